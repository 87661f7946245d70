"""Process hygiene: the engine never leaves global state changed, never breaks the process, and
nothing of it reaches what a program saves or inspects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same
from helpers import assert_state_as_eager

import adaptive_eager as ae

_ROOT = Path(__file__).resolve().parents[1]


def _env(cache_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTIVE_EAGER")}
    env.update({"ADAPTIVE_EAGER_CACHE_DIR": str(cache_dir), "ADAPTIVE_EAGER_BACKEND": "replay",
                "ADAPTIVE_EAGER_BUDGET": "0"})  # records from the first op (conftest.py)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


# ---- the flag with the package imported before torch ---------------------------------------

_IMPORT_FIRST = """
import adaptive_eager, torch
x = torch.arange(6.0)
print(adaptive_eager.is_enabled(), ((x * 2 + 1).sin()).tolist() == (torch.arange(6.0) * 2 + 1).sin().tolist())
"""


@pytest.mark.parametrize("args", [["-c", _IMPORT_FIRST], ["-m", "adaptive_eager", "cache", "ls"],
                                  ["-m", "adaptive_eager.cli", "report", "--last"]])
def test_flag_with_the_package_imported_before_torch(args: list[str], cache_dir: Path,
                                                     tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, *args], env=_env(cache_dir, ADAPTIVE_EAGER="1"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if args[0] == "-c":
        assert proc.stdout.split() == ["True", "True"]  # the engine is on, results are eager's


def test_bad_setting_with_the_package_imported_first_names_it(cache_dir: Path,
                                                              tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", "import adaptive_eager"],
                          env=_env(cache_dir, ADAPTIVE_EAGER="1", ADAPTIVE_EAGER_HOT_AFTER="soon"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "ADAPTIVE_EAGER_HOT_AFTER" in proc.stderr, proc.stderr


# ---- the mode stack changed inside torch.inference_mode() ------------------------------------

def _presence() -> Any:
    from adaptive_eager import api

    return api._state.presence


def _aside_and_back_inside_inference_mode(model: torch.nn.Module, x: torch.Tensor) -> list:
    """Module calls under inference mode; under the engine it steps aside inside one block and
    comes back (a probe, ``probe_every=2``) inside the next, as in generate() while a compile
    runs. Between the blocks and after them plain torch calls must work, in and out of it."""
    outs = []
    presence = _presence()
    with torch.inference_mode():
        outs.append(model(x))
        if presence is not None:
            presence.request_aside("asked for by the test")
        outs.append(model(x))  # the step-aside hook acts at this call's end
        if presence is not None:
            assert presence.aside and not presence.active
    outs.append(torch.tensor(1) * 2)
    with torch.inference_mode():
        outs.append(torch.tensor([3.0]) + 1)
        outs.append(model(x))
        outs.append(model(x))  # the second round aside: the probe pushes the modes here
        if presence is not None:
            assert presence.active
    before = ae.metrics()["ops_intercepted"]
    outs.append(model(x) * 2)  # out of the block the engine sees the ops again
    if presence is not None:
        assert ae.metrics()["ops_intercepted"] > before
    with torch.inference_mode():
        outs.append(torch.tensor(1) + model(x))
    return [o.detach().clone() for o in outs]


def test_mode_stack_changes_inside_inference_mode(cache_dir: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    x = torch.randn(3, 4)
    opts = dict(backend="replay", cache_dir=str(cache_dir), probe_every=2)
    want = _aside_and_back_inside_inference_mode(model, x)
    with ae.adaptive_eager(**opts):
        got = _aside_and_back_inside_inference_mode(model, x)
    for a, b in zip(want, got, strict=True):
        assert_same(a, b)
    with torch.inference_mode():
        torch.tensor(1)  # the process is not broken
    assert ae.metrics()["key_repairs"] >= 2
    assert_state_as_eager(lambda: _aside_and_back_inside_inference_mode(model, x), **opts)


# ---- traces never span an inference-mode boundary (Note [inference-mode boundaries]) --------

def _kv_cache_loop(steps: int) -> list:
    """KV caches made outside inference mode (as registered buffers are), written in place and
    read through views inside it; a fresh cache per call, as ``generate()`` makes, so views of
    pending lazy caches get recorded. Each step repeats the last."""
    inf = torch.ones(3, 4)
    with torch.inference_mode():
        inf = inf * 1  # an inference tensor
    outs = []
    for i in range(steps):
        cache = torch.zeros(2, 8, 4)
        with torch.inference_mode():
            cache.index_copy_(1, torch.tensor([1]), torch.full((2, 1, 4), float(i + 1)))
            cache.add_(0.5)
            k = cache[:, :3]
            first, second = cache.unbind(0)
            part = cache.split(4, dim=1)[1].transpose(0, 1)
            v = inf[1:]
            y = (k.sum(1) + first[:2] * second[:2] + part.sum()) * v[:1]
            outs.append([y.clone(), k.clone(), part.clone(),
                         torch.tensor([k.is_inference(), first.is_inference(),
                                       part.is_inference(), v.is_inference(),
                                       y.is_inference()]),
                         torch.tensor([cache._version, k._version])])
        outs.append([cache[:, :2].clone(), torch.tensor([cache[:, :2].is_inference(),
                                                         cache.is_inference(), y.is_inference()])])
    return outs


def _buffer_across_the_boundary(steps: int) -> list:
    """A value made lazily before an inference-mode block, read inside it, then saved for
    backward after it (eager: a normal tensor); and one made inside, used after (an inference
    tensor: in-place outside the block is refused in eager too)."""
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    outs = []
    for _ in range(steps):
        buf = torch.ones(3) * 2 + w.detach()
        with torch.inference_mode():
            seen = buf * 3
        loss = (w * buf).sum() + (w * w).sum()
        loss.backward()
        outs.append([seen.clone(), loss.detach(), w.grad.clone(),
                     torch.tensor([buf.is_inference(), seen.is_inference()])])
        w.grad = None
    return outs


@pytest.mark.parametrize("accel", [True, False])
def test_views_of_normal_tensors_under_inference_mode(accel: bool, cache_dir: Path) -> None:
    """The repro: ``cache.add_(1); cache[:, :3]`` inside ``inference_mode``, cache made before."""
    want = _kv_cache_loop(4)
    with ae.adaptive_eager(backend="replay", step_aside=False, accel=accel, check=True,
                           cache_dir=str(cache_dir)):
        got = _kv_cache_loop(4)
    assert ae.metrics()["trace_hits"] > 0
    for a, b in zip(want, got, strict=True):
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)


def test_values_keep_the_inference_kind_of_their_side(cache_dir: Path) -> None:
    want = _buffer_across_the_boundary(4)
    with ae.adaptive_eager(backend="replay", step_aside=False, check=True,
                           cache_dir=str(cache_dir)):
        got = _buffer_across_the_boundary(4)
    assert ae.metrics()["flush_reasons"].get("inference_mode", 0) >= 4
    for a, b in zip(want, got, strict=True):
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)


def test_views_of_normal_tensors_under_inference_mode_fused(cache_dir: Path) -> None:
    want = _kv_cache_loop(6)
    with ae.adaptive_eager(backend="inductor", hot_after=2, compile_async=False,
                           step_aside=False, cache_dir=str(cache_dir)):
        got = _kv_cache_loop(6)
    assert ae.metrics()["compiled_runs"] > 0
    for a, b in zip(want, got, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


# ---- the read guard is off the torch-function stack in the user's code ----------------------

def _reads_after_writes(x: torch.Tensor) -> list:
    """Reads of a tensor with a pending in-place write, each a flush inside the read guard's
    handler; the function-mode stack's length is noted after each (eager: 0)."""
    depth = torch._C._len_torch_function_stack
    seen: list[Any] = []
    x.add_(1)
    seen += [x.tolist(), depth()]
    x.mul_(3)
    seen += [str(x), depth()]
    x.sub_(1)
    torch.testing.assert_close(x, x.clone())
    seen.append(depth())
    x.div_(5)
    seen += [float(x.sum()), depth()]
    return seen


