"""Export files and the values read from the cache: checked before they are stored or used.

An export file carries its own integrity (Note [export files] in cache/bundle.py): a manifest
with a SHA-256 per member and, with a key, an HMAC over it. Import reads it as a bounded stream
and stores all of its entries or none. Every value the cache hands out passes type and range
checks first (Note [cache values are checked] in cache/values.py): a bad one is counted and
skipped, never a crash in the user's program.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import cli
from adaptive_eager.cache import bundle
from adaptive_eager.cache.disk import FORMAT, DiskCache

TORCH = torch.__version__
KERNEL = b"    tmp0 = static_cast<float>(0.5) * x;\n" * 200  # an artifact's C++ source, say
STATS = {"torch": TORCH, "hot": True, "decision": "fused: 0.1 ms vs op-by-op 0.3 ms",
         "replay_ms": 0.3, "fused_ms": 0.1, "varying": [], "samples": [], "used_at": 1.0}


# ---- helpers -----------------------------------------------------------------------------------
def fill(folder: Path) -> dict[str, tuple[dict, bytes]]:
    """A cache with two programs, their statistics and a quarantine mark; returns its entries."""
    disk = DiskCache(folder, 1 << 30)
    disk.put_program("a" * 32, TORCH, "inductor", KERNEL, {"n_ops": 3})
    disk.put_program("b" * 32, TORCH, "inductor", b"\x00\x01" * 5000, {"n_ops": 5})
    disk.put_stats("c" * 32, dict(STATS, program_key="a" * 32))
    disk.quarantine("d" * 32, "fused result differs")
    out = {k: disk.get_entry(k) for k in disk.keys()}
    disk.close()
    return out


def stored(folder: Path) -> dict[str, tuple[dict, bytes]]:
    disk = DiskCache(folder, 1 << 30)
    out = {k: disk.get_entry(k) for k in disk.keys()}
    disk.close()
    return out


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def export(capsys: pytest.CaptureFixture[str], src: Path, dest: Path, *extra: str) -> Path:
    rc, out, err = run(capsys, "export", str(dest), "--cache-dir", str(src), *extra)
    assert rc == 0, err
    return dest


def refused(capsys: pytest.CaptureFixture[str], file: Path, dest: Path, *extra: str) -> str:
    """Import ``file``: it must be refused with one line, and ``dest`` left empty."""
    rc, out, err = run(capsys, "import", str(file), "--cache-dir", str(dest), *extra)
    assert rc == 1 and out == "", (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "refused" in lines[0] and "nothing was imported" in lines[0], err
    assert "Traceback" not in err
    assert stored(dest) == {}
    return lines[0]


def members(path: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(path) as t:
        return [(m, t.extractfile(m).read() if m.isfile() else b"") for m in t.getmembers()]


def pack(path: Path, items: list[tuple[tarfile.TarInfo, bytes]],
         fmt: int = tarfile.USTAR_FORMAT) -> Path:
    with tarfile.open(path, "w:gz", format=fmt) as t:
        for info, data in items:
            if info.isfile():
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
            else:
                t.addfile(info)
    return path


def reseal(items: list[tuple[tarfile.TarInfo, bytes]], secret: bytes | None = None
           ) -> list[tuple[tarfile.TarInfo, bytes]]:
    """Recompute the manifest's checksums (as an attacker would) and, with ``secret``, sign."""
    data = {m.name: d for m, d in items}
    index = json.loads(data[bundle.INDEX])
    for row in index["members"]:
        row["size"] = len(data[row["name"]])
        row["sha256"] = hashlib.sha256(data[row["name"]]).hexdigest()
    if secret is not None:
        index["key_id"] = bundle.key_id(secret)
    raw = json.dumps(index).encode()
    out = []
    for info, d in items:
        if info.name == bundle.INDEX:
            d = raw
        elif info.name == bundle.SIGNATURE and secret is not None:
            d = bundle.sign(secret, raw).encode()
        out.append((info, d))
    return out


