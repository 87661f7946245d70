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
Ctrl-C, which the parent handles). Isolated mode (``-I``) keeps the working folder, PYTHON*
variables and the user site off ``sys.path``: a module planted in a world-writable working folder
is never imported. The package itself is loaded from the folder this process loaded it from (the
bootstrap below), everything else from the interpreter's own paths, so a backend object must come
from an installed package (one defined in the script is "unusable" there and compiles here). The
helper compiles into the same Inductor kernel folder as this process (sent with each request). It runs at ``HELPER_NICE``: where no
core is idle the program keeps a slight priority. A backend opts in with
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

import torch

log = logging.getLogger("adaptive_eager")

_HEADER = struct.Struct("<Q")
# Measured by benchmarks/compile_stall.py on 2 busy cores (two OpenMP threads stepping the
# program): at nice 0 the program ran 3x slower while the helper compiled (18 s); at 3, 1.6x
# (22 s); at 10 it did not slow down, but the compile took 58 s, and a program that keeps every
# core busy (16M-element steps) starved it for minutes: the fused program that would have made
# it 6x faster came far too late. So a slight preference only. Idle cores make this moot.
HELPER_NICE = 3


class HelperFailed(RuntimeError):
    """The helper process itself failed (not the compile): compile in this process instead."""


class CompileFailed(RuntimeError):
    """The backend raised inside the helper; the message carries its type and text."""


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
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:  # lifted Python numbers: cheap to send as they are
            return ("value", x.detach().clone())
        return ("tensor", tuple(x.shape), x.stride(), x.dtype, str(x.device))
    return ("value", x)


def _example(spec: tuple) -> Any:
    if spec[0] == "value":
        return spec[1]
    _, size, stride, dtype, device = spec
    return torch.empty_strided(size, stride, dtype=dtype, device=device).zero_()


def _flags() -> dict[str, Any]:
    from adaptive_eager.backends.inductor import chosen_kernel_dir

    return {"matmul_precision": torch.get_float32_matmul_precision(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "inductor_cache": chosen_kernel_dir()}


def _apply_flags(flags: dict[str, Any]) -> None:
    from adaptive_eager.backends.inductor import use_kernel_dir

    torch.set_float32_matmul_precision(flags["matmul_precision"])
    torch.use_deterministic_algorithms(flags["deterministic"])
    if flags["inductor_cache"]:
        use_kernel_dir(flags["inductor_cache"])


# The helper's first lines, run by ``python -I -c``: adaptive_eager (only it) from the folder the
# parent loaded it from, appended last so nothing there shadows the standard library.
_BOOT = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
         "import sys, importlib.machinery as m, importlib.util as u\n"
         "s = m.PathFinder.find_spec('adaptive_eager', [sys.argv[1]])\n"
         "p = u.module_from_spec(s); sys.modules['adaptive_eager'] = p; s.loader.exec_module(p)\n"
         "from adaptive_eager.compile_helper import main\n"
         "main()\n")


def helper_command() -> list[str]:
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [sys.executable, "-I", "-c", _BOOT, package_root, str(os.getpid())]


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
        request = (backend, dataclasses.replace(
            graph, example_inputs=[_input_spec(x) for x in graph.example_inputs]), _flags())
        with self._lock:
            try:
                proc = self._ensure()
                assert proc.stdin is not None and proc.stdout is not None
                _write(proc.stdin, request)
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
        raise CompileFailed(payload)

    def _ensure(self) -> subprocess.Popen:
        if self._pid != os.getpid():
            self._proc, self._pid = None, os.getpid()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            return proc
        if proc is not None:
            raise HelperFailed(f"the helper exited with status {proc.returncode}")
        env = dict(os.environ)
        env["ADAPTIVE_EAGER"] = "0"  # the helper must not switch the engine on for itself
        self._proc = subprocess.Popen(
            helper_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
            env=env, close_fds=True, start_new_session=True)  # Ctrl-C is the parent's
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
    if hasattr(os, "nice"):
        # The program comes first: on a busy machine the compile (and the C++ compilers it
        # starts, which inherit this) takes the CPU time the program leaves idle.
        os.nice(HELPER_NICE)
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
            backend, graph, flags = _read(inp)
        except (EOFError, OSError):
            return
        except Exception as err:  # e.g. a backend class this process cannot import
            _write(out, ("unusable", f"{type(err).__name__}: {err}", 0.0))
            continue
        start = time.perf_counter()
        try:
            _apply_flags(flags)
            graph.example_inputs = [_example(s) for s in graph.example_inputs]
            program = backend.compile(graph)
            answer = ("ok", backend.serialize(program), time.perf_counter() - start)
        except Exception as err:
            detail = "".join(traceback.format_exception_only(type(err), err)).strip()
            answer = ("error", detail[-2000:], time.perf_counter() - start)
        _write(out, answer)
