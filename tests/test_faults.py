"""Faults in the compiler or the disk cache never change a result: counted, logged once, skipped.

Each test runs a small hot loop whose expected values come from plain eager, injects one fault,
and checks the values, the counter, and that the engine recovers (recompiles or skips).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import backends
from adaptive_eager.backends.inductor import InductorBackend
from adaptive_eager.cache.disk import DiskCache
from adaptive_eager.cache.memory import TRIE

OPTS = {"hot_after": 2, "compile_async": False}


def chain(x: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x * 1.5 + 0.25) * x - 0.5).sum(0)


@pytest.fixture
def data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(24, 10)
    return x, chain(x)


def run_loop(x: torch.Tensor, ref: torch.Tensor, steps: int = 6, **options: Any) -> dict:
    """Run the hot loop, check every value against eager, return the metrics."""
    with ae.adaptive_eager(**{**OPTS, **options}):
        for _ in range(steps):
            torch.testing.assert_close(chain(x), ref, rtol=1e-5, atol=1e-6)
    return ae.metrics()


def fresh_process() -> None:
    """Forget everything in memory, as a new process would (the disk cache stays)."""
    ae.clear_caches()
    ae.reset_metrics()


def program_entries(cache_dir: Path) -> list[str]:
    disk = DiskCache(cache_dir, 1 << 30)
    try:
        return [k for k in disk.keys() if k.startswith("program:")]
    finally:
        disk.close()


def test_garbage_entry_is_skipped_and_recompiled(data, cache_dir: Path) -> None:
    run_loop(*data, cache_dir=cache_dir)
    keys = program_entries(cache_dir)
    assert keys
    disk = DiskCache(cache_dir, 1 << 30)
    for k in keys:
        disk.raw_set(k, b"\x00garbage")
    disk.close()
    fresh_process()
    m = run_loop(*data, cache_dir=cache_dir)
    assert m["disk_errors"] >= 1 and m["compiles"] >= 1 and m["fused_errors"] == 0


def test_truncated_value_is_skipped(data, cache_dir: Path) -> None:
    run_loop(*data, cache_dir=cache_dir)
    disk = DiskCache(cache_dir, 1 << 30)
    for k in program_entries(cache_dir):
        blob = disk.raw_get(k)
        assert blob is not None and len(blob) > 1000
        disk.raw_set(k, blob[:len(blob) // 2])  # a write cut short
    disk.close()
    fresh_process()
    m = run_loop(*data, cache_dir=cache_dir)
    assert m["disk_errors"] >= 1 and m["compiles"] >= 1


def test_entry_from_another_torch_version_is_skipped(data, cache_dir: Path) -> None:
    run_loop(*data, cache_dir=cache_dir)
    disk = DiskCache(cache_dir, 1 << 30)
    for k in program_entries(cache_dir):
        entry = disk.get_entry(k)
        assert entry is not None
        header, artifact = entry
        disk.put_entry(k, {**header, "torch": "1.0.0"}, artifact)  # as that version signs it
    disk.close()
    fresh_process()
    m = run_loop(*data, cache_dir=cache_dir)
    assert m["disk_errors"] >= 1 and m["compiles"] >= 1 and m["disk_hits"] == 0


def test_unusable_cache_folder_runs_without_disk_cache(data, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="adaptive_eager"):
        m = run_loop(*data, cache_dir=blocker / "cache")
    assert m["disk_errors"] >= 1 and m["compiles"] >= 1
    assert sum("cannot open cache folder" in r.message for r in caplog.records) == 1


def test_read_only_or_full_cache_folder(data, cache_dir: Path, monkeypatch) -> None:
    # Faults injected where a value is written (a real read-only folder: test_security.py).
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise sqlite3.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(DiskCache, "encode", refuse)
    m = run_loop(*data, cache_dir=cache_dir)
    assert m["disk_errors"] >= 1 and m["compiles"] >= 1

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DiskCache, "encode", full)
    fresh_process()
    m = run_loop(*data, cache_dir=cache_dir)
    assert m["disk_errors"] >= 1


def test_group_writable_cache_folder_is_refused(data, cache_dir: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    cache_dir.mkdir(parents=True)
    os.chmod(cache_dir, 0o777)
    with caplog.at_level(logging.WARNING, logger="adaptive_eager"):
        m = run_loop(*data, cache_dir=cache_dir)
    assert any("refusing cache folder" in r.message for r in caplog.records)
    assert m["disk_errors"] >= 1 and not program_entries_safe(cache_dir)


def program_entries_safe(cache_dir: Path) -> list[str]:
    os.chmod(cache_dir, 0o700)
    return program_entries(cache_dir)


def test_new_cache_folder_is_private(data, cache_dir: Path) -> None:
    run_loop(*data, cache_dir=cache_dir)
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700


def test_compile_that_raises_leaves_results_unchanged(data, cache_dir: Path, monkeypatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    def broken(self: Any, graph: Any) -> Any:
        raise RuntimeError("injected compiler failure")

    monkeypatch.setattr(InductorBackend, "compile", broken)  # patched here, not in the helper
    with caplog.at_level(logging.WARNING, logger="adaptive_eager"):
        m = run_loop(*data, steps=8, cache_dir=cache_dir, compile_process=False)
    assert m["compile_errors"] >= 1 and m["compiled_runs"] == 0
    assert sum("injected compiler failure" in r.message for r in caplog.records) == 1
    assert {e.state for e in TRIE.entry_list if e.n_ops > 1} <= {"failed", "new"}


@pytest.fixture
def helper() -> Any:
    """The compile helper's client, restored to a usable state afterwards."""
    from adaptive_eager.compile_process import HELPER

    yield HELPER
    HELPER.close()
    HELPER.broken = None


