"""Compiling in a helper process, so a compile never holds the program's GIL.

Note [compile process]
Inductor compiles in Python for seconds to a minute per trace. In a thread of the user's process
it shares the GIL with the program, which runs slower until the compile ends (1.2x with a core to
spare, benchmarks/compile_stall.py; more when the program's OpenMP threads also want the core the
compile runs on). Instead the compile thread hands the trace graph to a helper
process and waits on a pipe (holding no GIL): the FX graph is pickled, its example inputs travel
as metadata only (compiling reads no values), the helper compiles with the same backend object
and answers with the serialized program, which this process loads (on CPU the kernels are
already built in the shared Inductor cache folder, so loading runs no compiler).

The helper is ``python -I`` running adaptive_eager.compile_helper: started at the first compile,
with ``ADAPTIVE_EAGER=0`` so the engine is not switched on inside it, serving one compile at a
time, and exiting quietly when its stdin closes or its parent is gone (no traceback, also not for
Ctrl-C, which the parent handles). It runs isolated (Note [isolated subprocesses] in
isolation.py): ``-I`` keeps the working folder, PYTHON* variables and the user site off
``sys.path``, its working folder is a private one (Inductor's own children inherit it), and it
gets only the allow-listed variables: a module planted in a world-writable working folder is
never imported, by it or by the probes Inductor starts in it. The package itself is loaded from
the folder this process loaded it from (the bootstrap below), everything else from the
interpreter's own paths, so a backend object must come from an installed package (one defined in
the script is "unusable" there and compiles here). The helper compiles into the same Inductor
kernel folder as this process (sent with each request). It runs at the lowest CPU priority
(Note [compile priority]). A backend opts in with
``separate_process = True``. A compile that fails in the helper fails as it would here (the trace
stays op by op); a helper that cannot start, dies or answers garbage is counted
(``helper_errors``) and that compile, and every later one, runs in the compile thread instead.
Inductor settings changed at run time (``torch._inductor.config``) do not reach the helper: set
``ADAPTIVE_EAGER_COMPILE_PROCESS=0`` for programs that change them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
import traceback
from typing import IO, Any

from adaptive_eager.cache import pins
from adaptive_eager.isolation import child_env, isolate_vec_isa_probe, private_cwd

log = logging.getLogger("adaptive_eager")

_HEADER = struct.Struct("<Q")
# Note [compile priority]
# A compile runs beside the program it serves, on the same cores, while the program goes on
# plain eager (Note [waiting aside]). Earlier measurements (benchmarks/compile_stall.py, 2 cores,
# two OpenMP threads stepping the program): with the helper at nice 0 the program ran 3x slower
# while it compiled, at nice 3 1.6x; with the compile service's helpers at nice 0, a GPT-2-style
# step (two OpenMP threads on two cores) ran 5-8x eager's time for the ~80 steps a compile
# lasted, eager's own kernels 10-60x slower: an OpenMP team whose threads lose their core to
# another process waits at every barrier for the descheduled one, so a share of the CPU costs
# far more than that share. A nice level only weights the share; it does not stop that. So every
# helper (the program's own and the compile service's) takes the lowest class the system has:
# SCHED_IDLE on Linux (it runs only on CPU time nothing else wants; inherited by the C++
# compilers it starts) or nice 19 elsewhere. Measured on the 2-core VM (benchmarks/whole_run.py,
# two torch threads, 200 steps, cold): the whole run of logged_step went from 33.6 s to 21.0 s,
# moe 45.0 -> 15.2, cnn 70.2 -> 12.1, scan 73.9 -> 17.0 (eager 2.8-3.7 s). It does not remove
# the stall: there, even SCHED_IDLE busy loops slowed a two-thread eager run 14x, so the
# program also lends the compile a core while it waits (Note [compile cores] in cores.py). A
# program that waits for a compile (``compile_async=False``, or at exit) leaves the cores idle,
# and the compile runs at full speed then. The bootstrap takes it before the helper imports anything
# (``compile_helper.take_lowest_priority``): torch's imports are seconds of CPU too.



class HelperFailed(RuntimeError):
    """The helper process itself failed (not the compile): compile in this process instead."""


class CompileFailed(RuntimeError):
    """The backend raised inside the helper; the message carries its type and text.
    ``transient``: the helper judged it to depend on the environment or on files (Note
    [transient compile failures]), so a later process tries again."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


