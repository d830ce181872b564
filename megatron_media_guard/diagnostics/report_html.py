"""The post-mortem as one self-contained page (``media-guard report DIR --html FILE``): a
:class:`~.report.ReportSummary` (nothing re-read) as HTML with inline CSS and SVG; its sections,
bounds and escaping are docs/DIAGNOSTICS.md's ("The page"). Cells carry ``data-r`` / ``data-s``
(first rank / step of the bin, ``none`` for records without one) and ``data-n`` (records in the
cell); the heatmap's SVG states ``data-rank0``, ``data-rank-bin``, ``data-step0`` and
``data-step-bin``.
"""

from __future__ import annotations

import html
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path

from .report import HEAT_EVENTS, ReportSummary
from .report_format import _namer, fatal_text, neutralise

MAX_ROWS = 128  # heatmap rows (rank bins)
MAX_COLS = 200  # heatmap and chart columns (step bins)
MAX_TABLE = 50  # rows of the reasons / sample id tables
_ID_KEYS = ("event", "rank", "step", "modality", "item", "frames", "size", "fidelity", "family")
_ID_HEAD = ("records", "sample id", "first event", "rank", "step", "modality", "item")
_ID_HEAD += ("frames", "size (HxW)", "fidelity", "family", "where")

# the inline style, system fonts only; the palette sequential, light to dark (YlOrRd, 8 classes)
PALETTE = ("#ffeda0", "#fed976", "#feb24c", "#fd8d3c", "#fc4e2a", "#e31a1c", "#bd0026", "#800026")

_LEVELS = "".join(f".l{i + 1}{{fill:{c};background:{c}}}" for i, c in enumerate(PALETTE))

CSS = (
    "body{font:14px/1.4 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#1b1f24;"
    "background:#fff;max-width:1400px}"
    "h1{font-size:22px;margin:0 0 12px}"
    "h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}"
    "dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 16px;margin:0 0 8px}"
    "dt{color:#57606a}dd{margin:0}"
    "code{font:12px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;overflow-wrap:anywhere}"
    ".ev{display:inline-block;padding:1px 8px;margin:2px 4px 2px 0;border-radius:10px;"
    "background:#eaeef2;font-size:13px}"
    ".ev.drop{background:#fed976}.ev.repair{background:#c6e2ff}.ev.raise{background:#ff8182}"
    ".ev.budget{background:#fdb4d8}"
    ".fatal{border-left:4px solid #cf222e;background:#fff5f5;padding:8px 12px;margin:8px 0}"
    ".ok{color:#1a7f37}.note{color:#57606a;margin:4px 0 8px}.bin{color:#1b1f24}"
    ".scroll{overflow-x:auto}svg text{font:11px system-ui,sans-serif;fill:#57606a}"
    "svg .axis{font-size:12px;fill:#1b1f24}svg .bg{fill:#f6f8fa;stroke:#d0d7de}"
    "svg rect.x{stroke:#000;stroke-width:1.5px}svg rect:hover{stroke:#0969da;stroke-width:2px}"
    "svg .bar{fill:#57606a}svg .bar.drop{fill:#feb24c}svg .bar.repair{fill:#0969da}"
    "svg .bar.raise{fill:#cf222e}svg .bar.budget{fill:#bf3989}"
    "svg .mark{fill:none;stroke:#000;stroke-width:2px;pointer-events:none}"
    + _LEVELS
    + ".legend{font-size:12px;color:#57606a}"
    ".sw{display:inline-block;width:14px;height:10px;margin:0 3px 0 8px;vertical-align:middle;"
    "border:1px solid #d0d7de}"
    ".sw.x{border:2px solid #000}"
    ".series{display:flex;align-items:flex-end;gap:12px;margin:6px 0;"
    "border-bottom:1px solid #eaeef2}"
    ".slabel{width:190px;flex:none;font-size:12px;color:#57606a;overflow-wrap:anywhere}"
    ".slabel b{color:#1b1f24}table{border-collapse:collapse;margin:4px 0;font-size:13px}"
    "th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}"
    "th{background:#f6f8fa}td{overflow-wrap:anywhere}table.reasons td:nth-child(2){max-width:520px}"
    "table.reasons td:nth-child(3){max-width:560px;font:12px ui-monospace,monospace;color:#57606a}"
    "table.num td:not(:first-child){text-align:right}"
    "footer{margin-top:32px;color:#8c959f;font-size:12px}"
)


def _e(value: object) -> str:
    return html.escape(neutralise(str(value)), quote=True)


