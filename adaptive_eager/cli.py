"""The ``adaptive-eager`` command: run scripts under the engine, explain and manage the cache."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from adaptive_eager import config

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'500M', '2G', '1048576' -> bytes."""
    m = _SIZE.match(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use a number with K, M, G or T")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def _cache_dir(arg: str | None) -> Path:
    from adaptive_eager.cache.disk import resolve_cache_dir

    return Path(arg).expanduser() if arg else resolve_cache_dir(config.resolve())


def _open_disk(arg: str | None) -> Any:
    from adaptive_eager.cache.disk import DiskCache

    path = _cache_dir(arg)
    disk = DiskCache.open(path, config.resolve().cache_size_mb * 1024 * 1024)
    if disk is None:
        raise SystemExit(f"adaptive-eager: cannot use cache folder {path} (see the warning above)")
    return disk


def cmd_run(ns: argparse.Namespace) -> int:
    from adaptive_eager.launch import run_script

    run_script(ns.script, ns.args)
    return 0


class _WarmDone(BaseException):
    """Raised into the script once its step budget is spent (not an Exception: the script's
    own ``except Exception`` must not swallow it)."""


def cmd_warm(ns: argparse.Namespace) -> int:
    """Note [warm command]
    ``adaptive-eager warm SCRIPT`` runs the script under the engine, as ``run`` would, but
    never stepping aside (so every trace that gets hot is recorded and compiled, none waits
    aside for another's compile), and stops it after ``--steps`` optimizer steps (or
    ``--max-seconds``). Its hot traces go to the compile service, which compiles them in
    parallel (a helper per queued compile, up to the CPU count); the command then waits for
    all of them with a progress bar and exits. The programs are in the disk cache
    (``adaptive-eager cache ls``), marked hot, with this script's name: its next run loads
    them at engine start (Note [warm start] in compile/programs.py)."""
    import runpy
    import signal
    import time

    import adaptive_eager as ae
    from adaptive_eager import compiler
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = {"n": 0}

    def count(*_: Any) -> None:
        steps["n"] += 1
        if steps["n"] >= ns.steps:
            raise _WarmDone()

    def alarm(*_: Any) -> None:
        raise _WarmDone()

    handle = register_optimizer_step_post_hook(count)
    if ns.max_seconds:
        signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, ns.max_seconds)
    sys.argv = [ns.script, *ns.args]
    sys.path.insert(0, str(Path(ns.script).resolve().parent))
    status = 0
    start = time.perf_counter()
    options: dict[str, Any] = {"step_aside": False, "compile_async": True}
    if ns.cache_dir:
        options["cache_dir"] = ns.cache_dir
    # The engine's own start-up as in an ordinary run: trace keys name op metadata by the
    # order this process first saw it (calibration first), so a run that skipped calibration
    # would key every trace differently from the run this one warms up for.
    from adaptive_eager.calibrate import calibrate

    calibrate()
    ae.enable(**options)
    try:
        runpy.run_path(ns.script, run_name="__main__")
    except _WarmDone:
        pass
    except SystemExit as err:
        status = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    except Exception as err:  # the script failed: what it compiled so far still lands
        print(f"adaptive-eager warm: the script raised {type(err).__name__}: {err}",
              file=sys.stderr)
        status = 1
    finally:
        if ns.max_seconds:
            signal.setitimer(signal.ITIMER_REAL, 0)
        handle.remove()
        ran = time.perf_counter() - start
        try:
            ae.disable()
        except Exception as err:
            print(f"adaptive-eager warm: final flush failed: {err}", file=sys.stderr)
    futures = [f for m in list(compiler._managers.values()) for f in m.in_flight]
    _progress(futures, ran, steps["n"])
    m = ae.metrics()
    directory = _cache_dir(ns.cache_dir)
    print(f"adaptive-eager warm: {m['compiles']} compiled, {m['service_shared']} compiled by "
          f"another process, {m['disk_hits']} already cached, {m['compile_errors']} failed; "
          f"programs are in {directory} (adaptive-eager cache ls)", file=sys.stderr)
    return status


def _progress(futures: list, ran: float, steps: int) -> None:
    """Wait for the compiles, with a progress bar on a terminal (a line per compile else)."""
    import concurrent.futures
    import time

    total = len(futures)
    out = sys.stderr
    tty = getattr(out, "isatty", lambda: False)()
    out.write(f"adaptive-eager warm: ran {steps} steps in {ran:.1f}s; waiting for {total} "
              f"compile{'s' if total != 1 else ''}\n")
    start = time.perf_counter()
    pending = set(futures)
    while pending:
        done, pending = concurrent.futures.wait(pending, timeout=1.0)
        finished = total - len(pending)
        elapsed = time.perf_counter() - start
        if tty:
            bar = "#" * int(30 * finished / max(total, 1))
            out.write(f"\r  [{bar:<30}] {finished}/{total} compiled, {elapsed:.0f}s")
        elif done:
            out.write(f"  {finished}/{total} compiled, {elapsed:.0f}s\n")
        out.flush()
    if tty and total:
        out.write("\n")


