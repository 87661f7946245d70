"""Differential program fuzzer: random eager programs, run plainly and under adaptive_eager.

    python tests/fuzz_programs.py --mode replay --n 1000            # seeds 0..999, a summary
    python tests/fuzz_programs.py --mode fused --n 50 --first 7     # seeds 7..56
    python tests/fuzz_programs.py --mode replay --seed 123 --show   # print one program

A program is Python source: a few input tensors made outside the engine (``x0``, ``x1``...), then a
body of statements run ``iters`` times, each round in its own engine context (or one context with
``ae.sync()`` after each round), so its traces repeat, hit and, with Inductor, fuse. Statements:
OpInfo ops on their sample inputs (a pool tensor of the sample's shape and dtype substituted for
the sample's input, so ops chain), in-place variants of OpInfo ops, elementwise/reduction/matmul
ops over the pool, views (view, transpose, slicing, expand, diagonal, permute...), in-place writes
(add_, mul_, copy_, index_put_, slice assignment, zero_) through views of a base that is read later,
numpy round trips (``t.numpy()``, ``torch.from_numpy`` sharing memory, writes from the numpy side),
RNG draws (``torch.manual_seed`` then rand/randn/randint/dropout/bernoulli), ``.item()``-driven
branches, and a statement that raises (a shape or dtype error), which ends the body.

The generator runs each statement eagerly while it builds the program (so it knows every
variable's shape and dtype, and drops statements that raise unless they are meant to). Its choices
come from a ``Chooser``: Hypothesis' ``data.draw`` in tests/test_fuzz.py, a seeded
``random.Random`` here, so program ``--seed N`` is the same program on every machine with the same
torch.

Each program runs three ways (``run_program``): plain eager, engine replay, engine fused. Compared
(``compare``): every variable the body leaves (tensors, numpy arrays, Python scalars) and every
input (in-place writes), with dtype, shape and strides; replay bitwise (NaNs equal), fused within
``FUSED_TOL`` (Inductor reassociates reductions and contracts multiply-adds, and a body run several
times can amplify the difference); and exceptions: the same type, raised at the same (round,
statement), never at the context's exit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import functools
import math
import random
import re
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import adaptive_eager as ae

# Engine options of the two engine modes. Replay must equal eager bitwise; ``check`` verifies the
# promised metadata at replay. Fused: Inductor, a trace compiles once it ran twice, in the
# program's own thread and process (no helper process to start per program).
REPLAY_OPTIONS: dict[str, Any] = dict(backend="replay", step_aside=False, check=True,
                                      log_level="ERROR", disk_cache=False, compile_async=False)
FUSED_OPTIONS: dict[str, Any] = dict(backend="inductor", hot_after=2, compile_async=False,
                                     step_aside=False, check=True, log_level="ERROR",
                                     disk_cache=False, compile_process=False,
                                     compile_service=False)
MODES = {"replay": REPLAY_OPTIONS, "fused": FUSED_OPTIONS}

# Fused tolerance per dtype (rtol, atol): float32 1e-4/1e-5 as torch.testing's defaults widened for
# reassociated reductions repeated over rounds; integers and bools exact.
FUSED_TOL = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-7, 1e-9)}

DTYPES = (torch.float32, torch.float64, torch.int64)
SHAPES: tuple[tuple[int, ...], ...] = ((5, 5), (5,), (5, 5, 5), (4, 6), (1, 5), (2, 3, 4), ())
# Note [fused vocabulary]
# Every fused program compiles each of its traces (seconds each on a loaded machine), so a fused
# run can afford tens of programs where replay affords thousands. ``small=True`` draws inputs
# from two shapes and two dtypes, without OpInfo ops, and at most 6 statements: programs then
# share op bodies, so Inductor's own cache (and the engine's, within a process) hits for many of
# their graphs. The price is coverage: fewer shapes, dtypes and ops reach the fused path, so a
# fused-only bug in an OpInfo op or a float64 kernel is found only by the full vocabulary
# (``small=False``, slower: nearly every graph is a cold compile).
SMALL_SHAPES: tuple[tuple[int, ...], ...] = ((5, 5), (5,))
SMALL_DTYPES = (torch.float32, torch.int64)
VAR = re.compile(r"^[xtn]\d+$")


# ----------------------------------------------------------------------------------------------
# Choices
# ----------------------------------------------------------------------------------------------

class Chooser:
    """Where the generator's choices come from (a seeded Random; Hypothesis in test_fuzz.py)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, seq: Sequence[Any]) -> Any:
        return seq[self.integer(0, len(seq) - 1)]

    def coin(self, p: float = 0.5) -> bool:
        return self.integer(0, 999) < int(p * 1000)


# ----------------------------------------------------------------------------------------------
# OpInfo ops
# ----------------------------------------------------------------------------------------------

# Ops left out of the pool: random, uninitialised output, sparse/quantized/complex-only, slow
# decompositions, or eager-nondeterministic on CPU. Matched as prefixes of the OpInfo name.
_SKIP_PREFIXES = (
    "rand", "normal", "bernoulli", "nn.functional.dropout", "nn.functional.alpha_dropout",
    "nn.functional.feature_alpha_dropout", "nn.functional.rrelu", "multinomial", "uniform",
    "empty", "new_empty", "cauchy", "exponential", "geometric", "log_normal", "poisson",
    "sparse", "to_sparse", "_segment_reduce", "nn.functional.ctc_loss", "linalg.lstsq",
    "cdouble", "cfloat", "chalf", "item", "tolist", "nonzero_static", "svd_lowrank",
    "pca_lowrank", "lu", "linalg.eig", "linalg.svd", "svd", "linalg.matrix_rank",
    "linalg.pinv", "pinverse", "linalg.cond", "linalg.eigvals", "linalg.eigh", "linalg.eigvalsh",
    "symeig", "stft", "istft", "nn.functional.grid_sample", "nn.functional.interpolate",
    "nn.functional.upsample", "masked.", "_refs", "jiterator", "resize", "as_strided",
    "torch.ops.aten._efficient", "nn.functional.scaled_dot_product_attention",
    "nn.functional.multi_head_attention_forward", "histc", "histogram", "bincount",
    "unique", "nn.functional.embedding_bag", "index_reduce", "scatter_reduce",
    "nn.functional.max_unpool", "nn.functional.fractional_max_pool", "equal", "allclose",
    "storage", "nn.functional.pdist", "cov", "corrcoef", "native_dropout",
)


