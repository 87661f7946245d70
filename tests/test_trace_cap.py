"""Note [cap at the loop's period] (trace.py): a loop cut only by the trace cap repeats one trace."""

from __future__ import annotations

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import api
from adaptive_eager.trace import loop_period


def _loop(steps: int) -> list[torch.Tensor]:
    """A 7-op loop body, no sync, no module, no optimizer: only the cap cuts its traces."""
    torch.manual_seed(0)
    x, w = torch.randn(16), torch.randn(16)
    outs = []
    for _ in range(steps):
        x = torch.tanh(x * 0.9 + w) - 0.1 * x  # mul add tanh mul sub
        x = torch.sin(x).abs()
        outs.append(x)
    return outs


@pytest.mark.parametrize("accel", ["1", "0"])
def test_cap_flushes_repeat_one_trace(cache_dir: object, monkeypatch: pytest.MonkeyPatch,
                                      accel: str) -> None:
    monkeypatch.setenv("ADAPTIVE_EAGER_ACCEL", accel)
    ae.clear_caches()
    ae.reset_metrics()
    with ae.adaptive_eager(backend="replay", max_trace_ops=50, step_aside=False):
        outs = _loop(300)  # 2100 ops: about 42 cap flushes
        engine = api._state.engine
        cap = engine.cap
        ae.sync()
    m = ae.metrics()
    for a, b in zip(outs, _loop(300)):
        assert torch.equal(a, b)
    assert cap == 49, cap  # 7 x 7: the largest multiple of the period under the cap
    # misses: the first trace, the first ones at the loop's new phase, the last, partial one (4
    # here); every other cut hits. Unaligned, the loop's seven phases made 9 misses in 43.
    assert m["trace_misses"] <= 4 and m["trace_hits"] >= 40, m


def test_loop_period() -> None:
    def ops(seq: str) -> list[tuple[str]]:
        return [(c,) for c in seq]

    assert loop_period(ops("abc" * 10), 100) == 3
    assert loop_period(ops("xy" + "abcd" * 5 + "a"), 100) == 4  # a prefix, a partial period
    assert loop_period(ops("abac" * 4), 100) == 4
    assert loop_period(ops("a" * 9), 100) == 1
    assert loop_period(ops("abcd"), 100) == 0  # one period is no loop
    assert loop_period(ops("abc" * 10), 2) == 0  # longer than allowed
    assert loop_period([], 10) == 0