def edit(items: list[tuple[tarfile.TarInfo, bytes]], name: str, fn: Any
         ) -> list[tuple[tarfile.TarInfo, bytes]]:
    return [(m, fn(d) if m.name == name else d) for m, d in items]


def key_file(tmp_path: Path, name: str = "export.key", secret: bytes = b"k" * 32) -> Path:
    path = tmp_path / name
    path.write_bytes(secret)
    path.chmod(0o600)
    return path


def entries_json(entries: list[dict]) -> bytes:
    return json.dumps(entries).encode()


# ---- round trips ---------------------------------------------------------------------------------
def test_export_import_round_trip_unsigned(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                           ) -> None:
    want = fill(tmp_path / "a")
    bundle_path = export(capsys, tmp_path / "a", tmp_path / "e.tar.gz")
    rc, out, err = run(capsys, "import", str(bundle_path), "--cache-dir", str(tmp_path / "b"))
    assert rc == 0 and out.strip().startswith(f"imported {len(want)} entries"), (out, err)
    assert "not signed" in err
    assert stored(tmp_path / "b") == want


def test_export_import_round_trip_signed(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    want = fill(tmp_path / "a")
    key = key_file(tmp_path)
    bundle_path = export(capsys, tmp_path / "a", tmp_path / "e.tar.gz", "--key-file", str(key))
    assert bundle.SIGNATURE in [m.name for m, _ in members(bundle_path)]
    monkeypatch.setenv("ADAPTIVE_EAGER_EXPORT_KEY_FILE", str(key))  # the variable works too
    rc, out, err = run(capsys, "import", str(bundle_path), "--cache-dir", str(tmp_path / "b"))
    assert rc == 0 and f"imported {len(want)} entries" in out and err == "", (out, err)
    assert stored(tmp_path / "b") == want


# ---- the reproducer: one constant changed in a kernel's source -----------------------------------
def test_export_with_a_changed_kernel_constant_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Repacked with 0.5 -> 0.6 in an artifact: imported, signed and run before (wrong
    results); its checksum no longer matches."""
    fill(tmp_path / "a")
    items = members(export(capsys, tmp_path / "a", tmp_path / "e.tar.gz"))
    changed = [(m, d.replace(b"static_cast<float>(0.5)", b"static_cast<float>(0.6)"))
               for m, d in items]
    assert changed != items
    line = refused(capsys, pack(tmp_path / "t.tar.gz", changed), tmp_path / "b")
    assert "does not match its SHA-256" in line


def test_signed_export_altered_and_resealed_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Checksums recomputed after the change: only the signature can tell, and it does."""
    fill(tmp_path / "a")
    key = key_file(tmp_path)
    items = members(export(capsys, tmp_path / "a", tmp_path / "e.tar.gz", "--key-file",
                           str(key)))
    changed = reseal([(m, d.replace(b"(0.5)", b"(0.6)")) for m, d in items])
    line = refused(capsys, pack(tmp_path / "t.tar.gz", changed), tmp_path / "b",
                   "--key-file", str(key))
    assert "altered after it was signed" in line
    resigned = pack(tmp_path / "o.tar.gz", reseal(changed, b"o" * 32))  # with another key
    line = refused(capsys, resigned, tmp_path / "b", "--key-file", str(key))
    assert "signed with another key" in line


def test_key_and_signature_must_go_together(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                            ) -> None:
    """A key given: an unsigned file is refused (an attacker cannot strip the signature). No
    key: a signed file is refused (it asks for its key)."""
    fill(tmp_path / "a")
    key = key_file(tmp_path)
    unsigned = export(capsys, tmp_path / "a", tmp_path / "u.tar.gz")
    assert "not signed" in refused(capsys, unsigned, tmp_path / "b", "--key-file", str(key))
    signed = export(capsys, tmp_path / "a", tmp_path / "s.tar.gz", "--key-file", str(key))
    assert "give its key" in refused(capsys, signed, tmp_path / "b")
    stripped = [(m, d) for m, d in members(signed) if m.name != bundle.SIGNATURE]
    assert "disagree" in refused(capsys, pack(tmp_path / "x.tar.gz", stripped), tmp_path / "b")


@pytest.mark.parametrize("problem", ["loose", "short", "link", "missing"])
def test_unusable_key_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       problem: str) -> None:
    fill(tmp_path / "a")
    key = key_file(tmp_path)
    if problem == "loose":
        key.chmod(0o644)
    elif problem == "short":
        key.write_bytes(b"k" * 8)
    elif problem == "link":
        os.symlink(key, tmp_path / "link.key")
        key = tmp_path / "link.key"
    else:
        key = tmp_path / "nowhere.key"
    for cmd in ("export", "import"):
        rc, out, err = run(capsys, cmd, str(tmp_path / "e.tar.gz"), "--cache-dir",
                           str(tmp_path / "a"), "--key-file", str(key))
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "key file" in err, err
    assert not (tmp_path / "e.tar.gz").exists()