@functools.cache
def opinfo_db() -> dict[str, Any]:
    """OpInfo ops of the pool, keyed ``name`` or ``name.variant`` (imported on first use)."""
    from torch.testing._internal.common_methods_invocations import op_db

    out: dict[str, Any] = {}
    for op in op_db:
        key = op.name + ("." + op.variant_test_name if op.variant_test_name else "")
        if key.startswith(_SKIP_PREFIXES):
            continue
        out.setdefault(key, op)
    return out


@functools.cache
def opinfo_keys(dtype: torch.dtype) -> tuple[str, ...]:
    """The pool's ops that support ``dtype`` on CPU, in op_db's (deterministic) order."""
    keys = []
    for key, op in opinfo_db().items():
        try:
            if dtype in op.supported_dtypes("cpu"):
                keys.append(key)
        except Exception:
            continue
    return tuple(keys)


_samples: dict[tuple[str, torch.dtype], list[Any]] = {}


def samples(key: str, dtype: torch.dtype) -> list[Any]:
    """The first few sample inputs of an op (generated once, seeded, outside any engine)."""
    hit = _samples.get((key, dtype))
    if hit is None:
        hit = []
        with _plain(), torch.random.fork_rng():
            torch.manual_seed(0)
            try:
                for i, s in enumerate(opinfo_db()[key].sample_inputs("cpu", dtype,
                                                                    requires_grad=False)):
                    if i >= 4:
                        break
                    hit.append(s)
            except Exception:
                hit = []
        _samples[(key, dtype)] = hit
    return hit


def _clone(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, (list, tuple)):
        return type(v)(_clone(x) for x in v)
    if isinstance(v, dict):
        return {k: _clone(x) for k, x in v.items()}
    return v


def opinfo(key: str, dtype: torch.dtype, idx: int, x: torch.Tensor | None = None) -> Any:
    """Op ``key`` on its sample ``idx`` (fresh clones), ``x`` in place of the sample's input."""
    s = samples(key, dtype)[idx]
    inp = x if x is not None else _clone(s.input)
    return opinfo_db()[key].op(inp, *_clone(s.args), **_clone(s.kwargs))


def opinfo_(key: str, dtype: torch.dtype, idx: int, x: torch.Tensor) -> Any:
    """The in-place variant of op ``key`` on ``x``, with sample ``idx``'s other arguments."""
    s = samples(key, dtype)[idx]
    return opinfo_db()[key].inplace_variant(x, *_clone(s.args), **_clone(s.kwargs))


@contextlib.contextmanager
def _plain():
    """Plain eager for the generator's own work even if an engine is on (it never is)."""
    yield


# ----------------------------------------------------------------------------------------------
# Programs
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Program:
    inputs: list[str]  # setup lines, run outside the engine
    body: list[str]  # statements (a statement may be a block of lines)
    iters: int = 3
    per_round_context: bool = True  # False: one context, ae.sync() after each round
    features: tuple[str, ...] = ()
    seed: int | None = None

    def source(self, mode: str = "replay") -> str:
        """The program as a plain Python script (eager vs the engine, prints OK/DIFF)."""
        opts = ", ".join(f"{k}={v!r}" for k, v in MODES[mode].items())
        lines = [
            "import numpy as np, torch, torch.nn.functional as F",
            "import adaptive_eager as ae",
            "from fuzz_programs import opinfo, opinfo_  # tests/ on sys.path",
            "",
            f"OPTS = dict({opts})",
            "",
            "def run(engine):",
            "    torch.manual_seed(0)",
            *("    " + ln for ln in self.inputs),
            "    torch.manual_seed(1)",
        ]
        body = [ln for stmt in self.body for ln in stmt.splitlines()]
        if self.per_round_context:
            lines += [f"    for _ in range({self.iters}):",
                      "        with ae.adaptive_eager(**OPTS) if engine else "
                      "contextlib.nullcontext():",
                      *("            " + ln for ln in body)]
        else:
            lines += ["    with ae.adaptive_eager(**OPTS) if engine else contextlib.nullcontext():",
                      f"        for _ in range({self.iters}):",
                      *("            " + ln for ln in body),
                      "            ae.sync()"]
        lines += ["    return {k: v for k, v in locals().items()",
                  "            if k[0] in 'xtn' and k[1:].isdigit()}", ""]
        lines.insert(0, "import contextlib")
        return "\n".join(lines) + _SCRIPT_TAIL.format(mode=mode)


_SCRIPT_TAIL = '''
if __name__ == "__main__":
    import fuzz_programs
    print(fuzz_programs.check_callable(run, "{mode}"))
'''


