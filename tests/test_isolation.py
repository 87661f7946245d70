"""Processes the engine starts are isolated, the compile service is the same for every client,
dead helpers are reaped, and the size limit holds without breaking work (Note [isolated
subprocesses], Note [service identity], Note [transient compile failures], Note [kernel pins]).

Multi-process tests talk over the cache folder's Unix socket only, with bounded waits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import isolation, service
from adaptive_eager.cache import pins
from adaptive_eager.cache.disk import DiskCache
from adaptive_eager.compile_process import HELPER, failure_is_transient

COMPILE_SERVICE = True  # conftest: compiles go through the compile service

_PLANTED = "import os\nopen(os.environ.get('AE_MARK', '/nonexistent/x'), 'w')\n" \
           "raise ImportError('planted')\n"

_PROG = textwrap.dedent("""
    import json, sys, torch
    import adaptive_eager as ae
    x = torch.randn(int(sys.argv[1]), generator=torch.Generator().manual_seed(0))
    with ae.adaptive_eager(hot_after=1, step_aside=False):
        for i in range(6):
            if i == 2:
                ae.wait_for_compiles()
            y = ((x * 2).relu() * 0.5).sum().item()
    m = ae.metrics()
    print(json.dumps({"y": y, **{k: m[k] for k in ("compiles", "compiled_runs",
                      "compile_errors", "disk_hits", "service_compiles")}}))
""")


def _run(prog: Path, n: int, env: dict, cwd: Path | None = None) -> dict:
    r = subprocess.run([sys.executable, str(prog), str(n)], env=env, cwd=cwd,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def _eager(n: int) -> float:
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    return ((x * 2).relu() * 0.5).sum().item()


@pytest.fixture
def prog(tmp_path: Path) -> Path:
    path = tmp_path / "prog" / "p.py"
    path.parent.mkdir()
    path.write_text(_PROG)
    return path


def _env(cache_dir: Path, **extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", ADAPTIVE_EAGER_CACHE_DIR=str(cache_dir))
    env.update(extra)
    return env


def _stop(cache_dir: Path, **extra: str) -> None:
    """Stop the service of the identity ``extra`` gives (conftest stops only this process's)."""
    code = f"from pathlib import Path; from adaptive_eager import service; " \
           f"service.stop(Path({str(cache_dir)!r}))"
    subprocess.run([sys.executable, "-c", code], env=_env(cache_dir, **extra), timeout=60)


# ---- a module planted in the working folder --------------------------------------------------
@pytest.mark.parametrize("use_service", ["0", "1"])
def test_module_planted_in_the_working_folder_never_runs(
        tmp_path: Path, cache_dir: Path, prog: Path, use_service: str) -> None:
    shared = tmp_path / "shared"  # a folder others can write, the program's working folder
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "ctypes.py").write_text(_PLANTED)  # Inductor's VecISA probe imports ctypes
    mark = tmp_path / "planted-ran"
    env = _env(cache_dir, AE_MARK=str(mark), ADAPTIVE_EAGER_COMPILE_ASYNC="0",
               ADAPTIVE_EAGER_COMPILE_SERVICE=use_service)
    try:
        for _ in range(2):  # compiles (helper or service), then loads (the program probes)
            got = _run(prog, 64, env, cwd=shared)
            assert not mark.exists(), "a module planted in the working folder ran"
            assert got["compiled_runs"] >= 1 and got["compile_errors"] == 0, got
            assert got["y"] == pytest.approx(_eager(64), rel=1e-5)
    finally:
        _stop(cache_dir, AE_MARK=str(mark))


def test_vec_isa_probe_runs_isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.cpu_vec_isa as isa_mod

    assert isolation.isolate_vec_isa_probe(), "this torch starts its VecISA probe elsewhere"
    (tmp_path / "ctypes.py").write_text(_PLANTED)
    mark = tmp_path / "planted-ran"
    monkeypatch.setenv("AE_MARK", str(mark))
    monkeypatch.chdir(tmp_path)
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    isa = isa_mod.VecAVX2()
    assert isa._probe_load(lib) is True  # the probe still answers
    assert not isa._probe_load(str(tmp_path / "missing.so"))
    assert not mark.exists()