# ---- the reproducer: damaged, truncated, odd members -------------------------------------------
def test_damaged_export_is_refused_never_stored(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A flipped bit anywhere in the compressed data: refused (gzip CRC, checksums), or at
    worst (bits deflate ignores) imported byte for byte as exported, never altered."""
    want = fill(tmp_path / "a")
    good = export(capsys, tmp_path / "a", tmp_path / "e.tar.gz").read_bytes()
    start = good.index(b"\0", 10) + 1  # after gzip's header and its file name (not checked)
    for i, pos in enumerate(range(start, len(good), max(1, (len(good) - start) // 24))):
        damaged = bytearray(good)
        damaged[pos] ^= 0x10
        path = tmp_path / f"flip{i}.tar.gz"
        path.write_bytes(bytes(damaged))
        dest = tmp_path / f"b{i}"
        rc, out, err = run(capsys, "import", str(path), "--cache-dir", str(dest))
        assert "Traceback" not in err
        assert (rc == 1 and stored(dest) == {}) or (rc == 0 and stored(dest) == want), (pos, err)


def test_truncated_export_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill(tmp_path / "a")
    good = export(capsys, tmp_path / "a", tmp_path / "e.tar.gz").read_bytes()
    for cut in (200, 20, 1, len(good) // 2, len(good) - 30):
        path = tmp_path / f"cut{cut}.tar.gz"
        path.write_bytes(good[:-cut])
        assert "truncated" in refused(capsys, path, tmp_path / "b")


def _info(name: str, kind: bytes, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


@pytest.mark.parametrize("odd,why", [
    (_info("zz-link", tarfile.SYMTYPE, "/etc/shadow"), "a symbolic link"),
    (_info("artifacts/7.bin", tarfile.LNKTYPE, "manifest.json"), "a hard link"),
    (_info("artifacts", tarfile.DIRTYPE), "a folder"),
    (_info("artifacts/8.bin", tarfile.FIFOTYPE), "a pipe"),
    (_info("artifacts/9.bin", tarfile.CHRTYPE), "a device"),
    (tarfile.TarInfo("../../outside.bin"), "not part of an export file"),
    (tarfile.TarInfo("/tmp/absolute.bin"), "not part of an export file"),
    (tarfile.TarInfo("artifacts/../x.bin"), "not part of an export file"),
    (tarfile.TarInfo("artifacts/99.bin"), "not in the manifest"),
])
def test_odd_members_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 odd: tarfile.TarInfo, why: str) -> None:
    """Links, folders, devices, names outside the file's own: refused whole, even when the
    odd member comes last (nothing half-imported)."""
    fill(tmp_path / "a")
    items = members(export(capsys, tmp_path / "a", tmp_path / "e.tar.gz"))
    path = pack(tmp_path / "odd.tar.gz", [*items, (odd, b"x" * 10)])
    assert why in refused(capsys, path, tmp_path / "b")


def test_link_in_place_of_an_artifact_is_refused(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    fill(tmp_path / "a")
    items = members(export(capsys, tmp_path / "a", tmp_path / "e.tar.gz"))
    swapped = [(_info(m.name, tarfile.SYMTYPE, "/etc/passwd"), b"") if m.name.startswith(
        "artifacts/") else (m, d) for m, d in items]
    assert "a symbolic link" in refused(capsys, pack(tmp_path / "l.tar.gz", swapped),
                                        tmp_path / "b")


def test_pax_and_duplicate_and_missing_members_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill(tmp_path / "a")
    items = members(export(capsys, tmp_path / "a", tmp_path / "e.tar.gz"))
    items[0][0].pax_headers = {"comment": "x" * 10}
    pax = pack(tmp_path / "pax.tar.gz", items, fmt=tarfile.PAX_FORMAT)
    assert "a pax header" in refused(capsys, pax, tmp_path / "b")
    items[0][0].pax_headers = {}
    twice = pack(tmp_path / "twice.tar.gz", [*items, items[-1]])
    assert "appears twice" in refused(capsys, twice, tmp_path / "b")
    short = pack(tmp_path / "short.tar.gz", items[:-1])
    assert "not in the file" in refused(capsys, short, tmp_path / "b")
    reordered = pack(tmp_path / "order.tar.gz", items[1:] + items[:1])  # the manifest last
    refused(capsys, reordered, tmp_path / "b")


def test_trailing_data_and_other_files_are_refused(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    fill(tmp_path / "a")
    good = export(capsys, tmp_path / "a", tmp_path / "e.tar.gz").read_bytes()
    (tmp_path / "tail.tar.gz").write_bytes(good + gzip.compress(b"more data"))
    assert "follows the end" in refused(capsys, tmp_path / "tail.tar.gz", tmp_path / "b")
    (tmp_path / "junk.tar.gz").write_bytes(good + b"junk after the gzip stream")
    assert "follows the end" in refused(capsys, tmp_path / "junk.tar.gz", tmp_path / "b")
    (tmp_path / "plain.txt").write_bytes(b"hello")
    assert "not a gzip file" in refused(capsys, tmp_path / "plain.txt", tmp_path / "b")
    assert "cannot open" in refused(capsys, tmp_path / "missing.tar.gz", tmp_path / "b")
    assert "not a plain file" in refused(capsys, tmp_path, tmp_path / "b")
    other = pack(tmp_path / "other.tar.gz", [(tarfile.TarInfo("README"), b"hi")])
    assert "not an adaptive-eager export file" in refused(capsys, other, tmp_path / "b")


def test_earlier_format_asks_for_a_new_export(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Version 1 files (a manifest.json and artifacts, no checksums)."""
    manifest = entries_json([{"key": "program:" + "ab" * 16, "artifact": "artifacts/0.bin",
                              "value": {"format": FORMAT, "torch": TORCH, "backend": "inductor",
                                        "size": 3}}])
    old = pack(tmp_path / "old.tar.gz", [(tarfile.TarInfo("artifacts/0.bin"), b"abc"),
                                         (tarfile.TarInfo("manifest.json"), manifest)])
    assert "export it again with this version" in refused(capsys, old, tmp_path / "b")


# ---- the reproducer: a member that inflates to gigabytes ----------------------------------------
def _bomb_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    return info.tobuf(tarfile.GNU_FORMAT)


@pytest.mark.parametrize("shape", ["v1", "listed", "header"])
def test_oversized_member_is_refused_before_it_is_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], shape: str) -> None:
    """A member that says it is 3 GiB: refused at its header or at the manifest, never
    inflated (the file holds only a few bytes of it: reading would end in 'truncated')."""
    fill(tmp_path / "a")
    items = members(export(capsys, tmp_path / "a", tmp_path / "e.tar.gz"))
    if shape == "v1":  # the reproducer's shape: the artifact first, as version 1 wrote it
        raw = _bomb_header("artifacts/0.bin", 3 << 30) + bytes(4096)
    else:
        name = next(m.name for m, _ in items if m.name.startswith("artifacts/"))
        items = [(m, d) for m, d in items if m.name != name]
        index = json.loads(items[0][1])
        for row in index["members"]:
            if row["name"] == name and shape == "listed":
                row["size"] = 3 << 30
        items[0] = (items[0][0], json.dumps(index).encode())
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as t:
            for info, data in items:
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
            end = t.offset  # before the end-of-archive blocks
        raw = buf.getvalue()[:end] + _bomb_header(name, 3 << 30) + bytes(4096)
    path = tmp_path / "bomb.tar.gz"
    path.write_bytes(gzip.compress(raw))
    line = refused(capsys, path, tmp_path / "b")
    assert "truncated" not in line, line
    assert {"v1": "earlier version", "listed": "at most", "header": "the manifest says"}[
        shape] in line, line