# Known engine gaps (README, "Known gaps"), each with its strict xfail in
# tests/test_fuzz_regressions.py: left out of generated programs (statement kinds, OpInfo ops as
# "op:NAME", or variants such as "cmp_operator") so a sweep reports only new findings. Drop an
# entry when its regression test passes; ``--all`` on the command line keeps them in.
KNOWN: frozenset[str] = frozenset({
    "op:norm.nuc",  # test_svdvals_bitwise_under_replay
    # `x == lazy` runs reflected (CPython); the same comparison is written torch.eq(x, lazy)
    "cmp_operator",  # test_comparison_operator_with_pending_operand_keeps_eager_strides
})


class _Gen:
    """Builds one program, running each statement eagerly to know the variables' metadata."""

    def __init__(self, c: Chooser, mode: str, exclude: frozenset[str], opinfo_ops: bool,
                 small: bool) -> None:
        self.c, self.mode, self.exclude, self.use_opinfo = c, mode, exclude, opinfo_ops
        self.small = small
        self.ns: dict[str, Any] = base_namespace()
        self.inputs: list[str] = []
        self.body: list[str] = []
        self.features: list[str] = []
        self.n = 0
        self.ended = False

    # -- variables
    def fresh(self, prefix: str = "t") -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def tensors(self, pred: Callable[[torch.Tensor], bool] = lambda t: True) -> list[str]:
        return [k for k, v in self.ns.items()
                if VAR.match(k) and isinstance(v, torch.Tensor) and pred(v)]

    def pick(self, pred: Callable[[torch.Tensor], bool] = lambda t: True) -> str | None:
        names = self.tensors(pred)
        return self.c.choice(names) if names else None

    # -- statements
    def emit(self, feature: str, stmt: str, raises: bool = False) -> bool:
        """Run ``stmt`` in the generator's namespace; keep it if it behaves as intended."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exec(compile(stmt, "<fuzz>", "exec"), self.ns)
        except Exception:
            if raises:
                self.body.append(stmt)
                self.features.append(feature)
                self.ended = True
                return True
            for k in [k for k in self.ns if VAR.match(k) and f"{k} =" in stmt.split("\n")[0]]:
                self.ns.pop(k, None)
            return False
        if raises:
            return False
        self.body.append(stmt)
        self.features.append(feature)
        return True

    def make_inputs(self) -> None:
        shapes, dtypes = (SMALL_SHAPES, SMALL_DTYPES) if self.small else (SHAPES, DTYPES)
        for _ in range(self.c.integer(2, 4)):
            shape = self.c.choice(shapes)
            dtype = self.c.choice(dtypes)
            name = self.fresh("x")
            if dtype.is_floating_point:
                line = f"{name} = torch.randn({shape}, dtype=torch.{_dt(dtype)})"
            else:
                line = f"{name} = torch.randint(-5, 6, {shape})"
            if self.c.coin(0.2) and len(shape) >= 2:
                line += ".transpose(0, 1)"  # a non-contiguous input
            if dtype.is_floating_point and self.c.coin(0.1):
                line += ".requires_grad_()"  # a leaf: in-place writes to it raise
            self.inputs.append(line)
            exec(line, self.ns)

    def statement(self) -> None:
        kinds = [k for k in _KINDS if k not in self.exclude
                 and (self.use_opinfo or not k.startswith("opinfo"))]
        kind = self.c.choice(kinds)
        for _ in range(4):
            if getattr(self, "k_" + kind)():
                return

    # -- statement kinds (each returns whether it emitted)
    def k_opinfo(self) -> bool:
        dtype = self.c.choice(DTYPES)
        keys = [k for k in opinfo_keys(dtype) if "op:" + k not in self.exclude]
        if not keys:
            return False
        key = self.c.choice(keys)
        ss = samples(key, dtype)
        if not ss:
            return False
        idx = self.c.integer(0, len(ss) - 1)
        s = ss[idx]
        arg = ""
        if isinstance(s.input, torch.Tensor):
            same = self.tensors(lambda t: t.shape == s.input.shape and t.dtype == s.input.dtype)
            if same and self.c.coin(0.7):
                arg = ", " + self.c.choice(same)
        out = self.fresh()
        return self.emit("opinfo", f"{out} = opinfo({key!r}, torch.{_dt(dtype)}, {idx}{arg})")

    def k_opinfo_inplace(self) -> bool:
        dtype = self.c.choice(DTYPES)
        # polygamma_ fed its own output grows its values each round, and eager's kernel slows
        # with them (2 s a call near 1e8, minutes near 4e12): a stall of eager, not a finding
        keys = [k for k in opinfo_keys(dtype) if opinfo_db()[k].inplace_variant is not None
                and "op:" + k not in self.exclude and not k.startswith("polygamma")]
        if not keys:
            return False
        key = self.c.choice(keys)
        ss = samples(key, dtype)
        if not ss:
            return False
        idx = self.c.integer(0, len(ss) - 1)
        s = ss[idx]
        if not isinstance(s.input, torch.Tensor):
            return False
        same = self.tensors(lambda t: t.shape == s.input.shape and t.dtype == s.input.dtype)
        if not same:
            return False
        return self.emit("opinfo_inplace",
                         f"opinfo_({key!r}, torch.{_dt(dtype)}, {idx}, {self.c.choice(same)})")

    def k_binary(self) -> bool:
        a = self.pick()
        if a is None:
            return False
        ta = self.ns[a]
        b = self.pick(lambda t: _broadcastable(t.shape, ta.shape))
        if b is None:
            return False
        op = self.c.choice(["torch.add({a}, {b})", "torch.mul({a}, {b})", "{a} - {b}",
                            "torch.maximum({a}, {b})", "torch.where({a} > 0, {a}, {b})",
                            "{a} * 0.5 + {b}", "torch.true_divide({a}, {b}.abs() + 1)",
                            "torch.addcmul({a}, {a}, {b}, value=0.25)",
                            "torch.eq({a}, {b})" if "cmp_operator" in self.exclude
                            else "({a} == {b})",
                            "torch.lerp({a}.double(), {b}.double(), 0.3)",
                            "{a}.float().clamp(-2, 2).tanh() + {b}"])
        return self.emit("binary", f"{self.fresh()} = " + op.format(a=a, b=b))

    def k_unary(self) -> bool:
        a = self.pick()
        if a is None:
            return False
        op = self.c.choice(["{a}.abs()", "{a}.neg()", "{a}.float().exp().clamp(max=1e4)",
                            "{a}.float().sigmoid()", "{a}.clone()", "{a}.contiguous()",
                            "{a}.to(torch.float64)", "{a}.nan_to_num(0.0).clamp(-99, 99).long()",
                            "F.relu({a})", "{a}.sign()", "{a} * 3", "{a} + 1",
                            "{a}.float().pow(2)", "{a}.double().sqrt()"])
        return self.emit("unary", f"{self.fresh()} = " + op.format(a=a))

    def k_reduce(self) -> bool:
        a = self.pick(lambda t: t.dim() >= 1)
        if a is None:
            return False
        d = self.c.integer(0, self.ns[a].dim() - 1)
        op = self.c.choice(["{a}.sum({d})", "{a}.float().mean({d}, keepdim=True)",
                            "{a}.amax({d})", "{a}.cumsum({d})", "{a}.argmax({d})",
                            "{a}.float().softmax({d})", "{a}.sum()", "{a}.float().var({d})",
                            "{a}.float().norm()", "{a}.prod({d})"])
        return self.emit("reduce", f"{self.fresh()} = " + op.format(a=a, d=d))

    def k_matmul(self) -> bool:
        a = self.pick(lambda t: t.dim() == 2 and t.is_floating_point())
        if a is None:
            return False
        k = self.ns[a].shape[1]
        b = self.pick(lambda t: t.dim() in (1, 2) and t.shape[0] == k)
        if b is None:
            return False
        op = self.c.choice(["{a} @ {b}.to({a}.dtype)", "torch.mm({a}, {b}.to({a}.dtype))"
                            if self.ns[b].dim() == 2 else "torch.mv({a}, {b}.to({a}.dtype))"])
        return self.emit("matmul", f"{self.fresh()} = " + op.format(a=a, b=b))

    def k_cat(self) -> bool:
        a = self.pick(lambda t: t.dim() >= 1)
        if a is None:
            return False
        ta = self.ns[a]
        b = self.pick(lambda t: t.shape[1:] == ta.shape[1:] and t.dtype == ta.dtype)
        op = self.c.choice(["torch.cat([{a}, {b}])", "torch.stack([{a}, {a}], 1)",
                            "torch.cat([{b}, {a}], 0)[1:]"])
        return self.emit("cat", f"{self.fresh()} = " + op.format(a=a, b=b or a))

    def k_view(self) -> bool:
        a = self.pick()
        if a is None:
            return False
        t = self.ns[a]
        ops = ["{a}.view(-1)", "{a}.reshape(-1)[1:]", "{a}.unsqueeze(0)"]
        if t.dim() >= 2:
            ops += ["{a}.transpose(0, 1)", "{a}[1:, ::2]", "{a}.diagonal()", "{a}.t()",
                    "{a}.permute(1, 0, *range(2, {a}.dim()))", "{a}.narrow(1, 1, 2)",
                    "{a}.select(0, 1)", "{a}[..., -1]", "{a}.flatten(0, 1)"]
        if t.dim() >= 1:
            ops += ["{a}[1:]", "{a}[::2]", "{a}.unsqueeze(0).expand(3, *{a}.shape)",
                    "{a}.unflatten(0, ({a}.shape[0], 1))", "{a}.flip(0)"]
        if t.dim() >= 1 and t.shape[-1] == 1:
            ops += ["{a}.expand(*{a}.shape[:-1], 4)"]
        op = self.c.choice(ops)
        return self.emit("view", f"{self.fresh()} = " + op.format(a=a))

    def k_inplace(self) -> bool:
        p = self.pick()
        if p is None:
            return False
        t = self.ns[p]
        ops = ["{p}.add_(1)", "{p}.mul_(2)", "{p}.zero_()", "{p}.neg_()", "{p}.clamp_(-3, 3)"]
        src = self.pick(lambda s: _broadcastable(t.shape, s.shape, strict=True))
        if src is not None:
            ops += [f"{{p}}.copy_({src})", f"{{p}}.add_({src})", f"{{p}}.mul_({src})",
                    f"{{p}}.sub_({src}, alpha=2)"]
        if t.dim() >= 1 and t.shape[0] >= 3:
            ops += ["{p}[1:3] = 7", "{p}[0] = {p}[-1]", "{p}[::2] *= 2",
                    "{p}.index_put_((torch.tensor([0, 2]),), torch.tensor(5, dtype={p}.dtype))",
                    "{p}.index_put_((torch.tensor([1, 1]),), torch.ones((), dtype={p}.dtype), "
                    "accumulate=True)",
                    "{p}[torch.tensor([2, 0])] = {p}[torch.tensor([0, 1])]",
                    "{p}[{p} > 0] = 0"]
        if t.dim() >= 2:
            ops += ["{p}.diagonal().fill_(4)", "{p}.t().mul_(3)", "{p}[:, 0].copy_({p}[:, 1])"]
        op = self.c.choice(ops)
        ok = self.emit("inplace", op.format(p=p))
        if ok and self.c.coin(0.5):  # read what the write changed: the base, or a view of it
            self.emit("inplace", f"{self.fresh()} = {p} * 1")
        return ok

    def k_alias(self) -> bool:
        """Two views of one base; a write through one, then reads of the other and the base."""
        b = self.pick(lambda t: t.dim() >= 1 and t.numel() >= 4)
        if b is None:
            return False
        v1, v2, r = self.fresh(), self.fresh(), self.fresh()
        w = self.c.choice(["{v1}.add_(1)", "{v1}.mul_(-1)", "{v1}.copy_({v1}.flip(0))",
                           "{v1}[0] = 9"])
        stmt = (f"{v1} = {b}.view(-1)[1:]\n{v2} = {b}.view(-1)[:3]\n" + w.format(v1=v1)
                + f"\n{r} = {v2} + {b}.view(-1)[0]")
        return self.emit("alias", stmt)

    def k_numpy(self) -> bool:
        a = self.pick(lambda t: t.dim() >= 1)
        if a is None:
            return False
        n, t = self.fresh("n"), self.fresh()
        how = self.c.choice([
            "{n} = {a}.numpy()\n{t} = torch.from_numpy({n})",  # shares memory with a
            "{n} = {a}.numpy().copy()\n{t} = torch.from_numpy({n}) * 2",
            "{n} = {a}.numpy()\n{n} += 1\n{t} = {a} + 0",  # a numpy write, then read by torch
            "{n} = ({a} + 1).numpy()\n{t} = torch.as_tensor({n}.sum(0))",
            "{n} = {a}.numpy()\n{t} = torch.from_numpy({n})\n{a}.mul_(2)\n{t} = {t} + 0",
        ])
        return self.emit("numpy", how.format(a=a, n=n, t=t))

    def k_rng(self) -> bool:
        t = self.fresh()
        a = self.pick(lambda x: x.is_floating_point())
        ops = ["torch.rand({s})", "torch.randn({s}, dtype=torch.float64)",
               "torch.randint(0, 9, {s})", "torch.randperm(6)"]
        if a is not None:
            ops += [f"F.dropout({a}, 0.3, training=True)", f"torch.bernoulli({a}.sigmoid())",
                    f"{a}.clone().bernoulli_(0.4)", f"torch.rand_like({a}) + {a}",
                    f"torch.normal({a}, 1.0)"]
        seed = f"torch.manual_seed({self.c.integer(0, 3)})\n" if self.c.coin(0.5) else ""
        op = self.c.choice(ops).format(s=self.c.choice(SHAPES[:4]))
        return self.emit("rng", f"{seed}{t} = {op}")

    def k_branch(self) -> bool:
        a = self.pick(lambda x: x.numel() >= 1)
        if a is None:
            return False
        t = self.fresh()
        cond = self.c.choice(["{a}.sum().item() > 0", "bool(({a} > 1).any())",
                              "int({a}.argmax()) % 2 == 0", "float({a}.float().mean()) < 0.1",
                              "{a}.flatten()[0].item() >= 0"])
        stmt = (f"if {cond.format(a=a)}:\n    {t} = {a} + 1\nelse:\n    {t} = {a} * 2")
        return self.emit("branch", stmt)

    def k_error(self) -> bool:
        a = self.pick(lambda x: x.dim() >= 1)
        if a is None:
            return False
        t = self.fresh()
        ops = ["{t} = {a} + torch.ones(7)", "{t} = {a}.view(7, -1)", "{t} = {a}.sum(5)",
               "{t} = torch.cat([{a}, torch.ones(7, 7, 7, 7)])",
               "{t} = torch.mm({a}.float(), torch.ones(7, 3))", "{t} = {a}.expand(9, 9, 9, 9)"]
        ints = self.tensors(lambda x: x.dtype == torch.int64 and x.dim() >= 1)
        if ints:
            ops.append(f"{ints[0]}.add_(0.5)")  # "result type Float can't be cast to Long"
        wide = self.tensors(lambda x: x.dim() >= 1 and x.shape[0] >= 2)
        if wide:
            ops.append(f"{wide[0]}.unsqueeze(0).expand(2, *{wide[0]}.shape).add_(1)")
        op = self.c.choice(ops)
        return self.emit("error", op.format(a=a, t=t), raises=True)

    def k_autograd(self) -> bool:
        """A leaf made from a pool tensor, a loss, backward, its gradient read."""
        a = self.pick(lambda t: t.numel() >= 1)
        if a is None:
            return False
        w, l, g = self.fresh(), self.fresh(), self.fresh()
        f = self.c.choice(["({w}.tanh() * {w}).sum()", "({w} * 3).exp().clamp(max=1e3).mean()",
                           "{w}.pow(2).sum() + {w}.sum()", "F.softplus({w}).prod()",
                           "({w}.unsqueeze(0) * {w}.unsqueeze(-1)).sum()",
                           "{w}.flatten().cumsum(0).sum()"])
        stmt = (f"{w} = {a}.detach().double().clone().requires_grad_()\n"
                f"{l} = " + f.format(w=w) + f"\n{l}.backward()\n{g} = {w}.grad")
        return self.emit("autograd", stmt)

    def k_out(self) -> bool:
        """``out=`` variants: into a fresh empty tensor (resized), or into a view of a base."""
        a = self.pick()
        if a is None:
            return False
        ta = self.ns[a]
        p = self.pick(lambda t: t.shape == ta.shape and t.dtype == ta.dtype and t is not ta)
        t = self.fresh()
        ops = [f"{t} = torch.empty(0, dtype={a}.dtype)\ntorch.mul({a}, 2, out={t})",
               f"{t} = torch.empty(3, dtype={a}.dtype)\ntorch.neg({a}, out={t})"]
        if p is not None:
            ops += [f"torch.add({a}, {p}, out={p})", f"torch.mul({a}, {a}, out={p})",
                    f"torch.maximum({a}, {p}, out={p})"]
        return self.emit("out", self.c.choice(ops))

    def k_inplace_view(self) -> bool:
        """Ops that change a tensor's own shape or strides (``t_``, ``unsqueeze_``, ``resize_``)."""
        a = self.pick(lambda t: t.numel() >= 2)
        if a is None:
            return False
        t, r = self.fresh(), self.fresh()
        dim = self.ns[a].dim()
        ops = ["{t}.unsqueeze_(0)", "{t}.squeeze_()", "{t}.resize_(2)",
               "{t}.as_strided_((2,), (1,))", "{t}.unsqueeze_(-1).transpose_(0, -1)"]
        if dim == 2:
            ops += ["{t}.t_()"]
        if dim >= 2:
            ops += ["{t}.transpose_(0, 1)", "{t}.swapdims_(0, -1)"]
        src = self.c.choice([f"{a}.clone()", f"{a}.view_as({a})"]) if dim else f"{a}.clone()"
        op = self.c.choice(ops).format(t=t)
        return self.emit("inplace_view", f"{t} = {src}\n{op}\n{r} = {t} * 2")

    def k_detach(self) -> bool:
        """Aliases autograd does not see (``detach()``, ``.data``) written, then the base read."""
        a = self.pick()
        if a is None:
            return False
        d, r = self.fresh(), self.fresh()
        op = self.c.choice(["{d} = {a}.detach()\n{d}.add_(1)",
                            "{d} = {a}.data\n{d}.mul_(2)",
                            "{d} = {a}.detach().view(-1)\n{d}[0] = -1",
                            "{d} = {a} * {a}.flatten()[0].item()"])
        return self.emit("detach", op.format(a=a, d=d) + f"\n{r} = {a} + 0")


