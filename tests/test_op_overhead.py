"""benchmarks/op_overhead's record floor: the C handler builds here and answers every op with
one fresh wrapper (what the benchmark's floor row times), leaving real tensors untouched."""

from __future__ import annotations

import shutil
import sysconfig

import pytest
import torch

from benchmarks import op_overhead as O


@pytest.mark.skipif(shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) is None,
                    reason="no C compiler")
def test_floor_mode_hands_out_one_wrapper_per_op() -> None:
    x, y = torch.zeros(16), torch.ones(16)
    outs = []
    with O.FloorMode():
        z = x
        for _ in range(5):
            z = torch.add(z, y)
            outs.append(z)
    assert all(type(t) is O.WrapperFloor and t.shape == (16,) for t in outs)
    assert len({id(t) for t in outs}) == 5 and outs[0]._ae_slot == 0
    assert torch.equal(x, torch.zeros(16)) and torch.equal(y, torch.ones(16))
    rows = []
    for program in O.FLOOR_PROGRAMS:
        s = O.PlainSampler(program, O.PROGRAMS[program](torch.device("cpu")), lambda: None,
                           O.FLOOR_PATH)
        s.safe_round(2)
        rows += s.rows()
    assert all(not r.note.startswith("ERROR") and r.us_per_op and r.ops_per_rep
               for r in rows), rows
