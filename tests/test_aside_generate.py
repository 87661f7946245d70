"""Stepping aside in loops without an optimizer (``generate()``, evaluation): while the engine is
off its tick hooks sit on the outermost module only (Note [root ticks] in rounds.py), and probes
that find nothing back off (Note [probes back off]).

As in test_aside.py the decision is forced by pinning the measured costs, never by timing.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.modules import module as nn_module

import adaptive_eager as ae
from adaptive_eager import compiler
from adaptive_eager.compile import policy
from adaptive_eager.calibrate import calibrate


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.lin(x))) + x


class _Model(torch.nn.Module):
    """A root with nested submodules, called once per "token" like a decoder in generate()."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(6, 6)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        if self.fail:
            raise ValueError("bad input")
        return self.head(x)


def _step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One step of a greedy-decoding-like loop: one root call, its output fed back, and a read
    in Python (generate() reads the next token), which ends the trace."""
    x = model(x).softmax(-1)
    x.argmax().item()
    return x


def _decode(model: torch.nn.Module, steps: int) -> list[torch.Tensor]:
    x = torch.ones(2, 6)
    outs = []
    for _ in range(steps):
        x = _step(model, x)
        outs.append(x.clone())
    return outs


def _always_aside(monkeypatch: pytest.MonkeyPatch) -> None:
    calibrate()  # measure first, then pin: recording "costs" a second per op
    monkeypatch.setattr(policy, "RECORD_S", 1.0)
    monkeypatch.setattr(policy, "MIN_DECISIONS", 1)


def _our_global_hooks() -> int:
    from adaptive_eager.aside import Presence
    from adaptive_eager.rounds import _AsideHook, _RootTick

    hooks = [*nn_module._global_forward_hooks.values(),
             *nn_module._global_forward_pre_hooks.values()]
    return sum(isinstance(h, (_RootTick, _AsideHook))  # Note [hooks under Dynamo]
               or isinstance(getattr(h, "__self__", None), Presence) for h in hooks)


def _module_hooks(m: torch.nn.Module) -> int:
    return len(m._forward_hooks) + len(m._forward_pre_hooks)


def test_aside_ticks_on_the_root_only_and_probes(monkeypatch: pytest.MonkeyPatch,
                                                 cache_dir: Path, graph_backend: Any) -> None:
    """Aside, no global module hook is left (every module call takes torch's fast path) and only
    the root carries the two tick hooks; the root's calls still count rounds, so the probe comes
    after probe_every of them; results are eager's, bitwise (aside it is eager's kernels, and
    replayed traces run them op by op)."""
    _always_aside(monkeypatch)
    torch.manual_seed(0)
    model = _Model()
    with torch.no_grad():
        ref = _decode(model, 120)
        outs: list[torch.Tensor] = []
        seen: list[tuple[int, int, int, int]] = []  # ops, our global hooks, root's, inner's
        x = torch.ones(2, 6)
        with ae.adaptive_eager(backend=graph_backend.name, hot_after=2, compile_async=False,
                               cache_dir=str(cache_dir), disk_cache=False, probe_every=10):
            for _ in range(120):
                x = _step(model, x)
                outs.append(x.clone())
                inner = sum(_module_hooks(m) for m in model.modules() if m is not model)
                seen.append((ae.metrics()["ops_intercepted"], _our_global_hooks(),
                             _module_hooks(model), inner))
    assert _our_global_hooks() == 0 and _module_hooks(model) == 0  # all gone at exit
    for a, b in zip(outs, ref):
        assert torch.equal(a, b)
    m = ae.metrics()
    assert m["step_asides"] >= 2, m  # aside, probed, aside again
    aside = [(g, r, i) for (a, g, r, i), (b, *_) in zip(seen, seen[1:]) if a == b]
    assert aside, seen
    # aside from the second call on: only the root's pre and post hooks
    assert all(i == 0 for _, _, i in aside[1:]) and (0, 2, 0) in aside, aside
    per_call = [b[0] - a[0] for a, b in zip(seen, seen[1:])]
    first = per_call.index(0)
    # probe_every rounds aside: the round that stepped aside at a submodule's end, 8 plain-eager
    # ones, and the 10th, whose root-call end re-enters the engine (its trailing reads recorded)
    assert per_call[first:first + 8] == [0] * 8 and per_call[first + 8] > 0, per_call
    assert any(n > 0 for n in per_call[first + 9:]), per_call  # then the probe, ticked by the root


def _model_and_input() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = _Model()
    x = torch.ones(2, 6)
    with torch.no_grad():
        return model, x, model(x)


@contextlib.contextmanager
def _aside_after_30_steps(model: torch.nn.Module, x: torch.Tensor, cache_dir: Path,
                          graph_backend: Any) -> Iterator[Any]:
    """The engine on, 30 steps of the model run (enough to step aside): its presence."""
    with ae.adaptive_eager(backend=graph_backend.name, hot_after=2, compile_async=False,
                           cache_dir=str(cache_dir), disk_cache=False, probe_every=1000):
        for _ in range(30):
            _step(model, x)
        yield ae.api._state.presence


def test_root_copied_or_pickled_while_aside(monkeypatch: pytest.MonkeyPatch, cache_dir: Path,
                                            graph_backend: Any) -> None:
    """A model copied or saved while its tick hooks are on it: the copy works and carries inert
    hooks (no tie to the engine: its calls count no rounds); the original still ticks."""
    _always_aside(monkeypatch)
    model, x, want = _model_and_input()
    with torch.no_grad():
        with _aside_after_30_steps(model, x, cache_dir, graph_backend) as presence:
            assert presence.aside and _module_hooks(model) == 2, _module_hooks(model)
            copied = copy.deepcopy(model)
            loaded = pickle.loads(pickle.dumps(model))
            before = presence.steps_aside
            for other in (copied, loaded):
                assert torch.equal(other(x), want)
            assert presence.steps_aside == before  # the copies' hooks are inert
            model(x)
            assert presence.steps_aside == before + 1
    assert _module_hooks(model) == 0
    assert torch.equal(copied(x), want) and torch.equal(loaded(x), want)


def test_root_scripted_while_aside(monkeypatch: pytest.MonkeyPatch, cache_dir: Path,
                                   graph_backend: Any) -> None:
    """torch.jit.script of a root while its tick hooks are on it: scripted as in eager (the
    tick hooks are not scriptable and are left out), equal to eager; the original still ticks."""
    _always_aside(monkeypatch)
    model, x, want = _model_and_input()
    with torch.no_grad():
        with _aside_after_30_steps(model, x, cache_dir, graph_backend) as presence:
            assert presence.aside and _module_hooks(model) == 2, _module_hooks(model)
            scripted = torch.jit.script(model)
            assert torch.equal(scripted(x), want)
            before = presence.steps_aside
            model(x)
            assert presence.steps_aside == before + 1 and _module_hooks(model) == 2
    assert torch.equal(scripted(x), want)


def test_exception_in_the_root_while_aside(monkeypatch: pytest.MonkeyPatch, cache_dir: Path,
                                           graph_backend: Any) -> None:
    """The root's forward raises while aside: the user's exception comes out as it is, the
    round still ends (the post hook is always called), and later calls keep ticking."""
    _always_aside(monkeypatch)
    model, x, want = _model_and_input()
    with torch.no_grad():
        with _aside_after_30_steps(model, x, cache_dir, graph_backend) as presence:
            assert presence.aside
            before = presence.steps_aside
            model.fail = True
            with pytest.raises(ValueError, match="bad input"):
                model(x)
            model.fail = False
            assert presence.steps_aside == before + 1 and presence._depth == 0
            assert torch.equal(model(x), want)
            assert presence.steps_aside == before + 2


def test_probes_that_find_nothing_back_off(monkeypatch: pytest.MonkeyPatch, cache_dir: Path,
                                           graph_backend: Any) -> None:
    """Note [probes back off]: every probe that ends aside again doubles the rounds before the
    next one."""
    from adaptive_eager import aside

    _always_aside(monkeypatch)
    monkeypatch.setattr(policy, "PROBE_FLUSHES", 5)
    monkeypatch.setattr(aside, "PROBE_BACKOFF_MAX", 3)
    torch.manual_seed(0)
    model = _Model()
    with torch.no_grad():
        ref = _decode(model, 400)
        with ae.adaptive_eager(backend=graph_backend.name, hot_after=2, compile_async=False,
                               cache_dir=str(cache_dir), disk_cache=False, probe_every=5):
            x = torch.ones(2, 6)
            ops, outs = [], []
            for _ in range(400):
                n0 = ae.metrics()["ops_intercepted"]
                x = _step(model, x)
                outs.append(x.clone())
                ops.append(ae.metrics()["ops_intercepted"] - n0)
    for a, b in zip(outs, ref):
        assert torch.equal(a, b)
    runs, n = [], 0  # lengths of the stretches of calls that reached no engine
    for k in ops:
        if k == 0:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    if n:
        runs.append(n)
    # Rounds aside: 5, 10, 20, then capped at 5 << 3 = 40. Of each stretch the first round
    # stepped aside at a submodule's end and the last re-entered at the root's end (both
    # partly recorded), so the calls that reached no engine are 2 fewer; the last stretch may
    # be cut short by the loop's end.
    assert [r + 2 for r in runs[:4]] == [5, 10, 20, 40], runs
    assert all(r + 2 == 40 for r in runs[4:-1]) and runs[-1] + 2 <= 40, runs
    assert ae.metrics()["step_asides"] == len(runs), ae.metrics()


def test_trial_over_root_calls_switches_hook_kinds(monkeypatch: pytest.MonkeyPatch,
                                                   cache_dir: Path, graph_backend: Any) -> None:
    """A trial without an optimizer alternates engine rounds (global tick hooks) and eager rounds
    (root hooks only): each switch, at the start of a root call, keeps the count of rounds (the
    sides alternate call by call) and results are eager's. Which side wins is test_aside.py's
    business (timed there on a test clock); here either verdict leaves consistent hooks."""
    from adaptive_eager import aside
    from adaptive_eager.trial import TRIAL_TICKS

    class SteadyClock:  # rounds all alike: no verdict is clear early (Note [clear trials])
        now = 0.0

        def perf_counter(self) -> float:
            self.now += 0.001
            return self.now

    monkeypatch.setattr(aside, "time", SteadyClock())
    monkeypatch.setattr(compiler.CompileManager, "step_aside_reason", lambda self: None)
    during: list[tuple[str, str | None]] = []  # (side, tick hooks' kind) inside each root call

    class Observed(_Model):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            presence = ae.api._state.presence
            if presence is not None and ae.metrics()["trials_running"]:
                side = "E" if torch._C._len_torch_dispatch_stack() > 0 else "G"
                during.append((side, presence._tick_kind))
            return super().forward(x)

    torch.manual_seed(0)
    model = Observed()
    x = torch.ones(2, 6)
    with torch.no_grad():
        want = model(x).softmax(-1)
        with ae.adaptive_eager(backend=graph_backend.name, hot_after=2, compile_async=False,
                               cache_dir=str(cache_dir), disk_cache=False):
            presence = ae.api._state.presence
            for _ in range(60):
                assert torch.equal(_step(model, x), want)
            assert ae.metrics()["trials"] >= 1, ae.metrics()
            assert not presence.trial or len(during) > 2 * TRIAL_TICKS
            _step(model, x)  # a call after the last switch: the hooks fit the state
            if presence.active:
                assert presence._tick_kind == "global" and _module_hooks(model) == 0
            else:
                assert presence._tick_kind == "roots" and _our_global_hooks() == 0
                assert _module_hooks(model) == 2
    sides = [side for side, _ in during]
    assert sides[:2 * TRIAL_TICKS - 1] == (["E", "G"] * TRIAL_TICKS)[:-1], during
    assert all(kind == ("global" if side == "E" else "roots") for side, kind in during), during
    assert _our_global_hooks() == 0 and _module_hooks(model) == 0


def test_generate_aside_matches_eager_and_leaves_no_global_hook(
        monkeypatch: pytest.MonkeyPatch, cache_dir: Path, graph_backend: Any) -> None:
    """Hugging Face ``generate()`` with a KV cache under the engine, stepped aside: the tokens
    are eager's and, aside, no global module hook slows every module call."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(compiler.CompileManager, "step_aside_reason",
                        lambda self: "pinned by the test")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=16, n_layer=1, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    prompt = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(3))

    def gen() -> list[int]:
        return model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              use_cache=True, pad_token_id=0)[0].tolist()

    with torch.no_grad():
        want = gen()
        with ae.adaptive_eager(backend=graph_backend.name, hot_after=2, compile_async=False,
                               cache_dir=str(cache_dir), disk_cache=False):
            presence = ae.api._state.presence
            got = []
            while len(got) < 10 and not presence.aside:  # measured and decided first
                got.append(gen())
            assert presence.aside, (ae.metrics(), presence.waiting, presence.pending)
            assert _our_global_hooks() == 0
            n0 = ae.metrics()["ops_intercepted"]
            got.append(gen())
            assert ae.metrics()["ops_intercepted"] == n0  # plain eager
    assert all(g == want for g in got), (got, want)
    assert _our_global_hooks() == 0 and _module_hooks(model) == 0


