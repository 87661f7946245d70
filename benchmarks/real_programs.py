"""Workloads in the shape of real training programs written here, no downloads.

``char_gpt``: a character-level GPT in plain PyTorch (nanoGPT/minGPT shape: token + position
embeddings, 2 pre-LayerNorm blocks of causal self-attention and a GELU MLP, width 64, block 32,
dropout 0.1), fed by a ``DataLoader`` with 2 worker processes, AdamW, and ``loss.item()`` logged
every step. ``lstm_lm``: the pytorch/examples word_language_model shape on characters: embedding,
2-layer LSTM with dropout, decoder; hidden state detached between batches, ``clip_grad_norm_``
and a hand-written SGD update, ``loss.item()`` summed every step.

Each step records its loss (the ``.item()`` the program logs anyway) in ``Bench.losses``, so the
suite compares every step's loss with eager's, not only the first step's checksum.
"""

from __future__ import annotations

import math
import string
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.workloads import Bench, tensor_checksum

_VERSE = """\
Shall I compare thee to a summer's day? Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May, And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines, And often is his gold complexion dimm'd;
And every fair from fair sometime declines, By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade, Nor lose possession of that fair thou ow'st;
Nor shall Death brag thou wander'st in his shade, When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see, So long lives this, and this gives life to thee.
"""
# Every letter, digit-free punctuation and a newline: a vocabulary of 65, as tiny-shakespeare's.
TEXT = (_VERSE * 6) + string.ascii_letters + " .,;:!?'-&()\n"
VOCAB = sorted(set(TEXT))


def encoded() -> torch.Tensor:
    index = {c: i for i, c in enumerate(VOCAB)}
    return torch.tensor([index[c] for c in TEXT], dtype=torch.long)


# ---- character-level GPT with a DataLoader ---------------------------------------------------
_GPT = {"small": dict(layers=2, width=64, heads=4, block=32, batch=16, dropout=0.1)}


class CharChunks(torch.utils.data.Dataset):
    """(input, target) windows of ``block`` characters; deterministic by index, so worker
    processes need no RNG of their own."""

    def __init__(self, data: torch.Tensor, block: int) -> None:
        self.data, self.block = data, block

    def __len__(self) -> int:
        return len(self.data) - self.block - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i:i + self.block + 1]
        return chunk[:-1], chunk[1:]


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, block: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.attn_drop, self.resid_drop = nn.Dropout(dropout), nn.Dropout(dropout)
        self.register_buffer("mask", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, block: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, block, dropout)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab: int, layers: int, width: int, heads: int, block: int,
                 dropout: float) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, block, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _batches(loader: torch.utils.data.DataLoader) -> Iterator[Any]:
    while True:  # epochs, as a training loop over a fixed number of iterations does
        yield from loader


def build_char_gpt(size: str, device: torch.device, num_workers: int = 2) -> Bench:
    torch.manual_seed(0)
    cfg = _GPT[size]
    model = CharGPT(len(VOCAB), cfg["layers"], cfg["width"], cfg["heads"], cfg["block"],
                    cfg["dropout"]).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    loader = torch.utils.data.DataLoader(
        CharChunks(encoded(), cfg["block"]), batch_size=cfg["batch"], shuffle=True,
        drop_last=True, num_workers=num_workers, persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(0))
    batches: list[Iterator[Any]] = []  # started at the first step, as a training loop does
    losses: list[float] = []

    def step() -> torch.Tensor:
        if not batches:
            batches.append(_batches(loader))
        x, y = next(batches[0])
        x, y = x.to(device), y.to(device)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # logged every step, as real programs print it
        return loss.detach()

    return Bench(step=step, checksum=tensor_checksum, losses=losses)


# ---- LSTM language model with gradient clipping ---------------------------------------------
_LSTM = {"small": dict(emb=64, hidden=64, layers=2, bptt=20, batch=16, dropout=0.2)}


class LSTMModel(nn.Module):
    def __init__(self, vocab: int, emb: int, hidden: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab, emb)
        self.rnn = nn.LSTM(emb, hidden, layers, dropout=dropout)
        self.decoder = nn.Linear(hidden, vocab)
        self.layers, self.hidden = layers, hidden

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        out, state = self.rnn(self.drop(self.encoder(x)), state)
        return self.decoder(self.drop(out)), state

    def init_hidden(self, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.zeros(self.layers, batch, self.hidden, device=device)
        return z, z.clone()


def build_lstm_lm(size: str, device: torch.device) -> Bench:
    torch.manual_seed(0)
    cfg = _LSTM[size]
    data = encoded()
    n = data.numel() // cfg["batch"]
    columns = data[:n * cfg["batch"]].view(cfg["batch"], -1).t().contiguous().to(device)
    model = LSTMModel(len(VOCAB), cfg["emb"], cfg["hidden"], cfg["layers"],
                      cfg["dropout"]).to(device)
    model.train()
    lr, clip, bptt = 20.0, 0.25, cfg["bptt"]
    state = [model.init_hidden(cfg["batch"], device)]
    where = [0]
    losses: list[float] = []

    def step() -> torch.Tensor:
        i = where[0]
        if i + bptt + 1 > columns.size(0):  # next epoch: start over with a fresh state
            i = 0
            state[0] = model.init_hidden(cfg["batch"], device)
        where[0] = i + bptt
        x, y = columns[i:i + bptt], columns[i + 1:i + 1 + bptt]
        hidden = tuple(h.detach() for h in state[0])  # repackage_hidden
        model.zero_grad()
        out, new_state = model(x, hidden)
        state[0] = new_state
        loss = F.cross_entropy(out.view(-1, out.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        losses.append(loss.item())
        return loss.detach()

    return Bench(step=step, checksum=tensor_checksum, losses=losses)


def describe(workload: str, size: str) -> str:
    if workload == "char_gpt":
        c = _GPT[size]
        return (f"{c['layers']} layers, width {c['width']}, block {c['block']}, batch "
                f"{c['batch']}, vocab {len(VOCAB)}, DataLoader 2 workers")
    c = _LSTM[size]
    return (f"{c['layers']}-layer LSTM {c['hidden']}, bptt {c['bptt']}, batch {c['batch']}, "
            f"vocab {len(VOCAB)}, clip 0.25")
