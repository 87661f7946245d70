"""torch.set_default_dtype changed inside a trace: ops recorded under one default dtype must
give eager's dtype and values (factory ops without a dtype, Python-float promotion of integer
tensors), whichever default is set when the trace is replayed."""

from __future__ import annotations

import torch

from helpers import assert_equal_tree, eager_and_engine, to_plain


def _steps() -> list[torch.Tensor]:
    out = []
    base = torch.arange(3)
    old = torch.get_default_dtype()
    try:
        for _ in range(4):
            a = base + 1
            torch.set_default_dtype(torch.float64)
            b = a * 0.1  # promotes to the default dtype
            f = torch.full((3,), 0.1) + 0  # a factory op with no dtype
            torch.set_default_dtype(torch.float32)
            out += [b + 0, f, torch.arange(3.0) * 0.1]
    finally:
        torch.set_default_dtype(old)
    return out


def test_default_dtype_changed_mid_trace_matches_eager() -> None:
    """Each change flushes (Note [default dtype] in dispatch/regions.py): every run, not only
    the first, gives eager's dtypes and bits."""
    expected, got = eager_and_engine(lambda: to_plain(_steps()))
    assert_equal_tree(expected, got)
    assert [t.dtype for t in got[:3]] == [torch.float64, torch.float64, torch.float32]


def test_default_dtype_change_flushes_and_is_counted() -> None:
    import adaptive_eager as ae

    old = torch.get_default_dtype()
    try:
        with ae.adaptive_eager(backend="replay"):
            for _ in range(3):
                torch.set_default_dtype(torch.float64)
                a = torch.ones(2) * 0.5
                torch.set_default_dtype(torch.float32)
                b = torch.ones(2) * 0.5
                assert a.dtype == torch.float64 and b.dtype == torch.float32
            ae.sync()
            # the first loop runs its new ops at once (first sight); then each change flushes
            assert ae.metrics()["flush_reasons"].get("default_dtype", 0) >= 3
    finally:
        torch.set_default_dtype(old)
    assert torch.get_default_dtype() is old


def test_compile_flags_carry_the_default_dtype() -> None:
    from adaptive_eager import compile_process

    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        flags = compile_process._flags()
        assert flags["default_dtype"] == "float64"
        torch.set_default_dtype(torch.float32)
        compile_process._apply_flags(flags)  # what a compile helper does with a request
        assert torch.get_default_dtype() is torch.float64
        compile_process._apply_flags(dict(flags, default_dtype="int64"))  # refused: kept
        assert torch.get_default_dtype() is torch.float64
    finally:
        torch.set_default_dtype(old)
