"""The C accelerator of the hot path (Note [C accelerator] in adaptive_eager/_hot.c).

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
from adaptive_eager import config, shapes
from adaptive_eager.dispatch import mode
from adaptive_eager.core.meta import CONJ, METAS_BY_ID, NEG
from adaptive_eager.dispatch.lazy import LazyTensor
from adaptive_eager.engine import Engine, owned_engine
from adaptive_eager.trace import SLOTS, Slot
from helpers import assert_equal_tree, refcounts_around, to_plain

try:
    from adaptive_eager import _hot
except ImportError:  # no compiler where it was installed: the Python path runs
    _hot = None

needs_hot = pytest.mark.skipif(_hot is None, reason="adaptive_eager._hot (the C accelerator) "
                               "is not built: pip install -e . with a C compiler builds it")
# ADAPTIVE_EAGER_ACCEL=0 runs every op on the Python path: the tests that assert the C path's own
# statistics (ops recorded in C, references it holds) have nothing to read there and skip
needs_accel_on = pytest.mark.skipif(not config.resolve().accel, reason="ADAPTIVE_EAGER_ACCEL=0: "
                                    "the C path is off, its statistics stay zero")
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


def factories() -> Step:
    """Ops with no tensor argument at all (arange, full, zeros, scalar_tensor): not host-scalar
    ops, so C records them; and a real tensor beside them (C leaves that op to Python)."""
    a = torch.randn(3, 5)

    def step() -> Any:
        r = torch.arange(5, dtype=torch.float32)
        f = torch.full((3, 5), 0.25)
        z = torch.zeros(3, 1, dtype=torch.float64)
        m = torch.where(a > 0, a, torch.tensor(0.5))
        out = (m * r + f).sum(1, keepdim=True) + z
        return [out, torch.ones(2, 2).cumsum(0), torch.arange(2, 9, 3)]

    return step


PROGRAMS = {"add_chain": add_chain, "mixed_chain": mixed_chain, "inplace_ops": inplace_ops,
            "kwargs_and_lists": kwargs_and_lists, "multi_outputs": multi_outputs,
            "module_fwd_bwd": module_fwd_bwd, "optimizer_step": optimizer_step,
            "factories": factories}
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


def _out_key(o: Any) -> Any:
    return tuple(_out_key(x) for x in o) if type(o) in (list, tuple) else getattr(o, "key", o)


def _sym_state(tr: Any) -> Any:
    """What the trace took from a template (shapes.SymTrace), comparable across runs."""
    st = tr.sym
    if st is None:
        return None
    tpl = st.tpl
    return {"tpl": None if tpl is None else (tpl.label(), len(tpl.steps), tuple(tpl.seen),
                                             tpl.dead),
            "s": st.s, "first": st.first, "keys": list(st.keys),
            "outs": [_out_key(o) for o in st.outs], "preds": len(st.preds)}


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
        "off_outs": [getattr(o, "key", o) for o in tr.off_outs], "sym": _sym_state(tr),
        "node_is_template": tr.node is not None and type(tr.node.sym) is tuple,
    }


_COUNTERS = ("ops_intercepted", "ops_deferred", "ops_eager", "flushes", "trace_hits",
             "trace_misses", "fallbacks", "meta_misses", "engine_errors", "replay_errors",
             "guard_arms", "guard_disarms", "flush_reasons", "fallback_ops", "sym_learned",
             "sym_ops", "sym_hits", "sym_left", "sym_verified", "sym_guard_fallbacks",
             "sym_mispredicted", "sym_dims")


def _run(make: Callable[[], Step], accel: bool | None, monkeypatch: pytest.MonkeyPatch,
         rounds: int = ROUNDS, **opts: Any) -> tuple[list, list, dict]:
    """Results of ``rounds`` rounds (plain eager when ``accel`` is None), the traces flushed,
    and the counters; caches and counters start empty."""
    ae.clear_caches()
    ae.reset_metrics()
    torch.manual_seed(1234)
    step = make()
    if accel is None:
        return [to_plain(step()) for _ in range(rounds)], [], {}
    traces: list[dict] = []
    finish = Engine._finish

    def observed(self: Engine, tr: Any) -> Any:
        traces.append(_snapshot(tr))
        return finish(self, tr)

    monkeypatch.setattr(Engine, "_finish", observed)
    outs = []
    with ae.adaptive_eager(backend="replay", step_aside=False, accel=accel, **opts):
        for _ in range(rounds):
            outs.append(step())
            ae.sync()
    monkeypatch.setattr(Engine, "_finish", finish)
    m = ae.metrics()
    return [to_plain(o) for o in outs], traces, {k: m[k] for k in _COUNTERS}


def _assert_same_recording(expected: Any, c: tuple, py: tuple) -> None:
    """Both paths give eager's results and record identical traces and counters;
    ``c``/``py``: (results, traces, counters) of the C and the pure-Python path."""
    (got_c, traces_c, counters_c), (got_py, traces_py, counters_py) = c, py
    assert_equal_tree(expected, got_c)
    assert_equal_tree(expected, got_py)
    assert len(traces_c) == len(traces_py)
    for i, (tc, tp) in enumerate(zip(traces_c, traces_py)):
        for field in tc:
            assert tc[field] == tp[field], (i, field)
    assert counters_c == counters_py


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
    _assert_same_recording(expected, (got_c, traces_c, counters_c),
                           (got_py, traces_py, counters_py))
    assert counters_c["engine_errors"] == 0


@needs_hot
@needs_accel_on
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
    # 40 adds, all in C: the first one's real inputs (x and y, more than one element: no
    # host-scalar op) are numbered in C; sync's own calls are not recorded ops
    assert stats["fast"] == 40 and stats["slow"] == 0 and stats["ext"] == 2, stats


@needs_hot
@needs_accel_on
def test_ops_with_no_tensor_argument_record_in_c() -> None:
    """Factory ops (no tensor argument: not host-scalar ops, mode.is_host_scalar_op) on a known
    trace are recorded in C like any trie hit."""
    def step() -> Any:
        r = torch.arange(5, dtype=torch.float32)
        f = torch.full((5,), 0.25)
        return (r + f) * torch.zeros(5) + torch.ones(5, dtype=torch.float64)

    with ae.adaptive_eager(backend="replay", step_aside=False):
        for _ in range(3):
            step()
            ae.sync()
        _hot.reset_stats()
        n0 = ae.metrics()["ops_intercepted"]
        got = step()
        ae.sync()
        n = ae.metrics()["ops_intercepted"] - n0
        stats = _hot.stats()
    assert n == 7 and stats["fast"] == n and stats["slow"] == 0, (n, stats)
    assert_equal_tree(to_plain(got), step())


_refcounts_around = refcounts_around


@needs_hot
@needs_accel_on
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
        fast0 = _hot.stats()["fast"]
        before, after = _refcounts_around(watched, loop)
        assert _hot.stats()["fast"] - fast0 == 20 * 100  # x and y numbered in C each time
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
        from adaptive_eager.core.meta import CONJ, METAS_BY_ID, NEG
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


# ---- symbolic templates (Note [symbolic dims] in shapes.py) ----------------------------------
# Sizes before 11 teach the families and the template (three whole traces); later ones run on it.
# The first run at each s matches the template's patterns in Python and fills its memo (Note
# [template memo]); the second at that s takes every step after the anchor in C.
SIZES = [5, 7, 9, 11, 13, 6, 8, 10, 20, 20, 33, 33, 7, 7, 20]


def varlen(sizes: list[int] = SIZES, during: Callable[[int, int], None] | None = None) -> Step:
    """A size-varying program, one size per round: x is its only external (its first use is
    the template's anchor and goes to Python); every other op reads pending lazy tensors or
    no tensor at all. ``during(round, T)`` runs in the middle of each round's trace."""
    xs = [torch.randn(2, t, 16, generator=torch.Generator().manual_seed(t)) for t in sizes]
    it = iter(range(len(sizes)))

    def step() -> Any:
        r = next(it)
        x = xs[r]
        B, T, C = x.shape
        h = x * 2
        h = h + torch.arange(T).view(1, T, 1)
        y = h.softmax(-1).sum(1)
        if during is not None:
            during(r, T)
        z = torch.cat([h, h.neg()], dim=1).mean(1)
        q = torch.full((B, T), 0.5).unsqueeze(-1) * h
        mx, ix = q.max(dim=1)
        return [y + z + mx, ix, h.transpose(1, 2).reshape(B * C, T)[:, 1:T - 1]]

    return step


def _compare_paths(make: Callable[[], Step], rounds: int, monkeypatch: pytest.MonkeyPatch
                   ) -> tuple[dict, list, dict]:
    """Eager, C and Python runs of ``make``: results bitwise equal to eager, the same traces
    (keys, ops, slots, metadata, SymTrace state) and counters. The C run's stats."""
    expected, _, _ = _run(make, None, monkeypatch, rounds)
    _hot.reset_stats()
    got_c, traces_c, counters_c = _run(make, True, monkeypatch, rounds, disk_cache=False)
    stats = _hot.stats()
    got_py, traces_py, counters_py = _run(make, False, monkeypatch, rounds, disk_cache=False)
    assert _hot.stats() == stats
    assert stats["faults"] == 0, stats
    _assert_same_recording(expected, (got_c, traces_c, counters_c),
                           (got_py, traces_py, counters_py))
    assert counters_c["engine_errors"] == 0 and counters_c["sym_mispredicted"] == 0
    return stats, traces_c, counters_c


@needs_hot
def test_c_and_python_paths_record_the_same_template_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stats, traces, counters = _compare_paths(varlen, len(SIZES), monkeypatch)
    assert counters["sym_learned"] >= 1 and counters["sym_hits"] >= 5, counters
    on_tpl = [t for t in traces if t["sym"] is not None and t["sym"]["tpl"] is not None]
    assert len(on_tpl) >= 7 and all(t["node_is_template"] for t in on_tpl)
    assert stats["sym"] > 0, stats  # template steps were taken in C


@needs_hot
@needs_accel_on
def test_template_steps_are_taken_in_c_once_memoised() -> None:
    """The anchor fills the memo for a new s (Note [template memo at a new size] in
    shapes.py): the first run at an s and every later one take each template step after the
    anchor in C, and M.sym_ops counts them as on the Python path."""
    sizes = [5, 7, 9, 11, 13, 6, 8, 10, 24, 24]
    eager = varlen(sizes)
    expected = [to_plain(eager()) for _ in sizes]
    step = varlen(sizes)
    per: list[tuple[dict, int, int]] = []
    outs = []
    with ae.adaptive_eager(backend="replay", step_aside=False, disk_cache=False):
        for _ in sizes:
            _hot.reset_stats()
            m0 = ae.metrics()
            outs.append(step())
            ae.sync()
            m1 = ae.metrics()
            per.append((_hot.stats(), m1["sym_ops"] - m0["sym_ops"],
                        m1["ops_intercepted"] - m0["ops_intercepted"]))
        assert ae.metrics()["engine_errors"] == 0
    assert_equal_tree(expected, [to_plain(o) for o in outs])
    first, second = per[-2], per[-1]
    assert first[1] == second[1] == first[2] > 10, per  # every op of the trace on the template
    # s = 24 the first time and the second: every op but the anchor (x's first use: Python)
    # in C, the first time too (the anchor filled the memo for s)
    for run in (first, second):
        assert run[0]["sym"] == run[1] - 1 == run[0]["fast"], per
        assert run[0]["faults"] == 0, per


_LEARN8 = SIZES[:8]


def _tracking(sizes: list[int], act: Callable[[int, int], None]
              ) -> tuple[Callable[[], Step], list[list[int]]]:
    """``make`` for varlen whose mid-trace hook notes ``_hot.stats()["sym"]`` (one list per run)
    and then calls ``act(round, T)``."""
    runs: list[list[int]] = []

    def make() -> Step:
        marks: list[int] = []
        runs.append(marks)

        def during(r: int, t: int) -> None:
            marks.append(_hot.stats()["sym"])
            act(r, t)

        return varlen(sizes, during)

    return make, runs


@needs_hot
def test_a_memo_entry_for_another_key_goes_to_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """``memo[i][0] != key`` (the memo holds another key for this step): C hands the op to
    Python, which matches the step's pattern and memoises the new key; the traces, counters and
    results are the pure-Python path's and eager's."""
    sizes = _LEARN8 + [20, 20, 20, 20]

    def tamper(r: int, t: int) -> None:
        if r != 9 or not ae.is_enabled():  # not the eager run
            return
        eng = owned_engine()
        assert eng is not None
        st = eng.trace.sym
        assert st is not None and st.tpl is not None
        for tpl in shapes.STATE.templates:
            memo = tpl.memo.get(t, {})
            for i in [i for i in memo if i >= len(st.keys)]:  # the steps still to come
                memo[i] = (memo[i][0] + ("another key",), memo[i][1])

    make, runs = _tracking(sizes, tamper)
    stats, _, counters = _compare_paths(make, len(sizes), monkeypatch)
    m = runs[1]  # the C run: template steps taken in C by each round's middle
    # a first s is taken in C too once its anchor filled the memo (Note [template memo at a
    # new size] in shapes.py): round 8's second half and round 9's first half, all in C
    whole = m[9] - m[8]
    assert m[8] > 0 and whole > 0
    # the tampered second half of round 9 went to Python: only round 10's first half in C
    assert 0 < m[10] - m[9] < whole
    assert m[11] - m[10] == whole  # round 10's second half and round 11's first: C again
    for tpl in shapes.STATE.templates:  # Python memoised the real keys again
        assert all(k[-1] != "another key" for k, _ in tpl.memo.get(20, {}).values())
    assert counters["sym_left"] == 0 and stats["faults"] == 0


@needs_hot
def test_a_template_that_dies_mid_trace_goes_to_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """A template dropped (``dead``) while a trace runs on it: C takes none of its steps after
    that, Python leaves the template (a static path) and results stay eager's."""
    sizes = _LEARN8 + [20, 20, 20, 33]

    def kill(r: int, t: int) -> None:
        if r == 9 and ae.is_enabled():
            for tpl in shapes.STATE.templates:
                tpl.dead = True

    make, runs = _tracking(sizes, kill)
    stats, traces, counters = _compare_paths(make, len(sizes), monkeypatch)
    m = runs[1]
    assert m[9] - m[8] > 0  # round 9's first half: C
    assert stats["sym"] == m[9]  # nothing after the template died
    assert counters["sym_left"] >= 1
    assert traces[-1]["sym"] is None or traces[-1]["sym"]["tpl"] is None


@needs_hot
@needs_accel_on
def test_template_steps_in_c_leak_no_references() -> None:
    """Template steps in C take and drop references to the template, its nodes, memo and
    memoised metadata: counts are the same after 20 more traces at a memoised s."""
    sizes = _LEARN8 + [24] * 24
    step = varlen(sizes)
    with ae.adaptive_eager(backend="replay", step_aside=False, disk_cache=False):
        for _ in range(len(_LEARN8) + 4):
            step()
            ae.sync()
        tpl = next(t for t in shapes.STATE.templates if 24 in t.memo)
        memo = tpl.memo[24]
        got = memo[3][1]
        watched = (tpl, tpl.nodes[3], tpl.nodes[-1], memo, memo[3], got, tpl.steps,
                   aten.add.Tensor._ae_spec, mode._NO_KWARGS)
        s0 = _hot.stats()["sym"]
        before, after = _refcounts_around(watched, step)
        n = _hot.stats()["sym"] - s0
    assert n == 20 * (len(tpl.steps) - 1), n  # every step after the anchor, every trace
    assert before == after


def _init_args() -> tuple:
    """mode.py's arguments to _hot.init, without shapes' classes."""
    from adaptive_eager.cache.memory import TrieNode
    from adaptive_eager.dispatch.opspec import OpSpec
    from adaptive_eager.trace import Trace

    return (LazyTensor, torch.Tensor, torch.nn.Parameter, mode.Meta, SLOTS,
            torch.Tensor._make_wrapper_subclass, mode._set_bits, mode.M, mode._NO_KWARGS,
            mode._TO_COPY, mode.DEFER, mode.DeferMode.__dict__["__torch_dispatch__"], Trace,
            TrieNode, OpSpec, Engine)


@needs_hot
def test_init_without_shapes_classes_leaves_template_steps_to_python() -> None:
    """An init without Template and SymTrace (an older mode.py) keeps the trie-hit fast path
    and hands every template step to Python."""
    sizes = _LEARN8 + [24, 24]
    eager = varlen(sizes)
    expected = [to_plain(eager()) for _ in sizes]
    step = varlen(sizes)
    outs = []
    _hot.init(*_init_args())
    try:
        with ae.adaptive_eager(backend="replay", step_aside=False, disk_cache=False):
            for _ in sizes:
                _hot.reset_stats()
                outs.append(step())
                ae.sync()
            stats = _hot.stats()
            sym_ops = ae.metrics()["sym_ops"]
    finally:
        _hot.init(*_init_args(), shapes.Template, shapes.SymTrace)
    assert sym_ops > 0 and stats["sym"] == 0 and stats["fast"] == 0, stats
    assert_equal_tree(expected, [to_plain(o) for o in outs])


# ---- first uses of external tensors numbered in C (Trace.register's common case) -------------
def module_no_grad() -> Step:
    """A module's forward under no_grad, one trace per call: every parameter (and every
    ``weight.t()``, new each call) is a first use in each trace."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                                torch.nn.Linear(16, 8))
    emb = torch.nn.Embedding(10, 8)
    ids = torch.tensor([[1, 4, 2], [7, 0, 9]])

    def step() -> Any:
        with torch.no_grad():
            h = emb(ids)  # embedding(weight, ids): real tensors only, numbered in C
            return model(h) + model(h * 0.5)

    return step


def aliasing_inputs() -> Step:
    """Views of one storage (with offsets) enter a trace together: the same alias group, in
    one op and across ops; the same tensor twice in one op; a second offset of a known shape
    (its metadata is interned by the Python path first)."""
    base = torch.randn(8, 8)
    other = torch.randn(4, 8)
    rounds = iter(range(100))

    def step() -> Any:
        r = next(rounds)
        top, bottom = base[:4], base[4:]  # views of real tensors: made at once, new each time
        mid = base[2:6] if r >= 2 else base[1:5]  # a new offset in round 2
        z = torch.add(top, bottom)  # two first uses, one storage, in one op
        z = z * torch.mul(other, other)  # one tensor twice in one op
        z = z + mid - other
        return [z, torch.add(base.t()[:4], z)]

    return step


def lazy_with_value() -> Step:
    """Lazy tensors that hold their values from an earlier trace (requires_grad keeps them
    lazy) are first uses in the next one."""
    w = torch.randn(4, 6, requires_grad=True)
    carry: list[Any] = []

    def step() -> Any:
        with torch.no_grad():
            prev = carry[-1] if carry else torch.zeros(4, 6)
            out = torch.add(prev, 1.0).mul(0.5)
        g = w * 2 + 1  # requires grad: stays lazy after its trace ran
        carry[:] = [g]
        with torch.no_grad():
            return [out, torch.add(g, g).sum(0)]

    return step


def conj_views() -> Step:
    """Conj and neg views of real complex tensors (meta_of's bits) reach the engine as the
    inputs of clone (torch's conjugate fallback), mm and dot: numbered in Python."""
    x = torch.randn(6, dtype=torch.complex64)
    y = torch.randn(6, dtype=torch.complex64)
    m = torch.randn(3, 3, dtype=torch.complex64)

    def step() -> Any:
        xc = x.conj()  # a view of a real tensor with the conj bit
        out = [torch.add(xc, y) * 2, torch.mul(y, xc).sum(), torch.mm(m.conj(), m),
               torch.dot(xc, y), torch._neg_view(y).add(1)]
        return [o.clone() for o in out]

    return step


def data_replaced() -> Step:
    """A Parameter whose ``.data`` is replaced between traces (another shape, then another
    stride): its key must change with it, as on the Python path."""
    p = torch.nn.Parameter(torch.randn(4, 4))
    datas = {3: torch.randn(4, 6), 6: torch.randn(6, 4).t()}  # 3 rounds each: hits from the 3rd
    rounds = iter(range(100))

    def step() -> Any:
        r = next(rounds)
        if r in datas:
            p.data = datas[r]
        with torch.no_grad():
            return [torch.mul(p, 2).add(1), (p * p).sum(-1)]

    return step


FIRST_USE = {"module_no_grad": module_no_grad, "aliasing_inputs": aliasing_inputs,
             "lazy_with_value": lazy_with_value, "conj_views": conj_views,
             "data_replaced": data_replaced}


@needs_hot
@pytest.mark.parametrize("name", sorted(FIRST_USE))
def test_first_uses_numbered_in_c_record_the_same_traces(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    stats, traces, _ = _compare_paths(FIRST_USE[name], 9, monkeypatch)
    assert stats["fast"] > 0 and stats["ext"] > 0, stats
    if name == "lazy_with_value":  # the last round's g, numbered as an external
        assert "('ext', 'LazyTensor'" in repr(traces[-1]["ops"])
    if name == "conj_views":  # conj and neg views were numbered (in Python) with their bits
        bits = {METAS_BY_ID[mid].bits for _, mid, _ in _x_parts(traces[-1])}
        assert {0, CONJ, NEG} <= bits, bits


def _x_parts(trace: dict) -> list[tuple]:
    """The ('x', mid, group) parts of a trace's keys, in order."""
    return [k for key in trace["keys"] for k in key[1:] if type(k) is tuple and k[:1] == ("x",)]


@needs_hot
def test_aliasing_views_share_a_group_numbered_in_c(monkeypatch: pytest.MonkeyPatch) -> None:
    _, traces, _ = _compare_paths(aliasing_inputs, 5, monkeypatch)
    parts = _x_parts(traces[-1])
    # top, bottom (one op: one group), other (its own), mid, base.t()[:4] (base's group again)
    groups = [g for _, _, g in parts]
    assert groups == [0, 0, 1, 0, 0], parts
    assert len(traces[-1]["groups"]) == 2


@needs_hot
def test_replaced_data_changes_the_key_in_c(monkeypatch: pytest.MonkeyPatch) -> None:
    stats, traces, _ = _compare_paths(data_replaced, 9, monkeypatch)
    mids = [_x_parts(t)[0][1] for t in traces]
    assert len(set(mids)) == 3, mids
    assert stats["ext"] >= 3, stats  # the last round of each .data in C


def _first_use_counts(accel: bool) -> tuple[list, list, dict]:
    """Results and ``shared`` of the main thread's engine when another thread's engine uses
    its lazy tensors (values in, lazy: requires_grad) for the first time in each trace."""
    import threading

    torch.manual_seed(7)
    w = torch.randn(5, requires_grad=True)
    y = torch.randn(5)
    results: list[Any] = []
    shared: list[bool] = []
    _hot.reset_stats()
    with ae.adaptive_eager(backend="replay", step_aside=False, accel=accel, disk_cache=False):
        main = owned_engine()
        assert main is not None
        for _ in range(3):  # the first run of an op is eager (it learns its metadata)
            g = w * 3  # lazy, requires grad
            ae.sync()  # g holds its value now, and stays lazy
        assert type(g) is LazyTensor and g._ae_real is not None

        def worker() -> None:
            with ae.adaptive_eager(backend="replay", step_aside=False, accel=accel,
                                   disk_cache=False):
                for _ in range(4):
                    main.shared = False  # each trace's first use must set it again
                    with torch.no_grad():
                        z = torch.add(y, 1.0).mul(g).sub(y)
                    ae.sync()
                    shared.append(main.shared)
                    results.append(to_plain(z))

        t = threading.Thread(target=worker)
        t.start()
        t.join()
    return results, shared, _hot.stats()


@needs_hot
def test_another_threads_lazy_tensor_marks_its_owner_shared_in_c() -> None:
    got_c, shared_c, stats_c = _first_use_counts(True)
    got_py, shared_py, stats_py = _first_use_counts(False)
    torch.manual_seed(7)
    w = torch.randn(5, requires_grad=True)
    y = torch.randn(5)
    want = torch.add(y, 1.0).mul(w.detach() * 3).sub(y)
    for got in (got_c, got_py):
        assert len(got) == 4
        for z in got:
            assert torch.equal(z, want)
    assert shared_c == shared_py == [True] * 4
    assert stats_c["ext"] >= 2 and stats_c["faults"] == 0, stats_c  # the later rounds: C
    assert stats_py["fast"] == 0


@needs_hot
def test_first_uses_with_a_torch_function_mode_on_go_to_python() -> None:
    """Trace.register reads with torch-function modes off; C reads as is, so while a mode is
    on the stack during dispatch (rare: a mode's own handler pops it) first uses go to Python."""
    from torch.overrides import TorchFunctionMode

    class Counting(TorchFunctionMode):
        seen: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    x, y = torch.randn(6), torch.randn(6)
    with ae.adaptive_eager(backend="replay", step_aside=False, disk_cache=False):
        for _ in range(3):
            torch.add(x, y).mul(2)
            ae.sync()
        eng = owned_engine()
        assert eng is not None
        real_mode = torch._C._get_dispatch_stack_at(torch._C._len_torch_dispatch_stack() - 1)
        outs = []
        for with_mode, numbered_in_c in ((True, 0), (False, 2)):
            e0 = _hot.stats()["ext"]
            with torch._C._DisableTorchDispatch():  # as torch calls it: the mode off its stack
                if with_mode:
                    with Counting():
                        out = _hot.dispatch(real_mode, aten.add.Tensor, (), (x, y), {})
                else:
                    out = _hot.dispatch(real_mode, aten.add.Tensor, (), (x, y), {})
            assert _hot.stats()["ext"] - e0 == numbered_in_c
            assert type(out) is LazyTensor and eng.trace.ext == [x, y]
            # Python read the metadata with the mode off: the mode saw only is_host_scalar_op's
            # question, once (C asked nothing while it was on)
            assert Counting.seen == ["numel"], Counting.seen
            outs.append(to_plain(out.mul(2)))
    for got in outs:
        assert torch.equal(got, torch.add(x, y).mul(2))


def test_meta_order_is_the_python_paths(tmp_path: Any) -> None:
    """Interning order fixes every Meta's mid (the keys hold mids): in a fresh process C must
    intern exactly what Python would, in its order (C interns nothing: a first use whose
    metadata is new goes to Python)."""
    if _hot is None:
        pytest.skip("the C accelerator is not built")
    code = textwrap.dedent('''
        import sys, torch, adaptive_eager as ae
        sys.path.insert(0, sys.argv[2])
        from test_accel import FIRST_USE
        from adaptive_eager.core.meta import METAS_BY_ID
        from adaptive_eager import _hot
        torch.manual_seed(0)
        steps = [make() for make in FIRST_USE.values()]
        with ae.adaptive_eager(backend="replay", step_aside=False, disk_cache=False,
                               accel=sys.argv[1] == "1"):
            for _ in range(5):
                for step in steps:
                    step(); ae.sync()
        print(_hot.stats()["ext"])
        for m in METAS_BY_ID:
            print(m.mid, m.key)
    ''')
    tests_dir = str(__import__("pathlib").Path(__file__).parent)
    outs = []
    for accel in ("1", "0"):
        r = subprocess.run([sys.executable, "-c", code, accel, tests_dir], capture_output=True,
                           text=True, timeout=300, env={**__import__("os").environ,
                                                        "ADAPTIVE_EAGER_CACHE_DIR": str(tmp_path)})
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(r.stdout.splitlines())
    (n_c, *metas_c), (n_py, *metas_py) = outs
    assert int(n_c) > 0 and int(n_py) == 0
    assert metas_c == metas_py


@needs_hot
@needs_accel_on
def test_first_uses_in_c_leak_no_references() -> None:
    """Numbering in C takes and drops references to the tensors, their storages' addresses,
    metadata and the engine: counts are unchanged after 20 more traces."""
    model = torch.nn.Linear(6, 6)
    x = torch.randn(3, 6)
    base = torch.randn(4, 6)

    def step() -> None:
        with torch.no_grad():
            model(x).add(base[1:4]).mul(base[:3])

    with ae.adaptive_eager(backend="replay", step_aside=False, disk_cache=False):
        for _ in range(4):
            step()
            ae.sync()
        eng = owned_engine()
        from adaptive_eager.core.meta import _METAS
        metas = tuple(_METAS.values())
        watched = (model.weight, model.bias, x, base, eng, torch.strided) + metas
        e0 = _hot.stats()["ext"]
        before, after = _refcounts_around(watched, step)
        n = _hot.stats()["ext"] - e0
    assert n >= 20 * 4, n  # x, weight, bias, the views of base: in C every time
    assert before == after


def views_and_host_scalars() -> Step:
    """Views of real tensors (run_view) and ops on real CPU scalars (run_host_scalar, as an
    optimizer's step counter): C's early exits hand them straight to the engine's method."""
    w = torch.randn(6, 4)
    step_t = torch.tensor(0.0)
    scale = torch.tensor(0.5)

    def step() -> Any:
        step_t.add_(1)  # a host-scalar op writing a real scalar
        c = torch.mul(scale, 2.0)  # a host-scalar op making a new one
        z = (torch.mm(w.t(), w) + w[1:5].t()) * c  # views of a real tensor, then lazy ops
        return [z, step_t.clone(), c]

    return step


@needs_hot
def test_views_and_host_scalar_ops_are_handed_to_the_engine_as_in_python(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stats, _, counters = _compare_paths(views_and_host_scalars, 5, monkeypatch)
    assert stats["handed"] >= 4 * 5, stats  # three views and two host ops per round
    assert counters["ops_eager"] > 0


def attention_and_copies() -> Step:
    """Attention without dropout (a RANDOM op deferred as it draws nothing, Note [attention
    without dropout]), with dropout (it draws: at once), and _to_copy to another dtype (an op
    like any) or onto its own device (Python compares the devices)."""
    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    f = torch.nn.functional

    def step() -> Any:
        with torch.no_grad():
            a = f.scaled_dot_product_attention(q * 1.0, k, v)
            b = f.scaled_dot_product_attention(q, k * 0.5, v, is_causal=True, dropout_p=0.0)
            c = f.scaled_dot_product_attention(q, k, v, dropout_p=0.3)  # draws: at once
            d = (a + b).to(torch.float64).to("cpu") * 2
            return [a, b, c, d.to(torch.float32)]

    return step


@needs_hot
def test_attention_without_dropout_and_dtype_copies_record_in_c(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stats, traces, _ = _compare_paths(attention_and_copies, 5, monkeypatch)
    names = [op for op, *_ in traces[-1]["ops"]]
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in names, names
    assert "aten._to_copy.default" in names, names
    # the last round: everything but the dropout's random op and its views in C
    assert stats["fast"] >= 4 * 6, stats


@needs_hot
@needs_accel_on
def test_the_policy_object_is_not_leaked(monkeypatch: Any) -> None:
    """The policy read for each op recorded in C is released (once one reference
    to ``opspec.DEFER`` leaked per op; harmless for a small int, a leak all the same)."""
    from adaptive_eager import events
    from adaptive_eager.dispatch import opspec

    # DEFER is the int 0: the run timeline's new time buckets (zeros) would count as references
    monkeypatch.setattr(events.RUN_LOG.timeline, "note_flush", lambda *args, **kwargs: None)

    w = torch.randn(4, 4)

    def step() -> None:
        (torch.ones(4, 4) * 2 + w).sum()

    with ae.adaptive_eager(backend="replay", step_aside=False, disk_cache=False):
        for _ in range(4):
            step()
            ae.sync()
        f0 = _hot.stats()["fast"]
        before, after = _refcounts_around((opspec.DEFER,), step, times=50)
        n = _hot.stats()["fast"] - f0
    assert n >= 50 * 2, n
    assert before == after


def test_a_missing_accelerator_is_warned_once_and_reported(tmp_path: Any) -> None:
    """Without the extension (no compiler at install time) the engine still gives eager's results
    on the Python path, but says so: one warning per process, and a line in the report."""
    code = textwrap.dedent("""
        import logging, sys
        sys.modules["adaptive_eager._hot"] = None  # as if it was never built: ImportError
        import torch, adaptive_eager as ae
        from adaptive_eager import report
        from adaptive_eager.dispatch import mode
        assert mode._hot is None and mode.ACCEL_MISSING.startswith("not built")
        seen = []
        class Keep(logging.Handler):
            def emit(self, rec):
                seen.append(rec.getMessage())
        logging.getLogger("adaptive_eager").addHandler(Keep())
        x = torch.arange(6.0)
        want = (x * 2).sin() + 1
        outs = []
        for _ in range(3):  # three engines: still one warning
            with ae.adaptive_eager(backend="replay", cache_dir=sys.argv[1], step_aside=False):
                outs.append((x * 2).sin() + 1)
        with ae.adaptive_eager(backend="replay", cache_dir=sys.argv[1], accel=False):
            outs.append((x * 2).sin() + 1)
        assert all(torch.equal(o, want) for o in outs)
        warned = [m for m in seen if "C accelerator" in m]
        assert len(warned) == 1 and "not built" in warned[0], seen
        ae.api.write_run_log(ae.config.resolve({"cache_dir": sys.argv[1]}))
        text = report.format_report(report.build_report(report.Path(sys.argv[1])))
        assert "hot path: pure Python, the C accelerator is not built" in text, text
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
