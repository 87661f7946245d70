"""What a program is (Note [program key]): its key's named parts, the compile service's identity
(Note [service identity]), and changes of ambient settings as flush points (Note [ambient
state]). Replay results are compared bitwise with eager; fused ones within 1e-12 (float64)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import adaptive_eager as ae
from adaptive_eager import compile_process, program_key, service
from adaptive_eager.cache.memory import TRIE
from adaptive_eager.dispatch import ambient

from conftest import assert_same


@pytest.fixture(autouse=True)
def _global_flags_settable() -> Iterator[None]:
    """torch's own test utilities (imported by other test files: the fuzzer's OpInfo database)
    call ``torch.backends.disable_global_flags()`` for the rest of the process; these tests set
    flags as attributes, as user programs do, so they allow it for their duration."""
    allow = torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation"]
    with allow():
        yield


COMPILE_SERVICE = True  # conftest: compiles go through the compile service

_TRACE = {"digest": "d" * 32, "live": (3,), "lifted": (), "offsets": (), "baked": ()}
_STATE = (("default_dtype", "float32"), ("mkldnn.enabled", True))


# ---- the key's parts --------------------------------------------------------------------------
def _key(**change: object) -> str:
    args: dict = {"trace": _TRACE, "backend": "inductor:x", "state": _STATE,
                  "code": "c" * 32, "torch": "2.x git=y"}
    args.update(change)
    return program_key.program_key(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("part,other", [
    ("trace", dict(_TRACE, live=(4,))),
    ("backend", "inductor:y"),
    ("state", (("default_dtype", "float32"), ("mkldnn.enabled", False))),
    ("code", "e" * 32),
    ("torch", "2.x git=z"),
])
def test_each_named_part_changes_the_key(part: str, other: object) -> None:
    assert _key() == _key()  # same parts, same key (no process- or order-dependence)
    assert _key(**{part: other}) != _key(), part


def test_key_parts_are_loggable_strings() -> None:
    parts = program_key.key_parts(_TRACE, "inductor:x", _STATE)
    assert set(parts) == {"trace", "code", "torch", "backend", "state"}
    assert all(isinstance(v, str) for v in parts.values())
    assert parts["code"] == program_key.code_fingerprint()
    assert torch.__version__ in parts["torch"] and "git=" in parts["torch"]
    assert program_key.hash_parts(parts) == program_key.program_key(_TRACE, "inductor:x", _STATE)


def _copy_package(dest: Path) -> Path:
    pkg = Path(program_key.__file__).parent
    shutil.copytree(pkg, dest / "adaptive_eager", ignore=shutil.ignore_patterns("__pycache__"))
    return dest / "adaptive_eager"


def _fingerprint_of(pkg: Path, name: str) -> str:
    spec = importlib.util.spec_from_file_location(name, pkg / "program_key.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.code_fingerprint()


def test_fingerprint_covers_the_package_source(tmp_path: Path) -> None:
    pkg = _copy_package(tmp_path)
    same = _fingerprint_of(pkg, "_ae_fp_same")
    assert same == program_key.code_fingerprint()  # a copy of the same code is the same code
    with open(pkg / "graph.py", "a") as f:
        f.write("\n# another build of the graph builder\n")
    assert _fingerprint_of(pkg, "_ae_fp_changed") != same
    assert program_key.code_fingerprint() is program_key.code_fingerprint()  # cached


def test_sources_changed_since_import_give_a_fingerprint_of_that_process(tmp_path: Path) -> None:
    pkg = _copy_package(tmp_path)
    spec = importlib.util.spec_from_file_location("_ae_fp_loaded", pkg / "program_key.py")
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)  # the code this "process" runs
    with open(pkg / "graph.py", "a") as f:
        f.write("\n# upgraded while the program runs\n")
    mine = loaded.code_fingerprint()
    assert mine != program_key.code_fingerprint()  # not the code it loaded
    assert mine != _fingerprint_of(pkg, "_ae_fp_upgraded")  # nor the code now on disk


# ---- the ambient state --------------------------------------------------------------------------
@contextlib.contextmanager
def _attr(obj: object, name: str, value: object) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)  # a plain attribute set, as programs do (not the flags() context)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def _call(setter: Callable[[object], object], value: object, old: object) -> Iterator[None]:
    setter(value)
    try:
        yield
    finally:
        setter(old)


_N_THREADS = torch.get_num_threads()
_CHANGES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "mkldnn.enabled": lambda: _attr(torch.backends.mkldnn, "enabled", False),
    "mkldnn.flags": lambda: torch.backends.mkldnn.flags(enabled=False),
    "mkldnn.deterministic": lambda: _attr(torch.backends.mkldnn, "deterministic", True),
    "mkldnn direct": lambda: _call(torch._C._set_mkldnn_enabled, False, True),
    "cudnn.benchmark": lambda: _attr(torch.backends.cudnn, "benchmark", True),
    "cudnn.deterministic": lambda: _attr(torch.backends.cudnn, "deterministic", True),
    "cudnn.flags": lambda: torch.backends.cudnn.flags(enabled=False),
    "cuda.matmul.allow_tf32": lambda: _attr(torch.backends.cuda.matmul, "allow_tf32", True),
    "nnpack.flags": lambda: torch.backends.nnpack.flags(enabled=False),
    "math_sdp": lambda: _call(torch.backends.cuda.enable_math_sdp, False, True),
    "deterministic_algorithms": lambda: _call(torch.use_deterministic_algorithms, True, False),
    "matmul_precision": lambda: _call(torch.set_float32_matmul_precision, "medium", "highest"),
    "default_dtype": lambda: _call(torch.set_default_dtype, torch.float64, torch.float32),
    "num_threads": lambda: _call(torch.set_num_threads, 1 if _N_THREADS > 1 else 2, _N_THREADS),
    "flush_denormal": lambda: _call(torch.set_flush_denormal, True, False),
}


@pytest.mark.parametrize("change", sorted(_CHANGES))
def test_ambient_state_names_each_setting(change: str) -> None:
    before = ambient.state()
    with _CHANGES[change]():
        inside = ambient.state()
    assert inside != before, change  # a part of the program key and of the trie root
    # flush_denormal has no getter (its value is the last one set); restoring allow_tf32 or the
    # matmul precision leaves fp32_precision at "ieee" where it was "none" (torch's own)
    if change not in ("flush_denormal", "cuda.matmul.allow_tf32", "matmul_precision"):
        assert ambient.state() == before


def _engine() -> object:
    return ae.api._state.engine


def _warm(x: torch.Tensor) -> None:
    """Meet the ops once (a flush follows an op the engine has not seen in this process)."""
    for _ in range(2):
        (x * 2 + 1).sum().item()
        (x * 3).sum().item()


@pytest.mark.parametrize("change", sorted(_CHANGES))
def test_setting_change_flushes_pending_ops_first(change: str) -> None:
    x = torch.randn(16)
    with ae.adaptive_eager(backend="replay", step_aside=False):
        _warm(x)
        y = x * 2 + 1
        assert _engine().trace.ops  # deferred
        with _CHANGES[change]():
            assert not _engine().trace.ops, change  # ran under the settings they saw
            z = x * 3
        assert not _engine().trace.ops, change  # the restore is a change too
        assert_same(y, x * 2 + 1)
        assert_same(z, x * 3)


def test_setting_to_the_current_value_is_no_flush_point() -> None:
    x = torch.randn(16)
    with ae.adaptive_eager(backend="replay", step_aside=False):
        _warm(x)
        y = x * 2 + 1
        torch.backends.mkldnn.enabled = torch.backends.mkldnn.enabled
        with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled,
                                        benchmark=torch.backends.cudnn.benchmark,
                                        deterministic=torch.backends.cudnn.deterministic,
                                        allow_tf32=torch.backends.cudnn.allow_tf32):
            pass
        torch.set_float32_matmul_precision(torch.get_float32_matmul_precision())
        assert _engine().trace.ops
        assert_same(y, x * 2 + 1)


torch.manual_seed(0)
_CONV = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, stride=2))
_X = torch.randn(4, 3, 8, 8)
_TINY = torch.full((64,), 1e-39)  # denormal floats
_BIG = torch.randn(1_000_003, generator=torch.Generator().manual_seed(1))


def _conv() -> torch.Tensor:
    with torch.no_grad():
        return _CONV(_X)


def _mkldnn_attribute() -> torch.Tensor:
    prev = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        return _conv()
    finally:
        torch.backends.mkldnn.enabled = prev  # restored before the trace runs


def _mkldnn_flags() -> torch.Tensor:
    with torch.backends.mkldnn.flags(enabled=False):
        return _conv()


def _mkldnn_direct() -> torch.Tensor:
    torch._C._set_mkldnn_enabled(False)
    try:
        return _conv()
    finally:
        torch._C._set_mkldnn_enabled(True)


def _flush_denormal() -> torch.Tensor:
    torch.set_flush_denormal(True)
    try:
        return _TINY * 0.5 + 0.0
    finally:
        torch.set_flush_denormal(False)


def _one_thread() -> torch.Tensor:
    torch.set_num_threads(1)
    try:
        return (_BIG * 1.0001).sum()  # the parallel sum's chunks depend on the thread count
    finally:
        torch.set_num_threads(_N_THREADS)


_TOGGLED = [_mkldnn_attribute, _mkldnn_flags, _mkldnn_direct, _flush_denormal, _one_thread]


@pytest.mark.parametrize("fn", _TOGGLED, ids=lambda f: f.__name__)
def test_ops_recorded_under_a_toggled_setting_replay_bitwise(fn: Callable[[], torch.Tensor]) -> \
        None:
    if fn is _one_thread and _N_THREADS == 1:
        pytest.skip("one thread: nothing to toggle")
    ref = fn()
    with ae.adaptive_eager(backend="replay", step_aside=False):
        for _ in range(3):
            assert_same(fn(), ref)


def test_traces_under_other_settings_are_other_traces() -> None:
    with ae.adaptive_eager(backend="replay", step_aside=False):
        for _ in range(3):
            _conv().sum().item()
        plain = {e.digest for e in TRIE.entry_list}
        for _ in range(3):
            _mkldnn_attribute().sum().item()
        off = {e.digest for e in TRIE.entry_list} - plain
        assert off  # the same ops under mkldnn off: another root, other traces
        for _ in range(3):
            _conv().sum().item()
            _mkldnn_attribute().sum().item()
        assert {e.digest for e in TRIE.entry_list} == plain | off  # and both hit again


# ---- the compile service and helpers answer their own code only -------------------------------
def test_helper_refuses_a_request_of_other_code() -> None:
    flags = compile_process._flags()
    for other in (dict(flags, code="0" * 32), dict(flags, torch="1.0 git=old")):
        inp = io.BytesIO()
        compile_process._write(inp, (None, None, other))
        inp.seek(0)
        out = io.BytesIO()
        compile_process._serve(inp, out)
        status, detail, _ = compile_process._read(io.BytesIO(out.getvalue()))
        assert status == "unusable", (status, detail)
        assert "other adaptive_eager code" in detail or "another torch build" in detail, detail


_OLD_SERVICE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from adaptive_eager import service
    if sys.argv[2] == "start":
        service.connect(Path(sys.argv[1]), idle_s=120).close()
    elif sys.argv[2] == "status":
        print(json.dumps(service.status(Path(sys.argv[1]))))
    else:
        service.stop(Path(sys.argv[1]))
""")


