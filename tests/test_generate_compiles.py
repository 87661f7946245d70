"""How many programs a generation loop compiles (at most 3 per run; Note [rare
traces] in adaptive_eager/compile/policy.py). A KV-cache decode loop makes one symbolic trace per
token, plus traces that run once per call (the prefill, the first decode step whose cache is
the prefill's transposed view, a set-up check): only the decode trace may compile.

The quick tests use ``helpers.GraphProgramBackend`` (programs are the trace graphs: compiles
are free and results bitwise eager's); the slow ones compile Hugging Face GPT-2 and Llama with
Inductor and compare within fused tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import adaptive_eager as ae
from adaptive_eager.compile import policy
from conftest import assert_same

TOKENS = 24  # new tokens per call: the decode trace runs 23 times per call, the others once
CALLS = 4  # hot_after (3) runs of the per-call traces by then (first sightings are cut short)


class TinyLM(nn.Module):
    """One GPT-2-like block with a growing KV cache (``torch.cat`` along the length)."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 2, positions: int = 128) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.h, self.d = heads, d
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor, cache: tuple | None, start: int
                ) -> tuple[torch.Tensor, tuple]:
        t = ids.shape[1]
        x = self.emb(ids) + self.pos(torch.arange(start, start + t))
        q, k, v = self.qkv(self.ln1(x)).split(self.d, -1)
        q, k, v = (z.view(1, t, self.h, self.d // self.h).transpose(1, 2) for z in (q, k, v))
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
        x = x + self.proj(a.transpose(1, 2).reshape(1, t, self.d))
        x = x + self.mlp(self.ln2(x))
        return self.head(x), (k, v)


def _generate(model: TinyLM, prompt: torch.Tensor, n: int) -> tuple[list[int], list]:
    """Greedy decoding; ``.item()`` per token is the sync point (as a stopping check is)."""
    mask = torch.ones_like(prompt)  # a set-up trace, once per call
    if not bool((mask.sum(-1) == prompt.shape[1]).all()):
        raise AssertionError("mask")
    logits, cache = model(prompt, None, 0)
    tok = logits[:, -1].argmax(-1, keepdim=True)
    out, scores = [tok.item()], [logits[:, -1]]
    for i in range(n - 1):
        logits, cache = model(tok, cache, prompt.shape[1] + i)
        tok = logits[:, -1].argmax(-1, keepdim=True)
        out.append(tok.item())
        scores.append(logits[:, -1])
    return out, scores


def _run(backend: str, grad_ctx: type, calls: int = CALLS) -> tuple[tuple, list, dict]:
    model = TinyLM().eval()
    prompt = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(7))
    with grad_ctx():
        ref = _generate(model, prompt, TOKENS)
        with ae.adaptive_eager(backend=backend, compile_async=False, step_aside=False):
            got = [_generate(model, prompt, TOKENS) for _ in range(calls)]
    return ref, got, ae.metrics()


@pytest.mark.parametrize("grad_ctx", [torch.no_grad,
                                      pytest.param(torch.inference_mode, marks=pytest.mark.slow)])
def test_generate_compiles_only_the_decode_trace(graph_backend: object, grad_ctx: type) -> None:
    ref, got, m = _run(graph_backend.name, grad_ctx)  # type: ignore[attr-defined]
    for toks, scores in got:
        assert toks == ref[0]
        for a, b in zip(scores, ref[1]):
            assert_same(a, b)  # graph programs run eager's kernels: bitwise
    assert m["sym_programs"] == 1  # the decode trace, one program for every cache length
    assert m["compiles"] == 1, m  # the prefill, first decode and set-up check stayed op by op
    assert m["compiled_runs"] > 0 and m["compile_errors"] == 0 and m["fused_errors"] == 0


def test_without_the_rule_each_per_call_trace_compiles(graph_backend: object,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The same loop with the rare-trace rule off (a ratio nothing reaches): the traces that run
    once per call compile too, as before the rule (so the test above can fail)."""
    monkeypatch.setattr(policy, "RARE_RATIO", 10 ** 9)
    ref, got, m = _run(graph_backend.name, torch.no_grad)  # type: ignore[attr-defined]
    assert all(toks == ref[0] for toks, _ in got)
    assert m["compiles"] >= 2, m  # the decode trace and at least one per-call trace


def _split_step(x: torch.Tensor, w: list[torch.Tensor]) -> float:
    """A loop step cut into three traces of similar size by ``.item()`` (a logged value)."""
    total = 0.0
    for wi, act in zip(w, (torch.tanh, torch.sigmoid, torch.relu)):  # three distinct traces
        x = act(x @ wi) * 0.5 + x
        total += x.sum().item()
    return total


def test_split_step_traces_all_compile(graph_backend: object) -> None:
    """Traces of similar size that run equally often are not rare: each compiles at hot_after."""
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(16, 16, generator=g) * 0.1 for _ in range(3)]
    x = torch.randn(4, 16, generator=g)
    ref = [_split_step(x, w) for _ in range(6)]
    with ae.adaptive_eager(backend=graph_backend.name,  # type: ignore[attr-defined]
                           compile_async=False, step_aside=False):
        got = [_split_step(x, w) for _ in range(6)]
    assert got == ref
    assert ae.metrics()["compiles"] == 3


def test_rare_trace_compiles_later_not_never(graph_backend: object) -> None:
    """Trace A runs 20 times per round, trace B (as many ops, about as long) once: B is rare
    (A ran q = 20 times as often since B's first run; the rule's ratio is 10) and compiles only
    at its run hot_after * q = 60, long after its third run, but it does compile."""
    g = torch.Generator().manual_seed(0)
    wa, wb = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    x = torch.randn(2, 8, generator=g)

    def step(w: torch.Tensor) -> float:  # two traces of 3 ops each
        return (torch.relu if w is wa else torch.sigmoid)(x @ w).sum().item()

    compiles = []
    with ae.adaptive_eager(backend=graph_backend.name,  # type: ignore[attr-defined]
                           compile_async=False, step_aside=False, hot_after=3):
        for _ in range(200):
            vals = [step(wa) for _ in range(20)] + [step(wb)]
            compiles.append(ae.metrics()["compiles"])
            if compiles[-1] == 2:
                break
    assert vals == [step(wa)] * 20 + [step(wb)]
    assert compiles[0] == 1  # A, at its third run
    assert compiles[40] == 1  # B has run about 40 times: still op by op
    assert compiles[-1] == 2 and len(compiles) < 80  # then it compiled (B's run hot_after * q)


def test_foreach_optimizer_trace_is_not_rare(graph_backend: object) -> None:
    """A step cut by ``loss.item()`` before ``opt.step()``: a 343-op forward and backward and an
    8-op AdamW foreach trace over 48 tensors, which takes about as long. Weighed by op counts
    the optimizer trace read as rare (q ~ 40); by time it is not, and both compile."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(24) for m in (nn.Linear(16, 16), nn.Tanh())])

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))

    def train(model: nn.Module) -> list[float]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        out = []
        for _ in range(6):
            opt.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            loss.backward()
            out.append(loss.item())
            opt.step()
        return out

    ref = train(build())
    with ae.adaptive_eager(backend=graph_backend.name,  # type: ignore[attr-defined]
                           compile_async=False, step_aside=False):
        got = train(build())
    assert got == ref
    assert ae.metrics()["compiles"] == 2


