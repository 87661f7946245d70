"""Shared fixtures: every test starts with empty in-process caches and zeroed counters."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import adaptive_eager as ae


@pytest.fixture(autouse=True)
def _fresh_engine_state() -> Iterator[None]:
    from adaptive_eager.compile import jobs

    ae.disable()
    ae.clear_caches()
    ae.reset_metrics()
    jobs._service_broken = None  # a test that broke its service does not break the next one's
    yield
    ae.disable()


@pytest.fixture
def engine():
    """Enter the engine (op-by-op replay, metadata checks on); yields the metrics function."""
    with ae.adaptive_eager(check=True, backend="replay"):
        yield ae.metrics


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bitwise equality, including dtype and shape (NaNs compare equal)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and torch.equal(
        a.nan_to_num(), b.nan_to_num()), (a, b)


@pytest.fixture(scope="session", autouse=True)
def _private_inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Inductor's own cache lives in this session's temp folder, never the user's."""
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    yield
    if old is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test gets its own engine cache folder (the user's is never touched)."""
    path = tmp_path_factory.mktemp("ae-cache") / "cache"
    monkeypatch.setenv("ADAPTIVE_EAGER_CACHE_DIR", str(path))
    return path


@pytest.fixture(autouse=True)
def _stop_compile_services(cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
                           request: pytest.FixtureRequest) -> Iterator[None]:
    """A compile service a test started (Note [compile service]) does not outlive the test: the
    test's own is stopped, any other exits after 10 idle seconds. Only modules that say
    ``COMPILE_SERVICE = True`` compile through the service; the others were written for the
    per-process compile helper (its faults, its exit) and keep it."""
    monkeypatch.setenv("ADAPTIVE_EAGER_SERVICE_IDLE_S", "10")
    if not getattr(request.module, "LEARNING_BUDGET", False):
        # Note [learning budget]: the tests count what the engine does from the first op on;
        # the modules that say ``LEARNING_BUDGET = True`` test the default budget
        monkeypatch.setenv("ADAPTIVE_EAGER_BUDGET", "0")
    if not getattr(request.module, "COMPILE_SERVICE", False):
        monkeypatch.setenv("ADAPTIVE_EAGER_COMPILE_SERVICE", "0")
    yield
    from adaptive_eager import service

    if (cache_dir / "service" / service.sock_name()).exists():
        service.stop(cache_dir)


@pytest.fixture
def graph_backend() -> Iterator[object]:
    """``helpers.GraphProgramBackend`` registered under its name for one test."""
    from helpers import GraphProgramBackend, registered

    with registered(GraphProgramBackend()) as backend:
        yield backend