def _key(value: int | None) -> object:
    """A bin's first rank or step as the page's ``data-`` attributes state it."""
    return "none" if value is None else value


@dataclass(frozen=True)
class _Axis:
    """The display bins of ranks or steps: ``count`` bins of ``size`` from ``first`` (None: no
    value), then one more for the records without a value when ``none``."""

    first: int | None
    size: int
    count: int
    none: bool

    @classmethod
    def of(cls, values: Sequence[int | None], stored: int, limit: int, span: Sequence[int] = ()):
        """At most ``limit`` bins over ``values`` (stored bin starts), widened to ``span`` (the
        run's ranks or steps, so the map has the run's shape); the bin size is a multiple of
        ``stored``, so every stored bin falls in one."""
        known = [v for v in values if v is not None]
        none = len(known) < len(values)
        if not known:
            return cls(None, 1, 0, none)
        lo, hi = min([*known, *span]) // stored * stored, max([*known, *span])
        size = stored * -(-((hi - lo) // stored + 1) // limit)
        return cls(lo, size, (hi - lo) // size + 1, none)

    @property
    def bins(self) -> int:
        return self.count + self.none

    def index(self, value: int | None) -> int:
        if value is None or self.first is None:
            return self.count
        return (value - self.first) // self.size

    def start(self, i: int) -> int | None:
        """The first value of bin ``i``; None for the bin of records without one."""
        if i >= self.count or self.first is None:
            return None
        return self.first + i * self.size

    def label(self, i: int, what: str, none: str) -> str:
        a = self.start(i)
        if a is None:
            return none
        return f"{what} {a}" if self.size == 1 else f"{what}s {a}–{a + self.size - 1}"


def _ticks(n: int, about: int) -> list[int]:
    """About ``about`` of ``n`` bins to label, always the last."""
    every = max(1, n // about)
    return [i for i in range(n) if i % every == 0 or i == n - 1]


def _level(n: int, top: int) -> int:
    """Colour level 1..len(PALETTE) of a count on a log scale up to ``top``."""
    if top <= 1:
        return len(PALETTE)
    return 1 + min(len(PALETTE) - 1, int((len(PALETTE) - 1) * math.log(n) / math.log(top)))


def _heatmap(s: ReportSummary) -> str:
    grid, cells = s.heat, s.heat.cells
    if not cells:
        return "<p class=note>No drop, repair, raise or budget record: nothing to map.</p>"
    ranks = [r for r in s.by_rank if r is not None]  # the map has the run's shape
    steps = [] if s.first_step is None else [s.first_step, s.last_step]
    ra = _Axis.of([k[0] for k in cells], grid.rank_bin, MAX_ROWS, ranks)
    sa = _Axis.of([k[1] for k in cells], grid.step_bin, MAX_COLS, steps)
    rows, cols = ra.bins, sa.bins
    merged: dict[tuple[int, int], dict[str, int]] = {}
    for (r, s, event), n in cells.items():
        per = merged.setdefault((ra.index(r), sa.index(s)), {})
        per[event] = per.get(event, 0) + n
    top = max(sum(v.values()) for v in merged.values())
    cw = max(3, min(40, 960 // cols))
    ch = max(3, min(24, 640 // rows))
    left, head = 86, 22
    width, height = left + cols * cw + 40, head + rows * ch + 34
    rank_bin, step_bin = ra.size, sa.size
    out = [
        f'<svg class=heat xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"'
        f' data-rank0="{_key(ra.first)}" data-rank-bin="{rank_bin}"'
        f' data-step0="{_key(sa.first)}" data-step-bin="{step_bin}">',
        f'<rect x="{left}" y="{head}" width="{cols * cw}" height="{rows * ch}" class=bg />',
    ]
    marks: list[str] = []
    for (row, col), per in sorted(merged.items()):
        n = sum(per.values())
        what = ", ".join(f"{per[e]:,} {e}" for e in (*HEAT_EVENTS, "(other)") if e in per)
        where = f"{ra.label(row, 'rank', 'rank unknown')}, {sa.label(col, 'step', 'no step')}"
        cls = f"l{_level(n, top)}" + (" x" if "raise" in per else "")
        out.append(
            f'<rect x="{left + col * cw}" y="{head + row * ch}" width="{cw}" height="{ch}"'
            f' class="{cls}" data-r="{_key(ra.start(row))}" data-s="{_key(sa.start(col))}"'
            f' data-n="{n}"><title>{_e(where)}: {_e(what)}</title></rect>'
        )
        if "raise" in per:  # a marker that stays visible however small the cell
            cx, cy = left + col * cw + cw / 2, head + row * ch + ch / 2
            marks.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="6" class=mark />')
    out += marks
    for row in _ticks(rows, 16):
        text = "?" if ra.start(row) is None else ra.start(row)
        y = head + row * ch + ch / 2 + 4
        out.append(f'<text x="{left - 6}" y="{y:.0f}" class=tick text-anchor=end>{text}</text>')
    for col in _ticks(cols, 10):
        x = left + col * cw + cw / 2
        text = _key(sa.start(col))
        out.append(f'<text x="{x:.0f}" y="{head + rows * ch + 14}" class=tick>{text}</text>')
    out.append(
        f'<text x="{left + cols * cw / 2:.0f}" y="{height - 4}" class=axis>step</text>'
        f'<text x="{left - 6}" y="14" class=axis text-anchor=end>rank</text></svg>'
    )
    cell = f"{rank_bin} rank{'s' * (rank_bin > 1)} × {step_bin} step{'s' * (step_bin > 1)}"
    starts: dict[int, int] = {}  # colour level -> the least count drawn in it
    for i in range(len(PALETTE)):
        n = max(1, math.ceil(top ** (i / (len(PALETTE) - 1)))) if top > 1 else 1
        starts.setdefault(_level(n, top), n)
    legend = "".join(f'<span class="sw l{lv}"></span>{n:,} ' for lv, n in starts.items())
    return (
        f"<p class=note>Each cell: <b class=bin>{cell}</b> ({rows} × {cols} cells; "
        f"the reader kept bins of {grid.rank_bin} × {grid.step_bin}). Colour: records in the "
        f"cell, log scale; outlined: the cell holds a raise. Hover a cell for its exact "
        f"counts.</p><div class=scroll>{''.join(out)}</div>"
        f"<p class=legend>records per cell, from: {legend}"
        f'<span class="sw l8 x"></span>holds a raise (circled)</p>'
    )


def _series(s: ReportSummary) -> str:
    """Bars over steps: every record (``series``), then each heatmap event summed over ranks
    (``heat``), on shared step bins (the coarser of the two grids' bins, so both fold)."""
    charts: dict[str, dict[int, int]] = {}
    for grid, label_of in ((s.series, lambda _: "all records"), (s.heat, lambda e: e)):
        for (_, step, label), n in grid.cells.items():
            if step is not None:
                per = charts.setdefault(label_of(label), {})
                per[step] = per.get(step, 0) + n
    if not charts:
        return "<p class=note>No record with a step.</p>"
    steps = [st for per in charts.values() for st in per]
    axis = _Axis.of(steps, max(s.series.step_bin, s.heat.step_bin), MAX_COLS)
    first, size, cols = axis.first, axis.size, axis.count
    bw = max(2, min(12, 960 // cols))
    h = 44
    out = [
        f"<p class=note>Records over steps: all records, then each event of the heatmap; "
        f"each bar: <b class=bin>{size} step{'s' * (size > 1)}</b>; each chart on its own "
        f"scale; hover a bar for its count.</p>"
    ]
    order = ["all records", *(e for e in HEAT_EVENTS if e in charts)]
    for label in order:
        bars: dict[int, int] = {}
        for step, n in charts[label].items():
            i = axis.index(step)
            bars[i] = bars.get(i, 0) + n
        top = max(bars.values())
        parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{cols * bw}" height="{h}"'
            f' data-label="{_e(label)}" data-step0="{first}" data-step-bin="{size}">'
        ]
        for i, n in sorted(bars.items()):
            bh = max(1.0, h * n / top)
            parts.append(
                f'<rect x="{i * bw}" y="{h - bh:.1f}" width="{max(1, bw - 1)}" height="{bh:.1f}"'
                f' class="bar {_e(label.split()[0])}" data-s="{axis.start(i)}" data-n="{n}">'
                f"<title>{_e(axis.label(i, 'step', ''))}: {n:,} {_e(label)}</title></rect>"
            )
        parts.append("</svg>")
        total = sum(bars.values())
        out.append(
            f"<div class=series><div class=slabel><b>{_e(label)}</b><br>{total:,} records, "
            f"at most {top:,} per bar</div>{''.join(parts)}</div>"
        )
    return "".join(out)


def _table(head: Sequence[str], rows: Sequence[Sequence[object]], cls: str = "") -> str:
    if not rows:
        return "<p class=note>None.</p>"
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{'' if v is None else _e(v)}</td>" for v in row) + "</tr>"
        for row in rows
    )
    return f"<table class='{cls}'><tr>{th}</tr>{body}</table>"


def _counts(s: ReportSummary, which: str) -> str:
    data = s.by(which)
    if which == "family" and set(data) <= {"(none)"}:
        return (
            "<p class=note>No record names a model family (<code>extra.adapter</code> or "
            "<code>extra.family</code>; the adapters write it).</p>"
        )
    events = [e for e in s.by_event]
    rows = [
        [name, f"{sum(per.values()):,}", *(f"{per.get(e, 0):,}" for e in events)]
        for name, per in sorted(data.items(), key=lambda kv: -sum(kv[1].values()))
    ]
    return _table([which, "records", *events], rows, "num")


def _header(s: ReportSummary, name) -> str:
    known = [r for r in s.by_rank if r is not None]
    after = f" ({s.matched:,} after filters)" if s.matched != s.records else ""
    facts = [
        ("files", f"{len(s.files):,}"),
        ("records", f"{s.records:,}{after}"),
        ("steps", "none" if s.first_step is None else f"{s.first_step} … {s.last_step}"),
        ("ranks", f"{len(known)} ({min(known)} … {max(known)})" if known else "unknown"),
    ]
    if s.ranks_filter is not None or s.steps_filter is not None:
        facts.append(("filters", f"ranks={s.ranks_filter} steps={s.steps_filter}"))
    skipped = [f"{_e(name(f))}: {_e(why)}" for f, why in s.skipped_files.items()]
    if s.malformed:
        skipped.append(f"{s.malformed:,} malformed line(s)")
    if s.torn_files:
        skipped.append(f"torn last line in {', '.join(_e(name(f)) for f in s.torn_files)}")
    if skipped:
        facts.append(("skipped", "; ".join(skipped)))
    dl = "".join(f"<dt>{_e(k)}</dt><dd>{v if k == 'skipped' else _e(v)}</dd>" for k, v in facts)
    events = " ".join(
        f"<span class='ev {e if e in HEAT_EVENTS else ''}'>{_e(e)} {n:,}</span>"
        for e, n in s.by_event.items()
    )
    ff = s.first_fatal
    if ff is None:
        fatal = "<p class=ok>First fatal: none (no <code>raise</code> record).</p>"
    else:
        line, where = fatal_text(ff, name)
        fatal = (
            f"<div class=fatal><b>First fatal</b> <code>{_e(where)}</code><br>"
            f"<code>{_e(line)}</code></div>"
        )
    return f"<dl>{dl}</dl><p>{events}</p>{fatal}"


def render_html(summary: ReportSummary, title: str = "media-guard report") -> str:
    """The page for ``summary`` (a string; :func:`write_html` writes it)."""
    s = summary
    name = _namer(s.files)

    def where(ex: Mapping[str, object]) -> str | None:
        return f"{name(str(ex['file']))}:{ex['line']}" if ex else None

    reasons = []
    for reason, n in list(s.by_reason.items())[:MAX_TABLE]:
        ex = s.reason_examples.get(reason) or {}
        reasons.append([f"{n:,}", reason, ex.get("text"), where(ex)])
    ids = []
    for sid, n in s.top_sample_ids[:MAX_TABLE]:
        ex = s.sample_examples.get(sid) or {}
        ids.append([f"{n:,}", repr(sid), *(ex.get(k) for k in _ID_KEYS), where(ex)])
    note = "" if s.sample_ids_exact else " (estimated: counts are lower bounds)"
    more = len(s.by_reason) - MAX_TABLE
    sections = [
        ("Run", _header(s, name)),
        ("Drop / repair / raise / budget by rank × step", _heatmap(s)),
        ("Records over steps", _series(s)),
        (
            "Reasons (digits shown as #, full text)",
            _table(["records", "reason", "example record", "where"], reasons, "reasons")
            + (f"<p class=note>{more} more reasons: see --json.</p>" if more > 0 else ""),
        ),
        (f"Top offending sample ids (repair/drop/raise){note}", _table(_ID_HEAD, ids)),
        ("Per modality", _counts(s, "modality")),
        ("Per model family", _counts(s, "family")),
    ]
    body = "".join(f"<section><h2>{_e(h)}</h2>{content}</section>" for h, content in sections)
    return (
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body>"
        f"<h1>{_e(title)}</h1>{body}<footer>media-guard report: a self-contained page, "
        "no script and no network access.</footer></body></html>\n"
    )


def write_html(summary: ReportSummary, path: str | PathLike[str]) -> int:
    """Write the page to ``path`` (atomically: a temporary file renamed); returns its bytes.
    Raises OSError when the path cannot be written."""
    data = render_html(summary).encode("utf-8")
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".media-guard-report.", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return len(data)