def test_import_streams_members_within_the_size_limit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """A 64 MiB member (zeros: a 64 KiB file) against a 1 MiB cache: refused at the manifest,
    with little memory; under a larger limit, read in pieces, never whole, before storing."""
    disk = DiskCache(tmp_path / "a", 1 << 30)
    disk.put_program("e" * 32, TORCH, "inductor", bytes(64 << 20), {"n_ops": 1})
    disk.close()
    path = export(capsys, tmp_path / "a", tmp_path / "big.tar.gz")
    assert path.stat().st_size < 1 << 20
    monkeypatch.setenv("ADAPTIVE_EAGER_CACHE_SIZE_MB", "1")
    tracemalloc.start()
    try:
        line = refused(capsys, path, tmp_path / "b")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "size limit" in line and peak < 8 << 20, (line, peak)
    monkeypatch.setenv("ADAPTIVE_EAGER_CACHE_SIZE_MB", "1024")
    tracemalloc.start()
    try:
        with open(os.devnull, "wb") as sink:
            bundle.read(path, None, 1 << 30, 1 << 30, sink)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


# ---- the reproducer: fields of the wrong type -------------------------------------------------
BAD_STATS = [("decision", 5), ("decision", None), ("hot", "yes"), ("replay_ms", "fast"),
             ("replay_ms", -1.0), ("fused_ms", float("nan")), ("varying", "abc"),
             ("varying", [1, "x"]), ("failure", {"count": "two", "transient": True}),
             ("failure", {"error": 7}), ("samples", [{"fused_ms": "a"}]), ("used_at", "now"),
             ("program_key", 12), ("sym_sizes", [4, 8]), ("in_process", 1)]


