"""Symbolic dimensions (Note [symbolic dims] in adaptive_eager/shapes.py).

Every test runs the same function in plain eager first and then under the engine (op by op,
``backend="replay"``, metadata checks on) for several sequence lengths, and compares each
result bitwise, with its strides.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import shapes, sizefit
from conftest import assert_same

LEARN = [5, 7, 9, 11, 13, 6, 8, 10, 12, 14, 15, 18, 19, 21]  # fits need 3 sizes (4 for T*T strides)
NEW = [20, 33, 17, 40, 27]  # sizes never seen before


def _block() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    return torch.nn.Linear(16, 48), torch.nn.LayerNorm(16)


def _attention(lin: torch.nn.Module, ln: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A tiny causal attention block, HF-free: view sizes from x.shape, a mask slice, arange."""
    B, T, C = x.shape
    q, k, v = lin(ln(x)).split(16, dim=2)
    q = q.view(B, T, 2, 8).transpose(1, 2)
    k = k.view(B, T, 2, 8).transpose(1, 2)
    v = v.view(B, T, 2, 8).transpose(1, 2)
    att = q @ k.transpose(-2, -1) * 0.3
    mask = torch.ones(64, 64).tril()[:T, :T]
    att = att.masked_fill(mask == 0, float("-inf")).softmax(-1)
    y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
    return y + torch.arange(T).view(1, T, 1)


def _run(fn, xs: list[torch.Tensor], **opts) -> tuple[list[torch.Tensor], list[dict]]:
    outs, deltas = [], []
    with ae.adaptive_eager(check=True, backend="replay", **opts):
        for x in xs:
            before = ae.metrics()
            y = fn(x)
            ae.sync()
            outs.append(y)
            after = ae.metrics()
            deltas.append({k: after[k] - before[k] for k in (
                "trace_hits", "trace_misses", "meta_misses", "sym_ops", "sym_hits")})
    return outs, deltas


def _same_all(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want):
        assert_same(g, w)
        assert g.stride() == w.stride()


def test_forward_learns_then_hits_without_eager_runs() -> None:
    lin, ln = _block()
    xs = [torch.randn(2, t, 16) for t in LEARN + NEW]
    want = [_attention(lin, ln, x) for x in xs]
    got, deltas = _run(lambda x: _attention(lin, ln, x), xs)
    _same_all(got, want)
    m = ae.metrics()
    assert m["sym_learned"] >= 1 and m["sym_mispredicted"] == 0
    for d in deltas[-4:]:  # new sizes once learnt: one trace, a trie hit, no op run to learn
        assert d["meta_misses"] == 0, d
        assert d["trace_hits"] == 1 and d["trace_misses"] == 0, d
        assert d["sym_hits"] == 1, d
    assert any("aten.native_layer_norm" in k for k in m["sym_dims"]), m["sym_dims"]


def test_off_switch_keeps_static_keys() -> None:
    lin, ln = _block()
    xs = [torch.randn(2, t, 16) for t in LEARN + NEW]
    want = [_attention(lin, ln, x) for x in xs]
    got, deltas = _run(lambda x: _attention(lin, ln, x), xs, symbolic_dims=False)
    _same_all(got, want)
    assert ae.metrics()["sym_ops"] == 0
    assert all(d["meta_misses"] > 0 for d in deltas[len(LEARN):])


def test_predicted_metadata_equals_eager_each_size() -> None:
    """Every lazy output's sizes and strides as Python sees them, before any value is read."""
    lin, ln = _block()
    seen: list[list] = []
    want_meta: list[list] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = ln(x)
        a = h.view(B * T, C)
        s = (a @ a.t()).softmax(-1)
        r = s.reshape(B, T, B * T)[:, :, :T]
        seen.append([(t.shape, t.stride()) for t in (h, a, s, r)])
        return r

    xs = [torch.randn(2, t, 16) for t in LEARN + NEW]
    for x in xs:
        fn(x)
    want_meta, seen = seen, []
    _run(fn, xs)
    assert seen == want_meta
    assert ae.metrics()["sym_ops"] > 0


def test_backward_bitwise() -> None:
    lin, ln = _block()
    xs = [torch.randn(2, t, 16) for t in LEARN + NEW]

    def step(x: torch.Tensor) -> torch.Tensor:
        lin.zero_grad()
        ln.zero_grad()
        x = x.clone().requires_grad_()
        loss = _attention(lin, ln, x).square().mean()
        loss.backward()
        return torch.cat([lin.weight.grad.flatten(), ln.weight.grad, x.grad.flatten()])

    want = [step(x) for x in xs]
    got, deltas = _run(step, xs)
    _same_all(got, want)
    assert ae.metrics()["sym_mispredicted"] == 0
    assert sum(d["meta_misses"] for d in deltas[len(LEARN):]) == 0


def test_guard_sizes_zero_and_one_run_static() -> None:
    lin, ln = _block()
    xs = [torch.randn(2, t, 16) for t in LEARN + [1, 0, 1, 21]]
    fn = lambda x: (ln(x) * 2).sum(1)  # noqa: E731
    want = [fn(x) for x in xs]
    got, deltas = _run(fn, xs)
    _same_all(got, want)
    assert ae.metrics()["sym_guard_fallbacks"] >= 1
    assert deltas[-4]["sym_ops"] == 0 and deltas[-3]["sym_ops"] == 0  # s = 1, s = 0: static
    assert deltas[-1]["sym_hits"] == 1 and deltas[-1]["meta_misses"] == 0


