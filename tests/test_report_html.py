"""``adaptive-eager report --html``: the run timeline in the run log (Note [run timeline] in
events.py) and the self-contained page drawn from it, rendered by headless Chromium."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import events
from adaptive_eager.cli import main
from adaptive_eager.metrics import Metrics
from adaptive_eager.report import build_report, summarize_run
from adaptive_eager.report_html import render

HERE = Path(__file__).resolve()
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync")


def _line_of(marker: str) -> int:
    for i, text in enumerate(HERE.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# {marker}"):
            return i
    raise AssertionError(marker)


def _train(steps: int) -> None:
    """A small training loop that reads its loss before the backward pass (a flush there)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(128, 32), torch.randn(128, 1)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.item()  # marker: read loss
        loss.backward()
        opt.step()


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """One real run that compiles its step (in line, in this process) and runs it fused; its
    run log, its page, and the run's metrics as the log recorded them."""
    ae.disable()
    ae.clear_caches()
    ae.reset_metrics()
    cache = tmp_path_factory.mktemp("html-run") / "cache"
    with ae.adaptive_eager(cache_dir=str(cache), hot_after=2, compile_async=False,
                           compile_process=False, compile_service=False, step_aside=False):
        _train(30)
    page = cache.parent / "report.html"
    assert main(["report", "--cache-dir", str(cache), "--last", "--html", str(page)]) == 0
    run = build_report(cache, last=True)["runs"][0]
    (head,) = [r for r in events.read_runs(cache)[-1] if r.get("type") == "run"]
    yield {"cache": cache, "page": page, "html": page.read_text(), "run": run,
           "metrics": head["metrics"]}
    ae.disable()


def test_timeline_counts_every_flush_and_the_compile(compiled_run: dict) -> None:
    m, tl = compiled_run["metrics"], compiled_run["run"]["timeline"]
    assert m["compiles"] >= 1 and m["compiled_runs"] > 0, m
    buckets = tl["buckets"]
    fused, op_by_op = sum(b[0] for b in buckets), sum(b[1] for b in buckets)
    assert fused == m["compiled_runs"] and op_by_op == m["replayed_runs"]
    assert fused + op_by_op == m["flushes"]
    assert sum(b[4] + b[5] for b in buckets) == sum(r[1] for r in m["flush_sites"].values())
    compiles = [p for p in tl["phases"] if p[0] == "compiling"]
    assert compiles and all(p[1] <= p[2] <= tl["end"] for p in compiles)
    assert sum(p[3] for p in compiles) == m["compiles"] + m["disk_hits"]
    assert sum(p[4] for p in compiles) == pytest.approx(m["compile_seconds"], abs=1e-3)
    assert not [p for p in tl["phases"] if p[0] in ("aside", "waiting")]  # step_aside off
    assert 0 <= tl["first_flush"] <= tl["last_flush"] <= tl["end"]


def test_page_shows_the_runs_figures_and_sections(compiled_run: dict) -> None:
    page, run, m = compiled_run["html"], compiled_run["run"], compiled_run["metrics"]
    for section in ("figures", "timeline", "saved", "causes", "ledger"):
        assert f"<section id='{section}'>" in page, section
    figures = dict(re.findall(r"<b data-key='(\w+)'>([^<]*)</b>", page))
    assert figures["compiles"] == str(m["compiles"])
    assert figures["flushes"] == str(m["flushes"])
    assert figures["compiled_runs"] == str(m["compiled_runs"])
    assert figures["replayed_runs"] == str(m["replayed_runs"])
    assert figures["compile_seconds"] == str(round(m["compile_seconds"], 3))
    # the payback ledger's row, and the flush cause at this file's loss.item() line
    row = run["ledger"][0]
    ledger = page[page.index("<section id='ledger'>"):]
    assert f"<td>{row['trace'][:12]}</td>" in ledger
    assert f"<td>{row['compile_s']:,.3f}</td>" in ledger
    assert f"{HERE}:{_line_of('marker: read loss')} (_train)" in page
    assert ".item() (or float()/int()/bool() of a tensor)" in page
    assert "compiles and loads in flight; 1 finished" in page or m["compiles"] > 1
    # self-contained: nothing is loaded from anywhere
    assert not re.search(r"https?://|<link|\ssrc=|@import|url\((?!#)", page)


