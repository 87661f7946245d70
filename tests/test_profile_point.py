"""Note [any call is a safe point] (aside.py): a loop in one context with no module call, no
optimizer step and no sync steps aside while the context is still open, at the next return into
the user's code; never over another profiler."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import api
from adaptive_eager.compile import policy
from adaptive_eager.calibrate import calibrate


@pytest.fixture
def aside_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimate asks to step aside after one decision (recording "costs" a second per op)."""
    calibrate()
    monkeypatch.setattr(policy, "RECORD_S", 1.0)
    monkeypatch.setattr(policy, "MIN_DECISIONS", 1)


def _loop(steps: int, seen: list[bool] | None = None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    x, w = torch.randn(16), torch.randn(16)
    outs = []
    for _ in range(steps):
        x = torch.tanh(x * 0.9 + w) - 0.1 * x
        x = torch.sin(x).abs()
        outs.append(x)
        if seen is not None:
            standing = api._state.standing
            seen.append(bool(standing is not None and standing.aside))
    return outs


def _options(cache_dir: Path, graph_backend: object) -> dict:
    # the cap (7 x 5 ops) is the only flush: no sync, module or optimizer in the loop
    return dict(backend=graph_backend.name, hot_after=2, compile_async=False,
                cache_dir=str(cache_dir), disk_cache=False, max_trace_ops=35)


def test_steps_aside_inside_one_context(aside_soon: None, cache_dir: Path,
                                        graph_backend: object) -> None:
    ae.clear_caches()
    ae.reset_metrics()
    seen: list[bool] = []
    with ae.adaptive_eager(**_options(cache_dir, graph_backend)):
        outs = _loop(600, seen)
        inside = ae.metrics()
    for a, b in zip(outs, _loop(600)):
        assert torch.equal(a, b)
    assert inside["step_asides"] == 1, inside
    first = seen.index(True)  # aside while the context is open, and stays aside
    assert all(seen[first:]) and first < 400, first
    assert sys.getprofile() is None  # the profile function took itself off


def test_another_profiler_is_left_alone(aside_soon: None, cache_dir: Path,
                                        graph_backend: object) -> None:
    ae.clear_caches()
    ae.reset_metrics()
    calls = []

    def user_profiler(frame, event, arg):  # type: ignore[no-untyped-def]
        calls.append(event)

    seen: list[bool] = []
    sys.setprofile(user_profiler)
    try:
        with ae.adaptive_eager(**_options(cache_dir, graph_backend)):
            outs = _loop(300, seen)
            assert sys.getprofile() is user_profiler
    finally:
        sys.setprofile(None)
    for a, b in zip(outs, _loop(300)):
        assert torch.equal(a, b)
    assert calls and not any(seen)  # no safe point without the profile function: at the exit
    assert ae.metrics()["step_asides"] == 1


def test_not_inside_an_autograd_node_or_a_users_mode(cache_dir: Path) -> None:
    """Pending, the profile function passes over returns inside an autograd node (a tensor
    hook) and inside a user's mode's handler, and steps aside at the next return after them."""
    from test_aside import _Counting, _request_aside

    p = torch.randn(4, 4, requires_grad=True)
    seen: list[bool] = []
    with ae.adaptive_eager(backend="replay", cache_dir=cache_dir):
        user = _Counting()
        with user:
            presence = _request_aside()
            assert presence.active and not presence.aside  # the user's mode is on top
            p.register_hook(lambda g: seen.append(presence.aside))
            (torch.randn(4, 4) @ p).sum().backward()
            assert presence.active and not presence.aside
        torch.ones(2).add(1)  # a return in plain Python: steps aside now
        assert presence.aside and not presence.active
    assert seen == [False] and user.calls > 0
    assert not torch._C._len_torch_dispatch_stack() and sys.getprofile() is None