_KINDS = ("opinfo", "opinfo", "opinfo_inplace", "binary", "binary", "unary", "reduce", "matmul",
          "cat", "view", "view", "inplace", "inplace", "alias", "numpy", "rng", "branch",
          "autograd", "out", "inplace_view", "detach")
FEATURES = tuple(sorted(set(_KINDS))) + ("error",)


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _broadcastable(a: torch.Size, b: torch.Size, strict: bool = False) -> bool:
    """``b`` broadcasts against ``a`` (``strict``: to ``a``'s own shape, for in-place writes)."""
    try:
        out = torch.broadcast_shapes(a, b)
    except RuntimeError:
        return False
    return out == a if strict else True


def base_namespace() -> dict[str, Any]:
    return {"torch": torch, "F": F, "np": np, "ae": ae, "opinfo": opinfo, "opinfo_": opinfo_,
            "__builtins__": __builtins__}


def generate(c: Chooser, mode: str = "replay", exclude: frozenset[str] = frozenset(),
             opinfo_ops: bool = True, max_statements: int = 10, small: bool = False) -> Program:
    """One random program (its statements checked against plain eager as it is built).

    ``small``: the fused vocabulary (Note [fused vocabulary])."""
    g = _Gen(c, mode, exclude, opinfo_ops and not small, small)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        g.make_inputs()
        torch.manual_seed(1)
        for _ in range(c.integer(1, max_statements)):
            g.statement()
        # an error ends the body in its first round, so only one program in ten ends with one
        if "error" not in exclude and c.integer(0, 9) == 0:
            for _ in range(4):
                if g.k_error():
                    break
    iters = c.integer(2, 4) if mode == "replay" else c.integer(3, 5)
    return Program(g.inputs, g.body, iters=iters, per_round_context=c.coin(0.75),
                   features=tuple(sorted(set(g.features))))


