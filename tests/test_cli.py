"""The doors in: ADAPTIVE_EAGER=1 for unmodified scripts, the launchers, and the cache CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from adaptive_eager import cli, config

_TRAIN = textwrap.dedent("""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for step in range(6):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    print("loss", loss.item())
""")


def _env(cache_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTIVE_EAGER")}
    env.update({"ADAPTIVE_EAGER_CACHE_DIR": str(cache_dir), "ADAPTIVE_EAGER_BACKEND": "replay",
                "ADAPTIVE_EAGER_BUDGET": "0"})  # records from the first op (conftest.py)
    env.update(extra)
    return env


def _python(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _report(cache_dir: Path, *extra: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "adaptive_eager.cli", "report", "--json",
                           "--cache-dir", str(cache_dir), *extra], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_env_flag_runs_an_unmodified_script(tmp_path: Path, cache_dir: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    plain = _python([str(script)], _env(cache_dir), tmp_path)
    assert _report(cache_dir)["runs"] == []  # without the flag the engine never ran
    flagged = _python([str(script)], _env(cache_dir, ADAPTIVE_EAGER="1"), tmp_path)
    assert flagged.stdout == plain.stdout  # same loss, bit for bit (op-by-op backend)
    run = _report(cache_dir, "--last")["runs"][0]
    assert run["ops_deferred"] > 0 and run["trace_hits"] > 0
    assert run["flush_reasons"].get("optimizer_step", 0) >= 4


def test_flag_unset_does_not_import_the_package(tmp_path: Path, cache_dir: Path) -> None:
    code = "import sys, torch; print('adaptive_eager' in sys.modules)"
    out = _python(["-c", code], _env(cache_dir), tmp_path).stdout.strip()
    assert out == "False"


@pytest.mark.parametrize("launcher", [["-m", "adaptive_eager"],
                                      ["-m", "adaptive_eager.cli", "run"]])
def test_launchers_run_a_script_under_the_engine(tmp_path: Path, cache_dir: Path,
                                                launcher: list[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(_TRAIN + "import adaptive_eager as ae\nprint(ae.metrics()['ops_deferred'])\n")
    out = _python([*launcher, str(script)], _env(cache_dir), tmp_path).stdout.split()
    assert int(out[-1]) > 0


_VARYING = textwrap.dedent("""
    import sys, torch
    kind = sys.argv[1]
    ws = {d: torch.randn(16, 4, dtype=d) for d in (torch.float32, torch.float64)}
    xs = {d: torch.randn(7, 16, dtype=d) for d in (torch.float32, torch.float64)}
    for step in range(8):
        n = 8 if kind == "shape" and step >= 5 else 7
        x = torch.randn(n, 16)
        dtype = torch.float64 if kind == "dtype" and step >= 5 else torch.float32
        w = ws[dtype]
        if kind == "dtype":
            x = xs[dtype]
        shift = 1 if step < 5 else 2
        h = torch.tanh(x @ w)  # LINE-MM
        h = torch.roll(h, shift if kind == "scalar" else 1, 0)  # LINE-ROLL
        h.sum().item()
