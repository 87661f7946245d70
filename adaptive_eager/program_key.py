"""What a program is: the one function that names a stored or served program.

Note [program key]
A program compiled from a trace is valid for exactly the things that went into building it, so
its key (disk cache, remote store, compile-service de-duplication, warm-start prefetch) is a hash
over named parts, each a value that can be logged, in the manner of JAX's cache_key.get():

  trace    the trace digest (op sequence, input metadata, alias structure; its trie root holds the
           default dtype and the ambient state, Note [ambient state]) with the program's plan:
           live slots, lifted and baked Python numbers, synthetic-base offsets, shape guards.
  code     ``code_fingerprint()``: a hash of this package's own source, the code that records,
           keys, builds graphs and programs and runs them. A constant version string did not
           change when that code did: an older install's compile service fused a float64
           program in float32 (it predates the default dtype in compile requests) and stored it
           under the newer client's key, which reused it from disk after that service was gone.
  torch    torch's version and build: git revision, CUDA/HIP versions, debug build.
  backend  the backend's name and ``options_key()`` (its options, Inductor's thread count).
  state    ``ambient_state()``, the process-wide settings read when ops run or compile (matmul
           precision, deterministic algorithms, torch.backends flags, thread count...).

Thread-local state (grad mode, inference mode, autocast) is not a part of its own: autocast's
casts and autograd happen above the engine's dispatch mode, so they are ops of the trace or not,
and each op's grad mode is recorded with it (Note [grad-mode kernels]).

``program_key`` is the only place a program key is made. ``code_fingerprint`` is also the
compile service's identity (Note [service identity] in service.py): a service answers only
clients of the same code, so a program is never built by other code than the one keying it.
The fingerprint hashes every ``.py`` file of the package plus ``_hot.c`` (the sources, not the
built accelerator): computed once per process (a few milliseconds, at the first compile or service
start), then cached. This module imports torch only inside the functions that need it: the
compile service (which never imports torch) computes the fingerprint too.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from typing import Any

log = logging.getLogger("adaptive_eager")

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
# Sources only: the accelerator built from _hot.c differs in bytes from machine to machine (build
# paths), and ranks of one job on several machines must share programs (the remote store).
_SOURCE_SUFFIXES = (".py", ".c")


def _sources() -> list[tuple[str, int, int]]:
    """The package's source files: (path, size, mtime in ns), in path order."""
    found: list[tuple[str, int, int]] = []
    for folder, dirs, files in os.walk(_PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        for f in files:
            if f.endswith(_SOURCE_SUFFIXES):
                path = os.path.join(folder, f)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                found.append((path, st.st_size, st.st_mtime_ns))
    found.sort()
    return found


# The sources as this process loaded them (this module is imported with the package): a file
# changed since (an upgrade while the program runs) no longer describes the code running here.
_LOADED = _sources()


@functools.cache
def code_fingerprint() -> str:
    """A hash of this package's source files (relative path and bytes), 32 hex digits. Sources
    changed since this process imported them give a fingerprint of this process alone (no
    stored program or service of other code matches the code running here)."""
    h = hashlib.blake2b(digest_size=16)
    if _sources() != _LOADED:
        h.update(f"changed since import: {os.getpid()} {time.time_ns()}".encode())
        log.warning("adaptive_eager: its source files changed since this process imported "
                    "them; programs of this process are not shared with others")
        return h.hexdigest()
    for path, _, _ in _LOADED:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:  # unreadable: still part of the identity, by name
            data = b"?"
        rel = os.path.relpath(path, _PACKAGE)
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


@functools.cache
def torch_build() -> str:
    """torch's version and build: two builds of one version may generate different code."""
    import torch

    v = torch.version
    return (f"{torch.__version__} git={getattr(v, 'git_version', None)} "
            f"cuda={getattr(v, 'cuda', None)} hip={getattr(v, 'hip', None)} "
            f"debug={getattr(v, 'debug', None)}")


def ambient_state() -> tuple[tuple[str, Any], ...]:
    """The process-wide settings that decide what recorded ops compute (Note [ambient state])."""
    from adaptive_eager.dispatch import ambient

    return ambient.state()


def program_key(trace: dict[str, Any], backend: str, state: tuple[tuple[str, Any], ...],
                code: str | None = None, torch: str | None = None) -> str:
    """The key of a program: xxh3-128 over named parts (Note [program key]). ``trace``: the
    trace digest and program plan; ``backend``: name and options; ``state``: the ambient state
    the trace was recorded under (``TraceGraph.state``). ``code``/``torch`` default to this
    process's (tests pass others)."""
    parts = key_parts(trace, backend, state, code, torch)
    return hash_parts(parts)


def key_parts(trace: dict[str, Any], backend: str, state: tuple[tuple[str, Any], ...],
              code: str | None = None, torch: str | None = None) -> dict[str, str]:
    """The named parts of a program key, each as the string that is hashed (loggable)."""
    return {"trace": _canonical(trace), "code": code or code_fingerprint(),
            "torch": torch or torch_build(), "backend": backend, "state": _canonical(state)}


def hash_parts(parts: dict[str, str]) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    for name in sorted(parts):
        h.update(f"{name}={parts[name]};".encode())
    key = h.hexdigest()
    if log.isEnabledFor(logging.DEBUG):
        log.debug("adaptive_eager: program key %s: %s", key[:16], "; ".join(
            f"{n}={xxhash.xxh3_64_hexdigest(parts[n].encode())}" for n in sorted(parts)))
    return key


def _canonical(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{value[k]!r}" for k in sorted(value)) + "}"
    return repr(value)
