"""The size limit evicts whole program entries: a program with the kernel files only it uses,
least recently used first, never what a live process pins, never leaving an entry whose kernels
are gone (Note [program entries], Note [cache size], Note [kernel pins]).

The real-compile tests compile in subprocesses with their own cache folder (the conftest's
``cache_dir``) and the per-process compile helper; eviction runs here, through ``DiskCache``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from adaptive_eager.cache import kernel_refs, pins
from adaptive_eager.cache.disk import DiskCache

TORCH = torch.__version__
LIMIT_MB = "64"  # under pins.PCH_MIN_LIMIT: no precompiled headers, as any small limit

_FNS = """
FNS = [lambda x: ((x * 2).relu() * 0.5).sum(), lambda x: ((x + 1).tanh() * 0.5).sum(),
       lambda x: (x.sigmoid() - 0.25).abs().sum(), lambda x: ((x * x + 1).sqrt() - 1).sum()]
"""
_ns: dict = {}
exec(_FNS, _ns)  # the same four programs here and in the subprocess: no kernel in common
FNS = _ns["FNS"]

_PROG = _FNS + textwrap.dedent("""
    import json, sys, torch
    import adaptive_eager as ae
    ys = []
    x = torch.randn(256, generator=torch.Generator().manual_seed(0))
    for f in [FNS[int(a)] for a in sys.argv[1:]]:
        with ae.adaptive_eager(hot_after=1, step_aside=False):
            for i in range(6):
                if i == 2:
                    ae.wait_for_compiles()
                y = f(x).item()
        ys.append(y)
    m = ae.metrics()
    print(json.dumps({"ys": ys, **{k: m[k] for k in ("compiles", "compiled_runs", "disk_hits",
                      "disk_misses", "compile_errors", "disk_errors")}}))
""")


def _eager(i: int) -> float:
    x = torch.randn(256, generator=torch.Generator().manual_seed(0))
    return FNS[i](x).item()


def _run(prog: Path, programs: list[int], cache_dir: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", ADAPTIVE_EAGER_CACHE_DIR=str(cache_dir),
               ADAPTIVE_EAGER_CACHE_SIZE_MB=LIMIT_MB)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the kernels in <cache>/inductor, not the session's
    r = subprocess.run([sys.executable, str(prog), *map(str, programs)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["ys"] == pytest.approx([_eager(i) for i in programs], rel=1e-5)  # as eager
    return got


@pytest.fixture
def prog(tmp_path: Path) -> Path:
    path = tmp_path / "prog" / "p.py"
    path.parent.mkdir()
    path.write_text(_PROG)
    return path


def _folder_bytes(path: Path) -> int:
    """What the folder holds, measured here (every file and folder, the folder itself too)."""
    total = os.lstat(path).st_blocks * 512
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def _programs(disk: DiskCache) -> dict[str, list[str]]:
    """Stored program key -> the kernel keys its artifact names."""
    out = {}
    for key in disk.keys():
        if key.startswith("program:"):
            got = disk.get_entry(key)
            assert got is not None
            out[key] = kernel_refs.keys_in(got[1])
    return out


def _key_files(kernels: Path, key: str) -> list[Path]:
    folder = kernels / key[1:3]
    return sorted(folder.glob(key + "*")) if folder.is_dir() else []


def _kernels_present(disk: DiskCache, kernels: Path) -> None:
    """Every stored program names its kernels, and every one of them is on disk."""
    for key, names in _programs(disk).items():
        assert names, key  # at least the wrapper and one kernel
        for name in names:
            assert _key_files(kernels, name), (key, name)


# ---- real compiles ---------------------------------------------------------------------------
def test_eviction_removes_whole_programs_and_the_rest_loads(cache_dir: Path, prog: Path) -> None:
    got = _run(prog, [0, 1, 2, 3], cache_dir)  # one process; programs stored oldest first
    assert got["compiles"] >= 4 and got["compile_errors"] == 0, got
    kernels = cache_dir / "inductor"
    disk = DiskCache(cache_dir, 1 << 30)
    try:
        stored = _programs(disk)
        assert len(stored) == got["compiles"]
        written = {k: disk.program_info(k)["written"] for k in stored}
        for names in stored.values():  # the wrapper and its C++ kernel, each with files
            assert len(names) >= 2 and all(_key_files(kernels, n) for n in names), names
        _kernels_present(disk, kernels)
        before = _folder_bytes(cache_dir)
        limit = before
        while len(_programs(disk)) > len(stored) - 2:  # a shrinking limit: it fits each time
            limit -= 8192
            start = time.perf_counter()
            disk.enforce_limit(rescan=True, limit=limit)
            took = time.perf_counter() - start
            assert _folder_bytes(cache_dir) <= limit, (limit, _folder_bytes(cache_dir))
            _kernels_present(disk, kernels)
        left = _programs(disk)
        gone = set(stored) - set(left)
        # least recently used first: the two stored first went, each with its own kernels
        assert gone == set(sorted(stored, key=lambda k: written[k])[:len(gone)]), written
        for key in gone:
            for name in stored[key]:
                assert not _key_files(kernels, name), name
        print(f"folder {before} -> {_folder_bytes(cache_dir)} bytes, last eviction {took:.4f}s")
    finally:
        disk.close()
    # the kernels of one remaining program removed by hand: its load rebuilds them
    by_hand = sorted(left)[0]
    for name in left[by_hand]:
        for path in _key_files(kernels, name):
            path.unlink()
    got = _run(prog, [0, 1, 2, 3], cache_dir)
    assert got["compiles"] == len(gone), got  # the evicted ones: compiled again
    assert got["disk_misses"] >= len(gone), got  # ... as misses
    assert got["disk_hits"] == len(left), got  # the others loaded (one rebuilt its kernels)
    assert got["compile_errors"] == 0 and got["disk_errors"] == 0, got  # no failures


def test_pinned_kernels_survive_with_their_program(cache_dir: Path, prog: Path) -> None:
    _run(prog, [0], cache_dir)
    kernels = cache_dir / "inductor"
    pin = pins.pin(str(kernels))
    assert pin is not None
    disk = DiskCache(cache_dir, 1 << 30)
    try:
        old = set(_programs(disk))
        with pin.compiling():  # a compile in flight from here on: what it writes is pinned
            _run(prog, [1], cache_dir)
            new = {k: v for k, v in _programs(disk).items() if k not in old}
            assert len(new) == 1
            disk.enforce_limit(rescan=True, limit=1)
            left = _programs(disk)
            assert set(left) == set(new)  # the older program went; the pinned one stayed whole
            _kernels_present(disk, kernels)
            assert (kernels / "locks").is_dir()  # Inductor's locks: pinned while a pin lives
    finally:
        disk.close()
        os.close(pin.fd)  # this process's pin is released
        pins._pins.pop((os.getpid(), str(kernels)))


# ---- the choice, on files made here -----------------------------------------------------------
def _key(tag: str) -> str:
    return ("c" + tag + "x" * 51)[:52]


def _artifact(keys: list[str], size: int = 1000) -> bytes:
    """An Inductor artifact's layout: build key, then the kernel block (Note [program
    entries]), then the program's bytes."""
    return b"AE1" + b"\0" * 32 + kernel_refs.pack(keys) + os.urandom(size)


