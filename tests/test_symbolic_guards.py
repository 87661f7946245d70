"""A dynamic-size program's shape guards (Note [program shape guards] in
adaptive_eager/backends/inductor.py) and the rule that uses them (Note [trusting a size], Note
[verified sizes] in adaptive_eager/compile/sizes.py): the guards Inductor recorded are kept with the
artifact as data, decoded and evaluated without sympy or eval, survive the disk cache, refuse a
size that violates them (op by op, eager's bits), and, when unreadable, fall back to checking
every new size. Checked sizes are stored with the program, so a later process checks none again.

One compile for the module (``compiled``): each test copies its cache folder into its own and
loads the program from there, as a later process would.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import sympy
import torch
from torch.utils._sympy import functions as F

import adaptive_eager as ae
from adaptive_eager.backends.inductor import (_GUARDS_TAG, _enc_expr, _Unknown, pack_guards,
                                              unpack_guards)
from adaptive_eager.cache import kernel_refs
from adaptive_eager.compile import policy
from adaptive_eager.compiler import SYM_CHECKED_SIZES, ShapeGuards

LEARN = [5, 7, 9, 11, 13, 6, 8, 10, 20, 33, 17]  # a template, hot, and 3 sizes checked
# Which guards a compile records depends on its code generation (Inductor's CPU sum kernel adds
# s <= 4096 only where it considered its chunked accumulator), so the refusal tests add a bound
# of their own to the stored set, as a compile that assumed it would have stored it
BOUND = 40
RTOL, ATOL = 1.3e-4, 1e-4  # fused float32 tolerance (fused._TOL)
KEYS = ("compiles", "compiled_runs", "disk_hits", "sym_checked", "sym_trusted",
        "sym_guard_refused", "sym_guards_unknown", "sym_sizes_loaded", "sym_program_fallbacks",
        "fused_errors", "compile_errors", "disk_errors")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.LayerNorm(16)


def _block(ln: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    B, T, C = x.shape
    return ln(x).view(B, T, 2, 8).softmax(1).sum(-1) * 2.0


def _inputs(sizes: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, T, 16, generator=g) for T in sizes]


def _run(ln: torch.nn.Module, xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[dict]]:
    """Each input under the engine (kept on: every run goes through it), metrics per step."""
    got, steps = [], []
    with ae.adaptive_eager(compile_async=False, hot_after=2, symbolic_programs=True,
                           step_aside=False), torch.no_grad():
        for x in xs:
            got.append(_block(ln, x))
            ae.sync()
            m = ae.metrics()
            steps.append({k: m[k] for k in KEYS})
    return got, steps


def _program_entries(folder: Path) -> list[tuple[str, dict]]:
    from adaptive_eager.cache.disk import DiskCache

    disk = DiskCache.open(folder, 1 << 30)
    assert disk is not None
    try:
        out = []
        for name in disk.keys():
            if name.startswith("program:"):
                key = name[len("program:"):]
                out.append((key, disk.get_program(key, torch.__version__)))
        return out
    finally:
        disk.close()


@pytest.fixture(autouse=True)
def _keep_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether the program is kept after its timing is not what these tests check: on a loaded
    machine a measured "op by op" would route every later size past the program."""
    monkeypatch.setattr(policy, "KEEP_RATIO", float("inf"))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache folder holding the template, its one dynamic-size program and 3 checked sizes."""
    folder = tmp_path_factory.mktemp("guards") / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(policy, "KEEP_RATIO", float("inf"))  # as _keep_fused
        mp.setenv("ADAPTIVE_EAGER_CACHE_DIR", str(folder))
        mp.setenv("ADAPTIVE_EAGER_COMPILE_SERVICE", "0")
        ae.disable()
        ae.clear_caches()
        ae.reset_metrics()
        ln = _model()
        xs = _inputs(LEARN, 1)
        with torch.no_grad():
            want = [_block(ln, x) for x in xs]
        got, steps = _run(ln, xs)
        ae.disable()
        ae.clear_caches()  # closes the disk cache: the folder is complete on disk
        ae.reset_metrics()
    m = steps[-1]
    assert m["compiles"] == 1 and m["compile_errors"] == 0, steps
    assert m["sym_checked"] == SYM_CHECKED_SIZES and m["sym_guards_unknown"] == 0, steps
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL)
    yield folder


def _copy(compiled: Path, cache_dir: Path) -> None:
    shutil.copytree(compiled, cache_dir)


def test_stored_guards_are_data(compiled: Path) -> None:
    """The artifact on disk carries the guard block, which decodes with nothing unknown and
    holds at the sizes the program serves, not at s=1."""
    entries = _program_entries(compiled)
    assert len(entries) == 1
    data = entries[0][1]["artifact"]
    from adaptive_eager.backends.inductor import _build_key

    key = _build_key()
    assert data.startswith(key) and data[len(key):].startswith(_GUARDS_TAG)
    guards, rest = unpack_guards(memoryview(data)[len(key):])
    assert guards is not None and "unknown" not in guards, guards
    sg = ShapeGuards.decode(guards)
    assert sg.locs == [("size", 0, 1), ("stride", 0, 0)], sg.locs  # s: dim 1 of input 0,
    # whose contiguous stride 16*s the program assumes too
    x = torch.empty(2, 21, 16)
    assert sg.holds([x]) and sg.holds([torch.empty(2, 33, 16)])
    assert not sg.holds([torch.empty(2, 1, 16)])  # the 0/1 specialization: s >= 2
    kernels, rest = kernel_refs.unpack(rest)  # then the kernels it uses (Note [program entries])
    assert len(kernels) >= 2, kernels  # its wrapper and its C++ kernel
    assert bytes(rest[:1]) == b"\x80"  # torch's pickle follows


def test_guard_refuses_a_size_and_checked_sizes_come_from_disk(compiled: Path,
                                                              cache_dir: Path) -> None:
    """A fresh engine over the same folder, the stored guards bounded by s <= BOUND: the
    program loads (no compile), the 3 sizes checked before are loaded with it (no new check),
    new sizes within the guards run the program unchecked (also beyond every size checked:
    no range rule), and sizes past BOUND run op by op: eager's bits, counted once each."""
    _copy(compiled, cache_dir)
    _bound_guards(cache_dir, BOUND)
    ln = _model()
    sizes = [50, 21, 64, 37, 21, 50]  # the refused ones early: before paired timing
    # (Note [paired timing]) routes every other run of the loaded program op by op
    xs = _inputs(sizes, 2)
    with torch.no_grad():
        want = [_block(ln, x) for x in xs]
    got, steps = _run(ln, xs)
    m = steps[-1]
    assert m["compiles"] == 0 and m["disk_hits"] >= 1 and m["disk_errors"] == 0, steps
    assert m["sym_sizes_loaded"] == SYM_CHECKED_SIZES and m["sym_checked"] == 0, steps
    assert m["sym_guard_refused"] == 2 and m["sym_guards_unknown"] == 0, steps
    assert m["sym_trusted"] >= 2 and m["sym_program_fallbacks"] == 0, steps
    assert m["fused_errors"] == 0, steps
    prev = {k: 0 for k in KEYS}
    for T, y, e, step in zip(sizes, got, want, steps):
        if T > BOUND:
            assert step["compiled_runs"] == prev["compiled_runs"], (T, steps)
            assert torch.equal(y, e)
        else:
            torch.testing.assert_close(y, e, rtol=RTOL, atol=ATOL)
        prev = step
    assert steps[1]["compiled_runs"] == 1 and steps[1]["sym_trusted"] == 1, steps  # s=21


