"""How the engine starts processes: isolated from the program's folder, path and environment.

Note [isolated subprocesses]
Every process the engine starts, and every probe Inductor starts on its behalf, runs code as the
user; what it runs must come only from the interpreter's own paths and the package's folder,
never from where the program happens to run. A ``ctypes.py`` another user left in a shared
working folder ran as the victim when Inductor's VecISA probe (``python -c``: the working folder
first on ``sys.path``) was started with the program's working folder. So:

* Python children run ``python -I`` (no working folder or script folder on ``sys.path``, no
  PYTHON* variables, no user site), with their working folder a private one
  (``private_cwd``: 0700, this user's, made per process; the compile service and its helpers
  use the service folder, which the cache trust rule checks). Inductor's own children inherit
  the helper's working folder.
* Their environment is ``child_env``: only the variables named in ``ENV_NAMES`` or starting
  with one of ``ENV_PREFIXES`` (what finding and running the compiler, the CPU/GPU libraries
  and Inductor's own settings need), plus ``ADAPTIVE_EAGER=0``; ``TORCHINDUCTOR_CACHE_DIR``
  is left out (the kernel folder travels with each compile request), and the compile service
  also leaves out thread-pool and locale variables (``SHARED_DROPPED_PREFIXES``). Nothing else
  of the program's environment reaches a helper.
* The compile service is shared by many programs, so what it compiles with must not depend on
  which program started it (a service started with ``CXX=/bin/false`` failed every other
  program's compiles): its identity includes ``env_digest()`` of these variables (Note
  [service identity] in service.py), so a program whose compiler settings differ reaches a
  service of its own.
* Inductor's VecISA probe runs inside whichever process compiles or loads a program, the
  program itself included (loading an artifact probes). torch 2.13 starts it from
  ``VecISA._probe_load`` with ``subprocess.run([sys.executable, "-c", ...])``, no ``cwd`` and
  the parent's environment. Changing the program's working folder around it would race every
  other thread of the program (``chdir`` is process-wide), and answering the probe ahead would
  still leave each ISA's ``__bool__`` running it. So ``isolate_vec_isa_probe`` replaces that
  one method, process-wide and once, by the same probe (dlopen of the built test library, same
  timeout, same answer) run ``python -I`` from ``private_cwd`` with ``child_env`` and torch's
  library folder on ``LD_LIBRARY_PATH`` (what Inductor's own probe environment adds). The
  user's own ``torch.compile`` in that process gets the isolated probe too. A torch without that
  method is reported by the test that checks the probe (tests/test_isolation.py).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping

# Passed to children by exact name: finding and running the C/C++ compiler and the libraries.
ENV_NAMES = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR",
             "LD_LIBRARY_PATH", "LIBRARY_PATH", "CPATH", "C_INCLUDE_PATH",
             "CPLUS_INCLUDE_PATH", "CC", "CXX", "CONDA_PREFIX", "ATEN_CPU_CAPABILITY")
# ... and by prefix: Inductor's, Triton's and torch's settings, GPU selection, thread pools.
ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_", "TRITON_", "CUDA_", "HIP_", "ROCM_", "OMP_",
                "KMP_", "MKL_", "GOMP_")
# Never passed: each compile request names its kernel folder (Note [Inductor kernel folder]);
# torch writes its default here at ``import torch._dynamo``, so the value says little anyway.
ENV_DROPPED = ("TORCHINDUCTOR_CACHE_DIR",)
# Not passed to the shared compile service (nor part of its identity): they change no compiled
# code (each request carries the program's thread count, Note [compile threads]), only the
# helper's own thread pools and the language of messages, and they differ between a user's
# programs more often than anything else.
SHARED_DROPPED_PREFIXES = ("OMP_", "KMP_", "MKL_", "GOMP_", "LANG", "LC_")

_cwd: str | None = None
_cwd_lock = threading.Lock()


def child_env(environ: Mapping[str, str] | None = None,
              shared: bool = False) -> dict[str, str]:
    """The environment of a process the engine starts (Note [isolated subprocesses]);
    ``shared``: of the compile service and its helpers, which serve every program."""
    env = os.environ if environ is None else environ
    out = {k: v for k, v in env.items()
           if (k in ENV_NAMES or k.startswith(ENV_PREFIXES)) and k not in ENV_DROPPED
           and not (shared and k.startswith(SHARED_DROPPED_PREFIXES))}
    out["ADAPTIVE_EAGER"] = "0"  # a child never switches the engine on for itself
    return dict(sorted(out.items()))


def env_digest(environ: Mapping[str, str] | None = None) -> str:
    """A digest of the compile service's ``child_env``: part of its identity."""
    text = "\0".join(f"{k}={v}" for k, v in child_env(environ, shared=True).items())
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def private_cwd() -> str:
    """A working folder for children: 0700, this user's, one per process, removed at exit."""
    global _cwd
    with _cwd_lock:
        if _cwd is None or not os.path.isdir(_cwd):
            path = tempfile.mkdtemp(prefix="adaptive_eager-cwd-")  # 0700, O_EXCL
            pid = os.getpid()
            atexit.register(lambda: os.getpid() == pid and shutil.rmtree(path, True))
            _cwd = path
        return _cwd


def isolate_vec_isa_probe() -> bool:
    """Run Inductor's VecISA dlopen probe isolated (Note [isolated subprocesses]); idempotent.
    False when this torch has no ``VecISA._probe_load`` (then nothing is changed)."""
    try:
        import torch._inductor.cpu_vec_isa as isa_mod
    except Exception:
        return False
    cls = getattr(isa_mod, "VecISA", None)
    if cls is None or not callable(getattr(cls, "_probe_load", None)):
        return False
    if getattr(cls._probe_load, "_ae_isolated", False):
        return True
    source = getattr(cls, "_avx_py_load", None)
    if not isinstance(source, str) or "__lib_path__" not in source:
        return False

    def _probe_load(self: object, output_path: str) -> bool:
        try:  # a use: the size limit evicts orphan kernels by age (Note [program entries])
            os.utime(output_path)
        except OSError:
            pass
        return probe_load(source.replace("__lib_path__", output_path))

    _probe_load._ae_isolated = True  # type: ignore[attr-defined]
    cls._probe_load = _probe_load
    return True


def probe_env() -> dict[str, str]:
    """``child_env`` with torch's libraries first on the loader's path (as Inductor's probe)."""
    import torch

    env = child_env()
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    old = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = os.pathsep.join([lib, old]) if old else lib
    return env


def probe_load(code: str) -> bool:
    """Run ``code`` (Inductor's dlopen probe) in an isolated Python; True if it exits 0."""
    try:
        subprocess.run([sys.executable, "-I", "-c", code], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=probe_env(),
                       cwd=private_cwd(), timeout=60, check=True, close_fds=True)
    except subprocess.TimeoutExpired:
        import warnings

        warnings.warn("VecISA dlopen probe hung after 60s", stacklevel=2)
        return False
    except (subprocess.CalledProcessError, OSError):
        return False
    return True
