"""The ``inductor`` backend: a trace graph compiled by ``torch._inductor.standalone_compile``.

Fused C++ kernels on CPU, Triton on CUDA. Programs are specialized to the example inputs' shapes
(the trace key already fixes every shape). Compiled with ``aot=True``, an artifact serializes to
bytes in memory (15-40 kB for small graphs) and deserializes in milliseconds. On CPU the artifact
holds C++ source: the compiled kernels live in Inductor's cache folder, which the engine points
into its own cache folder, so a warm process also finds the kernels and runs no compiler.

Note [Inductor kernel folder]
Inductor dlopens the kernels it finds in its cache folder, so that folder obeys the cache trust
rule (Note [cache trust rule]). Its default, ``<tmp>/torchinductor_<user>``, is shared: another
user can create it first. And ``import torch._dynamo`` (any torch.optim optimizer does it) calls
``cache_dir()``, which writes that default into TORCHINDUCTOR_CACHE_DIR, so the variable being
set does not mean the user chose it. A value counts as the user's choice when it differs from
torch's default or was already set when torch was imported (adaptive_eager_autoload records it);
it is used only if it passes the trust rule, else a warning names it and the private folder is
used. Torch reads the variable on every ``cache_dir()`` call; precompiled headers (used only where
the cache's size limit holds them: Note [kernel pins]) use a path fixed
at import from the default (``codecache._HEADER_DIR``), which is pointed into the same folder. The
helper process gets the folder with each request. Without a disk cache (or before one is open),
a compile uses a private temporary folder of this process. Artifacts are specific to one torch build: the build's key is
stored with each and checked on load.
"""

from __future__ import annotations

import getpass
import logging
import os
import re
import sys
import tempfile
from typing import Any

import torch

from adaptive_eager.cache import kernel_refs, pins
from adaptive_eager.isolation import isolate_vec_isa_probe

log = logging.getLogger("adaptive_eager")

_kernel_dir: str | None = None  # where this process points Inductor (None: not chosen yet)