def test_helper_gets_a_private_folder_and_the_allowed_variables(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AE_SECRET_TOKEN", "s3cret")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "0")
    monkeypatch.chdir(tmp_path)
    HELPER.close()
    proc = HELPER._ensure()
    try:
        env = dict(kv.split("=", 1) for kv in
                   Path(f"/proc/{proc.pid}/environ").read_text().split("\0") if "=" in kv)
        cwd = os.readlink(f"/proc/{proc.pid}/cwd")
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_text().split("\0")
    finally:
        HELPER.close()
    assert "AE_SECRET_TOKEN" not in env and "PYTHONPATH" not in env
    assert env["TORCHINDUCTOR_MAX_AUTOTUNE"] == "0" and env["ADAPTIVE_EAGER"] == "0"
    assert set(env) == set(isolation.child_env())
    assert cmdline[1] == "-I"
    st = os.stat(cwd)
    assert cwd != str(tmp_path) and st.st_uid == os.geteuid() and st.st_mode & 0o077 == 0


# ---- the service's environment -------------------------------------------------------------
def test_service_environment_is_not_the_starters(cache_dir: Path, prog: Path) -> None:
    odd = {"CXX": "/bin/false"}
    try:  # a program with a broken compiler setting starts the cache's service first
        code = f"from pathlib import Path; from adaptive_eager import service; " \
               f"service.connect(Path({str(cache_dir)!r}), idle_s=60).close()"
        subprocess.run([sys.executable, "-c", code], env=_env(cache_dir, **odd), check=True,
                       timeout=120)
        got = _run(prog, 256, _env(cache_dir))  # another program compiles with its own
        assert got["compiles"] == 1 and got["compiled_runs"] >= 1, got
        assert got["compile_errors"] == 0 and got["service_compiles"] == 1, got
    finally:
        _stop(cache_dir, **odd)
        _stop(cache_dir)


def test_compiler_failure_is_transient_and_retried(cache_dir: Path, prog: Path) -> None:
    odd = {"CXX": "/bin/false"}
    try:
        got = _run(prog, 320, _env(cache_dir, **odd))  # its own compiler fails
        assert got["compile_errors"] == 1 and got["compiled_runs"] == 0, got
        disk = DiskCache(cache_dir, 1 << 30)
        fails = [disk.get_stats(k.split(":", 1)[1])["failure"] for k in disk.keys()
                 if k.startswith("stats:") and disk.get_stats(k.split(":", 1)[1]).get("failure")]
        assert fails and all(f["transient"] for f in fails), fails
        got = _run(prog, 320, _env(cache_dir))  # a working compiler: compiled and fused
        assert got["compiles"] == 1 and got["compiled_runs"] >= 1, got
        assert got["y"] == pytest.approx(_eager(320), rel=1e-5)
    finally:
        _stop(cache_dir, **odd)
        _stop(cache_dir)


def test_failure_classes() -> None:
    from torch._inductor.exc import CppCompileError, InductorError, InvalidCxxCompiler

    def wrapped(inner: BaseException) -> BaseException:
        try:
            try:
                raise inner
            except BaseException as err:
                raise InductorError(err, "") from err
        except BaseException as outer:
            return outer

    assert failure_is_transient(wrapped(InvalidCxxCompiler()))
    assert failure_is_transient(wrapped(CppCompileError(["g++"], "fatal error: x.h.gch")))
    assert failure_is_transient(wrapped(FileNotFoundError(2, "No such file")))
    assert not failure_is_transient(wrapped(RuntimeError("unsupported op aten.foo")))
    assert not failure_is_transient(ValueError("a dynamic size became a constant"))


# ---- dead helpers ------------------------------------------------------------------------------
def _helpers_of(pid: int) -> list[int]:
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(k) for k in kids]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


