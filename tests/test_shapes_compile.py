"""Dynamic-size programs for symbolic traces (Note [symbolic programs] in
adaptive_eager/symbolic_plan.py): a hot template trace compiles once into one Inductor program that
serves every value of s; the first fused run at each new size is checked against op-by-op
replay until SYM_CHECKED_SIZES sizes agreed, then a new size runs the program directly if the
program's shape guards hold at it, and op by op if not (Note [trusting a size] in compile/sizes.py).
The program is loaded from the disk cache by a later process.

Eager runs first on the same inputs; fused results are compared within the tolerance the
crosscheck uses (adaptive_eager.fused._TOL), op-by-op ones bitwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.compile import policy
from adaptive_eager.compiler import SYM_CHECKED_SIZES

LEARN = [5, 7, 9, 11, 13, 6, 8, 10]  # enough sizes for a template, then hot
NEW = [20, 33, 17, 20, 33, 17, 40, 40, 20, 33, 17, 27, 45]  # never seen while learning
RTOL, ATOL = 1.3e-4, 1e-4  # fused float32 tolerance (fused._TOL)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.LayerNorm(16)


def _block(ln: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """LayerNorm, a view whose sizes come from x.shape, softmax over T, a sum."""
    B, T, C = x.shape
    h = ln(x).view(B, T, 2, 8)
    return h.softmax(1).sum(-1) * 2.0


def _inputs(sizes: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, T, 16, generator=g) for T in sizes]


def _keys(m: dict) -> dict:
    return {k: m[k] for k in ("compiles", "compiled_runs", "sym_programs", "sym_checked",
                              "sym_program_fallbacks", "compile_errors", "fused_errors",
                              "sym_trusted", "sym_guard_refused", "sym_guards_unknown",
                              "sym_hits")}


def test_one_program_serves_every_size(monkeypatch: pytest.MonkeyPatch, cache_dir) -> None:
    # kept fused whatever its timing on a loaded machine: this test is about which sizes run it
    monkeypatch.setattr(policy, "KEEP_RATIO", float("inf"))
    ln = _model()
    xs = _inputs(LEARN + NEW + [1])
    with torch.no_grad():
        want = [_block(ln, x) for x in xs]
    steps = []
    with ae.adaptive_eager(compile_async=False, hot_after=2, symbolic_programs=True,
                           step_aside=False), torch.no_grad():  # every run under the engine
        for x in xs:
            y = _block(ln, x)
            ae.sync()
            steps.append((y, _keys(ae.metrics())))
    after_learn = steps[len(LEARN) - 1][1]
    assert after_learn["sym_programs"] == 1 and after_learn["compiles"] == 1, [
        m for _, m in steps]
    final = steps[-1][1]
    assert final["compiles"] == 1 and final["sym_programs"] == 1  # one program, every size
    assert final["compile_errors"] == 0 and final["fused_errors"] == 0
    assert final["sym_program_fallbacks"] == 0 and final["sym_guards_unknown"] == 0
    assert final["sym_guard_refused"] == 0  # (a size failing a guard: test_symbolic_guards)
    unchecked = 0  # fused runs of the program itself at a size checked before
    trusted = 0  # fused runs at a new size once SYM_CHECKED_SIZES sizes agreed
    agreed = [xs[i].shape[1] for i in range(1, len(LEARN))  # sizes checked while learning
              if steps[i][1]["sym_checked"] > steps[i - 1][1]["sym_checked"]]
    prev = after_learn
    for i in range(len(LEARN), len(xs)):
        (y, m), T = steps[i], xs[i].shape[1]
        if T == 1:  # s in {0, 1} never reaches a template: op by op, eager's bits
            assert m["compiled_runs"] == prev["compiled_runs"]
            assert torch.equal(y, want[i])
        elif T in agreed:  # a checked size: the program's result (or a paired op-by-op run)
            assert m["sym_checked"] == prev["sym_checked"]
            unchecked += m["compiled_runs"] - prev["compiled_runs"]
            torch.testing.assert_close(y, want[i], rtol=RTOL, atol=ATOL)
        elif len(agreed) < SYM_CHECKED_SIZES:
            # before enough sizes agreed: checked (replay's values returned) or op by op (a
            # size's first run), never the program unchecked
            assert torch.equal(y, want[i])
            assert m["sym_trusted"] == prev["sym_trusted"]
            if m["sym_checked"] > prev["sym_checked"]:
                agreed.append(T)
        else:  # enough agreed and the guards hold: a new size runs the program unchecked,
            # also beyond the largest agreed size (no range rule any more)
            assert m["sym_checked"] == prev["sym_checked"]  # (or a paired op-by-op run)
            trusted += m["compiled_runs"] - prev["compiled_runs"]
            torch.testing.assert_close(y, want[i], rtol=RTOL, atol=ATOL)
        prev = m
    assert unchecked >= 2 and trusted >= 2 and final["sym_trusted"] >= 2, steps[-1]
    # every run through the template counts, fused ones too (they were not counted)
    assert final["sym_hits"] - after_learn["sym_hits"] >= (final["compiled_runs"]
                                                           - after_learn["compiled_runs"])
    assert 40 not in agreed and 45 not in agreed and len(agreed) == SYM_CHECKED_SIZES, agreed
    from adaptive_eager.api import write_run_log
    from adaptive_eager.report import build_report, format_report

    write_run_log(ae.api.resolve_options({}))  # the report reads the run log
    text = format_report(build_report(cache_dir, last=True))
    assert (f"symbolic programs: {final['sym_checked']} sizes checked, 0 from disk, "
            f"{final['sym_trusted']} run unchecked by their guards, 0 refused") in text, text


def test_option_off_runs_op_by_op() -> None:
    ln = _model()
    xs = _inputs(LEARN + [20, 20])
    with torch.no_grad():
        want = [_block(ln, x) for x in xs]
    with ae.adaptive_eager(compile_async=False, hot_after=2, symbolic_programs=False), \
            torch.no_grad():
        got = []
        for x in xs:
            got.append(_block(ln, x))
            ae.sync()
        m = ae.metrics()
    assert m["compiles"] == 0 and m["compiled_runs"] == 0
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_lifted_scalar_and_input_mutation() -> None:
    """A varying Python number (lifted: aten.item inside the graph) and an in-place update of a
    static input, next to symbolic sizes: one program; the update matches eager's."""
    ln = _model()
    w = torch.randn(16, generator=torch.Generator().manual_seed(2))
    w0 = w.clone()

    def fn(x: torch.Tensor, lr: float) -> torch.Tensor:
        y = _block(ln, x)
        w.add_(x.sum((0, 1)), alpha=-lr)
        return y

    xs = _inputs(LEARN + [20, 20, 33, 33, 20, 33])
    with torch.no_grad():
        want = [fn(x, 0.1 * (i + 1)) for i, x in enumerate(xs)]
    w_want = w.clone()
    w.copy_(w0)
    with ae.adaptive_eager(compile_async=False, hot_after=2, symbolic_programs=True), torch.no_grad():
        got = []
        for i, x in enumerate(xs):
            got.append(fn(x, 0.1 * (i + 1)))
            ae.sync()
        m = _keys(ae.metrics())
    assert m["compiles"] == 1 and m["sym_programs"] == 1 and m["compile_errors"] == 0, m
    assert m["sym_checked"] >= 2 and m["compiled_runs"] > m["sym_checked"], m
    assert m["sym_program_fallbacks"] == 0 and m["fused_errors"] == 0, m
    torch.testing.assert_close(w, w_want, rtol=RTOL, atol=ATOL)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL)


