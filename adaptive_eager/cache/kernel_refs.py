"""Which of Inductor's kernel files a stored program uses: named in its artifact at compile time,
read back by the disk cache when it stores the program and when it evicts (Note [program
entries]). A leaf: no torch, nothing of ours (the compile service stores programs too).

Note [program entries]
The size limit evicts whole program entries: a program's row together with the kernel files
that only it uses, least recently used first (Note [cache size] in disk.py). Inductor names
every file it writes for a kernel after one key, ``c`` and 51 base32 characters (a hash of the
source and its compile command), in the folder ``key[1:3]``: ``2w/c2wh....py`` (the program's
Python wrapper), ``yx/cyxy....main.cpp`` and ``.main.so`` (a C++ kernel), the lock
``locks/<key>.lock``. A program's kernels are not all findable from its artifact: the artifact
holds the wrapper's source and key, but a C++ kernel's key hashes its source with the compile
command, computed by Inductor when it loads. So the process that compiled the program, which
has the wrapper and every kernel it loaded in ``sys.modules`` (the wrapper's globals are the
kernels, each from a module named after its key), names them when it serializes: a block after
the guard block, ``AEK1 | u32 length | keys joined by ","`` (``pack``). That process is the only
one that knows them exactly, even for a kernel an earlier compile already built (no file is
written then, so watching the folder during the compile would miss it). The artifact carries the
block through the helper, the compile service, the remote store and export; the disk cache reads
it when the program is stored (``keys_in``, no torch needed) into its table of references.

A key no stored program names is an orphan (the VecISA probe's test kernels, AOTAutograd's own
cache entries, what an evicted or failed compile left) and is evicted on its own, by age. A
program stored without a block (an earlier format) names nothing: its kernels are orphans, and
if they are evicted, its next load rebuilds them from the source in its artifact (seconds of
C++ compiler in that load, not a failure), as it would for kernels the user deleted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

TAG = b"AEK1"
KEY = re.compile(r"c[a-z0-9]{51}")
KEY_BYTES = re.compile(rb"c[a-z0-9]{51}")
_BUILD_KEY = 35  # b"AE1" and 32 bytes naming the torch build (backends/inductor.py)
_GUARDS = b"AEG1"  # the guard block, which comes first (Note [program shape guards])
_MAX_KEYS = 4096


def is_key(name: str) -> bool:
    """Whether ``name`` is an Inductor file key (Note [program entries])."""
    return len(name) == 52 and KEY.fullmatch(name) is not None


def pack(keys: Iterable[str]) -> bytes:
    """The block naming ``keys`` (empty when there are none)."""
    good = sorted({k for k in keys if is_key(k)})[:_MAX_KEYS]
    if not good:
        return b""
    body = ",".join(good).encode()
    return TAG + len(body).to_bytes(4, "big") + body


def unpack(rest: memoryview) -> tuple[list[str], memoryview]:
    """(keys, what follows) from the bytes after the guard block; no block: ([], rest)."""
    if bytes(rest[:4]) != TAG:
        return [], rest
    n = int.from_bytes(rest[4:8], "big")
    if len(rest) < 8 + n:
        raise ValueError("truncated program")
    return _keys(bytes(rest[8:8 + n])), rest[8 + n:]


def keys_in(artifact: bytes | memoryview) -> list[str]:
    """The kernel keys an Inductor artifact names ([] for any other, or a damaged one)."""
    data = memoryview(artifact)
    if bytes(data[:3]) != b"AE1" or len(data) < _BUILD_KEY:
        return []
    pos = _BUILD_KEY
    if bytes(data[pos:pos + 4]) == _GUARDS:
        pos += 8 + int.from_bytes(data[pos + 4:pos + 8], "big")
    try:
        return unpack(data[pos:])[0]
    except ValueError:
        return []


def _keys(body: bytes) -> list[str]:
    try:
        text = body.decode("ascii")
    except UnicodeDecodeError:
        return []
    return [k for k in text.split(",") if is_key(k)][:_MAX_KEYS]
