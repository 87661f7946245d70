"""Run PyTorch's own test files under plain eager, replay and fused, and tabulate what changes.

Usage (the test files are not part of this repository; see docs/pytorch_suites.md for where to get
them)::

    python tools/pytorch_suites.py --tests /path/to/pytorch/test --out docs/pytorch_suites.md

Each file runs three ways, each in fresh ``pytest`` processes on the CPU only:

- ``eager``: plain PyTorch, the reference;
- ``replay``: ``ADAPTIVE_EAGER=1 ADAPTIVE_EAGER_BACKEND=replay ADAPTIVE_EAGER_STEP_ASIDE=0``;
- ``fused``: ``ADAPTIVE_EAGER=1 ADAPTIVE_EAGER_HOT_AFTER=2 ADAPTIVE_EAGER_STEP_ASIDE=0
  ADAPTIVE_EAGER_COMPILE_ASYNC=0``.

A test "newly fails" in a mode when it passed in eager and failed, errored or crashed the process
in that mode. The table lists those per file with the first line of each error.

Note [Running a foreign test folder]
The test files come from an older PyTorch than the installed one, and their own conftest.py needs
pytest internals that moved. So each file (and its folder's package files) is copied into a fresh
temp folder, next to a conftest.py written here: it puts the original test folder on sys.path (for
helper imports such as ``optim.test_optim``), adds the few names the installed
``torch.testing._internal`` no longer has (COMPAT), and records every test's outcome as one JSON
line, flushed as it happens. A process that crashes or hangs therefore loses nothing already
recorded: the runner marks the test in progress as ``crash`` or ``timeout`` and starts a fresh
process that deselects every test already recorded, until the file's time budget is spent (what is
left is ``not run``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

MODES: dict[str, dict[str, str]] = {
    "eager": {},
    "replay": {"ADAPTIVE_EAGER": "1", "ADAPTIVE_EAGER_BACKEND": "replay",
               "ADAPTIVE_EAGER_STEP_ASIDE": "0"},
    "fused": {"ADAPTIVE_EAGER": "1", "ADAPTIVE_EAGER_HOT_AFTER": "2",
              "ADAPTIVE_EAGER_STEP_ASIDE": "0", "ADAPTIVE_EAGER_COMPILE_ASYNC": "0"},
}

# (file relative to the test folder, pytest -k expression or None). test_optim.py only re-exports
# the classes of optim/test_optim.py, optim/test_lrscheduler.py and optim/test_swa_utils.py, so the
# optimizer tests are named by their own file. The two big files run a subset that stays within a
# few minutes per mode on a 2-core machine.
DEFAULT_FILES: list[tuple[str, str | None]] = [
    ("optim/test_swa_utils.py", None),
    ("test_dlpack.py", None),
    ("test_numpy_interop.py", None),
    ("test_type_promotion.py", None),
    ("optim/test_lrscheduler.py", None),
    ("test_view_ops.py", None),
    ("test_indexing.py", None),
    ("optim/test_optim.py", None),
    ("test_autograd.py", "TestAutograd and not DeviceType and not Multithread and not Functional "
                         "and not ForwardMode and not Inference and not Complex "
                         "and not MultipleDispatch and (hook or view or inplace)"),
    ("test_nn.py", "TestNN and not DeviceType and (Linear or LayerNorm or Embedding)"),
]

FAILING = ("failed", "error", "crash")
RECORD_NAME = "outcomes.jsonl"
DESELECT_NAME = "deselect.txt"

# Names that PyTorch 2.1's tests import from torch.testing._internal and that later releases
# dropped or renamed: module -> {name: Python expression evaluated in that module}.
COMPAT: dict[str, dict[str, str]] = {
    "torch.testing._internal.common_utils": {
        "skipIfMps": "skipIfMPS",
        "_assertGradAndGradgradChecks": (
            "lambda test_case, apply_fn, inputs, **kw: ("
            "test_case.assertTrue(gradcheck(apply_fn, inputs, **kw)),"
            "test_case.assertTrue(gradgradcheck(apply_fn, inputs, **kw)))"),
    },
    "torch.testing._internal.common_cuda": {
        "tf32_is_not_fp32": "lambda: False",
    },
    "torch.testing._internal.common_nn": {
        "new_module_tests": "get_new_module_tests()",
    },
}

CONFTEST = '''\
"""Written by tools/pytorch_suites.py: compat names and a per-test outcome recorder."""
import importlib
import json
import os
import re
import sys
import time

import pytest

sys.path.append(os.environ["PYTORCH_SUITES_TESTS"])
for _mod, _names in %(compat)r.items():
    _m = importlib.import_module(_mod)
    for _name, _expr in _names.items():
        if not hasattr(_m, _name):
            setattr(_m, _name, eval(_expr, vars(_m)))

_HERE = os.path.dirname(os.path.abspath(__file__))
_RECORD = open(os.path.join(_HERE, %(record)r), "a", buffering=1)
_REPORTS = {}


def _emit(**kw):
    _RECORD.write(json.dumps(kw) + "\\n")
    _RECORD.flush()


def _message(report):
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    if isinstance(report.longrepr, tuple):  # skips: (path, line, reason)
        text = str(report.longrepr[2])
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


def pytest_collection_modifyitems(config, items):
    path = os.path.join(_HERE, %(deselect)r)
    if not os.path.exists(path):
        return
    with open(path) as f:
        skip = set(f.read().split("\\n"))
    keep = [item for item in items if item.nodeid not in skip]
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in skip])
    items[:] = keep


def pytest_runtest_logstart(nodeid, location):
    _REPORTS[nodeid] = ("passed", "")
    _emit(event="start", id=nodeid, t=time.time())


def pytest_runtest_logreport(report):
    outcome, message = _REPORTS.get(report.nodeid, ("passed", ""))
    if outcome in ("failed", "error"):
        return
    if hasattr(report, "wasxfail"):
        new = "xpassed" if report.passed else "xfailed"
    elif report.failed:
        new = "failed" if report.when == "call" else "error"
    elif report.skipped:
        new = "skipped"
    else:
        return
    if new in ("failed", "error") or outcome == "passed":
        _REPORTS[report.nodeid] = (new, _message(report))


def pytest_runtest_logfinish(nodeid, location):
    outcome, message = _REPORTS.pop(nodeid, ("passed", ""))
    _emit(event="end", id=nodeid, outcome=outcome, message=message, t=time.time())
'''


@dataclass
class Outcome:
    outcome: str
    message: str = ""


@dataclass
class ModeResult:
    """One file under one mode: test id -> outcome, plus how the processes ended."""

    tests: dict[str, Outcome] = field(default_factory=dict)
    seconds: float = 0.0
    processes: int = 0
    collect_error: str = ""

    def count(self, *outcomes: str) -> int:
        return sum(o.outcome in outcomes for o in self.tests.values())


def parse_record(lines: Iterable[str]) -> tuple[dict[str, Outcome], str | None]:
    """Outcomes from the recorder's JSON lines, and the id of a test started but never finished."""
    tests: dict[str, Outcome] = {}
    running: str | None = None
    for line in lines:
        try:
            ev = json.loads(line)
        except ValueError:  # a line cut short by a killed process
            continue
        if ev.get("event") == "start":
            running = ev["id"]
        elif ev.get("event") == "end":
            tests[ev["id"]] = Outcome(ev["outcome"], ev.get("message", ""))
            if running == ev["id"]:
                running = None
    return tests, running


