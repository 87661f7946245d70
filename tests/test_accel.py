"""The C accelerator of the hot path (issue 13, Note [C accelerator] in adaptive_eager/_hot.c).

The C path and the pure-Python path (``accel=False``, ``ADAPTIVE_EAGER_ACCEL=0``) must record the
same traces, op for op: the same trie keys, arguments with the same Slot markers, the same
scalars, slot bookkeeping, output metadata and counters; and both must give results bitwise
equal to plain eager. The tests skip only where the extension was not built, and one fails when
a C compiler exists but the extension is missing (a broken build must not go unnoticed).
"""

from __future__ import annotations

import gc
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import config
from adaptive_eager.dispatch import mode
from adaptive_eager.dispatch.lazy import LazyTensor
from adaptive_eager.engine import Engine, owned_engine
from adaptive_eager.trace import SLOTS, Slot
from helpers import assert_equal_tree, to_plain

try:
    from adaptive_eager import _hot
except ImportError:  # no compiler where it was installed: the Python path runs
    _hot = None

needs_hot = pytest.mark.skipif(_hot is None, reason="adaptive_eager._hot (the C accelerator) "
                               "is not built: pip install -e . with a C compiler builds it")
aten = torch.ops.aten


def test_extension_is_built_where_a_compiler_exists() -> None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None and shutil.which("gcc") is None:
        pytest.skip(f"no C compiler ({cc}) on this machine: the pure-Python path is expected")
    assert _hot is not None, "a C compiler exists but adaptive_eager._hot was not built"
    assert mode._hot is _hot


def test_option_parses_and_selects_the_path() -> None:
    assert config.resolve(environ={}).accel is True
    assert config.resolve(environ={"ADAPTIVE_EAGER_ACCEL": "0"}).accel is False
    with pytest.raises(config.ConfigError):
        config.resolve(environ={"ADAPTIVE_EAGER_ACCEL": "maybe"})
    for accel in (True, False):
        eng = Engine(config.resolve({"backend": "replay", "accel": accel}))
        m = mode.DeferMode(eng)
        in_c = "__torch_dispatch__" in vars(m)
        assert in_c is (accel and _hot is not None)


# ---- the programs ---------------------------------------------------------------------------
Step = Callable[[], Any]


def add_chain() -> Step:
    x, y = torch.randn(16), torch.randn(16)

    def step() -> Any:
        z = x
        for i in range(40):
            z = torch.add(z, y, alpha=0.5) if i % 7 == 3 else torch.add(z, y)
        return z

    return step


def mixed_chain() -> Step:
    a, b = torch.randn(16), torch.randn(16)
    m = torch.randn(4, 4)

    def step() -> Any:
        z = a
        for _ in range(6):
            z = torch.sin(torch.add(z, b) * 0.5).relu()
            z = (z.view(4, 4) @ m).reshape(16)
            z = torch.where(z > 0, z, b)
            z = z - z.sum() / 16
            z = z.view(4, 4).t().contiguous().view(16) * 2
        return z

    return step


def inplace_ops() -> Step:
    w, b = torch.randn(8), torch.randn(8)

    def step() -> Any:
        z = torch.mul(b, 1.5).add(w)
        z.add_(b)
        z.mul_(0.5).relu_()
        z.add_(b, alpha=-0.25)
        w.add_(z, alpha=0.1)  # a real tensor written: arms the read guard
        w.mul_(0.99)
        v = z.clone()
        v[2:5] = 3.0
        v.view(2, 4)[1].sub_(z[:4])
        return [z, v, w.clone()]

    return step


def kwargs_and_lists() -> Step:
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    idx = torch.tensor([0, 2, 3])

    def step() -> Any:
        z = torch.add(a, b, alpha=2).mul(0.25)
        s = torch.sum(z, dim=[0, 1], keepdim=True, dtype=torch.float64)
        c = torch.cat([z, z * 2, b], dim=0)
        st = torch.stack((z, z + 1), dim=1).sum(dim=(1,))
        g = torch.nn.functional.gelu(c, approximate="tanh").clamp(min=-0.5, max=2.0)
        e = torch.where(g > 0, g, 0.0).softmax(-1).index_select(0, idx)
        f = g.permute(1, 0).reshape(6, 12).narrow(1, 2, 5).amax(dim=[1])
        p = torch.addcmul(z, z, st, value=0.5).pow(2).mean(dim=-1, keepdim=True)
        return [s, c, st, g, e, f, p, z.sum(dtype=torch.float64)]

    return step


