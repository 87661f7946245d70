"""Metadata learnt for ops whose outputs are fresh serve pending inputs at other storage offsets
(Note [fresh outputs ignore offsets] in metadata.py): a Python loop over the time steps of a pending
tensor records as one trace after its first pass, results and metadata equal eager's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager as ae
from tests.helpers import assert_equal_tree, to_plain


def _scan(x: torch.Tensor, w: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Per-time-step work on views of a pending tensor (each at another storage offset)."""
    h = torch.zeros(x.shape[0], w.shape[1])
    u = torch.tanh(x @ w)  # pending
    outs = []
    for t in range(steps):
        a = u[:, t]  # a view of a pending tensor, offset t * width
        h = torch.exp(a * 0.1) * h + a[:, None, :].sum(1)  # pointwise, broadcast, reduction
        s = torch.softmax(h, -1) + F.layer_norm(a, a.shape[-1:])  # multi-output kernels
        outs.append(torch.cat([s, a.mul(2)], -1))
    outs.append(torch.stack(outs[:steps], 1).sum(1))
    return outs


def _run(fn: Callable[[], list[torch.Tensor]], **options: object) -> tuple[list, dict]:
    with ae.adaptive_eager(backend="replay", check=True, step_aside=False, **options):
        got = to_plain(fn())
        m = ae.metrics()
    return got, m


def _inputs(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, steps, generator=g).transpose(1, 2).contiguous(), \
        torch.randn(8, 6, generator=g)


@pytest.mark.parametrize("steps", [6, 12])
def test_a_loop_over_time_steps_learns_each_op_once(steps: int) -> None:
    x, w = _inputs(steps)
    expected = _scan(x, w, steps)
    got, m = _run(lambda: _scan(x, w, steps))
    assert_equal_tree(expected, got)
    for e, g in zip(expected, got):
        assert e.stride() == g.stride() and e.storage_offset() == g.storage_offset()
    # the ops of the loop body are learnt at its first pass; later passes differ only in the
    # offsets of their pending inputs: no eager run (and so no flush) per time step
    assert m["meta_misses"] <= 16, m["meta_misses"]
    assert sum(v for k, v in m["flush_reasons"].items() if k.startswith("new_op:")) <= 16


def _new_op_flushes() -> int:
    return sum(v for k, v in ae.metrics()["flush_reasons"].items() if k.startswith("new_op:"))


@pytest.mark.parametrize("steps", [4, 12])
def test_later_passes_of_the_loop_learn_nothing(steps: int) -> None:
    """The first pass flushes where it meets a new op (the rest of that pass then runs on real
    tensors); every later pass meets the same ops on pending views at other offsets only."""
    x, w = _inputs(steps)
    expected = [_scan(x, w, steps) for _ in range(4)]
    with ae.adaptive_eager(backend="replay", check=True, step_aside=False):
        got = [to_plain(_scan(x, w, steps))]
        ae.sync()
        learnt_first = _new_op_flushes()
        for _ in range(3):
            got.append(to_plain(_scan(x, w, steps)))
            ae.sync()
        later = _new_op_flushes() - learnt_first
    assert_equal_tree(expected, got)
    assert learnt_first >= 1 and later == 0, (learnt_first, later)


def _unsafe_views(x: torch.Tensor) -> list[torch.Tensor]:
    """``_unsafe_view`` shares its input's storage with no alias annotation: its output's offset
    follows the input's, so its metadata must stay keyed by offset."""
    y = x * 1.0  # pending
    return [torch.ops.aten._unsafe_view(y[i], (2, 3)) for i in range(4)]


def test_outputs_that_share_storage_keep_their_offsets() -> None:
    x = torch.randn(4, 6)
    expected = _unsafe_views(x)
    with ae.adaptive_eager(backend="replay", check=True, step_aside=False):
        outs = _unsafe_views(x)
        offsets = [o.storage_offset() for o in outs]  # the lazy tensors' own metadata
        got = to_plain(outs)
    assert offsets == [e.storage_offset() for e in expected] == [0, 6, 12, 18]
    assert_equal_tree(expected, got)


def test_in_place_ops_on_views_at_other_offsets_stay_exact() -> None:
    def fn() -> torch.Tensor:
        y = torch.arange(24.0).reshape(4, 6) * 1.0  # pending
        for i in range(4):
            v = y[i]
            v.add_(i)  # returns its input: keyed with the offset
            v.mul_(2)
        return y

    expected = fn()
    with ae.adaptive_eager(backend="replay", check=True, step_aside=False):
        got = to_plain(fn())
    assert_equal_tree(expected, got)
