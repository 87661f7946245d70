"""The benchmarked programs: plain eager PyTorch, each built at named sizes into a ``Bench``.

A workload's ``build(size, device)`` makes its inputs and state (seeded, outside any engine) and
returns a ``Bench``: ``step()`` runs one step of unmodified eager code and ``checksum(out)`` turns
the first step's result into one float, so every mode can be compared with eager.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

StepFn = Callable[[], Any]


@dataclasses.dataclass(frozen=True)
class Bench:
    step: StepFn
    checksum: Callable[[Any], float]
    losses: list[float] | None = None  # every step's logged loss, when the program logs one
    # Set when the program enters ``adaptive_eager()`` itself: engine modes call it with their
    # options instead of wrapping the step in the context.
    enters_engine: Callable[[dict[str, Any]], None] | None = None


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    description: str
    sizes: tuple[str, ...]  # small to large
    quick_sizes: tuple[str, ...]
    build: Callable[[str, torch.device], Bench]


def tensor_checksum(out: Any) -> float:
    """Sum of a tensor (or of the tensors in a tuple/list) in float64."""
    if isinstance(out, torch.Tensor):
        return float(out.detach().double().sum().item())
    if isinstance(out, (list, tuple)):
        return sum(tensor_checksum(o) for o in out)
    if isinstance(out, (int, float)):
        return float(out)
    raise TypeError(f"cannot checksum {type(out).__name__}")


def _seed() -> None:
    torch.manual_seed(0)


# ---- elementwise chain ---------------------------------------------------------------------
_ELEMENTS = {"64K": 1 << 16, "1M": 1 << 20, "16M": 1 << 24}


def gelu_chain(x: torch.Tensor) -> torch.Tensor:
    """tanh-GELU spelled out: 9 elementwise aten ops, each a full pass over memory in eager."""
    inner = x + 0.044715 * x * x * x
    t = torch.tanh(0.7978845608028654 * inner)
    return 0.5 * x * (1.0 + t)


def build_elementwise(size: str, device: torch.device) -> Bench:
    _seed()
    x = torch.randn(_ELEMENTS[size], device=device)
    return Bench(step=lambda: gelu_chain(x), checksum=tensor_checksum)


# ---- LayerNorm-Linear-GELU-Linear block, forward + backward -------------------------------
_MLP = {"small": (64, 128, 512), "large": (512, 512, 2048)}  # batch, dim, hidden


def build_mlp_block(size: str, device: torch.device) -> Bench:
    _seed()
    batch, dim, hidden = _MLP[size]
    block = torch.nn.Sequential(
        torch.nn.LayerNorm(dim), torch.nn.Linear(dim, hidden), torch.nn.GELU(),
        torch.nn.Linear(hidden, dim)).to(device)
    x = torch.randn(batch, dim, device=device)

    def step() -> torch.Tensor:
        block.zero_grad(set_to_none=True)
        loss = block(x).square().mean()
        loss.backward()
        return loss.detach()

    return Bench(step=step, checksum=tensor_checksum)


# ---- AdamW over many small parameters ------------------------------------------------------
_ADAM_PARAMS = {"small": 32, "large": 128}
_ADAM_SHAPES = ((64, 64), (64,), (128, 32), (32,))


def _build_adamw(size: str, device: torch.device, foreach: bool) -> Bench:
    _seed()
    shapes = [_ADAM_SHAPES[i % len(_ADAM_SHAPES)] for i in range(_ADAM_PARAMS[size])]
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, foreach=foreach)

    def step() -> None:
        opt.step()

    def checksum(_: Any) -> float:
        with torch.no_grad():
            return float(torch.stack([p.double().sum() for p in params[:8]]).sum().item())

    return Bench(step=step, checksum=checksum)


def build_adamw_forloop(size: str, device: torch.device) -> Bench:
    return _build_adamw(size, device, foreach=False)


def build_adamw_foreach(size: str, device: torch.device) -> Bench:
    return _build_adamw(size, device, foreach=True)


# ---- tiny Llama training step (transformers, built from a config, no downloads) ------------
_LLAMA = {  # hidden, intermediate, layers, heads, kv heads, vocab, batch, seq
    "small": (64, 128, 2, 4, 2, 512, 4, 32),
    "mid": (256, 688, 4, 4, 4, 2048, 8, 128),  # the GPT-2 step's size
    "large": (256, 688, 4, 8, 4, 2048, 8, 128),
}


def build_llama_train(size: str, device: torch.device) -> Bench:
    from transformers import LlamaConfig, LlamaForCausalLM

    _seed()
    hidden, inter, layers, heads, kv, vocab, batch, seq = _LLAMA[size]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                         max_position_embeddings=seq, use_cache=False)
    return _lm_train_bench(LlamaForCausalLM(config), vocab, batch, seq, device)


def _lm_train_bench(model: torch.nn.Module, vocab: int, batch: int, seq: int,
                    device: torch.device) -> Bench:
    """One causal-LM training step (loss on its own input ids), AdamW foreach."""
    model.to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(0, vocab, (batch, seq), device=device)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.detach()

    return Bench(step=step, checksum=tensor_checksum)


# ---- mid-size GPT-2 training step (transformers, from a config, no downloads) --------------
# width, layers, heads, vocab, batch, seq; ``small`` is the launch-bound model
# (benchmarks.varlen's) at its longest length
_GPT2 = {"small": (64, 2, 2, 256, 8, 64), "mid": (256, 4, 4, 2048, 8, 128)}


def build_gpt2_train(size: str, device: torch.device) -> Bench:
    """GPT2LMHeadModel (no dropout) trained with AdamW foreach: a whole step is ~2,500 aten ops."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _seed()
    width, layers, heads, vocab, batch, seq = _GPT2[size]
    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers,
                        n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        use_cache=False)
    return _lm_train_bench(GPT2LMHeadModel(config), vocab, batch, seq, device)