@pytest.mark.parametrize("field,value", BAD_STATS)
def test_imported_stats_with_a_bad_field_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: Any) -> None:
    """An export whose checksums match but whose entry has a field of the wrong type (another
    version, a hand edit): refused whole, naming the field; the entry before it not stored."""
    fill(tmp_path / "a")
    items = members(export(capsys, tmp_path / "a", tmp_path / "e.tar.gz"))

    def spoil(data: bytes) -> bytes:
        entries = json.loads(data)
        entries.append({"key": "stats:" + "f" * 32, "value": dict(STATS, **{field: value}),
                        "artifact": None})
        return json.dumps(entries).encode()

    bad = reseal(edit(items, bundle.ENTRIES, spoil))
    assert repr(field) in refused(capsys, pack(tmp_path / "bad.tar.gz", bad), tmp_path / "b")


@pytest.mark.parametrize("entry", [
    {"key": "program:" + "9" * 32, "value": {"format": FORMAT, "torch": TORCH, "size": "big",
                                               "backend": "inductor"}},
    {"key": "program:" + "9" * 32, "value": {"format": FORMAT, "torch": TORCH, "size": 999,
                                               "backend": "inductor"}},  # not the artifact's
    {"key": "program:" + "9" * 32, "value": {"torch": TORCH, "size": 0, "backend": "x"}},
    {"key": "program:" + "9" * 32, "value": {"format": FORMAT, "torch": TORCH, "size": 0,
                                               "backend": "x", "info": {"n_ops": "3"}}},
    {"key": "quarantine:" + "9" * 32, "value": {"reason": 3}},
    {"key": "stats:symdims-zz-" + "9" * 32, "value": {"anchor": "zz", "steps": []}},
    {"key": "stats:" + "9" * 32, "value": ["not", "an", "object"]},
    {"key": "other:" + "9" * 32, "value": {}},
    {"key": "stats:../../x", "value": {}},
    {"key": 5, "value": {}},
    {"key": "stats:" + "9" * 32, "value": {}, "artifact": "artifacts/1.bin"},
    {"key": "program:" + "9" * 32, "value": {}, "artifact": "manifest.json"},
])
def test_imported_entries_of_every_kind_are_checked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], entry: dict) -> None:
    fill(tmp_path / "a")
    items = members(export(capsys, tmp_path / "a", tmp_path / "e.tar.gz"))
    extra = dict({"artifact": None}, **entry)
    bad = reseal(edit(items, bundle.ENTRIES, lambda d: json.dumps(
        [*json.loads(d), extra]).encode()))
    refused(capsys, pack(tmp_path / "bad.tar.gz", bad), tmp_path / "b")


