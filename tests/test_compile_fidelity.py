"""Compiling never changes what the program sees (compiler side).

Each reproducer of /work/shared/repros that the compiler caused becomes a test here: the RNG
stream and torch.fx's globals untouched by in-process compiles, two threads with two engines,
programs that run after deserialization (scalar_tensor, dropout, GradScaler traces), fused AdamW,
a prompt exit with a compile pending, SIGINT, and failures and decisions that persist with their
evidence. Fused results are compared with plain eager within float32 tolerance; random draws and
op-by-op results bitwise.

``GraphBackend`` is a real backend (not a stand-in for Inductor's output): its program is the
trace's FX graph of aten ops, run as is, serialized node by node (Note [graph pickling]). It
compiles in microseconds, so tests of the compiler's bookkeeping need no Inductor compile.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx

import adaptive_eager as ae
from adaptive_eager import backends, compiler, config
from adaptive_eager import graph as graph_mod
from adaptive_eager.cache.disk import DiskCache

aten = torch.ops.aten
RTOL, ATOL = 1e-4, 1e-5  # fused float32 programs against eager


class GraphBackend:
    """Programs are the trace graphs themselves; ``fail_with`` makes the next compiles raise."""

    name = "fxgraph"
    compiles = True

    def __init__(self) -> None:
        self.fail_with: BaseException | None = None
        self.compiled = 0

    def options_key(self) -> str:
        return "fxgraph:1"

    def compile(self, graph: Any) -> Any:
        if self.fail_with is not None:
            raise self.fail_with
        self.compiled += 1
        return graph.gm

    def serialize(self, program: Any) -> bytes:
        return pickle.dumps(graph_mod._graph_nodes(program.graph))

    def load(self, data: bytes, graph: Any) -> Any:
        return fx.GraphModule(torch.nn.Module(), graph_mod._graph_from_nodes(pickle.loads(data)))


@pytest.fixture
def fxgraph() -> Any:
    backend = GraphBackend()
    backends._instances["fxgraph"] = backend
    yield backend
    backends._instances.pop("fxgraph", None)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


# ---- Note [graph pickling]: deserialized programs ---------------------------------------------
def _constant_ops_graph() -> graph_mod.TraceGraph:
    """The shape of SDPA's bool-mask conversion and the causal-mask check: ops whose arguments
    are all constants, next to ordinary ones."""
    g = fx.Graph()
    mask, x = g.placeholder("x0"), g.placeholder("x1")
    ninf = g.call_function(aten.scalar_tensor.default, (float("-inf"),),
                           {"dtype": torch.float32, "device": torch.device("cpu")})
    zero = g.call_function(aten.scalar_tensor.default, (0.0,), {"dtype": torch.float32})
    full = g.call_function(aten.full.default, ([3, 3], float("-inf")), {"dtype": torch.float32})
    causal = g.call_function(aten.triu.default, (full, 1))
    where = g.call_function(aten.where.self, (mask, zero, ninf))
    out = g.call_function(aten.add.Tensor, (x, where))
    parts = g.call_function(aten.split.Tensor, (out, 1))
    first = g.call_function(__import__("operator").getitem, (parts, 0))
    g.output((ninf, zero, causal, out, first))
    gm = fx.GraphModule(torch.nn.Module(), g)
    inputs = [torch.tensor([True, False, True]), torch.randn(3, 3)]
    return graph_mod.TraceGraph(gm=gm, plan=[("t", 0), ("t", 1)], offsets=[], lifted=(),
                                baked=(), baked_values=(), live=(0, 1, 2, 3, 4),
                                example_inputs=inputs, n_ops=7)


def test_trace_graph_pickles_node_for_node() -> None:
    """FX's own pickling re-traced the code and turned constant-only ops into tensor constants,
    which the deserialized Inductor program then lacked ("expected N, got N-k")."""
    tg = _constant_ops_graph()
    back = pickle.loads(pickle.dumps(tg))
    assert back.gm.code == tg.gm.code
    assert not [n for n in back.gm.graph.nodes if n.op == "get_attr"]
    assert not dict(back.gm.named_buffers())
    for a, b in zip(tg.gm(*tg.example_inputs), back.gm(*back.example_inputs)):
        assert torch.equal(a, b)


def test_deserialized_constant_ops_program_runs(tmp_path: Path) -> None:
    """The scalar_tensor reproducer's trace, the way the helper gets it: pickled, compiled,
    serialized, loaded; the loaded program runs and matches eager."""
    from adaptive_eager.backends.inductor import InductorBackend

    tg = pickle.loads(pickle.dumps(_constant_ops_graph()))
    backend = InductorBackend()
    data = backend.serialize(backend.compile(tg))
    program = backend.load(data, tg)
    want = _constant_ops_graph().gm(*tg.example_inputs)
    for a, b in zip(program(*tg.example_inputs), want):
        _close(a, b)


def test_scalar_tensor_trace_runs_deserialized_with_helper(cache_dir: Path) -> None:
    mask = torch.tensor([True, False, True])
    got = []
    with ae.adaptive_eager(hot_after=2, step_aside=False, cache_dir=cache_dir):
        for i in range(12):
            a = torch.scalar_tensor(float("-inf"), dtype=torch.float32)
            b = torch.scalar_tensor(0.0, dtype=torch.float32)
            ae.sync()
            got.append((a.item(), b.item(), torch.where(mask, b, a).tolist()))
            if i == 4:
                ae.wait_for_compiles(timeout=600)
    m = ae.metrics()
    assert m["compiled_runs"] >= 1 and m["fused_errors"] == 0, m
    assert all(v == (-math.inf, 0.0, [0.0, -math.inf, 0.0]) for v in got), got


@pytest.mark.slow
def test_gradscaler_training_runs_deserialized_programs(cache_dir: Path) -> None:
    def run(options: dict | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = torch.nn.Linear(8, 4)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        x = torch.randn(16, 8)
        ctx = ae.adaptive_eager(**options) if options is not None else None
        if ctx is not None:
            ctx.__enter__()
        for i in range(12):
            opt.zero_grad()
            loss = net(x).square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if i == 5 and ctx is not None:
                ae.sync()
                ae.wait_for_compiles(timeout=600)
        if ctx is not None:
            ctx.__exit__(None, None, None)
        return [p.detach().clone() for p in net.parameters()]

    want = run(None)
    got = run({"hot_after": 2, "step_aside": False, "cache_dir": cache_dir})
    m = ae.metrics()
    assert m["compiled_runs"] >= 1 and m["fused_errors"] == 0, m
    for a, b in zip(got, want):
        _close(a, b)


_DROPOUT = textwrap.dedent("""
    import json, math, sys, torch
    import adaptive_eager as ae
    torch.manual_seed(0)
    emb, lin = torch.nn.Embedding(100, 16), torch.nn.Linear(16, 100)
    pe, drop = torch.randn(12, 1, 16), torch.nn.Dropout(0.2)
    opt = torch.optim.SGD(list(emb.parameters()) + list(lin.parameters()), lr=0.5)
    data = torch.randint(0, 100, (40, 4))
    mask = torch.log(torch.tril(torch.ones(12, 12)))
    losses = []
    ctx = ae.adaptive_eager(hot_after=2, step_aside=False, compile_async=False,
                            cache_dir=sys.argv[2]) if sys.argv[1] == "engine" else None
    if ctx: ctx.__enter__()
    for step in range(24):
        src, tgt = data[step:step + 12], data[step + 1:step + 13]
        opt.zero_grad()
        x = drop(emb(src) * math.sqrt(16) + pe)
        causal = torch.triu(torch.full((12, 12), float("-inf")), diagonal=1)
        is_causal = bool((mask == causal).all())
        out = torch.log_softmax(lin(x), dim=-1)
        loss = torch.nn.functional.nll_loss(out.view(-1, 100), tgt.reshape(-1))
        loss.backward(); opt.step(); losses.append(loss.item())
    if ctx: ctx.__exit__(None, None, None)
    m = ae.metrics()
    print(json.dumps({"losses": losses, "m": {k: m[k] for k in (
        "compiles", "compiled_runs", "disk_hits", "fused_errors")}}))
