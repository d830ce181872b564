"""Per-rank JSONL writer: schema v1, fsync before return, naming, logger, threads."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from logging.handlers import BufferingHandler
from pathlib import Path

import numpy as np
import pytest

from megatron_media_guard.diagnostics import (
    EVENTS,
    LOGGER_NAME,
    SCHEMA_KEYS,
    SCHEMA_VERSION,
    DiagnosticsLog,
    GuardRecord,
    RankInfo,
    build_record,
    get_logger,
    summary_line,
)
from megatron_media_guard.errors import MediaInputError

SEED = GuardRecord(
    "drop",
    step=12,
    microbatch=0,
    sample=5,
    sample_id="abc",
    row=1,
    item=2,
    modality="image",
    expected=(2010,) * 16,
    got=(2550,) * 16,
    first_mismatch=0,
    num_frames=16,
    frame_hw=(1080, 2400),
    grid=(67, 30),
    action="drop",
    reason="40800 features for 32160 placeholders (+8640)",
    duration_ms=1.25,
)


def _lines(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_emit_writes_full_schema_v1_line(tmp_path):
    info = RankInfo(rank=3, tp=1, pp=0, dp=1, cp=0)
    with DiagnosticsLog(tmp_path, info) as log:
        written = log.emit(SEED, caller="trainer:step")
        default = log.emit(GuardRecord("check"))
    rec, _ = _lines(log.path)
    assert rec == written
    assert tuple(rec) == SCHEMA_KEYS  # every key, in schema order, no "extra" when not given
    assert rec["schema"] == SCHEMA_VERSION == 1
    assert (rec["rank"], rec["tp"], rec["pp"], rec["dp"], rec["cp"]) == (3, 1, 0, 1, 0)
    assert rec["expected"] == [2010] * 16 and rec["got"] == [2550] * 16
    assert rec["frame_hw"] == [1080, 2400] and rec["grid"] == [67, 30]
    assert rec["tiles"] is None and rec["fidelity"] is None
    assert rec["pid"] == os.getpid() and isinstance(rec["host"], str)
    assert rec["time"].endswith("+00:00") and "T" in rec["time"]
    assert rec["caller"] == "trainer:step"
    # without caller=: the calling function
    assert default["caller"].endswith(":test_emit_writes_full_schema_v1_line")


def test_fsync_happens_before_emit_returns(tmp_path, monkeypatch):
    seen: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        real(fd)
        seen.append(Path(log.path).read_text())  # the line is already in the file

    monkeypatch.setattr(os, "fsync", spy)
    log = DiagnosticsLog(tmp_path, RankInfo(rank=1))
    log.emit(GuardRecord("raise", step=4, reason="x"))
    assert len(seen) == 1 and json.loads(seen[0])["event"] == "raise"
    log.emit(GuardRecord("check"))
    assert len(seen) == 2
    log.close()


@pytest.mark.parametrize(
    ("rank", "name", "field"),
    [
        (3, "media_guard.rank00003.jsonl", 3),
        (0, "media_guard.rank00000.jsonl", 0),
        (None, "media_guard.rank00000.jsonl", None),  # unknown rank: file 0, field null
        (123456, "media_guard.rank123456.jsonl", 123456),
    ],
)
def test_file_name(tmp_path, rank, name, field):
    with DiagnosticsLog(tmp_path / "logs", RankInfo(rank=rank)) as log:
        assert log.path == tmp_path / "logs" / name
        assert not log.path.exists()  # opened lazily
        log.emit(GuardRecord("check"))
    assert _lines(tmp_path / "logs" / name)[0]["rank"] == field


@pytest.mark.parametrize(
    ("env", "rank"), [({"RANK": "5"}, 5), ({}, None), ({"RANK": "x"}, None), ({"RANK": " 2"}, 2)]
)
def test_rank_from_env(monkeypatch, env, rank):
    assert RankInfo.from_env(env) == RankInfo(rank=rank)
    monkeypatch.setattr(os, "environ", env)  # a log without a rank reads os.environ
    assert DiagnosticsLog(None).rank.rank == rank


def test_no_log_dir_writes_nothing_but_logs(tmp_path, capsys):
    log = DiagnosticsLog(None, RankInfo(rank=2))
    rec = log.emit(SEED)
    assert log.path is None and rec["event"] == "drop"
    assert "[media-guard] rank 2, step 12, microbatch 0: sample 5" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_logger_is_idempotent_and_does_not_propagate(tmp_path, capsys):
    a, b = get_logger(), get_logger()
    assert a is b and a.name == LOGGER_NAME and a.propagate is False
    assert a.level == logging.INFO
    to_stderr = [h for h in a.handlers if getattr(h, "stream", None) is sys.stderr]
    assert len(to_stderr) == 1  # (pytest adds its own capture handlers next to ours)
    n = len(a.handlers)
    get_logger()
    assert len(a.handlers) == n
    root_catch = BufferingHandler(1 << 20)
    logging.getLogger().addHandler(root_catch)
    try:
        with DiagnosticsLog(tmp_path, RankInfo(rank=0)) as log:
            log.emit(GuardRecord("check", step=1))
            log.emit(GuardRecord("drop", step=1, sample=0))
    finally:
        logging.getLogger().removeHandler(root_catch)
    assert root_catch.buffer == []  # nothing reached the root logger
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "[media-guard] rank 0, step 1: check",
        "[media-guard] rank 0, step 1: sample 0 -> drop",
    ]


@pytest.mark.parametrize("event", EVENTS)
def test_log_level_by_event(event):
    level = logging.WARNING if event in ("drop", "raise", "budget", "repair") else logging.INFO
    seen = BufferingHandler(1 << 20)
    get_logger().addHandler(seen)
    try:
        DiagnosticsLog(None, RankInfo(rank=0)).emit(GuardRecord(event))
    finally:
        get_logger().removeHandler(seen)
    assert [r.levelno for r in seen.buffer] == [level]


JSON_SAFE = {  # extra's key: (value given, value written)
    "nan": (float("nan"), None),
    "inf": (-float("inf"), None),
    "np": (np.int64(4), 4),
    "f32": (np.float32(0.5), 0.5),
    "obj": (object(), "<object>"),
    "arr": (np.zeros(0), "<ndarray>"),
    "list": ((1, 2.0, None), [1, 2.0, None]),
    "nested": ({"a": [1]}, {"a": [1]}),
}


def test_values_are_strict_json(tmp_path):
    extra = {k: given for k, (given, _) in JSON_SAFE.items()}
    with DiagnosticsLog(tmp_path, RankInfo(rank=0)) as log:
        record = GuardRecord(
            "repair",
            sample=np.int32(3),
            expected=(np.int64(4),),
            duration_ms=float("nan"),
            extra=extra,
        )
        rec = log.emit(record)
    line = log.path.read_text()
    assert "NaN" not in line and "Infinity" not in line
    assert _lines(log.path)[0] == rec
    assert rec["duration_ms"] is None and rec["sample"] == 3 and rec["expected"] == [4]
    assert rec["extra"] == {k: written for k, (_, written) in JSON_SAFE.items()}


def test_unknown_event_is_rejected():
    with pytest.raises(MediaInputError, match="unknown diagnostics event 'oops'"):
        GuardRecord("oops")  # type: ignore[arg-type]


@pytest.mark.usefixtures("quiet_logger")  # keep 400 summaries off stderr
def test_threads_write_whole_lines(tmp_path):
    def work(t: int) -> None:
        for i in range(50):
            log.emit(GuardRecord("check", step=i, sample=t, sample_id=f"t{t}-{i}" * 20))

    with DiagnosticsLog(tmp_path, RankInfo(rank=0)) as log:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
    recs = _lines(log.path)
    assert len(recs) == 400 and all(tuple(r) == SCHEMA_KEYS for r in recs)
    assert sorted((r["sample"], r["step"]) for r in recs) == [
        (t, i) for t in range(8) for i in range(50)
    ]


def test_emit_after_close_reopens(tmp_path):
    log = DiagnosticsLog(tmp_path, RankInfo(rank=0))
    log.emit(GuardRecord("check"))
    log.close()
    log.close()
    log.emit(GuardRecord("step"))
    log.close()
    assert [r["event"] for r in _lines(log.path)] == ["check", "step"]


def test_write_failure_does_not_raise(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    log = DiagnosticsLog(blocker / "sub", RankInfo(rank=0))  # a directory cannot be made here
    rec = log.emit(GuardRecord("raise", reason="r"))
    log.emit(GuardRecord("raise", reason="r"))
    assert rec["event"] == "raise" and log.write_errors == 2
    assert capsys.readouterr().err.count("cannot write diagnostics") == 1


@pytest.mark.parametrize(
    ("rec", "parts"),
    [
        (
            build_record(SEED, RankInfo(rank=3), time="t", host="h", pid=1, caller=None),
            [
                "[media-guard] rank 3, step 12, microbatch 0: sample 5 (sample_id 'abc') row 1, "
                "image item 2 (16 frames of 1080x2400 (HxW), grid 67x30): placeholder runs "
                "[2010 x16] = 32160 vs item features [2550 x16] = 40800 (surplus 8640, first "
                "mismatch at run 0); 40800 features for 32160 placeholders (+8640); 1.25 ms -> drop",
            ],
        ),
        (
            dict(
                rank=None,
                event="repair",
                sample=0,
                sample_id=17,
                expected=[256, 257],
                got=[256, 256],
                action="repair",
                fidelity="unique",
            ),
            [
                "single process (RANK unset): sample 0 (sample_id 17): ",
                "placeholder runs [256, 257] = 513 vs item features [256 x2] = 512 (deficit 1)",
                "; fidelity unique -> repair",
            ],
        ),
        (
            dict(event="check", expected=[4, 5], got=[5, 4], action="keep", duration_ms=0.25),
            ["[5, 4] = 9 (equal totals); 0.25 ms -> keep (check)"],
        ),
        (  # garbage types from a foreign file: no crash, one line
            dict(rank=[1], event=5, expected="x\ny", got=[1.5], frame_hw=[1], reason="a\nb"),
            ["rank [1]", "expected x y", "; a b"],
        ),
        ({}, ["[media-guard] single process (RANK unset): ?"]),
        (  # a long list: its head and a count
            dict(event="check", expected=list(range(40))),
            ["placeholder runs [0, 1, 2, 3, 4, 5, 6, 7, ... +32 more] = 780"],
        ),
    ],
)
def test_summary_line(rec, parts):
    line = summary_line(rec)
    assert "\n" not in line
    for part in parts:
        assert part in line, (part, line)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.usefixtures("quiet_logger")
def test_forked_child_appends_its_own_lines(tmp_path):
    with DiagnosticsLog(tmp_path, RankInfo(rank=0)) as log:
        log.emit(GuardRecord("check", step=0))
        pid = os.fork()
        if pid == 0:  # child: same object, inherited descriptor and lock
            try:
                log.emit(GuardRecord("drop", step=1))
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        log.emit(GuardRecord("check", step=2))
    recs = _lines(log.path)
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert recs[1]["pid"] == pid and recs[0]["pid"] == recs[2]["pid"] == os.getpid()