def test_duplicate_keys_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill(tmp_path / "a")
    items = members(export(capsys, tmp_path / "a", tmp_path / "e.tar.gz"))
    bad = reseal(edit(items, bundle.ENTRIES, lambda d: json.dumps(
        [*json.loads(d), json.loads(d)[-1]]).encode()))
    assert "appears twice" in refused(capsys, pack(tmp_path / "d.tar.gz", bad), tmp_path / "b")


def plant(folder: Path, key: str, header: Any, payload: bytes = b"") -> None:
    """A value signed with the cache's own key (as an import of an earlier version did), whose
    fields are wrong."""
    disk = DiskCache(folder, 1 << 30)
    disk.raw_set(key, disk.encode(key, header, payload))
    disk.close()


@pytest.mark.parametrize("field,value", BAD_STATS)
def test_stored_stats_with_a_bad_field_are_skipped_and_counted(
        cache_dir: Path, field: str, value: Any) -> None:
    plant(cache_dir, "stats:" + "c" * 32, dict(STATS, **{field: value}))
    disk = DiskCache(cache_dir, 1 << 30)
    assert disk.get_stats("c" * 32) is None
    assert ae.metrics()["disk_invalid"] == 1 and ae.metrics()["disk_errors"] >= 1
    assert disk.keys() == []  # removed: the next run writes a sound one
    disk.close()


def test_good_stats_are_read_as_written(cache_dir: Path) -> None:
    disk = DiskCache(cache_dir, 1 << 30)
    value = dict(STATS, failure={"stage": "compile", "error": "x", "transient": True, "at": 1.0,
                                 "count": 2}, samples=[{"fused_ms": 0.1, "replay_ms": 0.2,
                                                        "at": 3.0}],
                 sym_sizes={"program": "a" * 32, "agreed": [4, 8], "bad": [3]}, varying=[0, 2],
                 in_process=False, error="", compile_s=None, extra_field={"any": "thing"})
    disk.put_stats("c" * 32, value)
    assert disk.get_stats("c" * 32) == value
    disk.close()
    assert ae.metrics()["disk_invalid"] == 0


