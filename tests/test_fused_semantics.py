"""Fused programs keep eager's semantics: aliasing of outputs, in-place writes through views,
tensor-valued scalar arguments (Note [output aliasing] in graph.py).

Each test runs a loop under the Inductor backend often enough that its traces turn hot and run
fused, and compares every step with plain eager on the same inputs (float32 tolerance below).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import adaptive_eager as ae

RTOL, ATOL = 1e-5, 1e-6  # Inductor's float32 programs against eager
FAST = {"backend": "inductor", "hot_after": 2, "step_aside": False, "compile_async": False,
        "compile_process": False, "disk_cache": False}


def _fused(fn: Callable[[], list[torch.Tensor]]) -> tuple[list[torch.Tensor], dict]:
    with ae.adaptive_eager(**FAST):
        got = fn()
    return got, ae.metrics()


def _check(fn: Callable[[], list[torch.Tensor]], want_fused: bool = True) -> dict:
    want = fn()
    got, m = _fused(fn)
    assert len(want) == len(got)
    for k, (a, b) in enumerate(zip(want, got)):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL, msg=lambda s: f"step {k}: {s}")
    if want_fused:
        assert m["compiled_runs"] > 0, m
    return m


# ---- outputs that alias a mutated input (foreach in-place then clone) -------------------------
def _running_mean(op: Callable[..., None]) -> Callable[[], list[torch.Tensor]]:
    def run() -> list[torch.Tensor]:
        avg = [torch.zeros(3), torch.zeros(2)]
        n = torch.tensor(0)
        outs = []
        for i in range(8):
            cur = [torch.full((3,), float(i)), torch.full((2,), 2.0 * i)]
            if n == 0:  # a sync, as torch.optim.swa_utils does
                torch._foreach_copy_(avg, cur)
            else:
                op(avg, cur, n)
            n += 1
            outs += [a.clone() for a in avg]  # program outputs (a cat of them would not be)
        return outs
    return run


@pytest.mark.parametrize("name,op", [
    # swa_utils.get_swa_multi_avg_fn: a 0-d tensor counter as the divisor list
    ("addcdiv_tensor_divisor",
     lambda avg, cur, n: torch._foreach_addcdiv_(avg, torch._foreach_sub(cur, avg),
                                                 [n + 1] * len(avg))),
    ("addcmul_tensor_factor",
     lambda avg, cur, n: torch._foreach_addcmul_(avg, torch._foreach_sub(cur, avg),
                                                 [1.0 / (n + 1)] * len(avg))),
    ("div_tensor_list",
     lambda avg, cur, n: (torch._foreach_mul_(avg, n.float()),
                          torch._foreach_add_(avg, cur),
                          torch._foreach_div_(avg, [(n + 1).float()] * len(avg)))),
])
def test_running_mean_foreach(name: str, op: Callable[..., None]) -> None:
    m = _check(_running_mean(op))
    if name != "div_tensor_list":  # there Inductor keeps the clones apart by itself
        assert m["alias_fixes"] > 0, m  # the clones came back as the inputs themselves


def test_clone_after_inplace_foreach_is_not_the_input() -> None:
    """A clone taken after an in-place foreach op is its own memory: later writes to the input
    do not show through it."""
    def run() -> list[torch.Tensor]:
        xs = [torch.ones(4), torch.ones(5)]
        snaps = []
        for i in range(6):
            torch._foreach_add_(xs, [torch.full((4,), float(i)), torch.full((5,), 1.0)])
            snaps.append([x.clone() for x in xs])
            torch._foreach_mul_(xs, 0.5)
            snaps.append([x.clone() for x in xs])
        return [torch.cat(s) for s in snaps]
    _check(run)


# ---- in-place view ops on a fused program's outputs -------------------------------------------
_INPLACE_VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "t_": lambda v: v.t_(),
    "transpose_": lambda v: v.transpose_(0, 1),
    "swapdims_": lambda v: v.swapdims_(0, 1),
    "swapaxes_": lambda v: v.swapaxes_(0, 1),
    "unsqueeze_": lambda v: v.unsqueeze_(0),
    "squeeze_": lambda v: v.unsqueeze_(0).squeeze_(0),
    "as_strided_": lambda v: v.as_strided_((5, 5), (1, 5)),
}
_WRITE_AT = {"unsqueeze_": (0, 0, 1)}


_VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "view_as": lambda t: t.view_as(t), "view": lambda t: t.view(5, 5),
    "reshape": lambda t: t.reshape(5, 5), "detach": lambda t: t.detach()}


@pytest.mark.parametrize("name", sorted(_INPLACE_VIEWS))
def test_write_through_inplace_view(name: str) -> None:
    """``v = t.view_as(t); v.t_(); v[0, 1] = 0`` must write ``t[1, 0]``; the fused program
    returned ``t`` and its same-shape view as one tensor object, so ``t_`` turned ``t`` too.
    Each in-place view op, after each way of making the view."""
    def run() -> list[torch.Tensor]:
        out = []
        for _ in range(4):
            for make in _VIEWS.values():
                t = torch.ones(5, 5) * 2
                v = _INPLACE_VIEWS[name](make(t))
                v[_WRITE_AT.get(name, (0, 1))] = 0
                out += [t.clone(), v.clone(), torch.tensor(t.stride()),
                        torch.tensor(v.stride())]
        return out
    _check(run)


def test_two_outputs_one_object_keep_their_own_metadata() -> None:
    """Each output of a program is its own tensor: a metadata change on one (``t_``,
    ``unsqueeze_``) leaves the others as they were."""
    def run() -> list[torch.Tensor]:
        out = []
        for _ in range(5):
            a = torch.arange(6.0).reshape(2, 3) + 1
            b = a.view(2, 3)
            c = a.view_as(a)
            b.t_()
            c.unsqueeze_(0)
            out += [torch.tensor(a.shape), torch.tensor(b.shape), torch.tensor(c.shape),
                    a.clone(), b.clone(), c.clone()]
        return out
    _check(run)


# ---- a fused program's inputs (Note [unrecorded op's inputs] in trace.py) ---------------------
def _nested_and_sparse() -> list[torch.Tensor]:
    torch.manual_seed(0)
    out: list[torch.Tensor] = []
    for _ in range(4):
        a, b = torch.randn(3, 4), torch.randn(5, 4)
        nt = torch.nested.nested_tensor([a, b])
        out += [t.clone() for t in (nt + 1).sin().unbind()]
        out.append(torch.nested.to_padded_tensor(nt * 2, 0.0))
        out += [t.clone() for t in torch.nested.as_nested_tensor([a * 2, b]).unbind()]
        i = torch.tensor([[0, 1, 1, 2], [2, 0, 2, 1]])
        s = torch.sparse_coo_tensor(i, a[0, :4].clone(), (3, 3))
        out.append((s + s * 2).coalesce().to_dense() + torch.sparse.mm(s, a[:3]).sum())
    return out


def test_unrecorded_op_leaves_no_inputs_behind() -> None:
    """Nested-tensor ops are not recorded after their tensor arguments were numbered: a
    program's input plan then indexed past a later run's inputs (IndexError at the user's
    line)."""
    m = _check(_nested_and_sparse, want_fused=False)
    assert m["fused_errors"] == 0, m


# ---- writes through storage shared by several inputs (Note [writes through shared storage]) ----
def _shared(body: Callable[[torch.Tensor], None]) -> Callable[[], list[torch.Tensor]]:
    def run() -> list[torch.Tensor]:
        x = torch.arange(25, dtype=torch.float32).reshape(5, 5)
        out = []
        for _ in range(5):
            body(x)
            out.append(x.clone())
            ae.sync()  # one trace per step: it repeats, turns hot and compiles
        return out
    return run


def _flip_after_add(x: torch.Tensor) -> None:  # the fuzzer's program
    x.view(-1)[1:].add_(1)
    t = x.view(-1)[1:]
    t.copy_(t.flip(0))


def _roll_after_mul(x: torch.Tensor) -> None:
    x.view(-1)[:20].mul_(0.5)
    t = x.view(-1)[1:]
    t.copy_(t.roll(3))


def _shifted_member(x: torch.Tensor) -> None:  # pointwise, but through another member
    a, b = x.view(-1)[:24], x.view(-1)[1:]
    b.copy_(a * 0.5 + 1)


def _view_of_member(x: torch.Tensor) -> None:
    a = x.view(-1)[1:]
    a.add_(1)
    a.mul_(x.t().reshape(-1)[1:] * 0.01)


@pytest.mark.parametrize("body", [_flip_after_add, _roll_after_mul, _shifted_member,
                                  _view_of_member], ids=lambda f: f.__name__)
def test_write_reading_shared_storage_elsewhere(body: Callable[[torch.Tensor], None]) -> None:
    """Inductor would run these as one in-place loop that reads what it already overwrote."""
    _check(_shared(body), want_fused=False)


def test_in_place_updates_of_a_weight_with_its_transpose_still_fuse() -> None:
    """Pointwise updates of a member by itself are safe: a weight read through its transpose
    (a second input on the same storage) and updated in place still runs fused."""
    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        w = torch.randn(8, 8)
        h = torch.randn(4, 8)
        out = []
        for _ in range(6):
            y = h @ w.t()
            g = y.t() @ h
            w.mul_(0.99)
            w.add_(g * -0.01)
            w.addcmul_(w, w, value=-1e-3)
            out.append(w.clone())
            ae.sync()
        return out
    _check(run, want_fused=True)