# Note [transient compile failures]
# A stored failure keeps a trace op by op in every later process, so only a failure that the same
# graph would meet again anywhere may be stored as permanent: one the graph itself causes
# (lowering, an unsupported op, a shape error). A failure that depends on the machine is
# transient: the C++ compiler missing, refusing or failing (a compiler from another program's
# environment, ``CXX=/bin/false``; a precompiled header or kernel file removed under a warm
# helper by the size limit), any OS error (a file gone, a full disk), a subprocess that failed
# or timed out, memory, a killed or vanished helper. ``failure_is_transient`` walks the
# exception and its causes (Inductor wraps the compiler's error) and decides by type first,
# then by the marks such errors leave in a message that crossed a process boundary as text. A
# deterministic C++ code generation bug is classed transient too: it costs a few retries
# (``TRANSIENT_RETRIES`` in compiler.py), never a trace lost for good to a passing fault.
_TRANSIENT_TYPES = ("CppCompileError", "InvalidCxxCompiler", "CalledProcessError",
                    "TimeoutExpired", "SubprocessError", "BrokenPipeError")
_TRANSIENT_MARKS = ("OSError", "No space left", "Errno", "TimeoutError", "MemoryError",
                    "Killed", "BrokenPipe", "Cannot allocate memory", "CppCompileError",
                    "InvalidCxxCompiler", "C++ compile error", "CalledProcessError",
                    "FileNotFoundError", "No such file or directory", "HelperFailed")


