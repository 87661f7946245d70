"""out= ops under the engine (Note [out= ops] in adaptive_eager/dispatch/outvariant.py).

Each case runs twice under the engine (the first run learns metadata, the second defers) and is
compared bitwise with plain eager: the values and metadata of every out tensor, the values the
program computes from them afterwards, and the warnings eager gives when it resizes an out.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.dispatch.opspec import OUT, POLICY_NAMES, spec_for

aten = torch.ops.aten


def _run(fn: Callable[[], Any], runs: int = 2) -> tuple[Any, Any, dict]:
    """Plain eager once; under the engine ``runs`` times (after a reseed each time): eager's
    result, the engine's last result, and the metrics of that last run."""
    def call() -> Any:
        torch.manual_seed(7)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn()
        texts = sorted(str(w.message) for w in caught if "adaptive_eager" not in str(w.message))
        return out, texts

    eager = call()
    with ae.adaptive_eager(backend="replay", check=True, step_aside=False):
        for _ in range(runs):
            ae.reset_metrics()
            got = call()
        got = _plain(got)
        m = ae.metrics()
    return eager, got, m


def _plain(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


def _same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), (a, b)
        assert torch.equal(a, b), (a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b, (a, b)


def _deferred(m: dict, op: str) -> None:
    """The out= op did not run at once (no fallback for it, no flush in the step)."""
    assert m["fallback_ops"].get(op, 0) == 0, dict(m["fallback_ops"])
    assert not any(op in r for r in m["flush_reasons"]), dict(m["flush_reasons"])
    assert m["ops_deferred"] > 0


def test_out_ops_classified() -> None:
    for op in (aten.mul.out, aten.add.out, aten.sum.IntList_out, aten.max.dim_max,
               aten.mm.out, aten.cat.out):
        assert spec_for(op).policy == OUT, (op, POLICY_NAMES[spec_for(op).policy])
    assert spec_for(aten.mul.out).functional[0].op is aten.mul.Tensor
    assert spec_for(aten.max.dim_max).functional[1] == ("max", "max_values")
    # random, data-dependent and allocating out= ops keep the run-at-once fallback
    for op in (aten.bernoulli.out, aten.nonzero.out, aten.randn.out, aten.empty.out):
        assert POLICY_NAMES[spec_for(op).policy] == "fallback", op


def _ddp_bucket() -> tuple:
    """What DDP's reducer does per parameter: ``at::mul_out(bucket_view, grad, 1/world)``."""
    w = torch.randn(6, 5, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    bucket = torch.empty(w.numel() + b.numel()).zero_()  # real (DDP allocates it so)
    views = (bucket[:30].view(6, 5), bucket[30:])
    loss = (torch.randn(3, 6) @ w + b).tanh().sum()
    loss.backward()
    for p, v in zip((w, b), views):
        torch.mul(p.grad, 0.5, out=v)  # a wrapped-number scalar, as the reducer's
    return bucket * 1, w.grad, b.grad


OUT_CASES: dict[str, tuple[Callable[[], Any], str]] = {
    "ddp_bucket_mul": (_ddp_bucket, "aten.mul.out"),
    "add_alpha": (lambda: _with_out(lambda x, o: torch.add(x, x.cos(), alpha=0.25, out=o)),
                  "aten.add.out"),
    "sum_dim": (lambda: _with_out(lambda x, o: torch.sum(x, 1, keepdim=True, out=o), (4, 1)),
                "aten.sum.IntList_out"),
    "mm": (lambda: _with_out(lambda x, o: torch.mm(x, x.t().exp(), out=o), (4, 4)),
           "aten.mm.out"),
    "cat": (lambda: _with_out(lambda x, o: torch.cat([x, x.sin()], 0, out=o), (8, 5)),
            "aten.cat.out"),
    "clamp": (lambda: _with_out(lambda x, o: torch.clamp(x, -0.5, 0.5, out=o)), "aten.clamp.out"),
    "max_dim_two_outs": (lambda: _two_outs(), "aten.max.dim_max"),
}


def _with_out(call: Callable[[torch.Tensor, torch.Tensor], Any], shape: tuple = (4, 5)) -> tuple:
    x = torch.randn(4, 5) * 2
    y = x.sin() + 1  # pending under the engine
    out = torch.empty(shape)
    ret = call(y, out)
    assert ret is out  # eager returns the out tensor itself
    return out + 0, out.sum()


def _two_outs() -> tuple:
    x = torch.randn(4, 6).exp()
    vals, idx = torch.empty(4), torch.empty(4, dtype=torch.long)
    r = torch.max(x * 3, 1, out=(vals, idx))
    assert r[0] is vals and r[1] is idx
    return vals * 1, idx + 0


@pytest.mark.parametrize("case", list(OUT_CASES))
def test_out_op_deferred_bitwise(case: str) -> None:
    fn, op = OUT_CASES[case]
    eager, got, m = _run(fn)
    _same(eager, got)
    _deferred(m, op)


def _resize(kind: str) -> tuple:
    x = torch.randn(3, 4).sin()
    if kind == "wrong_shape":  # eager resizes it and warns
        out = torch.empty(5).zero_()
    elif kind == "empty":  # eager resizes it silently
        out = torch.empty(0)
    elif kind == "dtype":  # eager casts into it
        out = torch.empty(3, 4, dtype=torch.float64).zero_()
    elif kind == "transposed":  # eager writes through its strides
        out = torch.empty(4, 3).zero_().t()
    else:  # "aliases_input": the out is the input itself
        out = x
    r = torch.mul(x, x.cos(), out=out)
    assert r is out
    return out + 0, out.shape, out.stride(), out.dtype


@pytest.mark.parametrize("kind", ["wrong_shape", "empty", "dtype", "transposed",
                                  "aliases_input"])
def test_out_op_unusual_outs_match_eager(kind: str) -> None:
    """Outs that eager resizes (with its warning, or silently), casts into, writes through
    strides, or that alias an input: the engine runs the out= op itself, as eager."""
    eager, got, _ = _run(lambda: _resize(kind))
    _same(eager, got)
    if kind == "wrong_shape":
        assert any("resized" in t for t in eager[1]), eager[1]


def test_out_op_lazy_out_shrunk_follows_eager() -> None:
    """A lazy out (made by a deferred op) that eager resizes smaller: its shape follows."""
    def fn() -> tuple:
        a = torch.randn(4)
        z = torch.randn(3, 3) * 2
        torch.add(a, 1, out=z)
        return z.shape, z + 0
    eager, got, _ = _run(fn)
    _same(eager, got)


def test_out_op_lazy_out_grown_follows_eager() -> None:
    """Growing a lazy out beyond the memory it was made with: the wrapper takes its value's
    reallocated storage (metadata.refresh_wrapper); shape and values are eager's (it raised a
    clear error before)."""
    def fn() -> tuple:
        a = torch.randn(8)
        z = torch.randn(2) * 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.cat([a, a], out=z)
        z2 = torch.ones(3) * 2
        z2.resize_(4, 3)
        z2[1:] = 0.5
        z2.resize_(6, 4)  # grown again: the storage it took is reallocated once more
        z2[3:] = 1.5  # the 12 elements it had, then new memory
        return z.shape, z + 0, z2.shape, z2 + 0
    with ae.adaptive_eager(backend="replay"):
        for _ in range(2):  # the first run of ``* 1`` learns its metadata (z is real then)
            z = torch.randn(2) * 1
            lazy = type(z).__name__ == "LazyTensor"
    assert lazy
    eager, got, _ = _run(fn)  # its last run: z and z2 lazy when they grow
    _same(eager, got)


def test_out_op_training_loop_one_trace() -> None:
    """An out= op inside a training step keeps the step one trace: bitwise with eager."""
    def fn() -> list:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        flat = torch.empty(sum(p.numel() for p in model.parameters())).zero_()
        losses = []
        for _ in range(4):
            loss = model(torch.ones(4, 8)).square().mean()
            loss.backward()
            at = 0
            for p in model.parameters():  # DDP-style: scale each grad into a flat buffer
                n = p.numel()
                torch.mul(p.grad, 0.5, out=flat[at:at + n].view_as(p))
                at += n
            opt.step()
            opt.zero_grad()
            losses.append(flat.sum().item())
        return [losses, [p.detach() + 0 for p in model.parameters()]]
    eager, got, m = _run(fn)
    _same(eager, got)
    _deferred(m, "aten.mul.out")