def multi_outputs() -> Step:
    """Ops with several outputs (tuples and lists of new lazy tensors), and values carried over
    from the previous round (lazy tensors that hold their values by now) as inputs."""
    a = torch.randn(6, 8)
    w = torch.randn(6, 8, requires_grad=True)
    carry: list[Any] = []

    def step() -> Any:
        z = a * 1.5 + (carry[-1] if carry else 0.0)
        p, q, r = torch.split(z, [2, 2, 4], dim=1)
        u = torch.unbind(z[:3], dim=0)
        mx, ix = torch.max(z, dim=1)
        sv, si = torch.sort(z, dim=-1)
        tv, ti = torch.topk(z, 3)
        ch = z.chunk(3, dim=0)
        v, m = torch.var_mean(z, dim=0)
        out = torch.cat([p, q * 2, r.sum(1, keepdim=True).expand(6, 2)], dim=1)
        g = (w * z).tanh()  # requires grad: stays a lazy wrapper once its value is in
        if carry:
            g = g + carry[1] * 0.5  # last round's g: a lazy tensor holding its value
        carry[:] = [out.sum(1, keepdim=True).expand(6, 8) * 0.01, g]
        return [out, mx, ix, sv, si, tv, ti, *u, *ch, v, m, g.detach() + carry[1].detach()]

    return step


def module_fwd_bwd() -> Step:
    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 16), torch.nn.GELU(),
                                torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)

    def step() -> Any:
        for p in model.parameters():
            p.grad = None
        loss = model(x).square().mean()
        loss.backward()
        return [loss] + [p.grad for p in model.parameters()]

    return step


def optimizer_step() -> Step:
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    sgd_w = torch.randn(5, requires_grad=True)
    sgd = torch.optim.SGD([sgd_w], lr=0.1, momentum=0.9, foreach=False)
    x, y = torch.randn(7, 6), torch.randn(7, 3)

    def step() -> Any:
        opt.zero_grad()
        sgd.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y) + sgd_w.square().sum()
        loss.backward()
        opt.step()
        sgd.step()
        return [loss] + [p.detach().clone() for p in model.parameters()] + [sgd_w.detach().clone()]

    return step


PROGRAMS = {"add_chain": add_chain, "mixed_chain": mixed_chain, "inplace_ops": inplace_ops,
            "kwargs_and_lists": kwargs_and_lists, "multi_outputs": multi_outputs,
            "module_fwd_bwd": module_fwd_bwd, "optimizer_step": optimizer_step}
ROUNDS = 4  # the first records misses (Python); the later ones hit the trie (C)


# ---- what a trace holds, made comparable across runs ----------------------------------------
def _norm(x: Any, tr: Any) -> Any:
    if isinstance(x, Slot):
        return ("slot", x.i, x is SLOTS[x.i])
    if isinstance(x, torch.Tensor):
        pos = [i for i, e in enumerate(tr.ext) if e is x]
        return ("ext", type(x).__name__, pos, tuple(x.shape), x.dtype)
    if type(x) is list or type(x) is tuple:
        return (type(x).__name__, tuple(_norm(v, tr) for v in x))
    return (type(x).__name__, x)


def _path_keys(tr: Any) -> tuple:
    node = tr.node if tr.node is not None else tr.off_node
    keys = []
    while node is not None and node.key is not None:
        keys.append(node.key)
        node = node.parent
    return tuple(reversed(keys)) + tuple(tr.off_keys)


def _snapshot(tr: Any) -> dict:
    ops = [(str(op), type(margs).__name__, _norm(margs, tr),
            (kw is mode._NO_KWARGS, tuple((k, _norm(v, tr)) for k, v in kw.items())), slots)
           for op, margs, kw, slots in tr.ops]
    live = [(s, type(w).__name__, w._ae_meta.key) for s, r in enumerate(tr.refs)
            if (w := r()) is not None and type(w) is LazyTensor and w._ae_real is None]
    return {
        "ops": ops, "keys": _path_keys(tr), "on_trie": tr.node is not None,
        "scalars": [(type(v).__name__, v) for v in tr.scalars], "last": list(tr.last),
        "n_slots": tr.n_slots, "n_refs": len(tr.refs), "live": live, "n_ext": len(tr.ext),
        "groups": sorted(tr.groups.values()), "grad_ops": dict(tr.grad_ops),
        "off_outs": [getattr(o, "key", o) for o in tr.off_outs],
    }


