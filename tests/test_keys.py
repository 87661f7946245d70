"""Trace digests are process-independent: the disk cache's keys must not depend on the order in
which a process first met each shape."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

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
