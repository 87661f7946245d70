"""Time to fast: seconds until a fresh process runs a fused program.

    python -m benchmarks.time_to_fast [--out DIR] [--elements N] [--timeout S]

Each case runs in a fresh process. For the engine: seconds from the start of the first step to
the end of the first step that ran a fused program, with an empty cache folder (cold: a new
compile service, an empty Inductor kernel folder inside it) and then with that folder warm.
For torch.compile: the seconds of the compiled function's first call, with its own fresh
Inductor cache folder (cold) and then that folder again (warm). Both also as seconds from the
start of the script (imports included). Workloads: the 9-op elementwise chain (1M elements)
and a training step (MLP 32-64-8 + AdamW, as the 12-step script below). Last, that
12-step script under ``ADAPTIVE_EAGER=1`` twice with a pause between (until the service is
idle): how many steps of each run ran fused, and what the second run compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

T_SCRIPT = time.perf_counter()

_TRAIN12 = """
import json, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 32), torch.randn(64, 8)
fused = []
for step in range(12):
    import adaptive_eager as ae
    before = ae.metrics()["compiled_runs"]
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    loss.item()
    fused.append(ae.metrics()["compiled_runs"] > before)
m = ae.metrics()
print(json.dumps({"fused_steps": sum(fused), "compiles": m["compiles"],
                  "disk_hits": m["disk_hits"], "prefetched": m["prefetched"]}))
