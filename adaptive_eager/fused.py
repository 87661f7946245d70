"""Run a trace's fused program: inputs in, live values out, input mutations applied in place.

The program runs under the same guards as replay (below autograd, no Python dispatch), on
detached aliases of the external tensors, so mutations land in their storage (an optimizer step
updates the parameters) without autograd seeing a second write. With ``crosscheck``, the program
runs on copies and the trace also runs op by op; any difference quarantines the trace and the
op-by-op values are the ones the user gets.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from adaptive_eager.spans import span
from adaptive_eager.cache.memory import TraceEntry
from adaptive_eager.compiler import run_size
from adaptive_eager.core.meta import meta_of
from adaptive_eager.execute import ReplayGuard, replay
from adaptive_eager.graph import ext_reals
from adaptive_eager.metrics import METRICS as M
from adaptive_eager.trace import Trace

log = logging.getLogger("adaptive_eager")


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
    try:
        inputs = g.inputs(reals, tr.scalars)
    except Exception as err:  # an engine fault: counted, and this run goes op by op
        mgr.fused_failed(entry, err)
        return None
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
    unlike = _unlike_eager(tr, g.live, outs)
    if unlike is not None:  # Note [outputs unlike eager's]
        mgr.quarantine(entry, unlike)
        M.fused_errors += 1
        if not g.writes_ext:
            return None  # the program wrote nothing: this run goes op by op, eager's values
        log.error("adaptive_eager: %s, after the program had written its inputs in place; "
                  "this run's values may differ from eager's", unlike)
    mgr.decisions.record_fused(entry, time.perf_counter() - start, run_size(entry, tr))
    M.compiled_runs += 1
    M.ops_fused += len(tr.ops)
    env: list[Any] = [None] * tr.n_slots
    refs = tr.refs
    for s, out in zip(g.live, _repaired(entry, program, tr, reals, outs)):
        # A program serves runs whose live slots it covers: an output the user has dropped
        # since it was compiled is freed here, not held to the end of the flush (Note
        # [replay liveness] in execute.py).
        if refs[s]() is not None:
            env[s] = out
    del outs
    _fix_layouts(mgr, entry, tr, env, g.live)
    return env


# Note [outputs unlike eager's]
# Each lazy tensor promised a dtype, shape and device when its op was recorded, from eager's
# own kernels; a program that returns something else computed something else (Inductor's
# clamp once kept a bool dtype where eager promotes: Note [clamp of lifted numbers]). Only
# strides may differ (_fix_layouts copies those into eager's layout). Any other difference
# quarantines the trace; the run goes op by op when the program wrote no external tensor, so
# nothing was changed yet. A program that did write one has applied its writes already: that
# run keeps its values (logged as an error, counted in ``fused_errors``) and every later run is
# op by op. Three attribute comparisons per live output a run (about a microsecond).
def _unlike_eager(tr: Trace, live: tuple, outs: Any) -> str | None:
    """Why the program's outputs are not what eager's kernels promised, or None."""
    refs = tr.refs
    for k, (s, out) in enumerate(zip(live, outs)):
        w = refs[s]()
        if w is None or not isinstance(out, torch.Tensor):
            continue
        want = w._ae_meta
        if out.dtype != want.dtype or out.shape != want.size or out.device != want.device:
            return (f"fused output {k} is {out.dtype}{list(out.shape)} on {out.device} where "
                    f"eager gives {want.dtype}{list(want.size)} on {want.device}")
    return None


_ALIAS, _COPY = 0, 1


def _repaired(entry: TraceEntry, program: Any, tr: Trace, reals: list[torch.Tensor],
              outs: Any) -> Any:
    """The outputs, with those that alias more than in eager re-viewed or copied (Note
    [output aliasing] in graph.py). What a program returns is fixed by its code, so the repairs
    are found at its first run and kept with the entry."""
    known = entry.alias_fix
    if known is None or known[0] is not program:
        known = entry.alias_fix = (program, _alias_actions(entry.graph.out_roots, reals, outs))
    actions = known[1]
    if not actions:
        return outs
    outs = list(outs)
    for k, action in actions:
        out = outs[k]
        if action == _ALIAS:
            outs[k] = torch.ops.aten.alias.default(out)  # the same memory, its own metadata
        else:
            w = tr.refs[entry.graph.live[k]]()
            want = meta_of(out) if w is None else w._ae_meta
            fresh = torch.empty_strided(want.size, want.stride, dtype=want.dtype,
                                        device=want.device)
            fresh.copy_(out)
            outs[k] = fresh
        M.alias_fixes += 1
    return outs


def _storage_ptr(t: Any) -> int:
    """The address of a strided tensor's storage (0: none, or not strided)."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return 0
    return t.untyped_storage().data_ptr()


def _alias_actions(roots: Any, reals: list[torch.Tensor], outs: Any
                   ) -> tuple[tuple[int, int], ...]:
    """(output index, _ALIAS or _COPY) for each output that shares memory where eager's does
    not: the same object as an earlier output, an input's storage that it is no view of, or
    the storage of an earlier output of another root."""
    if roots is None or len(roots) != len(outs):
        return ()
    inputs = {_storage_ptr(t) for t in reals}
    inputs.discard(0)
    by_obj: dict[int, int] = {}
    by_ptr: dict[int, Any] = {}
    actions: list[tuple[int, int]] = []
    for k, (out, root) in enumerate(zip(outs, roots)):
        if not isinstance(out, torch.Tensor):
            continue
        j = by_obj.setdefault(id(out), k)
        if j != k:
            actions.append((k, _ALIAS if roots[j] == root else _COPY))
            continue
        p = _storage_ptr(out)
        if not p:
            continue
        own_input = root[0] == "x" and _storage_ptr(reals[root[1]]) == p
        if own_input:
            continue
        if p in inputs or by_ptr.setdefault(p, root) != root:
            actions.append((k, _COPY))
    return tuple(actions)


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
