"""``python -m benchmarks.op_overhead``: what one aten op costs, in µs, on each path it can take.

Two tiny programs (a chain of ``torch.add`` on 16 elements, and a mix of ops) and a small module
(LayerNorm-Linear-GELU-Linear, forward and backward) are timed as plain eager, under an empty
TorchDispatchMode, as bare aten calls from Python below autograd (the floor for op-by-op replay),
under a mode whose C handler only hands out one wrapper tensor per op (the floor for recording
with wrapper outputs: ``benchmarks/_floor.c``, built here with the machine's C compiler; the tiny
programs only, its fixed 16-element outputs would break the module's autograd), and under adaptive_eager (record + replay only): on a trace hit (the same loop repeated;
recording and replay timed apart) and on a miss (first sight of every op, after
``adaptive_eager.clear_caches()``). The paths are measured in interleaved rounds, so load from other
work spreads over all of them; the table gives the median and the best repetition. Prints the
table, the per-op targets with their measured ratios, and writes op_overhead.json and
op_overhead.md to the out directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.machine import describe, machine_info
from benchmarks.modes import probe_engine_options

DEFAULT_OUT = Path(__file__).parent / "out"
Program = Callable[[], torch.Tensor]
Sync = Callable[[], None]
# Record and replay only: no compiling of hot traces, no stepping aside when nothing gains.
WANTED_ENGINE_OPTIONS: dict[str, Any] = {"backend": "replay", "step_aside": False}


@dataclasses.dataclass
class Row:
    program: str
    path: str
    us_per_op: float | None = None  # median repetition
    best_us_per_op: float | None = None  # fastest repetition
    ops_per_rep: float | None = None
    reps: int = 0
    note: str = ""


# ---- programs ------------------------------------------------------------------------------
def add16_program(device: torch.device) -> Program:
    x, y = torch.zeros(16, device=device), torch.ones(16, device=device)

    def run() -> torch.Tensor:
        z = x
        for _ in range(200):
            z = torch.add(z, y)
        return z

    return run


def mix_program(device: torch.device) -> Program:
    torch.manual_seed(0)
    a, b = torch.randn(16, device=device), torch.randn(16, device=device)
    m = torch.randn(4, 4, device=device)

    def run() -> torch.Tensor:
        z = a
        for _ in range(20):
            z = torch.sin(torch.add(z, b) * 0.5).relu()
            z = (z.view(4, 4) @ m).reshape(16)
            z = torch.where(z > 0, z, b)
            z = z - z.sum() / 16
        return z

    return run


MLP_WIDTH, MLP_BATCH = 128, 64


def mlp_fb_program(device: torch.device) -> Program:
    """LayerNorm-Linear-GELU-Linear, forward and backward (the module workload)."""
    torch.manual_seed(0)
    d = MLP_WIDTH
    model = torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d),
                                torch.nn.GELU(), torch.nn.Linear(4 * d, d)).to(device)
    x = torch.randn(MLP_BATCH, d, device=device)
    params = list(model.parameters())

    def run() -> torch.Tensor:
        for p in params:
            p.grad = None
        loss = model(x).square().mean()
        loss.backward()
        return loss

    return run


PROGRAMS: dict[str, Callable[[torch.device], Program]] = {
    "add16": add16_program, "mix": mix_program, "mlp_fb": mlp_fb_program}
PROGRAM_DOC = {"add16": "200 x torch.add, 16 elements",
               "mix": "20 x (add mul sin relu view mm view gt where sum div sub), 16 elements",
               "mlp_fb": (f"LayerNorm-Linear-GELU-Linear forward + backward, batch {MLP_BATCH}, "
                          f"width {MLP_WIDTH} (hidden {4 * MLP_WIDTH}), grads set to None first")}


# ---- helpers -------------------------------------------------------------------------------
class EmptyMode(TorchDispatchMode):
    """A TorchDispatchMode that only calls the op: the floor for any dispatch-mode engine."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        return func(*args, **(kwargs or {}))


