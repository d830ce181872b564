"""The post-mortem page (``media-guard report DIR --html FILE``): its heatmap cells against the
records (parsed with html.parser), binning with the bin size stated, exact hover counts, full
reasons, escaping, self-containment, the bounded grids, and a real headless browser where one
is installed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest
from family_checks import record_line
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_media_guard.cli import main
from megatron_media_guard.diagnostics import file_name, report
from megatron_media_guard.diagnostics.report import summarize
from megatron_media_guard.diagnostics.report_format import format_summary
from megatron_media_guard.diagnostics.report_grid import _Grid
from megatron_media_guard.diagnostics.report_html import MAX_COLS, MAX_ROWS, render_html

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("quiet_logger")]
HEAT = ("drop", "repair", "raise", "budget")


def line(event: str, rank: int | None, step: int | None, **kw: object) -> str:
    return record_line(event, rank, step=step, microbatch=0, **kw) + "\n"


def write_run(d: Path, rows: list[tuple[str, int | None, int | None]]) -> None:
    """(event, rank, step) rows, one file per rank; rank None: rank null in a file whose name
    has no rank either (else the reader takes the file's)."""
    per: dict[int | None, list[str]] = {}
    for i, (event, rank, step) in enumerate(rows):
        kw = {"sample_id": f"s{i % 5}", "modality": "image"} if event != "check" else {}
        per.setdefault(rank, []).append(line(event, rank, step, **kw))
    for r, lines in per.items():
        name = "media_guard.rank-unknown.jsonl" if r is None else file_name(r)
        (d / name).write_text("".join(lines))


class Page(HTMLParser):
    """The heatmap's svg attributes, its cells (attributes + title text), the series bars."""

    def __init__(self) -> None:
        super().__init__()
        self.heat: dict[str, str] = {}
        self.cells: list[dict[str, str]] = []
        self.bars: list[dict[str, str]] = []
        self.tags: Counter[str] = Counter()
        self.text: list[str] = []
        self._in_heat = False
        self._cell: dict[str, str] | None = None
        self._title = False

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        self.tags[tag] += 1
        if tag == "svg" and "heat" in a.get("class", ""):
            self.heat, self._in_heat = a, True
        elif tag == "rect" and "data-n" in a:
            self._cell = {**a, "title": ""}
            (self.cells if self._in_heat else self.bars).append(self._cell)
        elif tag == "title":
            self._title = True

    def handle_endtag(self, tag):
        if tag == "svg":
            self._in_heat = False
        elif tag == "title":
            self._title = False
        elif tag == "rect":
            self._cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self._title and self._cell is not None:
            self._cell["title"] += data


def parse(text: str) -> Page:
    p = Page()
    p.feed(text)
    p.close()
    return p


def assert_cells(page: Page, rows) -> dict[tuple[str, str], Counter]:
    """The heatmap's cells hold the records binned as the page says it does (the first
    rank/step and the bin sizes it states); returns the records' events per cell."""
    assert page.heat, "no heatmap"
    r0, rb = page.heat["data-rank0"], int(page.heat["data-rank-bin"])
    s0, sb = page.heat["data-step0"], int(page.heat["data-step-bin"])
    want: dict[tuple[str, str], Counter] = {}
    for event, rank, step in rows:
        if event not in HEAT:
            continue
        rk = "none" if rank is None else str(int(r0) + (rank - int(r0)) // rb * rb)
        sk = "none" if step is None else str(int(s0) + (step - int(s0)) // sb * sb)
        want.setdefault((rk, sk), Counter())[event] += 1
    got = {(c["data-r"], c["data-s"]): int(c["data-n"]) for c in page.cells}
    assert got == {k: sum(v.values()) for k, v in want.items()}
    return want


FEW = [("check", r, s) for r in range(4) for s in range(6)]
FEW += [("drop", 1, 2), ("drop", 1, 2), ("repair", 1, 2), ("raise", 3, 5), ("budget", 0, 0)]
MANY_RANKS = [("drop", r, r % 7) for r in range(300)] + [("check", r, 0) for r in range(0, 300, 3)]
MANY_STEPS = [("repair", s % 3, s) for s in range(0, 5000, 7)] + [("drop", 2, 4999)]
UNKNOWN = [("drop", None, 3), ("drop", 2, None), ("raise", None, None), ("drop", 2, 1)]
WIDE_AND_TALL = [("drop", r, s) for r in range(0, 1000, 9) for s in range(0, 3000, 97)]


@pytest.mark.parametrize("rows", [FEW, MANY_RANKS, MANY_STEPS, UNKNOWN, WIDE_AND_TALL])
def test_heatmap_cells_match_the_records(tmp_path, rows):
    write_run(tmp_path, rows)
    page = parse(render_html(summarize(tmp_path, jobs=1)))
    want = assert_cells(page, rows)
    for c in page.cells:  # the hover title gives the exact count of each event in the cell
        per = want[(c["data-r"], c["data-s"])]
        for event, n in per.items():
            assert f"{n:,} {event}" in c["title"], c["title"]
        assert ("x" in c["class"].split()) == ("raise" in per)
    ranks = {r for _, r, _ in rows if r is not None}
    assert len({c["data-r"] for c in page.cells}) <= MAX_ROWS + 1
    assert len({c["data-s"] for c in page.cells}) <= MAX_COLS + 1
    rb, sb = int(page.heat["data-rank-bin"]), int(page.heat["data-step-bin"])
    assert rb == max(1, -(-(max(ranks) - min(ranks) + 1) // MAX_ROWS))
    text = "".join(page.text)
    assert f"{rb} rank{'s' * (rb > 1)} × {sb} step{'s' * (sb > 1)}" in text  # bin size stated


@pytest.mark.parametrize(
    "rows", [MANY_STEPS + [("check", 0, s) for s in range(0, 5000, 5)], [("check", 0, 3)]]
)
def test_series_bars_count_every_record(tmp_path, rows):
    write_run(tmp_path, rows)
    page = parse(render_html(summarize(tmp_path, jobs=1)))
    by_label: Counter[str] = Counter()
    for bar in page.bars:
        by_label[bar["class"].split()[1]] += int(bar["data-n"])
    assert by_label == Counter({"all": len(rows)}) + Counter(e for e, _, _ in rows if e != "check")


@pytest.mark.parametrize("cap", [4, 16, 64])
def test_heat_grid_stays_bounded_and_exact(tmp_path, monkeypatch, cap):
    monkeypatch.setattr(report, "HEAT_CAP", cap)
    write_run(tmp_path, WIDE_AND_TALL)
    s = summarize(tmp_path, jobs=1)
    assert len(s.heat.cells) <= cap and sum(s.heat.cells.values()) == len(WIDE_AND_TALL)
    assert_cells(parse(render_html(s)), WIDE_AND_TALL)


keys = st.tuples(
    st.none() | st.integers(-50, 5000), st.none() | st.integers(-50, 5000), st.sampled_from("abc")
)


@settings(max_examples=80, deadline=None)
@given(st.lists(keys, max_size=200), st.integers(2, 40), st.integers(0, 200))
def test_grid_property_exact_per_bin_and_mergeable(items, cap, split):
    one, a, b = _Grid(cap), _Grid(cap), _Grid(cap)
    for i, (r, s, label) in enumerate(items):
        one.add(r, s, label)
        (a if i < split else b).add(r, s, label)
    a.merge(b)
    for g in (one, a):
        rb, sb = 1 << g.rank_shift, 1 << g.step_shift
        truth = Counter(
            (None if r is None else r // rb * rb, None if s is None else s // sb * sb, lab)
            for r, s, lab in items
        )
        assert g.cells() == dict(truth)
        # all that cannot fold: (None, -1, 0) per dimension x label (negative bins stop at -1)
        assert len(g.counts) <= max(cap, 3 * 3 * 3)


def test_reasons_in_full_four_that_differ_after_100_characters(tmp_path):
    head = (
        "surplus: 10200 features for 8040 placeholders in the last video item of the sample, " * 2
    )
    tails = ["frames cut", "merge off", "wrong processor", "stale cache"]
    lines = [line("drop", 0, i, reason=head + t, sample_id=i) for i, t in enumerate(tails)]
    (tmp_path / file_name(0)).write_text("".join(lines))
    s = summarize(tmp_path, jobs=1)
    full = {re.sub(r"\d+", "#", head + t) for t in tails}
    assert set(s.by_reason) == full
    text, page = format_summary(s), render_html(s)
    for reason in full:
        assert reason in text and reason in page
        assert s.reason_examples[reason]["line"] in (1, 2, 3, 4)


HOSTILE = "<script>alert(1)</script>\x1b[2J\x1b]0;owned\x07\r\x9b\"'&"


def test_record_text_is_escaped_in_the_text_and_the_page_is_self_contained(tmp_path):
    (tmp_path / file_name(0)).write_text(
        line("raise", 0, 1, sample_id=HOSTILE, reason=HOSTILE, modality=HOSTILE, action=HOSTILE)
        + line("drop", 0, 2, sample_id="ok", extra={"adapter": HOSTILE})
        + "garbage\n"
    )
    os.mkfifo(tmp_path / file_name(1))  # a hostile file: skipped, named, never blocks
    s = summarize(tmp_path, jobs=1)
    text, page = format_summary(s), render_html(s)
    for out in (text, page):  # no control character but a newline reaches the terminal or page
        assert not any((ord(ch) < 32 and ch != "\n") or 0x7F <= ord(ch) <= 0x9F for ch in out)
    assert "\\x1b[2J" in text  # shown, escaped
    parsed = parse(page)
    assert parsed.tags["script"] == 0 and parsed.tags["link"] == 0 and parsed.tags["img"] == 0
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert not re.search(r"""(?:src|href)\s*=|url\(|@import|@font-face""", page)
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) <= {"http://www.w3.org/2000/svg"}
    assert "FIFO" in page and "1 malformed line(s)" in page


TORCH_FREE = """
import sys
from megatron_media_guard.cli import main
code = main(["report", sys.argv[1], "--json", "--html", sys.argv[2]])
print("TORCH:" + ",".join(sorted(m for m in sys.modules if m.split(".")[0] == "torch"))[:200])
sys.exit(code)
"""


def test_report_in_a_fresh_process_imports_no_torch_and_never_blocks(tmp_path):
    """End to end in a fresh process with a hard timeout: ``report --json --html`` over a
    directory where one rank file is a FIFO skips it with the reason (never hangs), prints one
    JSON object, names and writes the page, and imports no torch."""
    write_run(tmp_path, FEW)
    os.mkfifo(tmp_path / file_name(9))
    page = tmp_path / "p.html"
    argv = [sys.executable, "-c", TORCH_FREE, str(tmp_path), str(page)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[-1] == "TORCH:" and f"page {page}" in done.stderr
    summary = json.loads(out[0])
    assert summary["records"] == len(FEW)
    assert "FIFO" in summary["skipped_files"][str(tmp_path / file_name(9))]
    assert_cells(parse(page.read_text(encoding="utf-8")), FEW)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync")
CHROMIUM_FLAGS += ("--disable-background-networking", "--disable-component-update")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine")
def test_page_renders_in_a_headless_browser(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    write_run(tmp_path, MANY_RANKS + FEW)
    page = tmp_path / "page.html"
    assert main(["report", str(tmp_path), "--html", str(page)]) == 0
    shot = tmp_path / "shot.png"
    with tempfile.TemporaryDirectory() as profile:
        flags = [f"--user-data-dir={profile}", f"--screenshot={shot}", "--window-size=1400,1000"]
        argv = [CHROMIUM, *CHROMIUM_FLAGS, *flags, page.resolve().as_uri()]
        subprocess.run(argv, capture_output=True, timeout=90)
    assert shot.exists(), "chromium wrote no screenshot"
    with Image.open(shot) as im:
        rgb = im.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 20) or []
        assert rgb.size == (1400, 1000)
    assert len(colours) >= 20  # text, palette levels, table borders: not a blank page
    white = sum(n for n, c in colours if c == (255, 255, 255))
    assert white < 0.95 * 1400 * 1000
    palette_hits = {c for _, c in colours if c in {(254, 217, 118), (255, 237, 160)}}
    assert palette_hits, "no heatmap colour on screen"


def test_smoke_post_mortem_writes_the_page_next_to_its_logs(tmp_path):
    """``media-guard smoke`` ends with check_runs: the page lands in the log dir and the text
    names it (the launcher and ranks are not needed for that step)."""
    from megatron_media_guard.smoke.runspec import WorkerArgs
    from megatron_media_guard.smoke.verify import check_runs

    run = tmp_path / "budget_shrink.raise"
    run.mkdir()
    write_run(run, FEW)
    args = WorkerArgs(scenarios=(), policies=(), steps=2, log_dir=str(tmp_path))
    ok, text = check_runs(args, [], tmp_path)
    page = tmp_path / "report.html"
    assert ok and f"post-mortem page: {page.resolve().as_uri()}" in text
    assert parse(page.read_text(encoding="utf-8")).cells


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "keys",
    [
        [(-1, 0), (0, -1), (0, 0), (-1, -1)],  # bins shifting never merges: must stop anyway
        [(-50, 3), (0, 0), (-3, 70), (5, -2)],
        [(None, None), (None, 1), (1, None), (0, 0)],
    ],
)
def test_a_full_grid_stops_coarsening_when_nothing_can_fold(keys):
    g = _Grid(2)
    for r, s in keys * 3:
        for label in "abc":
            g.add(r, s, label)
    assert sum(g.counts.values()) == len(keys) * 3 * 3
