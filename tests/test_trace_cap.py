"""Note [cap at the loop's period] (trace.py): a loop cut only by the trace cap repeats one trace."""

from __future__ import annotations

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import api
from adaptive_eager.trace import SLOTS, Slot, loop_period


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
    def ops(seq: str) -> list[tuple[str, tuple]]:
        return [(c, ()) for c in seq]

    assert loop_period(ops("abc" * 10), 100) == 3
    assert loop_period(ops("xy" + "abcd" * 5 + "a"), 100) == 4  # a prefix, a partial period
    assert loop_period(ops("abac" * 4), 100) == 4
    assert loop_period(ops("a" * 9), 100) == 1
    assert loop_period(ops("abcd"), 100) == 0  # one period is no loop
    assert loop_period(ops("abc" * 10), 2) == 0  # longer than allowed
    assert loop_period([], 10) == 0


def test_loop_period_is_the_steps_not_the_inner_loops() -> None:
    """A step of 40 iterations of 5 ops whose first iteration reads the step's input from
    outside: by overloads alone it looks 5-periodic (a cap of 4095 made 40 phases)."""
    outside = torch.zeros(1)
    step: list[tuple] = []
    for it in range(40):
        y = outside if it == 0 else SLOTS[1]
        step += [("mul", (y, 0.9)), ("add", (SLOTS[2], outside)), ("tanh", (SLOTS[3],)),
                 ("mul", (y, 0.1)), ("sub", (SLOTS[4], SLOTS[5]))]
    for start in (0, 96, 150):  # a trace may start mid-step: its first ops read from outside
        trace = (step * 22)[start:start + 4096]
        trace[:3] = [(op, tuple(outside if type(a) is Slot else a for a in margs))
                     for op, margs in trace[:3]]
        assert loop_period(trace, 2048) == 200, start
    assert loop_period([("setup", ())] * 7 + (step * 21)[:4089], 2048) == 200  # a prefix
