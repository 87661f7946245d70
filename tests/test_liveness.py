"""Liveness: a pending trace keeps no value alive that the program dropped and that no later op
of the trace reads (Note [replay liveness] in execute.py). Measured by weak references to the
real values a replay makes, by the values a flush hands to publish, and by peak RSS in fresh
processes against plain eager; never by timing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import weakref
from typing import Any

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import engine as engine_mod
from adaptive_eager import execute

from conftest import assert_same

REP = 64  # base.repeat(REP): a 256 KiB value, "big" next to everything else the loop makes
BIG = 1000 * REP


def _loop(base: torch.Tensor, steps: int, scale_varies: bool = True) -> torch.Tensor:
    """Big temporaries made and dropped with no sync; only ``total`` outlives a step. With
    ``scale_varies`` the int scale is part of each op's key, so its metadata comes from learnt
    formulas and the flush checks them (shapes.replay_checked)."""
    total = torch.zeros(())
    for i in range(steps):
        big = base.repeat(REP) * ((i + 1) if scale_varies else 2.0)
        big2 = big.sin()
        big.exp()  # never read: eager frees it at once
        total = total + big2[::1000].sum()
        del big, big2
    return total


class _LiveBig:
    """Counts, after each op of a Python-loop replay, the big real values alive anywhere."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.refs: list[weakref.ref] = []
        self.seen: set[int] = set()
        self.most = 0
        self.ops = 0
        one = execute._replay_one

        def counted(ops: list, plan: list, grad_ops: Any, i: int, env: list) -> None:
            one(ops, plan, grad_ops, i, env)
            for v in env:
                if isinstance(v, torch.Tensor) and v.numel() >= BIG and id(v) not in self.seen:
                    self.seen.add(id(v))
                    self.refs.append(weakref.ref(v))
            alive = sum(1 for r in self.refs if r() is not None)
            self.most = max(self.most, alive)
            self.ops += 1

        monkeypatch.setattr(execute, "_replay_one", counted)


@pytest.mark.parametrize("scale_varies", [True, False], ids=["checked", "plain"])
def test_replay_frees_dropped_temporaries(monkeypatch: pytest.MonkeyPatch,
                                          scale_varies: bool) -> None:
    torch.manual_seed(0)
    base = torch.randn(1000)
    want = _loop(base, 8, scale_varies)
    counter = _LiveBig(monkeypatch)
    with ae.adaptive_eager(backend="replay", check=True, accel=False, step_aside=False):
        got = _loop(base, 8, scale_varies)
        assert_same(got, want)
    assert counter.ops > 0
    # Eager holds at most three big values at once (big, big2, exp(big)); a trace may add one
    # real input it reads (a value made before it began). Keeping the dropped ones: 20 and more.
    assert counter.most <= 4, counter.most


@pytest.fixture
def leaked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The slots of values handed to publish whose lazy tensor the program already dropped."""
    dead: list[int] = []
    real_publish = engine_mod.publish

    def checking(tr: Any, env: list, check: bool, swap: bool = True) -> None:
        dead.extend(s for s, v in enumerate(env) if v is not None and tr.refs[s]() is None)
        real_publish(tr, env, check, swap)

    monkeypatch.setattr(engine_mod, "publish", checking)
    return dead


def test_publish_gets_no_dead_values(leaked: list[int]) -> None:
    """What a replay hands to publish holds values of live slots only."""
    torch.manual_seed(0)
    base = torch.randn(1000)
    want = _loop(base, 6)
    with ae.adaptive_eager(backend="replay", check=True, step_aside=False):
        got = _loop(base, 6)
        assert_same(got, want)
    assert leaked == []


def _step(base: torch.Tensor, keep: list | None) -> torch.Tensor:
    big = base.repeat(REP) * 2.0
    big2 = big.sin()
    if keep is not None:
        keep.append(big2)
    return (big2[::1000] * big[::1000]).sum() + big2.mean()


def test_fused_dead_outputs_not_kept(leaked: list[int]) -> None:
    """A program compiled while an intermediate was live serves later runs that dropped it:
    that output is freed at once, not handed to publish."""
    pytest.importorskip("torch._inductor")
    torch.manual_seed(0)
    base = torch.randn(1000)
    wants = [_step(base, None).item() for _ in range(6)]
    got = []
    with ae.adaptive_eager(backend="inductor", hot_after=2, compile_async=False,
                           step_aside=False):
        for k in range(6):
            keep: list | None = [] if k < 3 else None  # compiled while big2 is live
            got.append(_step(base, keep).item())
            del keep
        fused = ae.metrics()["compiled_runs"]
    assert fused >= 2
    for g, w in zip(got, wants):
        assert g == pytest.approx(w, rel=1e-5, abs=1e-5)
    assert leaked == []


_RSS_CHILD = textwrap.dedent('''
    import json, sys, tempfile
    import torch
    import adaptive_eager as ae
    backend, warm = sys.argv[1], int(sys.argv[2])

    def step(base):
        total = torch.zeros(())
        for i in range(8):
            big = base.repeat(16_000) * (i + 1)   # 64 MB
            big2 = big.sin()                       # 64 MB
            big.exp()                              # 64 MB, never read
            total = total + big2[::1000].sum()
            del big, big2
        return total.item()

    def hwm_mb():
        line = [x for x in open("/proc/self/status") if x.startswith("VmHWM")][0]
        return int(line.split()[1]) / 1024

    if backend != "eager":
        ctx = ae.adaptive_eager(backend=backend, step_aside=False, hot_after=2,
                                compile_async=False, cache_dir=tempfile.mkdtemp())
        ctx.__enter__()
    torch.manual_seed(0)
    base = torch.randn(1000)
    vs = [step(base) for _ in range(warm)]
    open("/proc/self/clear_refs", "w").write("5")  # peak RSS from here on (compiling done)
    fused = ae.metrics()["compiled_runs"]
    vs += [step(base) for _ in range(3)]
    fused = ae.metrics()["compiled_runs"] - fused
    print(json.dumps(dict(vs=vs, peak_mb=hwm_mb(), fused=fused)))
''')


def _peak(backend: str, warm: int) -> dict:
    run = subprocess.run([sys.executable, "-c", _RSS_CHILD, backend, str(warm)],
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_peak_rss_near_eager() -> None:
    """Peak RSS of the loop in a fresh process under the engine (the C replay loop from the
    first run on, checked replays included) stays near eager's: at most 1.25x plus 100 MB (a
    trace may hold one real input it reads). Keeping the dropped temporaries costs about 1 GB
    more. Replay is bitwise equal to eager."""
    eager = _peak("eager", 0)
    got = _peak("replay", 0)
    assert got["vs"] == eager["vs"]
    assert got["peak_mb"] <= 1.25 * eager["peak_mb"] + 100, (got, eager)