def _bound_guards(folder: Path, bound: int) -> None:
    """Add ``s <= bound`` to the stored program's own guards."""
    from adaptive_eager.backends.inductor import _build_key

    (_, value), = _program_entries(folder)
    guards, _ = unpack_guards(memoryview(value["artifact"])[len(_build_key()):])
    assert guards is not None and guards["syms"][0] == ["size", 0, 1], guards
    guards["guards"].append(["<=", ["v", 0], bound])
    _rewrite_guards(folder, pack_guards(guards))


def _rewrite_guards(folder: Path, block: bytes) -> None:
    """Replace the stored program's guard block (written through the cache, so its HMAC is
    valid: what a newer engine's or a damaged writer's entry would look like)."""
    from adaptive_eager.backends.inductor import _build_key
    from adaptive_eager.cache.disk import DiskCache

    (key, value), = _program_entries(folder)
    data = value["artifact"]
    head = len(_build_key())
    _, rest = unpack_guards(memoryview(data)[head:])
    disk = DiskCache.open(folder, 1 << 30)
    assert disk is not None
    try:
        disk.put_program(key, torch.__version__, value["backend"],
                         data[:head] + block + bytes(rest), value["info"])
    finally:
        disk.close()


_BAD_BLOCKS = {
    "unknown node": pack_guards({"v": 1, "syms": [["size", 0, 1]],
                                 "guards": [["<=", ["v", 0], ["bessel", 4096]]]}),
    "unknown from the compile": pack_guards({"v": 1, "unknown": "Piecewise in a shape guard"}),
    "not json": _GUARDS_TAG + (9).to_bytes(4, "big") + b"{not json",
    "bad symbol": pack_guards({"v": 1, "syms": [["size", 7, 1]],
                               "guards": [["<=", ["v", 0], 4096]]}),
}


