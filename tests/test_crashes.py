"""Features real programs combine with eager, under the engine: no crash, eager's results.

Each reproducer of the dispatch-side crashes, and the features around them (LSTM,
inference_mode/no_grad generation with a KV cache, torch.func, autograd.Function, checkpoint,
hooks, gradient accumulation, clip_grad_norm_, attention without dropout). Op by op
(``backend="replay"``) results are compared bitwise with plain eager. Code that used to kill the
process runs in a subprocess with a timeout, so a crash fails its test instead of pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint

import adaptive_eager as ae
from helpers import assert_equal_tree, eager_and_engine, to_plain

SUBPROCESS_TIMEOUT = 240


def run_isolated(code: str, cache_dir: Path) -> str:
    """Run ``code`` in a fresh interpreter; fail (not crash) on a signal, error or hang."""
    env = dict(os.environ, ADAPTIVE_EAGER_CACHE_DIR=str(cache_dir), PYTHONFAULTHANDLER="1")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, (
        f"exit status {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
        f"--- stderr\n{proc.stderr[-6000:]}")
    return proc.stdout


# ---- LSTM (mkldnn_rnn_layer reads the grad mode: Note [grad-mode kernels]) ---------------------

def _lstm_steps(layers: int, steps: int = 4, clip: bool = True) -> list:
    rnn = torch.nn.LSTM(16, 16, layers)
    opt = torch.optim.SGD(rnn.parameters(), lr=0.1)
    x = torch.randn(7, 3, 16)
    out_list = []
    for _ in range(steps):
        opt.zero_grad()
        out, (h, c) = rnn(x)
        out.sum().backward()
        if clip:  # its norm is computed under no_grad: the trace (with the forward) runs there
            out_list.append(torch.nn.utils.clip_grad_norm_(rnn.parameters(), 0.25))
        out_list += [out.detach(), h.detach(), c.detach()]
        out_list += [p.grad.clone() for p in rnn.parameters()]
        opt.step()
    out_list += [p.detach().clone() for p in rnn.parameters()]
    return to_plain(out_list)


def test_lstm_one_layer_clip_grad_norm_bitwise() -> None:
    """Was: 'expected scalar type Byte but found UNKNOWN_SCALAR' in mkldnn_rnn_layer_backward
    (the forward replayed under clip_grad_norm_'s no_grad returned no workspace)."""
    expected, got = eager_and_engine(lambda: _lstm_steps(1), step_aside=False)
    assert_equal_tree(expected, got)
    m = ae.metrics()
    assert m["ops_deferred"] > 0 and m["engine_errors"] == 0 and m["replay_errors"] == 0


def test_lstm_two_layers_backward_bitwise() -> None:
    """Was: RecursionError in lazy.materialize (the forward replayed inside backward, where the
    autograd engine runs with grad mode off, and its workspace slot got no value)."""
    expected, got = eager_and_engine(lambda: _lstm_steps(2, clip=False), step_aside=False)
    assert_equal_tree(expected, got)
    assert ae.metrics()["replay_errors"] == 0


def test_lstm_inference_then_training_keys_grad_mode() -> None:
    """The same LSTM call under no_grad (no workspace) and with grad (a workspace its backward
    reads) must not share metadata or a trace."""
    def run() -> list:
        rnn = torch.nn.LSTM(8, 8, 1)
        x = torch.randn(5, 2, 8)
        outs = []
        for _ in range(3):
            with torch.no_grad():
                outs.append(rnn(x)[0])
            y, _ = rnn(x)
            y.sum().backward()
            outs += [y.detach(), rnn.weight_ih_l0.grad.clone()]
            with torch.no_grad():
                outs.append(rnn(x)[0] * 2)
        return to_plain(outs)

    expected, got = eager_and_engine(run, step_aside=False)
    assert_equal_tree(expected, got)


@pytest.mark.slow
def test_lstm_fused_within_tolerance(cache_dir: Path) -> None:
    """With the default backend. A trace holding mkldnn_rnn_layer is not fused (graph.py: its
    kernel reads the grad mode, Note [grad-mode kernels]): no program that fails when it runs
    (``fused_errors`` was 2), values equal within tolerance, other traces may still fuse."""
    torch.manual_seed(0)
    expected = _lstm_steps(1, steps=6)
    torch.manual_seed(0)
    with ae.adaptive_eager(hot_after=2, compile_async=False, cache_dir=cache_dir,
                           step_aside=False):
        got = _lstm_steps(1, steps=6)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    assert ae.metrics()["replay_errors"] == 0
    assert ae.metrics()["fused_errors"] == 0


# ---- inference_mode (Note in metadata.view_metadata) -----------------------------------------

def test_inference_mode_view_copy_does_not_crash(cache_dir: Path) -> None:
    """Was: a segfault on the second iteration (``to(copy=True)`` of a view of a lazy tensor,
    whose metadata were taken by running it on the wrapper: a copy read absent data)."""
    out = run_isolated("""
        import torch, adaptive_eager as ae
        def run():
            got = []
            shifts = [torch.full((2, 8, 4), float(i)) for i in range(5)]
            for i in range(5):
                with torch.inference_mode():
                    x = torch.ones(2, 8, 4) * 2 + shifts[i]  # the same trace every time
                    y = x[:, -1].to(copy=True, dtype=torch.float32)
                    z = x.transpose(1, 2).reshape(2, 32).contiguous().to(torch.float64)
                    got += [y.clone(), z.clone(), torch.tensor(y.sum().item())]
            return got
        expected = run()
        with ae.adaptive_eager(backend="replay", step_aside=False, check=True):
            got = run()
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(expected, got))
        assert ae.metrics()["ops_deferred"] > 0
        print("OK")
    """, cache_dir)
    assert "OK" in out


def test_inference_mode_composite_view_waits_for_pending_writes() -> None:
    """Under inference mode ``to``/``reshape``/``contiguous`` reach the engine and may copy: a
    copy of a real tensor with a deferred in-place write must see that write."""
    def run() -> list:
        w = torch.zeros(4, 3)
        outs = []
        with torch.inference_mode():
            for _ in range(4):
                w.add_(1)
                outs += [w.to(torch.float64), w.t().reshape(12), w.t().contiguous()]
            return [o.clone() for o in outs]

    expected, got = eager_and_engine(run, step_aside=False)
    assert_equal_tree(expected, got)


transformers = pytest.importorskip("transformers")


def _tiny_gpt2() -> Any:
    config = transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2,
                                     n_head=4)
    return transformers.GPT2LMHeadModel(config).eval()


