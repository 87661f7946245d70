"""Real Hugging Face models (built from tiny configs, no downloads) under the engine.

Op by op (``backend="replay"``) results are compared bitwise with eager; fused programs
(``backend="inductor"``) within rtol=1e-4, atol=1e-5 on losses and logits.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import adaptive_eager as ae
from helpers import assert_equal_tree, eager_and_engine

transformers = pytest.importorskip("transformers")


def _gpt2() -> Any:
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=4, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    return transformers.GPT2LMHeadModel(config)


def _llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def _train(build: Any, steps: int = 4) -> list:
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 96, (2, 16))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    return losses


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama-sdpa"])
def test_training_bitwise_op_by_op(build: Any) -> None:
    expected, got = eager_and_engine(lambda: _train(build))
    assert_equal_tree(expected, got)
    assert ae.metrics()["ops_deferred"] > 0


def _generate() -> list:
    model = _gpt2().eval()
    ids = torch.randint(0, 96, (1, 5))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        logits = model(out).logits
    return [out, logits]


def test_generate_matches_eager() -> None:
    expected, got = eager_and_engine(_generate)
    assert_equal_tree(expected, got)


@pytest.mark.slow
def test_llama_sdpa_training_fused_within_tolerance(cache_dir: Any) -> None:
    torch.manual_seed(0)
    expected = _train(_llama, steps=6)
    torch.manual_seed(0)
    with ae.adaptive_eager(hot_after=2, compile_async=False, cache_dir=cache_dir,
                           step_aside=False):
        got = _train(_llama, steps=6)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-4, atol=1e-5)
    assert ae.metrics()["compiles"] >= 1