def _last_start(path: Path, since: float) -> float | None:
    """When the test now running started (None when none is running in this process).

    since: when this process started; an unfinished start from a killed process is no test of
    this one's.
    """
    try:
        text = path.read_text()
    except OSError:
        return None
    started: float | None = None
    for line in text.splitlines()[-2:]:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        started = ev["t"] if ev.get("event") == "start" else None
    return started if started is not None and started >= since else None


def prepare_folder(tests: Path, rel: str, dest: Path) -> Path:
    """Copy one test file (and its package's __init__.py) into dest with the shim conftest."""
    src = tests / rel
    target = dest / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, target)
    init = src.parent / "__init__.py"
    if src.parent != tests and init.exists():
        shutil.copy2(init, target.parent / "__init__.py")
    (dest / "conftest.py").write_text(CONFTEST % {
        "compat": COMPAT, "record": RECORD_NAME, "deselect": DESELECT_NAME})
    return target


def mode_env(mode: str, scratch: Path, tests: Path) -> dict[str, str]:
    """The environment for one mode: engine switches, private caches, CPU only."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ADAPTIVE_EAGER", "TORCHINDUCTOR_CACHE_DIR"))}
    env.update(MODES[mode])
    env["ADAPTIVE_EAGER_CACHE_DIR"] = str(scratch / "ae-cache")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / "inductor-cache")
    env["PYTORCH_TESTING_DEVICE_ONLY_FOR"] = "cpu"
    env["PYTORCH_SUITES_TESTS"] = str(tests)
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _crash_line(output: str) -> str:
    """The line that says why a process died (a fatal signal, an abort) or its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if line.startswith(("Fatal Python error", "Segmentation fault", "terminate called")):
            return line[:200]
    return lines[-1][:200] if lines else "(no output)"


def _collect_error(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("E ") or "Error" in line]
    return lines[0].strip()[:300] if lines else (stdout.strip().splitlines() or [""])[-1][:300]