def _old(root: Path, cache_dir: Path, what: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(root), ADAPTIVE_EAGER="0")
    out = subprocess.run([sys.executable, "-c", _OLD_SERVICE, str(cache_dir), what], env=env,
                         capture_output=True, text=True, timeout=300, cwd=str(root))
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.fixture
def old_install(tmp_path: Path, cache_dir: Path) -> Iterator[Path]:
    """A copy of the package whose compile helpers ignore the default dtype (as an install older
    than the default dtype in compile requests), its compile service started on ``cache_dir``."""
    pkg = _copy_package(tmp_path)
    src = (pkg / "compile_process.py").read_text()
    old = "        torch.set_default_dtype(dtype)\n"
    assert old in src
    (pkg / "compile_process.py").write_text(src.replace(old, "        pass  # older code\n"))
    _old(tmp_path, cache_dir, "start")
    try:
        yield tmp_path
    finally:
        _old(tmp_path, cache_dir, "stop")


def _float64_step(x: torch.Tensor) -> torch.Tensor:
    f = torch.full((64,), 0.1)  # no dtype: the default
    return (x * f + torch.arange(64) * 0.1).tanh().sum()


def test_a_service_of_other_code_never_serves_this_client(old_install: Path,
                                                          cache_dir: Path) -> None:
    old_socks = {p.name for p in (cache_dir / "service").glob(service.SOCK_NAME + "-*")}
    assert old_socks and service.sock_name() not in old_socks  # listening, under its identity
    assert service.status(cache_dir) is None  # no service of this code yet
    torch.set_default_dtype(torch.float64)
    try:
        x = torch.randn(64, generator=torch.Generator().manual_seed(0))
        ref = _float64_step(x)
        with ae.adaptive_eager(cache_dir=cache_dir, hot_after=2, compile_async=False,
                               step_aside=False):
            outs = [_float64_step(x).item() for _ in range(8)]
    finally:
        torch.set_default_dtype(torch.float32)
    m = ae.metrics()  # compiled by a service: its own (the old one had no request)
    assert m["compiled_runs"] >= 1 and m["service_compiles"] >= 1, m
    for out in outs:  # float64 arithmetic (a float32 program is 1e-7 off)
        assert abs(out - ref.item()) <= 1e-12 * abs(ref.item()), (out, ref.item())
    old_status = json.loads(_old(old_install, cache_dir, "status"))
    assert old_status is not None and old_status.get("requests", 0) == 0, old_status
    # and a request of this code reaching the old service's socket is refused, not compiled
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(cache_dir / "service" / sorted(old_socks)[0]))
    try:
        service.send_msg(conn, {"protocol": service.PROTOCOL, "op": "compile", "key": "k" * 32,
                                "code": program_key.code_fingerprint()}, b"payload")
        conn.settimeout(60)
        answer, _ = service.recv_msg(conn)
    finally:
        conn.close()
    assert answer["status"] == "unusable" and "other adaptive_eager code" in answer["error"]