def failure_is_transient(err: BaseException) -> bool:
    """Whether a compile failure may not recur elsewhere (Note [transient compile failures])."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen or len(seen) > 32:
            continue
        seen.add(id(e))
        if isinstance(e, CompileFailed):
            if e.transient:
                return True
        elif isinstance(e, (OSError, TimeoutError, MemoryError, HelperFailed,
                            subprocess.SubprocessError)):
            return True
        if any(type(e).__name__ == name or any(c.__name__ == name for c in type(e).__mro__)
               for name in _TRANSIENT_TYPES):
            return True
        if not isinstance(e, CompileFailed) and any(m in str(e) for m in _TRANSIENT_MARKS):
            return True
        stack += [e.__cause__, e.__context__, getattr(e, "inner_exception", None)]
    return False


def _write(stream: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read(stream: IO[bytes]) -> Any:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("pipe closed")
    n = _HEADER.unpack(head)[0]
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("pipe closed mid-message")
    return pickle.loads(data)


def _input_spec(x: Any) -> tuple:
    import torch

    if isinstance(x, torch.Tensor):
        if x.dim() == 0:  # lifted Python numbers: cheap to send as they are
            return ("value", x.detach().clone())
        return ("tensor", tuple(x.shape), x.stride(), x.dtype, str(x.device))
    return ("value", x)


def _example(spec: tuple) -> Any:
    import torch

    if spec[0] == "value":
        return spec[1]
    _, size, stride, dtype, device = spec
    return torch.empty_strided(size, stride, dtype=dtype, device=device).zero_()


def _flags(state: tuple | None = None) -> dict[str, Any]:
    """What a compile request carries besides the graph: the ambient state the trace was
    recorded under (Note [ambient state]; ``state``: the graph's, else this thread's now), and
    who asks (code fingerprint, torch build: a helper of other code refuses the request)."""
    import torch

    from adaptive_eager.backends.inductor import chosen_kernel_dir, headers_fit
    from adaptive_eager.dispatch import ambient
    from adaptive_eager.program_key import code_fingerprint, torch_build

    state = tuple(state) if state else ambient.state()
    named = dict(state)
    return {"matmul_precision": named.get("matmul_precision",
                                          torch.get_float32_matmul_precision()),
            "deterministic": named.get("deterministic",
                                       torch.are_deterministic_algorithms_enabled()),
            # ops recorded without a dtype lower to the default (Note [default dtype])
            "default_dtype": named.get("default_dtype",
                                       str(torch.get_default_dtype()).removeprefix("torch.")),
            "state": state, "code": code_fingerprint(), "torch": torch_build(),
            "inductor_cache": chosen_kernel_dir(),
            # whether the cache's size limit holds precompiled headers (Note [kernel pins])
            "precompiled_headers": headers_fit(chosen_kernel_dir())}


def _foreign(flags: dict[str, Any]) -> str | None:
    """Why a helper must not take a request (other code or another torch build), or None."""
    from adaptive_eager.program_key import code_fingerprint, torch_build

    if flags.get("code") != code_fingerprint():
        return (f"a request of other adaptive_eager code ({str(flags.get('code'))[:12]}; "
                f"this helper runs {code_fingerprint()[:12]})")
    if flags.get("torch") != torch_build():
        return f"a request of another torch build ({flags.get('torch')}; here {torch_build()})"
    return None


def _apply_flags(flags: dict[str, Any]) -> None:
    import torch

    from adaptive_eager.backends.inductor import use_kernel_dir
    from adaptive_eager.dispatch import ambient

    torch.set_float32_matmul_precision(flags["matmul_precision"])
    torch.use_deterministic_algorithms(flags["deterministic"])
    dtype = getattr(torch, str(flags.get("default_dtype", "float32")), None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        torch.set_default_dtype(dtype)
    ambient.apply(flags.get("state") or ())
    if flags["inductor_cache"]:
        use_kernel_dir(flags["inductor_cache"], flags.get("precompiled_headers"))


# The first lines of a helper or of the compile service, run by ``python -I -c``: adaptive_eager
# (only it) from the folder the parent loaded it from, appended last so nothing there shadows the
# standard library. argv: [-c, package folder, module, function, args...]. The package's
# ``__init__`` runs only where ``import torch`` is wanted anyway (the helper, once it has taken
# the lowest CPU priority): the service
# (service.py) is a broker that never imports torch, and starts in a tenth of a second.
_BOOT = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
         "import sys, importlib, importlib.machinery as m, importlib.util as u\n"
         "s = m.PathFinder.find_spec('adaptive_eager', [sys.argv[1]])\n"
         "p = u.module_from_spec(s); sys.modules['adaptive_eager'] = p\n"
         "if sys.argv[4] == 'init':\n"
         "    importlib.import_module('adaptive_eager.compile_helper').take_lowest_priority()\n"
         "    s.loader.exec_module(p)\n"
         "getattr(importlib.import_module(sys.argv[2]), sys.argv[3])()\n")


def boot_command(module: str, function: str, args: list[str], init: bool = False) -> list[str]:
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [sys.executable, "-I", "-c", _BOOT, package_root, module, function,
            "init" if init else "bare", *args]


def helper_command() -> list[str]:
    """argv[5:]: the parent's pid."""
    return boot_command("adaptive_eager.compile_helper", "main", [str(os.getpid())], init=True)


def request_bytes(backend: Any, graph: Any) -> bytes:
    """What a helper reads for one compile: the backend, the graph with its example inputs as
    metadata, and the flags that change generated code (pickled; only a helper unpickles it)."""
    request = (backend, dataclasses.replace(
        graph, example_inputs=[_input_spec(x) for x in graph.example_inputs]),
        _flags(getattr(graph, "state", None)))
    return pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)


