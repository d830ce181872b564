"""Post-mortem reader and ``media-guard report``: counts, torn/garbage lines, filters, exit codes."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest
from family_checks import record_line
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_media_guard.cli import main
from megatron_media_guard.diagnostics import (
    EVENTS,
    DiagnosticsLog,
    GuardRecord,
    RankInfo,
    file_name,
    report,
)
from megatron_media_guard.diagnostics.report import ReportSummary, summarize
from megatron_media_guard.diagnostics.report_format import format_summary
from megatron_media_guard.diagnostics.report_grid import _HeavyHitters

pytestmark = pytest.mark.usefixtures("quiet_logger")


def line(event: str = "check", rank: int | None = 0, **fields: object) -> str:
    return record_line(event, rank, **fields)


def raw(**fields: object) -> str:
    return json.dumps(fields)


def write(d: Path, rank: int, lines: list[str], tail: str = "") -> Path:
    """A rank file of ``lines`` and ``tail``; lone surrogates are written as the invalid UTF-8
    bytes they stand for."""
    path = d / file_name(rank)
    path.write_bytes(("".join(x + "\n" for x in lines) + tail).encode("utf-8", "surrogateescape"))
    return path


# -- counting -------------------------------------------------------------------------------
def test_counts_by_rank_event_action_reason(tmp_path):
    for rank in range(3):
        with DiagnosticsLog(tmp_path, RankInfo(rank=rank)) as log:
            for step in range(4):
                log.emit(GuardRecord("check", step=step, action="keep"))
            why = f"{100 + rank} features for 90 placeholders (+{10 + rank})"
            log.emit(
                GuardRecord(
                    "drop", step=2, sample=1, sample_id=f"s{rank}", action="drop", reason=why
                )
            )
            if rank == 1:
                why = "run 0 holds 4 placeholders, its item 5 features"
                log.emit(GuardRecord("repair", step=3, sample_id="s1", action="repair", reason=why))
    s = summarize(tmp_path)
    assert (s.records, s.matched, s.malformed, s.torn_files) == (16, 16, 0, ())
    assert dict(s.by_event) == {"check": 12, "repair": 1, "drop": 3}
    assert {r: dict(v) for r, v in s.by_rank.items()} == {
        0: {"check": 4, "drop": 1},
        1: {"check": 4, "repair": 1, "drop": 1},
        2: {"check": 4, "drop": 1},
    }
    assert dict(s.by_action) == {"keep": 12, "drop": 3, "repair": 1}
    assert dict(s.by_reason) == {
        "(none)": 12,
        "# features for # placeholders (+#)": 3,
        "run # holds # placeholders, its item # features": 1,
    }
    assert s.top_sample_ids[0] == ("s1", 2) and s.sample_ids_exact
    assert (s.first_step, s.last_step) == (0, 3) and s.first_fatal is None


# -- torn, garbage, unknown and missing fields -----------------------------------------------
@pytest.mark.parametrize(
    ("body", "tail", "records", "malformed", "torn"),
    [
        ([line(), line("drop")], '{"schema":1,"time":"2026', 2, 0, True),  # cut mid-record
        ([line(), "x", line("drop")], "\x00\x00\x00\x00", 2, 1, True),  # NULs after a crash
        # torn: only a last line without its newline that fails to parse after valid records
        ([line(), line("drop")], line("raise"), 3, 0, False),  # whole record, no newline
        ([line(), line("drop"), '{"schema":1,"ev'], "", 2, 1, False),  # has its newline
        ([line(), "\x00\x00\x00\x00"], "", 1, 1, False),
        ([], "hello world", 0, 1, False),  # a text file: malformed, not torn
        (["hello world"], "", 0, 1, False),
        (["garbage"], '{"schema":1,"ev', 0, 2, False),  # no valid record before it
        ([line(), "garbage", line("drop")], "", 2, 1, False),
        (["[1, 2]", '"text"', "null", "3", line()], "", 1, 4, False),  # JSON, not objects
        ([line()], "3", 1, 1, False),  # parses, not an object: malformed
        (["", "   ", line()], "", 1, 0, False),  # blank lines: neither record nor garbage
        ([line()], "   ", 1, 0, False),
        ([line(), "garbage"], "", 1, 1, False),
        ([line(), "garbage", "", "  "], "", 1, 1, False),
        ([line()], "", 1, 0, False),
        ([], "", 0, 0, False),
        # hostile lines between two records: malformed, the rest kept
        ([line(), "[" * 3000 + "]" * 3000, line()], "", 2, 1, False),  # too deep to parse
        ([line(), '{"a":' * 3000 + "1" + "}" * 3000, line()], "", 2, 1, False),
        ([line(), '{"schema":1,"extra":' + "[" * 5000 + "]" * 5000 + "}", line()], "", 2, 1, False),
        ([line(), '{"schema":1,"event":"dro' + line(), line()], "", 2, 1, False),  # glued
        ([line(), '{"schema":1,"sample_id":' + "9" * 5000 + "}", line()], "", 2, 1, False),
        ([line(), "\udcff\udcfe\udc80 bad", line()], "", 2, 1, False),  # invalid UTF-8
        ([line(), '{"schema":1,"reason":"\udcff\udcfe"}', line()], "", 2, 1, False),
    ],
)
def test_torn_and_malformed_lines(tmp_path, body, tail, records, malformed, torn):
    path = write(tmp_path, 0, body, tail)
    s = summarize(tmp_path)
    assert (s.records, s.malformed) == (records, malformed)
    assert s.torn_files == ((str(path),) if torn else ())
    text = format_summary(s)
    assert ("torn last line" in text) is torn
    assert (f"{malformed} malformed" in text) is bool(malformed)


def test_unknown_and_missing_fields_are_tolerated(tmp_path):
    write(
        tmp_path,
        4,
        [
            raw(schema=2, event="drop", rank=4, new_field={"a": [1]}, sample_id="x"),
            raw(event="raise"),  # no rank: from the file name; no time/step
            raw(),  # an object with nothing in it
            raw(event=["odd"], action=7, reason=None, rank="4", step="2", sample_id={"k": 1}),
            raw(event="future-event", rank=4),
        ],
    )
    s = summarize(tmp_path)
    assert s.records == 5 and s.malformed == 0 and s.other_schema == 5
    assert dict(s.by_event) == {"drop": 1, "raise": 1, "(none)": 1, '["odd"]': 1, "future-event": 1}
    assert set(s.by_rank) == {4}
    assert s.first_fatal is not None and s.first_fatal["rank"] == 4
    assert (s.first_step, s.last_step) == (None, None)
    assert "(none)" in s.by_action and "7" in s.by_action


# -- filters ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ranks", "steps", "matched", "events"),
    [
        (None, None, 25, {"check": 20, "drop": 5}),
        ([1], None, 6, {"check": 5, "drop": 1}),
        ([0, 3], [4], 2, {"check": 2}),
        (None, [0, 1], 9, {"check": 8, "drop": 1}),  # a record without a step fails them
        ([9], None, 0, {}),
        ([3], None, 7, {"check": 5, "drop": 2}),
    ],
)
def test_filters(tmp_path, ranks, steps, matched, events):
    for rank in range(4):
        lines = [line("check", rank, step=s) for s in range(5)] + [line("drop", rank, sample=0)]
        if rank == 3:
            lines.append(raw(event="drop", step=1))  # no rank: it takes the file's
        write(tmp_path, rank, lines)
    s = summarize(tmp_path, ranks=ranks, steps=steps)
    assert s.records == 25 and s.matched == matched and dict(s.by_event) == events
    assert s.ranks_filter == (None if ranks is None else tuple(sorted(ranks)))


# -- first fatal ----------------------------------------------------------------------------
T = "2026-01-01T00:00:{:02d}.000000+00:00"


@pytest.mark.parametrize(
    ("files", "want"),
    [
        # earliest time wins across ranks
        ({0: [(T.format(9), 1, "a")], 1: [(T.format(3), 5, "b")], 2: [(T.format(5), 0, "c")]}, "b"),
        # equal times: lowest rank, then lowest step
        ({3: [(T.format(1), 2, "a")], 1: [(T.format(1), 9, "b"), (T.format(1), 4, "c")]}, "c"),
        # no times: lowest rank then step
        ({2: [(None, 1, "a")], 1: [(None, 8, "b"), (None, 7, "c")]}, "c"),
        # a time beats no time; 'Z' and naive times are read as UTC
        (
            {
                0: [(None, 0, "a")],
                1: [("2026-01-01T00:00:02Z", 0, "b")],
                2: [("2026-01-01T00:00:01", 0, "c")],
            },
            "c",
        ),
        ({0: [("not a time", 0, "a")], 1: [(T.format(59), 0, "b")]}, "b"),
    ],
)
def test_first_fatal(tmp_path, files, want):
    for rank, fatals in files.items():
        fatal = {"event": "raise", "rank": rank, "sample": 0, "item": 1, "reason": "why"}
        lines = [raw(event="check", rank=rank, step=0)]
        lines += [raw(**fatal, step=s, time=t, sample_id=sid) for t, s, sid in fatals]
        write(tmp_path, rank, lines)
    s = summarize(tmp_path)
    assert s.first_fatal is not None and s.first_fatal["sample_id"] == want
    text = format_summary(s)
    assert (
        f"first fatal: rank {s.first_fatal['rank']}, step {s.first_fatal['step']}: "
        f"sample 0 (sample_id '{want}'), item 1: why -> raise" in text
    )


# -- bounded counters -----------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=400), st.integers(0, 400))
def test_heavy_hitters_bounded_in_one_pass_and_merged(stream, split):
    """Exact below ``2 * capacity`` distinct keys; else each estimate undercounts by at most
    ``error`` <= n / (capacity + 1), so every key seen more often stays, merged or not."""
    truth = Counter(stream)
    one, a, b = _HeavyHitters(5), _HeavyHitters(5), _HeavyHitters(5)
    for i, key in enumerate(stream):
        one.add(key)
        (a if i < split else b).add(key)
    a.merge(b)
    if len(truth) < 10:
        assert one.error == 0 and one.counts == truth
    for hh in (one, a):
        assert len(hh.counts) < 10 and hh.error <= len(stream) / 6
        assert all(truth[k] - hh.error <= est <= truth[k] for k, est in hh.counts.items())
        assert all(k in hh.counts for k, n in truth.items() if n > hh.error)


def test_reason_classes_and_keys_are_capped(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "LABEL_CAP", 3)
    monkeypatch.setattr(report, "COMBO_CAP", 5)
    write(tmp_path, 0, [raw(event="drop", reason=f"kind{chr(97 + i)} {i}") for i in range(10)])
    s = summarize(tmp_path)
    assert s.count("drop") + s.count("(other)") == 10
    assert len(s.by_reason) <= 5 and "(other)" in s.by_reason


# -- parallel reading gives the same answer ---------------------------------------------------
@pytest.mark.timeout(120)
def test_jobs_do_not_change_the_result(tmp_path):
    events = ["drop" if i % 5 == 0 else "check" for i in range(50)]
    for rank in range(3):
        steps = [line(e, rank, step=i, sample_id=f"s{i % 7}") for i, e in enumerate(events)]
        write(tmp_path, rank, [*steps, "junk", line()], tail='{"torn')
    write(tmp_path, 3, [raw(event="raise", rank=3, step=2, time=T.format(1))])
    one, two = summarize(tmp_path, jobs=1), summarize(tmp_path, jobs=2)
    assert one == two and one.count("raise") == 1
    assert one.malformed == 3 and len(one.torn_files) == 3


# -- property: writer records + interleaved garbage + torn tail --------------------------------
small_int = st.none() | st.integers(-3, 10**6)
records = st.builds(
    GuardRecord,
    event=st.sampled_from(EVENTS),
    step=small_int,
    sample=small_int,
    sample_id=st.none() | st.integers(0, 50) | st.text(max_size=12),
    expected=st.none() | st.lists(st.integers(0, 5000), max_size=4).map(tuple),
    got=st.none() | st.lists(st.integers(0, 5000), max_size=4).map(tuple),
    action=st.none() | st.sampled_from(["keep", "drop", "repair", "raise"]),
    reason=st.none() | st.text(max_size=30),
    duration_ms=st.none() | st.floats(allow_nan=True, allow_infinity=True),
)


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


garbage = st.one_of(
    st.text(max_size=40).filter(lambda t: "\n" not in t and not _is_object(t)),
    st.binary(max_size=40)
    .filter(lambda b: b"\n" not in b)
    .map(lambda b: b.decode("utf-8", "replace"))
    .filter(lambda t: not _is_object(t)),
)


@settings(max_examples=60, deadline=None)
@given(
    recs=st.lists(records, max_size=20),
    junk=st.lists(st.tuples(st.integers(0, 20), garbage), max_size=6),
    cut=st.none() | st.integers(1, 10**6),
)
def test_property_event_counts_survive_garbage_and_torn_tail(tmp_path_factory, recs, junk, cut):
    d = tmp_path_factory.mktemp("prop")
    with mock.patch("os.fsync"), DiagnosticsLog(d, RankInfo(rank=2)) as log:
        for r in recs:
            log.emit(r)
    path = d / file_name(2)
    valid = path.read_text(encoding="utf-8").splitlines() if recs else []
    lines = list(valid)
    for pos, text in sorted(junk, reverse=True):
        lines.insert(min(pos, len(lines)), text)
    tail = whole = ""
    if cut is not None and valid:
        whole = valid[cut % len(valid)]
        tail = whole[: 1 + cut % len(whole)]  # a prefix, possibly all of it but the newline
    path.write_text("".join(x + "\n" for x in lines) + tail, encoding="utf-8")

    s = summarize(d)
    want = Counter(r.event for r in recs)
    if tail and tail == whole:  # a whole record without its newline is a record
        want[json.loads(whole)["event"]] += 1
    assert {e: s.count(e) for e in EVENTS} == {e: want[e] for e in EVENTS}
    assert s.records == len(recs) + (bool(tail) and tail == whole)
    bad = [x for x in lines if x not in valid and x.strip()]  # blank lines are never counted
    assert s.malformed == len(bad)
    assert bool(s.torn_files) == (bool(tail) and tail != whole)


# -- CLI ---------------------------------------------------------------------------------------
@pytest.fixture
def logdir(tmp_path):
    write(tmp_path, 0, [line("check", 0, step=1), line("drop", 0, step=2, sample=0, sample_id="a")])
    write(
        tmp_path, 1, [line("check", 1, step=1), line("raise", 1, step=2, sample=3, sample_id="b")]
    )
    return tmp_path


@pytest.mark.parametrize(
    ("args", "code"),
    [
        ([], 0),
        (["--fail-on", "raise"], 3),
        (["--fail-on", "budget"], 0),
        (["--fail-on", "budget,drop"], 3),
        (["--fail-on", "budget", "--fail-on", "raise"], 3),
        (["--fail-on", "raise", "--rank", "0"], 0),  # the raise is on rank 1
        (["--fail-on", "raise", "--step", "1"], 0),
        (["--fail-on", "raise", "--rank", "0,1", "--step", "1", "--step", "2"], 3),
        (["--fail-on", "nope"], 2),
        (["--rank", "x"], 2),
        (["--bogus"], 2),
    ],
)
def test_cli_exit_codes(logdir, capsys, args, code):
    assert main(["report", str(logdir), *args]) == code


def test_cli_no_command_and_help():
    assert main([]) == 2
    assert main(["--help"]) == 0


def test_cli_json_is_one_object(logdir, capsys):
    assert main(["report", str(logdir), "--json", "--fail-on", "raise"]) == 3
    out = capsys.readouterr().out
    data = json.loads(out)
    assert out.count("\n") == 1
    assert data["by_event"] == {"check": 2, "drop": 1, "raise": 1}
    assert data["by_rank"] == {"0": {"check": 1, "drop": 1}, "1": {"check": 1, "raise": 1}}
    assert data["first_fatal"]["sample_id"] == "b" and data["first_fatal"]["rank"] == 1
    assert data["fail_on"] == {"events": ["raise"], "hits": {"raise": 1}}


def test_cli_text_names_the_culprit(logdir, capsys):
    assert main(["report", str(logdir)]) == 0
    out = capsys.readouterr().out
    assert "first fatal: rank 1, step 2: sample 3 (sample_id 'b')" in out
    assert "by rank:" in out and "by event:" in out and "top offending sample ids" in out


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (lambda d: [d / "nope"], "no such diagnostics directory"),
        (lambda d: [d], "no media_guard.rank*.jsonl files in"),
        (
            lambda d: [write(d, 0, [line()]).parent, "--html", d / "no" / "p.html"],
            "cannot write --html",
        ),
    ],
)
@pytest.mark.parametrize("as_json", [False, True])
def test_cli_input_or_output_error_is_one_line_and_exit_2(tmp_path, capsys, args, why, as_json):
    """A CI step reading a wrong path (or writing the page where it cannot) fails: exit 2 and
    one line why (a JSON object with --json). The missing directory is summarize's
    MediaInputError (main reports no other error so), the empty one its ``files == ()``."""
    (tmp_path / "notes.txt").write_text("x")
    argv = ["report", *map(str, args(tmp_path)), *(["--json"] if as_json else [])]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and why in err
    if as_json:  # every subcommand's shape (test_hostile_replay: replay's)
        assert json.loads(out) == {"error": err.strip().split(": ", 1)[1], "exit_code": 2}
    else:
        assert out == ""


def test_cli_text_file_named_like_a_log_is_malformed(tmp_path, capsys):
    (tmp_path / file_name(0)).write_text("hello world")
    assert main(["report", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "1 malformed line(s)" in err and "0 torn" in err and "torn last line" not in out


def test_summary_is_frozen(tmp_path):
    write(tmp_path, 0, [line()])
    s = summarize([tmp_path / file_name(0)])
    assert isinstance(s, ReportSummary) and s.records == 1
    with pytest.raises(AttributeError):
        s.records = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.by_event["check"] = 5  # type: ignore[index]