@pytest.mark.slow
def test_helper_killed_mid_compile_is_reaped(cache_dir: Path) -> None:
    x = torch.randn(96, 41)
    ref = (x * 1.5).tanh() + x.sin()
    with ae.adaptive_eager(hot_after=2, compile_async=True, step_aside=False,
                           cache_dir=cache_dir):
        for _ in range(3):
            torch.testing.assert_close((x * 1.5).tanh() + x.sin(), ref, rtol=1e-5, atol=1e-6)
        st = None
        for _ in range(1200):  # until the helper compiles (bounded: 10 min)
            st = service.status(cache_dir)
            if st and st["compiling"]:
                break
            time.sleep(0.5)
        assert st and st["compiling"], st
        helper = _helpers_of(st["pid"])[0]
        os.kill(helper, signal.SIGKILL)
        ae.wait_for_compiles(timeout=600)
        for _ in range(3):
            torch.testing.assert_close((x * 1.5).tanh() + x.sin(), ref, rtol=1e-5, atol=1e-6)
    for _ in range(100):  # reaped within seconds (bounded)
        if _state(helper) == "gone":
            break
        time.sleep(0.1)
    assert _state(helper) == "gone"
    assert f"helper {helper} exited (-9)" in (cache_dir / "service" / "log").read_text()


def test_helper_dead_while_idle_is_reaped(cache_dir: Path) -> None:
    service.connect(cache_dir).close()
    st = service.status(cache_dir)
    assert st is not None
    for _ in range(100):  # the first helper starts as the service begins to serve
        if _helpers_of(st["pid"]):
            break
        time.sleep(0.1)
    helper = _helpers_of(st["pid"])[0]
    os.kill(helper, signal.SIGKILL)
    for _ in range(100):
        if _state(helper) == "gone":
            break
        time.sleep(0.1)
    assert _state(helper) == "gone"
    assert service.status(cache_dir)["helpers"] == 0


# ---- the size limit ------------------------------------------------------------------------------
def _folder_bytes(path: Path) -> int:
    total = 0
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            st = os.lstat(os.path.join(root, name))
            total += st.st_blocks * 512
    return total


@pytest.mark.slow
def test_size_limit_holds_and_next_compile_works(cache_dir: Path, prog: Path) -> None:
    env = _env(cache_dir, ADAPTIVE_EAGER_CACHE_SIZE_MB="5")
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the kernels in the cache folder, under its limit
    try:
        for n in (256, 192, 160):  # three programs, one warm service helper
            got = _run(prog, n, env)
            assert got["compiles"] == 1 and got["compiled_runs"] >= 1, got
            assert got["compile_errors"] == 0, got
            assert _folder_bytes(cache_dir) <= 5 << 20, _folder_bytes(cache_dir)
    finally:
        _stop(cache_dir, ADAPTIVE_EAGER_CACHE_SIZE_MB="5")


def test_eviction_keeps_what_a_live_process_pins(tmp_path: Path, cache_dir: Path) -> None:
    kernels = cache_dir / "inductor"
    disk = DiskCache(cache_dir, 1 << 30)
    old = time.time() - 3600
    for name in ("precompiled_headers", "ab", "cd"):
        (kernels / name).mkdir(mode=0o700)
        (kernels / name / "f").write_bytes(b"x" * 200_000)
        os.utime(kernels / name / "f", (old, old))
        os.utime(kernels / name, (old, old))
    pin = pins.pin(str(kernels))
    assert pin is not None
    with pin.compiling():
        (kernels / "cd" / "g").write_bytes(b"y" * 1000)  # written by a compile in flight
        disk.enforce_limit(rescan=True, limit=1)
        assert (kernels / "precompiled_headers" / "f").exists()
        assert (kernels / "cd" / "g").exists() and not (kernels / "ab").exists()
    # a pin of a process that is gone pins nothing (and is removed)
    code = f"from adaptive_eager.cache import pins; import os; pins.pin({str(kernels)!r}); " \
           f"os.kill(os.getpid(), 9)"
    subprocess.run([sys.executable, "-c", code], timeout=60)
    pin_files = sorted(os.listdir(kernels / pins.PINS_DIR))
    assert len(pin_files) == 2
    os.close(pin.fd)  # this process's pin is released too
    pins._pins.pop((os.getpid(), str(kernels)))
    disk.enforce_limit(rescan=True, limit=1)
    assert not (kernels / "precompiled_headers").exists() and not (kernels / "cd").exists()
    assert os.listdir(kernels / pins.PINS_DIR) == []
