"""The ways a workload is run, side by side. Each (workload, size, mode) is one fresh subprocess.

Modes in one ``cache_group`` share their cache directories for a (workload, size): the first runs
cold and fills them, the ``_warm`` one is a second fresh process that finds them filled. Engine
options a mode asks for (``backend``, ``cache_dir``) are probed in the worker and dropped, with a
note, when this version of adaptive_eager does not accept them yet.
"""

from __future__ import annotations

import dataclasses
from typing import Any

CACHE_DIR = "{cache_dir}"  # placeholder for the group's engine cache directory


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    kind: str  # "eager" | "engine" | "compile"
    description: str
    options: tuple[tuple[str, Any], ...] = ()  # engine options wanted (values may be CACHE_DIR)
    cache_group: str | None = None  # modes sharing cache dirs; None = a private fresh dir
    primer: str | None = None  # the mode that must run first to fill the shared cache


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("eager", "eager", "plain eager PyTorch"),
    Mode("engine_replay", "engine", "adaptive_eager(backend='replay'): op-by-op replay",
         options=(("backend", "replay"),)),
    Mode("engine", "engine", "adaptive_eager() with default options, cold caches",
         options=(("cache_dir", CACHE_DIR),), cache_group="engine"),
    Mode("engine_warm", "engine", "adaptive_eager(), fresh process, engine's cache dir reused",
         options=(("cache_dir", CACHE_DIR),), cache_group="engine", primer="engine"),
    Mode("torch_compile", "compile", "torch.compile(step), fresh Inductor cache",
         cache_group="compile"),
    Mode("torch_compile_warm", "compile", "torch.compile(step), fresh process, warm Inductor cache",
         cache_group="compile", primer="torch_compile"),
)}

# Baselines for the ratio columns, in order of preference.
EAGER_BASELINE = ("eager",)
COMPILE_BASELINE = ("torch_compile", "torch_compile_warm")


def wanted_options(mode: Mode, cache_dir: str) -> dict[str, Any]:
    """The engine options this mode asks for, with the cache directory filled in."""
    return {k: (cache_dir if v == CACHE_DIR else v) for k, v in mode.options}


def parse_modes(text: str | None) -> list[Mode]:
    """``a,b`` -> those modes in suite order; None -> all. Unknown names raise ValueError."""
    if not text:
        return list(MODES.values())
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    return [m for m in MODES.values() if m.name in names]


def probe_engine_options(ae: Any, wanted: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Keep the options this adaptive_eager accepts; note the ones it does not (yet)."""
    accepted: dict[str, Any] = {}
    notes: list[str] = []
    for key, value in wanted.items():
        try:
            ae.adaptive_eager(**{key: value})
        except TypeError:
            notes.append(f"option {key} unsupported, not passed")
        except ValueError as err:
            notes.append(f"option {key}={value!r} rejected ({err}), not passed")
        else:
            accepted[key] = value
    return accepted, notes
