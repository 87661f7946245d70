"""Memory the outside can see (Note [memory the outside can see] in dispatch/outside.py).

Each program runs plainly, then several times under the engine (op-by-op replay, and fused once
its traces are hot), so its traces repeat; every read through numpy, DLPack, a file or a raw
pointer must give eager's values."""

from __future__ import annotations

import copy
import ctypes
import gc
import os
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.dispatch import outside
from adaptive_eager.dispatch.lazy import LazyTensor

RUNS = 5
MODES = {
    "replay": dict(backend="replay", step_aside=False, check=True),
    "fused": dict(backend="inductor", hot_after=2, compile_async=False, step_aside=False),
}


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _same(mode: str, want: Any, got: Any) -> None:
    if isinstance(want, (list, tuple)):
        assert type(want) is type(got) and len(want) == len(got), (want, got)
        for w, g in zip(want, got):
            _same(mode, w, g)
        return
    if isinstance(want, torch.Tensor):
        assert _kind(got) is type(want), (type(want), type(got))
        want, got = want.detach().as_subclass(torch.Tensor), got.detach().as_subclass(
            torch.Tensor)
        assert want.dtype == got.dtype and want.shape == got.shape
        want, got = want.resolve_conj().numpy(), got.resolve_conj().numpy()
    if isinstance(want, np.ndarray):
        assert want.dtype == got.dtype and want.shape == got.shape, (want, got)
        if mode == "replay":
            assert np.array_equal(want, got), (want, got)
        else:  # fused: float32 kernels of another library
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        return
    assert want == got, (want, got)


def _kind(t: torch.Tensor) -> type:
    """A tensor's type as the program sees it (a lazy tensor stands for a plain one)."""
    return torch.Tensor if type(t) is LazyTensor else type(t)


def _check(mode: str, f: Callable[[], Any], runs: int = RUNS, repeats: bool = True) -> None:
    want = f()
    with ae.adaptive_eager(**MODES[mode]):
        for _ in range(runs):
            _same(mode, want, f())
    if repeats:
        assert ae.metrics()["trace_hits"] > 0  # the traces repeated


@pytest.fixture(params=sorted(MODES))
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


# ---- torch writes, the outside reads -----------------------------------------------------------
@pytest.mark.parametrize("via", ["numpy", "asarray", "np_from_dlpack", "array_of_view"])
def test_array_of_tensor_sees_later_inplace_writes(mode: str, via: str) -> None:
    def f() -> Any:
        z = (torch.randn(6, generator=_gen()) + 5).sqrt()
        if via == "numpy":
            n = z.numpy()
        elif via == "asarray":
            n = np.asarray(z)
        elif via == "np_from_dlpack":
            n = np.from_dlpack(z)
        else:
            n = z[1:4].numpy()
        z.add_(1)
        z.mul_(2)
        return n.copy()  # a numpy read, no torch call in between

    _check(mode, f)


def test_array_of_parameter_sees_optimizer_step(mode: str) -> None:
    torch.manual_seed(0)
    start = torch.nn.Linear(4, 3).state_dict()

    def f() -> Any:
        model = torch.nn.Linear(4, 3)
        model.load_state_dict(start)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        w = model.weight.detach().numpy()  # a live view of the parameter
        seen = []
        for _ in range(3):
            loss = model(torch.ones(2, 4)).square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            seen.append(w.copy())
        return seen

    _check(mode, f)


def test_memoryview_and_bytes_of_array(mode: str) -> None:
    def f() -> Any:
        t = torch.arange(8, dtype=torch.float32) * 1.5
        mv = memoryview(t.numpy())
        t.add_(1)
        first = bytes(mv)
        t.mul_(3)
        return [np.frombuffer(first, np.float32).copy(), np.frombuffer(bytes(mv), np.float32)]

    _check(mode, f)


