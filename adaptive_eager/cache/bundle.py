"""Export files: cache entries in one tar.gz that carries its own integrity.

Note [export files]
``adaptive-eager export FILE`` writes a gzip-compressed ustar archive of plain files, in order:

* ``export.json``: the manifest, ``{"format": "adaptive-eager-export", "version": 2, "signed":
  bool, "key_id": hex or null, "members": [{"name", "size", "sha256"}, ...]}``, listing every
  member after the signature with its length and SHA-256;
* ``export.sig`` (signed files only): HMAC-SHA256, in hex, under the secret of the key file
  (``--key-file`` or ``ADAPTIVE_EAGER_EXPORT_KEY_FILE``), of ``"adaptive-eager export 2\\0"``
  followed by the exact bytes of ``export.json``; ``key_id`` names the key (an HMAC of a fixed
  text, so it tells keys apart without revealing them);
* ``manifest.json``: the entries, ``[{"key", "value": header, "artifact": name or null}]``;
* ``artifacts/N.bin``: the programs' artifacts, raw bytes.

Import reads the file once, front to back, as a stream: nothing is extracted and no member is
read whole before its length is known to be within bounds. Each header is parsed here (never by
tarfile's reader, which would follow pax and GNU long-name members of any length): a member
that is not a plain file (a link, a folder, a device, a pax header), a name that is not one of
the above (``..``, absolute paths), a length over its bound, a member not in the manifest, a
length or SHA-256 that differs from it, a missing member, a damaged or truncated gzip stream
(its CRC and length are checked: the stream is read to its end) or data after the archive:
each refuses the whole file with one line. With a key, the signature is checked (constant time)
before the manifest is parsed; an unsigned file is then refused, as is a signed file imported
without its key. Then every entry is checked as the cache checks what it reads (Note [cache
values are checked] in values.py), and only when all of that passed are the entries stored, in
one transaction: all or nothing. The count printed is the count stored.

Without a key the checksums still catch a damaged file, but not an attacker, who can change an
artifact and its checksum alike: signing is what makes a file trustworthy across machines.
Artifacts are spooled to an unnamed temporary file while they are checked, so memory holds one
artifact at a time. Version 1 files (a ``manifest.json`` and artifacts, no checksums) are
refused with a request to export again.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import hmac
import io
import json
import os
import re
import stat
import tarfile
import time
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from adaptive_eager.cache.disk import entry_problem

FORMAT_NAME = "adaptive-eager-export"
VERSION = 2
INDEX = "export.json"
SIGNATURE = "export.sig"
ENTRIES = "manifest.json"
_ARTIFACT = re.compile(r"^artifacts/[0-9]{1,9}\.bin$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
INDEX_MAX = 16 << 20
ENTRIES_MAX = 256 << 20
MEMBER_MAX = 900_000_000  # below SQLite's largest value (1e9 bytes by default)
MEMBERS_MAX = 1 << 20
_SIG_MAX = 256
_TRAILER_MAX = 1 << 20  # zero padding after the archive's end (tar pads to 10 KiB records)
_CHUNK = 1 << 20
_CONTEXT = b"adaptive-eager export 2\0"
_KEY_ID = b"adaptive-eager export key id"
_KINDS = {tarfile.SYMTYPE: "a symbolic link", tarfile.LNKTYPE: "a hard link",
          tarfile.DIRTYPE: "a folder", tarfile.CHRTYPE: "a device", tarfile.BLKTYPE: "a device",
          tarfile.FIFOTYPE: "a pipe", tarfile.XHDTYPE: "a pax header",
          tarfile.XGLTYPE: "a pax header", tarfile.GNUTYPE_LONGNAME: "a GNU long name",
          tarfile.GNUTYPE_LONGLINK: "a GNU long link", tarfile.GNUTYPE_SPARSE: "a sparse file"}
LEGACY = ("it was written by an earlier version of adaptive-eager (no checksums); export it "
          "again with this version")


class BundleError(Exception):
    """An export file refused; the message is the one line the user sees."""


def key_id(secret: bytes) -> str:
    return hmac.new(secret, _KEY_ID, hashlib.sha256).hexdigest()[:16]


def sign(secret: bytes, index: bytes) -> str:
    return hmac.new(secret, _CONTEXT + index, hashlib.sha256).hexdigest()


# ---- writing ------------------------------------------------------------------------------------
def write(path: Path, entries: Iterable[tuple[str, dict, bytes]], secret: bytes | None) -> int:
    """Write ``entries`` as an export file at ``path`` (whole or not at all); returns how many."""
    items: list[dict] = []
    members: list[dict] = []
    with _spool() as spool:
        for i, (key, header, payload) in enumerate(entries):
            item: dict[str, Any] = {"key": key, "value": header, "artifact": None}
            if payload:
                item["artifact"] = f"artifacts/{i}.bin"
                spool.write(payload)
                members.append({"name": item["artifact"], "size": len(payload),
                                "sha256": hashlib.sha256(payload).hexdigest()})
            items.append(item)
        listing = json.dumps(items, sort_keys=True).encode()
        members.insert(0, {"name": ENTRIES, "size": len(listing),
                           "sha256": hashlib.sha256(listing).hexdigest()})
        index = json.dumps({"format": FORMAT_NAME, "version": VERSION,
                            "signed": secret is not None,
                            "key_id": key_id(secret) if secret is not None else None,
                            "members": members}, sort_keys=True).encode()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with tarfile.open(tmp, "w:gz", format=tarfile.USTAR_FORMAT) as tar:
                _add(tar, INDEX, len(index), io.BytesIO(index))
                if secret is not None:
                    sig = sign(secret, index).encode()
                    _add(tar, SIGNATURE, len(sig), io.BytesIO(sig))
                _add(tar, ENTRIES, len(listing), io.BytesIO(listing))
                spool.seek(0)
                for m in members[1:]:
                    _add(tar, m["name"], m["size"], spool)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return len(items)


def _add(tar: tarfile.TarFile, name: str, size: int, data: IO[bytes]) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o600, int(time.time())
    tar.addfile(info, data)


def _spool() -> IO[bytes]:
    import tempfile

    return tempfile.TemporaryFile()  # unnamed, private to this process


# ---- reading ------------------------------------------------------------------------------------
class Bundle:
    """A verified export file: its entries, their artifacts in the spool."""

    def __init__(self, signed: bool, entries: list[tuple[str, dict, str | None]],
                 spooled: dict[str, tuple[int, int]], spool: IO[bytes]) -> None:
        self.signed = signed
        self.entries = entries
        self._spooled = spooled
        self._spool = spool

    def items(self) -> Iterator[tuple[str, dict, bytes]]:
        """(key, header, payload), one artifact in memory at a time."""
        for key, header, artifact in self.entries:
            payload = b""
            if artifact is not None:
                offset, size = self._spooled[artifact]
                self._spool.seek(offset)
                payload = self._spool.read(size)
            yield key, header, payload


def read(path: Path, secret: bytes | None, artifact_max: int, total_max: int,
         spool: IO[bytes]) -> Bundle:
    """Read and check the whole export file at ``path`` (Note [export files]); raise
    BundleError saying what is wrong. Artifacts go to ``spool``; nothing is stored."""
    with _open(path) as f, _damage():
        stream = _Stream(f)
        members = _members(stream)
        index_bytes = _first(stream, members)
        nxt = next(members, None)
        sig = None
        if nxt is not None and nxt[0] == SIGNATURE:
            if nxt[1] > _SIG_MAX:
                raise BundleError(f"{SIGNATURE} is {nxt[1]} bytes long; a signature is 64")
            sig = stream.member(nxt[1])[0]
            nxt = next(members, None)
        _check_signature(secret, sig, index_bytes)
        listing, signed = _parse_index(index_bytes, artifact_max, total_max)
        if signed != (sig is not None):
            raise BundleError(f"{INDEX} and {SIGNATURE} disagree on whether the file is signed")
        entries_bytes, found = _read_members(stream, members, nxt, listing, spool)
        stream.trailer()
    entries = _parse_entries(entries_bytes, listing)
    return Bundle(signed, entries, found, spool)


def _read_members(stream: _Stream, members: Iterator[tuple[str, int]],
                  nxt: tuple[str, int] | None, listing: dict[str, tuple[int, str]],
                  spool: IO[bytes]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The members after the manifest, each checked against it: the entries' JSON, and where
    in ``spool`` each artifact lies (offset, size)."""
    found: dict[str, tuple[int, int]] = {}
    entries = b""
    while nxt is not None:
        name, size = nxt
        _expect(listing, found, name, size)
        if name == ENTRIES:
            entries, digest = stream.member(size)
            found[name] = (0, size)
        else:
            offset = spool.tell()
            digest = stream.member(size, spool)[1]
            found[name] = (offset, size)
        if digest != listing[name][1]:
            raise BundleError(f"member {name} does not match its SHA-256 in the manifest "
                              "(the file was altered or damaged)")
        nxt = next(members, None)
    missing = sorted(set(listing) - set(found))
    if missing:
        raise BundleError(f"member {missing[0]} is in the manifest but not in the file "
                          f"({len(missing)} missing: truncated?)")
    return entries, found