# ---- a small function, each call wrapped in the engine's context -----------------------------
_CTX = {"small": (200, 16)}  # calls per step, elements


def build_context_loop(size: str, device: torch.device) -> Bench:
    """``with adaptive_eager():`` around every call of a small function, no module, no optimizer
    (stepping aside at context boundaries). The program enters the engine itself
    (``Bench.enters_engine``): engine modes do not wrap the step; eager and torch.compile run
    the bare function."""
    _seed()
    calls, numel = _CTX[size]
    x = torch.randn(numel, device=device)
    w = torch.randn(numel, device=device)
    context: list[Any] = []  # the engine's context factory and options, for engine modes

    def small(y: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            y = torch.tanh(y * 0.9 + w) - 0.1 * y
        return y

    def step() -> torch.Tensor:
        out = x
        if context:
            enter, options = context
            for _ in range(calls):
                with enter(**options):
                    out = small(x)
        else:
            for _ in range(calls):
                out = small(x)
        return out

    def enters_engine(options: dict[str, Any]) -> None:
        import adaptive_eager

        context[:] = [adaptive_eager.adaptive_eager, options]

    return Bench(step=step, checksum=tensor_checksum, enters_engine=enters_engine)


# ---- launch-bound loop of tiny ops -----------------------------------------------------------
_TINY = {"small": (40, 16), "large": (400, 1024)}  # iterations (5 ops each), elements


def build_tiny_ops(size: str, device: torch.device) -> Bench:
    _seed()
    iters, numel = _TINY[size]
    x = torch.randn(numel, device=device)
    w = torch.randn(numel, device=device)

    def step() -> torch.Tensor:
        y = x
        for _ in range(iters):
            y = torch.tanh(y * 0.9 + w) - 0.1 * y
        return y

    return Bench(step=step, checksum=tensor_checksum)


# ---- data-dependent loop: .item() and a Python branch on it every iteration -----------------
_ITEM = {"small": (64, 8), "large": (1024, 8)}  # matrix size, iterations per step


def build_item_loop(size: str, device: torch.device) -> Bench:
    _seed()
    n, iters = _ITEM[size]
    m = torch.randn(n, n, device=device)
    a = torch.eye(n, device=device) + 0.1 * (m + m.T) / math.sqrt(n)  # SPD, eigenvalues near 1
    b = torch.randn(n, device=device)
    x = torch.zeros(n, device=device)

    def step() -> torch.Tensor:
        for _ in range(iters):
            r = b - a @ x
            residual = r.norm().item()  # sync point every iteration
            lr = 0.5 if residual > 1.0 else 0.1  # data-dependent Python branch
            x.add_(r, alpha=lr)
        return x

    return Bench(step=step, checksum=tensor_checksum)


def build_char_gpt(size: str, device: torch.device) -> Bench:
    from benchmarks.real_programs import build_char_gpt as build

    return build(size, device)


def build_lstm_lm(size: str, device: torch.device) -> Bench:
    from benchmarks.real_programs import build_lstm_lm as build

    return build(size, device)


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("elementwise", "GELU-like chain of 9 elementwise ops", ("64K", "1M", "16M"),
             ("16M",), build_elementwise),
    Workload("mlp_block", "LayerNorm-Linear-GELU-Linear, forward + backward",
             ("small", "large"), ("small",), build_mlp_block),
    Workload("adamw_forloop", "AdamW step, many small params, foreach=False",
             ("small", "large"), ("small",), build_adamw_forloop),
    Workload("adamw_foreach", "AdamW step, many small params, foreach=True",
             ("small", "large"), ("small",), build_adamw_foreach),
    Workload("llama_train", "LlamaForCausalLM training step from a config (AdamW foreach)",
             ("small", "mid", "large"), ("small",), build_llama_train),
    Workload("gpt2_train", "GPT2LMHeadModel training step from a config (AdamW foreach)",
             ("small", "mid"), ("mid",), build_gpt2_train),
    Workload("context_loop", "with adaptive_eager() around each call of a small function",
             ("small",), ("small",), build_context_loop),
    Workload("tiny_ops", "launch-bound loop of tiny elementwise ops",
             ("small", "large"), ("small",), build_tiny_ops),
    Workload("item_loop", "data-dependent loop, .item() + branch every iteration",
             ("small", "large"), ("small",), build_item_loop),
    Workload("char_gpt", "character-level GPT, DataLoader (2 workers), dropout, .item() a step",
             ("small",), ("small",), build_char_gpt),
    Workload("lstm_lm", "LSTM language model, clip_grad_norm_, hand-written SGD",
             ("small",), ("small",), build_lstm_lm),
)}


