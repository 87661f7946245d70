"""DataLoader workers run plain eager (Note [worker processes]); batches equal eager's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import adaptive_eager as ae


class Squares(Dataset):
    """Tensor work in __getitem__, plus what the worker saw of the engine."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.arange(8, dtype=torch.float32) * (i % 7)
        modes = torch._C._len_torch_dispatch_stack() + torch._C._len_torch_function_stack()
        return x.sin().cumsum(0) / 3.0 + 1.0, torch.tensor([modes, int(ae.is_enabled())])


def _batches(context: str | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader = DataLoader(Squares(), batch_size=16, num_workers=2, multiprocessing_context=context)
    return [(x.clone(), seen.clone()) for x, seen in loader]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_run_plain_eager(context: str) -> None:
    expected = _batches(context)
    with ae.adaptive_eager(backend="replay"):
        w = torch.ones(8, requires_grad=True)
        pending = (w * 2).sum()  # a trace pending at the fork: flushed first
        got = _batches(context)
        pending.backward()
    assert len(got) == len(expected) == 4
    for (x, seen), (ex, _) in zip(got, expected):
        assert torch.equal(x, ex)
        assert seen[:, 0].eq(0).all() and seen[:, 1].eq(0).all(), seen  # no modes, no engine
    assert torch.equal(w.grad, torch.full((8,), 2.0))


def test_flagged_script_workers_start_no_engine(tmp_path: Path, cache_dir: Path) -> None:
    script = tmp_path / "load.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        from torch.utils.data import DataLoader
        from test_workers import Squares
        if __name__ == "__main__":
            for ctx in ("fork", "spawn"):
                seen = torch.cat([s for _, s in DataLoader(Squares(), batch_size=16,
                                  num_workers=2, multiprocessing_context=ctx)])
                print(ctx, int(seen.sum()))
            import adaptive_eager
            print("main", adaptive_eager.is_enabled())
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTIVE_EAGER")}
    env.update(ADAPTIVE_EAGER="1", ADAPTIVE_EAGER_CACHE_DIR=str(cache_dir),
               ADAPTIVE_EAGER_BACKEND="replay", ADAPTIVE_EAGER_BUDGET="0")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["fork", "0", "spawn", "0", "main", "True"], proc.stdout
    keep = subprocess.run([sys.executable, str(script)], env={**env, "ADAPTIVE_EAGER_WORKERS": "1"},
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert keep.returncode == 0, keep.stderr[-3000:]
    fork_seen = int(keep.stdout.split()[1])
    assert fork_seen > 0  # asked for: the workers keep the engine
