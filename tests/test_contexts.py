"""Contexts entered again and again (Note [cheap contexts] in api.py): options are resolved
from the environment at every context, exactly, however cheaply; the context object nests.

Each environment case changes one ADAPTIVE_EAGER_* variable between two contexts and checks
that the next context's engine sees it, by its effect (a trace cap of 3 or 5 ops flushes a
6-op loop, counted in ``flush_reasons["trace_cap"]``) and its options; results stay eager's.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import api
from adaptive_eager.config import ConfigError

CAP = "ADAPTIVE_EAGER_MAX_TRACE_OPS"


def _six_ops() -> torch.Tensor:
    x = torch.ones(4)
    for _ in range(6):
        x = x * 1.5
    return x


WANT = _six_ops()


def _caps_hit(**options: object) -> tuple[bool, int]:
    """Run the 6-op loop in a context: (whether the trace cap flushed it, the engine's
    max_trace_ops)."""
    before = ae.metrics()["flush_reasons"].get("trace_cap", 0)
    with ae.adaptive_eager(backend="replay", **options):
        got = _six_ops()
        cap = api._state.engine.options.max_trace_ops
    assert torch.equal(got, WANT)
    return ae.metrics()["flush_reasons"].get("trace_cap", 0) > before, cap


def _changes() -> dict[str, Callable[[pytest.MonkeyPatch], None]]:
    """Ways a variable of ours can appear between two contexts; the later ones keep the raw
    environment's length and its last key as the fast check sees them."""
    def remember() -> None:  # a context's check now holds the environment as it is
        api.resolve_options({"backend": "replay"})

    def add_other_then_ours(mp: pytest.MonkeyPatch) -> None:
        mp.setenv("AE_TEST_OTHER", "x")
        mp.setenv(CAP, "3")

    def del_other_add_ours(mp: pytest.MonkeyPatch) -> None:
        mp.setenv("AE_TEST_OTHER", "x")
        remember()
        mp.delenv("AE_TEST_OTHER")
        mp.setenv(CAP, "3")  # same length

    def last_key_set_again(mp: pytest.MonkeyPatch, last: str) -> None:
        mp.setenv("AE_TEST_OTHER", "x")
        mp.setenv(last, "x")
        remember()
        mp.delenv(last)
        mp.setenv(CAP, "3")
        mp.setenv(last, "x")  # the same last key by value, and the same length:
        mp.delenv("AE_TEST_OTHER")

    return {
        "set": lambda mp: mp.setenv(CAP, "3"),
        "add other, then ours": add_other_then_ours,
        "delete another, add ours": del_other_add_ours,
        # a new key object: its identity differs
        "ours, then the last key again": lambda mp: last_key_set_again(mp, "AE_TEST_LAST"),
        # a one-byte key is a shared bytes object in CPython: the shortcut must not trust it
        "ours, then a one-byte last key again": lambda mp: last_key_set_again(mp, "Q"),
    }


@pytest.mark.parametrize("change", list(_changes()))
def test_a_variable_set_between_contexts_takes_effect(monkeypatch: pytest.MonkeyPatch,
                                                      change: str) -> None:
    monkeypatch.delenv(CAP, raising=False)
    assert _caps_hit() == (False, 4096)
    assert _caps_hit() == (False, 4096)  # the fast check's steady state
    _changes()[change](monkeypatch)
    assert _caps_hit() == (True, 3)
    assert _caps_hit() == (True, 3)


def test_a_value_changed_or_removed_between_contexts_takes_effect(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CAP, "3")
    assert _caps_hit() == (True, 3)
    monkeypatch.setenv(CAP, "5")
    assert _caps_hit() == (True, 5)
    monkeypatch.setenv(CAP, "5")  # the same value again (a new object): same options
    first = api.resolve_options({"backend": "replay"})
    assert _caps_hit() == (True, 5)
    assert api.resolve_options({"backend": "replay"}) is first
    monkeypatch.delenv(CAP)
    assert _caps_hit() == (False, 4096)


def test_other_variables_keep_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A variable of another program's changing between contexts keeps the same options (and
    so the thread's standing engine, Note [contexts are rounds])."""
    with ae.adaptive_eager(backend="replay"):
        first = api._state.engine
    for i in range(3):
        monkeypatch.setenv("AE_TEST_UNRELATED", str(i))
        with ae.adaptive_eager(backend="replay"):
            assert api._state.engine is first
    monkeypatch.delenv("AE_TEST_UNRELATED")
    with ae.adaptive_eager(backend="replay"):
        assert api._state.engine is first