def test_step_hook_stays_between_contexts_and_counts_only_inside(
        monkeypatch: pytest.MonkeyPatch, cache_dir: Path, graph_backend: Any) -> None:
    """The optimizer step hook stays registered between contexts (no registration per context,
    Note [cheap contexts]), but a step taken outside every context counts no round; inside, rounds
    count again; results are eager's."""
    from adaptive_eager.rounds import _StepHook
    from helpers import train_steps

    _always_aside(monkeypatch)

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 1))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)

    x, y = torch.randn(5, 6), torch.randn(5, 1)
    model, opt = fresh()
    ref = train_steps(model, opt, x, y, 50)
    model, opt = fresh()
    options = dict(backend=graph_backend.name, hot_after=2, compile_async=False,
                   cache_dir=str(cache_dir), disk_cache=False, probe_every=1000)
    losses = train_steps(model, opt, x, y, 30, options)
    presence = ae.api._state.standing
    assert presence is not None and presence.aside and not presence.in_context
    ref_to = _StepHook._by_thread.get(presence.thread)
    assert ref_to is not None and ref_to() is presence  # still registered
    before = presence.steps_aside
    losses += train_steps(model, opt, x, y, 10)  # outside any context
    assert presence.steps_aside == before
    losses += train_steps(model, opt, x, y, 10, options)  # the same options: the same presence
    assert ae.api._state.standing is presence and presence.steps_aside == before + 10
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-4, atol=1e-6)