"""


def _build(workload: str, elements: int) -> tuple[Any, Any]:
    """(step function, state) of a workload, built outside any engine."""
    import torch

    torch.manual_seed(0)
    if workload == "elementwise":
        x = torch.randn(elements)

        def chain() -> Any:
            inner = x + 0.044715 * x * x * x
            t = torch.tanh(0.7978845608028654 * inner)
            return 0.5 * x * (1.0 + t)

        return chain, None
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    xb, yb = torch.randn(64, 32), torch.randn(64, 8)

    def train_step() -> Any:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        return loss

    return train_step, None


def child(mode: str, workload: str, elements: int, timeout: float) -> dict:
    import torch

    t_imported = time.perf_counter()
    step, _ = _build(workload, elements)
    out: dict[str, Any] = {"mode": mode, "workload": workload,
                           "import_torch_s": round(t_imported - T_SCRIPT, 2)}
    if mode == "torch_compile":
        compiled = torch.compile(step)
        t0 = time.perf_counter()
        y = compiled()
        (y.sum() if y.dim() else y).item()
        t1 = time.perf_counter()
        out.update(first_call_s=round(t1 - t0, 2), from_script_start_s=round(t1 - T_SCRIPT, 2))
        return out
    import adaptive_eager as ae

    with ae.adaptive_eager():
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < timeout:
            before = ae.metrics()["compiled_runs"]
            y = step()
            if workload == "elementwise":
                ae.sync()
            else:
                y.item()
            n += 1
            if ae.metrics()["compiled_runs"] > before:
                t1 = time.perf_counter()
                out.update(time_to_fused_s=round(t1 - t0, 2),
                           from_script_start_s=round(t1 - T_SCRIPT, 2), steps=n)
                break
        else:
            out.update(time_to_fused_s=None, steps=n)
    m = ae.metrics()
    out.update({k: (round(m[k], 2) if isinstance(m[k], float) else m[k]) for k in (
        "compiles", "disk_hits", "prefetched", "service_compiles", "service_errors",
        "compile_queued_seconds", "compile_seconds", "compile_load_seconds",
        "compile_wait_seconds", "program_waits")})
    return out


def _run_child(args: list[str], env: dict[str, str], timeout: float) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.time_to_fast", "--child", *args],
                          capture_output=True, text=True, env=env, timeout=timeout + 300)
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _wait_service_idle(cache: Path, limit: float = 600.0) -> None:
    from adaptive_eager import service

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        st = service.status(cache)
        if st is None or not (st["in_flight"] or st["queued"] or st["compiling"]):
            return
        time.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", nargs=4, metavar=("MODE", "WORKLOAD", "ELEMENTS", "TIMEOUT"))
    p.add_argument("--elements", type=int, default=1 << 20)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", default="benchmarks/out/time_to_fast")
    ns = p.parse_args()
    if ns.child:
        mode, workload, elements, timeout = ns.child
        print(json.dumps(child(mode, workload, int(elements), float(timeout))))
        return
    from adaptive_eager import service

    base = Path(tempfile.mkdtemp(prefix="ae-ttf-"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ADAPTIVE_EAGER", "TORCHINDUCTOR_"))}
    rows = []
    for workload in ("elementwise", "train_step"):
        cache = base / f"engine-{workload}"
        inductor = base / f"inductor-{workload}"
        inductor.mkdir(mode=0o700)
        args = [workload, str(ns.elements), str(ns.timeout)]
        for temp in ("cold", "warm"):
            e = _run_child(["engine", *args], {**env, "ADAPTIVE_EAGER_CACHE_DIR": str(cache)},
                           ns.timeout)
            _wait_service_idle(cache)
            t = _run_child(["torch_compile", *args],
                           {**env, "TORCHINDUCTOR_CACHE_DIR": str(inductor)}, ns.timeout)
            rows.append({"workload": workload, "cache": temp, "engine": e, "torch_compile": t})
            print(json.dumps(rows[-1]), flush=True)
        log = cache / "service" / "log"
        rows[-1]["service_log"] = log.read_text() if log.exists() else ""
        service.stop(cache)
    # the 12-step script twice, a pause between the runs (until its compile landed)
    cache = base / "engine-train12"
    script = base / "train12.py"
    script.write_text(_TRAIN12)
    runs = []
    for _ in range(2):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              env={**env, "ADAPTIVE_EAGER": "1",
                                   "ADAPTIVE_EAGER_CACHE_DIR": str(cache)}, timeout=600)
        r = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {
            "error": proc.stderr[-1500:]}
        r["seconds"] = round(time.perf_counter() - start, 2)
        r["stderr"] = [ln for ln in proc.stderr.splitlines() if "adaptive_eager:" in ln]
        runs.append(r)
        pause = time.perf_counter()
        _wait_service_idle(cache)
        r["pause_s"] = round(time.perf_counter() - pause, 2)
        print(json.dumps(r), flush=True)
    service.stop(cache)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"rows": rows, "train12": runs}, indent=2))
    md = _markdown(rows, runs, ns)
    (out / "results.md").write_text(md)
    print(md)
    shutil.rmtree(base, ignore_errors=True)


def _markdown(rows: list[dict], runs: list[dict], ns: argparse.Namespace) -> str:
    lines = ["| workload | caches | engine: first step to first fused step, s | engine: from "
             "script start, s | torch.compile: first call, s | torch.compile: from script "
             "start, s | ratio (engine / torch.compile first call) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        e, t = r["engine"], r["torch_compile"]
        ef, tf = e.get("time_to_fused_s"), t.get("first_call_s")
        ratio = f"{ef / tf:.2f}x" if ef is not None and tf else "-"
        name = r["workload"] + (f" ({ns.elements} elements)" if r["workload"] == "elementwise"
                                else " (MLP + AdamW)")
        lines.append(f"| {name} | {r['cache']} | {ef} | {e.get('from_script_start_s')} | {tf} "
                     f"| {t.get('from_script_start_s')} | {ratio} |")
    lines.append("")
    lines.append("Engine seconds by stage (metrics): queued = waiting for the service's "
                 "helper (its start and warm-up included), compiling, loading, total wait:")
    for r in rows:
        e = r["engine"]
        lines.append(f"- {r['workload']} {r['cache']}: queued {e.get('compile_queued_seconds')}"
                     f", compiling {e.get('compile_seconds')}, loading "
                     f"{e.get('compile_load_seconds')}, wait {e.get('compile_wait_seconds')}; "
                     f"compiles {e.get('compiles')}, disk hits {e.get('disk_hits')}, prefetched "
                     f"{e.get('prefetched')}, steps until fused {e.get('steps')}")
    for r in rows:
        for ln in r.get("service_log", "").splitlines():
            if "warmed up" in ln or "ok after" in ln:
                lines.append(f"  - service ({r['workload']}): {ln.split(': ', 1)[-1]}")
    lines.append("")
    lines.append("12-step training script under ADAPTIVE_EAGER=1, run twice with a pause "
                 "between (until the compile service was idle):")
    for i, r in enumerate(runs, 1):
        lines.append(f"- run {i}: {r.get('seconds')} s, {r.get('fused_steps')} of 12 steps "
                     f"fused, compiles {r.get('compiles')}, disk hits {r.get('disk_hits')}, "
                     f"prefetched {r.get('prefetched')}; pause after it {r.get('pause_s')} s; "
                     + "; ".join(r.get("stderr", [])))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