def test_compiles_run_in_the_helper_process(data, cache_dir: Path, helper: Any) -> None:
    m = run_loop(*data, steps=6, cache_dir=cache_dir, compile_service=False)
    assert m["compiled_runs"] >= 1 and m["helper_errors"] == 0, m
    assert helper._proc is not None and helper._proc.poll() is None
    assert helper._proc.pid != os.getpid()


def test_compile_failing_in_the_helper_leaves_results_unchanged(
        data, cache_dir: Path, helper: Any, monkeypatch) -> None:
    # An option Inductor rejects: the compile raises inside the helper, not in this process.
    monkeypatch.setitem(backends._instances, "inductor",
                        InductorBackend({"no_such_inductor_option": 1}))
    m = run_loop(*data, steps=8, cache_dir=cache_dir)
    assert m["compile_errors"] >= 1 and m["compiled_runs"] == 0 and m["helper_errors"] == 0, m
    assert {e.state for e in TRIE.entry_list if e.n_ops > 1} <= {"failed", "new"}


def test_helper_that_dies_moves_compiles_into_this_process(data, cache_dir: Path,
                                                           helper: Any) -> None:
    # The per-process helper (compile_service off): the service has its own fallback tests.
    run_loop(*data, steps=6, cache_dir=cache_dir, compile_service=False)
    helper._proc.kill()
    helper._proc.wait()
    fresh_process()
    m = run_loop(*data, steps=6, cache_dir=cache_dir, disk_cache=False, compile_service=False)
    assert m["helper_errors"] == 1 and m["compiles"] >= 1 and m["compiled_runs"] >= 1, m
    assert helper.broken is not None


def test_deserialized_program_that_fails_is_compiled_here(data, cache_dir: Path, helper: Any,
                                                          monkeypatch) -> None:
    """A program that went through bytes (helper process, disk) and fails to run is compiled in
    this process instead, and later processes compile it here too rather than load it."""
    real_load = InductorBackend.load

    def broken_load(self: Any, blob: bytes, graph: Any) -> Any:
        program = real_load(self, blob, graph)

        def run(*inputs: Any) -> Any:
            raise IndexError("injected: list index out of range")
        return run if program is not None else program

    monkeypatch.setattr(InductorBackend, "load", broken_load)
    m = run_loop(*data, steps=10, cache_dir=cache_dir)
    assert m["fused_errors"] == 1 and m["compiles"] == 2 and m["compiled_runs"] >= 1, m
    fresh_process()
    m = run_loop(*data, steps=10, cache_dir=cache_dir)
    assert m["fused_errors"] == 0 and m["disk_hits"] == 0 and m["compiled_runs"] >= 1, m