def test_a_finished_thread_leaves_no_engine_behind(cache_dir: Path) -> None:
    """The step hook holds each thread's presence weakly: once a thread that used the engine
    has ended, its engine can be collected."""
    import gc
    import threading
    import weakref

    refs: list[weakref.ref] = []

    def work() -> None:
        with ae.adaptive_eager(backend="replay"):
            (torch.ones(3) * 2).sum().item()
            refs.append(weakref.ref(ae.api._state.engine))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    gc.collect()
    assert refs and refs[0]() is None


def test_varlen_benchmark_median_and_table() -> None:
    """benchmarks/varlen.py: the median is statistics.median (the mean of the two middle values
    for an even count), and each generation row says how many timed runs were plain eager and
    why, next to wall and CPU time ratios (paired where measured so)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks import varlen

    assert varlen._median([4.0, 1.0, 3.0, 2.0]) == 2.5
    rows = {"eager": {"gpt2/no_grad": {"ms_per_token": 1.0, "cpu_ms_per_token": 1.0}},
            "engine": {"gpt2/no_grad": {"ms_per_token": 1.25, "cpu_ms_per_token": 1.05,
                                        "aside": "3/3", "state": "aside", "hit_rate": None,
                                        "compiles": 0}},
            "engine_paired": {"gpt2/no_grad": {"ms_per_token": 1.0, "cpu_ms_per_token": 1.0,
                                               "eager_ms_per_token": 1.0, "paired_ratio": 1.02,
                                               "cpu_paired_ratio": 1.01, "aside": "3/3",
                                               "state": "waiting on compiles"}}}
    table = varlen._table({"generate": rows})
    assert "| gpt2/no_grad | engine | 1.25 | 0.80x | 1.25 | 1.05 | 3/3 (aside) | - | 0 |" in table
    assert "1.02 (paired) | 1.01 (paired) | 3/3 (waiting on compiles)" in table


def test_checkpoints_written_aside_hold_nothing_of_the_engine(
        monkeypatch: pytest.MonkeyPatch, cache_dir: Path, graph_backend: Any) -> None:
    """Aside, the root carries the engine's tick hooks (Note [root ticks]); what a program
    saves leaves them out: ``torch.save`` of the module loads under ``weights_only`` with only
    the model's own classes allowed, and pickles and deep copies carry nothing of the engine."""
    import copy
    import io
    import pickle

    _always_aside(monkeypatch)
    torch.manual_seed(0)
    model = _Model()
    with torch.no_grad(), ae.adaptive_eager(backend=graph_backend.name, hot_after=2,
                                            compile_async=False, cache_dir=str(cache_dir),
                                            disk_cache=False, probe_every=1000):
        _decode(model, 40)
        assert _module_hooks(model) == 2  # the premise: aside, ticks on the root
        buf = io.BytesIO()
        torch.save(model, buf)
        data = pickle.dumps(model)
        twin = copy.deepcopy(model)
        assert _module_hooks(model) == 2  # the live module keeps them
    assert b"adaptive_eager" not in buf.getvalue() and b"adaptive_eager" not in data
    assert _module_hooks(twin) == 0
    buf.seek(0)
    with torch.serialization.safe_globals([_Model, *{type(m) for m in model.modules()}]):
        loaded = torch.load(buf, weights_only=True)
    with torch.no_grad():
        torch.testing.assert_close(_decode(loaded, 3), _decode(model, 3))