_COUNTERS = ("ops_intercepted", "ops_deferred", "ops_eager", "flushes", "trace_hits",
             "trace_misses", "fallbacks", "meta_misses", "engine_errors", "replay_errors",
             "guard_arms", "guard_disarms", "flush_reasons", "fallback_ops")


def _run(make: Callable[[], Step], accel: bool | None,
         monkeypatch: pytest.MonkeyPatch) -> tuple[list, list, dict]:
    """Results of ROUNDS rounds (plain eager when ``accel`` is None), the traces flushed, and
    the counters; caches and counters start empty."""
    ae.clear_caches()
    ae.reset_metrics()
    torch.manual_seed(1234)
    step = make()
    if accel is None:
        return [to_plain(step()) for _ in range(ROUNDS)], [], {}
    traces: list[dict] = []
    finish = Engine._finish

    def observed(self: Engine, tr: Any) -> Any:
        traces.append(_snapshot(tr))
        return finish(self, tr)

    monkeypatch.setattr(Engine, "_finish", observed)
    outs = []
    with ae.adaptive_eager(backend="replay", step_aside=False, accel=accel):
        for _ in range(ROUNDS):
            outs.append(step())
            ae.sync()
    monkeypatch.setattr(Engine, "_finish", finish)
    m = ae.metrics()
    return [to_plain(o) for o in outs], traces, {k: m[k] for k in _COUNTERS}


