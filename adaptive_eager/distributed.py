"""Ranks of one torch.distributed job make the same decisions for the same trace.

Note [ranks agree]
Under DDP (and FSDP, and any data-parallel scheme) replicas stay equal only if every rank applies
the same averaged gradient with the same arithmetic. Op-by-op replay and plain eager (stepping
aside) are the same arithmetic; a fused program is not (within tolerance, not bitwise). So every
rank must run a given trace fused, or not, at the same run of that trace. Left alone, each rank
decided from its own clock: a compile finished at step 9 on one rank and step 12 on the other,
one rank kept a program its twin dropped, one stepped aside: measured on main, 3 of 4 warm
2-rank DDP runs ended with bitwise different replicas. In a distributed job (``WORLD_SIZE`` > 1
in the environment, or an initialized default process group of more than one rank):

- *When* is a pure function of the trace's run count. Compiles and disk loads are synchronous
  (the flush that wants the program waits for it, as with ``compile_async`` off), and a program
  is looked for (disk or compile) at the trace's ``hot_after``-th run only, never earlier because
  this machine's disk remembers the trace as hot. Every rank that runs the same traces switches
  at the same run; no background compile can finish "at a different step".
- *What* (the plan at that run: look for a program, or stay op by op because this disk says so;
  keep or drop a measured program; step aside) is agreed through the job's
  c10d store: at each decision point a rank proposes its own answer with
  ``store.compare_set(topic, "", mine)``, and the store keeps the first proposal. Every rank gets
  that first answer back. The topic names the decision by what all ranks share: the trace digest
  and its run count (or the flush count).
- No measured trial (Note [measured trial] in trial.py): a trial starts once a rank's compile
  manager has settled, which each rank reaches at its own step, and then alternates fused and
  eager rounds, so the replicas ran different arithmetic at the same step (1 of 5 fused 2-rank
  DDP runs diverged). A job steps aside only on the agreed estimate, at one flush count.

Why first-writer-wins on the store, and not a collective or a barrier at the decision point:
compare_set never waits for another rank. A rank that runs traces its peers do not (rank 0
evaluating, a short last batch) proposes into topics nobody else reads and simply gets its own
answer back; it can never hang, and no collective is issued that the peers would have to match
(a mismatched collective deadlocks or corrupts the peers' next one). The cost is one store round
trip per decision (16 us on 127.0.0.1 here), a few per trace over a whole run. The price of not
waiting: ranks do not pool their measurements (the first rank's timing decides). What the store
cannot make agree: a rank whose own compile or program fails where its peers' work (it runs op
by op while they run fused; a trace this rank's cache quarantined is counted as ``diverged`` and
warned once, a failed compile is not detected), and a run whose set of live values differs
between ranks (the engine decides per run, from weak references, whether the program returns
every value still referenced; a tensor kept alive a little longer on one rank, by a reference
cycle the garbage collector has not reached yet, sends that run op by op there). With no store (a job before ``init_process_group``, or a store
without compare_set) each decision takes a fixed answer that does not depend on timing: look for
a program, keep it, never step aside.

Ranks on one machine share the disk cache, so with compiles synchronous the first rank to reach
a hot trace compiles it and its peers wait for the program on disk (Note [one compile per
machine]) instead of compiling the same graph on the same cores.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import sys
import time
from typing import Any

from adaptive_eager.compile import policy  # the hot rule's MIN_OBSERVED
from adaptive_eager.core import hooks

log = logging.getLogger("adaptive_eager")

# Counters of this module (metrics.py has fixed slots; the report reads these through stats()).
STATS: collections.Counter[str] = collections.Counter()
PEER_WAIT_S = 600.0  # longest wait for a peer's program on disk before compiling here
_POLL_S = 0.05

_env_world: int | None = None
_store_for: tuple[Any, Any] | None = None  # (default group, prefixed store or None)
_warned: set[str] = set()


def _world_from_env() -> int:
    global _env_world
    if _env_world is None:
        try:
            _env_world = int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            _env_world = 1
    return _env_world


def _dist() -> Any:
    """torch.distributed if the program imported it (never imported here for nothing)."""
    d = sys.modules.get("torch.distributed")
    if d is None or not d.is_available():
        return None
    return d


def active() -> bool:
    """Whether this process is one rank of a distributed job of more than one rank."""
    if _world_from_env() > 1:
        return True
    d = _dist()
    return d is not None and d.is_initialized() and d.get_world_size() > 1


def sync_compiles() -> bool:
    """Compiles and loads run at the flush that wants them (Note [ranks agree])."""
    return active()


def rank() -> int:
    d = _dist()
    if d is not None and d.is_initialized():
        return d.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


# Note [job id]
# ``adaptive-eager report`` groups the run logs of one job's ranks. torchrun's TORCHELASTIC_RUN_ID
# is "none" unless the job was given ``--rdzv-id`` (or ``--standalone``), and
# torch.multiprocessing.spawn sets nothing, so neither names a job alone. While the process
# group is up, the ranks agree on an id through the job's store (the first proposal wins, as for
# decisions: Note [ranks agree]): torchrun's run id, if it has one, plus a random part, so two
# jobs never share an id. The id is resolved once, at the first store access (the first
# decision) or when the run log is written, whichever comes first. A rank that never reaches the
# store while the group is up (a replay-only run whose log is written after
# ``destroy_process_group``) records torchrun's id, else ``MASTER_ADDR:MASTER_PORT``
# (``job_kind`` "address"): the report then groups runs of that address whose times overlap
# (two jobs cannot hold one port at once).
_job: tuple[str, str] | None = None  # (id, kind) once agreed


def job_id() -> str:
    """The job's id, the same on every rank (Note [job id]; "" outside a distributed job)."""
    return _job_info()[0]