""")


def _line_of(marker: str) -> int:
    return next(i for i, line in enumerate(_VARYING.splitlines(), 1) if marker in line)


@pytest.mark.parametrize("kind,cause,line_marker", [
    ("shape", "shape", "LINE-MM"), ("dtype", "dtype", "LINE-MM"),
    ("scalar", "scalar", "LINE-ROLL")])
def test_report_names_the_cause_of_a_miss(tmp_path: Path, cache_dir: Path, kind: str,
                                          cause: str, line_marker: str) -> None:
    script = tmp_path / "vary.py"
    script.write_text(_VARYING)
    _python([str(script), kind], _env(cache_dir, ADAPTIVE_EAGER="1"), tmp_path)
    misses = _report(cache_dir, "--last")["runs"][0]["miss_causes"]
    found = [m for m in misses if m["cause"] == cause]
    assert found, misses
    m = found[0]
    assert m["where"].startswith(f"{script}:{_line_of(line_marker)} ")
    if cause == "shape":
        assert m["op"] == "aten.mm.default" and m["dim"] == 0 and {m["old"], m["new"]} == {7, 8}
        assert "dim 0" in m["advice"] and "pad" in m["advice"]
    if cause == "dtype":
        assert {m["old"], m["new"]} == {"torch.float32", "torch.float64"}
    if cause == "scalar":
        assert m["op"] == "aten.roll.default" and {m["old"], m["new"]} == {"1", "2"}


def test_human_report_and_explain(tmp_path: Path, cache_dir: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "vary.py"
    script.write_text(_VARYING)
    _python([str(script), "shape"], _env(cache_dir, ADAPTIVE_EAGER="1"), tmp_path)
    assert cli.main(["report", "--cache-dir", str(cache_dir)]) == 0
    text = capsys.readouterr().out
    assert "misses by cause" in text and "advice: dim 0" in text
    trace = _report(cache_dir)["runs"][0]["traces"][0]["trace"]
    assert cli.main(["explain", trace[:10], "--cache-dir", str(cache_dir)]) == 0
    text = capsys.readouterr().out
    assert trace in text and "aten." in text and str(script) in text


def test_report_of_a_single_process_run_has_no_job(tmp_path: Path, cache_dir: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A run outside a distributed job records no job; ``--job`` then finds none (exit 2)."""
    script = tmp_path / "vary.py"
    script.write_text(_VARYING)
    _python([str(script), "shape"], _env(cache_dir, ADAPTIVE_EAGER="1"), tmp_path)
    rep = _report(cache_dir)
    assert rep["jobs"] == [] and rep["runs"][0]["dist"] is None
    assert cli.main(["report", "--cache-dir", str(cache_dir), "--job", "last"]) == 2
    assert "no distributed job 'last'" in capsys.readouterr().err


