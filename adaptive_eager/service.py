"""The compile service: one per user and cache folder, shared by every process that uses it.

Note [compile service]
Compiles outlive the program that asked for them, and no trace is compiled twice at once. The
first engine that needs a compile starts the service (``python -I``, detached: its own session,
reparented to init); later processes, repeated runs, parallel test workers and the ranks of one
job on this machine (of the same code: Note [service identity]) talk to the same one. It listens
on a Unix socket inside the private cache folder (``<cache>/service/sock-<identity>``, the folder
0700 and checked by the cache trust rule), and refuses any peer whose SO_PEERCRED uid is not its
own (clients check the service's uid too).

* Requests are data, never code to the service: a JSON header (cache key, label, torch version)
  plus the opaque payload that the compile helper reads (the pickled backend and graph). The
  service neither unpickles nor imports torch: it is a broker with a queue (it starts in about
  0.1 s); compiles run in compile helpers it keeps (compile_process.serve, started ``python -I``
  as before, ``parent`` = the service), which keep torch and Inductor imported and warmed up
  (Note [helper warm-up] in compile_process.py) for as long as the service lives.
* De-duplicated by cache key: a request for a key being compiled waits for that compile; one
  whose program is already on disk is answered from disk at once.
* The service writes each program into the disk cache itself (verified entry, as the engine
  would), before it answers, so a program that asked and exited still leaves it for the next run.
* A requester that goes away does not cancel its compile. The service exits after
  ``idle`` seconds with no request and no compile (``ADAPTIVE_EAGER_SERVICE_IDLE_S``).
* A helper is started for each queued compile up to ``max_helpers`` (the CPU count, at most 4):
  ``adaptive-eager warm`` compiles the traces of a script in parallel.
* An engine that cannot reach or start the service, or whose service dies mid-compile, compiles
  in a helper of its own, as before (``service_errors``, logged once per process).
The service writes its log to ``<cache>/service/log`` (0600).

Note [service identity]
A service builds programs with its own code, and stores them under keys its clients computed
with theirs. A service started by an older install (its code predating the default dtype in
compile requests) fused a newer client's float64 program in float32 and stored it under the
client's key; later runs loaded it from disk. So a service answers only clients of its own
code: its socket and lock are named for ``identity()`` (the package's code fingerprint, Note
[program key], with the Python executable the service runs, and the digest of the variables its
compiles run under, Note [isolated subprocesses] in isolation.py: a service started by a program
with ``CXX=/bin/false`` failed every other program's compiles), ``<cache>/service/sock-<id>``.
The service and its helpers get only those variables, so a client reaches a service whose
compiler settings are its own, whoever started it. A
client of other code (another install, an upgraded checkout, another interpreter) finds no
socket of its identity and starts a service of its own beside the old one, which exits when
idle. Each compile request also names the client's fingerprint: a service of other code answers
"unusable" (the client compiles in a helper of its own), and a compile helper refuses a request
of other code or another torch build (compile_process._foreign). ``stop`` and ``status`` reach
the service of the caller's identity.

Why this shape. A per-process helper that detaches at exit would finish its compile, but each
process would still pay a fresh helper (imports, VecISA probe, first-graph set-up: 15-30 s here)
and two processes would compile one key twice. A fork server (a warm zygote forking a child per
compile) starts compiles fastest, but forks a process whose OpenMP and Inductor worker pools
may be running. Compiling under a file lock in each program de-duplicates but blocks the
programs and dies with them. A broker that never imports torch starts in a tenth of a second,
cannot be steered by what it forwards (it parses JSON headers only), survives its clients, and
leaves the torch-heavy work to helpers that are the same isolated processes as before.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from adaptive_eager.cache import pins, trust
from adaptive_eager.isolation import child_env, env_digest

log = logging.getLogger("adaptive_eager")

SERVICE_DIR = "service"
SOCK_NAME = "sock"  # followed by "-<identity>" (Note [service identity])
LOCK_NAME = "lock"
LOG_NAME = "log"
PROTOCOL = 1
_H32 = struct.Struct("<I")
_H64 = struct.Struct("<Q")
_MAX_HEADER = 1 << 20
_MAX_PAYLOAD = 1 << 31
START_TIMEOUT_S = 15.0  # a service that is not listening by then counts as unavailable
DEFAULT_IDLE_S = 120.0
_SO_PEERCRED = getattr(socket, "SO_PEERCRED", 17)
_CRED = struct.Struct("3i")


class ServiceUnavailable(RuntimeError):
    """No service could be reached or started (the engine compiles in a helper of its own)."""


# ---- framing ------------------------------------------------------------------------------------
def send_msg(sock: socket.socket, header: dict, payload: bytes = b"") -> None:
    head = json.dumps(header, sort_keys=True).encode()
    sock.sendall(_H32.pack(len(head)) + head + _H64.pack(len(payload)))
    if payload:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_msg(sock: socket.socket) -> tuple[dict, bytes]:
    n = _H32.unpack(_recv_exact(sock, _H32.size))[0]
    if n > _MAX_HEADER:
        raise ValueError("header too large")
    header = json.loads(_recv_exact(sock, n))
    if not isinstance(header, dict):
        raise ValueError("header is not an object")
    m = _H64.unpack(_recv_exact(sock, _H64.size))[0]
    if m > _MAX_PAYLOAD:
        raise ValueError("payload too large")
    return header, _recv_exact(sock, m) if m else b""


def peer_uid(sock: socket.socket) -> int:
    _, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, _SO_PEERCRED, _CRED.size))
    return uid


@functools.cache
def _code_identity() -> str:
    from adaptive_eager.program_key import code_fingerprint

    return f"{code_fingerprint()}\0{sys.executable}\0{sys.version}"


def identity() -> str:
    """Who a service serves (Note [service identity]): this package's code and interpreter, and
    the environment its compiles run in (as the program's is now)."""

    h = hashlib.blake2b(f"{_code_identity()}\0{env_digest()}".encode(), digest_size=8)
    return h.hexdigest()


def sock_name() -> str:
    return f"{SOCK_NAME}-{identity()}"


def lock_name() -> str:
    return f"{LOCK_NAME}-{identity()}"


def _sock_address(folder: Path) -> tuple[str, int | None]:
    """The socket's path, short enough for sun_path (108 bytes): through /proc/self/fd when the
    folder's own path is too long (the fd is returned, to be closed after bind/connect)."""
    path = str(folder / sock_name())
    if len(path.encode()) < 100:
        return path, None
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    return f"/proc/self/fd/{fd}/{sock_name()}", fd


def service_dir(cache_dir: Path, create: bool = True) -> Path:
    """``<cache>/service``: checked by the trust rule (Note [cache trust rule])."""
    root = trust.check_root(cache_dir, create=create)
    return trust.private_subdir(root, SERVICE_DIR, create=create)


def _code() -> str:
    from adaptive_eager.program_key import code_fingerprint

    return code_fingerprint()


# ---- the client ---------------------------------------------------------------------------------
def connect(cache_dir: Path, start: bool = True, idle_s: float | None = None,
            timeout: float = START_TIMEOUT_S, size_limit: int | None = None) -> socket.socket:
    """A connection to the service of ``cache_dir``; starts it if none listens (and ``start``).
    Raises ServiceUnavailable."""
    try:
        folder = service_dir(cache_dir)
    except (OSError, trust.Untrusted) as err:
        raise ServiceUnavailable(f"service folder: {err}") from None
    started = False
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        try:
            return _connect_once(folder)
        except (FileNotFoundError, ConnectionRefusedError) as err:
            if not start:
                raise ServiceUnavailable(f"no compile service running ({err})") from None
            if not started:
                _spawn(cache_dir, folder, idle_s, size_limit)
                started = True
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"the compile service did not start within "
                                         f"{timeout:.0f} s (see {folder / LOG_NAME})") from None
            time.sleep(delay)
            delay = min(delay * 1.5, 0.2)
        except OSError as err:
            raise ServiceUnavailable(f"{type(err).__name__}: {err}") from None