def _loss(ln: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """GPT-2's loss shape: labels padded by one (ignore_index) and shifted, cross entropy."""
    logits = ln(x)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    return torch.nn.functional.cross_entropy(logits.view(-1, 16), shifted.view(-1),
                                             ignore_index=-100)


def _run_loss(ln: torch.nn.Module, data: list) -> tuple[list[torch.Tensor], dict]:
    with ae.adaptive_eager(compile_async=False, hot_after=2, symbolic_programs=True), \
            torch.no_grad():
        got = []
        for x, lab in data:
            got.append(_loss(ln, x, lab))
            ae.sync()
        m = ae.metrics()
    return got, {**_keys(m), "disk_hits": m["disk_hits"], "sym_loaded": m["sym_loaded"],
                 "sym_sizes_loaded": m["sym_sizes_loaded"]}


def test_padded_labels_stay_dynamic_and_load_from_disk() -> None:
    """constant_pad_nd's fake kernel reads sizes as ints (Note [specializing kernels] in
    backends/inductor.py): the program must still be dynamic and serve every size. Then, with
    every in-memory cache dropped (as a new process starts), the template and the program
    come from the disk cache: nothing compiles, and the sizes checked before come with the
    program (Note [verified sizes]), so sizes never seen run fused with no new check."""
    ln = _model()
    g = torch.Generator().manual_seed(3)
    sizes = LEARN + [12, 14, 15] + [20, 33, 20, 33, 17]  # two traces per size to learn
    later = [26, 41, 26, 41, 19, 19]
    data = [(torch.randn(2, T, 16, generator=g), torch.randint(0, 16, (2, T), generator=g))
            for T in sizes + later]
    with torch.no_grad():
        want = [_loss(ln, x, lab) for x, lab in data]
    got, m = _run_loss(ln, data[:len(sizes)])
    assert m["compiles"] == 1 and m["sym_programs"] == 1 and m["compile_errors"] == 0, m
    assert m["compiled_runs"] > m["sym_checked"] >= 2, m
    assert m["sym_program_fallbacks"] == 0 and m["fused_errors"] == 0, m
    ae.clear_caches()
    ae.reset_metrics()
    got2, m = _run_loss(ln, data[len(sizes):])
    assert m["sym_loaded"] >= 1 and m["compiles"] == 0 and m["disk_hits"] >= 1, m
    assert m["compiled_runs"] >= 4 and m["sym_checked"] == 0, m
    assert m["sym_sizes_loaded"] >= SYM_CHECKED_SIZES and m["sym_trusted"] >= 2, m
    assert m["sym_program_fallbacks"] == 0 and m["fused_errors"] == 0, m
    for a, e in zip(got + got2, want):
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL)