def test_page_renders_in_headless_chromium(compiled_run: dict, tmp_path: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install chromium): the page is not "
                    "rendered")
    page: Path = compiled_run["page"]

    def chromium(*args: str) -> str:
        with tempfile.TemporaryDirectory() as profile:
            done = subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                                   *args, page.as_uri()], capture_output=True, text=True,
                                  timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    dom = chromium("--dump-dom")
    root = re.search(r"<html[^>]*>", dom)
    assert root is not None, dom[:500]
    ready = re.search(r'data-report-ready="charts:(\d+)"', root.group(0))
    assert ready is not None, root.group(0)  # the page's script ran to its end
    assert int(ready.group(1)) >= 4  # timeline, time saved, flush causes, ledger
    assert "data-report-error" not in root.group(0)  # no script on the page failed
    png = tmp_path / "report.png"
    chromium(f"--screenshot={png}", "--window-size=1200,1600")
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", head[16:24]) == (1200, 1600)


def test_replayed_run_times_its_flushes_into_the_buckets(cache_dir: Path) -> None:
    """Op by op only: every flush's seconds land in the op-by-op buckets."""
    with ae.adaptive_eager(cache_dir=str(cache_dir), backend="replay", step_aside=False):
        _train(12)
    tl = build_report(cache_dir, last=True)["runs"][0]["timeline"]
    m = ae.metrics()
    buckets = tl["buckets"]
    assert sum(b[0] for b in buckets) == 0 and sum(b[1] for b in buckets) == m["flushes"] > 0
    seconds = sum(r[3] for r in m["flush_sites"].values())
    assert sum(b[3] for b in buckets) == pytest.approx(seconds, abs=1e-5 * len(buckets) + 1e-6)


def test_timeline_stays_bounded_and_places_asides_between_flushes() -> None:
    m = Metrics()
    tl = events.Timeline(start=time.time() - 5000.0)  # flushes land 5000 s into the run
    tl.note_flush(0.001, 3, True, m)
    first_end = tl.last_end
    for _ in range(events.MAX_PHASES + 50):
        m.step_asides += 1  # the engine went aside and came back between two flushes
        tl.note_flush(0.001, 3, False, m)
    assert len(tl.buckets) <= events.MAX_BUCKETS and tl.width * events.MAX_BUCKETS > 5000
    assert sum(b[0] + b[1] for b in tl.buckets) == events.MAX_PHASES + 51
    assert len(tl.phases) == events.MAX_PHASES and tl.dropped == 50
    kind, start, end, n, _ = tl.phases[0]
    assert (kind, n) == ("aside", 1) and start == round(first_end, 4) and start <= end
    m.compiles_pending = 1  # a compile submitted, and still in flight when the log is written
    tl.note_flush(0.001, 3, True, m)
    m.step_asides += 1
    rec = tl.record(m.as_dict())
    assert [p[0] for p in rec["phases"][-2:]] == ["aside", "compiling"]
    assert all(p[-1] == "open" for p in rec["phases"][-2:])


def test_page_escapes_what_the_run_log_holds() -> None:
    hostile = "<script>alert(1)</script>"
    records = [{"type": "run", "run_id": "r1", "start": 0.0, "end": 1.0, "argv": [hostile],
                "metrics": {"flush_sites": {f"read at {hostile}:3 (f)": [2, 10, 10, 0.5]}}}]
    page = render(summarize_run(records), hostile)
    assert hostile not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "has no timeline" in page  # a log written before timelines existed


def test_html_of_an_empty_cache_says_so(cache_dir: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "r.html"
    assert main(["report", "--cache-dir", str(cache_dir), "--html", str(out)]) == 2
    assert "no runs recorded" in capsys.readouterr().err and not out.exists()