# ----------------------------------------------------------------------------------------------
# Running and comparing
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Outcome:
    values: dict[str, Any]
    error: tuple[str, int, Any, str] | None  # (type name, round, statement index or "exit", text)
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)


_codes: dict[str, Any] = {}


def _code(stmt: str) -> Any:
    code = _codes.get(stmt)
    if code is None:
        if len(_codes) > 20000:
            _codes.clear()
        code = _codes[stmt] = compile(stmt, "<fuzz>", "exec")
    return code


def run_program(p: Program, mode: str | None) -> Outcome:
    """Run ``p`` plainly (``mode`` None) or under the engine mode ``mode``."""
    ns = base_namespace()
    torch.manual_seed(0)
    for ln in p.inputs:
        exec(_code(ln), ns)
    torch.manual_seed(1)
    codes = [_code(s) for s in p.body]
    error = None
    where: tuple[int, Any] = (0, 0)
    opts = MODES[mode] if mode else None
    if mode:
        ae.clear_caches()
        ae.reset_metrics()

    def ctx() -> Any:
        return ae.adaptive_eager(**opts) if opts else contextlib.nullcontext()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if p.per_round_context:
                for it in range(p.iters):
                    with ctx():
                        for k, code in enumerate(codes):
                            where = (it, k)
                            exec(code, ns)
                        where = (it, "exit")
            else:
                with ctx():
                    for it in range(p.iters):
                        for k, code in enumerate(codes):
                            where = (it, k)
                            exec(code, ns)
                        where = (it, "sync")
                        ae.sync()
                    where = (p.iters - 1, "exit")
        except Exception as err:  # noqa: BLE001 - compared with eager's
            error = (type(err).__name__, where[0], where[1], str(err).split("\n")[0][:200])
    values = {k: _snapshot(v) for k, v in ns.items() if VAR.match(k)}
    return Outcome(values, error, ae.metrics() if mode else {})