@pytest.mark.parametrize("kind", sorted(_BAD_BLOCKS))
def test_unreadable_guards_fall_back_to_checking(compiled: Path, cache_dir: Path,
                                                 kind: str) -> None:
    """Guards the engine cannot read or evaluate trust no size: each new size is checked
    against op-by-op replay (replay's values returned: eager's bits), counted in
    ``sym_guards_unknown``; sizes checked before still run fused, and the load never fails."""
    _copy(compiled, cache_dir)
    _rewrite_guards(cache_dir, _BAD_BLOCKS[kind])
    ln = _model()
    sizes = [21, 50, 21, 33]  # 33 was checked by the first process
    xs = _inputs(sizes, 3)
    with torch.no_grad():
        want = [_block(ln, x) for x in xs]
    got, steps = _run(ln, xs)
    m = steps[-1]
    assert m["compiles"] == 0 and m["disk_hits"] >= 1, steps
    assert m["sym_guards_unknown"] >= 1 and m["sym_trusted"] == 0, steps
    assert m["sym_guard_refused"] == 0 and m["fused_errors"] == 0, steps
    assert steps[0]["sym_checked"] == 1 and steps[1]["sym_checked"] == 2, steps  # 21, 50
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for y, e in zip(got[2:], want[2:]):
        torch.testing.assert_close(y, e, rtol=RTOL, atol=ATOL)


# ---- the data and its interpreter, no compile --------------------------------------------------
def test_interpreter_matches_sympy_on_torch_expressions() -> None:
    """Expressions of the kinds ShapeEnv guards hold, encoded as data and evaluated by
    ShapeGuards, agree with sympy's own evaluation at many sizes."""
    a, b = sympy.symbols("s0 s1", integer=True, positive=True)
    exprs = [
        sympy.Eq(a, b), sympy.Ne(a, 1), a <= 4096, sympy.Lt(2 * a + 3, b * b),
        sympy.Ge(F.FloorDiv(a, 3), 2), sympy.Eq(F.Mod(a, 4), 0), sympy.Eq(F.PythonMod(b, 5), 1),
        sympy.Le(F.Min(a, b), 7), sympy.Gt(F.Max(a, 9), b), sympy.Eq(F.CeilDiv(a, 4), 3),
        sympy.Eq(F.ModularIndexing(a, 2, 3), 1), sympy.And(a >= 2, b < 40),
        sympy.Or(sympy.Eq(a, 3), sympy.Eq(b, 3)), sympy.Not(sympy.Eq(a, b)),
        sympy.Le(a ** 2, 100), sympy.Le(F.PowByNatural(a, 2), 100),
    ]
    index = {a: 0, b: 1}
    guards = {"v": 1, "syms": [["size", 0, 1], ["size", 1, 0]],
              "guards": [_enc_expr(e, index, 0) for e in exprs]}
    decoded = json.loads(json.dumps(guards))  # what the disk gives back
    for va in (2, 3, 4, 9, 12, 13, 40):
        for vb in (2, 3, 9, 11, 40, 41):
            x, y = torch.empty(1, va), torch.empty(vb)
            for e, node in zip(exprs, decoded["guards"]):
                one = ShapeGuards.decode({**decoded, "guards": [node]})
                want = bool(e.subs({a: va, b: vb}))
                assert one.holds([x, y]) == want, (e, va, vb)


