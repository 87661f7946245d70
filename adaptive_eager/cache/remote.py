"""An opt-in program store shared by machines: ``ADAPTIVE_EAGER_REMOTE_CACHE=redis://host:port/db``.

Note [remote program store]
Ranks on many machines compile the same traces; one machine's program can serve them all. The
store is Redis (Inductor's own remote cache speaks it too; redis-py), holding programs under
the same keys as the disk cache (``program_key``, Note [program key]: trace and program plan,
the engine's code fingerprint, torch build, backend options, ambient state), and each one's plan
under a key known before it (Note [remote program plan]). It sits behind the disk cache: a
disk miss asks the store, and a verified entry is written into the disk cache (signed there
with the local key, as every local entry is) and loaded from it as usual; a program compiled
here is published to the store once it is on disk.

A program is code and a Redis server is a place others can write, so the store is trusted
only through a shared secret: ``ADAPTIVE_EAGER_REMOTE_CACHE_KEY_FILE`` names a file of at least
32 bytes, private to the user (mode 0600 or stricter, owned by them), the same on every machine
of the job. Every value is ``MAGIC | len(header) | header JSON | artifact | HMAC-SHA256(secret,
redis key | header | artifact)``; the tag is checked (constant time) before the header is
parsed, then the header must name this format, this torch version, the key asked for, the
artifact's size and SHA-256. Anything else is refused and counted (``refused``), never loaded.
Without a usable key file the store is not used at all (one warning): an entry nobody can
verify is never trusted. Connection errors switch the store off for the rest of the process
(counted, logged once); the disk cache and compiles go on as without it.

Note [remote program plan]
A program's key holds its plan (Note [program key]): which Python numbers are lifted to inputs
and which are baked in, the lifted ones being those seen to change between the trace's runs.
A process that has only just met the trace (a fresh machine: no statistics on disk, one run
seen) knows no number that varies, so the key it computes at the trace's first run is not the
key of the program another machine compiled after watching its numbers (an optimizer's step
count, bias corrections): every lookup missed and each machine compiled again. So next to
each program the store holds its plan (``PLAN_PREFIX``), under a key a process computes from
the trace alone (digest, live slots, and the code, torch, backend and ambient parts of
Note [program key]). A disk miss reads the plan, builds the graph with those numbers lifted
(lifting more numbers than this process has seen change is always correct: they become inputs)
and looks the program up under the key it then computes itself; that key also binds the baked
numbers, so a program compiled for other constants is never found. The plan is signed and
verified as programs are (the HMAC binds its Redis key, prefix included: a program entry is
never read as a plan nor the reverse) and must parse as a list of positions; anything else is
refused and counted. A later publisher overwrites it (numbers found to vary only grow).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import logging
import os
import struct
import threading
from typing import Any

from adaptive_eager import config
from adaptive_eager.cache import trust

log = logging.getLogger("adaptive_eager")

URL_ENV = config.setting("remote_cache").env  # every variable is declared in config.py
KEY_ENV = config.setting("remote_cache_key_file").env
MAGIC = b"AERC1"
FORMAT = 1
MIN_SECRET = 32
TIMEOUT_S = 2.0
PREFIX = "adaptive_eager:program:"
PLAN_PREFIX = "adaptive_eager:plan:"  # Note [remote program plan]

STATS: collections.Counter[str] = collections.Counter()


class RemoteError(RuntimeError):
    """The remote store cannot be used (bad URL, no key, an unusable key file)."""


def _read_secret(path: str) -> bytes:
    try:
        return trust.read_key_file(path, MIN_SECRET)
    except trust.Untrusted as err:
        raise RemoteError(f"{KEY_ENV}: {err}") from None


class RemoteCache:
    """Programs in Redis, each value authenticated with the shared secret (module Note)."""

    def __init__(self, url: str, secret: bytes, client: Any = None) -> None:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise RemoteError(f"{URL_ENV}={url!r}: expected redis://host:port/db")
        if client is None:
            try:
                import redis
            except ImportError:
                raise RemoteError(f"{URL_ENV} is set but redis-py is not installed "
                                  "(pip install redis)") from None
            client = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S,
                                          socket_connect_timeout=TIMEOUT_S)
        self.url = url
        self._secret = secret
        self._client = client
        self.broken: str | None = None
        self._lock = threading.Lock()

    # ---- encoding -----------------------------------------------------------------------------
    def _tag(self, rkey: bytes, header: bytes, artifact: bytes) -> bytes:
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in (rkey, header, artifact):
            mac.update(struct.pack(">Q", len(part)))
            mac.update(part)
        return mac.digest()

    def encode(self, key: str, torch_version: str, backend: str, artifact: bytes,
               info: dict, prefix: str = PREFIX) -> bytes:
        header = json.dumps({"format": FORMAT, "torch": torch_version, "backend": backend,
                             "key": key, "size": len(artifact),
                             "sha256": hashlib.sha256(artifact).hexdigest(), "info": info},
                            sort_keys=True).encode()
        tag = self._tag((prefix + key).encode(), header, artifact)
        return MAGIC + struct.pack(">I", len(header)) + header + artifact + tag

    def decode(self, key: str, torch_version: str, value: bytes,
               prefix: str = PREFIX) -> dict | None:
        """The entry stored at ``prefix + key`` if it verifies, else None (counted as refused)."""
        try:
            if not value.startswith(MAGIC) or len(value) < len(MAGIC) + 4 + 32:
                return self._refuse(key, "not an entry of this format")
            (n,) = struct.unpack(">I", value[len(MAGIC):len(MAGIC) + 4])
            start = len(MAGIC) + 4
            header, artifact, tag = (value[start:start + n], value[start + n:-32], value[-32:])
            if not hmac.compare_digest(tag, self._tag((prefix + key).encode(), header,
                                                      artifact)):
                return self._refuse(key, "signature does not verify (another key, or altered)")
            meta = json.loads(header)
        except Exception as err:  # malformed: refused, never half-used
            return self._refuse(key, f"malformed ({type(err).__name__})")
        if (meta.get("format") != FORMAT or meta.get("key") != key
                or meta.get("torch") != torch_version or meta.get("size") != len(artifact)
                or meta.get("sha256") != hashlib.sha256(artifact).hexdigest()):
            return self._refuse(key, "for another key or torch version, or a bad checksum")
        return {**meta, "artifact": bytes(artifact)}

    def _refuse(self, key: str, why: str) -> None:
        STATS["refused"] += 1
        log.warning("adaptive_eager: remote program %s refused: %s", key[:16], why)
        return None

    # ---- store --------------------------------------------------------------------------------
    def get_program(self, key: str, torch_version: str) -> dict | None:
        value = self._call("get", PREFIX + key)
        if value is None:
            STATS["misses"] += 1
            return None
        entry = self.decode(key, torch_version, value)
        if entry is not None:
            STATS["hits"] += 1
        return entry

    def put_program(self, key: str, torch_version: str, backend: str, artifact: bytes,
                    info: dict) -> bool:
        """Publish (never overwriting an entry already there: first writer wins)."""
        value = self.encode(key, torch_version, backend, artifact, info)
        done = self._call("set", PREFIX + key, value, nx=True)
        if done:
            STATS["published"] += 1
        return bool(done)

    def get_plan(self, key: str, torch_version: str) -> tuple[int, ...] | None:
        """The lifted positions published for ``key`` (Note [remote program plan]), or None."""
        value = self._call("get", PLAN_PREFIX + key)
        if value is None:
            STATS["plan_misses"] += 1
            return None
        entry = self.decode(key, torch_version, value, PLAN_PREFIX)
        if entry is None:
            return None
        try:
            lifted = json.loads(entry["artifact"])["lifted"]
            if not (isinstance(lifted, list)
                    and all(type(i) is int and 0 <= i for i in lifted)):
                raise ValueError("lifted is not a list of positions")
        except Exception as err:  # signed by a holder of the secret, still never half-used
            return self._refuse(key, f"plan malformed ({type(err).__name__}: {err})")
        STATS["plan_hits"] += 1
        return tuple(lifted)

    def put_plan(self, key: str, torch_version: str, lifted: tuple[int, ...]) -> bool:
        """Publish a program's plan (overwriting: the numbers seen to vary only grow)."""
        artifact = json.dumps({"lifted": sorted(lifted)}).encode()
        value = self.encode(key, torch_version, "plan", artifact, {}, PLAN_PREFIX)
        return bool(self._call("set", PLAN_PREFIX + key, value))

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self.broken is not None:
            return None
        try:
            return getattr(self._client, name)(*args, **kwargs)
        except Exception as err:
            STATS["errors"] += 1
            self.broken = f"{type(err).__name__}: {err}"
            log.warning("adaptive_eager: remote program store %s unavailable (%s); going on "
                        "without it", self.url, self.broken)
            return None