def test_to_dlpack_of_pending_tensor(mode: str) -> None:
    def f() -> Any:
        x = torch.randn(4, 5, generator=_gen())
        caps = torch.utils.dlpack.to_dlpack((x + 5).sqrt() * 1)
        y = torch.utils.dlpack.from_dlpack(caps)
        return y.clone()

    _check(mode, f)


def test_to_dlpack_then_inplace_write(mode: str) -> None:
    def f() -> Any:
        z = torch.randn(5, generator=_gen()) * 2
        n = np.from_dlpack(torch.from_dlpack(torch.to_dlpack(z)))
        z.add_(3)
        return n.copy()

    _check(mode, f)


def test_shared_file_mapping_sees_writes(mode: str, tmp_path: Any) -> None:
    path = str(tmp_path / "mapped.bin")

    def f() -> Any:
        with open(path, "wb") as fh:
            fh.write(b"\0" * 32)
        t = torch.from_file(path, shared=True, size=8, dtype=torch.float32)
        t.add_(2)
        t.mul_(torch.arange(8, dtype=torch.float32))
        with open(path, "rb") as fh:  # the file, read outside torch
            return np.frombuffer(fh.read(), np.float32).copy()

    _check(mode, f)


def test_shared_memory_sees_writes_through_pointer(mode: str) -> None:
    def f() -> Any:
        t = torch.zeros(6)
        t.share_memory_()
        ptr = t.data_ptr()  # the address another process maps
        seen = []
        for k in range(3):
            t.add_(k + 1)
            seen.append(np.frombuffer(ctypes.string_at(ptr, 24), np.float32).copy())
        return seen

    _check(mode, f)


# ---- the outside writes, torch reads -----------------------------------------------------------
def test_from_numpy_inplace_writes_reach_the_array(mode: str) -> None:
    def f() -> Any:
        arr = np.arange(3, dtype=np.float32)
        t = torch.from_numpy(arr)
        t.mul_(2).add_(1)
        _ = t.clone()
        other = (torch.arange(3.0) * 2).exp()  # deferred: the traces repeat
        return [arr.copy(), other]

    _check(mode, f)


@pytest.mark.parametrize("via", ["from_numpy", "as_tensor", "asarray", "from_dlpack",
                                 "frombuffer", "tensor", "as_tensor_copy", "asarray_copy"])
def test_reads_of_outside_memory_see_its_value_then(mode: str, via: str) -> None:
    def f() -> Any:
        arr = np.arange(4, dtype=np.float32)
        if via == "frombuffer":
            buf = bytearray(arr.tobytes())
            t = torch.frombuffer(buf, dtype=torch.float32)
            arr = np.frombuffer(buf, np.float32)  # a view of the same bytes
        else:
            make = {"from_numpy": torch.from_numpy, "as_tensor": torch.as_tensor,
                    "asarray": torch.asarray, "from_dlpack": torch.from_dlpack,
                    "tensor": torch.tensor,  # copies, as the two below
                    "as_tensor_copy": lambda a: torch.as_tensor(a, dtype=torch.float64),
                    "asarray_copy": lambda a: torch.asarray(a, dtype=torch.float16)}[via]
            t = make(arr)
        y = t * 2 + 1  # a torch read of the outside memory
        arr += 10  # the outside writes it before anything reads y
        z = t + 0
        return [y, z]

    _check(mode, f)


def test_copying_as_tensor_stays_deferred() -> None:
    arr = np.arange(4, dtype=np.float64)
    t = torch.as_tensor(arr, dtype=torch.float32)  # a copy: nothing escapes
    assert not outside.ESCAPED or not any(
        outside.escaped(a) for a in [t.untyped_storage().data_ptr()])


def test_escape_ends_with_the_array() -> None:
    with ae.adaptive_eager(**MODES["replay"]):
        t = torch.ones(16) * 3
        n = t.numpy()
        addr = t.untyped_storage().data_ptr()
        assert outside.escaped(addr)
        t.add_(1)
        assert n[0] == 4.0
        del n
        gc.collect()
        assert not outside.escaped(addr)
        t.add_(1)  # deferred again: nothing outside sees it
        assert t.tolist()[0] == 5.0