# Note [compile threads]
# Inductor's CPU code generation reads ``torch.get_num_threads()`` when it compiles: how many
# loop levels to parallelize, whether a reduction splits across threads, ``#pragma omp parallel``
# or plain loops (with one thread, none). torch.compile compiles in the program's process, so
# its kernels suit the program's thread count; a helper process has its own default (every
# core), and a program run with one torch thread got kernels made for two here. The backend
# object takes the program's thread count with it when it is pickled for a helper or the compile
# service (``__getstate__``, at each request), and compiles under it; the count is part of
# ``options_key`` (so of the program's cache key), as it is of Inductor's own FX graph cache
# key: a program compiled serial for one thread is not loaded by a process that runs sixteen.
# Measured (Llama width 128, 2 layers, the 461-op step program, run with one thread, 15
# interleaved calls at load 8.8): 6.95 ms CPU compiled for one thread, 7.06 ms for two: within
# noise at that size; the kernels differ (the two-thread ones have OpenMP regions).
class InductorBackend:
    name = "inductor"
    compiles = True
    separate_process = True  # compiles in the helper process (Note [compile process])

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = dict(options or {})
        self.threads: int | None = None  # the program's thread count, once pickled

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["threads"] = torch.get_num_threads()  # Note [compile threads]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"threads": None, **state})

    def options_key(self) -> str:
        return f"inductor:{sorted(self.options.items())}:threads={torch.get_num_threads()}"

    def compile(self, graph: Any) -> Any:
        import time

        from adaptive_eager.cache import trust

        ensure_kernel_dir()
        start = time.time()
        with _num_threads(self.threads), torch.no_grad(), \
                pins.compiling(chosen_kernel_dir()):  # Note [kernel pins]; no_grad: autograd
            # ran above us
            if getattr(graph, "dynamic", None):  # Note [symbolic programs] in symbolic_plan.py
                fakes = _fake_dynamic(graph)
                _not_specialized(fakes, "propagating shapes")
                # the fakes' own mode, through a tracing context: ``from_graph`` took it from
                # the outputs' example values, and a graph with no tensor output (in-place
                # writes only) got a fresh ShapeEnv whose first unbacked float was zuf0 again
                # ("possible memo disaster" in rebind_unbacked)
                mode = next((f.fake_mode for f in fakes if hasattr(f, "fake_mode")), None)
                if mode is None:  # a bare StopIteration would escape the generator context
                    raise RuntimeError("a dynamic-size graph without tensor inputs")
                with torch._guards.tracing(torch._guards.TracingContext(mode)):
                    program = torch._inductor.standalone_compile(
                        graph.gm, fakes, dynamic_shapes="from_tracing_context",
                        options=self.options, aot=True)
                _not_specialized(fakes, "compiling")
                program.ae_shape_guards = shape_guards(fakes)  # Note [program shape guards]
            else:
                program = torch._inductor.standalone_compile(
                    graph.gm, _detached(graph.example_inputs),
                    dynamic_shapes="from_example_inputs", options=self.options, aot=True)
        if trust.loose_umask():  # kernels made 0777 would be refused (and deleted) next run
            trust.tighten(chosen_kernel_dir(), start)
        return program

    def warm_up(self) -> None:
        """Import what loading a program needs (seconds in a fresh interpreter)."""
        from torch._inductor import compile_fx, standalone_compile  # noqa: F401

        ensure_kernel_dir()  # codecache is imported now: point its header folder too

    def prepare(self, cache_dir: str) -> None:
        """Keep Inductor's kernels in ``<cache dir>/inductor`` (Note [Inductor kernel folder])."""
        use_kernel_dir(choose_kernel_dir(cache_dir))

    def serialize(self, program: Any) -> bytes:
        data = program.serialize()
        return _build_key() + pack_guards(getattr(program, "ae_shape_guards", None)) + \
            kernel_refs.pack(kernel_keys(data)) + data  # Note [program entries]

    def load(self, data: bytes, graph: Any) -> Any:
        from torch._inductor.standalone_compile import AOTCompiledArtifact

        ensure_kernel_dir()
        key = _build_key()
        if not data.startswith(key):
            raise ValueError("artifact was compiled by another torch build")
        guards, rest = unpack_guards(memoryview(data)[len(key):])
        keys, rest = kernel_refs.unpack(rest)
        with pins.compiling(chosen_kernel_dir()):  # evicted kernels are rebuilt here
            missing = _missing(chosen_kernel_dir(), keys)
            if missing:  # Note [program entries]: rebuilt from the artifact's source
                log.info("adaptive_eager: %d kernel(s) of a stored program are gone (%s); "
                         "rebuilding them", len(missing), missing[0])
            program = AOTCompiledArtifact.deserialize(bytes(rest))
        program.ae_shape_guards = guards
        return program


def kernel_keys(data: bytes) -> list[str]:
    """The keys of the kernel files a program just compiled or loaded here uses: its wrapper
    (named in its serialized bytes ``data``) and the kernels in the wrapper's globals, each from
    a module named after its key (Note [program entries])."""
    folder = chosen_kernel_dir() + os.sep
    loaded: dict[str, Any] = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and path.startswith(folder):
            loaded[os.path.basename(path).split(".")[0]] = module
    keys = {k.decode() for k in set(kernel_refs.KEY_BYTES.findall(data))}
    for key in list(keys):
        wrapper = loaded.get(key)
        if wrapper is None:
            continue
        for value in list(vars(wrapper).values()):
            try:  # ``torch.ops`` namespaces look any attribute up as an operator
                owners = (value, getattr(value, "fn", None))  # a Triton kernel: its .fn
                names = [getattr(owner, "__module__", None) for owner in owners]
            except Exception:
                continue
            for name in names:
                if isinstance(name, str):
                    keys.update(kernel_refs.KEY.findall(name))
    return sorted(keys)


