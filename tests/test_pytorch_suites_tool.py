"""tools/pytorch_suites.py on a tiny synthetic test folder: outcomes, restarts, the table."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_TESTS = '''
import os
import time

import pytest

MODE = os.environ.get("FAKE_MODE")


def test_ok():
    pass


def test_fails_in_mode():
    assert not MODE, "boom | in mode"


def test_crashes_in_mode():
    if MODE:
        os._exit(3)


def test_hangs_in_mode():
    if MODE:
        time.sleep(120)


def test_skipped():
    pytest.skip("not here")


@pytest.fixture
def broken():
    if MODE:
        raise RuntimeError("setup broke")


def test_setup_error_in_mode(broken):
    pass


def test_after_all():
    pass
'''


@pytest.fixture
def tool(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    path = ROOT / "tools/pytorch_suites.py"
    spec = importlib.util.spec_from_file_location("pytorch_suites", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "pytorch_suites", mod)
    spec.loader.exec_module(mod)
    # No torch in the synthetic run: no compat names, and a "mode" that is one variable.
    monkeypatch.setattr(mod, "COMPAT", {})
    monkeypatch.setattr(mod, "MODES", {"eager": {}, "replay": {"FAKE_MODE": "1"}})
    return mod


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub/__init__.py").write_text("")
    (tmp_path / "sub/test_fake.py").write_text(textwrap.dedent(FAKE_TESTS))
    (tmp_path / "conftest.py").write_text("raise RuntimeError('the folder conftest is not used')\n")
    return tmp_path


def test_parse_record_keeps_finished_tests_and_names_the_running_one(tool: ModuleType) -> None:
    lines = ['{"event": "start", "id": "a", "t": 1}',
             '{"event": "end", "id": "a", "outcome": "passed", "message": "", "t": 2}',
             '{"event": "start", "id": "b", "t": 3}', '{"event": "end", "id"']
    tests, running = tool.parse_record(lines)
    assert {t: o.outcome for t, o in tests.items()} == {"a": "passed"}
    assert running == "b"


def test_run_eager_and_mode_then_compare_and_render(tool: ModuleType, folder: Path) -> None:
    rel = "sub/test_fake.py"
    eager = tool.run_mode(folder, rel, None, "eager", budget=120, test_timeout=60)
    mode = tool.run_mode(folder, rel, None, "replay", budget=120, test_timeout=8)
    ids = {t.split("::")[-1]: o for t, o in eager.tests.items()}
    assert ids["test_skipped"].outcome == "skipped"
    assert eager.count("passed") == 6 and len(eager.tests) == 7
    got = {t.split("::")[-1]: o for t, o in mode.tests.items()}
    assert got["test_fails_in_mode"].outcome == "failed"
    assert "boom" in got["test_fails_in_mode"].message
    assert got["test_crashes_in_mode"].outcome == "crash"
    assert "rc=3" in got["test_crashes_in_mode"].message
    assert got["test_hangs_in_mode"].outcome == "timeout"
    assert got["test_setup_error_in_mode"].outcome == "error"
    assert "setup broke" in got["test_setup_error_in_mode"].message
    # Restarts after the crash and the hang ran the rest, each test once.
    assert got["test_after_all"].outcome == "passed" and mode.processes == 3
    new = [t.split("::")[-1] for t, _ in tool.compare(eager, mode)]
    assert new == ["test_crashes_in_mode", "test_fails_in_mode", "test_setup_error_in_mode"]

    results = {rel: {"eager": eager, "replay": mode}}
    table = tool.render(results, {rel: "fake"}, modes=("replay",))
    row = next(line for line in table.splitlines() if line.startswith("| `sub/test_fake.py`"))
    assert row.split(" | ")[1:5] == ["`fake`", "6 / 7", "3", "0/1"]
    assert "boom \\| in mode" in table  # a pipe in a message does not break the table
    causes = table.split("### New failures by error")[1].split("###")[0]
    assert sum(line.startswith("| 1 | replay |") for line in causes.splitlines()) == 3
    assert tool.cluster_key("index 10 out of 10 at 0x7f00") == "index N out of N"
    again = tool.from_json(tool.to_json(results))
    assert tool.render(again, {rel: "fake"}, modes=("replay",)) == table


def test_budget_stops_restarts(tool: ModuleType, folder: Path) -> None:
    mode = tool.run_mode(folder, "sub/test_fake.py", "hangs or after_all", "replay", budget=15,
                         test_timeout=60)
    got = {t.split("::")[-1]: o.outcome for t, o in mode.tests.items()}
    assert got == {"test_hangs_in_mode": "timeout"}
    names = [*got, "test_after_all"]
    eager = tool.ModeResult({f"x::{n}": tool.Outcome("passed") for n in names})
    assert tool.not_run(eager, tool.ModeResult({f"x::{n}": tool.Outcome(o)
                                                for n, o in got.items()})) == 1