def test_unknown_expressions_make_the_set_unknown() -> None:
    a = sympy.Symbol("s0", integer=True, positive=True)
    for e in (sympy.Le(a / 2, 3), sympy.Le(F.FloatTrueDiv(a, 2), 3),
              sympy.Le(sympy.Symbol("u0"), 3)):
        with pytest.raises(_Unknown):
            _enc_expr(e, {a: 0}, 0)


@pytest.mark.parametrize("data", [
    None, [], {"v": 2, "syms": [], "guards": []}, {"v": 1, "syms": [], "guards": [["eval", 1]]},
    {"v": 1, "syms": [["size", 0]], "guards": []}, {"v": 1, "syms": [["shape", 0, 0]],
                                                    "guards": []},
    {"v": 1, "syms": [["size", 0, 0]], "guards": [["v", 1]]},
    {"v": 1, "syms": [], "guards": [["<=", 1]]}, {"v": 1, "syms": [], "guards": ["1 < 2"]},
    {"v": 1, "syms": [], "guards": [1.5]}, {"v": 1, "unknown": "x"},
])
def test_malformed_guards_are_refused_when_decoded(data: object) -> None:
    with pytest.raises(ValueError):
        ShapeGuards.decode(data)


def test_evaluation_that_cannot_say_raises() -> None:
    """Division by zero, logic on numbers, a guard that is not a relation, an input the
    program does not have: ValueError (the engine then checks the size)."""
    t = torch.empty(2, 3)
    for guards in ([["==", ["//", ["v", 0], 0], 1]], [["and", ["v", 0]]], [["+", ["v", 0], 1]],
                   [["==", ["pow", ["v", 0], 65], 1]]):
        sg = ShapeGuards.decode({"v": 1, "syms": [["size", 0, 1]], "guards": guards})
        with pytest.raises(ValueError):
            sg.holds([t])
    sg = ShapeGuards.decode({"v": 1, "syms": [["size", 1, 0]], "guards": [["<", ["v", 0], 9]]})
    with pytest.raises(ValueError):
        sg.holds([t])


def test_guard_block_round_trip() -> None:
    g = {"v": 1, "syms": [["stride", 2, 0], ["offset", 1]],
         "guards": [["==", ["v", 0], ["*", 16, ["v", 1]]]]}
    blob = pack_guards(g) + b"\x80rest"
    got, rest = unpack_guards(memoryview(blob))
    assert got == g and bytes(rest) == b"\x80rest"
    got, rest = unpack_guards(memoryview(b"\x80legacy"))  # a program stored before guards
    assert got is None and bytes(rest) == b"\x80legacy"
    assert pack_guards(None) == b""
    with pytest.raises(ValueError):
        unpack_guards(memoryview(_GUARDS_TAG + (99).to_bytes(4, "big") + b"{}"))


def test_template_refused_by_the_graph_builder_is_counted() -> None:
    """An input whose stride follows s in a dim whose size does not (``big[:, 0]`` of a
    [2, T, 16] tensor) cannot enter a dynamic-size program: the graph builder refuses the
    template (``sym_unfusable``), the trace runs op by op with eager's bits. No compile."""
    ln = _model()
    g = torch.Generator().manual_seed(4)
    sizes = LEARN + [20, 33, 20]
    data = [torch.randn(2, T, 16, generator=g) for T in sizes]

    def fn(big: torch.Tensor) -> torch.Tensor:
        return _block(ln, big) * big[:, 0].unsqueeze(1).sum(-1, keepdim=True)

    with torch.no_grad():
        want = [fn(x) for x in data]
    with ae.adaptive_eager(compile_async=False, hot_after=2, symbolic_programs=True,
                           step_aside=False), torch.no_grad():
        got = []
        for x in data:
            got.append(fn(x))
            ae.sync()
        m = ae.metrics()
    assert m["sym_hits"] >= 1 and m["sym_unfusable"] == 1 and m["compiles"] == 0, m
    for a, e in zip(got, want):
        assert torch.equal(a, e)