@needs_hot
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_c_and_python_paths_record_the_same_traces(name: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    make = PROGRAMS[name]
    expected, _, _ = _run(make, None, monkeypatch)
    _hot.reset_stats()
    got_c, traces_c, counters_c = _run(make, True, monkeypatch)
    stats = _hot.stats()
    got_py, traces_py, counters_py = _run(make, False, monkeypatch)
    assert _hot.stats() == stats  # the pure-Python path never entered C
    assert stats["fast"] > 0, stats  # the C path recorded ops ...
    assert stats["faults"] == 0, stats  # ... and met no error
    assert_equal_tree(expected, got_c)
    assert_equal_tree(expected, got_py)
    assert len(traces_c) == len(traces_py)
    for i, (tc, tp) in enumerate(zip(traces_c, traces_py)):
        for field in tc:
            assert tc[field] == tp[field], (i, field)
    assert counters_c == counters_py
    assert counters_c["engine_errors"] == 0


@needs_hot
def test_most_ops_of_a_known_chain_record_in_c() -> None:
    step = add_chain()
    with ae.adaptive_eager(backend="replay", step_aside=False):
        for _ in range(3):  # ops learnt one by one cut the first traces short
            step()
            ae.sync()
        _hot.reset_stats()
        step()
        ae.sync()
    stats = _hot.stats()
    # 40 adds: the first (a real input, the mode's early exits) goes to Python; sync's
    # own calls are not recorded ops
    assert stats["fast"] == 39, stats


@needs_hot
def test_dropped_lazy_tensors_die_and_references_are_not_leaked() -> None:
    """The engine reads liveness from weak references: outputs made in C must die when the
    user drops them, and recording must not leak references to anything it touches."""
    x, y = torch.randn(16), torch.randn(16)

    def loop() -> None:
        z = x
        for _ in range(100):
            z = torch.add(z, y, alpha=0.5)

    with ae.adaptive_eager(backend="replay", step_aside=False):
        for _ in range(3):
            loop()
            ae.sync()
        eng = owned_engine()
        assert eng is not None
        z = x
        for _ in range(50):
            z = torch.add(z, y)
        refs = eng.trace.refs
        assert sum(r() is not None for r in refs) == 1  # only the last output is held
        meta = z._ae_meta
        del z
        ae.sync()
        spec = aten.add.Tensor._ae_spec
        watched = (x, y, spec, meta, SLOTS[7], aten.add.Tensor, mode._NO_KWARGS, eng.trace)
        gc.collect()
        before = [sys.getrefcount(o) for o in watched]
        fast0 = _hot.stats()["fast"]
        for _ in range(20):
            loop()
            ae.sync()
        gc.collect()
        after = [sys.getrefcount(o) for o in watched]
        assert _hot.stats()["fast"] - fast0 == 20 * 99
    assert before[:-1] == after[:-1]  # the trace object is replaced at each flush


@needs_hot
def test_an_error_while_checking_falls_back_to_the_python_path() -> None:
    """A fault inside the C checks counts and hands the op to the Python handler, which
    records it as it always would."""
    x, y = torch.randn(6), torch.randn(6)

    class Flaky:
        """A mode whose ``engine`` fails once (as a fault inside the C checks would)."""

        def __init__(self, real: Any) -> None:
            self.real, self.calls = real, 0

        @property
        def engine(self) -> Any:
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("injected")
            return self.real.engine

    with ae.adaptive_eager(backend="replay", step_aside=False):
        for _ in range(2):
            w = torch.add(x, y).mul(2)
            ae.sync()
        z = torch.add(x, y)  # a pending lazy first argument: the C path's case
        real_mode = torch._C._get_dispatch_stack_at(torch._C._len_torch_dispatch_stack() - 1)
        assert type(real_mode) is mode.DeferMode
        flaky = Flaky(real_mode)
        f0 = _hot.stats()["faults"]
        with torch._C._DisableTorchDispatch():  # as torch calls it: the mode off its stack
            out = _hot.dispatch(flaky, aten.mul.Tensor, (LazyTensor,), (z, 2), {})
        assert _hot.stats()["faults"] == f0 + 1
        assert flaky.calls == 2  # C asked once (and failed), Python once
        assert type(out) is LazyTensor
        got = to_plain(out)
        want = to_plain(w)
    assert torch.equal(got, want)
    assert torch.equal(got, torch.add(x, y).mul(2))


@needs_hot
def test_an_interrupt_while_checking_propagates_as_on_the_python_path() -> None:
    """KeyboardInterrupt/SystemExit met inside the C checks is the user's: it propagates (the
    Python handler catches Exception only), it is not cleared and the op re-run."""
    x, y = torch.randn(6), torch.randn(6)

    class Interrupting:
        def __init__(self, real): self.real, self.calls = real, 0

        @property
        def engine(self):
            self.calls += 1
            raise KeyboardInterrupt("ctrl-c")

    with ae.adaptive_eager(backend="replay", step_aside=False):
        for _ in range(2):
            torch.add(x, y).mul(2)
            ae.sync()
        z = torch.add(x, y)
        real = torch._C._get_dispatch_stack_at(torch._C._len_torch_dispatch_stack() - 1)
        for handler in (_hot.dispatch, mode.DeferMode.__dict__["__torch_dispatch__"]):
            m = Interrupting(real)
            with torch._C._DisableTorchDispatch(), pytest.raises(KeyboardInterrupt):
                handler(m, aten.mul.Tensor, (LazyTensor,), (z, 2), {})
            assert m.calls == 1


@needs_hot
def test_a_kwargs_dict_that_grows_while_walked_does_not_overrun_the_key() -> None:
    """Python code run by a key's __eq__ adds entries to kwargs while C walks it: C must stop
    (it wrote past the key tuple: a segfault or heap corruption). In a subprocess: a crash."""
    code = textwrap.dedent('''
        import torch, adaptive_eager as ae
        from adaptive_eager.dispatch.lazy import LazyTensor
        aten = torch.ops.aten
        x, y = torch.randn(6), torch.randn(6)
        kw = {}
        class Evil:
            fired = False
            def __hash__(self): return hash("alpha")
            def __eq__(self, other):
                if not Evil.fired:
                    Evil.fired = True
                    for i in range(200):
                        kw[f"k{i}"] = i
                return False
        with ae.adaptive_eager(backend="replay", step_aside=False, disk_cache=False):
            for _ in range(3):
                torch.add(torch.add(x, y), y, alpha=2); ae.sync()
            z = torch.add(x, y)
            m = torch._C._get_dispatch_stack_at(torch._C._len_torch_dispatch_stack() - 1)
            kw[Evil()] = 1
            with torch._C._DisableTorchDispatch():
                try:
                    m.__torch_dispatch__(aten.add.Tensor, (LazyTensor,), (z, y), kw)
                except TypeError:
                    pass  # the Python path's answer to a non-str keyword
            import gc; gc.collect()
        print("ok")
    ''')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stderr[-2000:])
