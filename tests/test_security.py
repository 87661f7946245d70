"""The cache folder is a trust boundary: one test per finding, tried as an attacker.

Planted pickles write a marker file when unpickled: the marker must never appear, and results stay
those of plain eager. Cases with another local user run as root, with a throwaway user this file
creates (``useradd``) owning the planted files; elsewhere they skip. Findings 6 (exit) and 7
(decisions) belong to the compiler; only the helper's quiet exit is tested here.
"""

from __future__ import annotations

import logging
import os
import pickle
import pwd
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import config
from adaptive_eager.cache.disk import DiskCache

OTHER_USER = "ae-attacker"
TORCH = torch.__version__


# ---- helpers -----------------------------------------------------------------------------------
class Planted:
    """Unpickling this runs code: it writes the marker."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def planted_pickle(marker: Path) -> bytes:
    return pickle.dumps(Planted(marker))


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    path = tmp_path / "MARKER"
    yield path
    assert not path.exists(), "a planted pickle ran"


@pytest.fixture(scope="session")
def other_user() -> tuple[int, int]:
    """uid and gid of a second local user (created when missing; needs root)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root to create and use a second local user")
    try:
        pw = pwd.getpwnam(OTHER_USER)
    except KeyError:
        if shutil.which("useradd") is None:
            pytest.skip("no useradd to create a second local user")
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", OTHER_USER], check=True,
                       capture_output=True)
        pw = pwd.getpwnam(OTHER_USER)
    return pw.pw_uid, pw.pw_gid


def chown_tree(path: Path, owner: tuple[int, int]) -> None:
    os.chown(path, *owner, follow_symlinks=False)
    if path.is_dir() and not path.is_symlink():
        for p in path.rglob("*"):
            os.chown(p, *owner, follow_symlinks=False)


def as_other_user(owner: tuple[int, int], args: list[str], **kw: Any) -> subprocess.CompletedProcess:
    """Run ``python args`` as the second user, able to read (not write) root's files such as
    the interpreter under /root: a real user of a folder they cannot write."""
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv to run as the second user")
    cmd = ["setpriv", f"--reuid={owner[0]}", f"--regid={owner[1]}", "--clear-groups",
           "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
           sys.executable, *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTIVE_EAGER")}
    env["HOME"] = "/nonexistent"
    env["ADAPTIVE_EAGER_BUDGET"] = "0"  # records from the first op (conftest.py)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, **kw)


def plant(disk: Any, key: str, blob: bytes, obj: Any) -> None:
    """Put a value into the store as someone with write access to its database would: the
    bytes as they are (this store), or the object itself (a store that pickles values)."""
    if hasattr(disk, "raw_set"):
        disk.raw_set(key, blob)
    else:
        disk.raw().set(key, obj)


def legacy_cache(folder: Path, values: dict[str, Any]) -> Path:
    """A cache in the earlier diskcache format (pickled values in ``xx/yy/*.val`` files)."""
    import diskcache

    c = diskcache.Cache(str(folder), disk_min_file_size=0)
    for k, v in values.items():
        c.set(k, v)
    c.close()
    os.chmod(folder, 0o700)
    return folder / "cache.db"


def value_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.val"))


def chain(x: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x * 1.5 + 0.25) * x - 0.5).sum(0)


def run_loop(x: torch.Tensor, steps: int = 5, **options: Any) -> dict:
    ref = chain(x)
    with ae.adaptive_eager(hot_after=2, compile_async=False, **options):
        for _ in range(steps):
            torch.testing.assert_close(chain(x), ref, rtol=1e-5, atol=1e-6)
    return ae.metrics()


def fresh_process() -> None:
    ae.clear_caches()
    ae.reset_metrics()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ADAPTIVE_EAGER") and k != "TORCHINDUCTOR_CACHE_DIR"}
    env["ADAPTIVE_EAGER_BUDGET"] = "0"  # records from the first op (conftest.py)
    env.update(extra)
    return env


