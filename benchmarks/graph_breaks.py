"""Ordinary eager programs that ``torch.compile`` handles badly: data-dependent shapes, ``.item()``
branches, Python loops over time steps, shapes that change from batch to batch.

Each program is plain eager PyTorch on the CPU. ``Program.build()`` makes the model, optimizer
and a pool of input batches (seeded, so every mode starts from the same state) and returns a
``Built``: ``step(*batch)`` runs one training (or solver) step of unmodified eager code and
returns its loss (a tensor or a float); the driver feeds the batches in order, cycling, as a
``for x, y in loader: step(x, y)`` loop does, so ``torch.compile`` sees tensors, not step
numbers. ``state_checksum()`` sums the trained state in float64 after the run, so a mode's end
state can be compared with eager's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, ...]


@dataclasses.dataclass(frozen=True)
class Built:
    step: Callable[..., Any]
    batches: Sequence[Batch]
    state_checksum: Callable[[], float]


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    description: str
    build: Callable[[], Built]
    # Largest relative difference from eager's final loss and state checksum counted as equal:
    # fused programs round differently, and 200 optimizer steps carry the difference along.
    rtol: float = 1e-3
    listed: bool = True  # False: a test program, run only when named


def params_checksum(module: nn.Module) -> Callable[[], float]:
    def checksum() -> float:
        with torch.no_grad():
            return float(sum(p.detach().double().sum() for p in module.parameters()).item())
    return checksum


def _seed() -> torch.Generator:
    torch.manual_seed(0)
    return torch.Generator().manual_seed(1)


POOL = 16  # distinct batches per program, cycled


# ---- 1. top-2 Mixture of Experts ------------------------------------------------------------
class MoE(nn.Module):
    """Top-2 routing over 8 expert MLPs; each expert gets the tokens routed to it, found with
    ``nonzero`` (a data-dependent count of rows per expert and per step)."""

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
            for _ in range(experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = self.gate(x).softmax(-1)
        weight, index = probs.topk(2, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = (index == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, expert(x[token]) * weight[token, slot].unsqueeze(-1))
        # Switch-style load-balancing loss: fraction routed x mean gate probability
        routed = F.one_hot(index[:, 0], probs.shape[-1]).float().mean(0)
        aux = (routed * probs.mean(0)).sum() * probs.shape[-1]
        return out, aux


def build_moe() -> Built:
    g = _seed()
    dim, tokens = 64, 256
    model = nn.ModuleDict({"norm": nn.LayerNorm(dim), "moe": MoE(dim, 128, 8),
                           "head": nn.Linear(dim, dim)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [(torch.randn(tokens, dim, generator=g), torch.randn(tokens, dim, generator=g))
               for _ in range(POOL)]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        h, aux = model["moe"](model["norm"](x))
        loss = F.mse_loss(model["head"](x + h), y) + 0.01 * aux
        loss.backward()
        opt.step()
        return loss.detach()

    return Built(step, batches, params_checksum(model))


# ---- 2. neural ODE with an adaptive step size -----------------------------------------------
class VectorField(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim + 1, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                 nn.Tanh(), nn.Linear(hidden, dim))

    def forward(self, t: float, y: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([y, y.new_full((y.shape[0], 1), t)], dim=1))


def solve(f: VectorField, y: torch.Tensor, t_end: float = 1.0, rtol: float = 3e-5,
          atol: float = 3e-6) -> tuple[torch.Tensor, int, int]:
    """Bogacki-Shampine 3(2): each try is accepted or rejected by ``err.item() <= 1``, and the
    next step size is computed in Python from that float."""
    t, h, accepted, rejected = 0.0, 0.1, 0, 0
    k1 = f(t, y)
    while t < t_end - 1e-9:
        h = min(h, t_end - t)
        k2 = f(t + h / 2, y + h / 2 * k1)
        k3 = f(t + 3 * h / 4, y + 3 * h / 4 * k2)
        y_new = y + h * (2 / 9 * k1 + 1 / 3 * k2 + 4 / 9 * k3)
        k4 = f(t + h, y_new)
        err_vec = h * (-5 / 72 * k1 + 1 / 12 * k2 + 1 / 9 * k3 - 1 / 8 * k4)
        scale = atol + rtol * torch.maximum(y.abs(), y_new.abs())
        err = (err_vec / scale).pow(2).mean().sqrt().item()
        if err <= 1.0:
            t, y, k1 = t + h, y_new, k4
            accepted += 1
        else:
            rejected += 1
        h *= min(5.0, max(0.2, 0.9 * (err + 1e-12) ** (-1 / 3)))
    return y, accepted, rejected


def build_ode() -> Built:
    g = _seed()
    dim, batch = 16, 64
    field = VectorField(dim, 64)
    with torch.no_grad():  # a livelier field: about 10 tries per solve, some rejected
        field.net[-1].weight.mul_(4.0)
    opt = torch.optim.Adam(field.parameters(), lr=3e-3)
    batches = [(torch.randn(batch, dim, generator=g), torch.randn(batch, dim, generator=g))
               for _ in range(POOL)]

    def step(y0: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        y1, _, _ = solve(field, y0)
        loss = F.mse_loss(y1, target)
        loss.backward()
        opt.step()
        return loss.detach()

    return Built(step, batches, params_checksum(field))


# ---- 3. a training step that logs its loss and branches on it -------------------------------
class TinyTransformer(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True,
                                       norm_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[:tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build_logged_step() -> Built:
    g = _seed()
    vocab, seq, batch = 128, 32, 16
    model = TinyTransformer(vocab, 64, 4, 2, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = [(torch.randint(vocab, (batch, seq), generator=g),
                torch.randint(vocab, (batch, seq), generator=g)) for _ in range(POOL)]
    ema = [0.0]  # running loss: a step whose loss jumps above it has its gradients clipped

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        value = loss.item()
        if ema[0] and value > 1.002 * ema[0]:
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        ema[0] = value if not ema[0] else 0.9 * ema[0] + 0.1 * value
        opt.step()
        return value

    return Built(step, batches, params_checksum(model))


# ---- 4. Mamba-style selective scan ----------------------------------------------------------
class SelectiveScan(nn.Module):
    """Input-dependent state-space recurrence h_t = exp(dt_t A) h_t-1 + dt_t B_t x_t, y_t = C_t h_t,
    as a Python loop over time steps (as reference Mamba code without the fused kernel)."""

    def __init__(self, dim: int, inner: int, state: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, inner)
        self.dt = nn.Linear(inner, inner)
        self.bc = nn.Linear(inner, 2 * state, bias=False)
        self.a_log = nn.Parameter(torch.log(torch.arange(1, state + 1).float()).repeat(inner, 1))
        self.out = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = F.silu(self.inp(x))  # (batch, time, inner)
        dt = F.softplus(self.dt(u))
        b, c = self.bc(u).chunk(2, dim=-1)  # (batch, time, state) each
        a = -self.a_log.exp()  # (inner, state)
        h = u.new_zeros(u.shape[0], u.shape[2], a.shape[1])
        ys = []
        for t in range(u.shape[1]):
            da = torch.exp(dt[:, t, :, None] * a)
            h = da * h + (dt[:, t, :, None] * u[:, t, :, None]) * b[:, t, None, :]
            ys.append((h * c[:, t, None, :]).sum(-1))
        return self.out(torch.stack(ys, dim=1))


def build_scan() -> Built:
    g = _seed()
    dim, batch, steps = 32, 8, 32
    model = SelectiveScan(dim, 64, 16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = [(torch.randn(batch, steps, dim, generator=g),
                torch.randn(batch, steps, dim, generator=g)) for _ in range(POOL)]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return Built(step, batches, params_checksum(model))


# ---- 5. small CNN -----------------------------------------------------------------------------
def build_cnn() -> Built:
    g = _seed()
    chans = [(3, 16, 1), (16, 16, 1), (16, 32, 2), (32, 32, 1), (32, 64, 2), (64, 64, 1)]
    layers: list[nn.Module] = []
    for cin, cout, stride in chans:
        layers += [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                   nn.ReLU()]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = [(torch.randn(8, 3, 32, 32, generator=g), torch.randint(10, (8,), generator=g))
               for _ in range(POOL)]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return Built(step, batches, params_checksum(model))


# ---- 6. GRU cell loop over batches of varying length ----------------------------------------
def build_gru() -> Built:
    g = _seed()
    dim, hidden, batch = 32, 64, 16
    cell = nn.GRUCell(dim, hidden)
    head = nn.Linear(hidden, 4)
    model = nn.ModuleList([cell, head])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = []
    for _ in range(POOL):  # each batch padded to its own longest sequence (16 to 32 steps)
        lengths = torch.randint(8, 33, (batch,), generator=g)
        longest = int(lengths.max())
        batches.append((torch.randn(batch, longest, dim, generator=g), lengths,
                        torch.randint(4, (batch,), generator=g)))

    def step(x: torch.Tensor, lengths: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        h = x.new_zeros(x.shape[0], hidden)
        for t in range(x.shape[1]):  # padded positions keep the hidden state
            h = torch.where((t < lengths)[:, None], cell(x[:, t], h), h)
        loss = F.cross_entropy(head(h), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return Built(step, batches, params_checksum(model))


# ---- 7. masked-LM step: loss over the masked positions only -----------------------------------
def build_masked_lm() -> Built:
    g = _seed()
    vocab, seq, batch, mask_id = 128, 32, 16, 0
    model = TinyTransformer(vocab, 64, 4, 1, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = []
    for _ in range(POOL):  # about 15% of the positions masked: a different count per batch
        tokens = torch.randint(1, vocab, (batch, seq), generator=g)
        batches.append((tokens, torch.rand(batch, seq, generator=g) < 0.15))

    def step(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        hidden = model(tokens.masked_fill(mask, mask_id))
        loss = F.cross_entropy(hidden[mask], tokens[mask])  # boolean index: data-dependent rows
        loss.backward()
        opt.step()
        return loss.detach()

    return Built(step, batches, params_checksum(model))


# ---- a tiny program for the driver's test ---------------------------------------------------
def build_tiny() -> Built:
    g = _seed()
    w = nn.Parameter(torch.randn(8))
    batches = [(torch.randn(8, generator=g),) for _ in range(4)]

    def step(x: torch.Tensor) -> float:
        loss = (w * x).tanh().sum()
        value = loss.item()
        if value > 0:
            loss = loss * 2
        loss.backward()
        with torch.no_grad():
            w.sub_(0.1 * w.grad)
            w.grad = None
        return value

    return Built(step, batches, lambda: float(w.detach().double().sum().item()))


def build_chain() -> Built:
    g = _seed()
    n = 1 << 18
    w = nn.Parameter(torch.randn(n, generator=g) * 0.1)
    opt = torch.optim.SGD([w], lr=1e-2)
    batches = [(torch.randn(n, generator=g),) for _ in range(2)]

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        y = torch.sin(x * w) * 0.5 + torch.cos(x - w) * 0.25
        y = torch.tanh(y) * torch.sigmoid(y + 1.0) - 0.1 * y
        loss = (y * y).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return Built(step, batches, params_checksum(nn.ParameterList([w])))


PROGRAMS: dict[str, Program] = {p.name: p for p in (
    Program("moe", "top-2 MoE, 8 experts (topk + nonzero per expert), 256 tokens of width 64, "
            "AdamW", build_moe),
    Program("ode", "neural ODE, Bogacki-Shampine with step size accepted/rejected by "
            "err.item(), MLP 17-64-64-16 on 64 states, backward through the solver, Adam",
            build_ode, rtol=1e-2),
    Program("logged_step", "2-layer transformer (width 64, seq 32, batch 16), loss.item() every "
            "step, clip_grad_norm_ when the loss jumps above its running mean, AdamW",
            build_logged_step),
    Program("scan", "Mamba-style selective scan, Python loop over 32 time steps (inner 64, "
            "state 16, batch 8), forward + backward, Adam", build_scan),
    Program("cnn", "conv-bn-relu x6 (16-64 channels), batch 8 of 3x32x32, SGD momentum",
            build_cnn),
    Program("gru", "GRUCell loop (32-64) over batches padded to their own longest length "
            "(8-32 steps), Adam", build_gru),
    Program("masked_lm", "1-layer transformer, cross-entropy over the masked positions only "
            "(boolean index, about 15% of 16x32), AdamW", build_masked_lm),
    Program("chain", "elementwise chain of 12 ops on 256K elements, forward + backward, SGD: "
            "a step fusion speeds up (for long runs: how soon the engine gets there)",
            build_chain, listed=False),
    Program("tiny", "8-element parameter, .item() branch, hand-written SGD (test program)",
            build_tiny, listed=False),
)}


def listed() -> list[str]:
    return [name for name, p in PROGRAMS.items() if p.listed]


def relative_difference(a: float | None, b: float | None) -> float | None:
    """|a - b| / max(|a|, |b|, 1e-12); None when either is missing or not finite."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return None
    return abs(a - b) / max(abs(a), abs(b), 1e-12)
