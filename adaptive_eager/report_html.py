"""``adaptive-eager report --html FILE``: one run as a self-contained page.

The page holds everything it shows: inline CSS, charts drawn here as inline SVG, and a few lines
of script (sortable tables); it loads nothing from anywhere, so it opens offline and can be
mailed. Its figures are ``report.summarize_run``'s, the ones the text report prints: this module
only draws them. The timeline is the run log's (Note [run timeline] in events.py).
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from adaptive_eager.report import build_report

PLOT_W = 900  # the timeline's drawing width, pixels
LABEL_W = 210
LANE_H = 30
BAR_W = 520  # horizontal bar charts
COLORS = {"fused": "#2e9d5b", "op_by_op": "#e0861e", "recording": "#c4cfdb",
          "compiling": "#7a5cc7", "aside": "#5b7fa6", "waiting": "#36a3ad", "lost": "#d0473c",
          "saved": "#2e9d5b"}


def write_html(cache_dir: Path, out: Path, run: str | None = None, last: bool = False,
               job: str | None = None) -> dict:
    """Write the page for the newest of the selected runs; returns that run's summary.
    Raises LookupError when no run is selected (as ``build_report`` does for a bad id)."""
    rep = build_report(cache_dir, run=run, last=last, job=job)
    if not rep["runs"]:
        raise LookupError(f"no runs recorded in {Path(cache_dir) / 'runs'}: run a program "
                          "under the engine first")
    summary = rep["runs"][-1]
    out.write_text(render(summary, str(cache_dir)), encoding="utf-8")
    return summary


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def render(r: dict, cache_dir: str) -> str:
    """The page for one run's summary (``report.summarize_run``)."""
    argv = " ".join(r.get("argv") or [])
    body = [f"<h1>adaptive_eager run {_e(r['run_id'])}</h1>",
            f"<p class='sub'>{_e(argv)} &middot; {r['seconds']:.3f} s &middot; cache folder "
            f"{_e(cache_dir)}</p>",
            _figures(r), _timeline_section(r.get("timeline")), _saved_section(r),
            _causes_section(r), _ledger_section(r), _misses_section(r)]
    title = _e(f"adaptive_eager run {r['run_id']}")
    return (f"{_HEAD}<title>{title}</title><style>{_CSS}</style></head>\n<body>\n"
            + "\n".join(body) + f"\n<script>{_JS}</script>\n</body></html>\n")


def _figures(r: dict) -> str:
    saved_ms = sum(t["saved_ms"] for t in r["top_traces"])
    items = [("seconds", "run seconds", r["seconds"]),
             ("trace_hit_rate", "trace hit rate %", r["trace_hit_rate"]),
             ("flushes", "flushes (traces run)", r.get("flushes", 0)),
             ("compiled_runs", "fused runs", r.get("compiled_runs", 0)),
             ("replayed_runs", "op-by-op runs", r.get("replayed_runs", 0)),
             ("ops_deferred", "ops deferred", r["ops_deferred"]),
             ("fused_share", "deferred ops run fused %", r["fused_share"]),
             ("compiles", "compiles", r["compiles"]),
             ("compile_seconds", "compile seconds", r["compile_seconds"]),
             ("disk_hits", "programs from disk", r["disk_hits"]),
             ("step_asides", "stepped aside", r["step_asides"]),
             ("compile_waits", "plain eager while compiling", r.get("compile_waits", 0)),
             ("budget_rounds", "rounds plain within the learning budget",
              r.get("budget_rounds", 0)),
             ("compiles_held", "compiles held by the budget", r.get("compiles_held", 0)),
             ("saved_ms", "ms saved by fused runs (top traces)", round(saved_ms, 3))]
    cells = "".join(f"<div class='fig'><b data-key='{k}'>{_e(v)}</b><span>{_e(label)}</span>"
                    f"</div>" for k, label, v in items)
    return f"<section id='figures'><div class='figs'>{cells}</div></section>"


# ---- the timeline --------------------------------------------------------------------------
_LANES = (("recording", "engine on"), ("fused", "fused runs"),
          ("op_by_op", "op-by-op runs"), ("compiling", "compiles and loads in flight"),
          ("aside", "stepped aside (plain eager)"), ("waiting", "plain eager while compiling"))