_CHILD = textwrap.dedent("""
    import json, sys, torch
    import adaptive_eager as ae
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(16)

    def block(x):
        B, T, C = x.shape
        return ln(x).view(B, T, 2, 8).softmax(1).sum(-1) * 2.0

    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, int(t), 16, generator=g) for t in sys.argv[1:]]
    with torch.no_grad():
        want = [block(x) for x in xs]
        with ae.adaptive_eager(compile_async=False, hot_after=2, symbolic_programs=True):
            got = []
            for x in xs:
                got.append(block(x))
                ae.sync()
            m = ae.metrics()
    close = all(torch.allclose(a, b, rtol=%r, atol=%r) for a, b in zip(got, want))
    print(json.dumps({k: m[k] for k in ("compiles", "sym_programs", "disk_hits", "compiled_runs",
                                        "sym_checked", "sym_loaded", "compile_errors",
                                        "fused_errors", "sym_program_fallbacks",
                                        "sym_sizes_loaded", "sym_trusted")}
                     | {"close": close}))
""" % (RTOL, ATOL))


@pytest.mark.slow  # two processes and a compile: about 90 s on the shared machine
def test_symbolic_program_loads_from_disk_in_a_later_process(cache_dir) -> None:
    """A warm process finds the template, its dynamic-size program and the sizes the first
    process checked on disk: it compiles nothing, checks nothing again, and runs fused at sizes
    the first process never saw."""
    env = dict(os.environ, ADAPTIVE_EAGER_CACHE_DIR=str(cache_dir))

    def child(*sizes: int) -> dict:
        res = subprocess.run([sys.executable, "-c", _CHILD, *map(str, sizes)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    first = child(*LEARN, 20, 33, 20)
    assert first["compiles"] == 1 and first["sym_programs"] == 1, first
    second = child(17, 40, 17, 40, 26, 26)
    assert second["sym_loaded"] >= 1 and second["compiles"] == 0, second
    assert second["disk_hits"] >= 1 and second["compiled_runs"] >= 4, second
    assert first["sym_checked"] >= SYM_CHECKED_SIZES, first
    assert second["sym_checked"] == 0 and second["sym_program_fallbacks"] == 0, second
    assert second["sym_sizes_loaded"] >= SYM_CHECKED_SIZES and second["sym_trusted"] >= 2, second
    assert second["compile_errors"] == 0 and second["fused_errors"] == 0, second
    assert first["close"] and second["close"], (first, second)


def test_input_whose_stride_follows_s_in_a_size_one_dim() -> None:
    """generate's ``attention_mask[:, -1:]``: sizes [1, 1], stride (T + 1, 1). A size-1 dim's
    stride moves no address, so the input is static and the trace still compiles once."""
    ln = _model()
    g = torch.Generator().manual_seed(4)
    sizes = LEARN + [12, 14, 15] + [20, 33, 20, 33]
    data = []
    for T in sizes:
        mask = torch.randn(1, T + 1, generator=g)
        data.append((torch.randn(2, T, 16, generator=g), mask[:, -1:]))

    def fn(x: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return _block(ln, x) * last.unsqueeze(-1)

    with torch.no_grad():
        want = [fn(x, m) for x, m in data]
    with ae.adaptive_eager(compile_async=False, hot_after=2), torch.no_grad():
        got = []
        for x, m in data:
            got.append(fn(x, m))
            ae.sync()
        m = _keys(ae.metrics())
    assert m["compiles"] == 1 and m["sym_programs"] == 1 and m["compile_errors"] == 0, m
    assert m["compiled_runs"] >= 3 and m["fused_errors"] == 0, m
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL)
