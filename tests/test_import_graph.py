"""The package's import graph may only get simpler (tools/import_graph.py).

The figures below are today's: an import circle that grows, or a new import hidden in a function
to break one, fails here; a change that removes some lowers the figure in the same commit.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

_TOOL = Path(__file__).resolve().parent.parent / "tools" / "import_graph.py"

MODULES_IN_CIRCLES = 25
IMPORTS_IN_FUNCTIONS = 52


@pytest.fixture(scope="module")
def import_graph() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_graph", _TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_import_circles_and_function_imports_do_not_grow(import_graph: ModuleType) -> None:
    graph = import_graph.build()
    in_circles = sum(map(len, graph.circles()))
    assert in_circles <= MODULES_IN_CIRCLES, graph.circles()
    assert graph.local_count() <= IMPORTS_IN_FUNCTIONS, {
        m: sorted(v) for m, v in graph.local.items() if v}


def test_the_checker_finds_circles_and_function_imports(import_graph: ModuleType,
                                                       tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("from .sub import c\n")
    (pkg / "sub" / "c.py").write_text("def f():\n    from pkg.a import x\n")
    (pkg / "d.py").write_text("import pkg.a\n")  # into the circle, not part of it
    graph = import_graph.build(pkg)
    assert graph.circles() == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    assert graph.local_count() == 1 and graph.local["pkg.sub.c"] == {"pkg.a"}


def test_every_hook_slot_is_filled_once_the_package_is_imported() -> None:
    """Note [hook slots]: the modules that fill them are imported by the package itself, so a
    lower module never finds a slot empty (a numpy view of a lazy tensor would then not flush)."""
    import torch

    import adaptive_eager  # noqa: F401
    from adaptive_eager.core import hooks

    names = ("flush_before_handoff", "spec_for", "engine_mode", "collectives")
    assert all(getattr(hooks, n) is not None for n in names), {
        n: getattr(hooks, n) for n in names}
    assert hooks.spec_for(torch.ops.aten.add.Tensor).name == "aten.add.Tensor"