def test_read_guard_leaves_the_stack_after_a_read(cache_dir: Path) -> None:
    x = torch.ones(4)
    want = [_reads_after_writes(x) for _ in range(4)]
    x = torch.ones(4)
    with ae.adaptive_eager(backend="replay", step_aside=False, cache_dir=str(cache_dir)):
        got = [_reads_after_writes(x) for _ in range(4)]
    assert got == want
    assert ae.metrics()["guard_arms"] == 0  # Note [reads of pending writes]


def _ends_with_a_pending_write() -> dict:
    """Test bodies that end with an in-place write pending and no read of its value after it
    (PyTorch's test_autograd in-place tests): each leaves the write to the engine's next flush."""
    def requires_grad_inplace(t: Any) -> None:
        a = torch.randn(5, 5) + 0
        b = torch.randn(5, 5, requires_grad=True)
        a += b
        t.assertTrue(a.requires_grad)

    def inplace_on_view(t: Any) -> None:
        base = torch.zeros(4, 4)
        v = base[1:3]
        v.mul_(2).add_(1)
        t.assertTrue(v.shape == (2, 4))

    def buffer_update(t: Any) -> None:
        bn = torch.nn.BatchNorm1d(3)
        bn(torch.randn(8, 3))  # running stats: in-place writes to real buffers
        t.assertTrue(bn.training)

    def optimizer_step_then_hook(t: Any) -> None:
        w = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([w], lr=0.1)
        (w * 2).sum().backward()
        opt.step()
        w.grad.add_(1)  # a pending write to .grad after the step's flush
        t.assertIsNotNone(w.grad)

    def grad_accumulation(t: Any) -> None:
        w = torch.ones(3, requires_grad=True)
        for _ in range(2):
            (w * 3).sum().backward()
        t.assertTrue(w.grad.dtype == torch.float32)

    return {f.__name__: f for f in (requires_grad_inplace, inplace_on_view, buffer_update,
                                    optimizer_step_then_hook, grad_accumulation)}


