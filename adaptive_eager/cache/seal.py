"""Sealed values: the per-cache secret and the MAC every stored value carries (Note [cache values
are data, verified first] in disk.py). A value is ``MAC(32) | "AEC2" | u32 header length |
header JSON | payload``; the MAC is checked before anything is parsed."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adaptive_eager.cache import trust
from adaptive_eager.cache.folder import SECRET_NAME
from adaptive_eager.cache.trust import Untrusted

_MAGIC = b"AEC2"
_HEAD = struct.Struct("<I")
_MAC_LEN = 32


class BadEntry(Exception):
    """A value that failed verification or parsing."""


def load_secret(directory: Path, read_only: bool, refused: Callable[[str, str], None]) -> bytes:
    """The per-cache MAC key: read only if it is this user's regular 0600 file; made when
    missing or unsound (unless the folder is read-only: then Untrusted)."""
    for _ in range(3):
        try:
            fd = trust.open_private(directory, SECRET_NAME)
        except FileNotFoundError:
            if read_only:
                raise Untrusted(f"{directory} is read-only and has no {SECRET_NAME}; "
                                "nothing in it can be verified") from None
            _create_secret(directory)
            continue
        except Untrusted as err:
            if read_only:
                raise
            refused(f"secret:{directory}", str(err))
            trust.remove_tree(directory / SECRET_NAME)  # a new key: old values fail
            continue
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            data = f.read(_MAC_LEN + 1)
        if stat.S_IMODE(st.st_mode) & 0o077 or len(data) != _MAC_LEN:
            if read_only:
                raise Untrusted(f"{directory / SECRET_NAME} is readable by others or damaged")
            refused(f"secret:{directory}", f"{directory / SECRET_NAME} is readable by others "
                    "or damaged; making a new one")
            trust.remove_tree(directory / SECRET_NAME)
            continue
        return data
    raise Untrusted(f"could not create a private {SECRET_NAME} in {directory}")


def _create_secret(directory: Path) -> None:
    tmp = f"{SECRET_NAME}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = trust.open_private(directory, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(_MAC_LEN))
            f.flush()
            os.fsync(f.fileno())
        try:  # atomic and exclusive: two processes starting at once agree on one key
            os.link(directory / tmp, directory / SECRET_NAME, follow_symlinks=False)
        except FileExistsError:
            pass
    finally:
        try:
            os.unlink(directory / tmp)
        except OSError:
            pass


class Seal:
    """Seals values under one cache's secret, and opens what it sealed."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def mac(self, key: str, body: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + b"\0" + body, hashlib.sha256).digest()

    def encode(self, key: str, header: dict, payload: bytes = b"") -> bytes:
        head = json.dumps(header, default=_jsonable, sort_keys=True).encode()
        body = _MAGIC + _HEAD.pack(len(head)) + head + payload
        return self.mac(key, body) + body

    def decode(self, key: str, blob: Any, header_only: bool = False) -> tuple[dict, bytes]:
        """Verify the MAC first, then parse; raise BadEntry for anything else."""
        if not isinstance(blob, bytes) or len(blob) < _MAC_LEN + len(_MAGIC) + _HEAD.size:
            raise BadEntry("not a value this cache wrote (old format or damaged)")
        mac, body = blob[:_MAC_LEN], blob[_MAC_LEN:]
        if not hmac.compare_digest(mac, self.mac(key, body)):
            raise BadEntry("failed verification: not written by this cache, or damaged")
        if body[:len(_MAGIC)] != _MAGIC:
            raise BadEntry("unknown value format")
        n = _HEAD.unpack_from(body, len(_MAGIC))[0]
        start = len(_MAGIC) + _HEAD.size
        try:
            header = json.loads(body[start:start + n])
        except ValueError as err:
            raise BadEntry(f"unreadable header ({err})") from None
        if not isinstance(header, dict):
            raise BadEntry("header is not a JSON object")
        return header, (b"" if header_only else body[start + n:])


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    if isinstance(obj, tuple):
        return list(obj)
    if isinstance(obj, bytes):
        return obj.hex()
    return str(obj)
