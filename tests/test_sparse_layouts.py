"""Sparse weights under the engine: a storage-less tensor counts as touching the pending trace
(Trace.touches_storage), so syncs on it flush instead of asking it for a storage."""

from __future__ import annotations

import pytest
import torch

import adaptive_eager as ae

from conftest import assert_same


def _linear_grads(layout: str) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    w = m.weight.detach()
    m.weight = torch.nn.Parameter(
        w.to_sparse() if layout == "coo" else getattr(w, f"to_sparse_{layout}")())
    inp = torch.randn(4, requires_grad=True)
    res = m(inp)
    # a sync on the result while the sparse weight is an input of the pending trace
    torch.testing.assert_close(res, torch.einsum("i,ji->j", inp, m.weight.to_dense()) + m.bias)
    grads = torch.autograd.grad(res, [m.weight, inp], torch.ones(4))
    return res, grads[0].to_dense(), grads[1]


@pytest.mark.filterwarnings("ignore:Sparse CS")
@pytest.mark.parametrize("layout", ["coo", "csr", "csc"])
def test_sparse_weight_linear_autograd_equals_eager(layout: str) -> None:
    want = _linear_grads(layout)
    with ae.adaptive_eager(backend="replay", step_aside=False, check=True):
        for _ in range(3):  # the trace repeats
            got = _linear_grads(layout)
            for w, g in zip(want, got, strict=True):
                assert_same(g, w)


def test_a_storage_less_tensor_touches_a_trace_with_inputs() -> None:
    from adaptive_eager.trace import Trace

    csr = torch.eye(3).to_sparse_csr()
    tr = Trace(None)
    assert not tr.touches_storage(csr)  # nothing pending: no flush needed
    tr.register(torch.ones(3))
    assert tr.touches_storage(csr)  # its parts may be the trace's inputs: flush first
