"""The package's import graph: circles, and imports made inside functions.

    python tools/import_graph.py          # figures and the circles, module by module

A module that imports another (at its top, or inside a function, where a circle is usually
broken by hand) is an edge. Circles are the strongly connected components of the graph with
both kinds of edge: every module in one can reach every other. tests/test_import_graph.py holds
the figures to today's, so a change can only lower them (docs/design.md, "Import graph").
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "adaptive_eager"


@dataclass
class ImportGraph:
    top: dict[str, set[str]] = field(default_factory=dict)  # module -> modules it imports at top
    local: dict[str, set[str]] = field(default_factory=dict)  # ... inside a function or method

    def circles(self) -> list[list[str]]:
        """Strongly connected components of more than one module, largest first."""
        edges = {m: self.top[m] | self.local[m] for m in self.top}
        return sorted(_components(edges), key=len, reverse=True)

    def local_count(self) -> int:
        return sum(len(v) for v in self.local.values())


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _targets(node: ast.Import | ast.ImportFrom, here: str, is_pkg: bool,
             known: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    base = node.module or ""
    if node.level:
        parts = here.split(".") if is_pkg else here.split(".")[:-1]
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join([*parts, *([base] if base else [])])
    out = set()
    for a in node.names:
        full = f"{base}.{a.name}"
        if full in known:
            out.add(full)  # from package import module
        elif base in known:
            out.add(base)  # from module import name
    return out


def build(package: Path = PACKAGE) -> ImportGraph:
    known = module_names(package)
    graph = ImportGraph()
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        top: set[str] = set()
        local: set[str] = set()
        in_function = {id(n) for f in ast.walk(tree)
                       if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found = _targets(node, name, path.name == "__init__.py", known) - {name}
                (local if id(node) in in_function else top).update(found)
        graph.top[name], graph.local[name] = top, local
    return graph


def _components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def main() -> int:
    graph = build()
    circles = graph.circles()
    print(f"{len(graph.top)} modules; {sum(map(len, circles))} in {len(circles)} import circles; "
          f"{graph.local_count()} imports inside functions")
    for c in circles:
        print(f"circle of {len(c)}: {', '.join(c)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