""")


@pytest.mark.slow
def test_dropout_trace_warm_run_matches_eager(tmp_path: Path, cache_dir: Path) -> None:
    """The word_language_model pattern: the warm run's programs come from disk and run."""
    script = tmp_path / "drop.py"
    script.write_text(_DROPOUT)

    def run(mode: str) -> dict:
        proc = subprocess.run([sys.executable, str(script), mode, str(cache_dir)],
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    eager = run("eager")["losses"]
    cold = run("engine")
    warm = run("engine")
    assert cold["m"]["compiles"] >= 1, cold
    assert warm["m"]["disk_hits"] >= 1 and warm["m"]["fused_errors"] == 0, warm
    assert warm["m"]["compiled_runs"] >= 1, warm
    torch.testing.assert_close(torch.tensor(warm["losses"]), torch.tensor(eager),
                               rtol=RTOL, atol=ATOL)


# ---- Note [in-process compiles] ---------------------------------------------------------------
def test_rng_stream_unchanged_by_in_process_compile(cache_dir: Path) -> None:
    """A compile in this process (compile_process off, and the fallback after a deserialized
    program fails) saved and restored the global RNG state while the program drew numbers."""
    x = torch.randn(64, 64)
    n = 60
    torch.manual_seed(0)
    want = [torch.rand(1).item() for _ in range(n)]
    torch.manual_seed(0)
    got = []
    with ae.adaptive_eager(hot_after=2, step_aside=False, compile_process=False,
                           cache_dir=cache_dir):
        for _ in range(n):
            ((x * 2 + 1).sin() * 3).cos().sum()
            ae.sync()
            got.append(torch.rand(1).item())
    m = ae.metrics()
    assert m["compiles"] >= 1 and m["compiled_runs"] >= 1, m
    assert got == want


def test_in_process_compile_restores_rng_states() -> None:
    """The guard itself: whatever the compile draws, the streams continue where they were."""
    import random

    torch.manual_seed(3)
    random.seed(3)
    want = (torch.rand(4), random.random())
    torch.manual_seed(3)
    random.seed(3)
    with compiler._compile_guard():
        torch.rand(100)
        random.random()
    assert torch.equal(torch.rand(4), want[0]) and random.random() == want[1]


class _Checked(torch.nn.Module):
    """A block that records, at every call, whether nn.Module's methods are torch's own."""

    CALL = torch.nn.Module.__call__
    GETATTR = torch.nn.Module.__getattr__
    seen: list[bool] = []

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Checked.seen.append(torch.nn.Module.__call__ is _Checked.CALL
                             and torch.nn.Module.__getattr__ is _Checked.GETATTR)
        return torch.tanh(self.lin(x))


def test_module_calls_unpatched_during_in_process_compiles(cache_dir: Path) -> None:
    """torch.fx's tracer patches nn.Module.__call__ while it traces; a compile in a thread let
    the program's module calls run through the patch (NameError in user code)."""
    def run(options: dict | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[_Checked() for _ in range(4)])
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        xs = [torch.randn(b, 16) for b in (8, 12)]
        ctx = ae.adaptive_eager(**options) if options is not None else None
        if ctx is not None:
            ctx.__enter__()
        for i in range(10):
            opt.zero_grad()
            net(xs[i % 2]).square().mean().backward()
            opt.step()
        if ctx is not None:
            ctx.__exit__(None, None, None)
        return [p.detach().clone() for p in net.parameters()]

    want = run(None)
    _Checked.seen.clear()
    got = run({"hot_after": 2, "compile_process": False, "step_aside": False,
               "cache_dir": cache_dir})
    m = ae.metrics()
    assert m["compiles"] >= 1 and m["compiled_runs"] >= 1, m
    assert _Checked.seen and all(_Checked.seen)
    for a, b in zip(got, want):
        _close(a, b)


# ---- two threads, two engines -----------------------------------------------------------------
_SEEDING = threading.Lock()  # the global generator is shared: two threads seeding it at once
                             # interleave their draws (the test's own race, not the engine's)


def _train(seed: int, steps: int) -> list[torch.Tensor]:
    with _SEEDING:  # random ops run at once under the engine: every draw happens in here
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                  torch.nn.Linear(32, 4))
        x, y = torch.randn(8, 16), torch.randn(8, 4)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def test_two_threads_two_engines_share_no_unlocked_state(tmp_path: Path, fxgraph: Any) -> None:
    """Each thread its own context and cache folder; their trace entries are shared (one trie):
    picking up finished work from one thread raced the other ('NoneType' has no 'done')."""
    steps = 30
    want = {s: _train(s, steps) for s in (1, 2)}
    dirs = {s: tmp_path / f"c{s}" for s in (1, 2)}
    for s in (1, 2):  # warm both folders: the second round loads programs in the worker
        with ae.adaptive_eager(backend="fxgraph", hot_after=2, step_aside=False,
                               cache_dir=dirs[s]):
            _train(s, 6)
    for _ in range(3):
        ae.clear_caches()
        errors: list[str] = []
        got: dict[int, list[torch.Tensor]] = {}

        def worker(seed: int) -> None:
            try:
                with ae.adaptive_eager(backend="fxgraph", hot_after=2, step_aside=False,
                                       cache_dir=dirs[seed]):
                    got[seed] = _train(seed, steps)
            except Exception as err:  # reported below, with the thread's own error
                errors.append(f"{type(err).__name__}: {err}")

        threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for s in (1, 2):
            for a, b in zip(got[s], want[s]):
                _close(a, b)
    assert ae.metrics()["compiled_runs"] >= 1