class CompileProcess:
    """The client side: one helper per process, one compile at a time."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._pid = os.getpid()  # a forked child must not share its parent's helper
        self._lock = threading.Lock()
        self.broken: str | None = None  # why the helper is not used any more

    def compile(self, backend: Any, graph: Any) -> tuple[bytes, float]:
        """Serialized program and the helper's compile seconds; raises CompileFailed or
        HelperFailed."""
        if self.broken is not None:
            raise HelperFailed(self.broken)
        request = request_bytes(backend, graph)
        with self._lock:
            try:
                proc = self._ensure()
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(_HEADER.pack(len(request)) + request)
                proc.stdin.flush()
                status, payload, seconds = _read(proc.stdout)
            except Exception as err:  # pipe, pickling, a dead helper
                if self.broken is None:  # not abandoned at exit: a real failure
                    self._give_up(f"{type(err).__name__}: {err}")
                raise HelperFailed(self.broken) from err
        if status == "ok":
            return payload, seconds
        if status == "unusable":  # this request only: compile it here
            from adaptive_eager.metrics import METRICS

            METRICS.helper_errors += 1
            raise HelperFailed(f"the helper could not take this compile: {payload}")
        raise CompileFailed(payload, transient=status != "error")

    def _ensure(self) -> subprocess.Popen:
        if self._pid != os.getpid():
            self._proc, self._pid = None, os.getpid()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            return proc
        if proc is not None:
            raise HelperFailed(f"the helper exited with status {proc.returncode}")

        # Note [isolated subprocesses]: -I, a private working folder, the allow-listed variables
        self._proc = subprocess.Popen(
            helper_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
            env=child_env(), cwd=private_cwd(), close_fds=True,
            start_new_session=True)  # Ctrl-C is the parent's
        return self._proc

    def _give_up(self, why: str) -> None:
        from adaptive_eager.metrics import METRICS

        METRICS.helper_errors += 1
        self.broken = why
        log.warning("adaptive_eager: the compile helper process failed (%s); compiling in this "
                    "process from now on", why)
        self.close()

    def abandon(self) -> None:
        """At the program's exit: kill a helper still compiling, quietly (its answer would come
        too late; the helper exits by itself on EOF, but a compile can take a minute)."""
        self.broken = "the program exited"
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=5)
        except Exception:
            proc.kill()
            try:
                proc.wait(timeout=5)  # reaped, not left a zombie of this program
            except Exception:
                pass


HELPER = CompileProcess()


def _exit_with_parent(parent: int) -> None:
    """Mid-compile, stdin EOF is not seen: leave as soon as the parent is gone."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(0)


def serve(parent: int | None = None) -> None:
    """The helper's loop: requests on stdin, answers on the original stdout; returns (quietly)
    when the parent closes the pipe or is gone. ``parent``: the pid that started this helper
    (it may have died while this one was still importing torch)."""
    import signal

    # Ctrl-C reaches the whole process group: the parent handles it and closes the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid() if parent is None else parent
    if os.getppid() != parent:
        return
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # compilers' prints must not corrupt the answers
    inp = sys.stdin.buffer
    try:
        _serve(inp, out)
    except (BrokenPipeError, EOFError, ConnectionError):
        pass  # the parent is gone: nothing to answer, nothing to report
    try:
        out.close()
    except OSError:
        pass


def _serve(inp: IO[bytes], out: IO[bytes]) -> None:
    while True:
        try:
            request = _read(inp)
            if request[0] == "warm_up":
                _write(out, warm_up(*request[1:]))
                continue
            backend, graph, flags = request
        except (EOFError, OSError):
            return
        except Exception as err:  # e.g. a backend class this process cannot import
            _write(out, ("unusable", f"{type(err).__name__}: {err}", 0.0))
            continue
        start = time.perf_counter()
        foreign = _foreign(flags)
        if foreign is not None:  # Note [service identity] in service.py
            _write(out, ("unusable", foreign, 0.0))
            continue
        try:
            fast_vec_isa_pick()
            _apply_flags(flags)
            graph.example_inputs = [_example(s) for s in graph.example_inputs]
            program = backend.compile(graph)
            answer = ("ok", backend.serialize(program), time.perf_counter() - start)
        except Exception as err:
            detail = "".join(traceback.format_exception_only(type(err), err)).strip()
            status = "transient" if failure_is_transient(err) else "error"
            answer = (status, detail[-2000:], time.perf_counter() - start)
        _write(out, answer)