def _kernel(kernels: Path, key: str, age: float, size: int = 50_000) -> None:
    folder = kernels / key[1:3]
    folder.mkdir(mode=0o700, exist_ok=True)
    for suffix in (".cpp", ".so"):
        path = folder / (key + suffix)
        path.write_bytes(os.urandom(size))
        os.utime(path, (age, age))


def test_shared_kernels_go_with_their_last_program(cache_dir: Path) -> None:
    disk = DiskCache(cache_dir, 1 << 30)
    kernels = cache_dir / "inductor"
    old = time.time() - 3600
    a, b, shared, orphan = _key("aa"), _key("bb"), _key("ss"), _key("oo")
    for key in (a, b, shared):
        _kernel(kernels, key, old)
    _kernel(kernels, orphan, old - 10)  # no program names it: the oldest
    disk.put_program("pa", TORCH, "inductor", _artifact([a, shared]), {"n_ops": 1})
    time.sleep(0.01)
    disk.put_program("pb", TORCH, "inductor", _artifact([b, shared]), {"n_ops": 1})
    try:
        disk.enforce_limit(rescan=True, limit=disk.measure() - 1)  # the orphan is enough
        assert not _key_files(kernels, orphan) and disk.program_info("pa") is not None
        disk.enforce_limit(rescan=True, limit=disk.measure() - 1)  # then the oldest program
        assert disk.program_info("pa") is None and not _key_files(kernels, a)
        assert _key_files(kernels, shared) and _key_files(kernels, b)  # pb still uses it
        disk.enforce_limit(rescan=True, limit=disk.measure() - 1)
        assert disk.program_info("pb") is None
        assert not _key_files(kernels, shared) and not _key_files(kernels, b)
        assert not (kernels / shared[1:3]).exists()  # emptied folders go too
    finally:
        disk.close()


def test_kernel_block_round_trip() -> None:
    keys = [_key("aa"), _key("bb")]
    guards = b"AEG1" + (2).to_bytes(4, "big") + b"{}"
    art = b"AE1" + b"\0" * 32 + guards + kernel_refs.pack(keys + ["../etc", "x"]) + b"\x80rest"
    assert kernel_refs.keys_in(art) == keys  # after the guard block; odd names are dropped
    assert kernel_refs.keys_in(b"AE1" + b"\0" * 32 + b"\x80rest") == []  # an earlier format
    assert kernel_refs.keys_in(b"AE1" + b"\0" * 32 + b"AEK1" + (99).to_bytes(4, "big")) == []
    got, rest = kernel_refs.unpack(memoryview(kernel_refs.pack(keys) + b"\x80rest"))
    assert got == keys and bytes(rest) == b"\x80rest"
