"""Value-dependent errors rise at the line that made them (Note [value checks] in
adaptive_eager/dispatch/bounds.py): an out-of-bounds index raises eager's own error at its
statement, on a trace that is known (replayed or fused), and the engine goes on as eager does."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager as ae

from conftest import assert_same

X = torch.arange(12.0).view(3, 4)
ROWS_OK, ROWS_BAD = torch.tensor([2, 0]), torch.tensor([0, 3])
NEG = torch.tensor([-1, 0])
COLS = torch.tensor([[0, 1, 2, 3], [2, 1, 0, 0]])
COLS_BAD = torch.tensor([[0, 1, 2, 3], [2, 1, 0, 4]])

# name -> op(x, index): x is a pending tensor (computed under the engine) in every case
CASES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "getitem": lambda x, i: x[i] * 2,
    "getitem_2d": lambda x, i: x[i, i.clamp(max=1)] + 1,
    "index_select": lambda x, i: x.index_select(0, i) + 1,
    "index_add": lambda x, i: x.clone().index_add_(0, i, x[:2]),
    "index_copy": lambda x, i: x.clone().index_copy_(0, i, x[:2]),
    "index_fill": lambda x, i: x.clone().index_fill_(0, i, 5.0),
    "index_put": lambda x, i: x.clone().index_put_((i,), torch.tensor(7.0)),
    "take": lambda x, i: x.take(i) + 1,
    "put": lambda x, i: x.clone().put_(i, torch.tensor([1.0, 2.0])),
    "embedding": lambda x, i: F.embedding(i, x) * 2,
    "nll_loss": lambda x, i: F.nll_loss(x[:2].log_softmax(1), i),
    "cross_entropy": lambda x, i: F.cross_entropy(x[:2], i),
}
# the index each case takes, made from the row index outside the engine: a real index is
# checked when recorded; a pending one (computed in the same trace) is not (the Note)
PREP: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "take": lambda i: i * 4, "put": lambda i: i * 4,  # 12 is out of bounds for 12 elements
    "nll_loss": lambda i: i + 1, "cross_entropy": lambda i: i + 1,  # class 4 of 4
}
# cases whose index is a 2-d column index (gather and scatter run along dim 1)
ALONG: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "gather": lambda x, i: x[:2].gather(1, i) * 2,
    "scatter": lambda x, i: x[:2].clone().scatter_(1, i, 1.0),
    "scatter_add": lambda x, i: x[:2].clone().scatter_add_(1, i, x[:2]),
    "scatter_reduce": lambda x, i: x[:2].clone().scatter_reduce_(1, i, x[:2], "amax"),
}
MODES = {
    "replay": dict(backend="replay", step_aside=False, check=True),
    "fused": dict(backend="inductor", hot_after=2, compile_async=False, step_aside=False),
}


def _outcome(fn: Callable[[], torch.Tensor]) -> torch.Tensor | tuple[type, str]:
    try:
        out = fn()
        return out.clone() if out.dim() else out.reshape(1).clone()
    except (IndexError, RuntimeError) as err:
        return type(err), str(err).splitlines()[0]


def _run(op: Callable, good: torch.Tensor, bad: torch.Tensor, **engine: object) -> list:
    """Three good calls (the trace repeats), a bad one, then a good one; each raises or returns
    inside its own statement, before anything else reads the result."""
    seen = []
    for i in range(5):
        idx = bad if i == 3 else good
        with ae.adaptive_eager(**engine) if engine else _nothing():
            x = X * 1.5  # pending under the engine
            seen.append(_outcome(lambda: op(x, idx)))
    return seen


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _compare(eager: list, engine: list, exact: bool) -> None:
    for e, g in zip(eager, engine, strict=True):
        if isinstance(e, tuple):
            assert g == e  # the same error, raised inside the same statement
        elif exact:
            assert_same(e, g)
        else:
            torch.testing.assert_close(g, e)


# every case op by op; a few fused (each compiles a program)
FUSED = ("getitem", "embedding", "nll_loss")
PAIRS = [(name, "replay") for name in CASES] + [(name, "fused") for name in FUSED]


@pytest.mark.parametrize(("name", "mode"), PAIRS)
def test_out_of_bounds_index_raises_at_its_line(name: str, mode: str) -> None:
    op, prep = CASES[name], PREP.get(name, lambda i: i)
    good, bad = prep(ROWS_OK), prep(ROWS_BAD)
    eager = _run(op, good, bad)
    assert isinstance(eager[3], tuple), "the bad index must fail in eager too"
    _compare(eager, _run(op, good, bad, **MODES[mode]), mode == "replay")


@pytest.mark.parametrize(("name", "mode"),
                         [(name, "replay") for name in ALONG] + [("gather", "fused")])
def test_out_of_bounds_index_along_a_dim_raises_at_its_line(name: str, mode: str) -> None:
    op = ALONG[name]
    eager = _run(op, COLS, COLS_BAD)
    assert isinstance(eager[3], tuple)
    _compare(eager, _run(op, COLS, COLS_BAD, **MODES[mode]), mode == "replay")


@pytest.mark.parametrize("name", ["getitem", "index_fill", "index_put", "take", "index_select"])
def test_negative_indices_do_what_eager_does(name: str) -> None:
    """Negative indices wrap for some ops and raise for others: the engine does the same."""
    op = CASES[name]
    eager = _run(op, NEG, NEG)
    _compare(eager, _run(op, NEG, NEG, **MODES["replay"]), True)


def test_ignore_index_targets_stay_deferred() -> None:
    """Targets equal to ``ignore_index`` (padding labels) are in bounds: the loss is deferred
    with the rest of the step, not run at once."""
    target = torch.tensor([1, -100, 2])
    logits = torch.randn(3, 4)
    eager = F.cross_entropy(logits * 2, target)
    for _ in range(3):
        with ae.adaptive_eager(**MODES["replay"]):
            before = ae.metrics()["fallbacks"]
            loss = F.cross_entropy(logits * 2, target)
            assert ae.metrics()["fallbacks"] == before
        assert_same(loss, eager)


def test_an_error_leaves_the_pending_trace_consistent() -> None:
    """What was recorded before the failing statement still runs, and equals eager."""
    w = torch.zeros(3)
    with ae.adaptive_eager(**MODES["replay"]):
        for step in range(4):
            w.add_(1.0)
            try:
                X.index_select(0, ROWS_BAD if step == 2 else ROWS_OK)
            except IndexError:
                pass
    assert_same(w, torch.full((3,), 4.0))
