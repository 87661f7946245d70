"""Exceptions the floors above share."""

from __future__ import annotations


class Unsupported(Exception):
    """An op input the engine does not model; the op runs eagerly instead."""