def run_mode(tests: Path, rel: str, kexpr: str | None, mode: str, budget: float,
             test_timeout: float, python: str = sys.executable) -> ModeResult:
    """Run one file under one mode until every test is recorded or the budget is spent."""
    result = ModeResult()
    with tempfile.TemporaryDirectory(prefix=f"pt-suite-{mode}-") as tmp:
        scratch = Path(tmp)
        work = scratch / "tests"
        target = prepare_folder(tests, rel, work)
        record, deselect = work / RECORD_NAME, work / DESELECT_NAME
        env = mode_env(mode, scratch, tests)
        cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN",
               "--rootdir", str(work), "-c", os.devnull, str(target.relative_to(work))]
        if kexpr:
            cmd[-1:-1] = ["-k", kexpr]
        start = time.monotonic()
        while True:
            left = budget - (time.monotonic() - start)
            if left <= 0:
                break
            done_before = len(result.tests)
            rc, out, hung = _run_watched(cmd, work, env, record, left, test_timeout)
            result.processes += 1
            tests_now, running = parse_record(record.read_text().splitlines()
                                              if record.exists() else [])
            result.tests.update(tests_now)
            if running is not None:
                reason = "timeout" if hung else "crash"
                if hung == "test":
                    why = f"killed after {test_timeout:.0f}s in this test"
                elif hung == "budget":
                    why = "the file's time budget ran out in this test"
                else:
                    why = f"process ended rc={rc}: {_crash_line(out)}"
                result.tests[running] = Outcome(reason, why)
                deselect.write_text("\n".join(result.tests))
                if hung == "budget":
                    break
                continue
            if rc not in (0, 1, 5) and len(result.tests) == done_before:
                result.collect_error = f"rc={rc}: {_collect_error(out)}"
            break
        result.seconds = time.monotonic() - start
    return result


