"""Interned tensor metadata: ``Meta``, one object per distinct (size, stride, offset, dtype,
device, view bits), numbered in interning order.

Trace keys and trie nodes hold a metadata's number (``mid``) or the object itself, so equal
metadata compares by identity. The C accelerator looks keys up in ``_METAS`` itself and interns
nothing (Note [C accelerator] in _hot.c): mids keep the Python path's order. This module imports
nothing of the package, so everything above it may.
"""

from __future__ import annotations

from typing import Any

import torch


class Meta:
    """Interned tensor metadata: equal metadata is the same object with the same ``mid``."""

    __slots__ = ("size", "stride", "offset", "dtype", "device", "bits", "mid", "key",
                 "wrapper_args")

    def __init__(self, key: tuple, mid: int) -> None:
        self.key = key
        self.size, self.stride, self.offset, self.dtype, self.device, self.bits = key
        self.mid = mid
        # _make_wrapper_subclass's arguments after the class, made once per metadata (an
        # offset of None parses faster than 0 and means 0)
        self.wrapper_args = (self.size, self.stride, self.offset or None, None, self.dtype,
                             torch.strided, self.device)

    def __repr__(self) -> str:
        return (f"Meta(size={tuple(self.size)}, stride={self.stride}, offset={self.offset}, "
                f"dtype={self.dtype}, device={self.device}, bits={self.bits})")


_METAS: dict[tuple, Meta] = {}
METAS_BY_ID: list[Meta] = []  # mid -> Meta, for explaining keys (reports)


CONJ, NEG = 1, 2  # Meta.bits: the conjugate and negative view bits (complex views)


def intern_meta(size: Any, stride: tuple, offset: int, dtype: torch.dtype,
                device: torch.device, bits: int = 0) -> Meta:
    key = (tuple(size), tuple(stride), offset, dtype, device, bits)
    m = _METAS.get(key)
    if m is None:
        m = _METAS[key] = Meta(key, len(_METAS))
        METAS_BY_ID.append(m)
    return m


def meta_of(t: torch.Tensor) -> Meta:
    """Metadata of a real tensor (call with torch-function modes off: these are tensor methods)."""
    bits = (CONJ if t.is_conj() else 0) | (NEG if t.is_neg() else 0)
    return intern_meta(t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, bits)
