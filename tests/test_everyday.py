"""Everyday features an OpInfo sweep does not reach, found by a sweep of common programs:
storage sharing (``Module.share_memory()``, torch.multiprocessing), packed sequences
for RNNs, and ops whose outputs share their input's storage without saying so."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from multiprocessing.reduction import ForkingPickler

import torch.multiprocessing  # noqa: F401  (registers its tensor reductions with ForkingPickler)

import adaptive_eager as ae
from helpers import assert_equal_tree, to_plain


def _repeated(fn: Callable[[], Any], reps: int = 3) -> tuple[list, list]:
    """``fn`` run ``reps`` times in eager and ``reps`` times under one engine context (op by op):
    the later runs are the ones the engine knows, where ops are deferred."""
    torch.manual_seed(0)
    expected = [to_plain(fn()) for _ in range(reps)]
    torch.manual_seed(0)
    with ae.adaptive_eager(backend="replay", check=True):
        got = [to_plain(fn()) for _ in range(reps)]
    return expected, got


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2))


def test_module_share_memory_keeps_every_parameter() -> None:
    # Note [storage methods]: the copy into shared memory was deferred and ran after the data
    # pointer had moved, so every parameter after the first came back zeros
    torch.manual_seed(0)
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(3, 4)
    with ae.adaptive_eager(backend="replay"):
        model.share_memory()
        y = model(x)
    assert all(p.is_shared() for p in model.parameters())
    for a, p in zip(before, model.parameters()):
        assert torch.equal(a, p.detach())
    with torch.no_grad():
        assert torch.equal(y.detach(), model(x))


def test_share_memory_of_a_pending_tensor_bitwise() -> None:
    def fn() -> Any:
        a = torch.randn(4) * 2
        a.share_memory_()
        return a + 1, a.is_shared()

    expected, got = _repeated(fn)
    assert_equal_tree(expected, got)


def test_storage_copy_and_fill_land_at_once() -> None:
    def fn() -> Any:
        a = torch.randn(4) * 2
        b = torch.zeros(4)
        b.untyped_storage().copy_(a.untyped_storage())
        c = torch.ones(3) * 3
        c.untyped_storage().fill_(0)
        return b.clone(), c + 1, a

    expected, got = _repeated(fn)
    assert_equal_tree(expected, got)


def test_multiprocessing_pickling_of_a_pending_tensor() -> None:
    # torch.multiprocessing hands CPU tensors over through shared memory (the same storage call)
    def fn() -> Any:
        a = torch.randn(5).exp()
        b = pickle.loads(bytes(ForkingPickler.dumps(a)))
        return b * 2, torch.equal(a, b)

    expected, got = _repeated(fn)
    assert_equal_tree(expected, got)


@pytest.mark.parametrize("lengths", [[5, 3, 2], [5, 5, 5], [2, 2, 1], [4, 1, 3]])
def test_pack_and_pad_follow_the_lengths(lengths: list[int]) -> None:
    # the packed size is the sum of the lengths: learnt once, it was wrong for the next lengths
    x = torch.randn(3, 5, 4)

    def fn(ls: list[int]) -> Any:
        p = nn.utils.rnn.pack_padded_sequence(x * 1, torch.tensor(ls), batch_first=True,
                                              enforce_sorted=False)
        o, n = nn.utils.rnn.pad_packed_sequence(p, batch_first=True)
        return p.data, p.batch_sizes, o, n

    with ae.adaptive_eager(backend="replay", check=True):
        fn([5, 3, 2])  # an earlier call with other lengths and the same shapes
        got = to_plain(fn(lengths))
    assert_equal_tree(to_plain(fn(lengths)), got)


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_packed_rnn_training_bitwise(cell: str) -> None:
    def fn() -> Any:
        torch.manual_seed(1)
        rnn = (nn.GRU(4, 6, batch_first=True) if cell == "gru"
               else nn.LSTM(4, 6, num_layers=2, batch_first=True, bidirectional=True))
        x = torch.randn(3, 5, 4)
        packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([2, 5, 3]),
                                                   batch_first=True, enforce_sorted=False)
        out, hidden = rnn(packed)
        o, n = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        o.sum().backward()
        return o, hidden, n, [p.grad for p in rnn.parameters()]

    expected, got = _repeated(fn)
    assert_equal_tree(expected, got)


def test_packed_gru_under_inference_mode_bitwise() -> None:
    def fn() -> Any:
        torch.manual_seed(1)
        rnn = nn.GRU(4, 6)
        seqs = [torch.randn(n, 4) for n in (5, 2, 3)]
        with torch.inference_mode():
            packed = nn.utils.rnn.pack_sequence(seqs, enforce_sorted=False)
            out, h = rnn(packed)
            o, n = nn.utils.rnn.pad_packed_sequence(out, total_length=7)
        return o.clone(), h.clone(), n.clone()

    expected, got = _repeated(fn)
    assert_equal_tree(expected, got)


def test_unsafe_split_and_chunk_are_views() -> None:
    # Note [unsafe views]: their outputs share the input's storage at its offset
    def fn() -> Any:
        a = torch.randn(6, 4) * 2
        parts = a.unsafe_chunk(3, 0)
        parts[1].add_(1)
        real = torch.randn(6, 4)
        sp = (*real[:4].unsafe_split(2, 0), *real[2:].unsafe_split(2, 0))  # same shapes, offsets
        sp[3].mul_(3)  # differ: metadata learnt for one offset must not serve the other
        return a, parts, real, sp, [p.storage_offset() for p in (*parts, *sp)]

    expected, got = _repeated(fn)
    assert_equal_tree(expected, got)


def test_python_callbacks_run_on_values() -> None:
    # Note [Python callbacks on values]: apply_ on a deferred tensor segfaulted, map_ raised
    def fn() -> Any:
        lazy = torch.ones(4) * 2
        lazy.apply_(lambda v: v * 3 + 1)
        real = torch.ones(4)
        real.mul_(2)  # a pending write the callback must see
        real.map_(lazy, lambda a, b: a * b)
        other = torch.arange(4.0)
        other.map2_(lazy, real, lambda a, b, c: a + b - c)
        return lazy + 0, real + 0, other + 0

    expected, got = _repeated(fn)
    assert_equal_tree(expected, got)


def test_python_callbacks_refuse_grad_like_eager() -> None:
    def fn() -> Any:
        x = torch.ones(2, requires_grad=True) * 1
        with pytest.raises(RuntimeError, match=r"Can't call apply_\(\) on Variable that requires"):
            x.apply_(lambda v: v)
        return x

    expected, got = _repeated(fn)
    assert_equal_tree(expected, got)


def test_python_callbacks_refuse_grad_arguments_and_take_keywords() -> None:
    """map_'s other and map2_'s x, y are refused like self when they require grad; keyword
    arguments pass as in plain torch (the wrapper installed at import took none)."""
    def fn() -> Any:
        a = torch.zeros(3)
        y = torch.ones(3, requires_grad=True) * 1
        with pytest.raises(RuntimeError, match=r"Can't call map_\(\) on Variable that requires"):
            a.map_(y, lambda p, q: p + q)
        with pytest.raises(RuntimeError, match=r"Can't call map2_\(\) on Variable that requires"):
            a.map2_(torch.ones(3) * 1, y, lambda p, q, r: p + q + r)
        b = torch.zeros(2) + 1
        b.map_(torch.ones(2) * 3, callable=lambda p, q: p + q)
        c = torch.zeros(2)
        c.map2_(b, torch.ones(2), callable=lambda p, q, r: p * q - r)
        return a + 0, b + 0, c + 0

    expected, got = _repeated(fn)
    assert_equal_tree(expected, got)


def _tiny_hf(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, vocab_size=97)
    torch.manual_seed(0)
    if name == "mixtral":  # mixture of experts: routing by topk, tokens gathered per expert
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))
    return transformers.T5ForConditionalGeneration(transformers.T5Config(  # relative buckets
        vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0))


@pytest.mark.parametrize("name", ["mixtral", "t5"])
def test_hugging_face_training_and_beam_search_bitwise(name: str) -> None:
    def fn() -> Any:
        model = _tiny_hf(name)
        torch.manual_seed(1)
        ids = torch.randint(3, 97, (2, 9))
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[0, -2:] = 0
        extra = ({"labels": ids} if name == "mixtral" else
                 {"labels": torch.randint(3, 97, (2, 5))})
        opt = torch.optim.AdamW(model.parameters(), 1e-3)
        losses = []
        for _ in range(2):
            opt.zero_grad()
            loss = model(input_ids=ids, attention_mask=mask, **extra).loss
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        model.eval()
        with torch.no_grad():
            out = model.generate(ids[:, :5], attention_mask=mask[:, :5], max_new_tokens=4,
                                 num_beams=3, do_sample=False, pad_token_id=0)
        return losses, out

    expected, got = _repeated(fn, reps=2)
    assert_equal_tree(expected, got)


def test_resize_grows_tensors_made_under_the_engine() -> None:
    # metadata.refresh_wrapper: a grown wrapper takes its value's storage (a clear error before)
    def fn() -> Any:
        a = torch.ones(3)  # deferred: a factory op with no tensor argument
        a.resize_(5)
        a[3:] = 0.5
        b = torch.ones(2) * 3
        b.resize_as_(torch.zeros(4, 2))
        b.fill_(1.5)
        c = torch.arange(6.0) * 2
        c.resize_(2, 2)
        return a * 2, b * 1, c + 1, a.shape, b.stride()

    expected, got = _repeated(fn)
    assert_equal_tree(expected, got)


def test_swap_tensors_of_pending_tensors() -> None:
    # regions.swap_call: the engine's weak references made swapping a lazy tensor raise
    def fn() -> Any:
        t1, t2 = torch.ones(2) * 2, torch.zeros(2) * 1
        r = torch.arange(2.0)
        s = r * 3  # a pending read of r: it must see r's value before the swap
        torch.utils.swap_tensors(r, t1)
        torch.manual_seed(1)
        model = nn.Linear(3, 3)
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model.to(torch.float64)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
        return t1, t2, r, s, model(torch.ones(1, 3, dtype=torch.float64))

    expected, got = _repeated(fn)
    assert_equal_tree(expected, got)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_value_dependent_composites_follow_the_values(mode: str) -> None:
    # Under inference mode these composite ops reach the engine whole: their sizes (narrow's
    # view offset) were learnt once and served for other values (opspec._DATA_SHAPED)
    grad_mode = torch.inference_mode if mode == "inference_mode" else torch.no_grad

    def fn(i: int) -> Any:
        a = torch.arange(12.0) * 1
        return (a.narrow(0, torch.tensor(i), 3), torch.tensor_split(a, torch.tensor([i, i + 2])),
                torch.where(a > i), a.repeat_interleave(torch.arange(12) % (i + 1)))

    values = (1, 2, 5, 0)
    expected = [to_plain(fn(i)) for i in values]
    with ae.adaptive_eager(backend="replay", check=True):
        got = []
        for i in values:
            with grad_mode():
                got.append(to_plain(fn(i)))
    assert_equal_tree(expected, got)


def test_forward_ad_under_inference_mode() -> None:
    # opspec._FORWARD_AD: dual-number ops deferred under inference mode replayed outside it
    import torch.autograd.forward_ad as fwAD

    def fn() -> Any:
        with torch.inference_mode():
            x = torch.randn(3)
            with fwAD.dual_level():
                d = fwAD.make_dual(x, torch.ones(3))
                primal, tangent = fwAD.unpack_dual((d.sin() * d).sum())
            return primal, tangent

    expected, got = _repeated(fn)
    assert_equal_tree(expected, got)


def test_writes_through_unsafe_views_in_fused_programs(tmp_path: Any) -> None:
    # graph._UNSAFE_VIEW_OPS: functionalization took their outputs for new tensors, so a write
    # through one never reached the base in a fused program (wrong from the first fused run)
    def fn(x: torch.Tensor) -> torch.Tensor:
        a = x * 1
        a.unsafe_split(2)[0].add_(1)
        a.unsafe_chunk(2, 1)[1].mul_(3)
        return a * 2

    x = torch.randn(4, 2)
    expected = fn(x)
    with ae.adaptive_eager(backend="inductor", hot_after=1, compile_async=False,
                           cache_dir=str(tmp_path), step_aside=False):
        got = [fn(x).detach().clone() for _ in range(4)]
        compiled_runs = ae.metrics()["compiled_runs"]
    assert compiled_runs >= 1  # the fused program really ran
    for g in got:
        torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-6)
