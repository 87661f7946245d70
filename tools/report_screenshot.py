"""Regenerate docs/report.png: a 200-step training run under the engine, drawn by
``adaptive-eager report --html`` and photographed by headless Chromium.

    python tools/report_screenshot.py [--out docs/report.png] [--keep DIR]

The program is a chain of elementwise ops over a 512K-element weight trained with SGD, which
fusion speeds up. It runs twice in fresh folders: a first run fills Inductor's own cache, and the
second, with an empty engine cache, is the one drawn. That run compiles in line, in this process
(ADAPTIVE_EAGER_COMPILE_ASYNC=0, ADAPTIVE_EAGER_COMPILE_PROCESS=0), so warm-up, the compile and
the fused runs after it all fit in one short run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROGRAM = """\
import torch

torch.manual_seed(0)
w = torch.randn(1 << 19, requires_grad=True)
target = torch.randn(1 << 19)
opt = torch.optim.SGD([w], lr=0.05, momentum=0.9)
for step in range(200):
    opt.zero_grad()
    y = w
    for _ in range(6):
        y = torch.sigmoid(y * 1.3 - 0.2) * 2.0 - 0.5
    loss = ((y - target) ** 2).mean()
    loss.backward()
    opt.step()
    if step % 20 == 0:
        print(f"step {step}: loss {loss.item():.4f}")
"""

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync")


def screenshot(page: Path, png: Path, size: str = "1200,1600") -> None:
    """Photograph ``page`` with headless Chromium (a fresh profile, no network features)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("report_screenshot: chromium is not installed")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                        f"--screenshot={png}", f"--window-size={size}", page.as_uri()],
                       check=True, timeout=120, capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "report.png"))
    ap.add_argument("--keep", default=None, help="leave the run's folders here")
    ns = ap.parse_args()
    work = Path(ns.keep or tempfile.mkdtemp(prefix="ae-report-"))
    work.mkdir(parents=True, exist_ok=True)
    script = work / "train_small.py"
    script.write_text(PROGRAM)
    env = {**os.environ, "ADAPTIVE_EAGER": "1", "ADAPTIVE_EAGER_COMPILE_ASYNC": "0",
           "ADAPTIVE_EAGER_COMPILE_PROCESS": "0", "ADAPTIVE_EAGER_COMPILE_SERVICE": "0",
           "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for cache in ("warm-up", "cache"):  # the first run only fills Inductor's cache
        env["ADAPTIVE_EAGER_CACHE_DIR"] = str(work / cache)
        subprocess.run([sys.executable, script.name], cwd=work, env=env, check=True)
    page = work / "report.html"
    del env["ADAPTIVE_EAGER"]  # the report command is no run of its own
    subprocess.run([sys.executable, "-m", "adaptive_eager", "report", "--last", "--html",
                    str(page), "--cache-dir", str(work / "cache")], env=env, check=True)
    screenshot(page, Path(ns.out).resolve())
    print(f"wrote {ns.out} (page {page})")
    if ns.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