@pytest.mark.slow
def test_two_threads_two_engines_inductor(tmp_path: Path) -> None:
    steps = 40
    want = {s: _train(s, steps) for s in (1, 2)}
    errors: list[str] = []
    got: dict[int, list[torch.Tensor]] = {}

    def worker(seed: int) -> None:
        try:
            with ae.adaptive_eager(hot_after=2, step_aside=False, cache_dir=tmp_path / str(seed)):
                got[seed] = _train(seed, steps)
        except Exception as err:
            errors.append(__import__("traceback").format_exc())

    threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for s in (1, 2):
        for a, b in zip(got[s], want[s]):
            _close(a, b)


# ---- fused AdamW ------------------------------------------------------------------------------
def test_fused_adamw_compiles_and_matches_eager(cache_dir: Path) -> None:
    """AdamW(fused=True): functionalizing aten._fused_adamw_ asserts inside torch; the graph
    calls its functional variant and copies the results back."""
    def run(options: dict | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = torch.nn.Linear(8, 4)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
        x = torch.randn(16, 8)
        ctx = ae.adaptive_eager(**options) if options is not None else None
        if ctx is not None:
            ctx.__enter__()
        for _ in range(8):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
        if ctx is not None:
            ctx.__exit__(None, None, None)
        return [p.detach().clone() for p in net.parameters()] + [
            t.clone() for st in opt.state.values() for t in st.values()]

    want = run(None)
    got = run({"hot_after": 2, "step_aside": False, "compile_async": False,
               "compile_process": False, "cache_dir": cache_dir})
    m = ae.metrics()
    assert m["compile_errors"] == 0 and m["compiled_runs"] >= 1, m
    for a, b in zip(got, want):
        _close(a, b)


# ---- exit and SIGINT ----------------------------------------------------------------------------------
_PENDING = textwrap.dedent("""
    import os, sys, torch
    import adaptive_eager as ae
    from adaptive_eager import backends
    from adaptive_eager.backends.inductor import InductorBackend
    from adaptive_eager.cache.memory import TRIE
    from adaptive_eager.compile_process import HELPER

    STALL = ("__import__('time').sleep(600) or __import__('adaptive_eager.backends.inductor', "
             "fromlist=['InductorBackend']).InductorBackend()")

    class StallBackend(InductorBackend):
        # Inductor, in a helper that first stalls for 600 s (as a very large compile would).
        name = "stall"

        def __reduce__(self):
            return (eval, (STALL,))

    backends._instances["stall"] = StallBackend()
    x = torch.randn(64, 64)
    with ae.adaptive_eager(backend="stall", hot_after=2, step_aside=False, cache_dir=sys.argv[1]):
        for _ in range(6):
            ((x * 2 + 1).tanh() * 3).sum()
            ae.sync()
        while HELPER._proc is None:  # the compile reached the helper
            ae.sync()
    print("helper", HELPER._proc.pid, "pending", ae.metrics()["compiles_pending"],
          ",".join(e.digest for e in TRIE.entry_list if e.n_ops >= 2), flush=True)
""")


def test_exit_with_compile_pending_is_prompt_and_says_so(tmp_path: Path, cache_dir: Path) -> None:
    script = tmp_path / "pending.py"
    script.write_text(_PENDING)
    # the stalled helper would hold a joined worker for 600 s: exiting at all is the check
    proc = subprocess.run([sys.executable, str(script), str(cache_dir)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.split()
    assert words[0] == "helper" and int(words[3]) >= 1, proc.stdout
    notices = [ln for ln in proc.stderr.splitlines() if "pending at exit" in ln]
    assert len(notices) == 1 and "1 compile still pending" in notices[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "can't register atexit" not in proc.stderr
    helper = int(words[1])
    for _ in range(100):  # the abandoned helper goes too
        try:
            os.kill(helper, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.kill(helper, signal.SIGKILL)
        pytest.fail("the compile helper outlived its program")
    disk = DiskCache.open(cache_dir, 1 << 30)
    try:  # marked hot at submit: the next run compiles it at once
        assert any((disk.get_stats(d) or {}).get("hot") for d in words[4].split(","))
    finally:
        disk.close()


_SIGINT = textwrap.dedent("""
    import faulthandler, signal, sys, torch
    import adaptive_eager as ae
    # A job started in the background by a non-interactive shell (a CI script's ``cmd &``)
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler: the
    # test is about what the engine does with Ctrl-C, so the child takes Python's own handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's dump if it hangs
    x = torch.randn(128, 128)
    with ae.adaptive_eager(hot_after=2, step_aside=False, cache_dir=sys.argv[1]):
        for i in range(10 ** 9):
            y = x
            for _ in range(40):
                y = (y * 1.0001).tanh()
            ae.sync()
            if i == 3:
                print("running", flush=True)
                print("sigint:", signal.getsignal(signal.SIGINT),
                      sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])), file=sys.stderr)
""")


def test_sigint_under_the_engine_exits_as_python_does(tmp_path: Path, cache_dir: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(_SIGINT)
    proc = subprocess.Popen([sys.executable, str(script), str(cache_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "running"
        time.sleep(1.0)  # a compile of the hot trace is pending in the helper by now
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # say where it is stuck (every thread's stack)
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2.0)
            proc.kill()
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"no exit 120 s after SIGINT; the child's stacks:\n{err[-8000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGINT, err[-3000:]
    assert "KeyboardInterrupt" in err


# ---- Note [persisted decisions] -------------------------------------------------------------
def _loop(steps: int = 8) -> torch.Tensor:
    x = torch.arange(12.0).reshape(3, 4)
    out = x
    for _ in range(steps):
        out = (x * 2 + 1).sin().mul(3)
        ae.sync()
    return out


def _stats(cache_dir: Path) -> dict:
    from adaptive_eager.cache.memory import TRIE

    hot = [e for e in TRIE.entry_list if e.n_ops >= 2]
    assert hot
    disk = DiskCache.open(cache_dir, 1 << 30)
    try:
        return disk.get_stats(hot[0].digest) or {}
    finally:
        disk.close()


def _next_process() -> None:
    """What a new process starts with: nothing in memory, the disk cache as it was."""
    ae.clear_caches()
    ae.reset_metrics()


def test_transient_compile_failure_is_retried_by_the_next_process(cache_dir: Path,
                                                                   fxgraph: GraphBackend) -> None:
    want = (torch.arange(12.0).reshape(3, 4) * 2 + 1).sin().mul(3)
    opts = {"backend": "fxgraph", "hot_after": 2, "step_aside": False, "compile_async": False,
            "cache_dir": cache_dir}
    fxgraph.fail_with = OSError(errno.ENOSPC, "No space left on device")
    with ae.adaptive_eager(**opts):
        got = _loop()
    assert ae.metrics()["compile_errors"] == 1 and ae.metrics()["compiled_runs"] == 0
    stored = _stats(cache_dir)
    assert stored["failure"]["transient"] and stored["failure"]["count"] == 1, stored
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    fxgraph.fail_with = None  # the disk has room again
    _next_process()
    with ae.adaptive_eager(**opts):
        got = _loop()
    m = ae.metrics()
    assert m["compiles"] >= 1 and m["compiled_runs"] >= 1 and m["compile_errors"] == 0, m
    assert _stats(cache_dir).get("failure") is None
    _close(got, want)


def test_permanent_compile_failure_is_not_retried(cache_dir: Path,
                                                  fxgraph: GraphBackend) -> None:
    opts = {"backend": "fxgraph", "hot_after": 2, "step_aside": False, "compile_async": False,
            "cache_dir": cache_dir}
    fxgraph.fail_with = NotImplementedError("no lowering for this op")
    with ae.adaptive_eager(**opts):
        _loop()
    assert not _stats(cache_dir)["failure"]["transient"]
    fxgraph.fail_with = None
    _next_process()
    with ae.adaptive_eager(**opts):
        _loop()
    assert fxgraph.compiled == 0 and ae.metrics()["compiled_runs"] == 0


def test_transient_failures_stop_being_retried_at_once(cache_dir: Path,
                                                       fxgraph: GraphBackend) -> None:
    opts = {"backend": "fxgraph", "hot_after": 2, "step_aside": False, "compile_async": False,
            "cache_dir": cache_dir}
    fxgraph.fail_with = TimeoutError("compile timed out")
    for _ in range(compiler.TRANSIENT_RETRIES + 1):
        _next_process()
        with ae.adaptive_eager(**opts):
            _loop()
        assert ae.metrics()["compile_errors"] == 1
    assert _stats(cache_dir)["failure"]["count"] == compiler.TRANSIENT_RETRIES + 1
    _next_process()
    with ae.adaptive_eager(**opts):
        _loop()
    assert ae.metrics()["compile_errors"] == 0  # not tried again until RETRY_AFTER_S passed


def test_decisions_from_several_processes_combine(cache_dir: Path,
                                                  fxgraph: GraphBackend) -> None:
    """Three processes measured the program clearly faster; a fourth, contended, measures it
    slower: the stored decision is the median over all four, not the last writer's."""
    opts = {"backend": "fxgraph", "hot_after": 2, "step_aside": False, "compile_async": False,
            "cache_dir": cache_dir}
    with ae.adaptive_eager(**opts):
        _loop(10)
    stored = _stats(cache_dir)
    assert len(stored["samples"]) == 1, stored
    from adaptive_eager.cache.memory import TRIE

    digest = [e for e in TRIE.entry_list if e.n_ops >= 2][0].digest
    earlier = [{"fused_ms": 0.5, "replay_ms": 1.0, "at": 1.0}] * 3
    mine = {"fused_ms": 3.0, "replay_ms": 1.0, "at": 2.0}  # this process: "not faster"
    disk = DiskCache.open(cache_dir, 1 << 30)
    try:
        disk.put_stats(digest, dict(stored, samples=earlier))
    finally:
        disk.close()
    mgr = compiler.manager_for(config.resolve(opts))
    entry = [e for e in TRIE.entry_list if e.digest == digest][0]
    entry.fused_s, entry.replay_s = [mine["fused_ms"] / 1e3], [mine["replay_ms"] / 1e3]
    entry.decision = "op-by-op: fused 3.000 ms is not faster than 1.000 ms"
    mgr.save_stats(entry, sample=True)
    combined = _stats(cache_dir)
    assert len(combined["samples"]) == 4
    assert combined["decision"].startswith("fused: median fused/op-by-op 0.50 over 4"), combined


def test_warm_process_remeasures_a_stored_decision_it_disagrees_with(
        cache_dir: Path, fxgraph: GraphBackend) -> None:
    opts = {"backend": "fxgraph", "hot_after": 2, "step_aside": False, "compile_async": False,
            "cache_dir": cache_dir}
    with ae.adaptive_eager(**opts):
        _loop(10)
    stored = _stats(cache_dir)
    from adaptive_eager.cache.memory import TRIE

    digest = [e for e in TRIE.entry_list if e.n_ops >= 2][0].digest
    # another process's verdict: op by op, with a fused time far below what replay costs here
    disk = DiskCache.open(cache_dir, 1 << 30)
    try:
        disk.put_stats(digest, dict(stored, decision="op-by-op: fused 1e-06 ms is not faster",
                                    fused_ms=1e-6, replay_ms=1e-6, samples=[]))
    finally:
        disk.close()
    _next_process()
    with ae.adaptive_eager(**opts):
        _loop(14)
    m = ae.metrics()
    assert m["disk_hits"] >= 1 and m["compiled_runs"] >= 1, m
    assert len(_stats(cache_dir)["samples"]) >= 1


# ---- complex tensors --------------------------------------------------------------------------
def test_complex_trace_with_conj_view_fuses_and_matches_eager(cache_dir: Path) -> None:
    """Inductor compiled an internal ``_conj`` view as if its bit were not set (imaginary parts'
    sign flipped, silently); the graph uses ``conj_physical`` for it."""
    x = torch.randn(64, dtype=torch.complex64)

    def f() -> torch.Tensor:
        return (x * (1 + 2j) + (x * 2).conj()).exp() * 0.5

    with ae.adaptive_eager(hot_after=2, step_aside=False, compile_async=False,
                           compile_process=False, cache_dir=cache_dir):
        ys = []
        for _ in range(6):
            ys.append(f())
            ae.sync()
    m = ae.metrics()
    assert m["compiled_runs"] >= 1 and m["fused_errors"] == 0, m
    for y in ys:
        _close(y, f())


def test_conj_view_input_stays_op_by_op_bitwise(cache_dir: Path, fxgraph: GraphBackend) -> None:
    """A conjugate view of a real tensor enters the trace as an input with its bit set: such
    traces are not fused (see graph._BIT_VIEWS), and replay matches eager bitwise."""
    x = torch.randn(64, dtype=torch.complex64)
    outs = []
    with ae.adaptive_eager(backend="fxgraph", hot_after=2, step_aside=False,
                           compile_async=False, cache_dir=cache_dir):
        for _ in range(6):
            outs.append((x * (1 + 2j) + x.conj()).exp() * 0.5)
            ae.sync()
    assert ae.metrics()["compiled_runs"] == 0 and ae.metrics()["engine_errors"] == 0
    for y in outs:
        assert torch.equal(y, (x * (1 + 2j) + x.conj()).exp() * 0.5)


def test_varying_complex_scalar_stays_op_by_op_bitwise(cache_dir: Path,
                                                       fxgraph: GraphBackend) -> None:
    """A Python complex that changes between runs cannot be a program input (no symbolic
    complex scalars in torch.compile): such a trace runs op by op, bitwise equal to eager."""
    x = torch.randn(64, dtype=torch.complex64)
    outs = []
    with ae.adaptive_eager(backend="fxgraph", hot_after=2, step_aside=False,
                           compile_async=False, cache_dir=cache_dir):
        for i in range(6):
            outs.append((x * complex(1, i) + x.conj()).exp() * 0.5)
            ae.sync()
    assert ae.metrics()["compiled_runs"] == 0 and ae.metrics()["engine_errors"] == 0
    for i, y in enumerate(outs):
        assert torch.equal(y, (x * complex(1, i) + x.conj()).exp() * 0.5)


def _scaled_loop(scales: list[float]) -> list[torch.Tensor]:
    """One short trace per step whose Python number is ``scales[i]`` (keyed by type only)."""
    x = torch.linspace(-1.0, 1.0, 64)
    out = []
    for s in scales:
        y = ((x * s).sin() + 1.0).sum()
        out.append(y.detach().clone())
        ae.sync()
    return out


def test_trace_hot_under_a_replay_engine_still_lifts_its_varying_numbers(
        cache_dir: Path, fxgraph: GraphBackend) -> None:
    """Runs counted by an engine that never compiles compared no numbers: the first compiling
    engine must watch them before it compiles, or it bakes in a number that changes every step
    and the program is never usable (the demo's AdamW trace: 0 fused steps)."""
    scales = [0.5 + 0.1 * i for i in range(12)]
    expected = [((torch.linspace(-1.0, 1.0, 64) * s).sin() + 1.0).sum() for s in scales]
    with ae.adaptive_eager(backend="replay", cache_dir=cache_dir):
        _scaled_loop(scales)
    with ae.adaptive_eager(backend="fxgraph", hot_after=3, step_aside=False,
                           compile_async=False, cache_dir=cache_dir):
        got = _scaled_loop(scales)
    # used: its warm-up and measured runs (the decision after them may keep op by op)
    assert ae.metrics()["compiled_runs"] >= 4, ae.metrics()
    assert fxgraph.compiled == 1
    for g, e in zip(got, expected):
        _close(g, e)


def test_number_that_changes_after_the_compile_is_lifted_by_a_recompile(
        cache_dir: Path, fxgraph: GraphBackend) -> None:
    """A number constant over the runs before the compile, changing later (a learning-rate
    schedule's first change): the program is compiled again with it as an input."""
    scales = [0.5] * 3 + [0.5 + 0.1 * i for i in range(10)]
    expected = [((torch.linspace(-1.0, 1.0, 64) * s).sin() + 1.0).sum() for s in scales]
    with ae.adaptive_eager(backend="fxgraph", hot_after=2, step_aside=False,
                           compile_async=False, cache_dir=cache_dir):
        got = _scaled_loop(scales)
    m = ae.metrics()
    assert fxgraph.compiled == 2, fxgraph.compiled  # once baked, once with the number lifted
    assert m["compiled_runs"] >= 4, m  # the second program serves the changing numbers
    for g, e in zip(got, expected):
        _close(g, e)


def test_forked_child_does_not_report_its_parents_pending_compiles() -> None:
    """A DataLoader worker forked while a compile was queued inherits the queue: at its exit it
    must not print the parent's "still pending" line (seen twice in one run), nor take the
    queue's lock, which a parent thread that does not exist in the child may have held."""
    import concurrent.futures

    from adaptive_eager import compiler

    job = (concurrent.futures.Future(), print, (), "trace abc (9 ops)")
    parent = compiler._Worker()
    parent._jobs.append(job)
    assert parent.close() == ["trace abc (9 ops)"]
    child = compiler._Worker()
    child._jobs.append(job)
    child._pid = -1  # as after os.fork: the queue was made by another process
    child._cond.acquire()  # held by the parent's (absent) worker thread at the fork
    assert child.close() == [] and child.closed