def _connect_once(folder: Path) -> socket.socket:
    st = os.lstat(folder / sock_name())  # FileNotFoundError: nobody of our code listens
    import stat as stat_mod

    if not stat_mod.S_ISSOCK(st.st_mode) or st.st_uid != trust.uid():
        raise ServiceUnavailable(f"{folder / sock_name()} is not this user's socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address, fd = _sock_address(folder)
    try:
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    finally:
        if fd is not None:
            os.close(fd)
    if peer_uid(sock) != trust.uid():
        sock.close()
        raise ServiceUnavailable("the socket's server belongs to another user")
    return sock


def service_command(cache_dir: Path, idle_s: float | None,
                    size_limit: int | None = None) -> list[str]:
    """argv of a service: the cache folder, the idle timeout and the size limit of the program
    that starts it (its helpers warm up with precompiled headers only where they fit)."""
    from adaptive_eager.compile_process import boot_command

    return boot_command("adaptive_eager.service", "main",
                        [str(cache_dir), str(idle_s if idle_s is not None else idle_default()),
                         str(int(size_limit) if size_limit else 0)])


def idle_default() -> float:
    raw = os.environ.get("ADAPTIVE_EAGER_SERVICE_IDLE_S")
    try:
        return max(float(raw), 0.5) if raw else DEFAULT_IDLE_S
    except ValueError:
        return DEFAULT_IDLE_S


def _spawn(cache_dir: Path, folder: Path, idle_s: float | None,
           size_limit: int | None) -> None:
    """Start a service, detached (it forks once more at once, so it is nobody's child here),
    isolated (Note [isolated subprocesses]): only the allow-listed variables, which its
    identity names, and the private service folder as its working folder."""

    fd = trust.open_private(folder, LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        proc = subprocess.Popen(service_command(cache_dir, idle_s, size_limit),
                                stdin=subprocess.DEVNULL, stdout=fd, stderr=fd,
                                env=child_env(shared=True), close_fds=True,
                                start_new_session=True, cwd=folder)
    finally:
        os.close(fd)
    try:
        proc.wait(timeout=10)  # the first process exits once its child is on its way
    except subprocess.TimeoutExpired:
        pass


def request(cache_dir: Path, header: dict, payload: bytes = b"", start: bool = True,
            idle_s: float | None = None) -> socket.socket:
    """Send one request; returns the connection to read its answer from (``recv_msg``)."""
    limit = header.get("size_limit")
    sock = connect(cache_dir, start=start, idle_s=idle_s,
                   size_limit=limit if isinstance(limit, int) else None)
    try:
        send_msg(sock, {"protocol": PROTOCOL, "code": _code(), **header}, payload)
    except OSError as err:
        sock.close()
        raise ServiceUnavailable(f"sending to the compile service: {err}") from None
    return sock


def status(cache_dir: Path) -> dict | None:
    """The running service's counts, or None when none runs."""
    try:
        sock = request(cache_dir, {"op": "status"}, start=False)
    except ServiceUnavailable:
        return None
    try:
        sock.settimeout(10)
        return recv_msg(sock)[0]
    except (OSError, EOFError, ValueError):
        return None
    finally:
        sock.close()


def stop(cache_dir: Path, timeout: float = 10.0) -> bool:
    """Ask a running service to exit now (helpers included); True if one was running."""
    try:
        sock = request(cache_dir, {"op": "stop"}, start=False)
    except ServiceUnavailable:
        return False
    try:
        sock.settimeout(timeout)
        header, _ = recv_msg(sock)
        pid = int(header.get("pid", 0))
    except (OSError, EOFError, ValueError):
        return True
    finally:
        sock.close()
    deadline = time.monotonic() + timeout
    while pid and time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    return True


# ---- the service ----------------------------------------------------------------------------------
class _Job:
    def __init__(self, key: str, header: dict, payload: bytes) -> None:
        self.key = key
        self.header = header
        self.payload = payload
        self.done = threading.Event()
        self.answer: dict = {}
        self.data = b""
        self.queued_at = time.monotonic()
        self.waiters = 1


class _Helper:
    """One compile helper process (compile_process.serve) and the thread feeding it."""

    def __init__(self, service: Service) -> None:
        from adaptive_eager.compile_process import helper_command

        self.service = service
        self.proc = subprocess.Popen(  # Note [isolated subprocesses]
            helper_command(), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=None, close_fds=True, env=child_env(shared=True),
            cwd=service.folder)
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def send_raw(self, payload: bytes) -> tuple:
        from adaptive_eager.compile_process import _HEADER, _read

        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(_HEADER.pack(len(payload)) + payload)
        self.proc.stdin.flush()
        return _read(self.proc.stdout)

    def loop(self) -> None:
        svc = self.service
        with svc.cond:
            svc.warming += 1
        try:
            self.warm_up()
        except Exception as err:
            svc.note(f"helper warm-up failed: {type(err).__name__}: {err}")
        finally:
            with svc.cond:
                svc.warming -= 1
                svc.last_activity = time.monotonic()
        while True:
            job = svc.next_job(self)
            if job is None:
                svc.helper_gone(self)  # stopping, or this helper died while idle
                return
            if self.proc.poll() is not None:  # died before taking it: the job waits for another
                svc.requeue(job)
                svc.helper_gone(self)
                return
            start = time.monotonic()
            try:
                status, payload, seconds = self.send_raw(job.payload)
            except Exception as err:  # the helper died: this job fails, the helper is replaced
                svc.finish(job, {"status": "helper_died", "error": f"{type(err).__name__}: "
                                 f"{err}"}, b"", start)
                svc.helper_gone(self)
                return
            if status == "ok":
                svc.finish(job, {"status": "ok", "compile_s": seconds}, payload, start)
            elif status in ("error", "transient"):  # Note [transient compile failures]
                svc.finish(job, {"status": "error", "transient": status == "transient",
                                 "error": str(payload)[-2000:], "compile_s": seconds}, b"",
                           start)
            else:
                svc.finish(job, {"status": status, "error": str(payload)[-2000:],
                                 "compile_s": seconds}, b"", start)

    def warm_up(self) -> None:
        """Imports, the VecISA pick and Inductor's first-graph set-up, before any request
        needs them (Note [helper warm-up] in compile_process.py)."""
        import pickle

        kernels = self.service.kernel_dir()
        pch = self.service.headers_fit()
        status, detail, seconds = self.send_raw(pickle.dumps(("warm_up", kernels, False, pch)))
        with self.service.cond:
            idle = not self.service.queue
        if idle and status == "ok":  # Inductor's first-graph set-up (precompiled header too),
            # unless a real compile is waiting: that one pays it with no tiny kernel first
            status, more, extra = self.send_raw(pickle.dumps(("warm_up", kernels, True, pch)))
            detail, seconds = f"{detail}, {more.split(', ')[-1]}", seconds + extra
        self.service.note(f"helper {self.proc.pid} warmed up in {seconds:.1f}s ({status}: "
                          f"{str(detail)[:300]})")

    def close(self, timeout: float = 5.0) -> None:
        """Close its pipes and reap it (killed if it does not exit within ``timeout``)."""
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()




class Service:
    def __init__(self, cache_dir: Path, idle_s: float, size_limit: int = 0) -> None:
        self.cache_dir = trust.check_root(cache_dir, create=True)
        self.folder = service_dir(self.cache_dir)
        self.idle_s = idle_s
        self.size_limit = size_limit  # of the program that started it (0: unknown)
        self.cond = threading.Condition()
        self.queue: collections.deque[_Job] = collections.deque()
        self.jobs: dict[str, _Job] = {}
        self.helpers: list[_Helper] = []
        self.max_helpers = max(1, min(4, os.cpu_count() or 1))
        self.busy = 0  # helpers compiling now
        self.warming = 0  # helpers still warming up (the service does not idle out meanwhile)
        self.last_activity = time.monotonic()
        self.stopping = False
        self.counts = collections.Counter()
        self._disk: Any = None
        self._disk_lock = threading.Lock()

    def note(self, text: str) -> None:
        try:
            sys.stderr.write(f"{time.strftime('%H:%M:%S')} service {os.getpid()}: {text}\n")
            sys.stderr.flush()
        except Exception:
            pass

    def kernel_dir(self) -> str:
        """Where warm-up puts Inductor's kernels: the cache's own folder (Note [Inductor kernel
        folder]); each compile request carries its client's choice."""
        return str(trust.private_subdir(self.cache_dir, "inductor"))

    def headers_fit(self) -> bool | None:
        """Whether warm-up may build precompiled headers (Note [kernel pins])."""

        return None if not self.size_limit else self.size_limit >= pins.PCH_MIN_LIMIT

    def disk(self, size_limit: int) -> Any:
        with self._disk_lock:
            if self._disk is None:
                from adaptive_eager.cache.disk import DiskCache

                self._disk = DiskCache(self.cache_dir, size_limit)
            return self._disk

    # ---- jobs --------------------------------------------------------------------------------
    def submit(self, header: dict, payload: bytes) -> tuple[_Job | None, dict, bytes]:
        """A job to wait for, or an answer at once (the program is already on disk)."""
        key = str(header.get("key", ""))
        with self.cond:
            self.last_activity = time.monotonic()
            job = self.jobs.get(key)
            if job is not None:
                job.waiters += 1
                self.counts["shared"] += 1
                return job, {"shared": True}, b""
        try:
            found = self.disk(int(header.get("size_limit", 2 << 30))).get_program(
                key, str(header.get("torch", "")))
        except Exception:
            found = None
        if found is not None:
            self.counts["from_disk"] += 1
            return None, {"status": "ok", "from_disk": True, "stored": True}, found["artifact"]
        with self.cond:
            job = self.jobs.get(key)
            if job is not None:  # arrived meanwhile
                job.waiters += 1
                self.counts["shared"] += 1
                return job, {"shared": True}, b""
            job = self.jobs[key] = _Job(key, header, payload)
            self.queue.append(job)
            self.counts["requests"] += 1
            idle_helpers = len(self.helpers) - self.busy
            if idle_helpers < len(self.queue) and len(self.helpers) < self.max_helpers:
                self.start_helper()
            self.cond.notify_all()
        return job, {}, b""

    def start_helper(self) -> None:
        try:
            self.helpers.append(_Helper(self))
        except Exception as err:
            self.note(f"cannot start a compile helper: {err}")

    def next_job(self, helper: _Helper) -> _Job | None:
        """The next queued job for ``helper``; None when stopping or the helper died idle."""
        with self.cond:
            while not self.queue and not self.stopping:
                if helper.proc.poll() is not None:
                    return None
                self.cond.wait(1.0)
            if self.stopping:
                return None
            self.busy += 1
            return self.queue.popleft()

    def requeue(self, job: _Job) -> None:
        """A job taken by a helper that had died: first in line again."""
        with self.cond:
            self.busy -= 1
            self.queue.appendleft(job)
            self.cond.notify_all()

    def finish(self, job: _Job, answer: dict, data: bytes, start: float) -> None:
        answer["queued_s"] = round(start - job.queued_at, 4)
        if answer.get("status") == "ok" and data:
            try:
                h = job.header
                self.disk(int(h.get("size_limit", 2 << 30))).put_program(
                    job.key, str(h.get("torch", "")), str(h.get("backend", "")), data,
                    {"n_ops": h.get("n_ops"), "compile_s": answer.get("compile_s", 0.0),
                     "by": "service"})
                answer["stored"] = True
            except Exception as err:
                self.note(f"storing {job.key[:16]} failed: {err}")
                answer["stored"] = False
            self.counts["compiles"] += 1
        else:
            self.counts["failed"] += 1
        self.note(f"{job.header.get('label', job.key[:16])}: {answer.get('status')} after "
                  f"{time.monotonic() - job.queued_at:.1f}s (queued {answer['queued_s']:.1f}s, "
                  f"{job.waiters} waiting)")
        with self.cond:
            job.answer, job.data = answer, data
            self.jobs.pop(job.key, None)
            self.busy -= 1
            self.last_activity = time.monotonic()
            job.done.set()
            self.cond.notify_all()

    def helper_gone(self, helper: _Helper) -> None:
        """A helper that died or is told to stop: reaped (no zombie stays), replaced if work
        waits."""
        with self.cond:
            known = helper in self.helpers
            if known:
                self.helpers.remove(helper)
            if known and helper.proc.poll() is not None:
                self.note(f"helper {helper.proc.pid} exited ({helper.proc.returncode})")
            if self.queue and not self.stopping:
                self.start_helper()
        helper.close(timeout=1.0 if helper.proc.poll() is None else 5.0)

    # ---- connections -------------------------------------------------------------------------
    def handle(self, conn: socket.socket) -> None:
        op = None
        try:
            if peer_uid(conn) != trust.uid():
                self.counts["refused"] += 1
                self.note("refused a peer of another user")
                return
            header, payload = recv_msg(conn)
            op = header.get("op")
            if op == "status":
                with self.cond:
                    send_msg(conn, {"pid": os.getpid(), "queued": len(self.queue),
                                    "compiling": self.busy, "helpers": len(self.helpers),
                                    "in_flight": sorted(self.jobs), **self.counts})
                return
            if op == "stop":
                send_msg(conn, {"pid": os.getpid()})
                self.shutdown()
                return
            if op != "compile" or header.get("protocol") != PROTOCOL:
                send_msg(conn, {"status": "unusable", "error": f"unknown request {op!r}"})
                return
            if header.get("code") != _code():  # Note [service identity]
                self.counts["refused_code"] += 1
                send_msg(conn, {"status": "unusable", "error": "a service of other "
                                f"adaptive_eager code ({_code()[:12]}) than the client's "
                                f"({str(header.get('code'))[:12]})"})
                return
            job, answer, data = self.submit(header, payload)
            if job is None:
                send_msg(conn, answer, data)
                return
            while not job.done.wait(1.0):
                if self.stopping:
                    return
            send_msg(conn, {**job.answer, **answer}, job.data)
        except (OSError, EOFError, ValueError):
            pass  # a requester that left: its compile goes on
        finally:
            try:
                conn.close()
            except OSError:
                pass
            if op == "compile":  # status requests do not keep a service alive
                with self.cond:
                    self.last_activity = time.monotonic()

    def idle(self) -> bool:
        with self.cond:
            return (not self.jobs and not self.queue and self.busy == 0 and not self.warming
                    and time.monotonic() - self.last_activity > self.idle_s)

    def shutdown(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def serve(self, listener: socket.socket) -> None:
        listener.settimeout(0.5)
        self.start_helper()  # warm: imports, VecISA, first-graph set-up, before any request
        while not self.stopping:
            if self.idle():
                break
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError as err:
                if err.errno in (errno.EINTR, errno.ECONNABORTED):
                    continue
                raise
            conn.settimeout(None)
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()
        self.stopping = True
        self.note(f"exiting ({dict(self.counts)})")


def main() -> None:
    """``python -I -c <boot> adaptive_eager.service main CACHE IDLE``: become the service."""
    args = sys.argv[5:]
    cache_dir, idle_s = Path(args[0]), float(args[1])
    size_limit = int(args[2]) if len(args) > 2 and args[2].isdigit() else 0
    identity()  # of the code loaded now (Note [service identity])
    if os.fork():  # detach: the starter reaps this one at once; the service is init's child
        os._exit(0)
    os.setsid() if os.getsid(0) != os.getpid() else None
    try:
        svc = Service(cache_dir, idle_s, size_limit)
    except (OSError, trust.Untrusted) as err:
        sys.stderr.write(f"adaptive_eager service: refusing {cache_dir}: {err}\n")
        os._exit(1)
    lock_fd = trust.open_private(svc.folder, lock_name(), os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + 10.0
    while True:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:
            pass
        try:  # another service holds the folder: if it listens, it serves
            _connect_once(svc.folder).close()
            os._exit(0)
        except (OSError, ServiceUnavailable):
            pass  # it is exiting (its socket is gone first): take over once it has
        if time.monotonic() > deadline:
            os._exit(1)
        time.sleep(0.1)
    sock_path = svc.folder / sock_name()
    try:
        st = os.lstat(sock_path)
        import stat as stat_mod

        if stat_mod.S_ISSOCK(st.st_mode) or stat_mod.S_ISLNK(st.st_mode):
            os.unlink(sock_path)  # a stale socket of a service that died (we hold the lock)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address, fd = _sock_address(svc.folder)
    old = os.umask(0o177)  # the socket itself 0600 (the folder is 0700 anyway)
    try:
        listener.bind(address)
    finally:
        os.umask(old)
        if fd is not None:
            os.close(fd)
    listener.listen(64)
    svc.note(f"listening for {cache_dir} (idle exit after {idle_s:.0f}s; code "
             f"{_code()[:12]}, identity {identity()})")
    try:
        svc.serve(listener)
    finally:
        try:  # first: a client from now on starts a new service, which waits for our lock
            os.unlink(sock_path)
        except OSError:
            pass
        listener.close()
        for h in list(svc.helpers):
            h.close()
        os.close(lock_fd)
    os._exit(0)