def _tiny_llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("build", ["_tiny_gpt2", "_tiny_llama"], ids=["gpt2", "llama-sdpa"])
def test_generate_with_kv_cache_token_ids_equal(build: str, grad_mode: str,
                                                cache_dir: Path) -> None:
    """Hugging Face ``generate()`` (greedy, KV cache on) under inference_mode and no_grad: the
    last line of each step is ``logits[:, -1].to(copy=True, dtype=float32)`` (it segfaulted
    under inference_mode: in a subprocess)."""
    out = run_isolated(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_crashes import generate_case
        generate_case({build!r}, {grad_mode!r})
        print("OK")
    """, cache_dir)
    assert "OK" in out


def generate_case(build_name: str, grad_mode: str) -> None:
    build = globals()[build_name]

    def run() -> list:
        model = build()
        ids = torch.randint(0, 96, (2, 5))
        mask = torch.ones_like(ids)
        with getattr(torch, grad_mode)():
            out = []
            for _ in range(2):  # a second call runs the same traces again (hits)
                out.append(model.generate(ids, attention_mask=mask, max_new_tokens=6,
                                          do_sample=False, pad_token_id=0, use_cache=True))
        return to_plain(out)

    expected, got = eager_and_engine(run, step_aside=False)
    assert_equal_tree(expected, got)
    assert ae.metrics()["ops_deferred"] > 0


# ---- torch.func (Note [functorch transforms]) ---------------------------------------------------

def test_func_hessian_does_not_crash(cache_dir: Path) -> None:
    """Was: 'Attempted to access the data pointer on an invalid python storage', then a
    segfault."""
    out = run_isolated("""
        import torch, adaptive_eager as ae
        from torch.func import hessian
        torch.manual_seed(0)
        x = torch.randn(6)
        f = lambda a: (a ** 3).sum() + (a.sin() * a).sum()
        expected = [hessian(f)(x) for _ in range(4)]
        with ae.adaptive_eager(backend="replay", step_aside=False, check=True):
            got = []
            for _ in range(4):
                y = x * 1.0  # a lazy input
                got.append(hessian(f)(y))
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), (expected, got)
        m = ae.metrics()
        assert m["fallback_ops"]["functorch"] > 0 and m["engine_errors"] == 0, m
        print("OK")
    """, cache_dir)
    assert "OK" in out


@pytest.mark.parametrize("backend", ["replay", "inductor"])
def test_forward_ad_custom_function_backward_does_not_crash(cache_dir: Path,
                                                            backend: str) -> None:
    """Was a segfault: forward-mode AD's zero tangent (``_efficientzerotensor``, a ZeroTensor
    without storage) was deferred and replayed under backward; it runs at once now, and ops on
    it too (no storage to number)."""
    out = run_isolated(f"""
        import torch, adaptive_eager as ae
        import torch.autograd.forward_ad as fwAD

        class Func(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, y, z):
                ctx.save_for_backward(x, y)
                ctx.save_for_forward(x, y)
                ctx.z = z
                return z * x * y

            @staticmethod
            def jvp(ctx, x_t, y_t, _):
                x_p, y_p = ctx.saved_tensors
                return ctx.z * (y_p * x_t + x_p * y_t)

            @staticmethod
            def vjp(ctx, grad_out):
                x, y = ctx.saved_tensors
                return ctx.z * grad_out * y, ctx.z * grad_out * x, None

        def run():
            a = torch.tensor(1., requires_grad=True, dtype=torch.double)
            b = torch.tensor(2., requires_grad=True, dtype=torch.double)
            with fwAD.dual_level():
                out = Func.apply(fwAD.make_dual(a, torch.tensor(1., dtype=torch.double)), b, 4)
                tangent = fwAD.unpack_dual(out).tangent.item()
                out.backward()
            return a.grad.item(), b.grad.item(), tangent

        want = run()
        with ae.adaptive_eager(backend="{backend}", hot_after=2, compile_async=False,
                               step_aside=False):
            got = [run() for _ in range(4)]
        assert all(g == want for g in got), (want, got)
        print("OK")
    """, cache_dir)
    assert "OK" in out


def _func_suite() -> list:
    from torch.func import functional_call, grad, jacrev, vmap

    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(3, 5)
    outs: list = []
    for _ in range(3):
        xl = x * 1.0  # lazy under the engine
        outs.append(vmap(torch.dot)(xl, xl + 1))
        outs.append(vmap(lambda r: (r.sin() * 2).sum(), in_dims=0)(xl))
        outs.append(grad(lambda a: (a.exp() * a).sum())(xl))
        outs.append(jacrev(lambda a: a.sin() * a.cos())(xl[0]))

        def loss(p: dict, inp: torch.Tensor) -> torch.Tensor:
            return functional_call(model, p, (inp,)).pow(2).mean()

        outs.append(functional_call(model, params, (xl,)))  # not a transform: deferred
        outs += list(grad(loss)(params, xl).values())
        per_sample = vmap(grad(loss), in_dims=(None, 0))(params, xl.unsqueeze(1))
        outs += list(per_sample.values())
        outs.append(xl * 3)  # the engine records again after the transforms
    return to_plain(outs)


def test_func_vmap_grad_jacrev_functional_call_bitwise() -> None:
    expected, got = eager_and_engine(_func_suite, step_aside=False)
    assert_equal_tree(expected, got)
    m = ae.metrics()
    assert m["fallback_ops"]["functorch"] > 0 and m["ops_deferred"] > 0
    assert m["engine_errors"] == 0


# ---- autograd features -----------------------------------------------------------------------

class _Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * 3 * x * x


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 6))


def test_autograd_function_bitwise() -> None:
    def run() -> list:
        lin = torch.nn.Linear(4, 4)
        x = torch.randn(3, 4)
        outs = []
        for _ in range(3):
            y = _Cube.apply(lin(x)).sum()
            y.backward()
            outs += [y.detach(), lin.weight.grad.clone()]
            lin.zero_grad()
        return to_plain(outs)

    expected, got = eager_and_engine(run, step_aside=False)
    assert_equal_tree(expected, got)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpoint_bitwise(reentrant: bool) -> None:
    def run() -> list:
        a, b = _mlp(), _mlp()
        x = torch.randn(4, 6, requires_grad=True)
        outs = []
        for _ in range(3):
            h = torch.utils.checkpoint.checkpoint(a, x, use_reentrant=reentrant)
            y = torch.utils.checkpoint.checkpoint(b, h.relu(), use_reentrant=reentrant)
            y.square().sum().backward()
            outs += [y.detach(), x.grad.clone()] + [p.grad.clone() for p in a.parameters()]
            a.zero_grad(), b.zero_grad()
            x.grad = None
        return to_plain(outs)

    expected, got = eager_and_engine(run, step_aside=False)
    assert_equal_tree(expected, got)


def test_forward_and_backward_hooks_bitwise() -> None:
    def run() -> list:
        model = _mlp()
        seen: list = []
        model[0].register_forward_pre_hook(lambda m, inp: (inp[0] * 0.5,))
        model[1].register_forward_hook(lambda m, inp, out: out + 1.0)
        model[2].register_full_backward_hook(lambda m, gi, go: seen.append(go[0] * 1.0))
        model[0].weight.register_hook(lambda g: g * 2)
        x = torch.randn(5, 6, requires_grad=True)
        x.register_hook(lambda g: seen.append(g.sum()))
        for _ in range(3):
            model(x).sum().backward()
            seen += [model[0].weight.grad.clone(), x.grad.clone()]
            model.zero_grad()
            x.grad = None
        return to_plain(seen)

    expected, got = eager_and_engine(run, step_aside=False)
    assert_equal_tree(expected, got)


def test_gradient_accumulation_and_clip_grad_norm_bitwise() -> None:
    def run() -> list:
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.randn(16, 6)
        outs = []
        for step in range(3):
            for micro in range(4):  # 4 micro-batches accumulate into .grad
                chunk = data[micro * 4:(micro + 1) * 4]
                (model(chunk).square().mean() / 4).backward()
            outs.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
            outs.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1,
                                                       foreach=False))
            outs += [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        return to_plain(outs + [p.detach() for p in model.parameters()])

    expected, got = eager_and_engine(run)
    assert_equal_tree(expected, got)


# ---- attention without dropout (Note [attention without dropout] in mode.py) --------------------

def test_cpu_sdpa_without_dropout_is_deferred_not_a_cut() -> None:
    import torch.nn.functional as F

    def run() -> list:
        q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
        outs = []
        for _ in range(3):
            o = F.scaled_dot_product_attention(q * 1.0, k, v, is_causal=True)
            o.sum().backward()
            outs += [o.detach(), q.grad.clone()]
            q.grad = None
        return to_plain(outs)

    expected, got = eager_and_engine(run, step_aside=False)
    assert_equal_tree(expected, got)
    m = ae.metrics()
    name = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert not any(name in r for r in m["flush_reasons"]), m["flush_reasons"]
    assert m["ops_deferred"] > 0


def test_sdpa_with_dropout_still_draws_as_eager() -> None:
    import torch.nn.functional as F

    def run() -> list:
        q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
        return to_plain([F.scaled_dot_product_attention(q * 1.0, k, v, dropout_p=0.3)
                         for _ in range(3)])

    expected, got = eager_and_engine(run, step_aside=False)
    assert_equal_tree(expected, got)


def test_inference_mode_dropout_sdpa_detach_do_not_cut_the_trace() -> None:
    """Under inference mode the composite ops reach the engine: ``dropout`` with train=False
    (eager returns its input itself), ``scaled_dot_product_attention`` without dropout and
    ``detach_`` (autograd metadata only) must neither flush nor change results."""
    import torch.nn.functional as F

    def run() -> list:
        x = torch.randn(2, 4, 8, 8)
        outs: list = []
        with torch.inference_mode():
            for _ in range(4):
                h = x * 2
                d = F.dropout(h, 0.3, training=False)
                outs.append(d is h)
                a = F.scaled_dot_product_attention(d, d + 1, d - 1, is_causal=True)
                a.detach_()
                outs.append(a * 1.0)
        return to_plain(outs)

    expected, got = eager_and_engine(run, step_aside=False)
    assert_equal_tree(expected, got)
    reasons = ae.metrics()["flush_reasons"]
    assert not any(("dropout" in r or "scaled_dot" in r or "detach_" in r)
                   and not r.startswith("new_op:") for r in reasons), reasons


# ---- the profiler (Note [lazy tensors become real] in lazy.py) ---------------------------------

def test_profiler_record_shapes_with_adam_state_bitwise() -> None:
    # record_shapes/profile_memory keep weak references to each TensorImpl, so turning a kept lazy
    # tensor (Adam's state, a kept .grad) into a plain one was refused by torch and raised
    from torch.profiler import ProfilerActivity, profile

    def run() -> list:
        model = _mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x = torch.randn(5, 6)
        outs = []
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                     profile_memory=True, with_stack=True):
            for _ in range(4):
                opt.zero_grad(set_to_none=False)
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                outs += [loss.item()] + [p.grad.clone() for p in model.parameters()]
        for _ in range(2):  # the state objects kept lazy by the profiler still work after it
            opt.zero_grad(set_to_none=False)
            model(x).square().mean().backward()
            opt.step()
        state = [v for s in opt.state.values() for v in s.values()]
        return to_plain(outs + [p.detach() for p in model.parameters()] + state)

    expected, got = eager_and_engine(run, step_aside=False)
    assert_equal_tree(expected, got)


def test_a_refused_swap_leaves_the_lazy_tensor_with_its_value() -> None:
    from adaptive_eager.dispatch.lazy import LazyTensor, become_real

    x = torch.ones(3)
    ys = [torch.full((3,), float(i)) for i in range(4)]
    kept, refs = [], []
    with ae.adaptive_eager(backend="replay", step_aside=False, disk_cache=False):
        for y in ys:  # the first run of an op is eager; later runs are deferred: lazy tensors
            w = x.mul(y)
            if type(w) is LazyTensor:
                refs.append(torch._C._WeakTensorRef(w))  # what the profiler holds
            kept.append(w)
            ae.sync()  # the trace runs and publishes
    assert refs, "the engine deferred nothing"
    for w, y in zip(kept, ys):
        assert torch.equal(w, y)
    held = [w for w in kept if type(w) is LazyTensor]
    assert len(held) == len(refs)  # each one a weak reference kept lazy, with its value
    assert become_real(held[0], torch.zeros(3)) is False  # refused, nothing changed
    assert type(held[0]) is LazyTensor and torch.equal(held[0], kept[len(kept) - len(held)])
