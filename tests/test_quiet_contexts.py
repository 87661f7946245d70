"""Note [quiet contexts] (aside.py): aside, a context's entry and exit only count.

Each test runs the same program with the quiet path on and with it off (``_note_quiet`` never
marking the presence quiet: every context takes the full path), and asks for the same results,
bitwise eager's, and the same engine behaviour: which contexts reached the engine, how often it
stepped aside and probed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import api
from adaptive_eager.compile import policy
from adaptive_eager.aside import Presence
from adaptive_eager.calibrate import calibrate


def _small(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        x = torch.tanh(x * 0.9 + w) - 0.1 * x
    return x


@pytest.fixture
def aside_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimate asks to step aside after one decision (recording "costs" a second per op)."""
    calibrate()
    monkeypatch.setattr(policy, "RECORD_S", 1.0)
    monkeypatch.setattr(policy, "MIN_DECISIONS", 1)
    monkeypatch.setattr(policy, "PROBE_FLUSHES", 5)


def _quiet_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Presence, "_note_quiet", lambda self: None)


def _run(calls: int, options: dict, inside=None) -> tuple[list[torch.Tensor], list[int], int]:
    """Each call in its own context; results, ops intercepted per context, quiet contexts."""
    torch.manual_seed(0)
    x, w = torch.randn(8), torch.randn(8)
    outs, per_call, quiet = [], [], 0
    for i in range(calls):
        before = ae.metrics()["ops_intercepted"]
        standing = api._state.standing
        quiet += bool(standing is not None and standing.quiet)
        with ae.adaptive_eager(**options):
            out = _small(x, w)
            if inside is not None:
                inside(i, out)
        outs.append(out)
        per_call.append(ae.metrics()["ops_intercepted"] - before)
    return outs, per_call, quiet


def _fresh() -> None:
    ae.clear_caches()
    ae.reset_metrics()


def _options(cache_dir: Path, graph_backend: object, probe_every: int = 1000) -> dict:
    return dict(backend=graph_backend.name, hot_after=2, compile_async=False,
                cache_dir=str(cache_dir), disk_cache=False, probe_every=probe_every)


def _eager(calls: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    x, w = torch.randn(8), torch.randn(8)
    return [_small(x, w) for _ in range(calls)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert type(u) is torch.Tensor and torch.equal(u, v), (u, v)


def test_quiet_contexts_change_nothing_but_the_path(monkeypatch: pytest.MonkeyPatch,
                                                    cache_dir: Path, graph_backend: object,
                                                    aside_soon: None) -> None:
    """Aside, probing after probe_every contexts, aside again: the same with and without the
    quiet path, context by context; most contexts aside were quiet."""
    options = _options(cache_dir, graph_backend, probe_every=10)
    outs, per_call, quiet = _run(90, options)
    m = ae.metrics()
    _same(outs, _eager(90))
    assert m["step_asides"] >= 2 and quiet >= 10, (m, quiet)
    _fresh()
    _quiet_off(monkeypatch)
    outs_off, per_call_off, quiet_off = _run(90, options)
    m_off = ae.metrics()
    _same(outs_off, _eager(90))
    assert quiet_off == 0
    assert per_call == per_call_off  # the same contexts reached the engine
    for key in ("step_asides", "flushes", "trials", "kept_fused", "kept_replay"):
        assert m[key] == m_off[key], (key, m, m_off)


def test_an_optimizer_step_in_a_quiet_context_makes_steps_the_rounds(
        monkeypatch: pytest.MonkeyPatch, cache_dir: Path, graph_backend: object,
        aside_soon: None) -> None:
    """A step inside a quiet context is counted as in any other: rounds are optimizer steps
    from then on, and the presence is no longer quiet."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    steps_at: list[int] = []

    def inside(i: int, out: torch.Tensor) -> None:
        standing = api._state.standing
        if i >= 40 and standing.aside and not steps_at:
            steps_at.append(i)
            p.grad = torch.ones(4)
            opt.step()

    _, _, quiet = _run(60, _options(cache_dir, graph_backend), inside)
    standing = api._state.standing
    assert steps_at and quiet >= 1, (steps_at, quiet)
    assert standing.ticks_from == "step" and not standing.quiet
    assert torch.equal(p.detach(), torch.full((4,), 0.9))


def test_clear_caches_between_quiet_contexts_starts_a_new_engine(
        cache_dir: Path, graph_backend: object, aside_soon: None) -> None:
    _run(40, _options(cache_dir, graph_backend))
    standing = api._state.standing
    assert standing.quiet, "expected to be aside between contexts"
    ae.clear_caches()
    with ae.adaptive_eager(**_options(cache_dir, graph_backend)):
        assert api._state.presence is not standing
        y = torch.ones(3) * 2
    assert torch.equal(y, torch.full((3,), 2.0))


def test_an_exception_leaves_a_quiet_context_like_any_other(
        cache_dir: Path, graph_backend: object, aside_soon: None) -> None:
    options = _options(cache_dir, graph_backend)
    _run(40, options)
    standing = api._state.standing
    assert standing.quiet
    before = standing.steps_aside
    with pytest.raises(ValueError, match="user error"):
        with ae.adaptive_eager(**options):
            raise ValueError("user error")
    assert not ae.is_enabled() and not standing.in_context
    assert standing.steps_aside == before + 1  # a round like any other
    assert torch._C._len_torch_dispatch_stack() == 0


def test_nested_contexts_while_quiet(cache_dir: Path, graph_backend: object,
                                     aside_soon: None) -> None:
    options = _options(cache_dir, graph_backend)
    _run(40, options)
    standing = api._state.standing
    assert standing.quiet
    x = torch.randn(8)
    with ae.adaptive_eager(**options):
        with ae.adaptive_eager(**options):
            y = x * 3
        assert ae.is_enabled()
        z = y + 1
    assert not ae.is_enabled()
    assert torch.equal(z, x * 3 + 1)


def test_a_probe_of_contexts_that_record_nothing_ends(aside_soon: None, cache_dir: Path,
                                                      graph_backend: object,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [probes back off]: a probe among contexts with no op (no flush) ends after
    PROBE_ROUNDS rounds; it used to keep the engine on for good."""
    from adaptive_eager import aside

    monkeypatch.setattr(aside, "PROBE_ROUNDS", 30)
    _fresh()
    options = _options(cache_dir, graph_backend, probe_every=10)
    outs, per_call, _ = _run(30, options)
    _same(outs, _eager(30))
    presence = api._state.standing
    x, w = torch.randn(8), torch.randn(8)
    for _ in range(100):  # contexts with ops until this one ends aside (a probe may be on)
        if presence.aside:
            break
        with ae.adaptive_eager(**options):
            _small(x, w)
    assert presence.aside, per_call
    asides = ae.metrics()["step_asides"]
    states = []
    for _ in range(200):  # a probe starts after 10 empty contexts, ends 30 later
        with ae.adaptive_eager(**options):
            pass
        states.append(presence.aside)
    assert ae.metrics()["step_asides"] > asides, states
    assert states[-1] or not all(states[-30:]), states
    first_probe = states.index(False)
    assert first_probe <= 20 and all(states[first_probe + 31:first_probe + 40]), states
    # and the calls after it still give eager's results
    outs, _, _ = _run(5, options)
    _same(outs, _eager(5))