# ---- 1: Inductor's kernels live in the private cache folder -------------------------------------
_KERNELS = textwrap.dedent("""
    import os, sys, torch
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # imports torch._dynamo
    import adaptive_eager as ae
    x = torch.randn(16, 16)
    ref = (torch.tanh(x * 1.5) + x).sum(0)
    with ae.adaptive_eager(hot_after=2, compile_async=False, cache_dir=sys.argv[1]):
        for _ in range(5):
            torch.testing.assert_close((torch.tanh(x * 1.5) + x).sum(0), ref)
    m = ae.metrics()
    assert m["compiles"] >= 1 and m["compiled_runs"] >= 1, m
    print(os.environ["TORCHINDUCTOR_CACHE_DIR"])
""")


@pytest.mark.slow  # a cold compile in a fresh kernel folder: a minute or two on 2 busy cores
def test_inductor_kernels_live_in_the_private_cache_folder(tmp_path: Path, cache_dir: Path,
                                                           other_user: tuple[int, int]) -> None:
    """Finding 1: an optimizer imports torch._dynamo first (the variable then holds torch's
    shared default), and another user created that default folder first, 0777."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o1777)
    os.chmod(tmp, 0o1777)
    shared = tmp / f"torchinductor_{pwd.getpwuid(os.getuid()).pw_name}"
    shared.mkdir()
    os.chmod(shared, 0o777)
    chown_tree(shared, other_user)
    script = tmp_path / "kernels.py"
    script.write_text(_KERNELS)
    proc = subprocess.run([sys.executable, str(script), str(cache_dir)], capture_output=True,
                          text=True, timeout=600, env=_env(TMPDIR=str(tmp)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernels = cache_dir / "inductor"
    assert proc.stdout.strip().splitlines()[-1] == str(kernels)
    assert any(p.suffix in (".so", ".py", ".cpp") for p in kernels.rglob("*")), "no kernels"
    assert list(shared.iterdir()) == [], "kernels went to the shared folder"


def test_torchs_default_written_back_is_not_the_users_choice(
        cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 1, quick form: ``import torch._dynamo`` wrote torch's shared default into the
    variable; the engine's own folder is used all the same."""
    import torch._dynamo  # noqa: F401  (what creating an optimizer does)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from adaptive_eager.backends import inductor

    monkeypatch.setattr(inductor, "_kernel_dir", None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None
    inductor.InductorBackend().prepare(str(disk.directory))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(disk.directory / "inductor")
    from adaptive_eager.compile_process import _flags

    assert _flags()["inductor_cache"] == str(disk.directory / "inductor")  # the helper's too
    disk.close()


def test_torchinductor_cache_dir_is_used_only_if_trusted(tmp_path: Path, cache_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    import torch._inductor.codecache as codecache

    from adaptive_eager.backends import inductor
    from adaptive_eager.backends.inductor import InductorBackend

    monkeypatch.setattr(inductor, "_kernel_dir", None)  # this process's choice: restored after
    monkeypatch.setattr(codecache, "_HEADER_DIR", codecache._HEADER_DIR)
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", codecache._HEADER_LOCK_DIR)
    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None
    backend = InductorBackend()
    mine = tmp_path / "my-kernels"
    mine.mkdir(mode=0o700)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(mine))
    backend.prepare(str(disk.directory))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(mine)  # the user's choice, trusted
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(loose))
    with caplog.at_level(logging.WARNING, logger="adaptive_eager"):
        backend.prepare(str(disk.directory))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(disk.directory / "inductor")
    assert any("not using TORCHINDUCTOR_CACHE_DIR" in r.message for r in caplog.records)
    assert codecache._HEADER_DIR.startswith(str(disk.directory / "inductor"))
    disk.close()


def test_planted_kernel_folder_is_removed_unread(cache_dir: Path, marker: Path,
                                                 other_user: tuple[int, int]) -> None:
    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None
    disk.close()
    planted = cache_dir / "inductor" / "ab"
    planted.mkdir(parents=True)
    (planted / "kernel.py").write_text(f"open({str(marker)!r}, 'w')\n")
    chown_tree(planted, other_user)
    loose = cache_dir / "inductor" / "cd"
    loose.mkdir()
    os.chmod(loose, 0o777)
    ae.reset_metrics()
    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None
    assert not planted.exists() and not loose.exists()
    assert ae.metrics()["disk_errors"] >= 1
    disk.close()


