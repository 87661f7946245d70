"""In-place ops whose kernel resizes the tensor they write (Note [in-place ops that resize]).

Each body runs plainly and then several rounds under the engine (the first round learns the ops,
the later ones defer what they can); every round must equal eager bitwise, shapes and strides
included.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import adaptive_eager as ae

REPLAY = dict(backend="replay", step_aside=False, check=True, compile_async=False)
FUSED = dict(backend="inductor", hot_after=2, step_aside=False, compile_async=False,
             disk_cache=False)


def _b() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(3, 4, 5, dtype=torch.float64, generator=g),
            torch.randn(3, 5, 6, dtype=torch.float64, generator=g))


def _view_of_real(x: torch.Tensor) -> dict:
    """The fuzzer's program: addbmm_ on a (1,)-shaped view of a real tensor, then views of it."""
    b1, b2 = _b()
    t = x.diagonal()
    t.addbmm_(b1, b2, beta=0.6, alpha=0.2)
    tail = t.view(-1)[1:]
    tail.mul_(-1)
    return {"t": t, "tail": tail, "sum": t.view(-1)[:3] + t.view(-1)[0], "x": x}


def _pending_self(x: torch.Tensor) -> dict:
    """addbmm_ on a pending scalar: the lazy wrapper must take the product's shape."""
    b1, b2 = _b()
    s = x.sum() * 0.5  # pending, shape ()
    s.addbmm_(b1, b2)
    return {"s": s, "rows": s.sum(1), "t": s.t() * 2}


def _same_shape_after(x: torch.Tensor) -> dict:
    """addbmm_ that does not resize, in the same rounds as one that does."""
    b1, b2 = _b()
    full = torch.zeros(4, 6, dtype=torch.float64) + x.sum()
    full.addbmm_(b1, b2)
    one = x[0, :1] * 1.0
    one.addbmm_(b1, b2)
    return {"full": full, "one": one, "both": full + one}


def _custom_op_resizes() -> Callable[[torch.Tensor], dict]:
    """A user's custom op whose kernel resizes the tensor it mutates (its fake impl cannot say
    so): found at its learning run like addbmm_."""
    lib = torch.library.Library("ae_test_resize", "FRAGMENT")  # noqa: TOR901
    lib.define("grow_(Tensor(a!) x) -> ()")

    def grow_(x: torch.Tensor) -> None:
        old = x.clone()
        x.resize_(2, *x.shape)
        x[0].copy_(old)
        x[1].copy_(old * 2)

    lib.impl("grow_", grow_, "CPU")
    lib.impl("grow_", lambda x: None, "Meta")
    _custom_op_resizes.lib = lib  # type: ignore[attr-defined]  # kept alive with the op

    def body(x: torch.Tensor) -> dict:
        t = x * 3
        torch.ops.ae_test_resize.grow_(t)
        return {"t": t, "after": t.sum(0) + 1}
    return body


BODIES = {"view_of_real": _view_of_real, "pending_self": _pending_self,
          "same_shape_after": _same_shape_after}


def _rounds(body: Callable[[torch.Tensor], dict], opts: dict, n: int = 4) -> None:
    x = torch.randn(1, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xe, xa = x.clone(), x.clone()
    for i in range(n):
        eager = body(xe)
        with ae.adaptive_eager(**opts):
            got = body(xa)
        ae.sync()
        for k, e in eager.items():
            g = got[k]
            assert (g.shape, g.stride()) == (e.shape, e.stride()), (i, k)
            if opts["backend"] == "replay":
                assert torch.equal(g, e), (i, k)
            else:
                torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12, msg=f"round {i}, {k}")


@pytest.mark.parametrize("name", sorted(BODIES))
def test_inplace_resize_matches_eager_under_replay(name: str) -> None:
    _rounds(BODIES[name], REPLAY)


def test_inplace_resize_matches_eager_fused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    _rounds(_same_shape_after, FUSED, n=5)


def test_custom_op_that_resizes_what_it_writes() -> None:
    _rounds(_custom_op_resizes(), REPLAY)