def _job_info() -> tuple[str, str]:
    global _job
    if _job is not None:
        return _job
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    named = run_id if run_id not in ("", "none") else ""
    store = _store(resolve_job=False)
    if store is not None:
        import uuid

        mine = f"{named or 'job'}-{uuid.uuid4().hex[:12]}"
        try:
            got = store.compare_set("job", "", mine)
            _job = (got.decode() if isinstance(got, bytes) else str(got), "store")
            return _job
        except Exception:
            STATS["store_errors"] += 1
    if named:
        return named, "torchrun"
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return (f"{addr}:{port}", "address") if addr and port else ("", "")


def run_info() -> dict[str, Any] | None:
    """What this rank's run log records about its job (None outside a distributed job)."""
    if not active():
        return None
    d = _dist()
    world = _world_from_env()
    if d is not None and d.is_initialized():
        world = d.get_world_size()
    job, kind = _job_info()
    try:
        local = int(os.environ.get("LOCAL_RANK", "-1"))
    except ValueError:
        local = -1
    return {"rank": rank(), "world": world, "local_rank": local, "job": job, "job_kind": kind,
            "host": socket.gethostname(), "pid": os.getpid(), **STATS}


def log_fields() -> dict[str, Any]:
    """Fields of the run log's head record: this rank's job (``dist``) and the remote store's
    counters (``remote``), each only when there is something to say."""
    out: dict[str, Any] = {}
    try:
        info = run_info()
        if info is not None:
            out["dist"] = info
        from adaptive_eager.cache import remote

        rs = remote.stats()
        if rs:
            out["remote"] = rs
    except Exception as err:  # a log field must never break the run log
        log.debug("adaptive_eager: no job fields in the run log: %s", err)
    return out


def _store(resolve_job: bool = True) -> Any:
    """The default process group's store under an ``adaptive_eager/`` prefix, or None."""
    global _store_for
    d = _dist()
    if d is None or not d.is_initialized():
        return None
    try:
        group = d.distributed_c10d._get_default_group()
    except Exception:
        return None
    if _store_for is not None and _store_for[0] is group:
        return _store_for[1]
    store = None
    try:
        base = d.distributed_c10d._get_default_store()
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = d.PrefixStore(f"adaptive_eager/{restart}/", base)
    except Exception as err:
        _warn_once("store", f"no c10d store to agree through ({err}); ranks use fixed rules")
    _store_for = (group, store)
    if resolve_job and store is not None:
        _job_info()  # Note [job id]: while the group is up
    return store