@contextlib.contextmanager
def _open(path: Path) -> Iterator[IO[bytes]]:
    try:  # O_NONBLOCK: a pipe planted under the name must not block the open
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise BundleError(f"cannot open it ({err.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BundleError("not a plain file")
    with os.fdopen(fd, "rb") as f:
        yield f


@contextlib.contextmanager
def _damage() -> Iterator[None]:
    """The gzip layer's errors as one line each."""
    try:
        yield
    except EOFError:
        raise BundleError("the file is truncated (the compressed stream ends early)") from None
    except gzip.BadGzipFile as err:
        if "Not a gzipped file" in str(err):
            raise BundleError("not a gzip file: not an adaptive-eager export file") from None
        raise BundleError(f"the file is damaged ({err})") from None
    except zlib.error as err:
        raise BundleError(f"the file is damaged (bad compressed data: {err})") from None


class _Stream:
    """The decompressed archive, read in bounded pieces."""

    def __init__(self, f: IO[bytes]) -> None:
        self._gz = gzip.GzipFile(fileobj=f, mode="rb")

    def exact(self, n: int) -> bytes:
        data = self._gz.read(n)
        if len(data) != n:
            raise BundleError("the file is truncated (the archive ends inside a member)")
        return data

    def member(self, size: int, sink: IO[bytes] | None = None) -> tuple[bytes, str]:
        """A member's data (kept only without ``sink``) and its SHA-256; skips its padding."""
        h = hashlib.sha256()
        kept = []
        left = size
        while left:
            piece = self.exact(min(left, _CHUNK))
            h.update(piece)
            if sink is None:
                kept.append(piece)
            else:
                sink.write(piece)
            left -= len(piece)
        self.exact(-size % 512)
        return b"".join(kept), h.hexdigest()

    def trailer(self) -> None:
        """Read to the end of the gzip stream (which checks its CRC and length): only the
        archive's zero padding may follow its end."""
        seen = 0
        while True:
            try:
                piece = self._gz.read(_CHUNK)
            except gzip.BadGzipFile as err:
                if "Not a gzipped file" not in str(err):
                    raise
                raise BundleError("data follows the end of the archive") from None
            if not piece:
                return
            seen += len(piece)
            if seen > _TRAILER_MAX or piece.count(0) != len(piece):
                raise BundleError("data follows the end of the archive")


def _members(stream: _Stream) -> Iterator[tuple[str, int]]:
    """(name, size) of each member, from its ustar header; the caller reads its data."""
    while True:
        block = stream.exact(512)
        if block == bytes(512):
            return
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError as err:
            raise BundleError(f"a damaged member header ({err})") from None
        if info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
            what = _KINDS.get(info.type, f"of type {info.type!r}")
            raise BundleError(f"member {info.name!r} is {what}; an export file holds plain "
                              "files only")
        if info.name not in (INDEX, SIGNATURE, ENTRIES) and not _ARTIFACT.match(info.name):
            raise BundleError(f"member {info.name!r} is not part of an export file")
        yield info.name, info.size


def _first(stream: _Stream, members: Iterator[tuple[str, int]]) -> bytes:
    try:
        first = next(members, None)
    except BundleError as err:
        if "not part of an export file" in str(err):
            raise BundleError(f"{err}: not an adaptive-eager export file") from None
        raise
    if first is None:
        raise BundleError("an empty archive: not an adaptive-eager export file")
    name, size = first
    if name != INDEX:
        raise BundleError(LEGACY if name == ENTRIES or _ARTIFACT.match(name)
                          else f"it starts with {name}: not an adaptive-eager export file")
    if size > INDEX_MAX:
        raise BundleError(f"{INDEX} is {size} bytes long (at most {INDEX_MAX})")
    return stream.member(size)[0]


def _check_signature(secret: bytes | None, sig: bytes | None, index: bytes) -> None:
    """With a key: the signature must be there and match. Without: the file must be unsigned."""
    if secret is None:
        if sig is not None:
            raise BundleError("the file is signed: give its key with --key-file or "
                              "ADAPTIVE_EAGER_EXPORT_KEY_FILE to import it")
        return
    if sig is None:
        raise BundleError("the file is not signed, and a key was given (--key-file or "
                          "ADAPTIVE_EAGER_EXPORT_KEY_FILE): export it again with that key")
    if hmac.compare_digest(sig, sign(secret, index).encode()):
        return
    try:  # only to say which: the manifest is not used
        theirs = json.loads(index).get("key_id")
    except Exception:
        theirs = None
    if isinstance(theirs, str) and theirs != key_id(secret):
        raise BundleError(f"the file was signed with another key (key id {theirs[:16]}; "
                          f"yours is {key_id(secret)})")
    raise BundleError("its signature does not match: the file was altered after it was signed")


def _parse_index(data: bytes, artifact_max: int, total_max: int
                 ) -> tuple[dict[str, tuple[int, str]], bool]:
    """The manifest as {member: (size, sha256)} and whether it says the file is signed."""
    try:
        index = json.loads(data)
    except ValueError as err:
        raise BundleError(f"{INDEX} is not JSON ({err})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT_NAME:
        raise BundleError(f"{INDEX} is not an adaptive-eager export manifest")
    version = index.get("version")
    if type(version) is int and version > VERSION:
        raise BundleError(f"it is export format {version}, newer than this version of "
                          f"adaptive-eager reads ({VERSION}): update adaptive-eager")
    if version != VERSION or type(index.get("signed")) is not bool:
        raise BundleError(f"{INDEX}: bad 'version' or 'signed'")
    members = index.get("members")
    if type(members) is not list or len(members) > MEMBERS_MAX:
        raise BundleError(f"{INDEX}: 'members' is not a list of at most {MEMBERS_MAX}")
    listing: dict[str, tuple[int, str]] = {}
    for m in members:
        name, size, digest = _member_row(m)
        bound = ENTRIES_MAX if name == ENTRIES else min(artifact_max, MEMBER_MAX)
        if name in listing or name in (INDEX, SIGNATURE):
            raise BundleError(f"{INDEX} lists {name} twice or out of place")
        if size > bound:
            raise BundleError(f"member {name} is {_mib(size)} long; at most {_mib(bound)} is "
                              "accepted (the cache's size limit: ADAPTIVE_EAGER_CACHE_SIZE_MB)")
        listing[name] = (size, digest)
    if ENTRIES not in listing:
        raise BundleError(f"{INDEX} does not list {ENTRIES}")
    total = sum(s for n, (s, _) in listing.items() if n != ENTRIES)
    if total > total_max:
        raise BundleError(f"its programs take {_mib(total)}, more than this cache's size limit "
                          f"of {_mib(total_max)} (ADAPTIVE_EAGER_CACHE_SIZE_MB)")
    return listing, index["signed"]


def _member_row(m: Any) -> tuple[str, int, str]:
    if type(m) is not dict:
        raise BundleError(f"{INDEX}: a member row is not an object")
    name, size, digest = m.get("name"), m.get("size"), m.get("sha256")
    if type(name) is not str or (name != ENTRIES and not _ARTIFACT.match(name)):
        raise BundleError(f"{INDEX} lists a member named {str(name)[:80]!r}")
    if type(size) is not int or size < 0 or type(digest) is not str or not _SHA256.match(digest):
        raise BundleError(f"{INDEX}: member {name} has a bad size or sha256")
    return name, size, digest


def _expect(listing: dict[str, tuple[int, str]], found: dict[str, tuple[int, int]], name: str,
            size: int) -> None:
    """Before reading a member: it is listed, new, and as long as the manifest says."""
    if name not in listing:
        raise BundleError(f"member {name} is not in the manifest")
    if name in found:
        raise BundleError(f"member {name} appears twice")
    if size != listing[name][0]:
        raise BundleError(f"member {name} is {size} bytes long; the manifest says "
                          f"{listing[name][0]}")


def _parse_entries(data: bytes, listing: dict[str, tuple[int, str]]
                   ) -> list[tuple[str, dict, str | None]]:
    try:
        items = json.loads(data)
    except ValueError as err:
        raise BundleError(f"{ENTRIES} is not JSON ({err})") from None
    if type(items) is not list:
        raise BundleError(f"{ENTRIES} is not a list of entries")
    out: list[tuple[str, dict, str | None]] = []
    keys: set[str] = set()
    for i, item in enumerate(items):
        if type(item) is not dict:
            raise BundleError(f"{ENTRIES}: entry {i} is not an object")
        key, header, artifact = item.get("key"), item.get("value"), item.get("artifact")
        label = f"entry {i} ({str(key)[:48]})"
        if artifact is not None and (type(artifact) is not str or artifact == ENTRIES
                                     or artifact not in listing):
            raise BundleError(f"{label}: its artifact {str(artifact)[:80]!r} is not in the file")
        size = 0 if artifact is None else listing[artifact][0]
        why = entry_problem(key, header, size)
        if why is not None:
            raise BundleError(f"{label}: {why}")
        if key in keys:
            raise BundleError(f"{label}: the key appears twice")
        keys.add(key)
        out.append((key, header, artifact))
    return out


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
