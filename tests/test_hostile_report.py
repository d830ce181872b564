"""Hostile files for ``media-guard report``: rank files that are special (FIFO, devices,
directories, dangling symlinks, symlink loops), unreadable, deeply nested, not UTF-8, full of
escape sequences or huge strings. Each is counted or skipped with a reason, the rest of the
post-mortem is kept, never a hang (every test has a hard timeout), never a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from family_checks import record_line
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_media_guard.cli import main
from megatron_media_guard.diagnostics import file_name, report
from megatron_media_guard.diagnostics.report import summarize
from megatron_media_guard.diagnostics.report_format import format_summary

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("quiet_logger")]


def line(event="drop", rank=0, step=1, mb=0, **kw):
    return record_line(event, rank, step=step, microbatch=mb, **kw) + "\n"


VIDEO_REASON = "surplus: 10200 features for 8040 placeholders in the last video item"
GOOD = [line(sample_id="s0", reason="surplus: 5 features for 4 placeholders (+1)")] * 3


def good_file(d: Path, rank: int = 0) -> Path:
    p = d / file_name(rank)
    p.write_text("".join(GOOD))
    return p


# ---- report: special files named like rank files ------------------------------------------
SPECIAL = {
    "fifo": (os.mkfifo, "FIFO"),
    "urandom": (lambda p: os.symlink("/dev/urandom", p), "character device"),
    "zero": (lambda p: os.symlink("/dev/zero", p), "character device"),
    "directory": (Path.mkdir, "directory"),
    "dangling_symlink": (lambda p: os.symlink(p.parent / "nowhere", p), "No such file"),
    "symlink_loop": (lambda p: os.symlink(p.absolute(), p), "symbolic links"),
}


@pytest.mark.parametrize("case", sorted(SPECIAL))
def test_report_skips_special_files_with_a_reason(tmp_path, case, capsys):
    make, why = SPECIAL[case]
    good_file(tmp_path)
    make(tmp_path / file_name(1))
    s = summarize(tmp_path, jobs=1)
    assert s.records == 3 and s.count("drop") == 3
    assert list(s.skipped_files) == [str(tmp_path / file_name(1))]
    assert why in s.skipped_files[str(tmp_path / file_name(1))]
    assert main(["report", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "warning: skipped" in err and why in err
    assert f"skipped file {file_name(1)}" in out and "3 records" in out


def test_report_skips_an_unreadable_file(tmp_path, monkeypatch):
    """chmod 000 is no barrier to root: the open is made to fail as it would for a user."""
    good_file(tmp_path)
    bad = good_file(tmp_path, 1)
    real_open = os.open

    def deny(path, *a, **kw):
        if os.fspath(path) == str(bad):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(report.os, "open", deny)
    s = summarize(tmp_path, jobs=1)
    assert s.records == 3 and "Permission denied" in s.skipped_files[str(bad)]


# ---- report: hostile content (hostile lines: tests/test_report.py, test_torn_and_malformed_lines;
# escape sequences: tests/test_report_html.py)
def test_huge_strings_are_cut_in_the_summary(tmp_path):
    p = tmp_path / file_name(0)
    with p.open("w") as f:
        for i in range(300):
            big = f"{i}-" + "x" * 50_000
            f.write(line("raise", sample_id=big[:1000], reason="r " * 20_000, action=big))
    s = summarize(tmp_path, jobs=1)
    assert s.records == 300
    assert max(len(str(k)) for k, _ in s.top_sample_ids) <= 210
    assert max(len(k) for k in s.by_action) <= 130
    assert max(len(k) for k in s.by_reason) <= 4096  # the writer's longest string, no more
    text = format_summary(s)
    assert max(len(x) for x in text.splitlines()) < 4200
    assert len(json.dumps(s.to_dict())) < 200_000


# ---- report: reading a smoke directory of several runs -----------------------------------
def test_smoke_directory_names_the_run_and_labels_consensus(tmp_path):
    for event, rank in (("raise", 1), ("drop", 0)):
        d = tmp_path / f"{event}.policy"
        d.mkdir()
        (d / file_name(rank)).write_text(
            line(event, rank=rank, action=event, reason=VIDEO_REASON)
            + line("consensus", rank=rank, action="raise")
        )
    s = summarize(tmp_path, jobs=1)
    assert s.by_action == {"drop": 1, "raise": 1, "raise (consensus)": 2}
    text = format_summary(s)
    assert "[raise.policy/media_guard.rank00001.jsonl:1]" in text
    assert "the stage's action, not its own" in text


@pytest.mark.parametrize("limit", [20, 40, 57])
def test_reasons_are_not_cut_mid_word(limit):
    from megatron_media_guard.diagnostics.records import cut_words

    out = cut_words(VIDEO_REASON, limit)
    assert len(out) <= limit and out.endswith("...")
    assert VIDEO_REASON.startswith(out[:-3]) and VIDEO_REASON[len(out) - 3] == " "


# ---- report: the template fast path is exact ------------------------------------------------

TIMES = st.sampled_from(
    ["2026-01-01T00:00:00.000000+00:00", "x", "", "2026\\u0041", "2026\u00e9", "a\tb"]
)
TOKENS = st.sampled_from(["0", "7", "12", "null", "-1", "01", "1e3", "1.5", '"3"', "true", "99x"])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["drop", "raise", "check"]), TIMES, TOKENS, TOKENS),
        min_size=1,
        max_size=30,
    )
)
def test_template_fast_path_matches_a_full_parse(tmp_path_factory, rows):
    """Lines that differ from earlier ones only in time/step/microbatch (valid or not) give the
    same summary with the fast path as without it."""
    d = tmp_path_factory.mktemp("fast")
    base = line("drop", step=0, mb=0, sample_id="s", reason="r 1")
    out = []
    for event, t, step, mb in rows:
        text = base.replace('"event":"drop"', f'"event":"{event}"')
        text = text.replace("2026-01-01T00:00:00.000000+00:00", t.replace("\t", "\\t"), 1)
        text = text.replace(',"step":0,', f',"step":{step},', 1)
        text = text.replace(',"microbatch":0,', f',"microbatch":{mb},', 1)
        out.append(text)
    (d / file_name(0)).write_text("".join(out))
    fast = summarize(d, jobs=1).to_dict()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report, "template_match", lambda line: None)  # every line parsed in full
        assert summarize(d, jobs=1).to_dict() == fast


def test_streams_are_not_left_open(tmp_path):
    """The reader closes every file it opened (no descriptor leak over many files)."""
    for r in range(50):
        good_file(tmp_path, r)
    before = len(os.listdir("/proc/self/fd"))
    summarize(tmp_path, jobs=1)
    assert len(os.listdir("/proc/self/fd")) <= before