def test_template_program_that_specializes_is_refused_and_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the SymInt-aware decomposition of ``constant_pad_nd`` (Note [specializing
    kernels]: GPT-2's loss pads its labels), its fake kernel fixes the length (``Eq(s0, T)``):
    the program would serve one size only, so the backend refuses it while propagating shapes,
    before Inductor compiles anything; counted in ``sym_specialized``, and the trace runs op
    by op with eager's bits."""
    from adaptive_eager.backends import inductor

    monkeypatch.setattr(inductor, "_SYM_DECOMPS", ())
    monkeypatch.setattr(inductor, "_PROP", None)  # rebuilt without the decomposition
    ln = _model()
    g = torch.Generator().manual_seed(5)
    sizes = LEARN + [12, 14, 15, 20, 33, 20]
    data = [(torch.randn(2, T, 16, generator=g), torch.randint(0, 16, (2, T), generator=g))
            for T in sizes]

    def fn(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        return torch.nn.functional.cross_entropy(ln(x).view(-1, 16), shifted.view(-1),
                                                 ignore_index=-100)

    with torch.no_grad():
        want = [fn(x, lab) for x, lab in data]
    with ae.adaptive_eager(compile_async=False, hot_after=2, symbolic_programs=True,
                           step_aside=False, compile_process=False), torch.no_grad():
        got = []
        for x, lab in data:
            got.append(fn(x, lab))
            ae.sync()
        m = ae.metrics()
    monkeypatch.undo()
    inductor._PROP = None
    assert m["sym_hits"] >= 1 and m["sym_specialized"] == 1, m
    assert m["compile_errors"] == 1 and m["compiled_runs"] == 0, m
    for a, e in zip(got, want):
        assert torch.equal(a, e)


def _two_fakes_dynamic_in_dim_1() -> tuple:
    """A fake mode with a ShapeEnv and two (2, s, 16) fakes, each with its own symbol."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)

    mode = FakeTensorMode(shape_env=ShapeEnv())
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.DYNAMIC,
                                                  DimDynamic.STATIC])
    x = mode.from_tensor(torch.randn(2, 10, 16), symbolic_context=ctx)
    y = mode.from_tensor(torch.randn(2, 10, 16), symbolic_context=ctx)
    return mode, x, y


def test_guards_collected_from_a_real_shape_env() -> None:
    """``shape_guards`` reads what a ShapeEnv recorded while fake kernels ran on a dynamic
    length: glu halves dim 1 (``s % 2 == 0``), cdist picks its kernel by size (``s <= 25``),
    and the range every size symbol gets (``s >= 2``; glu's half too: ``s // 2 != 1``); a
    second input's length unified with the first (broadcasting) becomes an equality. Decoded,
    they hold exactly where those assumptions do."""
    from adaptive_eager.backends.inductor import shape_guards

    mode, x, y = _two_fakes_dynamic_in_dim_1()
    with mode:
        torch.nn.functional.glu(x, 1)
        torch.cdist(x, x)
        x + y
    data = shape_guards([x, y])
    assert "unknown" not in data, data
    sg = ShapeGuards.decode(json.loads(json.dumps(data)))

    def at(a: int, b: int) -> bool:
        return sg.holds([torch.empty(2, a, 16), torch.empty(2, b, 16)])

    assert at(10, 10) and at(4, 4) and at(24, 24)
    assert not at(11, 11) and not at(26, 26) and not at(10, 12)
    assert not at(2, 2)  # glu's half would be 1: a size-1 dim, specialized away



def test_symbolic_strides_become_equalities() -> None:
    """A contiguous input's stride is 16*s in the fakes: the program assumes that layout, so it
    is kept as an equality (a slice of a longer buffer, same sizes, fails it; its static
    strides are the template's to match). Two inputs made
    with their own symbols stay independent (nothing related them while compiling)."""
    from adaptive_eager.backends.inductor import shape_guards

    mode, x, y = _two_fakes_dynamic_in_dim_1()
    data = shape_guards([x, y])
    assert ["stride", 0, 0] in data["syms"], data
    sg = ShapeGuards.decode(data)
    assert sg.holds([torch.empty(2, 7, 16), torch.empty(2, 7, 16)])
    assert sg.holds([torch.empty(2, 7, 16), torch.empty(2, 8, 16)])
    assert not sg.holds([torch.empty(2, 7, 16), torch.empty(2, 9, 16)[:, :7]])  # 144 != 16*7


def test_malformed_stored_sizes_are_ignored_and_counted(compiled: Path, cache_dir: Path) -> None:
    """Checked sizes in the statistics that are not sizes (a string, s=1) are ignored and
    counted in ``disk_errors``: the sizes are checked again, results eager's."""
    from adaptive_eager.cache.disk import DiskCache

    _copy(compiled, cache_dir)
    disk = DiskCache.open(cache_dir, 1 << 30)
    assert disk is not None
    try:
        names = [n[len("stats:"):] for n in disk.keys() if n.startswith("stats:")]
        found = 0
        for name in names:
            stats = disk.get_stats(name)
            if stats and isinstance(stats.get("sym_sizes"), dict):
                stats["sym_sizes"]["agreed"] = ["20", 1, 33]
                disk.put_stats(name, stats)
                found += 1
    finally:
        disk.close()
    assert found == 1
    ln = _model()
    xs = _inputs([21, 50], 6)
    with torch.no_grad():
        want = [_block(ln, x) for x in xs]
    got, steps = _run(ln, xs)
    m = steps[-1]
    assert m["compiles"] == 0 and m["disk_hits"] >= 1 and m["disk_errors"] >= 1, steps
    assert m["sym_sizes_loaded"] == 0 and m["sym_checked"] == 2 and m["sym_trusted"] == 0, steps
    for y, e in zip(got, want):
        assert torch.equal(y, e)


def test_guard_arithmetic_out_of_range_is_refused() -> None:
    """A stored guard block is data: constants beyond any size and products that grow past
    them raise ValueError (the engine then checks the size) instead of evaluating big-int
    products without bound (a few thousand 4000-digit factors took minutes)."""
    with pytest.raises(ValueError):
        ShapeGuards.decode({"v": 1, "syms": [], "guards": [["==", ["*", 10 ** 4000, 2], 0]]})
    t = torch.empty(3, 2)
    for guards in ([["==", ["*", 1 << 100, 1 << 100], 0]],
                   [["==", ["*", ["pow", 1 << 63, 64], ["pow", 1 << 63, 64]], 0]],
                   [["==", ["+", 1 << 128, 1 << 128], 0]]):
        sg = ShapeGuards.decode({"v": 1, "syms": [["size", 0, 0]], "guards": guards})
        with pytest.raises(ValueError):
            sg.holds([t])
    sg = ShapeGuards.decode({"v": 1, "syms": [["size", 0, 0]],
                             "guards": [["==", ["pow", ["v", 0], 2], 9],
                                        ["<=", ["*", ["v", 0], 1 << 62], 1 << 64]]})
    assert sg.holds([t]) is True and sg.holds([torch.empty(4, 2)]) is False


def test_deeply_nested_guard_block_reads_as_unknown() -> None:
    """JSON nested past the interpreter's recursion limit is an unreadable block (unknown
    guards: sizes are checked), not a failed load of the program."""
    body = b'{"v":1,"syms":[],"guards":[' + b"[" * 100_000 + b"]" * 100_000 + b"]}"
    blob = _GUARDS_TAG + len(body).to_bytes(4, "big") + body + b"\x80rest"
    got, rest = unpack_guards(memoryview(blob))
    assert "unknown" in got and bytes(rest) == b"\x80rest"
    with pytest.raises(ValueError):
        ShapeGuards.decode(got)


@pytest.mark.slow
def test_lifted_scalar_without_outputs_compiles() -> None:
    """A symbolic trace whose only effect is an in-place write with a varying Python float
    (lifted: an aten.item in the program) and no tensor output: it should compile once and
    its fused runs match eager within tolerance."""
    ln = _model()
    xs = _inputs(LEARN, 1)
    w0 = torch.randn(16, generator=torch.Generator().manual_seed(2))

    def run(w: torch.Tensor) -> None:
        for i, x in enumerate(xs):
            _block(ln, x)  # dropped: the trace's only effect is the write below
            w.add_(x.sum((0, 1)), alpha=-0.1 * (i + 1))
            ae.sync()

    with torch.no_grad():
        want = w0.clone()
        run(want)
        got = w0.clone()
        with ae.adaptive_eager(compile_async=False, hot_after=2, symbolic_programs=True,
                               compile_process=False):  # the helper fails the same way
            run(got)
    m = ae.metrics()
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)  # holds either way
    assert m["compile_errors"] == 0 and m["compiles"] == 1, m
    assert m["compiled_runs"] > 0