@pytest.mark.parametrize("body", sorted(_ends_with_a_pending_write()))
def test_a_test_ending_with_a_pending_write_leaks_no_mode(body: str, cache_dir: Path) -> None:
    import unittest

    from torch.testing._internal.common_utils import TestCase

    fn = _ends_with_a_pending_write()[body]

    class T(TestCase):
        def test_x(self) -> None:
            for _ in range(5):  # recorded once each op was seen (the first sights run)
                fn(self)

    result = unittest.TestResult()
    with ae.adaptive_eager(backend="replay", step_aside=False, cache_dir=str(cache_dir)):
        T("test_x").run(result)
        pending = len(ae.api._state.engine.trace.ops)
    assert not result.errors and not result.failures, result.errors + result.failures
    assert torch._C._len_torch_function_stack() == 0
    assert pending > 0  # the write was still pending when tearDown looked at the stack


def test_torch_testcase_sees_no_leaked_mode(cache_dir: Path) -> None:
    """torch's TestCase.tearDown compares the function-mode stack's length with setUp's."""
    import unittest

    from torch.testing._internal.common_utils import TestCase

    x = torch.ones(4)

    class T(TestCase):
        def test_x(self) -> None:
            x.add_(1)
            self.assertEqual(x, torch.full((4,), 2.0))

    result = unittest.TestResult()
    with ae.adaptive_eager(backend="replay", step_aside=False, cache_dir=str(cache_dir)):
        T("test_x").run(result)
    assert not result.errors and not result.failures, result.errors + result.failures
    x = torch.ones(4)
    assert_state_as_eager(lambda: [_reads_after_writes(x) for _ in range(3)], backend="replay",
                          step_aside=False, cache_dir=str(cache_dir))
