"""Fitting sizes: integer polynomials in one symbol ``s`` through observed ints, and the
patterns that match concrete keys against them (Note [symbolic dims] in shapes.py, Fitting).

Pure: this module imports nothing of the package but the metrics and core/, so shapes.py and
graph.py may use it at their top without joining the package's import circle.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import torch

from adaptive_eager.core.meta import Meta
from adaptive_eager.metrics import METRICS as M

MIN_OBS = 3  # distinct values of s before a skeleton is fitted


class Poly:
    """(c0 + c1*s + c2*s*s) / d with integer coefficients: a fitted size, stride or int."""

    __slots__ = ("c0", "c1", "c2", "d", "_h")

    def __init__(self, c0: int, c1: int, c2: int, d: int) -> None:
        self.c0, self.c1, self.c2, self.d = c0, c1, c2, d
        self._h = hash((c0, c1, c2, d))

    def __call__(self, s: int) -> int | None:
        q, r = divmod(self.c0 + s * (self.c1 + s * self.c2), self.d)
        return q if r == 0 else None

    def solve(self, v: int) -> int | None:
        """The s that gives v (degree 1 only: the symbol's own position is one)."""
        if self.c2 or not self.c1:
            return None
        q, r = divmod(v * self.d - self.c0, self.c1)
        return q if r == 0 else None

    def __eq__(self, other: object) -> bool:
        return type(other) is Poly and (self.c0, self.c1, self.c2, self.d) == (
            other.c0, other.c1, other.c2, other.d)  # type: ignore[union-attr]

    def __hash__(self) -> int:
        return self._h

    def __repr__(self) -> str:  # stable: part of template digests
        return f"P({self.c0},{self.c1},{self.c2},{self.d})"

    def text(self) -> str:
        parts = []
        for c, t in ((self.c2, "s^2"), (self.c1, "s"), (self.c0, "")):
            if c:
                parts.append(f"{c}{'*' + t if t else ''}" if c != 1 or not t else t)
        body = " + ".join(parts) or "0"
        return body if self.d == 1 else f"({body})/{self.d}"


def _fit(xs: list[int], ys: list[int]) -> int | Poly | None:
    """The lowest-degree polynomial through every point, confirmed by one point more."""
    y0 = ys[0]
    if all(y == y0 for y in ys):
        return y0
    n = len(xs)
    if n >= 3:  # affine, in integers first (the common case: no Fractions)
        x0, x1, y1 = xs[0], xs[1], ys[1]
        dx, dy = x1 - x0, y1 - y0
        if all((y - y0) * dx == dy * (x - x0) for x, y in zip(xs, ys)):
            g = _gcd(abs(dy), abs(dx)) or 1
            num, den = dy // g, dx // g
            if den < 0:
                num, den = -num, -den
            c0 = y0 * den - num * x0  # (c0 + num*s) / den
            g2 = _gcd(_gcd(abs(c0), abs(num)), den) or 1
            return Poly(c0 // g2, num // g2, 0, den // g2)
    for deg in (1, 2):
        if n < deg + 2:
            return None
        pts = list(zip(xs, ys))[:deg + 1]
        coef = [Fraction(0)] * 3
        # Lagrange interpolation through deg + 1 points, expanded into coefficients
        for i, (xi, yi) in enumerate(pts):
            basis = [Fraction(1)]
            denom = Fraction(1)
            for j, (xj, _) in enumerate(pts):
                if j != i:
                    basis = [Fraction(0)] + basis  # multiply by (s - xj)
                    for k in range(len(basis) - 1):
                        basis[k] -= xj * basis[k + 1]
                    denom *= xi - xj
            for k, b in enumerate(basis):
                coef[k] += yi * b / denom
        d = 1
        for c in coef:
            d = d * c.denominator // _gcd(d, c.denominator)
        p = Poly(int(coef[0] * d), int(coef[1] * d), int(coef[2] * d), d)
        if all(p(x) == y for x, y in zip(xs, ys)):
            return p
    return None


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def search_fit(vecs: list[list[int]], n_key: int) -> tuple[list[int], list] | None:
    """One fit of the newest observation with earlier ones of its own site (slope_fits)."""
    found = slope_fits(vecs, n_key)
    return found[0] if found else None


def _fit_rows(idx: list[int], vecs: list[list[int]], n_key: int) -> tuple[list[int], list] | None:
    rows = [vecs[i] for i in idx]
    ref = rows[0]
    first = next((j for j in range(n_key) if any(r[j] != ref[j] for r in rows)), None)
    if first is None:
        return None
    xs = [r[first] for r in rows]
    if min(xs) < 2 or len(set(xs)) != len(xs):
        return None
    fits = []
    for ys in zip(*rows):
        f = _fit(xs, list(ys))
        if f is None:
            return None
        fits.append(f)
    return idx, fits


def slope_fits(vecs: list[list[int]], n_key: int) -> list[tuple[list[int], list]]:
    """Every fit the newest observation makes with earlier ones of its own site, in O(pool):
    two observations of one site at different s agree exactly at its constant positions, so
    earlier observations are bucketed by (positions that differ from the newest, values where
    they agree); a bucket of two (three for a quadratic such as [B, H, T, T] strides) is tried."""
    new = len(vecs) - 1
    vx = vecs[new]
    buckets: dict[tuple, list[int]] = {}
    for i in range(new - 1, -1, -1):
        # None where the two differ, the shared value elsewhere: both parts of the bucket key
        key = tuple([a if a == b else None for a, b in zip(vecs[i], vx)])
        try:
            if key.index(None) >= n_key:
                continue  # the keys agree: not a different value of s
        except ValueError:
            continue  # identical observation
        buckets.setdefault(key, []).append(i)
    found = []
    for idx in buckets.values():
        for k in (MIN_OBS - 1, MIN_OBS):  # affine from three, quadratic from four
            if len(idx) >= k:
                got = _fit_rows([*reversed(idx[:k]), new], vecs, n_key)
                if got is not None:
                    found.append(got)
                    break
    return found


class ExtPat:
    """An external tensor's metadata with fitted sizes/strides (in a key: ('x', ExtPat, g))."""

    __slots__ = ("size", "stride", "dtype", "device", "bits", "_h")

    def __init__(self, size: tuple, stride: tuple, dtype: torch.dtype, device: torch.device,
                 bits: int) -> None:
        self.size, self.stride, self.dtype, self.device, self.bits = (
            size, stride, dtype, device, bits)
        self._h = hash((size, stride, dtype, device, bits))

    def match(self, m: Meta, st: list) -> bool:
        if (m.dtype != self.dtype or m.device != self.device or m.bits != self.bits
                or len(m.size) != len(self.size)):
            return False
        for t, v in zip(self.size, m.size):
            if not leaf_match(t, v, st):
                return False
        for t, v in zip(self.stride, m.stride):
            if not leaf_match(t, v, st):
                return False
        return True

    def __eq__(self, other: object) -> bool:
        return type(other) is ExtPat and self._h == other._h and (  # type: ignore[union-attr]
            self.size, self.stride, self.dtype, self.device, self.bits) == (
            other.size, other.stride, other.dtype, other.device, other.bits)  # type: ignore

    def __hash__(self) -> int:
        return self._h

    def __repr__(self) -> str:
        return f"X({self.size!r},{self.stride!r},{self.dtype},{self.device},{self.bits})"


def leaf_match(t: Any, v: Any, st: list) -> bool:
    """Whether an int ``v`` fits a fitted or static ``t``, binding s (``st[0]``) on first use."""
    if type(t) is not Poly:
        return t == v
    if type(v) is not int:
        return False
    s = st[0]
    if s is None:
        s = t.solve(v)
        if s is None:
            return False
        if s < 2:  # guard: broadcasting and contiguity rules change at 0 and 1
            M.sym_guard_fallbacks += 1
            return False
        st[0] = s
    return t(s) == v


# ---- argument kinds: which ints of a key are tensor references, which values ----------
_ARG_KINDS: dict[Any, tuple] = {}


def _tensor_type(t: Any) -> bool:
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


def arg_kinds(spec: Any) -> tuple:
    """Per op: whether each positional argument is a tensor, and the kwarg-only names."""
    got = _ARG_KINDS.get(spec)
    if got is None:
        try:
            args = spec.op._schema.arguments
            pos = tuple(_tensor_type(a.type) for a in args if not a.kwarg_only)
            kw = {a.name: _tensor_type(a.type) for a in args if a.kwarg_only}
        except AttributeError:
            pos, kw = (), {}
        got = _ARG_KINDS[spec] = (pos, kw)
    return got