def test_cache_ls_export_import_clear_prune(tmp_path: Path, cache_dir: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from adaptive_eager.cache.disk import DiskCache

    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None
    disk.put_program("abc", "2.13.0", "inductor", b"x" * 100_000, {"n_ops": 3})
    disk.put_stats("abc", {"hot": True})
    disk.close()
    assert cli.main(["cache", "ls", "--cache-dir", str(cache_dir)]) == 0
    assert "1 program" in capsys.readouterr().out
    bundle = tmp_path / "warm.tar.gz"
    assert cli.main(["export", str(bundle), "--cache-dir", str(cache_dir)]) == 0
    other = tmp_path / "other"
    assert cli.main(["import", str(bundle), "--cache-dir", str(other)]) == 0
    copy = DiskCache.open(other, 1 << 30)
    assert copy is not None and copy.get_program("abc", "2.13.0")["artifact"] == b"x" * 100_000
    copy.close()
    assert cli.main(["cache", "prune", "--max-size", "1K", "--cache-dir", str(other)]) == 0
    assert cli.main(["cache", "clear", "--cache-dir", str(cache_dir)]) == 0
    capsys.readouterr()
    assert cli.main(["cache", "ls", "--cache-dir", str(cache_dir)]) == 0
    assert "program" not in capsys.readouterr().out


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(config.ConfigError, match="ADAPTIVE_EAGER_HOT_AFTER='soon'.*positive"):
        config.resolve(environ={"ADAPTIVE_EAGER_HOT_AFTER": "soon"})
    with pytest.raises(config.ConfigError, match="ADAPTIVE_EAGER_CROSSCHECK='maybe'"):
        config.resolve(environ={"ADAPTIVE_EAGER_CROSSCHECK": "maybe"})
    with pytest.raises(config.ConfigError, match="ADAPTIVE_EAGER_LOG_LEVEL"):
        config.resolve(environ={"ADAPTIVE_EAGER_LOG_LEVEL": "LOUD"})
    with pytest.raises(TypeError, match="unknown option 'hot_afer'.*hot_after"):
        config.resolve({"hot_afer": 2})
    assert cli.parse_size("500M") == 500 << 20 and cli.parse_size("2G") == 2 << 30


def test_every_variable_is_documented_in_the_readme() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for setting in config.SETTINGS:
        assert setting.env in readme, setting.env
    assert config.ENABLE_ENV in readme


_CALIBRATED = textwrap.dedent("""
    import torch
    x = torch.ones(3)
    for i in range(3):
        y = (x * 2 + 1).sum()
    print(y.item())
""")


def test_calibration_traces_are_not_the_users_misses(tmp_path: Path, cache_dir: Path) -> None:
    # step_aside on (the default) makes the engine calibrate itself at start, under the engine
    script = tmp_path / "tiny.py"
    script.write_text(_CALIBRATED)
    proc = _python([str(script)], _env(cache_dir, ADAPTIVE_EAGER="1", ADAPTIVE_EAGER_STEP_ASIDE="1",
                                       ADAPTIVE_EAGER_LOG_LEVEL="INFO"), tmp_path)
    assert "trace miss" in proc.stderr and "autoload" not in proc.stderr, proc.stderr
    run = _report(cache_dir, "--last")["runs"][0]
    # one trace, seen for the first time once: before the fix the report said "1 misses" but
    # "3x at an op or shape seen for the first time", two of them at adaptive_eager_autoload.py
    assert run["trace_misses"] == 1 and run["first_sight_misses"] == 1, run
    log = next((cache_dir / "runs").glob("*.jsonl")).read_text().splitlines()
    wheres = {json.loads(line).get("where") for line in log} - {None}
    assert wheres == {f"{script}:3 (<module>)"}, wheres


def test_the_whole_command_line_is_logged_bounded(tmp_path: Path, cache_dir: Path) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(_CALIBRATED)
    args = [f"--arg{i}=v{i}" for i in range(12)]
    _python([str(script), *args], _env(cache_dir, ADAPTIVE_EAGER="1"), tmp_path)
    assert _report(cache_dir, "--last")["runs"][0]["argv"] == [str(script), *args]
    from adaptive_eager.events import MAX_ARGV_CHARS, bounded_argv

    long = bounded_argv(["train.py", "x" * 5000, "never"])
    assert long[0] == "train.py" and long[1].endswith("...") and len(long) == 2
    assert sum(len(a) for a in long) <= MAX_ARGV_CHARS + 3


@pytest.mark.parametrize("command", ["report", "explain"])
def test_report_and_explain_into_a_closed_pipe_exit_quietly(tmp_path: Path, cache_dir: Path,
                                                            command: str) -> None:
    script = tmp_path / "vary.py"
    script.write_text(_VARYING)
    _python([str(script), "shape"], _env(cache_dir, ADAPTIVE_EAGER="1"), tmp_path)
    args = ["report"] if command == "report" else [
        "explain", _report(cache_dir)["runs"][0]["traces"][0]["trace"][:10]]
    # as `adaptive-eager report | head -1` when head has already left: the reader end is closed
    # before the command writes anything, so its first write meets a broken pipe
    proc = subprocess.Popen([sys.executable, "-m", "adaptive_eager.cli", *args, "--cache-dir",
                             str(cache_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 141)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    # and with a real `head -1` reading the first line
    shell = subprocess.run(f"{sys.executable} -m adaptive_eager.cli {' '.join(args)} "
                           f"--cache-dir {cache_dir} | head -1", shell=True, capture_output=True,
                           text=True, timeout=120)
    assert shell.stdout.strip() and "Traceback" not in shell.stderr, shell.stderr


def test_cache_clear_removes_the_run_logs_but_nothing_else(tmp_path: Path, cache_dir: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(_CALIBRATED)
    for _ in range(2):
        _python([str(script)], _env(cache_dir, ADAPTIVE_EAGER="1"), tmp_path)
    runs = cache_dir / "runs"
    assert len(_report(cache_dir)["runs"]) == 2
    keep = runs / "notes.txt"  # not a name the engine makes
    keep.write_text("mine")
    outside = tmp_path / "outside.jsonl"
    outside.write_text("{}")
    link = runs / "20990101-000000-abcdef.jsonl"  # a run-log name, but a link: never followed
    link.symlink_to(outside)
    assert cli.main(["cache", "clear", "--cache-dir", str(cache_dir)]) == 0
    assert "and 2 run logs" in capsys.readouterr().out
    assert _report(cache_dir)["runs"] == []
    assert keep.read_text() == "mine" and outside.read_text() == "{}" and link.is_symlink()
