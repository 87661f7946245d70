"""The benchmark's real-program workloads (benchmarks/real_programs.py) under the engine: every
step's logged loss bitwise equal to plain eager's, op by op (backend "replay").

A character-level GPT fed by a DataLoader with 2 worker processes, dropout and ``loss.item()``
every step; an LSTM language model with detached hidden state, ``clip_grad_norm_`` and a
hand-written SGD update. The benchmark (``python -m benchmarks --workloads char_gpt,lstm_lm``)
runs them longer and in every mode.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import adaptive_eager as ae
from benchmarks.real_programs import build_char_gpt, build_lstm_lm
from benchmarks.workloads import Bench

STEPS = 5


def _losses(build: Callable[[str, torch.device], Bench], engine: bool) -> list[float]:
    bench = build("small", torch.device("cpu"))  # seeds itself
    if engine:
        with ae.adaptive_eager(backend="replay", check=True):
            for _ in range(STEPS):
                bench.step()
    else:
        for _ in range(STEPS):
            bench.step()
    assert bench.losses is not None
    return list(bench.losses)


@pytest.mark.parametrize("build", [build_char_gpt, build_lstm_lm], ids=["char_gpt", "lstm_lm"])
def test_every_step_s_loss_equals_eager(build: Callable[[str, torch.device], Bench]) -> None:
    expected = _losses(build, engine=False)
    got = _losses(build, engine=True)
    assert len(expected) == STEPS and got == expected  # floats from .item(): bitwise
    m = ae.metrics()
    assert m["ops_deferred"] > 0 and m["trace_hits"] > 0  # the engine really ran the steps
    assert m["replay_errors"] == 0 and m["engine_errors"] == 0, m