def _timeline_section(tl: dict | None) -> str:
    head = "<section id='timeline'><h2>Timeline</h2>"
    if not tl or tl.get("end") is None:
        return head + ("<p>This run's log has no timeline (it was written by an older "
                       "version of adaptive_eager).</p></section>")
    note = ("<p class='note'>Bars: the share of each time slice spent running traces fused or "
            "op by op (a flush that submitted a compile counts under the compile). Compiles "
            "and stepping aside are placed by the flushes that saw them begin and end (the "
            "first trace after a return counts as aside); a hatched end was still open when "
            "the log was written. Hover for figures.</p>")
    return head + _timeline_svg(tl) + _legend() + note + "</section>"


def _legend() -> str:
    keys = "".join(f"<span><i style='background:{COLORS[k]}'></i>{_e(text)}</span>"
                   for k, text in _LANES)
    return f"<div class='legend'>{keys}</div>"


def _timeline_svg(tl: dict) -> str:
    end = max(float(tl["end"]), 1e-6)
    scale = PLOT_W / end
    height = LANE_H * len(_LANES) + 34
    out = [f"<svg class='timeline' width='{LABEL_W + PLOT_W + 20}' height='{height}' "
           f"viewBox='0 0 {LABEL_W + PLOT_W + 20} {height}' role='img'>",
           "<defs><pattern id='open' width='6' height='6' patternUnits='userSpaceOnUse' "
           "patternTransform='rotate(45)'><rect width='3' height='6' fill='#fff' "
           "fill-opacity='0.55'/></pattern></defs>"]
    lane = {k: i for i, (k, _) in enumerate(_LANES)}
    for i, (_, text) in enumerate(_LANES):
        y = i * LANE_H
        out.append(f"<rect x='{LABEL_W}' y='{y + 2}' width='{PLOT_W}' height='{LANE_H - 4}' "
                   "class='lane'/>")
        out.append(f"<text x='{LABEL_W - 8}' y='{y + LANE_H / 2 + 4}' text-anchor='end'>"
                   f"{_e(text)}</text>")
    phases = tl.get("phases") or []
    out += _recording(tl, phases, scale, lane["recording"])
    out += _buckets(tl, scale, lane)
    for p in phases:
        out.append(_phase_rect(p, scale, lane.get(p[0])))
    out += _axis(end, scale, LANE_H * len(_LANES))
    out.append("</svg>")
    return "".join(out)


def _span(x0: float, x1: float, y: float, h: float, color: str, title: str) -> str:
    w = max(x1 - x0, 1.0)
    return (f"<rect x='{LABEL_W + x0:.1f}' y='{y:.1f}' width='{w:.1f}' height='{h:.1f}' "
            f"fill='{color}'><title>{_e(title)}</title></rect>")


def _recording(tl: dict, phases: list, scale: float, row: int) -> list[str]:
    """Engine on: from the first flush to the last, less the times it was aside."""
    if tl.get("first_flush") is None:
        return []
    on = [(float(tl["first_flush"]), float(tl["last_flush"]))]
    for p in phases:
        if p[0] in ("aside", "waiting"):
            on = [piece for a, b in on for piece in ((a, min(b, p[1])), (max(a, p[2]), b))
                  if piece[1] > piece[0]]
    y = row * LANE_H + 4
    return [_span(a * scale, b * scale, y, LANE_H - 8, COLORS["recording"],
                  f"{a:.2f}-{b:.2f} s: engine on (recording ops, your Python, flushes)")
            for a, b in on]


def _buckets(tl: dict, scale: float, lane: dict) -> list[str]:
    width = float(tl["width"])
    out = []
    for i, b in enumerate(tl.get("buckets") or []):
        for kind, n, secs, ops in (("fused", b[0], b[2], b[4]), ("op_by_op", b[1], b[3], b[5])):
            if secs <= 0 and n == 0:
                continue
            share = min(secs / width, 1.0)
            h = max((LANE_H - 6) * share, 3.0)  # a flush stays visible
            y = lane[kind] * LANE_H + LANE_H - 3 - h
            words = "fused" if kind == "fused" else "op by op"
            title = (f"{i * width:.2f}-{(i + 1) * width:.2f} s: {n} runs {words} ending here "
                     f"({ops} ops), {secs * 1000:.1f} ms running {words} ({share:.0%})")
            out.append(_span(i * width * scale, (i + 1) * width * scale - 0.5, y, h,
                             COLORS[kind], title))
    return out