def test_fused_program_that_raises_at_run_time(data, cache_dir: Path, monkeypatch) -> None:
    def compile_raising_program(self: Any, graph: Any) -> Any:
        def program(*inputs: Any) -> Any:
            raise RuntimeError("injected kernel failure")
        return program

    monkeypatch.setattr(InductorBackend, "compile", compile_raising_program)
    monkeypatch.setattr(InductorBackend, "serialize", lambda self, p: b"")
    m = run_loop(*data, steps=8, cache_dir=cache_dir, compile_process=False)
    assert m["fused_errors"] >= 1 and m["compiled_runs"] == 0


class WrongBackend(InductorBackend):
    """Compiles for real, then returns results that are off by one."""

    name = "wrong"
    separate_process = False  # defined in this test module, which the helper cannot import

    def compile(self, graph: Any) -> Any:
        program = super().compile(graph)
        return lambda *inputs: tuple(o + 1 for o in program(*inputs))


def test_crosscheck_quarantines_a_wrong_fused_program(data, cache_dir: Path,
                                                      monkeypatch) -> None:
    monkeypatch.setitem(backends._instances, "wrong", WrongBackend())
    m = run_loop(*data, steps=8, cache_dir=cache_dir, backend="wrong", crosscheck=True)
    assert m["quarantined"] == 1 and m["compiled_runs"] >= 1
    assert any(e.state == "quarantined" for e in TRIE.entry_list)
    digest = next(e.digest for e in TRIE.entry_list if e.state == "quarantined")
    fresh_process()  # a later process never fuses it again
    run_loop(*data, steps=4, cache_dir=cache_dir, backend="wrong", crosscheck=False)
    assert next(e for e in TRIE.entry_list if e.digest == digest).state == "quarantined"


class SlowBackend(InductorBackend):
    name = "slow"

    def compile(self, graph: Any) -> Any:
        import time

        program = super().compile(graph)

        def slow(*inputs: Any) -> Any:
            time.sleep(0.05)
            return program(*inputs)
        return slow


def test_fused_program_slower_than_replay_is_dropped(data, cache_dir: Path, monkeypatch) -> None:
    monkeypatch.setitem(backends._instances, "slow", SlowBackend())
    m = run_loop(*data, steps=10, cache_dir=cache_dir, backend="slow")
    assert m["kept_replay"] >= 1 and m["kept_fused"] == 0
    entry = next(e for e in TRIE.entry_list if e.decision.startswith("op-by-op"))
    assert entry.state == "replay" and entry.fused_s and entry.replay_s
    runs_before = m["compiled_runs"]
    run_loop(*data, steps=3, cache_dir=cache_dir, backend="slow")
    assert ae.metrics()["compiled_runs"] == runs_before  # decided: no more fused runs


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(backends.UnknownBackend, match="inductor, replay"):
        backends.get_backend("no-such-compiler")


def test_backend_from_entry_point_group(monkeypatch) -> None:
    class EP:
        name = "plugin"

        def load(self) -> Any:
            return lambda: SlowBackend()

    monkeypatch.setattr(backends, "entry_points", lambda group: [EP()])
    backend = backends.get_backend("plugin")
    assert isinstance(backend, SlowBackend)
    backends._instances.pop("plugin", None)


_KILLED = textwrap.dedent("""
    import os, sys, torch
    import adaptive_eager as ae
    from adaptive_eager.cache.disk import DiskCache
    real_sql = DiskCache.sql
    def sql_then_die(self, query, args=()):
        if query.startswith("INSERT") and args and str(args[0]).startswith("program:"):
            conn = self._db()
            conn.execute("BEGIN")
            conn.execute(query, args)  # the row is written...
            os._exit(9)  # ...and the process dies before it commits
        return real_sql(self, query, args)
    DiskCache.sql = sql_then_die
    x = torch.ones(8, 8)
    # compile_service off: this process writes the program itself (and dies doing so)
    with ae.adaptive_eager(hot_after=2, compile_async=False, compile_service=False,
                           cache_dir=sys.argv[1]):
        for _ in range(6):
            (torch.tanh(x * 1.5 + 0.25) * x - 0.5).sum(0).tolist()
""")


def test_process_killed_mid_write(tmp_path: Path, cache_dir: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    proc = subprocess.run([sys.executable, str(script), str(cache_dir)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 9, proc.stderr[-2000:]
    x = torch.ones(8, 8)
    m = run_loop(x, chain(x), cache_dir=cache_dir)
    assert m["compiles"] >= 1 and m["fused_errors"] == 0  # nothing half-written was used
    assert json.dumps(m)  # metrics stay serializable
