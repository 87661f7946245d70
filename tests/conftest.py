"""Shared fixtures: every test starts with empty in-process caches and zeroed counters."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import adaptive_eager as ae


@pytest.fixture(autouse=True)
def _fresh_engine_state() -> Iterator[None]:
    ae.disable()
    ae.clear_caches()
    ae.reset_metrics()
    yield
    ae.disable()


@pytest.fixture
def engine():
    """Enter the engine with replay metadata checks on; yields the metrics function."""
    with ae.adaptive_eager(check=True):
        yield ae.metrics


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bitwise equality, including dtype and shape (NaNs compare equal)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and torch.equal(
        a.nan_to_num(), b.nan_to_num()), (a, b)