def _missing(folder: str, keys: list[str]) -> list[str]:
    """The keys of ``keys`` with no file left in kernel folder ``folder``."""
    gone = []
    for key in keys:
        try:
            names = os.listdir(os.path.join(folder, key[1:3]))
        except OSError:
            names = []
        if not any(n.startswith(key) for n in names):
            gone.append(key)
    return gone


class _num_threads:
    """torch's thread count set to ``n`` for a compile (None: unchanged; Note [compile threads])."""

    def __init__(self, n: int | None) -> None:
        self.n = n
        self.old = 0

    def __enter__(self) -> None:
        self.old = torch.get_num_threads()
        if self.n is not None and self.n != self.old:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc: Any) -> None:
        if torch.get_num_threads() != self.old:
            torch.set_num_threads(self.old)


def _fake_dynamic(graph: Any) -> list[Any]:
    """Fake inputs with the graph's symbolic dims dynamic (one ShapeEnv), propagated through
    the graph so that ``dynamic_shapes="from_graph"`` compiles one program for every size."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)

    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = []
    inputs = _detached(graph.example_inputs)
    dyn = list(graph.dynamic) + [()] * (len(inputs) - len(graph.dynamic))
    for t, dims in zip(inputs, dyn):
        if dims:
            ctx = StatelessSymbolicContext(dynamic_sizes=[
                DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(t.dim())])
            fakes.append(mode.from_tensor(t, symbolic_context=ctx))
        else:
            fakes.append(mode.from_tensor(t, static_shapes=True))
    _symbolic_prop(graph.gm, mode).propagate_dont_convert_inputs(*fakes)
    # from_graph takes its fake mode from the outputs' example values: this ShapeEnv (a fresh
    # one re-ran aten.item on these fakes: "zuf0 possible memo disaster" with lifted scalars)
    for node in graph.gm.graph.nodes:
        if node.op == "output":
            for arg in node.args[0]:
                if isinstance(arg, torch.fx.Node) and "val" in arg.meta:
                    arg.meta["example_value"] = arg.meta["val"]
    return fakes


# Note [specializing kernels]
# Some ops' fake kernels read sizes as plain ints (the C++ composite of constant_pad_nd calls
# ``sizes()``): propagating shapes through one fixes its input's dynamic size (GPT-2's loss pads
# the labels: ``Eq(s0, 31)``). Their decompositions (torch._decomp's SymInt-aware refs) give
# the same shapes symbolically, and Inductor lowers the op itself when it compiles.
_SYM_DECOMPS = ("constant_pad_nd.default",)


def _symbolic_prop_class() -> Any:
    from torch._decomp import decomposition_table
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    aten = torch.ops.aten
    decomps = {}
    for name in _SYM_DECOMPS:
        packet, overload = name.split(".")
        op = getattr(getattr(aten, packet), overload)
        if op in decomposition_table:
            decomps[op] = decomposition_table[op]

    class SymbolicProp(FakeTensorProp):
        """FakeTensorProp that says which op fixed a dynamic size, and propagates the ops
        whose fake kernel would fix one through their decomposition."""

        def run_node(self, n: torch.fx.Node) -> Any:
            env = self._mode.shape_env
            before = len(env.replacements)
            fn = decomps.get(n.target) if n.op == "call_function" else None
            if fn is None:
                result = super().run_node(n)
            else:
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                with self._mode:
                    result = fn(*args, **kwargs)
                n.meta["val"] = result
            if len(env.replacements) != before:
                _not_specialized_env(env, f"propagating shapes through {n.target}")
            return result

    return SymbolicProp


def _symbolic_prop(gm: Any, mode: Any) -> Any:
    """A SymbolicProp interpreter (the class is made on first use: torch.fx imports late)."""
    global _PROP
    if _PROP is None:
        _PROP = _symbolic_prop_class()
    return _PROP(gm, mode)


_PROP: Any = None


def _not_specialized_env(env: Any, stage: str) -> None:
    import sympy

    fixed = {str(k): str(v) for k, v in env.replacements.items()
             if isinstance(v, (int, sympy.Integer))}
    if fixed:
        raise RuntimeError(f"a dynamic size became a constant while {stage}: {fixed}")


def _not_specialized(fakes: list[Any], stage: str) -> None:
    """Raise when a dynamic input size was fixed to a constant (a guard such as Eq(s0, 31)):
    the program would serve one size only and refuse the others at run time."""
    env = next((f.fake_mode.shape_env for f in fakes
                if getattr(f, "fake_mode", None) is not None), None)
    if env is not None:
        _not_specialized_env(env, stage)


# Note [program shape guards]
# A dynamic-size program is correct only for sizes that satisfy what the compile assumed about
# them. Inductor records every such assumption as a guard in the ShapeEnv of the fakes it
# compiled (``ShapeEnv.guards``: for GPT-2-like graphs ``Eq(s0, s1)`` from broadcasting two
# inputs that follow s, and ``s0 <= 4096`` from the CPU codegen choosing a sum kernel without
# its chunked accumulator, ``need_use_acc_helper``), plus the value range of each symbol
# (``var_to_range``: sizes are assumed >= 2, the 0/1 specialization) and the symbols it unified
# (``replacements``). Which guards there are depends on that compile's code generation (the
# 4096 bound appears only where the sum kernel weighed its accumulator): the set is per
# program, which is why it is kept with the program. The AOT artifact checks none of them
# when called (its bundled callable has no guards; Dynamo's would be the caller's), so the
# engine must. ``shape_guards`` turns
# them, right after the compile and in the process that compiled, into data: each symbol is
# located as (size | stride | offset, input, dim) of the program's inputs, and each guard is a
# small tree of ints, symbol references and the operators + * // % cdiv pow min max, the
# relations == != < <= > >= and and/or/not. Every other symbolic property of an input
# becomes an equality too: a dim that duck sizing gave another dim's symbol (equal at compile
# time, assumed equal ever after, with no entry in ``guards``: Dynamo's produce_guards would
# emit it as a source equality) and a stride such as 16*s (contiguity). Anything else (a
# rational coefficient, an unbacked symbol from ``aten.item``, a float function) makes the
# whole set ``unknown``, which
# the engine treats as "no size may be trusted by guards" (it checks each size against replay,
# as before guards existed). The set travels inside the serialized program (``pack_guards``:
# a tagged, length-prefixed JSON block after the build key; torch's pickle follows), so the
# helper process, the compile service, the disk cache and the remote store carry it without
# change, under the disk cache's HMAC. Nothing in it is executed: the engine decodes it with a
# fixed table of operators and evaluates it with plain integer arithmetic
# (ShapeGuards in compile/sizes.py), never through sympy (sympify evaluates strings) or eval. A
# program serialized before this (no block) loads with guards None, treated as unknown.
_GUARDS_TAG = b"AEG1"
_REL = ("==", "!=", "<", "<=", ">", ">=")


class _Unknown(Exception):
    pass


def shape_guards(fakes: list[Any]) -> dict[str, Any]:
    """The compile's assumptions on the inputs' sizes, as data (Note [program shape guards])."""
    try:
        return _shape_guards(fakes)
    except _Unknown as err:
        return {"v": 1, "unknown": str(err)[:200]}
    except Exception as err:  # a torch whose ShapeEnv differs: no guards, sizes are checked
        return {"v": 1, "unknown": f"{type(err).__name__}: {err}"[:200]}


def _shape_guards(fakes: list[Any]) -> dict[str, Any]:
    import sympy

    env = next((f.fake_mode.shape_env for f in fakes
                if getattr(f, "fake_mode", None) is not None), None)
    if env is None:
        raise _Unknown("no ShapeEnv on the inputs")
    props: list[tuple[list[Any], Any]] = []  # every symbolic size, stride, offset
    for i, f in enumerate(fakes):
        if isinstance(f, torch.Tensor):
            for d, v in enumerate(f.size()):
                props.append((["size", i, d], v))
            for d, v in enumerate(f.stride()):
                props.append((["stride", i, d], v))
            props.append((["offset", i], f.storage_offset()))
    props = [(loc, v.node._expr) for loc, v in props if isinstance(v, torch.SymInt)]
    syms: list[list[Any]] = []
    index: dict[Any, int] = {}
    for loc, e in props:  # each symbol at the first input property made with it
        if isinstance(e, sympy.Symbol) and e not in index:
            index[e] = len(syms)
            syms.append(loc)
    guards: list[Any] = [_enc_expr(g.expr, index, 0) for g in env.guards]
    for loc, e in props:  # any other symbolic property is what the program was compiled
        # for: a dim duck-sized to another's symbol (equal lengths at compile time share it,
        # guarded by nothing in env.guards), a contiguous stride such as 16*s
        if isinstance(e, sympy.Symbol) and syms[index[e]] is loc:
            continue
        syms.append(loc)
        guards.append(["==", ["v", len(syms) - 1], _enc_expr(e, index, 0)])
    for sym, k in list(index.items()):
        rng = env.var_to_range.get(sym)
        if rng is not None:
            for bound, rel in ((rng.lower, ">="), (rng.upper, "<=")):
                if isinstance(bound, (int, sympy.Integer)) and not isinstance(bound, bool):
                    guards.append([rel, ["v", k], int(bound)])
        rep = env.replacements.get(sym)
        if rep is not None and rep != sym:
            guards.append(["==", ["v", k], _enc_expr(rep, index, 0)])
    import json

    seen: set[str] = set()  # a bound can come from a guard and from the symbol's range
    kept = []
    for g in guards:
        text = json.dumps(g)
        if g is not True and text not in seen:
            seen.add(text)
            kept.append(g)
    return {"v": 1, "syms": syms, "guards": kept}


def _enc_expr(e: Any, index: dict[Any, int], depth: int) -> Any:
    import sympy
    from torch.utils._sympy import functions as F

    if depth > 48:
        raise _Unknown("expression too deep")
    if e is sympy.true or isinstance(e, sympy.logic.boolalg.BooleanTrue):
        return True
    if e is sympy.false or isinstance(e, sympy.logic.boolalg.BooleanFalse):
        return False
    if isinstance(e, sympy.Integer):
        return int(e)
    if isinstance(e, sympy.Symbol):
        k = index.get(e)
        if k is None:
            raise _Unknown(f"symbol {e} is not a size of an input")
        return ["v", k]
    args = [_enc_expr(a, index, depth + 1) for a in e.args]
    t = type(e)
    ops = {sympy.Add: "+", sympy.Mul: "*", F.FloorDiv: "//", F.CleanDiv: "//",
           F.CeilDiv: "cdiv", F.Mod: "%", F.PythonMod: "%", sympy.Mod: "%",
           F.PowByNatural: "pow", F.Min: "min", F.Max: "max", sympy.Min: "min",
           sympy.Max: "max", sympy.Eq: "==", sympy.Ne: "!=", sympy.StrictLessThan: "<",
           sympy.LessThan: "<=", sympy.StrictGreaterThan: ">", sympy.GreaterThan: ">=",
           sympy.And: "and", sympy.Or: "or", sympy.Not: "not"}
    op = ops.get(t)
    if op is not None:
        return [op, *args]
    if t is sympy.Pow and isinstance(e.args[1], sympy.Integer) and int(e.args[1]) >= 0:
        return ["pow", *args]
    if t is F.ModularIndexing:  # (x // d) % m
        return ["%", ["//", args[0], args[1]], args[2]]
    if t is F.Identity:
        return args[0]
    raise _Unknown(f"{t.__name__} in a shape guard")


def pack_guards(guards: dict[str, Any] | None) -> bytes:
    """The guard block of a serialized program (empty: a static program has none)."""
    import json

    if guards is None:
        return b""
    body = json.dumps(guards, separators=(",", ":")).encode()
    return _GUARDS_TAG + len(body).to_bytes(4, "big") + body


def unpack_guards(rest: memoryview) -> tuple[dict[str, Any] | None, memoryview]:
    """(guards, the artifact's bytes) from what follows the build key; guards None when the
    program has no block. An unreadable block reads as unknown guards, never as a failed load
    (the engine then checks sizes as it would without guards)."""
    import json

    if bytes(rest[:4]) != _GUARDS_TAG:
        return None, rest
    n = int.from_bytes(rest[4:8], "big")
    if len(rest) < 8 + n:
        raise ValueError("truncated program")
    try:
        guards = json.loads(bytes(rest[8:8 + n]))
    except (ValueError, RecursionError) as err:  # RecursionError: nested past the C stack
        guards = {"v": 1, "unknown": f"unreadable guards: {err}"[:200]}
    if not isinstance(guards, dict):
        guards = {"v": 1, "unknown": "guards of another format"}
    return guards, rest[8 + n:]


def _build_key() -> bytes:
    """A fixed-length prefix naming the torch build (a hash of its sources)."""
    from torch._inductor.codecache import torch_key

    return b"AE1" + torch_key()[:32].ljust(32, b"\0")


def _detached(inputs: list[Any]) -> list[Any]:
    """Compile for inference: the engine runs programs below autograd, on detached aliases."""
    return [t.detach() if isinstance(t, torch.Tensor) else t for t in inputs]


def _torch_default() -> str:
    """Inductor's default kernel folder (``cache_dir_utils.default_cache_dir``). Computed here
    while Inductor is not loaded: importing that module imports ``torch._inductor`` and Dynamo
    with it, 1.4 s of every engine start here (Note [import when a program lands])."""
    loaded = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if loaded is not None:
        return os.path.abspath(loaded.default_cache_dir())
    try:
        username = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        getuid = getattr(os, "getuid", None)
        username = f"uid_{getuid()}" if callable(getuid) else "unknown_user"
    sanitized = re.sub(r'[\\/:*?"<>|]', "_", username)
    return os.path.abspath(os.path.join(tempfile.gettempdir(), "torchinductor_" + sanitized))


def user_kernel_dir() -> str | None:
    """TORCHINDUCTOR_CACHE_DIR if the user set it (not torch writing its default back)."""
    value = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not value:
        return None
    if os.path.abspath(value) != _torch_default():
        return value
    autoload = sys.modules.get("adaptive_eager_autoload")
    at_import = getattr(autoload, "INDUCTOR_DIR_AT_IMPORT", None)
    return value if at_import and os.path.abspath(at_import) == os.path.abspath(value) else None


def choose_kernel_dir(cache_dir: str) -> str:
    """The user's TORCHINDUCTOR_CACHE_DIR if it passes the trust rule, else ``<cache>/inductor``."""
    from adaptive_eager.cache import trust
    from adaptive_eager.metrics import METRICS

    chosen = user_kernel_dir()
    private = os.path.join(cache_dir, "inductor")
    if chosen is not None:
        try:
            path = trust.check_root(chosen, create=True)
            bad = trust.scan(path)[2]
            if bad:
                raise trust.Untrusted(next(iter(bad.values())))
            return str(path)
        except (trust.Untrusted, OSError) as err:
            METRICS.disk_errors += 1
            log.warning("adaptive_eager: not using TORCHINDUCTOR_CACHE_DIR=%s (%s); Inductor "
                        "kernels go to %s instead", chosen, err, private)
    from adaptive_eager.cache.disk import KERNEL_DIRS_OK

    try:
        root = trust.check_root(cache_dir, create=False)
        path = str(trust.private_subdir(root, "inductor"))
        if path in KERNEL_DIRS_OK:  # checked when the cache opened, and writable
            return path
        log.info("adaptive_eager: the cache folder is read-only: Inductor kernels go to a "
                 "temporary folder")
    except (trust.Untrusted, OSError) as err:  # checked at open; changed since: not ours
        METRICS.disk_errors += 1
        log.warning("adaptive_eager: cannot keep Inductor kernels in %s (%s); using a "
                    "temporary folder", private, err)
    return _temporary_dir()


def _temporary_dir() -> str:
    """A 0700 folder of this process, removed at exit (kernels are then compiled again)."""
    import atexit
    import shutil

    path = tempfile.mkdtemp(prefix="adaptive_eager-inductor-")
    pid = os.getpid()
    atexit.register(lambda: os.getpid() == pid and shutil.rmtree(path, ignore_errors=True))
    return path


def use_kernel_dir(path: str, precompiled_headers: bool | None = None) -> None:
    """Point Inductor (the variable and the paths it fixed at import) at ``path``; with
    precompiled headers where its cache's size limit holds them (``precompiled_headers``: the
    requester's choice, in a helper; Note [kernel pins])."""
    global _kernel_dir, _headers_fit
    _kernel_dir = path
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    _headers_fit = headers_fit(path) if precompiled_headers is None else precompiled_headers
    codecache = sys.modules.get("torch._inductor.codecache")
    if codecache is not None:
        _point_headers(codecache, path)
        set_precompiled_headers(_headers_fit)


def headers_fit(path: str) -> bool | None:
    """Whether the size limit of the cache that owns kernel folder ``path`` holds precompiled
    headers (None: no cache of this process owns it)."""
    from adaptive_eager.cache.disk import KERNEL_DIR_LIMITS

    limit = KERNEL_DIR_LIMITS.get(path)
    return None if limit is None else limit >= pins.PCH_MIN_LIMIT


_PCH_DEFAULT: bool | None = None  # Inductor's own setting, before this process changed it
_headers_fit: bool | None = None  # of the chosen kernel folder (applied once Inductor loads)


def set_precompiled_headers(fit: bool | None) -> None:
    """Inductor's precompiled headers off where they do not fit (None, True: its own setting)."""
    global _PCH_DEFAULT
    from torch._inductor import config as inductor_config

    if _PCH_DEFAULT is None:
        _PCH_DEFAULT = bool(inductor_config.cpp_cache_precompile_headers)
    inductor_config.cpp_cache_precompile_headers = _PCH_DEFAULT and fit is not False


def _point_headers(codecache: Any, path: str) -> None:
    headers = os.path.join(path, "precompiled_headers")
    if getattr(codecache, "_HEADER_DIR", headers) != headers:
        codecache._HEADER_DIR = headers
        codecache._HEADER_LOCK_DIR = os.path.join(headers, "locks")


def kernel_dir() -> str | None:
    return _kernel_dir


def chosen_kernel_dir() -> str:
    """The folder for this process's kernels, choosing a temporary one if none was chosen (no
    disk cache); also puts it back into the variable should anything have reset it."""
    global _kernel_dir
    if _kernel_dir is None:
        _kernel_dir = _temporary_dir()
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") != _kernel_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = _kernel_dir
    return _kernel_dir


def ensure_kernel_dir() -> None:
    """Before Inductor compiles or loads anything: its folder, this process's pin on it (Note
    [kernel pins]) and the isolated VecISA probe (Note [isolated subprocesses])."""
    path = chosen_kernel_dir()
    import torch._inductor.codecache as codecache

    _point_headers(codecache, path)
    set_precompiled_headers(_headers_fit)
    pins.pin(path)
    isolate_vec_isa_probe()
