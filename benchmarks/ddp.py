"""DDP benchmark: 2 gloo ranks on 127.0.0.1, the mid-size GPT-2 training step.

Modes, each a fresh job of ``--ranks`` processes started by torch.multiprocessing.spawn:
  eager          plain DDP
  engine_cold    DDP inside ``adaptive_eager()`` with an empty cache folder
  engine_warm    the same, with the folder engine_cold left (programs on disk)
  torch_compile  ``torch.compile(DDP(model))`` (Dynamo's DDPOptimizer splits at buckets)
Per mode and rank: median ms per step over the timed steps (after ``--warmup``), time to the end
of the first step, compiles, fused runs, steps aside, and whether the replicas' final parameters
are bitwise identical. One run, figures for the README (never a test threshold):

    python -m benchmarks.ddp --steps 20 --warmup 5 --out benchmarks/out/ddp
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

MODES = ("eager", "engine_cold", "engine_warm", "torch_compile")
_GPT2 = {"mid": (256, 4, 4, 2048, 8, 128), "small": (64, 2, 2, 256, 4, 32)}


def _rank(rank: int, world: int, port: int, mode: str, cfg: dict) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=900))
    width, layers, heads, vocab, batch, seq = _GPT2[cfg["size"]]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width,
                                       n_layer=layers, n_head=heads, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    ctx: Any = contextlib.nullcontext()
    if mode.startswith("engine"):
        import adaptive_eager as ae

        ctx = ae.adaptive_eager()
    times: list[float] = []
    start = time.perf_counter()
    first = 0.0
    with ctx:
        net: Any = DDP(model)
        if mode == "torch_compile":
            net = torch.compile(net)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        for i in range(cfg["warmup"] + cfg["steps"]):
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = net(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            loss.item()  # the step is done when its loss is known
            now = time.perf_counter()
            if i == 0:
                first = now - start
            if i >= cfg["warmup"]:
                times.append(now - t)
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    info: dict[str, Any] = {}
    if mode.startswith("engine"):
        import adaptive_eager as ae
        from adaptive_eager import distributed as aed

        m = ae.metrics()
        info = {k: m[k] for k in ("compiles", "disk_hits", "compiled_runs", "replayed_runs",
                                  "step_asides", "ops_fused", "ops_deferred")}
        info["agreement"] = dict(aed.stats())
    times.sort()
    out = {"rank": rank, "mode": mode, "median_ms": times[len(times) // 2] * 1e3,
           "min_ms": times[0] * 1e3, "first_step_s": first, **info}
    torch.save({"result": out, "params": params}, Path(cfg["out"]) / f"{mode}.rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--size", default="mid", choices=sorted(_GPT2))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", default="benchmarks/out/ddp")
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("ADAPTIVE_EAGER_CACHE_DIR", tempfile.mkdtemp(prefix="ae-ddp-"))
    cfg = {"size": args.size, "steps": args.steps, "warmup": args.warmup,
           "threads": args.threads, "out": str(out)}
    rows = []
    for mode in args.modes.split(","):
        t = time.perf_counter()
        mp.spawn(_rank, args=(args.ranks, _free_port(), mode, cfg), nprocs=args.ranks)
        wall = time.perf_counter() - t
        got = [torch.load(out / f"{mode}.rank{r}.pt") for r in range(args.ranks)]
        same = all(torch.equal(got[0]["params"], x["params"]) for x in got[1:])
        for x in got:
            rows.append(dict(x["result"], wall_s=wall, replicas_identical=same))
        print(json.dumps([x["result"] for x in got]), "replicas identical:", same, flush=True)
    (out / "ddp.json").write_text(json.dumps(rows, indent=1))
    lines = ["| mode | rank | median ms/step | first step s | compiles | fused runs | "
             "steps aside | replicas identical | job wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['rank']} | {r['median_ms']:.1f} | "
                     f"{r['first_step_s']:.1f} | {r.get('compiles', '-')} | "
                     f"{r.get('compiled_runs', '-')} | {r.get('step_asides', '-')} | "
                     f"{r['replicas_identical']} | {r['wall_s']:.0f} |")
    (out / "ddp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