def _warn_once(kind: str, text: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        log.warning("adaptive_eager: rank %d: %s", rank(), text)


def agree(topic: str, mine: str, default: str) -> str:
    """The answer every rank gets for ``topic``: the first rank's proposal (Note [ranks agree]).

    ``default`` is the fixed answer when there is no store to agree through."""
    store = _store()
    if store is None:
        STATS["fixed"] += 1
        return default
    try:
        got = store.compare_set(topic, "", mine)
    except Exception as err:  # a store without compare_set, or the store went away
        STATS["store_errors"] += 1
        _warn_once("compare_set", f"store.compare_set failed ({type(err).__name__}: {err}); "
                                  "ranks use fixed rules")
        return default
    answer = got.decode() if isinstance(got, bytes) else str(got)
    STATS["agreed"] += 1
    if answer != mine:
        STATS["overruled"] += 1
        log.info("adaptive_eager: rank %d: %s: %r here, %r agreed (another rank decided first)",
                 rank(), topic, mine, answer)
    return answer


def diverged(why: str) -> None:
    """This rank cannot follow an agreed decision (its own compile or program failed)."""
    STATS["diverged"] += 1
    _warn_once(f"diverged:{why}", f"cannot follow the decision the other ranks agreed ({why}); "
                                  "this rank runs op by op where they run fused")


def stats() -> dict[str, Any]:
    return {"active": active(), "rank": rank(), "job": job_id(), **STATS}


# ---- Note [collectives in traces] ------------------------------------------------------------
# Functional collectives (``torch.distributed._functional_collectives``: all_reduce,
# all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, and their wait_tensor) are
# ops of the ``_c10d_functional`` namespace that return a new tensor and leave their input alone,
# so they are deferred like any op (opspec.py), and the compute around them stays one trace. Why
# that is sound:
# - Order. Collectives match across ranks by the order each rank issues them. A trace replays in
#   program order, and every other collective (``dist.all_reduce``, DDP's reducer, barrier: the
#   in-place ``c10d`` ops) still flushes the pending trace before it runs, so on each rank the
#   collectives run in the order the program issued them. ``destroy_process_group`` flushes too.
# - Waiting. funcol wraps each result in an AsyncCollectiveTensor whose first use calls
#   ``wait_tensor``; a lazy result gets ``wait_tensor`` at once instead (``_maybe_wrap_tensor``
#   is wrapped), deferred right after the collective, so the trace waits where eager would have
#   waited at the latest. No rank blocks while recording: the blocking happens at a flush, which
#   every rank reaches no later than its next collective or sync point.
# - Values. Op by op, the same collective on the same inputs: bitwise eager's. The first call of
#   a new (op, input metadata) runs at once to learn its metadata, in order, as every op's does.
# Traces with a collective are never fused (``ready_to_start`` decides them op by op at once, the
# same on every rank since it depends only on the trace): a compiled program would reorder or
# overlap collectives inside Inductor, which is not tested here.
COLLECTIVES = frozenset({"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                         "all_to_all_single", "wait_tensor"})
_with_collectives: dict[str, bool] = {}  # trace digest -> has a functional collective
_hooks_installed = False


def _collectives() -> frozenset[str]:
    install_collective_hooks()
    return COLLECTIVES


hooks.collectives = _collectives  # Note [hook slots] in core/hooks.py


def install_collective_hooks() -> None:
    """Wrap funcol's result wrapper and ``destroy_process_group`` (idempotent)."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from adaptive_eager.dispatch.lazy import LazyTensor

    wrap = funcol._maybe_wrap_tensor
    wait = torch.ops._c10d_functional.wait_tensor.default

    def _maybe_wrap_tensor(t: Any) -> Any:
        # deferred (or run at once to learn its metadata) under the engine: wait in the trace
        if type(t) is LazyTensor or type(_get_current_dispatch_mode()).__name__ == "DeferMode":
            return wait(t)
        return wrap(t)

    funcol._maybe_wrap_tensor = _maybe_wrap_tensor
    destroy = dist.destroy_process_group

    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        from adaptive_eager.engine import owned_engine

        eng = owned_engine()
        if eng is not None and eng.trace.ops and not eng.busy and not eng.flushing:
            eng.flush("destroy_process_group")  # pending collectives run while the group lives
        return destroy(*args, **kwargs)

    destroy_process_group.__doc__ = destroy.__doc__
    dist.destroy_process_group = destroy_process_group
    if getattr(dist.distributed_c10d, "destroy_process_group", None) is destroy:
        dist.distributed_c10d.destroy_process_group = destroy_process_group


def _has_collectives(entry: Any, trace: Any) -> bool:
    got = _with_collectives.get(entry.digest)
    if got is None:
        got = _with_collectives[entry.digest] = any(
            getattr(op, "namespace", "") == "_c10d_functional" for op, *_ in trace.ops)
    return got


# ---- the decision points (one call each from compiler.py and aside.py) ----------------------
def ready_to_start(mgr: Any, entry: Any, trace: Any = None, live: Any = None) -> bool:
    """From ``CompileManager._maybe_start``: may this flush look for a program for ``entry``
    (the disk, then a compile)? Not for a trace with a functional collective (Note
    [collectives in traces]). Outside distributed jobs otherwise always. In one, only at the
    run where the trace is hot by count, and only if the ranks agree to (else the entry is
    decided op by op here, as on every rank)."""
    if trace is not None and _has_collectives(entry, trace):
        with _state_lock():
            entry.state = "replay"
            entry.disk_checked = True
            entry.decision = "op-by-op: functional collectives in the trace (never fused)"
            mgr.decided.append(entry)
        return False
    if not active():
        return True
    hot_after = mgr.options.hot_after
    if entry.runs < hot_after or entry.observed < min(hot_after, policy.MIN_OBSERVED):
        return False
    mine, stats = _intent(mgr, entry)
    agreed = agree(f"plan/{entry.digest}/{entry.runs}", mine, default="fused")
    if agreed != "fused":
        with _state_lock():
            entry.state = "replay"
            entry.disk_checked = True
            entry.decision = f"op-by-op: {agreed.partition(':')[2] or 'agreed'} (ranks agree)"
            if stats and stats.get("replay_ms") and stats.get("fused_ms"):
                entry.replay_s = [stats["replay_ms"] / 1e3]
                entry.fused_s = [stats["fused_ms"] / 1e3]
            mgr.decided.append(entry)  # every rank counts it: settled() agrees across ranks
        return False
    if mine != "fused":
        if mine.startswith("replay:quarantined"):
            diverged("this rank's cache quarantined the trace")
        mgr.decisions.remeasure.add(entry.digest)  # our disk's op-by-op is overruled: look anyway
    if trace is not None and live is not None:
        _one_compile_per_machine(mgr, entry, trace, live)
    return True


def _state_lock() -> Any:
    from adaptive_eager.compiler import STATE_LOCK

    return STATE_LOCK


def _intent(mgr: Any, entry: Any) -> tuple[str, dict | None]:
    """What this rank's own disk says about the trace: "fused" (look for a program) or
    "replay:<why>" (the same tests as ``CompileManager._from_disk``)."""
    disk = mgr.disk
    if disk is None:
        return "fused", None
    try:
        if disk.is_quarantined(entry.digest):
            return "replay:quarantined in an earlier run", None
        stats = disk.get_stats(entry.digest)
    except Exception:
        return "fused", None
    if stats is None or entry.digest in mgr.decisions.remeasure:
        return "fused", stats
    import torch

    failure = stats.get("failure")
    retry = bool(failure) and mgr.programs.retry_failure(failure)
    if (str(stats.get("decision", "")).startswith("op-by-op") and not retry
            and stats.get("torch") == torch.__version__):
        return f"replay:{stats['decision']} (earlier run)", stats
    return "fused", stats


def agree_keep(mgr: Any, entry: Any, keep: bool) -> bool:
    """From ``CompileManager._decide``: keep the measured program? The first rank to measure
    decides for all (every rank decides at the same run of the trace)."""
    if not active():
        return keep
    return agree(f"keep/{entry.digest}/{entry.runs}", "1" if keep else "0", default="1") == "1"


def agree_aside(mgr: Any, reason: str | None) -> str | None:
    """From ``CompileManager.step_aside_reason``: step aside, and why (None: stay)."""
    if not active() or not mgr.options.step_aside or not mgr.backend.compiles:
        return reason
    answer = agree(f"aside/{mgr.flushes}", reason or "", default="")
    return answer or None


def agree_trial(stay: bool) -> bool:
    """From the measured trial's verdict (aside.py): stay in the engine?"""
    if not active():
        return stay
    from adaptive_eager.metrics import METRICS

    return agree(f"trial/{METRICS.trials}", "engine" if stay else "eager",
                 default="engine") == "engine"


# ---- Note [one compile per machine] ---------------------------------------------------------
# Compiles are synchronous in distributed jobs, so ranks on one machine sharing a cache folder
# would each compile the same hot trace at the same flush, on the same cores. With the compile
# service (Note [compile service]) the service de-duplicates them. Without it, the first rank of
# the machine to reach the trace (first writer on the store, topic named by host, cache folder
# and program key) compiles and stores the program as always; the others wait for it to appear
# on disk (verified as every disk entry is) and load it. A compile that fails (its failure is
# on disk) or PEER_WAIT_S without a program: the waiting rank compiles itself. A compiling rank
# that dies mid-compile keeps its peers here up to PEER_WAIT_S (Known gaps).
def _one_compile_per_machine(mgr: Any, entry: Any, trace: Any, live: Any) -> None:
    disk = mgr.disk
    store = _store()
    if disk is None or store is None or entry.in_process:
        return
    jobs = getattr(mgr, "jobs", None)  # where its compiles run (compile/jobs.py)
    if jobs is not None and jobs.use_service(entry):
        return  # the compile service compiles each key once for every process of the machine
    from adaptive_eager import graph as graph_mod
    import torch

    try:
        g = graph_mod.build(trace, live, entry.varying)
        key = mgr.programs.key(entry, g)
        if disk.get_program(key, torch.__version__) is not None:
            return  # already there: _from_disk loads it
    except Exception:
        return
    host = f"{socket.gethostname()}:{disk.directory}"
    me = str(rank())
    try:
        who = store.compare_set(f"compiler/{host}/{key}", "", me)
        who = who.decode() if isinstance(who, bytes) else str(who)
    except Exception:
        return
    if who == me:
        STATS["compiled_for_peers"] += 1
        return
    start, wall = time.monotonic(), time.time()
    log.info("adaptive_eager: rank %s: waiting for rank %s's program for trace %s", me, who,
             entry.digest[:12])
    try:
        _wait_for_peer(entry, disk, key, who, start, wall)
    finally:
        STATS["peer_waits"] += 1
        STATS["peer_wait_ms"] += int((time.monotonic() - start) * 1000)


def _wait_for_peer(entry: Any, disk: Any, key: str, who: str, start: float, wall: float,
                   ) -> None:
    import torch

    while time.monotonic() - start < PEER_WAIT_S:
        try:
            if disk.get_program(key, torch.__version__) is not None:
                STATS["peer_programs"] += 1
                entry.was_hot = True
                return
            st = disk.get_stats(entry.digest) or {}
        except Exception:
            return
        failure = st.get("failure")
        if failure and float(failure.get("at", 0.0)) >= wall - 1.0:  # the peer's compile failed
            STATS["peer_failed"] += 1
            return
        time.sleep(_POLL_S)
    STATS["peer_timeouts"] += 1
    _warn_once("peer", f"no program from rank {who} after {PEER_WAIT_S:.0f}s; compiling here")
