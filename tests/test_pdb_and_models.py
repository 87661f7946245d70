"""Debugging and real models: pdb at a breakpoint, and a Hugging Face model trained under the engine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import adaptive_eager as ae
from helpers import assert_equal_tree, eager_and_engine

_PDB_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import adaptive_eager as ae

    def main(use_engine):
        torch.manual_seed(0)
        w = torch.randn(3, 3, requires_grad=True)
        x = torch.randn(2, 3)
        ctx = ae.adaptive_eager(backend="replay") if use_engine else None
        if ctx:
            ctx.__enter__()
        for _ in range(3):  # warm: the last iteration is fully deferred
            y = (x @ w).tanh() * 2
            x.add_(0.5)
        breakpoint()
        if ctx:
            ctx.__exit__(None, None, None)

    main(sys.argv[1] == "engine")
""")


def _run_under_pdb(tmp_path: Path, mode: str) -> str:
    script = tmp_path / "prog.py"
    script.write_text(_PDB_SCRIPT)
    commands = "p y\np x\np y.shape\np (y * 0 + 1).sum().item()\nc\n"
    proc = subprocess.run([sys.executable, str(script), mode], input=commands, text=True,
                          capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONBREAKPOINT": "pdb.set_trace"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.replace(str(script), "prog.py")


def test_pdb_prints_lazy_tensor_like_eager(tmp_path: Path) -> None:
    eager_out = _run_under_pdb(tmp_path, "eager")
    engine_out = _run_under_pdb(tmp_path, "engine")
    assert "grad_fn=<MulBackward0>" in eager_out
    assert engine_out == eager_out


def _tiny_llama_training(steps: int = 3) -> list:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 16))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_hf_tiny_llama_trains_bitwise() -> None:
    expected, got = eager_and_engine(_tiny_llama_training)
    assert_equal_tree(expected, got)
    assert ae.metrics()["ops_deferred"] > 0