def _snapshot(v: Any) -> Any:
    """A plain copy of a value (tensor values and metadata; numpy arrays; scalars as they are)."""
    if isinstance(v, torch.Tensor):
        meta = (v.dtype, tuple(v.shape), v.stride(), v.storage_offset(), v.requires_grad)
        plain = torch.empty(v.shape, dtype=v.dtype)
        plain.copy_(v.detach())  # real (the engine's are materialized once their context exits)
        grad = v.grad if v.is_leaf and v.requires_grad else None
        return ("tensor", meta, plain, None if grad is None else _snapshot(grad))
    if isinstance(v, np.ndarray):
        return ("ndarray", (v.dtype, v.shape, v.strides), v.copy())
    if isinstance(v, (tuple, list)):
        return ("seq", type(v).__name__, [_snapshot(x) for x in v])
    return ("other", type(v).__name__, v if isinstance(v, (int, float, bool, str, type(None)))
            else repr(type(v)))


def _values_equal(a: torch.Tensor, b: torch.Tensor, tol: tuple[float, float] | None) -> bool:
    if tol is None or not a.is_floating_point():
        return torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                     and torch.equal(a.nan_to_num(), b.nan_to_num()))
    return torch.allclose(a, b, rtol=tol[0], atol=tol[1], equal_nan=True)