def test_a_bad_value_set_between_contexts_is_refused_then_forgotten(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _caps_hit() == (False, 4096)
    monkeypatch.setenv(CAP, "0")
    with pytest.raises(ConfigError, match=CAP):
        ae.adaptive_eager(backend="replay")
    monkeypatch.delenv(CAP)
    assert _caps_hit() == (False, 4096)


def test_os_environ_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A program that replaces os.environ by a plain mapping (no raw dict behind it)."""
    monkeypatch.delenv(CAP, raising=False)
    assert _caps_hit() == (False, 4096)
    monkeypatch.setattr(os, "environ", {**os.environ, CAP: "3"})
    assert _caps_hit() == (True, 3)
    os.environ[CAP] = "5"
    assert _caps_hit() == (True, 5)


def test_keyword_types_are_part_of_the_options() -> None:
    """``hot_after=1`` resolved first must not make ``hot_after=True`` (== 1) pass: a bool is
    no integer option."""
    assert _caps_hit(hot_after=1) == (False, 4096)
    with pytest.raises(ConfigError, match="hot_after"):
        ae.adaptive_eager(backend="replay", hot_after=True)
    with pytest.raises(ConfigError, match="check"):
        ae.adaptive_eager(backend="replay", check=1)
    assert _caps_hit(max_trace_ops=3) == (True, 3)
    assert _caps_hit(max_trace_ops=5) == (True, 5)


def test_one_context_object_nests_and_is_reused() -> None:
    """The same object entered inside itself and again later: the inner exit is no outermost
    one; leaving it more often than entered is an error, not a silent close."""
    ctx = ae.adaptive_eager(backend="replay")
    with ctx:
        engine = api._state.engine
        with ctx:
            y = _six_ops()
        assert api._state.engine is engine and ae.is_enabled()
        z = y + 1
    assert not ae.is_enabled() and torch._C._len_torch_dispatch_stack() == 0
    assert torch.equal(z, WANT + 1)
    with ctx:
        assert api._state.engine is engine
    with pytest.raises(RuntimeError, match="more often than entered"):
        ctx.__exit__(None, None, None)
    assert not ae.is_enabled()


def test_enable_inside_a_context_keeps_its_own_object() -> None:
    """``enable()`` inside a ``with`` and ``disable()`` after it (not nested in order): as before,
    the with's exit ends the engine it started; disable() then only unwinds its own entry."""
    with ae.adaptive_eager(backend="replay"):
        ae.enable(backend="replay")
        y = _six_ops()
    assert not ae.is_enabled()
    ae.disable()
    assert not ae.is_enabled() and torch._C._len_torch_dispatch_stack() == 0
    assert torch.equal(y, WANT)


def test_keyword_types_are_compared_per_name() -> None:
    """The same keywords in another order with a bool and an int value swapped are equal as a
    dict ({a: 1, b: True} == {b: 1, a: True}); their types in call order were equal too, so
    the invalid pair took the valid one's options unchecked."""
    ok = ae.adaptive_eager(hot_after=1, compile_async=True)
    assert (ok.options.hot_after, ok.options.compile_async) == (1, True)
    with pytest.raises(ConfigError):
        ae.adaptive_eager(compile_async=1, hot_after=True)
    again = ae.adaptive_eager(compile_async=True, hot_after=1)  # reordered, valid: the same
    assert again.options == ok.options
    with ae.adaptive_eager(compile_async=True, hot_after=1, backend="replay"):
        got = _six_ops()
    assert torch.equal(got, WANT)


def test_environment_changed_by_another_thread_while_checking() -> None:
    """A thread adding and removing a variable while this one resolves options: the check
    read the environment's last key with an iterator, which raised RuntimeError ("dictionary
    changed size during iteration") out of adaptive_eager() when the other thread ran in
    between; now that check only falls back to the full one."""
    import sys
    import threading

    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            os.environ["ADAPTIVE_EAGER_TEST_CHURN"] = "1"
            del os.environ["ADAPTIVE_EAGER_TEST_CHURN"]

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(300_000):
            assert api.resolve_options({}).max_trace_ops == 4096
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(interval)
        os.environ.pop("ADAPTIVE_EAGER_TEST_CHURN", None)