# Note [helper warm-up]
# Where the seconds of a cold compile went (fresh process, 2 cores, torch 2.13, a 9-op chain):
# ``import torch`` 2.0 s, ``torch._dynamo`` 1.7 s, ``torch._inductor`` 1.5 s, Inductor's VecISA
# probe 17-22 s with an empty kernel folder (it builds a test program with g++ for each of the
# four ISAs the CPU flags list, AMX, AVX512-VNNI, AVX512, AVX2, and dlopens each in a new Python)
# and 2.0 s with a warm one (the four dlopen probes), then the first graph 2.7 s (0.4 s with its
# kernels cached). torch.compile's first call pays the same probe. So:
# * A helper of the compile service imports all of it and runs the probe and one tiny compile
#   as soon as it starts (``warm_up``), before the first request; the service keeps it for
#   later requests and processes, so only a service's first compile pays any of this.
# * The VecISA probe stops at the first ISA that works (``fast_vec_isa_pick``): Inductor uses
#   only the first valid one when neither ATEN_CPU_CAPABILITY nor ``cpp.simdlen`` is set, so the
#   choice is the same, at a quarter of the cost. Done in helpers, and in the program before it
#   loads a program (loading an artifact runs the probe too: 2 s warm, far more with a fresh
#   kernel folder); torch.compile in the program then gets the same choice, sooner.
# * Helpers take the lowest CPU priority before any of this (Note [compile priority]).


def fast_vec_isa_pick() -> None:
    """Make Inductor's VecISA pick probe ISAs in order and stop at the first that builds and
    loads (Note [helper warm-up]). Same choice as Inductor's own; idempotent."""
    import torch._inductor.cpu_vec_isa as isa_mod
    from torch._inductor import config as inductor_config

    isolate_vec_isa_probe()  # Note [isolated subprocesses]: before any probe can run
    if getattr(isa_mod, "_ae_fast_pick", False):
        return
    isa_mod._ae_fast_pick = True
    if os.environ.get("ATEN_CPU_CAPABILITY") or inductor_config.cpp.simdlen is not None:
        return  # Inductor then picks by capability or width from the whole list: keep it
    full = isa_mod.valid_vec_isa_list
    if sys.platform != "linux" or not hasattr(isa_mod, "x86_isa_checker"):
        return
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return

    import functools

    @functools.cache
    def first_valid() -> list:
        flags = isa_mod.x86_isa_checker()
        for isa in isa_mod.supported_vec_isa_list:
            if all(flag in flags for flag in str(isa).split()) and isa:
                return [isa]
        return []

    first_valid.__wrapped_full__ = full  # type: ignore[attr-defined]
    isa_mod.valid_vec_isa_list = first_valid


def warm_up(kernel_dir: str | None, graph: bool = True,
            precompiled_headers: bool | None = None) -> tuple[str, str, float]:
    """Import Inductor, pick the VecISA and compile one tiny graph (into ``kernel_dir``), so the
    first real request starts where a later one would (Note [helper warm-up]). The detail says
    where the seconds went."""
    start = time.perf_counter()
    phases: list[str] = []

    def lap(name: str) -> None:
        nonlocal start
        now = time.perf_counter()
        phases.append(f"{name} {now - start:.1f}s")
        start = now

    total = time.perf_counter()
    try:
        import torch

        from adaptive_eager.backends.inductor import ensure_kernel_dir, use_kernel_dir

        if kernel_dir:
            use_kernel_dir(kernel_dir, precompiled_headers)
        import torch._dynamo  # noqa: F401  (Note [compile worker]: dynamo first)

        lap("dynamo")
        import torch._inductor.codecache  # noqa: F401
        import torch._inductor.standalone_compile  # noqa: F401

        lap("inductor")
        fast_vec_isa_pick()
        ensure_kernel_dir()
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        pick_vec_isa()
        lap("vec_isa")
        if not graph:
            return "ok", ", ".join(phases), time.perf_counter() - total

        def tiny(x: torch.Tensor) -> torch.Tensor:
            return (x * 2.0 + 1.0).relu()

        from adaptive_eager.backends.inductor import chosen_kernel_dir

        gm = torch.fx.symbolic_trace(tiny)
        with torch.no_grad(), pins.compiling(chosen_kernel_dir()):
            torch._inductor.standalone_compile(gm, [torch.zeros(8)],
                                               dynamic_shapes="from_example_inputs", aot=True)
        lap("first graph")
    except Exception as err:  # the warm-up is an optimization: a real compile reports errors
        return "error", f"{type(err).__name__}: {err}", time.perf_counter() - total
    return "ok", ", ".join(phases), time.perf_counter() - total