def _phase_rect(p: list, scale: float, row: int | None) -> str:
    if row is None:
        return ""
    kind, start, end, n, secs = p[:5]
    is_open = len(p) > 5 and p[5] == "open"
    if kind == "compiling":
        title = (f"{start:.2f}-{end:.2f} s: compiles and loads in flight; {n} finished, "
                 f"{secs:.2f} s compiling")
    elif kind == "aside":
        title = f"{start:.2f}-{end:.2f} s: stepped aside {n}x, plain eager (nothing gained)"
    else:
        title = f"{start:.2f}-{end:.2f} s: plain eager while a compile was in flight"
    if is_open:
        title += " (still open when the log was written)"
    y = row * LANE_H + 4
    rect = _span(start * scale, end * scale, y, LANE_H - 8, COLORS[kind], title)
    if is_open:
        rect += _span(start * scale, end * scale, y, LANE_H - 8, "url(#open)", title)
    return rect


def _axis(end: float, scale: float, y: float) -> list[str]:
    step = _nice_step(end / 8)
    out = [f"<line x1='{LABEL_W}' y1='{y + 2}' x2='{LABEL_W + PLOT_W}' y2='{y + 2}' "
           "class='axis'/>"]
    t = 0.0
    while t <= end + 1e-9:
        x = LABEL_W + t * scale
        out.append(f"<line x1='{x:.1f}' y1='{y + 2}' x2='{x:.1f}' y2='{y + 7}' class='axis'/>"
                   f"<text x='{x:.1f}' y='{y + 20}' text-anchor='middle'>{t:g} s</text>")
        t = round(t + step, 9)
    return out


def _nice_step(raw: float) -> float:
    if raw <= 0:
        return 1.0
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


# ---- bar charts and tables -----------------------------------------------------------------
def _hbars(rows: list[tuple[str, float, str, str, str]], unit: str) -> str:
    """Horizontal bars: (label, value, color, tooltip, words after the value); a negative value
    is drawn as its size."""
    if not rows:
        return ""
    top = max(abs(row[1]) for row in rows) or 1.0
    h = 22
    out = [f"<svg class='bars' width='{LABEL_W + BAR_W + 420}' height='{h * len(rows) + 4}' "
           "role='img'>"]
    for i, (label, value, color, title, words) in enumerate(rows):
        y = i * h + 2
        w = max(abs(value) / top * BAR_W, 1.0)
        after = f" \u00b7 {words}" if words else ""
        out.append(f"<text x='{LABEL_W - 8}' y='{y + 15}' text-anchor='end'>{_e(label)}</text>"
                   f"<rect x='{LABEL_W}' y='{y + 3}' width='{w:.1f}' height='{h - 6}' "
                   f"fill='{color}'><title>{_e(title)}</title></rect>"
                   f"<text x='{LABEL_W + w + 6:.1f}' y='{y + 15}'>{value:,.3f} {unit}"
                   f"{_e(after)}</text>")
    out.append("</svg>")
    return "".join(out)