class RecordingMode(TorchDispatchMode):
    """Keeps the aten calls a program makes (with their real arguments), to count and replay."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


class WrapperFloor(torch.Tensor):
    """The wrapper class _floor.c hands out (never dispatched: the mode takes every op)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise RuntimeError("the wrapper floor's tensors are never computed with")


_FLOOR: list[Any] = []  # the built module, once per process


def build_floor() -> Any:
    """benchmarks/_floor.c built with the compiler Python was built with, imported."""
    if _FLOOR:
        return _FLOOR[0]
    import importlib.machinery
    import importlib.util
    import subprocess
    import sysconfig

    src = Path(__file__).with_name("_floor.c")
    out = Path(tempfile.mkdtemp(prefix="ae-floor-")) / ("_floor" + (
        sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    subprocess.run([*cc, "-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
                    str(src), "-o", str(out)], check=True, capture_output=True, timeout=120)
    loader = importlib.machinery.ExtensionFileLoader("_floor", str(out))
    spec = importlib.util.spec_from_file_location("_floor", out, loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    refs: list[Any] = []
    mod.setup(torch.Tensor._make_wrapper_subclass,
              (WrapperFloor, (16,), (1,), None, None, torch.float32, torch.strided,
               torch.device("cpu")), refs, ("_ae_trace", "_ae_slot", "_ae_meta"),
              (refs, 0, None))
    _FLOOR.append(mod)
    return mod


class FloorMode(TorchDispatchMode):
    """Every op answered by _floor.c's handler (installed on the instance, as the engine's)."""

    def __init__(self) -> None:
        super().__init__()
        from types import MethodType

        self.__torch_dispatch__ = MethodType(build_floor().handler, self)  # type: ignore

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # as the engine's mode: no dynamo shim per op
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise RuntimeError("replaced by the C handler")


FLOOR_PATH = "one wrapper per op from C (record floor)"
FLOOR_PROGRAMS = ("add16", "mix")


def record_calls(run: Program) -> list[tuple[Any, tuple, dict]]:
    rec = RecordingMode()
    with rec:
        run()
    return rec.calls


@contextmanager
def no_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def device_sync(device: torch.device) -> Sync:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def per_op(times: list[float], ops: float) -> tuple[float | None, float | None]:
    if not times or not ops:
        return None, None
    return statistics.median(times) * 1e6 / ops, min(times) * 1e6 / ops


# ---- samplers: each measures one path, a few repetitions per round -------------------------
class Sampler:
    """Collects repetition times for one path; ``round`` adds ``reps`` more, ``rows`` reports."""

    def __init__(self, program: str, run: Program, sync: Sync) -> None:
        self.program, self.run, self.sync = program, run, sync
        self.error = ""

    def round(self, reps: int) -> None:
        raise NotImplementedError

    def rows(self) -> list[Row]:
        raise NotImplementedError

    def safe_round(self, reps: int) -> None:
        if self.error:
            return
        try:
            self.round(reps)
        except Exception as err:  # noqa: BLE001  # a broken path is a row with its error
            self.error = f"ERROR {type(err).__name__}: {err}"[:300]


class PlainSampler(Sampler):
    """Eager, an empty dispatch mode, or the recorded aten calls replayed from Python."""

    def __init__(self, program: str, run: Program, sync: Sync, path: str) -> None:
        super().__init__(program, run, sync)
        self.path = path
        self.calls = record_calls(run)
        self.times: list[float] = []
        fn: Callable[[], Any] = run
        if path == "aten calls from Python (replay floor)":
            fn = self._replay_calls
        self.fn = fn

    def _replay_calls(self) -> None:
        # below autograd, as the engine's replay runs (the recorded calls are aten's own)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            for func, args, kwargs in self.calls:
                func(*args, **kwargs)

    @contextmanager
    def _context(self) -> Iterator[None]:
        if self.path == "empty TorchDispatchMode":
            with EmptyMode():
                yield
        elif self.path == FLOOR_PATH:
            with FloorMode():
                yield
        else:
            yield

    def round(self, reps: int) -> None:
        with self._context():
            self.fn()  # warm
            with no_gc():
                for _ in range(reps):
                    t0 = time.perf_counter()
                    self.fn()
                    self.sync()
                    self.times.append(time.perf_counter() - t0)

    def rows(self) -> list[Row]:
        n = len(self.calls)
        med, best = per_op(self.times, n)
        note = ("recorded ops, real inputs" if "replay floor" in self.path else
                "C handler: make the wrapper, 3 attributes, a weak reference; nothing else"
                if self.path == FLOOR_PATH else "")
        return [Row(self.program, self.path, med, best, n, len(self.times), self.error or note)]


def metric_delta(ae: Any, before: dict[str, Any]) -> dict[str, float]:
    after = ae.metrics()
    return {k: after[k] - before.get(k, 0) for k in after
            if isinstance(after[k], (int, float)) and not isinstance(after[k], bool)}


def add_counts(total: dict[str, float], delta: dict[str, float]) -> None:
    for k, v in delta.items():
        total[k] = total.get(k, 0) + v


class EngineHitSampler(Sampler):
    """Steady state: the same loop repeated, each repetition one known trace (a hit)."""

    def __init__(self, program: str, run: Program, sync: Sync, ae: Any,
                 options: dict[str, Any], label: str = "") -> None:
        super().__init__(program, run, sync)
        self.ae, self.options, self.label = ae, options, label
        self.record: list[float] = []
        self.replay: list[float] = []
        self.counts: dict[str, float] = {}

    def round(self, reps: int) -> None:
        ae = self.ae
        with ae.adaptive_eager(**self.options):
            for _ in range(5):  # first sight runs eagerly, the next records a new trace, then hits
                self.run()
                ae.sync()
            before = ae.metrics()
            with no_gc():
                for _ in range(reps):
                    t0 = time.perf_counter()
                    self.run()
                    t1 = time.perf_counter()
                    ae.sync()
                    self.sync()
                    self.replay.append(time.perf_counter() - t1)
                    self.record.append(t1 - t0)
            add_counts(self.counts, metric_delta(ae, before))

    def rows(self) -> list[Row]:
        n = len(self.record)
        name = "adaptive_eager hit" + (f" [{self.label}]" if self.label else "")
        if self.error or not n:
            return [Row(self.program, name, note=self.error)]
        c = self.counts
        ops = c.get("ops_intercepted", 0) / n
        deferred = c.get("ops_deferred", 0) / n or ops
        note = (f"per rep: {c.get('trace_hits', 0) / n:g} hits, {c.get('trace_misses', 0) / n:g}"
                f" misses, {c.get('flushes', 0) / n:g} flushes, {deferred:g} deferred")
        total = [a + b for a, b in zip(self.record, self.replay, strict=True)]
        return [
            Row(self.program, f"{name}: record", *per_op(self.record, ops), ops, n, note),
            Row(self.program, f"{name}: replay (sync)", *per_op(self.replay, deferred),
                deferred, n),
            Row(self.program, f"{name}: total", *per_op(total, ops), ops, n),
        ]


class EngineMissSampler(Sampler):
    """First sight of every (op, input metadata): caches cleared before each repetition."""

    def __init__(self, program: str, run: Program, sync: Sync, ae: Any,
                 options: dict[str, Any]) -> None:
        super().__init__(program, run, sync)
        self.ae, self.options = ae, options
        self.times: list[float] = []
        self.counts: dict[str, float] = {}

    def round(self, reps: int) -> None:
        ae = self.ae
        with ae.adaptive_eager(**self.options):
            ae.sync()
            before = ae.metrics()
            for _ in range(reps):
                ae.sync()
                ae.clear_caches()
                with no_gc():
                    t0 = time.perf_counter()
                    self.run()
                    ae.sync()
                    self.sync()
                    self.times.append(time.perf_counter() - t0)
            add_counts(self.counts, metric_delta(ae, before))

    def rows(self) -> list[Row]:
        n = len(self.times)
        path = "adaptive_eager miss (after clear_caches): total"
        if self.error or not n:
            return [Row(self.program, path, note=self.error)]
        c = self.counts
        ops = c.get("ops_intercepted", 0) / n
        note = (f"per rep: {c.get('meta_misses', 0) / n:g} first-sight ops run eagerly, "
                f"{c.get('trace_misses', 0) / n:g} trace misses, {c.get('trace_hits', 0) / n:g} "
                "hits")
        return [Row(self.program, path, *per_op(self.times, ops), ops, n, note)]


PLAIN_PATHS = ("eager", "empty TorchDispatchMode", "aten calls from Python (replay floor)")


def samplers_for(program: str, device: torch.device, ae: Any, options: dict[str, Any],
                 also: tuple[str, ...] = ()) -> tuple[list[Sampler], list[Sampler]]:
    """(steady-state samplers, cold samplers) for one program; engine ones only if it imports.
    ``also``: more engine hit paths, each with options ``key=value[,key=value]`` on top."""
    run = PROGRAMS[program](device)
    sync = device_sync(device)
    steady: list[Sampler] = [PlainSampler(program, run, sync, p) for p in PLAIN_PATHS]
    if program in FLOOR_PROGRAMS and device.type == "cpu":
        steady.append(PlainSampler(program, run, sync, FLOOR_PATH))
    cold: list[Sampler] = []
    if ae is not None:
        steady.append(EngineHitSampler(program, run, sync, ae, options))
        for extra in also:
            more = dict(kv.split("=", 1) for kv in extra.split(","))
            steady.append(EngineHitSampler(program, run, sync, ae, {**options, **more}, extra))
        cold.append(EngineMissSampler(program, run, sync, ae, options))
    return steady, cold


def measure(device: torch.device, ae: Any, options: dict[str, Any], rounds: int, reps: int,
            miss_reps: int, also: tuple[str, ...] = ()) -> list[Sampler]:
    """Interleave: every round runs each path once, so load spikes spread over all paths."""
    steady: list[Sampler] = []
    cold: list[Sampler] = []
    for program in PROGRAMS:
        s, c = samplers_for(program, device, ae, options, also)
        steady += s
        cold += c
    for _ in range(rounds):
        for sampler in steady:
            sampler.safe_round(max(reps // rounds, 1))
        for sampler in cold:
            sampler.safe_round(max(miss_reps // rounds, 1))
    return sorted(steady + cold, key=lambda s: list(PROGRAMS).index(s.program))


def import_engine(cache_dir: str) -> tuple[Any, dict[str, Any], list[str]]:
    """adaptive_eager (None if it does not import), the options it accepts, and notes."""
    try:
        import adaptive_eager as ae
    except Exception as err:  # noqa: BLE001
        return None, {}, [f"adaptive_eager failed to import: {err!r}"[:300]]
    options, notes = probe_engine_options(ae, {**WANTED_ENGINE_OPTIONS, "cache_dir": cache_dir})
    return ae, options, notes


# ---- output ----------------------------------------------------------------------------------
def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def markdown(header: dict[str, Any], rows: list[Row]) -> str:
    eager = {r.program: r.us_per_op for r in rows if r.path == "eager"}
    notes = "; ".join(header["engine_option_notes"])
    out = ["# adaptive_eager per-op overhead", "", f"- Command: `{header['command']}`",
           f"- Machine: {describe(header['machine'])}",
           (f"- Device: {header['device']}, {header.get('threads')} torch thread(s); "
            "load average (1/5/15 min) before: "
            f"{header['load_before']}, after: {header['load_after']}"),
           f"- adaptive_eager options: {header['engine_options']}"
           + (f" ({notes})" if notes else ""),
           "- Programs: " + "; ".join(f"`{k}`: {v}" for k, v in PROGRAM_DOC.items()),
           (f"- {header['rounds']} interleaved rounds; µs/op: median repetition / aten ops in it; "
            "best: fastest repetition; x eager: median / eager's median"), "",
           "| program | path | µs/op | best µs/op | x eager | ops/rep | reps | notes |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = eager.get(r.program)
        ratio = f"{r.us_per_op / base:.1f}" if r.us_per_op is not None and base else ""
        ops = "" if r.ops_per_rep is None else f"{r.ops_per_rep:g}"
        out.append(f"| {r.program} | {r.path} | {_fmt(r.us_per_op)} | {_fmt(r.best_us_per_op)} | "
                   f"{ratio} | {ops} | {r.reps} | {r.note.replace('|', '/')} |")
    out += ["", "## Per-op targets (ratio to eager's per-op time: best / median)", "",
            "| program | path | target | best | median | met (best) |", "|---|---|---|---|---|---|"]
    out += [f"| {t[0]} | {t[1]} | {t[2]:g}x | {t[3]} | {t[4]} | {t[5]} |" for t in targets(rows)]
    return "\n".join(out) + "\n"


# The per-op targets: (program, path, most x eager)
TARGETS = (("add16", "adaptive_eager hit: record", 3.5), ("mix", "adaptive_eager hit: record", 2.0),
           ("add16", "adaptive_eager hit: total", 5.0), ("mix", "adaptive_eager hit: total", 3.0),
           ("mlp_fb", "adaptive_eager hit: total", 2.0))


def targets(rows: list[Row]) -> list[tuple[str, str, float, str, str, str]]:
    """Each target with its measured ratios (best over best, median over median)."""
    eager = {r.program: r for r in rows if r.path == "eager"}
    by = {(r.program, r.path): r for r in rows}
    out = []
    for program, path, limit in TARGETS:
        r, e = by.get((program, path)), eager.get(program)
        if r is None or e is None or not r.best_us_per_op or not e.best_us_per_op:
            out.append((program, path, limit, "", "", "not measured"))
            continue
        best = r.best_us_per_op / e.best_us_per_op
        med = (r.us_per_op or 0) / (e.us_per_op or 1)
        out.append((program, path, limit, f"{best:.2f}", f"{med:.2f}",
                    "yes" if best <= limit else "no"))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.op_overhead",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output dir ({DEFAULT_OUT})")
    p.add_argument("--reps", type=int, default=200, help="repetitions per steady-state path")
    p.add_argument("--miss-reps", type=int, default=20, help="repetitions of the cold path")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--also", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help="one more engine hit path with these options on top, timed in the same "
                        "interleaved rounds (e.g. --also lazy_guard=0: the always-armed read "
                        "guard); repeatable")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1, as the targets' table: matmul threads spinning "
                        "on a shared machine make per-op times noise)")
    return p.parse_args(argv)


def load_average() -> tuple[float, ...]:
    return tuple(round(x, 2) for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available (torch.cuda.is_available() is False): skipping.")
        return 0
    torch.set_num_threads(args.threads)  # before machine_info, which reports it
    header: dict[str, Any] = {
        "command": "python -m benchmarks.op_overhead " + shlex.join(
            sys.argv[1:] if argv is None else argv),
        "machine": machine_info(args.device), "device": args.device, "rounds": args.rounds,
        "load_before": load_average(), "threads": args.threads}
    with tempfile.TemporaryDirectory(prefix="ae-op-overhead-") as cache_dir:
        os.environ["ADAPTIVE_EAGER_CACHE_DIR"] = cache_dir  # never the user's own caches
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor")
        ae, options, notes = import_engine(cache_dir)
        header["engine_options"], header["engine_option_notes"] = options, notes
        samplers = measure(torch.device(args.device), ae, options, args.rounds, args.reps,
                           args.miss_reps, tuple(args.also))
    header["load_after"] = load_average()
    rows = [row for s in samplers for row in s.rows()]
    text = markdown(header, rows)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "op_overhead.md").write_text(text)
    (args.out / "op_overhead.json").write_text(json.dumps(
        {**header, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1, default=repr))
    print(f"wrote {args.out / 'op_overhead.md'}, {args.out / 'op_overhead.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