# ---- 2 and the helper half of 6: the compile helper starts isolated, exits quietly -------------
def test_helper_never_imports_modules_planted_in_the_working_folder(
        tmp_path: Path, marker: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from adaptive_eager.compile_process import CompileProcess

    cwd = tmp_path / "shared-cwd"
    cwd.mkdir()
    os.chmod(cwd, 0o777)
    for name in ("typing_extensions", "sitecustomize", "usercustomize", "numpy"):
        (cwd / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').write('{name}')\n")
    monkeypatch.chdir(cwd)
    proc = CompileProcess()._ensure()
    assert proc.stdin is not None
    proc.stdin.close()  # the helper imports torch and the package, reads EOF, exits
    assert proc.wait(timeout=300) == 0


def test_compile_service_never_imports_modules_planted_in_the_working_folder(
        tmp_path: Path, cache_dir: Path, marker: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The service (Note [compile service]) and its helpers start ``python -I`` in ``/``."""
    from adaptive_eager import service

    cwd = tmp_path / "shared-cwd"
    cwd.mkdir()
    os.chmod(cwd, 0o777)
    for name in ("typing_extensions", "sitecustomize", "usercustomize", "numpy", "json",
                 "xxhash"):
        (cwd / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').write('{name}')\n")
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("PYTHONPATH", str(cwd))
    service.connect(cache_dir).close()
    log = cache_dir / "service" / "log"
    deadline = time.monotonic() + 300  # the helper imports torch and Inductor, then warms up
    while "warmed up" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "warmed up" in log.read_text() and "(ok" in log.read_text(), log.read_text()
    assert not marker.exists(), marker.read_text()


_ORPHAN = textwrap.dedent("""
    import os, signal, sys, time, torch
    import adaptive_eager as ae
    from adaptive_eager.compile_process import HELPER
    from adaptive_eager.metrics import METRICS
    x = torch.randn(32, 32)
    # the per-process helper (the shared compile service outlives its programs by design)
    with ae.adaptive_eager(hot_after=2, compile_async=True, cache_dir=sys.argv[1],
                           compile_service=False):
        for _ in range(4):
            ((x * 1.5).tanh() + x).sum().tolist()
        deadline = time.time() + 120
        while (HELPER._proc is None or METRICS.compiles_pending == 0) and time.time() < deadline:
            time.sleep(0.05)
        print(HELPER._proc.pid, flush=True)
        kernels = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        while not any(files for _, _, files in os.walk(kernels)) and time.time() < deadline:
            time.sleep(0.05)  # until the helper is writing kernels: mid-compile
        os.kill(os.getpid(), signal.SIGKILL)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def test_orphaned_helper_exits_quietly(tmp_path: Path, cache_dir: Path) -> None:
    """Helper half of finding 6: the parent is killed while the helper compiles."""
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc to watch the helper")
    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN)
    err_path = tmp_path / "stderr.txt"
    kernels = tmp_path / "kernels"  # watched: files appear there once the helper compiles
    kernels.mkdir(mode=0o700)
    with open(err_path, "w") as err_file:  # shared with the helper (and its compile workers)
        proc = subprocess.run([sys.executable, str(script), str(cache_dir)],
                              stdout=subprocess.PIPE, stderr=err_file, text=True,
                              env=_env(TORCHINDUCTOR_CACHE_DIR=str(kernels)), cwd=tmp_path,
                              timeout=300)
    assert proc.returncode == -signal.SIGKILL, err_path.read_text()[-3000:]
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 300  # hang detection only: a compile takes far less
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the orphaned helper kept running"
    time.sleep(0.5)
    err = err_path.read_text()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-3000:]


# ---- 3: every folder and file on the way is checked, links are never followed -------------------
def test_symlinked_value_subfolder_is_never_followed(tmp_path: Path, cache_dir: Path,
                                                     marker: Path,
                                                     other_user: tuple[int, int]) -> None:
    cache_dir.mkdir(parents=True, mode=0o700)
    legacy_cache(cache_dir, {"stats:d": {"hot": True}})
    (val,) = value_files(cache_dir)
    evil = tmp_path / "evil"
    sub = val.parent.relative_to(cache_dir)  # xx/yy
    (evil / sub.parts[1]).mkdir(parents=True)
    (evil / sub.parts[1] / val.name).write_bytes(planted_pickle(marker))
    chown_tree(evil, other_user)
    shutil.rmtree(cache_dir / sub.parts[0])
    os.symlink(evil, cache_dir / sub.parts[0])  # the value subfolder is the attacker's
    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None
    assert disk.get_stats("d") is None
    disk.close()
    assert (evil / sub.parts[1] / val.name).exists()  # never deleted through the link either


def test_loose_subfolder_of_a_readable_cache_is_refused(cache_dir: Path, marker: Path,
                                                        other_user: tuple[int, int]) -> None:
    """A 0755 cache folder with one 0777 subfolder in which another user replaced a value."""
    cache_dir.mkdir(parents=True)
    legacy_cache(cache_dir, {"stats:d": {"hot": True}})
    os.chmod(cache_dir, 0o755)
    (val,) = value_files(cache_dir)
    os.chmod(val.parent, 0o777)
    val.unlink()
    val.write_bytes(planted_pickle(marker))
    os.chown(val, *other_user)
    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None and disk.get_stats("d") is None
    disk.close()


@pytest.mark.parametrize("name", ["secret", "cache.sqlite", "runs", "inductor"])
def test_links_inside_the_cache_folder_are_refused(tmp_path: Path, cache_dir: Path,
                                                   name: str, other_user: tuple[int, int]) -> None:
    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None
    disk.put_stats("d", {"hot": True})
    disk.close()
    target = tmp_path / f"attacker-{name}"
    if name in ("runs", "inductor"):
        target.mkdir()
        (target / "20250101-000000-abcdef.jsonl").write_text('{"type": "run"}\n')
    else:
        target.write_bytes(os.urandom(32))
    chown_tree(target, other_user)
    trust_before = target.stat().st_mtime
    victim = cache_dir / name
    if victim.is_dir():
        shutil.rmtree(victim)
    elif victim.exists():
        victim.unlink()
    os.symlink(target, victim)
    ae.reset_metrics()
    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None
    assert disk.get_stats("d") in (None, {"hot": True})  # the db itself: rebuilt if refused
    disk.put_stats("e", {"hot": False})
    assert disk.get_stats("e") == {"hot": False}
    disk.close()
    from adaptive_eager.events import RUN_LOG, read_runs

    RUN_LOG.write(cache_dir, [], {})
    read_runs(cache_dir)
    assert ae.metrics()["disk_errors"] >= 1
    assert target.exists() and target.stat().st_mtime == trust_before  # never written
    if target.is_dir():
        assert [p.name for p in target.iterdir()] == ["20250101-000000-abcdef.jsonl"]


def test_cache_folder_below_another_users_folder_is_refused(tmp_path: Path,
                                                            other_user: tuple[int, int]) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chmod(theirs, 0o755)
    os.chown(theirs, *other_user)
    assert DiskCache.open(theirs / "cache", 1 << 30) is None  # they could swap it any time


# ---- 4: names come from the engine, never from the database --------------------------------------
def test_filename_column_is_never_trusted(tmp_path: Path, cache_dir: Path, marker: Path) -> None:
    cache_dir.mkdir(parents=True, mode=0o700)
    db = legacy_cache(cache_dir, {"stats:d": {"hot": True}, "program:k": b"x" * 10})
    outside = tmp_path / "outside.pickle"
    outside.write_bytes(planted_pickle(marker))
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    victim = victim_dir / "thesis.txt"
    victim.write_text("years of work")
    with sqlite3.connect(db) as conn:  # absolute names: one to read, one to delete
        conn.execute("UPDATE Cache SET filename = ?, value = NULL WHERE key = 'stats:d'",
                     (str(outside),))
        conn.execute("UPDATE Cache SET filename = ?, value = NULL, mode = 2 "
                     "WHERE key = 'program:k'", (str(victim),))
    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None
    assert disk.get_stats("d") is None
    assert disk.get_program("k", TORCH) is None
    disk.close()
    assert victim.read_text() == "years of work" and outside.exists()


def test_run_log_pruning_never_follows_links(tmp_path: Path, cache_dir: Path) -> None:
    from adaptive_eager.events import KEEP_RUNS, RUN_LOG

    outside = tmp_path / "outside"
    outside.mkdir()
    names = [f"2025010{i % 9 + 1}-0000{i:02d}-abcdef.jsonl" for i in range(KEEP_RUNS + 11)]
    for n in names:
        (outside / n).write_text('{"type": "run"}\n')
    cache_dir.mkdir(parents=True, mode=0o700)
    os.symlink(outside, cache_dir / "runs")
    RUN_LOG.write(cache_dir, [], {})
    assert sorted(p.name for p in outside.iterdir()) == sorted(names)
    # A real runs folder whose old files are links to the user's files: the links are not runs.
    os.unlink(cache_dir / "runs")
    (cache_dir / "runs").mkdir(mode=0o700)
    for n in names:
        os.symlink(outside / n, cache_dir / "runs" / n)
    RUN_LOG.write(cache_dir, [], {})
    assert sorted(p.name for p in outside.iterdir()) == sorted(names)


# ---- 5: nothing is unpickled, and every value is verified first ---------------------------------
@pytest.mark.parametrize("kind", ["program:k", "stats:d", "quarantine:d"])
def test_planted_pickle_in_a_value_never_runs(cache_dir: Path, marker: Path, kind: str) -> None:
    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None
    plant(disk, kind, planted_pickle(marker), Planted(marker))
    ae.reset_metrics()
    assert disk.get_program("k", TORCH) is None
    assert disk.get_stats("d") is None
    assert not disk.is_quarantined("d")
    assert ae.metrics()["disk_errors"] >= 1
    disk.close()


def test_entry_written_without_the_secret_is_refused(tmp_path: Path, cache_dir: Path,
                                                      marker: Path) -> None:
    """A complete, well-formed entry with a matching checksum, made by someone who can write
    the database but does not know this cache's key."""
    theirs = tmp_path / "theirs"
    a = DiskCache.open(theirs, 1 << 30)
    assert a is not None
    a.put_program("k", TORCH, "inductor", planted_pickle(marker), {"n_ops": 1})
    a.put_stats("d", {"hot": True, "decision": "keep fused"})
    a.close()
    b = DiskCache.open(cache_dir, 1 << 30)  # has its own key
    assert b is not None
    b.close()
    for p in theirs.iterdir():
        if p.is_file() and p.name != "secret":
            shutil.copy(p, cache_dir / p.name)
    ae.reset_metrics()
    b = DiskCache.open(cache_dir, 1 << 30)
    assert b is not None
    assert b.get_program("k", TORCH) is None and b.get_stats("d") is None
    assert ae.metrics()["disk_errors"] >= 1
    b.close()


@pytest.mark.slow  # two small compiles: ~1 min on 2 busy cores (the store-level tests are quick)
def test_engine_over_a_planted_cache_gives_eager_results(cache_dir: Path, marker: Path) -> None:
    x = torch.randn(24, 10)
    run_loop(x, cache_dir=cache_dir, compile_process=False)
    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None
    keys = disk.keys()
    assert any(k.startswith("program:") for k in keys) and any(k.startswith("stats:")
                                                                for k in keys)
    for k in keys:
        plant(disk, k, planted_pickle(marker), Planted(marker))
    disk.close()
    fresh_process()
    m = run_loop(x, cache_dir=cache_dir, compile_process=False)  # compared with eager
    assert m["disk_errors"] >= 1 and m["disk_hits"] == 0 and m["fused_errors"] == 0


def test_cache_ls_reads_metadata_only(cache_dir: Path, marker: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    from adaptive_eager import cli

    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None
    plant(disk, "program:" + "a" * 32, planted_pickle(marker), Planted(marker))
    disk.put_program("b" * 32, TORCH, "inductor", planted_pickle(marker), {"n_ops": 2})
    disk.close()
    assert cli.main(["cache", "ls", "--cache-dir", str(cache_dir)]) == 0
    out = capsys.readouterr().out
    assert "ops=2" in out


def test_old_format_entries_are_skipped_and_counted(cache_dir: Path) -> None:
    cache_dir.mkdir(parents=True, mode=0o700)
    legacy_cache(cache_dir, {"stats:d": {"hot": True}, "quarantine:d": {"reason": "x"}})
    ae.reset_metrics()
    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None
    assert disk.get_stats("d") is None and not disk.is_quarantined("d")
    assert ae.metrics()["disk_errors"] >= 1
    disk.close()


def test_cache_secret_is_private(cache_dir: Path) -> None:
    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None
    disk.put_stats("d", {"hot": True})
    disk.close()
    secret = cache_dir / "secret"
    assert stat.S_IMODE(secret.lstat().st_mode) == 0o600 and secret.lstat().st_size == 32
    os.chmod(secret, 0o644)  # others may have read it: a new key, old values refused
    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None and disk.get_stats("d") is None
    assert stat.S_IMODE(secret.lstat().st_mode) == 0o600
    disk.close()


# ---- 8: a bad setting under ADAPTIVE_EAGER=1 stops the program with one clear line --------------
@pytest.mark.parametrize("var,value", [
    ("ADAPTIVE_EAGER", "maybe"),
    ("ADAPTIVE_EAGER_HOT_AFTER", "soon"),
    ("ADAPTIVE_EAGER_CACHE_SIZE_MB", "9999999999999"),
    ("ADAPTIVE_EAGER_CHECK", "perhaps"),
    ("ADAPTIVE_EAGER_BACKEND", "no-such-backend"),
])
def test_bad_setting_under_the_flag_stops_with_one_line(tmp_path: Path, cache_dir: Path,
                                                        var: str, value: str) -> None:
    env = _env(ADAPTIVE_EAGER="1", ADAPTIVE_EAGER_CACHE_DIR=str(cache_dir),
               ADAPTIVE_EAGER_BACKEND="replay")
    env[var] = value
    proc = subprocess.run([sys.executable, "-c", "import torch; print('started')"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and "started" not in proc.stdout, proc.stderr[-3000:]
    assert lines and var in lines[-1], proc.stderr[-3000:]
    assert "expected" in lines[-1] or "available" in lines[-1], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name,bad", [
    ("cache_size_mb", 0), ("cache_size_mb", 9999999999999), ("max_trace_ops", 0),
    ("max_trace_ops", 10**12), ("hot_after", 0), ("hot_after", 10**12), ("probe_every", -1),
    ("probe_every", 10**15),
])
def test_numeric_options_are_bounded(name: str, bad: int) -> None:
    setting = next(s for s in config.SETTINGS if s.name == name)
    with pytest.raises(config.ConfigError, match=setting.env):
        config.resolve(environ={setting.env: str(bad)})
    with pytest.raises(config.ConfigError, match=name):
        config.resolve({name: bad}, environ={})


# ---- 9: the size limit covers the whole folder; damage is repaired; read-only serves reads ------
def folder_bytes(folder: Path) -> int:
    return sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def test_size_limit_covers_kernels_and_is_enforced(cache_dir: Path) -> None:
    limit = 2 << 20
    disk = DiskCache.open(cache_dir, limit)
    assert disk is not None
    disk.close()
    old_kernels = cache_dir / "inductor" / "zz"
    old_kernels.mkdir(parents=True)
    (old_kernels / "kernel.so").write_bytes(os.urandom(1 << 20))
    os.utime(old_kernels / "kernel.so", (1, 1))
    os.utime(old_kernels, (1, 1))
    disk = DiskCache.open(cache_dir, limit)
    assert disk is not None
    for i in range(8):
        disk.put_program(f"p{i}", TORCH, "inductor", os.urandom(400_000), {"n_ops": i})
        time.sleep(0.01)
    assert disk.get_program("p7", TORCH) is not None  # the newest stays
    assert disk.get_program("p0", TORCH) is None  # the oldest went
    assert not old_kernels.exists()  # old kernels count, and went first
    disk.close()
    assert folder_bytes(cache_dir) <= limit


def test_corrupt_database_is_moved_aside_and_rebuilt(cache_dir: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None
    disk.put_stats("d", {"hot": True})
    disk.close()
    for p in cache_dir.iterdir():
        if p.is_file() and p.name != "secret":
            p.write_bytes(b"this is not a database" * 100)
    ae.reset_metrics()
    with caplog.at_level(logging.WARNING, logger="adaptive_eager"):
        for _ in range(2):
            disk = DiskCache.open(cache_dir, 1 << 30)
            assert disk is not None
            disk.put_stats("e", {"hot": False})
            assert disk.get_stats("e") == {"hot": False}
            disk.close()
    assert ae.metrics()["disk_errors"] == 1
    assert sum("damaged" in r.message for r in caplog.records) == 1
    assert any(p.name.endswith(".corrupt") for p in cache_dir.iterdir())


def test_orphaned_value_files_are_collected(cache_dir: Path) -> None:
    cache_dir.mkdir(parents=True, mode=0o700)
    db = legacy_cache(cache_dir, {f"stats:{i}": {"blob": "x" * 1000} for i in range(5)})
    db.unlink()  # the index is gone: its value files are orphans
    assert len(value_files(cache_dir)) == 5
    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None
    disk.close()
    assert value_files(cache_dir) == []


_READ_ONLY = textwrap.dedent("""
    import sys, torch
    from adaptive_eager.cache.disk import DiskCache
    from adaptive_eager.metrics import METRICS
    d = DiskCache.open(sys.argv[1], 1 << 30)
    assert d is not None and d.read_only, "not served read-only"
    v = d.get_program("k", torch.__version__)
    assert v is not None and v["artifact"] == b"artifact bytes", v
    assert d.get_stats("d") == {"hot": True}
    d.put_stats("e", {"hot": False})  # skipped, not an error
    print("served")
""")


def test_read_only_cache_serves_reads(tmp_path: Path, other_user: tuple[int, int]) -> None:
    folder = tmp_path / "ro-cache"
    folder.mkdir(mode=0o700)
    os.chown(folder, *other_user)
    write = textwrap.dedent("""
        import sys, torch
        from adaptive_eager.cache.disk import DiskCache
        d = DiskCache.open(sys.argv[1], 1 << 30)
        d.put_program("k", torch.__version__, "inductor", b"artifact bytes", {"n_ops": 1})
        d.put_stats("d", {"hot": True})
        d.close()
    """)
    proc = as_other_user(other_user, ["-c", write, str(folder)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for p in folder.rglob("*"):
        os.chmod(p, 0o500 if p.is_dir() else 0o400)
    os.chmod(folder, 0o500)
    proc = as_other_user(other_user, ["-c", _READ_ONLY, str(folder)])
    assert proc.returncode == 0 and "served" in proc.stdout, proc.stderr[-3000:]


def test_another_users_link_as_the_cache_path_is_refused(tmp_path: Path,
                                                         other_user: tuple[int, int]) -> None:
    """The cache path itself is a link another user made (in /tmp, say), pointing at a folder
    of the victim's own: refused, as links above it are, and nothing there is touched; the
    victim's own link is followed."""
    from adaptive_eager.cache import trust

    own = tmp_path / "appcache"  # another program's data, diskcache's layout
    (own / "ab").mkdir(parents=True, mode=0o700)
    (own / "cache.db").write_text("precious")
    (own / "ab" / "x.val").write_text("value")
    link = tmp_path / "cache"
    os.symlink(own, link)
    os.chown(link, *other_user, follow_symlinks=False)
    with pytest.raises(trust.Untrusted, match="symlink owned by uid"):
        trust.check_root(link)
    ae.reset_metrics()
    x = torch.arange(4.0)
    with ae.adaptive_eager(cache_dir=str(link), hot_after=2, compile_async=False):
        got = [(x * i).sum().item() for i in range(6)]
    assert got == [(x * i).sum().item() for i in range(6)]
    assert ae.metrics()["disk_errors"] >= 1
    assert sorted(p.name for p in own.rglob("*")) == ["ab", "cache.db", "x.val"]
    assert (own / "cache.db").read_text() == "precious"
    mine = tmp_path / "mine"
    os.symlink(own, mine)  # the user's own link: followed
    assert trust.check_root(mine, create=False) == own.resolve()