def test_constant_dim_equal_to_s_stays_static() -> None:
    """A width of 16 that equals the length once must not become symbolic."""
    w = torch.randn(16, 16)
    fn = lambda x: (x @ w).relu()  # noqa: E731
    xs = [torch.randn(t, 16) for t in [16, 5, 9, 12, 30, 16, 7]]
    want = [fn(x) for x in xs]
    got, deltas = _run(fn, xs)
    _same_all(got, want)
    assert deltas[-1]["sym_hits"] == 1 and deltas[-1]["meta_misses"] == 0
    for tpl in shapes.STATE.templates:
        for key, _ksym, _out, _osym in tpl.steps:
            for part in key[1:]:  # the weight [16, 16] stays a plain external
                if isinstance(part, tuple) and len(part) == 3 and isinstance(
                        part[1], sizefit.ExtPat):
                    assert part[1].size[1] == 16


def test_wrong_prediction_is_caught_counted_and_result_is_eager() -> None:
    fn = lambda x: (x * 2).sum(-1, keepdim=True)  # noqa: E731
    xs = [torch.randn(3, t) for t in [5, 7, 9, 11, 13, 6, 8]]
    want = [fn(x) for x in xs]
    got, _ = _run(fn, xs)
    _same_all(got, want)
    assert shapes.STATE.templates
    # Corrupt what was learnt: the strides of the product x * 2 become 7.
    for tpl in shapes.STATE.templates:
        for _k, _ks, out, osym in tpl.steps:
            if osym:
                out.stride = tuple(7 for _ in out.stride)
                out.memo.clear()
    x = torch.randn(3, 23)
    with ae.adaptive_eager(backend="replay"):  # check off: only the symbolic check runs
        y = fn(x)
        ae.sync()
    assert ae.metrics()["sym_mispredicted"] == 1
    assert_same(y, fn(x))
    assert y.stride() == fn(x).stride()
    assert all(t.dead for t in shapes.STATE.templates)


_CHILD = textwrap.dedent("""
    import json, sys, torch
    import adaptive_eager as ae
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(16)
    fn = lambda x: (ln(x) * 2).sum(1)
    out = []
    with ae.adaptive_eager(backend="replay", check=True):
        for t in [int(a) for a in sys.argv[1:]]:
            x = torch.randn(2, t, 16)
            before = ae.metrics()["meta_misses"]
            y = fn(x)
            ae.sync()
            assert torch.equal(y, fn(x))
            out.append(ae.metrics()["meta_misses"] - before)
    m = ae.metrics()
    print(json.dumps({"misses": out, "loaded": m["sym_loaded"], "learned": m["sym_learned"],
                      "hits": m["sym_hits"]}))
""")


def test_learnt_dims_persist_across_processes(cache_dir) -> None:
    env = dict(os.environ, ADAPTIVE_EAGER_CACHE_DIR=str(cache_dir))

    def child(*sizes: int) -> dict:
        res = subprocess.run([sys.executable, "-c", _CHILD, *map(str, sizes)], env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout.strip().splitlines()[-1])

    first = child(5, 7, 9, 11, 13, 6)
    assert first["learned"] >= 1
    from adaptive_eager.report import build_report, format_report

    text = format_report(build_report(cache_dir, last=True))
    assert "symbolic dims: " in text and "native_layer_norm" in text, text
    second = child(21, 34)
    assert second["loaded"] >= 1
    assert second["misses"] == [0, 0] and second["hits"] >= 2


@pytest.mark.slow  # about 25 s of CPU, over a minute on the shared machine
def test_gpt2_variable_length_training_bitwise_and_hits() -> None:
    """A config-built GPT-2 (2 layers) trained with a new sequence length every step: losses
    and weights bitwise equal to eager's; once learnt, a new length is one trie hit per step
    with no op run to learn metadata."""
    import random

    from transformers import GPT2Config, GPT2LMHeadModel

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
        model = GPT2LMHeadModel(cfg)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    rng = random.Random(0)
    lens = rng.sample(range(16, 64), 22)
    data = [torch.randint(0, 64, (2, t), generator=torch.Generator().manual_seed(t)) for t in lens]

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, rec: list | None) -> list:
        losses = []
        for x in data:
            before = ae.metrics() if rec is not None else None
            opt.zero_grad()
            loss = model(x, labels=x).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if rec is not None:
                after = ae.metrics()
                rec.append({k: after[k] - before[k] for k in ("trace_hits", "trace_misses",
                                                             "meta_misses", "flushes")})
        return losses

    model, opt = make()
    want = train(model, opt, None)
    want_w = [p.detach().clone() for p in model.parameters()]
    model, opt = make()
    rec: list = []
    with ae.adaptive_eager(backend="replay", check=True, step_aside=False):
        got = train(model, opt, rec)
    assert got == want
    for p, w in zip(model.parameters(), want_w):
        assert_same(p.detach(), w)
    m = ae.metrics()
    assert m["sym_mispredicted"] == 0 and m["engine_errors"] == 0
    last = rec[-5:]  # lengths never seen before, each
    assert sum(r["meta_misses"] for r in last) == 0, rec
    assert sum(r["trace_hits"] for r in last) >= 4, rec


def test_sizes_seen_before_the_fit_meet_the_template() -> None:
    """Note [static paths below a template]: sizes recorded before the fit lose their static
    paths, so a later run at such a size is the template's entry (one trace, one program)
    rather than a static trace that would become hot and compile for that size alone."""
    lin, ln = _block()
    xs = [torch.randn(2, t, 16, generator=torch.Generator().manual_seed(t))
          for t in LEARN + [15, 18, 21]]  # whole traces recorded before the fit
    want = [_attention(lin, ln, x) for x in xs]
    got, deltas = _run(lambda x: _attention(lin, ln, x), xs)
    _same_all(got, want)
    assert all(d["sym_hits"] == 1 and d["meta_misses"] == 0 for d in deltas[-3:]), deltas
