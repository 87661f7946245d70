"""Run a trace's fused program: inputs in, live values out, input mutations applied in place.

The program runs under the same guards as replay (below autograd, no Python dispatch), on
detached aliases of the external tensors, so mutations land in their storage (an optimizer step
updates the parameters) without autograd seeing a second write. With ``crosscheck``, the program
runs on copies and the trace also runs op by op; any difference quarantines the trace and the
op-by-op values are the ones the user gets.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from adaptive_eager.spans import span
from adaptive_eager.cache.memory import TraceEntry
from adaptive_eager.compiler import run_size
from adaptive_eager.dispatch.lazy import meta_of
from adaptive_eager.execute import ReplayGuard, replay
from adaptive_eager.graph import ext_reals
from adaptive_eager.metrics import METRICS as M
from adaptive_eager.trace import Trace


def _call(program: Any, inputs: list[Any]) -> Any:
    with span("adaptive_eager.fused"):
        return program(*inputs)


def run_fused(mgr: Any, entry: TraceEntry, program: Any, tr: Trace,
              crosscheck: bool) -> list | None:
    """The env (values by slot) from the fused program, or None to fall back to replay."""
    with ReplayGuard():  # every tensor op here is the engine's own, never the user's
        return _run_fused(mgr, entry, program, tr, crosscheck)


def _run_fused(mgr: Any, entry: TraceEntry, program: Any, tr: Trace,
               crosscheck: bool) -> list | None:
    g = entry.graph
    reals = [t.detach() for t in ext_reals(tr)]
    if crosscheck:
        return _crosschecked(mgr, entry, program, tr, reals)
    inputs = g.inputs(reals, tr.scalars)
    if inputs is None:
        return None  # aliased inputs moved since compiling: this run goes op by op
    start = time.perf_counter()
    try:
        outs = _call(program, inputs)
    except Exception as err:
        # Inductor applies input mutations after its kernels ran, so a raise leaves inputs as
        # they were: replaying is safe.
        mgr.fused_failed(entry, err)
        return None
    mgr.record_fused(entry, time.perf_counter() - start, run_size(entry, tr))
    M.compiled_runs += 1
    M.ops_fused += len(tr.ops)
    env: list[Any] = [None] * tr.n_slots
    refs = tr.refs
    for s, out in zip(g.live, outs):
        # A program serves runs whose live slots it covers: an output the user has dropped
        # since it was compiled is freed here, not held to the end of the flush (Note
        # [replay liveness] in execute.py).
        if refs[s]() is not None:
            env[s] = out
    del outs
    _fix_layouts(mgr, entry, tr, env, g.live)
    return env


def _fix_layouts(mgr: Any, entry: TraceEntry, tr: Trace, env: list, live: tuple) -> None:
    """A fused output must have the strides its lazy tensor promised (they are user-visible).

    Inductor may lay out an output differently (a transposed view of an intermediate comes back
    dense); it is then copied into eager's layout and counted in ``layout_fixes``."""
    for s in live:
        w = tr.refs[s]()
        out = env[s]
        if w is None or out is None:
            continue
        want = w._ae_meta
        if meta_of(out) is not want:
            fixed = torch.empty_strided(want.size, want.stride, dtype=want.dtype,
                                        device=want.device)
            fixed.copy_(out)  # same values; the strides eager would have produced
            env[s] = fixed
            M.layout_fixes += 1


def _crosschecked(mgr: Any, entry: TraceEntry, program: Any, tr: Trace,
                  reals: list[torch.Tensor]) -> list | None:
    g = entry.graph
    copies = _clone_preserving_aliases(reals)
    inputs = g.inputs(copies, tr.scalars)
    if inputs is None:
        return None
    try:
        outs = _call(program, inputs)
    except Exception as err:
        mgr.fused_failed(entry, err)
        return None
    M.compiled_runs += 1
    env = replay(tr, list(g.live), False)
    problems = [f"output slot {s}" for s, out in zip(g.live, outs)
                if env[s] is not None and not _close(out, env[s])]
    problems += [f"input {i} after the run" for i, (c, r) in enumerate(zip(copies, reals))
                 if not _close(c, r)]
    if problems:
        mgr.quarantine(entry, "fused result differs from op-by-op replay: " + ", ".join(
            problems[:4]))
    return env


def _clone_preserving_aliases(reals: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the inputs that share storage exactly where the originals do."""
    storages: dict[int, torch.Tensor] = {}
    out = []
    for t in reals:
        st = t.untyped_storage()
        base = storages.get(st.data_ptr())
        if base is None:
            n = st.nbytes() // t.element_size()
            base = storages[st.data_ptr()] = t.as_strided((n,), (1,), 0).clone()
        out.append(base.as_strided(t.shape, t.stride(), t.storage_offset()))
    return out


_TOL = {torch.float16: (1e-3, 1e-3), torch.bfloat16: (1.6e-2, 1e-2),
        torch.float32: (1.3e-6 * 100, 1e-5 * 10), torch.float64: (1e-7, 1e-7)}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal within the dtype's tolerance (exact for integers and bools)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return bool(torch.equal(a, b))
    rtol, atol = _TOL.get(a.dtype, (1e-5, 1e-5))
    return bool(torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))