# ---- Hugging Face models with Inductor (slow: one dynamic-size compile per case) -----------
def _hf(arch: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2,
                                      n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.slow
@pytest.mark.parametrize("arch,grad_ctx", [("gpt2", torch.no_grad),
                                           ("llama", torch.inference_mode)])
def test_hf_generate_compiles_one_program(arch: str, grad_ctx: type) -> None:
    """benchmarks/varlen.py's generate case, shortened: 5 calls of 24 new tokens. Before the
    rule a case compiled 4-5 programs (prefill, first decode, mask set-up, a 2-op check)."""
    model = _hf(arch)
    prompt = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(7))

    def gen() -> tuple[list[int], list[torch.Tensor]]:
        out = model.generate(prompt, max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                             do_sample=False, use_cache=True, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
        return out.sequences[0].tolist(), [s.clone() for s in out.scores]

    with grad_ctx():
        ref = gen()
        with ae.adaptive_eager(compile_async=False, step_aside=False):
            got = [gen() for _ in range(5)]
    m = ae.metrics()
    for toks, scores in got:
        assert toks == ref[0]
        for a, b in zip(scores, ref[1]):
            torch.testing.assert_close(a, b, rtol=1.3e-4, atol=1e-4)  # fused tolerance
    assert m["compiles"] == 1, m
    assert m["sym_programs"] == 1 and m["compile_errors"] == 0 and m["fused_errors"] == 0
    assert m["compiled_runs"] > 0