# ---- the process's store, and the two calls the compile manager makes ------------------------
_store: RemoteCache | None = None
_configured: tuple[str, str] | None = None  # (URL, key file) the store above was made for


def from_env(environ: Any = None) -> RemoteCache | None:
    """The store ``ADAPTIVE_EAGER_REMOTE_CACHE`` names, or None (unset, or unusable: warned)."""
    global _store, _configured
    env = os.environ if environ is None else environ
    url = env.get(URL_ENV, "").strip()
    key_file = env.get(KEY_ENV, "")
    if (url, key_file) == _configured:
        return _store
    _configured, _store = (url, key_file), None
    if not url:
        return None
    try:
        if not key_file:
            raise RemoteError(f"{URL_ENV} is set but {KEY_ENV} is not: entries nobody can "
                              "verify are never trusted")
        _store = RemoteCache(url, _read_secret(key_file))
    except RemoteError as err:
        STATS["config_errors"] += 1
        log.warning("adaptive_eager: remote program store not used: %s", err)
    return _store


def fetch_into(disk: Any, key: str, torch_version: str) -> bool:
    """On a disk miss: a verified program from the store, written into the disk cache (where
    the caller then finds it). False when there is no store or no verified entry."""
    remote = from_env()
    if remote is None or disk is None or getattr(disk, "read_only", False):
        return False
    entry = remote.get_program(key, torch_version)
    if entry is None:
        return False
    try:
        disk.put_program(key, torch_version, entry["backend"], entry["artifact"],
                         dict(entry.get("info") or {}, remote=remote.url))
    except Exception:
        return False
    return True


def fetch_plan(plan_key: str, torch_version: str) -> tuple[int, ...] | None:
    """The lifted positions another machine's program of this trace has, or None (Note
    [remote program plan])."""
    remote = from_env()
    return None if remote is None else remote.get_plan(plan_key, torch_version)


def publish_from(disk: Any, key: str, torch_version: str, plan_key: str = "",
                 lifted: tuple[int, ...] = ()) -> None:
    """After a compile here: the program, as the disk cache verified it, to the store, and
    then its plan under ``plan_key`` (Note [remote program plan]): a reader that finds the
    plan finds the program."""
    remote = from_env()
    if remote is None or disk is None:
        return
    try:
        value = disk.get_program(key, torch_version)
    except Exception:
        return
    if value is None or (value.get("info") or {}).get("remote"):
        return  # not stored, or it came from the store in the first place
    remote.put_program(key, torch_version, value.get("backend", ""), value["artifact"],
                       dict(value.get("info") or {}))
    if plan_key and remote.broken is None:  # published now or by another machine before
        remote.put_plan(plan_key, torch_version, lifted)


def stats() -> dict[str, int]:
    return dict(STATS)