def _table(head: list[str], rows: list[list[object]], tid: str) -> str:
    ths = "".join(f"<th>{_e(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(_cell(c) for c in row) + "</tr>" for row in rows)
    return f"<table class='sortable' id='{tid}'><thead><tr>{ths}</tr></thead><tbody>{trs}" \
           "</tbody></table>"


def _cell(value: object) -> str:
    """Figures and ids stay on one line; sentences and source lines wrap."""
    text = _e(value)
    return f"<td class='wrap'>{text}</td>" if len(str(value)) > 24 else f"<td>{text}</td>"


def _saved_section(r: dict) -> str:
    head = "<section id='saved'><h2>Time saved per trace</h2>"
    rows = r["top_traces"]
    if not rows:
        return head + ("<p>No trace ran both fused and op by op in this run, so no saving was "
                       "measured.</p></section>")
    bars = [(t["trace"][:12], t["saved_ms"], COLORS["saved" if t["saved_ms"] >= 0 else "lost"],
             f"{t['fused_runs']} fused runs x ({_num(t['replay_ms'])} - {_num(t['fused_ms'])}) "
             "ms", f"{t['fused_runs']} fused runs") for t in rows]
    table = _table(["trace", "runs", "ops", "op-by-op ms", "fused ms", "fused runs",
                    "saved ms", "decision"],
                   [[t["trace"][:12], t["runs"], t["n_ops"], _num(t["replay_ms"]),
                     _num(t["fused_ms"]), t["fused_runs"], _num(t["saved_ms"]), t["decision"]]
                    for t in rows], "saved-table")
    note = ("<p class='note'>Saved: fused runs times (median op-by-op time less median fused "
            "time), both measured in this run; the op-by-op time is that of the runs paired "
            "with fused ones, which the engine decided by (the trace's first, colder runs only "
            "where there are none).</p>")
    return head + _hbars(bars, "ms") + table + note + "</section>"


def _causes_section(r: dict) -> str:
    head = "<section id='causes'><h2>Flush causes by source line</h2>"
    rows = r.get("flush_causes") or []
    if not rows:
        return head + "<p>No flush was recorded.</p></section>"
    bars = []
    for c in rows[:12]:
        value, color = ((c["lost_s"], COLORS["lost"]) if c["lost_s"] is not None
                        else (c["op_by_op_s"], COLORS["op_by_op"]))
        bars.append((_short(c["where"]), value, color,
                     f"{c['where']}: {c['kind']}, {c['flushes']}x, {c['ops_op_by_op']} of "
                     f"{c['ops']} ops op by op", f"{c['kind']}, {c['flushes']}x"))
    unit = "s lost" if any(c["lost_s"] is not None for c in rows) else "s op by op"
    table = _table(["source line", "what ended the trace", "flushes", "ops", "ops op by op",
                    "s op by op", "s lost", "what to do"],
                   [[c["where"], c["kind"], c["flushes"], c["ops"], c["ops_op_by_op"],
                     _num(c["op_by_op_s"], 4), _num(c["lost_s"], 4), c["advice"]]
                    for c in rows], "causes-table")
    note = ("<p class='note'>Lost: the seconds these flushes' ops ran op by op, less what fused "
            "programs took for the same work in this run (the run's measured ratio); without "
            "a fused measurement the op-by-op seconds are shown.</p>")
    return head + _hbars(bars, unit) + table + note + "</section>"


def _short(where: str, keep: int = 34) -> str:
    """``/long/path/train.py:12 (step)`` -> ``train.py:12 (step)``, cut to ``keep``."""
    text = where.rsplit("/", 1)[-1]
    return text if len(text) <= keep else text[:keep - 1] + "\u2026"


def _ledger_section(r: dict) -> str:
    head = "<section id='ledger'><h2>Payback ledger</h2>"
    rows = r.get("ledger") or []
    if not rows:
        return head + "<p>Nothing was compiled in this run.</p></section>"
    bars = []
    for t in rows:
        name = (t["trace"] or "")[:12]
        even = ("never breaks even" if t["break_even_runs"] is None
                else f"breaks even after {t['break_even_runs']} fused runs")
        paid = ", paid back" if t["paid_back"] else ""
        bars.append((f"{name} compile", t["compile_s"], COLORS["compiling"],
                     f"compiled in {t['compile_s']} s", even))
        color = COLORS["saved" if t["saved_s"] >= 0 else "lost"]
        bars.append((f"{name} saved", t["saved_s"], color,
                     f"{t['fused_runs']} fused runs saved {t['saved_s']} s",
                     f"by {t['fused_runs']} fused runs{paid}"))
    table = _table(["trace", "ops", "compile s", "saved per run ms", "runs", "fused runs",
                    "break-even runs", "saved s", "paid back"],
                   [[(t["trace"] or "")[:12], t["n_ops"], _num(t["compile_s"]),
                     _num(t["saved_ms_per_run"]), t["runs"], t["fused_runs"],
                     "never" if t["break_even_runs"] is None else t["break_even_runs"],
                     _num(t["saved_s"]), "yes" if t["paid_back"] else "no"] for t in rows],
                   "ledger-table")
    note = ("<p class='note'>Break-even: fused runs needed to win the compile back at the "
            "measured saving per run (never: the program was not faster). A program from the "
            "disk cache costs no compile in the run that loads it.</p>")
    return head + _hbars(bars, "s") + table + note + "</section>"


def _misses_section(r: dict) -> str:
    rows = r.get("miss_causes") or []
    reasons = r.get("flush_reasons") or {}
    out = ["<section id='misses'><h2>Flush reasons and misses</h2>"]
    if reasons:
        out.append(_table(["flush reason", "count"], [[k, v] for k, v in reasons.items()],
                          "reasons-table"))
    if rows:
        out.append(_table(["cause", "op", "argument", "was", "now", "count", "where", "advice"],
                          [[m["cause"], m["op"], m["arg"], m["old"], m["new"], m["count"],
                            m["where"], m["advice"]] for m in rows], "misses-table"))
    else:
        out.append(f"<p>No trace left a known one because something changed "
                   f"({r.get('first_sight_misses', 0)} first sights of an op or shape).</p>")
    out.append("</section>")
    return "".join(out)


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;
max-width:1160px;color:#1d2430;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid
#dde3ea;padding-bottom:4px}.sub{color:#5a6675;margin:0 0 16px;word-break:break-all}
.figs{display:flex;flex-wrap:wrap;gap:8px}.fig{background:#f3f6f9;border-radius:6px;
padding:8px 12px;min-width:120px}.fig b{display:block;font-size:19px}.fig span{color:#5a6675;
font-size:12px}svg text{font-size:12px;fill:#1d2430}.lane{fill:#f5f7fa}.axis{stroke:#8a96a3}
.legend{display:flex;flex-wrap:wrap;gap:14px;margin:6px 0 0 8px;font-size:12px}.legend i{
display:inline-block;width:12px;height:12px;margin-right:5px;vertical-align:-2px;
border-radius:2px}.note{color:#5a6675;font-size:12px}table{border-collapse:collapse;
margin:10px 0;font-size:12.5px;width:100%}th,td{border-bottom:1px solid #e3e8ee;padding:4px 6px;
text-align:left;vertical-align:top}th{background:#f3f6f9;cursor:pointer;user-select:none}
td{white-space:nowrap}td.wrap{white-space:normal;word-break:break-word}
"""

# Sortable tables, and a marker the tests read: data-report-ready once this ran, data-report-error
# if any script on the page failed.
_JS = """
window.addEventListener('error', function (e) {
  document.documentElement.setAttribute('data-report-error', String(e.message));
});
(function () {
  function key(td) {
    var t = td.textContent.replace(/,/g, '');
    var n = parseFloat(t);
    return isNaN(n) || !/^-?[0-9.]/.test(t) ? t.toLowerCase() : n;
  }
  document.querySelectorAll('table.sortable').forEach(function (table) {
    table.querySelectorAll('th').forEach(function (th, col) {
      th.addEventListener('click', function () {
        var body = table.tBodies[0];
        var rows = Array.prototype.slice.call(body.rows);
        var down = th.getAttribute('data-down') !== '1';
        rows.sort(function (a, b) {
          var x = key(a.cells[col]), y = key(b.cells[col]);
          return (x < y ? -1 : x > y ? 1 : 0) * (down ? -1 : 1);
        });
        th.setAttribute('data-down', down ? '1' : '0');
        rows.forEach(function (row) { body.appendChild(row); });
      });
    });
  });
  var n = document.querySelectorAll('svg').length;
  document.documentElement.setAttribute('data-report-ready', 'charts:' + n);
})();
"""

# default-src 'none': the page may load nothing, whatever a source line or argv holds
_HEAD = ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>\n"
         "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; "
         "style-src 'unsafe-inline'; script-src 'unsafe-inline'\">\n")