def describe_size(workload: str, size: str) -> str:
    """Human-readable parameters of one size, for the report."""
    if workload == "elementwise":
        return f"{_ELEMENTS[size]:,} elements"
    if workload == "mlp_block":
        b, d, h = _MLP[size]
        return f"batch {b}, dim {d}, hidden {h}"
    if workload.startswith("adamw"):
        return f"{_ADAM_PARAMS[size]} params"
    if workload == "llama_train":
        hid, _, layers, heads, _, vocab, batch, seq = _LLAMA[size]
        return f"hidden {hid}, {layers} layers, {heads} heads, vocab {vocab}, batch {batch}x{seq}"
    if workload == "gpt2_train":
        width, layers, heads, vocab, batch, seq = _GPT2[size]
        return f"width {width}, {layers} layers, {heads} heads, vocab {vocab}, batch {batch}x{seq}"
    if workload == "context_loop":
        calls, numel = _CTX[size]
        return f"{calls} contexts a step, 20 ops each on {numel} elements"
    if workload == "tiny_ops":
        iters, numel = _TINY[size]
        return f"{iters * 5} ops on {numel} elements"
    if workload == "item_loop":
        n, iters = _ITEM[size]
        return f"{n}x{n} matvec, {iters} .item() per step"
    if workload in ("char_gpt", "lstm_lm"):
        from benchmarks.real_programs import describe

        return describe(workload, size)
    return size
