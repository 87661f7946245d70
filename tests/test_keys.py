"""Trace digests are process-independent: the disk cache's keys must not depend on the order in
which a process first met each shape."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import adaptive_eager as ae

_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import adaptive_eager as ae
    from adaptive_eager.cache.memory import TRIE
    if sys.argv[1] == "other-shapes-first":  # intern other metadata before the trace's own
        with ae.adaptive_eager(backend="replay", step_aside=False):
            for n in (3, 5, 7):
                (torch.ones(n, n) * 2).sum().item()
        ae.clear_caches()
    x, w = torch.ones(8, 8), torch.full((8,), 0.5)
    with ae.adaptive_eager(backend="replay", step_aside=False):
        for _ in range(3):
            (torch.tanh(x * 1.5 + w) @ x).sum().item()
    print(json.dumps(sorted(e.digest for e in TRIE.entry_list)))
""")


def _digests(mode: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_digest_independent_of_shape_interning_order() -> None:
    plain, shuffled = _digests("plain"), _digests("other-shapes-first")
    assert plain and plain == shuffled, (plain, shuffled)


# ---- Note [bool keys]: True == 1 in a dict, never in a trace key --------------------------------
_B = torch.tensor((0, 1), dtype=torch.bool)
_SCALAR_CALLS = {
    "positional": lambda s: _B + s,  # aten.add.Tensor(self, other): the Scalar keyed by value
    "keyword": lambda s: torch.ops.aten.add.Tensor(_B, other=s),
    "where": lambda s: torch.where(_B, _B, s),
    "fill": lambda s: torch.full((2,), s),
}


@pytest.mark.parametrize("accel", [True, False])
@pytest.mark.parametrize("call", _SCALAR_CALLS)
def test_bool_and_int_scalars_are_other_traces(call: str, accel: bool) -> None:
    """A trace recorded with ``True`` is never replayed for ``1`` (nor ``1`` for ``True``, or
    either for ``1.0``): dtypes and values equal eager's whichever came first."""
    fn = _SCALAR_CALLS[call]
    order = (True, True, True, 1, 1, 1, 1.0, 1.0, True, False, 0, 0, False)
    want = [fn(s) for s in order]
    with ae.adaptive_eager(backend="replay", step_aside=False, check=True, accel=accel):
        got = [fn(s) for s in order]
    for s, w, g in zip(order, want, got):
        assert g.dtype == w.dtype and torch.equal(g, w), (s, w, g)
