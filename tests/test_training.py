"""Training loops under the engine equal eager bitwise: losses, parameters and gradients."""

from __future__ import annotations

import pytest
import torch

import adaptive_eager as ae
from helpers import assert_equal_tree, eager_and_engine, to_plain, train_steps


def _train(optimizer: str, steps: int = 6, dropout: bool = True) -> dict:
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, 16), torch.nn.GELU()]
    if dropout:
        layers.append(torch.nn.Dropout(0.25))
    layers += [torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)]
    model = torch.nn.Sequential(*layers)
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    elif optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    elif optimizer == "adamw_foreach":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    else:
        raise ValueError(optimizer)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    losses = train_steps(model, opt, x, y, steps)
    return {
        "losses": losses,
        "params": [to_plain(p) for p in model.parameters()],
        "grads": [to_plain(p.grad) for p in model.parameters()],
        "state": [to_plain(s) for s in opt.state.values()],
    }


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw_foreach"])
def test_mlp_training_bitwise(optimizer: str) -> None:
    expected, got = eager_and_engine(lambda: _train(optimizer))
    assert_equal_tree(expected, got)
    m = ae.metrics()
    assert m["ops_deferred"] > 0 and m["trace_hits"] > 0


def test_second_pass_through_loop_hits_trace_cache() -> None:
    w = torch.randn(16, 16)

    def step(x: torch.Tensor) -> float:
        return ((x @ w).relu() * 0.5 + 1).sum().item()

    x = torch.randn(4, 16)
    with ae.adaptive_eager(check=True, backend="replay"):
        step(x)  # first sight: every op runs once to learn its output metadata
        after_first = ae.metrics()
        step(x)  # deferred into one trace, new
        step(x)  # the same trace again: a hit
    m = ae.metrics()
    assert after_first["meta_misses"] > 0 and after_first["ops_deferred"] == 0
    assert m["meta_misses"] == after_first["meta_misses"]
    assert m["trace_misses"] == 1 and m["trace_hits"] == 1


def test_varying_python_scalar_is_not_a_new_trace() -> None:
    x = torch.randn(8)
    out = []
    with ae.adaptive_eager(check=True, backend="replay"):
        for step in range(6):
            lr = 0.1 / (step + 1)
            out.append((x * lr + lr).sum().item())
    expected = [(x * (0.1 / (s + 1)) + 0.1 / (s + 1)).sum().item() for s in range(6)]
    assert out == expected
    m = ae.metrics()
    assert m["trace_hits"] >= 4 and m["trace_misses"] == 1


def test_item_dependent_branch() -> None:
    def fn() -> list:
        x = torch.randn(10)
        seen = []
        for i in range(8):
            x = x * 1.3 - 0.2
            if x.mean().item() > 0:
                x = x.sin()
                seen.append("pos")
            else:
                x = x.cos() + 0.1
                seen.append("neg")
            seen.append(to_plain(x))
        return seen

    expected, got = eager_and_engine(fn)
    assert_equal_tree(expected, got)


def test_grad_of_leaf_matches_after_several_backwards() -> None:
    def fn() -> list:
        w = torch.randn(5, 3, requires_grad=True)
        for _ in range(3):  # .grad accumulates across backward calls
            (w.sin() * w).sum().backward()
        return [to_plain(w.grad)]

    expected, got = eager_and_engine(fn)
    assert_equal_tree(expected, got)