def test_cache_ls_survives_a_program_with_a_bad_size(
        cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The reproducer's second half: a program whose "size" is text crashed ``cache ls``."""
    header = {"format": FORMAT, "torch": TORCH, "backend": "inductor", "size": "big"}
    plant(cache_dir, "program:" + "a" * 32, header, b"abc")
    rc, out, err = run(capsys, "cache", "ls", "--cache-dir", str(cache_dir))
    assert rc == 0 and "refused" in out and "Traceback" not in err, (out, err)
    plant(cache_dir, "program:" + "a" * 32, header, b"abc")
    rc, out, err = run(capsys, "export", str(cache_dir.parent / "e.tar.gz"), "--cache-dir",
                       str(cache_dir))
    assert rc == 0 and "exported 0 entries" in out  # a bad entry is not passed on


def test_warm_start_skips_stats_with_bad_fields(cache_dir: Path) -> None:
    """recent_programs (engine start) reads statistics headers itself."""
    plant(cache_dir, "stats:" + "c" * 32, dict(STATS, used_at="late", script="s.py",
                                               program_key="a" * 32))
    plant(cache_dir, "stats:" + "d" * 32, dict(STATS, script="s.py", program_key="b" * 32,
                                               used_at=5.0))
    disk = DiskCache(cache_dir, 1 << 30)
    disk.put_program("b" * 32, TORCH, "inductor", b"x", {"n_ops": 1})
    assert disk.recent_programs("s.py", 10) == ["b" * 32]
    disk.close()
    assert ae.metrics()["disk_invalid"] == 1


def test_symbolic_dims_with_bad_fields_are_skipped(cache_dir: Path) -> None:
    from adaptive_eager import config, shapes

    plant(cache_dir, "stats:symdims-0g-" + "a" * 32, {"anchor": "0g", "digest": "x",
                                                     "steps": [], "dims": "n"})
    plant(cache_dir, "stats:symdims-00-" + "b" * 32, {"anchor": "00", "digest": "x",
                                                     "steps": "many"})
    shapes.configure(config.resolve())
    assert ae.metrics()["disk_invalid"] == 2


def test_engine_over_stats_with_bad_fields_gives_eager_results(
        cache_dir: Path, graph_backend: Any) -> None:
    """The reproducer: a stats entry whose decision is a number crashed the program in the
    compiler (AttributeError); now it is skipped and counted, and the result is eager's."""
    x = torch.randn(32, generator=torch.Generator().manual_seed(0))
    ref = (x * 2 + 1).relu().sum().item()

    def work() -> float:
        with ae.adaptive_eager(step_aside=False, hot_after=2, backend=graph_backend.name,
                               compile_async=False):
            for _ in range(12):
                y = (x * 2 + 1).relu().sum().item()
        return y

    assert work() == ref
    disk = DiskCache(cache_dir, 1 << 30)
    keys = [k for k in disk.keys() if k.startswith("stats:")]
    assert keys
    for key in keys:
        header = disk.get_entry(key)[0]
        disk.raw_set(key, disk.encode(key, dict(header, decision=5, replay_ms="x")))
    disk.close()
    ae.disable()
    ae.clear_caches()
    ae.reset_metrics()
    assert work() == ref
    assert ae.metrics()["disk_invalid"] >= 1


def test_store_entries_is_all_or_nothing(cache_dir: Path) -> None:
    """The storing half of an import: an entry that fails its checks midway rolls back the
    ones before it (and a sound batch is stored whole, counted)."""
    from adaptive_eager.cache.seal import BadEntry

    disk = DiskCache(cache_dir, 1 << 30)
    good = [("stats:" + "1" * 32, dict(STATS), b""), ("quarantine:" + "2" * 32,
                                                       {"reason": "x", "when": 1.0}, b"")]
    with pytest.raises(BadEntry, match="decision"):
        disk.store_entries([*good, ("stats:" + "3" * 32, dict(STATS, decision=5), b"")])
    assert disk.keys() == []
    assert disk.store_entries(good) == 2 and len(disk.keys()) == 2
    disk.close()