def cmd_report(ns: argparse.Namespace) -> int:
    from adaptive_eager.report import build_report, format_report

    if ns.html:
        from adaptive_eager.report_html import write_html

        try:
            run = write_html(_cache_dir(ns.cache_dir), Path(ns.html), run=ns.run, last=ns.last,
                             job=ns.job)
        except LookupError as err:
            print(f"adaptive-eager: {err}", file=sys.stderr)
            return 2
        except OSError as err:
            print(f"adaptive-eager: cannot write {ns.html}: {err}", file=sys.stderr)
            return 1
        print(f"wrote {ns.html} (run {run['run_id']})")
        return 0
    try:
        rep = build_report(_cache_dir(ns.cache_dir), run=ns.run, last=ns.last, job=ns.job)
    except LookupError as err:
        print(f"adaptive-eager: {err}", file=sys.stderr)
        return 2
    print(json.dumps(rep, indent=2, default=str) if ns.json else format_report(rep))
    return 0


def cmd_explain(ns: argparse.Namespace) -> int:
    from adaptive_eager.report import explain_trace, format_explain

    try:
        info = explain_trace(_cache_dir(ns.cache_dir), ns.trace)
    except LookupError as err:
        print(f"adaptive-eager: {err}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=2) if ns.json else format_explain(info))
    return 0


def cmd_cache(ns: argparse.Namespace) -> int:
    disk = _open_disk(ns.cache_dir)
    try:
        if ns.action == "ls":  # headers only: no artifact is parsed, let alone loaded
            kinds: dict[str, int] = {}
            for key in disk.keys():
                kind = key.split(":", 1)[0]
                kinds[kind] = kinds.get(kind, 0) + 1
                if kind == "program" and not ns.quiet:
                    value = disk.program_info(key)
                    if value is None:
                        print(f"program {key[8:24]}  (refused: not verified)")
                        continue
                    info = value.get("info") if isinstance(value.get("info"), dict) else {}
                    print(f"program {key[8:24]}  backend={value.get('backend', '?')}  "
                          f"ops={info.get('n_ops', '?')}  {value.get('size', 0) / 1024:.0f} KiB  "
                          f"torch={value.get('torch', '?')}")
            print(f"{disk.directory}: " + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
                  + f"; {disk.measure() / (1 << 20):.1f} MiB")
        elif ns.action == "clear":
            from adaptive_eager.events import clear_runs

            n = disk.clear()
            runs = clear_runs(disk.directory)  # else `report` still lists runs of a cleared cache
            print(f"removed {n} entries and {runs} run logs from {disk.directory}")
        elif ns.action == "prune":
            if ns.max_size is None:
                print("adaptive-eager: cache prune needs --max-size", file=sys.stderr)
                return 2
            removed = disk.enforce_limit(rescan=True, limit=ns.max_size)
            print(f"removed {removed} entries; {disk.usage() / (1 << 20):.1f} MiB left")
    finally:
        disk.close()
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    """Verified programs, statistics and quarantine marks into one export file, checksummed
    and, with a key, signed (Note [export files] in cache/bundle.py)."""
    from adaptive_eager.cache import bundle

    secret, key_file = _export_key(ns)
    disk = _open_disk(ns.cache_dir)
    try:
        n = bundle.write(Path(ns.file), _verified_entries(disk), secret)
    except OSError as err:
        print(f"adaptive-eager: cannot write {ns.file}: {err}", file=sys.stderr)
        return 1
    finally:
        disk.close()
    how = (f"signed with {key_file}" if secret is not None else
           "not signed: checksums only; sign with --key-file to vouch for it across machines")
    print(f"exported {n} entries to {ns.file} ({how})")
    return 0


def _verified_entries(disk: Any) -> Any:
    """(key, header, payload) of every entry that verifies and passes its checks."""
    for key in disk.keys():
        entry = disk.get_entry(key)
        if entry is not None:  # failed verification or its checks: not exported
            yield key, entry[0], entry[1]


def cmd_import(ns: argparse.Namespace) -> int:
    """Entries from an export file, all of them or none: the file is read and checked whole
    (checksums; the signature with a key) before anything is stored (Note [export files]).
    Importing signs the entries with this cache's key: programs are code, so this is you
    vouching for them."""
    import sqlite3
    import tempfile

    from adaptive_eager.cache import bundle
    from adaptive_eager.cache.seal import BadEntry

    secret, _ = _export_key(ns)
    disk = _open_disk(ns.cache_dir)
    try:
        if disk.read_only:
            return _refused(ns.file, f"the cache folder {disk.directory} is read-only")
        with tempfile.TemporaryFile() as spool:
            try:
                found = bundle.read(Path(ns.file), secret, disk.size_limit, disk.size_limit,
                                    spool)
            except bundle.BundleError as err:
                return _refused(ns.file, str(err))
            try:
                n = disk.store_entries(found.items())
            except (sqlite3.Error, OSError, BadEntry) as err:
                return _refused(ns.file, f"storing failed ({err})")
    finally:
        disk.close()
    print(f"imported {n} entries into {disk.directory}")
    if secret is None:
        print(f"adaptive-eager: {ns.file} is not signed: its checksums show it is undamaged, not "
              "who made it (sign exports with --key-file to check that)", file=sys.stderr)
    return 0


def _refused(file: str, why: str) -> int:
    print(f"adaptive-eager: import of {file} refused: {why}; nothing was imported",
          file=sys.stderr)
    return 1


def _export_key(ns: argparse.Namespace) -> tuple[bytes | None, str | None]:
    """The secret of --key-file, else of ADAPTIVE_EAGER_EXPORT_KEY_FILE, else none."""
    from adaptive_eager.cache import trust

    path = ns.key_file or config.resolve().export_key_file
    if not path:
        return None, None
    try:
        return trust.read_key_file(path), path
    except trust.Untrusted as err:
        raise config.ConfigError(f"{err} (--key-file or "
                                 f"{config.setting('export_key_file').env})") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="adaptive-eager", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a Python script with the engine on")
    r.add_argument("script")
    r.add_argument("args", nargs=argparse.REMAINDER)
    r.set_defaults(fn=cmd_run)
    w = sub.add_parser("warm", help="run a script for a few steps and compile its traces ahead "
                       "of time (the next run starts fused)")
    w.add_argument("--steps", type=int, default=20,
                   help="stop the script after this many optimizer steps (default 20)")
    w.add_argument("--max-seconds", type=float, default=0.0,
                   help="also stop it after this many seconds (default: no limit)")
    w.add_argument("--cache-dir", default=None)
    w.add_argument("script")
    w.add_argument("args", nargs=argparse.REMAINDER)
    w.set_defaults(fn=cmd_warm)
    for name, fn, helptext in (("report", cmd_report, "what the cache hit, missed, and why"),
                               ("explain", cmd_explain, "the ops of one trace and its history")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--cache-dir", default=None)
        s.add_argument("--json", action="store_true", help="machine-readable output")
        s.set_defaults(fn=fn)
        if name == "report":
            g = s.add_mutually_exclusive_group()
            g.add_argument("--run", default=None, help="a run id (or its prefix)")
            g.add_argument("--last", action="store_true", help="only the newest run")
            g.add_argument("--job", default=None,
                           help="only the runs of one distributed job: its id (or prefix), "
                                "or 'last' for the newest job")
            s.add_argument("--html", metavar="FILE", default=None,
                           help="write the newest selected run as one self-contained HTML page "
                                "(timeline, time saved, flush causes, payback ledger)")
        else:
            s.add_argument("trace", help="a trace id (or its prefix)")
    c = sub.add_parser("cache", help="list, clear or prune the disk cache")
    c.add_argument("action", choices=("ls", "clear", "prune"))
    c.add_argument("--max-size", type=parse_size, default=None, help="for prune, e.g. 500M")
    c.add_argument("--cache-dir", default=None)
    c.add_argument("--quiet", action="store_true")
    c.set_defaults(fn=cmd_cache)
    for name, fn in (("export", cmd_export), ("import", cmd_import)):
        s = sub.add_parser(name, help=f"{name} a warm cache as one file")
        s.add_argument("file")
        s.add_argument("--cache-dir", default=None)
        s.add_argument("--key-file", default=None,
                       help="a private file (0600, at least 32 bytes) whose secret signs the "
                            "file (export) and must have signed it (import); default "
                            "$ADAPTIVE_EAGER_EXPORT_KEY_FILE, else unsigned (checksums only)")
        s.set_defaults(fn=fn)
    return p


def main(argv: list[str] | None = None, default_command: str | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if default_command and (not args or args[0] not in (
            "run", "warm", "report", "explain", "cache", "export", "import", "-h", "--help")):
        args = [default_command, *args]
    ns = build_parser().parse_args(args)
    try:
        rc = int(ns.fn(ns) or 0)
        if ns.fn is not cmd_run and ns.fn is not cmd_warm:
            sys.stdout.flush()  # a closed pipe surfaces here, not in the interpreter's exit
        return rc
    except config.ConfigError as err:
        print(f"adaptive-eager: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        if ns.fn is cmd_run or ns.fn is cmd_warm:  # the user's script's own pipe
            raise
        return _closed_pipe()


def _closed_pipe() -> int:
    """`report | head`: the reader left. Exit quietly as a Unix tool does (Python docs, "Note on
    SIGPIPE"): point stdout at devnull so the flush at exit does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by a closed pipe


if __name__ == "__main__":
    raise SystemExit(main())