def _run_watched(cmd: list[str], cwd: Path, env: dict[str, str], record: Path, budget: float,
                 test_timeout: float) -> tuple[int, str, str]:
    """Run pytest; kill it when one test runs past test_timeout or the budget is spent.

    Returns (exit status, output, "" or what was exceeded: "test" or "budget").
    """
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.monotonic() + budget
        since = time.time()
        hung = ""
        while proc.poll() is None:
            time.sleep(0.5)
            started = _last_start(record, since)
            if started is not None and time.time() - started > test_timeout:
                hung = "test"
            elif time.monotonic() > deadline:
                hung = "budget"
            if hung:
                _kill(proc)
                break
        rc = proc.wait()
        log.seek(0)
        return rc, log.read(), hung


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """End the pytest process and whatever it started (its own session)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def compare(eager: ModeResult, other: ModeResult) -> list[tuple[str, Outcome]]:
    """Tests that passed in eager and failed, errored or crashed in the other mode."""
    return sorted((tid, o) for tid, o in other.tests.items()
                  if o.outcome in FAILING and tid in eager.tests
                  and eager.tests[tid].outcome == "passed")


def not_run(eager: ModeResult, other: ModeResult) -> int:
    return sum(tid not in other.tests for tid in eager.tests)


def cluster_key(message: str) -> str:
    """A failure message with its numbers blanked, so that one cause reads as one line."""
    return re.sub(r"\d+", "N", message.split(" at 0x")[0])[:120]


def clusters(results: dict[str, dict[str, ModeResult]], modes: Sequence[str]) -> list[str]:
    """Rows of (count, mode, message, one example), most frequent first."""
    groups: dict[tuple[str, str], list[str]] = {}
    for by_mode in results.values():
        for m in modes:
            if m in by_mode:
                for tid, o in compare(by_mode["eager"], by_mode[m]):
                    groups.setdefault((m, cluster_key(o.message)), []).append(tid)
    rows = ["| tests | mode | error (numbers as N) | example |", "|---|---|---|---|"]
    for (m, key), tids in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        rows.append(f"| {len(tids)} | {m} | {_cell(key) or '(no message)'} | `{tids[0]}` |")
    return rows if groups else []


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(results: dict[str, dict[str, ModeResult]], selectors: dict[str, str | None],
           modes: Sequence[str] = ("replay", "fused")) -> str:
    """The markdown report: one summary row per file, then each newly failing test."""
    head = ["file", "-k", "eager: passed / tests"]
    head += [f"new failures: {m}" for m in modes]
    head += ["timeouts (" + "/".join(("eager", *modes)) + ")", "not run (" + "/".join(modes) + ")",
             "minutes (" + "/".join(("eager", *modes)) + ")"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    details: list[str] = []
    for rel, by_mode in results.items():
        eager = by_mode["eager"]
        k = selectors.get(rel)
        row = [f"`{rel}`", f"`{_cell(k)}`" if k else "all",
               f"{eager.count('passed')} / {len(eager.tests)}"]
        if eager.collect_error:
            row[-1] += f" (collection: {_cell(eager.collect_error)})"
        for m in modes:
            new = compare(eager, by_mode[m]) if m in by_mode else []
            row.append(str(len(new)) if m in by_mode else "-")
            if new:
                details.append(f"\n### `{rel}` under {m}: {len(new)} newly failing\n")
                details += [f"- `{tid}` ({o.outcome}): {_cell(o.message) or '(no message)'}"
                            for tid, o in new]
        row.append("/".join(str(by_mode[m].count("timeout")) if m in by_mode else "-"
                            for m in ("eager", *modes)))
        row.append("/".join(str(not_run(eager, by_mode[m])) if m in by_mode else "-"
                            for m in modes))
        row.append("/".join(f"{by_mode[m].seconds / 60:.1f}" if m in by_mode else "-"
                            for m in ("eager", *modes)))
        rows.append("| " + " | ".join(row) + " |")
    by_cause = clusters(results, modes)
    if by_cause:
        rows += ["", "### New failures by error", ""] + by_cause
    return "\n".join(rows) + "\n" + ("\n".join(details) + "\n" if details else "")


def to_json(results: dict[str, dict[str, ModeResult]]) -> dict[str, object]:
    return {rel: {m: {"seconds": r.seconds, "processes": r.processes,
                      "collect_error": r.collect_error,
                      "tests": {t: [o.outcome, o.message] for t, o in r.tests.items()}}
                  for m, r in by_mode.items()} for rel, by_mode in results.items()}


def from_json(data: dict[str, dict[str, dict]]) -> dict[str, dict[str, ModeResult]]:
    return {rel: {m: ModeResult({t: Outcome(*o) for t, o in r["tests"].items()}, r["seconds"],
                                r["processes"], r["collect_error"])
                  for m, r in by_mode.items()} for rel, by_mode in data.items()}


def _parse_files(specs: Sequence[str] | None) -> list[tuple[str, str | None]]:
    """FILE or FILE::KEXPR; a file named without -k keeps its default selector."""
    if not specs:
        return list(DEFAULT_FILES)
    defaults = dict(DEFAULT_FILES)
    out = []
    for spec in specs:
        rel, _, k = spec.partition("::")
        out.append((rel, k or defaults.get(rel)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests", type=Path, help="PyTorch's test/ folder")
    ap.add_argument("--files", nargs="*", metavar="FILE[::KEXPR]",
                    help="files relative to --tests, each optionally with a -k expression")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    ap.add_argument("--file-timeout", type=float, default=600.0,
                    help="seconds one file may take under one mode, restarts included")
    ap.add_argument("--test-timeout", type=float, default=120.0,
                    help="seconds one test may run before its process is killed")
    ap.add_argument("--json", type=Path, help="also write (and extend) raw outcomes here")
    ap.add_argument("--render", type=Path, nargs="+",
                    help="only render the table from --json files (later files win per file/mode)")
    ap.add_argument("--out", type=Path, help="write the markdown table here (default: stdout)")
    args = ap.parse_args(argv)

    files = _parse_files(args.files)
    selectors = dict(files)
    if args.render:
        results = {}
        for path in args.render:
            for rel, by_mode in from_json(json.loads(path.read_text())).items():
                results.setdefault(rel, {}).update(by_mode)
        selectors = {rel: selectors.get(rel, dict(DEFAULT_FILES).get(rel)) for rel in results}
    else:
        if args.tests is None:
            ap.error("--tests is required unless --render is given")
        modes = ["eager"] + [m for m in args.modes if m != "eager"]
        results = from_json(json.loads(args.json.read_text())) \
            if args.json and args.json.exists() else {}
        for rel, k in files:
            results[rel] = {}
            for mode in modes:
                r = run_mode(args.tests.resolve(), rel, k, mode, args.file_timeout,
                             args.test_timeout)
                results[rel][mode] = r
                print(f"{rel} [{mode}] {len(r.tests)} tests, {r.count('passed')} passed, "
                      f"{r.count(*FAILING)} failing, {r.count('timeout')} timeouts, "
                      f"{r.seconds:.0f}s {r.collect_error}", file=sys.stderr, flush=True)
                if args.json:
                    args.json.write_text(json.dumps(to_json(results), indent=1))
        selectors.update({rel: k for rel, k in DEFAULT_FILES if rel in results
                          and rel not in selectors})
    table = render(results, selectors)
    if args.out:
        args.out.write_text(table)
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