def compare(eager: Outcome, other: Outcome, fused: bool) -> list[str]:
    """Differences of ``other`` from ``eager`` (empty: they agree)."""
    diffs: list[str] = []
    if eager.error != other.error:
        e, o = eager.error, other.error
        if e is None or o is None or e[:3] != o[:3]:
            diffs.append(f"exception: eager {e} vs engine {o}")
            if e is not None or o is not None:
                return diffs  # values after different exceptions are not comparable
    for name in sorted(set(eager.values) | set(other.values), key=_var_order):
        a, b = eager.values.get(name), other.values.get(name)
        if a is None or b is None:
            diffs.append(f"{name}: present only in {'eager' if b is None else 'engine'}")
            continue
        diffs += [f"{name}: {d}" for d in _diff_value(a, b, fused)]
    return diffs


def _diff_value(a: Any, b: Any, fused: bool) -> list[str]:
    if a[0] != b[0]:
        return [f"kind {a[0]} vs {b[0]}"]
    if a[0] == "tensor":
        (dt, shape, stride, off, rg), x = a[1], a[2]
        (dt2, shape2, stride2, off2, rg2), y = b[1], b[2]
        if (dt, shape) != (dt2, shape2):
            return [f"dtype/shape {dt}{shape} vs {dt2}{shape2}"]
        out = []
        if rg != rg2:
            out.append(f"requires_grad {rg} vs {rg2}")
        if (a[3] is None) != (b[3] is None):
            out.append(f"grad {'None' if a[3] is None else 'set'} vs "
                       f"{'None' if b[3] is None else 'set'}")
        elif a[3] is not None:
            out += [f".grad {d}" for d in _diff_value(a[3], b[3], fused)]
        if (stride, off) != (stride2, off2):
            out.append(f"stride/offset {stride}+{off} vs {stride2}+{off2}")
        if not _values_equal(x, y, FUSED_TOL.get(dt) if fused else None):
            out.append("values differ: " + _describe(x, y))
        return out
    if a[0] == "ndarray":
        if a[1][:2] != b[1][:2]:
            return [f"ndarray meta {a[1]} vs {b[1]}"]
        x, y = torch.from_numpy(a[2]), torch.from_numpy(b[2])
        tol = FUSED_TOL.get(x.dtype) if fused else None
        return [] if _values_equal(x, y, tol) else ["ndarray values differ: " + _describe(x, y)]
    if a[0] == "seq":
        if a[1] != b[1] or len(a[2]) != len(b[2]):
            return [f"sequence {a[1]}[{len(a[2])}] vs {b[1]}[{len(b[2])}]"]
        return [f"[{i}] {d}" for i, (x, y) in enumerate(zip(a[2], b[2]))
                for d in _diff_value(x, y, fused)]
    if a != b and not (isinstance(a[2], float) and isinstance(b[2], float)
                       and (math.isclose(a[2], b[2], rel_tol=1e-4) if fused
                            else (a[2] != a[2] and b[2] != b[2]))):
        return [f"{a[1:]} vs {b[1:]}"]
    return []


def _describe(x: torch.Tensor, y: torch.Tensor) -> str:
    try:
        d = (x.double() - y.double()).abs().nan_to_num(nan=float("inf"))
        i = int(d.flatten().argmax()) if d.numel() else 0
        return (f"max abs diff {float(d.max()) if d.numel() else 0:.3g} at flat {i} "
                f"(eager {x.flatten()[i].item() if x.numel() else None}, "
                f"engine {y.flatten()[i].item() if y.numel() else None})")
    except Exception as err:  # noqa: BLE001
        return repr(err)


def _var_order(name: str) -> tuple[str, int]:
    return name[0], int(name[1:])


LAST_METRICS: dict[str, Any] = {}  # the engine's counters of the last ``check``


def check(p: Program, mode: str) -> list[str]:
    """Run ``p`` eagerly and under ``mode``; the differences (eager twice first: if eager does not
    agree with itself, the program is not a test and no difference is reported)."""
    eager = run_program(p, None)
    try:
        other = run_program(p, mode)
    except BaseException as err:  # noqa: BLE001 - an engine crash outside the program's code
        return [f"engine crashed: {err!r}\n{traceback.format_exc()}"]
    LAST_METRICS.clear()
    LAST_METRICS.update(other.metrics)
    diffs = compare(eager, other, fused=(mode == "fused"))
    if diffs and compare(eager, run_program(p, None), fused=False):
        return []  # eager is not deterministic here
    return diffs


