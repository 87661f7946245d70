"""Every ``ADAPTIVE_EAGER_*`` setting, typed, defaulted and validated in one place.

This module imports nothing else from adaptive_eager. Options reach the engine in two ways: keyword
arguments of ``adaptive_eager.adaptive_eager(**options)`` / ``enable(**options)``, or environment
variables (read when an engine starts, so tests can override them with ``monkeypatch.setenv`` or,
better, with keyword arguments).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any


class ConfigError(ValueError):
    """A setting has a value the engine cannot use."""


def _parse_bool(name: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def _parse_pos_int(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected a positive integer") from None
    if value <= 0:
        raise ConfigError(f"{name}={raw!r}: expected a positive integer")
    return value


def _int_in(lo: int, hi: int) -> Callable[[str, str], int]:
    """A parser for integers in [lo, hi] whose message says what the variable accepts."""
    what = (f"a positive integer, at most {hi}" if lo == 1 else f"an integer from {lo} to {hi}")

    def parse(name: str, raw: str) -> int:
        try:
            value = int(raw.strip().replace("_", ""))
        except ValueError:
            raise ConfigError(f"{name}={raw!r}: expected {what}") from None
        if not lo <= value <= hi:
            raise ConfigError(f"{name}={raw!r}: expected {what}")
        return value

    parse.accepts = what  # type: ignore[attr-defined]
    return parse


def _parse_str(name: str, raw: str) -> str:
    value = raw.strip()
    if not value:
        raise ConfigError(f"{name}={raw!r}: expected a non-empty value")
    return value


def _parse_redis_url(name: str, raw: str) -> str:
    value = raw.strip()
    if not value.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"{name}={raw!r}: expected redis://host:port/db "
                          "(or rediss://, unix://)")
    return value


def _parse_nonneg_int(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected an integer >= 0") from None
    if value < 0:
        raise ConfigError(f"{name}={raw!r}: expected an integer >= 0")
    return value


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _parse_log_level(name: str, raw: str) -> str:
    level = raw.strip().upper()
    if level not in _LOG_LEVELS:
        raise ConfigError(f"{name}={raw!r}: expected one of {', '.join(_LOG_LEVELS)}")
    return level


@dataclasses.dataclass(frozen=True)
class Setting:
    """One option: its keyword name, environment variable, parser, default and meaning."""

    name: str
    env: str
    parse: Callable[[str, str], Any]
    default: Any
    doc: str


SETTINGS: tuple[Setting, ...] = (
    Setting("max_trace_ops", "ADAPTIVE_EAGER_MAX_TRACE_OPS", _int_in(1, 1_000_000), 4096,
            "Longest trace before it is flushed (a sync point)."),
    Setting("check", "ADAPTIVE_EAGER_CHECK", _parse_bool, False,
            "Verify at replay that each real output has the shape/stride/dtype the lazy tensor "
            "promised (debug aid; costs ~1 us per op)."),
    Setting("log_level", "ADAPTIVE_EAGER_LOG_LEVEL", _parse_log_level, "WARNING",
            "Level of the 'adaptive_eager' logger."),
    Setting("backend", "ADAPTIVE_EAGER_BACKEND", _parse_str, "inductor",
            "Compiler for hot traces: inductor, replay (never compiles), or a name registered "
            "in the adaptive_eager.backends entry-point group."),
    Setting("hot_after", "ADAPTIVE_EAGER_HOT_AFTER", _int_in(1, 1_000_000), 3,
            "A trace is compiled once it has run this many times."),
    Setting("cache_dir", "ADAPTIVE_EAGER_CACHE_DIR", _parse_str, "",
            "Disk cache folder (default: $XDG_CACHE_HOME/adaptive_eager or "
            "~/.cache/adaptive_eager). Must be private to the user."),
    Setting("cache_size_mb", "ADAPTIVE_EAGER_CACHE_SIZE_MB", _int_in(1, 10_000_000), 2048,
            "Size limit of the cache folder (programs, Inductor kernels, run logs), 1 to "
            "10000000; least recently used programs and kernels are evicted beyond it."),
    Setting("disk_cache", "ADAPTIVE_EAGER_DISK_CACHE", _parse_bool, True,
            "Use the disk cache (off: compile in every process)."),
    Setting("crosscheck", "ADAPTIVE_EAGER_CROSSCHECK", _parse_bool, False,
            "Run every fused execution op by op too and compare; a mismatch quarantines "
            "the trace."),
    Setting("compile_async", "ADAPTIVE_EAGER_COMPILE_ASYNC", _parse_bool, True,
            "Compile in a background thread while the program keeps running op by op."),
    Setting("compile_process", "ADAPTIVE_EAGER_COMPILE_PROCESS", _parse_bool, True,
            "Compile in a helper process, so compiling never slows the program through the "
            "GIL (off: in a thread of this process)."),
    Setting("step_aside", "ADAPTIVE_EAGER_STEP_ASIDE", _parse_bool, True,
            "Leave the mode stack when measurements show no trace gains from fusion."),
    Setting("lend_core", "ADAPTIVE_EAGER_LEND_CORE", _parse_bool, True,
            "While waiting aside for a compile, run one torch thread fewer than the cores, so "
            "the compile does not stall the program's OpenMP team (Note [compile cores]); "
            "reductions may then round as with fewer threads. Off: the program's own count."),
    Setting("budget", "ADAPTIVE_EAGER_BUDGET", _int_in(0, 100), 5,
            "Percent of the run's time the engine may spend learning (recording op by op, "
            "sending traces, compiling beside the program) beyond plain eager's, counted from "
            "the start (Note [learning budget] in budget.py); until then it runs plain eager. "
            "0: no limit, record from the first op."),
    Setting("step_flush", "ADAPTIVE_EAGER_STEP_FLUSH", _parse_bool, True,
            "End the trace after every optimizer step, so each training iteration is one "
            "trace that repeats (like torch_xla's mark_step)."),
    Setting("probe_every", "ADAPTIVE_EAGER_PROBE_EVERY", _int_in(0, 1_000_000_000), 2000,
            "After stepping aside, re-enter to measure again after this many optimizer steps "
            "(0: never)."),
    Setting("workers", "ADAPTIVE_EAGER_WORKERS", _parse_bool, False,
            "Keep the engine in DataLoader worker processes (default: workers run plain "
            "eager, Note [worker processes])."),
    # the compile service (Note [compile service] in service.py)
    Setting("compile_service", "ADAPTIVE_EAGER_COMPILE_SERVICE", _parse_bool, True,
            "Compile in the per-user compile service of the cache folder, shared by processes, "
            "so compiles finish after the program exits (off: a helper of this process)."),
    Setting("service_idle_s", "ADAPTIVE_EAGER_SERVICE_IDLE_S", _int_in(1, 86_400), 120,
            "Seconds the compile service waits with nothing to do before it exits."),
    # the read guard armed only while needed (Note [read guard] in dispatch/mode.py)
    Setting("lazy_guard", "ADAPTIVE_EAGER_LAZY_GUARD", _parse_bool, True,
            "Put the read guard (a TorchFunctionMode) on the mode stack only while a real tensor "
            "has pending writes or inside torch.func transforms (off: on every torch call)."),
    # the C accelerator of the hot path (Note [C accelerator] in _hot.c)
    Setting("accel", "ADAPTIVE_EAGER_ACCEL", _parse_bool, True,
            "Record ops on known traces with the C accelerator (adaptive_eager._hot, built by "
            "pip install when a C compiler is present; without it the engine warns once). Off: "
            "the pure-Python path."),
    # the young generation's threshold while recording (Note [young collections])
    Setting("gc_headroom", "ADAPTIVE_EAGER_GC_HEADROOM", _parse_bool, True,
            "While the engine records, raise the garbage collector's young-generation threshold "
            "(when it is the interpreter's default) above what a pending trace keeps alive, so "
            "deferred ops do not set off collections (off: the threshold is left alone)."),
    # the opt-in remote program store (cache/remote.py reads these two)
    Setting("remote_cache", "ADAPTIVE_EAGER_REMOTE_CACHE", _parse_redis_url, "",
            "A Redis store shared by machines, redis://host:port/db (unset: none); needs "
            "ADAPTIVE_EAGER_REMOTE_CACHE_KEY_FILE."),
    Setting("remote_cache_key_file", "ADAPTIVE_EAGER_REMOTE_CACHE_KEY_FILE", _parse_str, "",
            "A private file (0600, yours, at least 32 bytes) holding the secret that signs "
            "remote entries; the same file on every machine."),
    # export files (Note [export files] in cache/bundle.py)
    Setting("export_key_file", "ADAPTIVE_EAGER_EXPORT_KEY_FILE", _parse_str, "",
            "A private file (0600, yours, at least 32 bytes) whose secret signs export files "
            "and is required to import them; --key-file overrides it (unset: checksums only)."),
    # variable shapes (Note [symbolic dims] in shapes.py)
    Setting("symbolic_dims", "ADAPTIVE_EAGER_SYMBOLIC_DIMS", _parse_bool, True,
            "Learn which dimensions vary (one trace for every sequence length) and keep what "
            "was learnt in the disk cache (off: every new size is a new trace)."),
    Setting("symbolic_programs", "ADAPTIVE_EAGER_SYMBOLIC_PROGRAMS", _parse_bool, True,
            "Compile a hot symbolic trace once into a dynamic-size program for every size, "
            "its first fused runs at new sizes checked against op-by-op replay (off: such "
            "traces run op by op)."),
)

# The on/off switch for unmodified scripts (read by the torch.backends entry point).
ENABLE_ENV = "ADAPTIVE_EAGER"

_BY_NAME = {s.name: s for s in SETTINGS}


def setting(name: str) -> Setting:
    """The declaration of one option (its variable, parser, default, help)."""
    return _BY_NAME[name]


@dataclasses.dataclass(frozen=True)
class Options:
    """The resolved options of one engine."""

    max_trace_ops: int = 4096
    check: bool = False
    log_level: str = "WARNING"
    backend: str = "inductor"
    hot_after: int = 3
    cache_dir: str = ""
    cache_size_mb: int = 2048
    disk_cache: bool = True
    crosscheck: bool = False
    compile_async: bool = True
    compile_process: bool = True
    step_aside: bool = True
    lend_core: bool = True  # Note [compile cores]
    budget: int = 5  # Note [learning budget]
    step_flush: bool = True
    probe_every: int = 2000
    workers: bool = False
    compile_service: bool = True
    service_idle_s: int = 120
    remote_cache: str = ""
    remote_cache_key_file: str = ""
    export_key_file: str = ""  # read by the export/import commands only
    lazy_guard: bool = True
    accel: bool = True  # the C accelerator
    gc_headroom: bool = True  # Note [young collections]
    symbolic_dims: bool = True
    symbolic_programs: bool = False  # dynamic-size programs (GPT-2's step still specializes)


def resolve(overrides: Mapping[str, Any] | None = None,
            environ: Mapping[str, str] | None = None) -> Options:
    """Options from the environment, then keyword overrides on top; bad values raise ConfigError."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for s in SETTINGS:
        raw = env.get(s.env)
        values[s.name] = s.default if raw is None else s.parse(s.env, raw)
    for key, value in (overrides or {}).items():
        setting = _BY_NAME.get(key)
        if setting is None:
            known = ", ".join(sorted(_BY_NAME))
            raise TypeError(f"adaptive_eager: unknown option {key!r}; accepted options: {known}")
        values[key] = _coerce(setting, value)
    return Options(**values)


def _coerce(setting: Setting, value: Any) -> Any:
    """Validate a keyword option with the same rules as its environment variable."""
    if isinstance(value, str):
        return setting.parse(setting.name, value)
    if isinstance(setting.default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"option {setting.name}={value!r}: expected True or False")
        return value
    if isinstance(setting.default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"option {setting.name}={value!r}: expected an integer")
        return setting.parse(setting.name, str(value))
    if hasattr(value, "__fspath__"):
        return os.fspath(value)
    raise ConfigError(f"option {setting.name}={value!r}: expected a string")


def enabled_by_env(environ: Mapping[str, str] | None = None) -> bool:
    """True when ADAPTIVE_EAGER asks for the engine to switch on for the whole program."""
    env = os.environ if environ is None else environ
    raw = env.get(ENABLE_ENV)
    return False if raw is None else _parse_bool(ENABLE_ENV, raw)