# ---- objects made below the dispatcher ---------------------------------------------------------
class Plain(torch.Tensor):
    pass


class WithTF(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("cls", [Plain, WithTF])
def test_as_subclass_of_lazy_and_pending(mode: str, cls: type) -> None:
    def f() -> Any:
        a = (torch.ones(3) * 2).as_subclass(cls)
        b = torch.ones(3)
        b.add_(1)  # a real tensor with a pending write
        c = b.as_subclass(cls)
        return [a, c, b]

    _check(mode, f)


def test_make_subclass_of_lazy_and_pending(mode: str) -> None:
    def f() -> Any:
        a = torch.Tensor._make_subclass(Plain, torch.ones(3) * 2)
        b = torch.ones(3)
        b.add_(1)
        c = torch.Tensor._make_subclass(Plain, b, True)
        return [a, c, torch.tensor(c.requires_grad)]

    _check(mode, f)


def test_parameter_of_lazy_and_pending(mode: str) -> None:
    def f() -> Any:
        w = torch.randn(3, generator=_gen(), requires_grad=True)
        p = torch.nn.Parameter(w * 2)  # lazy, with autograd history
        b = torch.ones(3)
        b.add_(1)
        q = torch.nn.Parameter(b)  # shares b's storage, write pending
        b.mul_(5)
        loss = (p * q).sum()
        loss.backward()
        return [p, q, p.grad, torch.tensor(p.is_leaf)]

    _check(mode, f)


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("rg", [False, True])
@pytest.mark.parametrize("conj", [False, True])
def test_numpy_force_of_complex(mode: str, rg: bool, conj: bool, lazy: bool) -> None:
    data = [[1 + 2j, -2 + 3j], [-1 - 2j, 3 - 2j]]

    def f() -> Any:
        x = torch.tensor(data, requires_grad=rg)
        if lazy:
            x = x * 1
        if conj:
            x = x.conj()
        return x.numpy(force=True).copy()

    _check(mode, f, repeats=lazy)


def test_sparse_coo_tensor_of_deferred_parts(mode: str) -> None:
    def f() -> Any:
        with torch.sparse.check_sparse_tensor_invariants():
            i = torch.tensor([[0, 1, 1]]) + 0
            v = torch.tensor([1.0, 2.0, 3.0]) * 2
            s = torch.sparse_coo_tensor(i, v, (3,))
            c = torch.sparse_csr_tensor(torch.tensor([0, 1, 2]) * 1, torch.tensor([0, 1]) + 0,
                                        torch.tensor([4.0, 5.0]) * 1, (2, 2))
        return [s.to_dense(), c.to_dense()]

    _check(mode, f)


# ---- Python-level reads of a tensor with pending writes -------------------------------------
def test_python_reads_of_pending_writes(mode: str) -> None:
    def f() -> Any:
        t = torch.arange(4, dtype=torch.float32)
        t.add_(1)
        out: list[Any] = [torch.tensor(t.tolist())]
        t.mul_(2)
        out.append(pickle.loads(pickle.dumps(t)))
        t.add_(1)
        out.append(copy.deepcopy(t))
        t.add_(1)
        out.append(torch.tensor(t.untyped_storage().tolist(), dtype=torch.uint8))
        t.add_(1)
        out.append(torch.tensor(list(t.storage())))
        t.add_(1)
        out.append(torch.from_numpy(np.frombuffer(ctypes.string_at(t.data_ptr(), 16),
                                                  np.float32).copy()))
        lazy = t * 3
        out.append(torch.tensor(lazy.tolist()))
        out.append(pickle.loads(pickle.dumps(lazy)))
        return out

    _check(mode, f)