def check_callable(run: Callable[[bool], dict[str, Any]], mode: str) -> str:
    """For printed programs: compare ``run(False)`` (eager) with ``run(True)`` (engine)."""
    def outcome(engine: bool) -> Outcome:
        try:
            vals = run(engine)
            err = None
        except Exception as e:  # noqa: BLE001
            vals, err = {}, (type(e).__name__, 0, 0, str(e)[:200])
        return Outcome({k: _snapshot(v) for k, v in vals.items()}, err)

    diffs = compare(outcome(False), outcome(True), fused=(mode == "fused"))
    return "OK" if not diffs else "DIFF\n" + "\n".join(diffs)


def minimise(p: Program, mode: str, keep: Callable[[list[str]], bool] | None = None) -> Program:
    """A smaller program with a difference of the same class (greedy: drop statements, inputs,
    rounds while ``keep(diffs)`` holds)."""
    diffs = check(p, mode)
    want = classify(diffs) if diffs else None
    keep = keep or (lambda d: bool(d) and classify(d) == want)
    if not keep(diffs):
        return p

    def still(q: Program) -> bool:
        try:
            return keep(check(q, mode))
        except Exception:  # noqa: BLE001
            return False

    changed = True
    while changed:
        changed = False
        for field in ("body", "inputs"):
            i = 0
            while i < len(getattr(p, field)):
                items = getattr(p, field)
                q = dataclasses.replace(p, **{field: items[:i] + items[i + 1:]})
                if still(q):
                    p, changed = q, True
                else:
                    i += 1
        for iters in range(1, p.iters):
            q = dataclasses.replace(p, iters=iters)
            if still(q):
                p, changed = q, True
                break
        if not p.per_round_context:
            q = dataclasses.replace(p, per_round_context=True)
            if still(q):
                p, changed = q, True
    return p


def report(p: Program, mode: str, diffs: list[str]) -> str:
    """What a failing test prints: the differences, then the program as a script."""
    head = f"{len(diffs)} difference(s), mode {mode}, seed {p.seed}, features {p.features}"
    return "\n".join([head, *diffs[:12], "", "# ---- program (tests/ on sys.path) ----",
                      p.source(mode)])


# ----------------------------------------------------------------------------------------------
# Command line: a sweep that logs every mismatch instead of stopping at the first
# ----------------------------------------------------------------------------------------------

def sweep(mode: str, n: int, first: int = 0, exclude: frozenset[str] = frozenset(),
          opinfo_ops: bool = True, out: Any = sys.stdout, small: bool = False) -> Counter:
    counts: Counter = Counter()
    t0 = time.time()
    for seed in range(first, first + n):
        p = generate(Chooser(seed), mode, exclude, opinfo_ops,
                     max_statements=6 if small else 10, small=small)
        p.seed = seed
        # a program still running after 300 s prints every thread's stack (a hang is a finding)
        faulthandler.dump_traceback_later(300, exit=False)
        try:
            diffs = check(p, mode)
        finally:
            faulthandler.cancel_dump_traceback_later()
        counts["programs"] += 1
        for key in ("compiled_runs", "replayed_runs", "compile_errors", "fused_errors",
                    "quarantined", "fallback_ops", "engine_errors"):
            value = LAST_METRICS.get(key) or 0
            value = sum(value.values()) if isinstance(value, dict) else value
            counts["sum " + key] += value
            counts["programs with " + key] += bool(value)
        if diffs:
            counts["mismatches"] += 1
            counts["class: " + classify(diffs)] += 1
            print(f"=== seed {seed} ===\n" + report(p, mode, diffs), file=out, flush=True)
        if (seed - first + 1) % (50 if mode == "replay" else 5) == 0:
            print(f"# {seed - first + 1}/{n} programs, {counts['mismatches']} mismatches, "
                  f"{time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    return counts


def classify(diffs: list[str]) -> str:
    d = diffs[0]
    if d.startswith("engine crashed"):
        return "crash"
    if d.startswith("exception"):
        return "exception"
    if "stride" in d:
        return "stride"
    if "dtype/shape" in d:
        return "metadata"
    return "values"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=sorted(MODES), default="replay")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None, help="print/check one program")
    ap.add_argument("--show", action="store_true")
    ap.add_argument("--minimise", action="store_true", help="with --seed: shrink a mismatch")
    ap.add_argument("--exclude", default="", help="comma-separated statement kinds")
    ap.add_argument("--all", action="store_true", help="keep the known gaps (KNOWN) in")
    ap.add_argument("--no-opinfo", action="store_true")
    ap.add_argument("--small", action="store_true", help="the fused vocabulary")
    args = ap.parse_args(argv)
    exclude = frozenset(x for x in args.exclude.split(",") if x) | (
        frozenset() if args.all else KNOWN)
    if args.seed is not None:
        p = generate(Chooser(args.seed), args.mode, exclude, not args.no_opinfo,
                     max_statements=6 if args.small else 10, small=args.small)
        p.seed = args.seed
        if args.show:
            print(p.source(args.mode))
        if args.minimise:
            p = minimise(p, args.mode)
        diffs = check(p, args.mode)
        print(report(p, args.mode, diffs) if diffs else "OK")
        return 1 if diffs else 0
    counts = sweep(args.mode, args.n, args.first, exclude, not args.no_opinfo, small=args.small)
    print("# " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
