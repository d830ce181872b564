"""Fault injection for the per-rank log writer and the replay dump: short writes, ENOSPC
(``os.write`` monkeypatched), a FIFO at the log path, a torn tail left mid-run by another
writer, and a full disk under the torch-format bundle. The promises: the next good record
is never lost, the merge is never blocked, a raise stays a MediaAlignmentError that says
when nothing could be written, a drop is applied, and the record comes before the bundle."""

from __future__ import annotations

import errno
import json
import os
import threading
from collections.abc import Mapping

import pytest
import torch

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaGuard
from megatron_media_guard.cli import main
from megatron_media_guard.core import providers
from megatron_media_guard.diagnostics import DiagnosticsLog, GuardRecord, RankInfo, log
from megatron_media_guard.diagnostics.report import summarize
from megatron_media_guard.replay import bundle_save
from megatron_media_guard.testing import TEST_GRAMMARS, inject

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("quiet_logger")]
Q = TEST_GRAMMARS["qwen"]
LAYOUT = [[("image", 4)], [("image", 3)]]


def merge_a_fault(cfg: GuardConfig, **kw):
    """One merge of a batch with a surplus feature on rank 0."""
    guard = MediaGuard(cfg, Q, rank=RankInfo(rank=0))
    batch = inject(Q, LAYOUT, "surplus_feature")
    emb = torch.zeros(*batch.input_ids.shape, 8)
    return guard.merge(emb, batch.input_ids, batch.features(8), batch.items, **kw)


def reasons(path) -> list[str]:
    """The ``reason`` of every line that parses, in order; None for a line that does not."""
    out = []
    for raw in path.read_bytes().split(b"\n")[:-1]:
        try:
            out.append(json.loads(raw)["reason"])
        except ValueError:
            out.append(None)
    return out


class FlakyWrite:
    """``os.write`` that misbehaves on chosen calls: ``short`` writes half the bytes, ``enospc``
    writes half then raises ENOSPC (a disk that filled mid-line), ``fail`` raises at once."""

    def __init__(self, plan: dict[int, str]):
        self.plan, self.calls, self.real = plan, 0, os.write

    def __call__(self, fd, data):
        self.calls += 1
        what = self.plan.get(self.calls)
        if what == "short":
            return self.real(fd, bytes(data[: max(1, len(data) // 2)]))
        if what == "enospc":
            self.real(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        if what == "fail":
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real(fd, data)


@pytest.mark.parametrize(
    "plan, emits, lines",
    [
        ({2: "short"}, "abc", ["a", "b", "c"]),  # a short write is completed, nothing lost
        ({2: "short", 3: "short", 4: "short"}, "abc", ["a", "b", "c"]),
        ({2: "enospc"}, "abc", ["a", None, "c"]),  # the torn line only
        ({2: "fail"}, "abc", ["a", "c"]),  # nothing of b reached the file
        ({2: "enospc", 3: "fail"}, "abcd", ["a", None, "d"]),  # two failures in a row
    ],
    ids=["short", "short_x3", "enospc_mid_line", "enospc_at_once", "enospc_then_fail"],
)
def test_write_faults_never_cost_the_next_record(tmp_path, monkeypatch, plan, emits, lines):
    flaky = FlakyWrite(plan)
    monkeypatch.setattr(log.os, "write", flaky)
    w = DiagnosticsLog(tmp_path, RankInfo(rank=0))
    for r in emits:
        w.emit(GuardRecord("check", reason=r))
    assert reasons(w.path) == lines
    assert w.write_errors == sum(1 for v in plan.values() if v != "short")
    assert w.last_error is None and w.describe_path() == str(w.path)  # the last write was good
    s = summarize(tmp_path, jobs=1)
    assert s.records == sum(x is not None for x in lines) and not s.torn_files


TORN = b'{"schema":1,"ev'  # a line another writer left when it died mid-write
PEER = b'{"schema":1,"event":"check","reason":"peer"}\n'  # a well-behaved peer's whole line


@pytest.mark.parametrize(
    "steps, want",
    [
        (["one", TORN, "two", "three"], ["one", None, "two", "three"]),  # with our file open
        ([TORN, "one", PEER, "two"], [None, "one", "peer", "two"]),  # before this process began
    ],
    ids=["mid_run", "at_open"],
)
def test_torn_tail_from_another_writer_costs_only_that_line(tmp_path, steps, want):
    w = DiagnosticsLog(tmp_path, RankInfo(rank=0))
    for step in steps:
        if isinstance(step, bytes):
            with open(w.path, "ab") as f:
                f.write(step)
        else:
            w.emit(GuardRecord("check", reason=step))
    assert reasons(w.path) == want
    s = summarize(tmp_path, jobs=1)
    assert (s.records, s.malformed) == (3, 1)


def test_a_fifo_at_the_log_path_never_blocks(tmp_path):
    os.mkfifo(tmp_path / "media_guard.rank00000.jsonl")
    w = DiagnosticsLog(tmp_path, RankInfo(rank=0))
    t = threading.Thread(target=w.emit, args=(GuardRecord("check"),), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "emit blocked on a FIFO"
    assert w.write_errors == 1 and "not a regular file" in w.last_error
    assert "write FAILED" in w.describe_path()


@pytest.mark.parametrize("fault", ["fifo", "enospc"])
def test_raise_says_when_the_log_could_not_be_written(tmp_path, monkeypatch, fault):
    if fault == "fifo":
        os.mkfifo(tmp_path / "media_guard.rank00000.jsonl")
    else:
        monkeypatch.setattr(log.os, "write", FlakyWrite({1: "fail", 2: "fail", 3: "fail"}))
    with pytest.raises(MediaAlignmentError) as info:
        merge_a_fault(GuardConfig(log_dir=str(tmp_path)), step=1)
    msg = str(info.value)
    assert "per-rank log:" in msg and "write FAILED" in msg
    assert ("not a regular file" if fault == "fifo" else "No space left") in msg


def test_emit_survives_a_field_that_cannot_be_serialized(tmp_path):
    class Loud(Mapping):
        def __getitem__(self, key):
            raise RuntimeError("boom")

        def __iter__(self):
            raise RuntimeError("boom")

        def __len__(self):
            return 1

    w = DiagnosticsLog(tmp_path, RankInfo(rank=0))
    rec = w.emit(GuardRecord("drop", extra=Loud()))
    assert rec["event"] == "drop" and "could not be serialized" in rec["reason"]
    assert reasons(w.path) == [rec["reason"]]


# ---- the dump: a full disk under the torch-format bundle --------------------------------
def _disk_full(*args, **kwargs):
    raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter failed writing")


@pytest.mark.parametrize("policy", ["drop", "raise"])
def test_full_dump_dir_with_the_torch_backend_is_contained(tmp_path, monkeypatch, policy):
    monkeypatch.setattr(bundle_save, "_safetensors", lambda: None)  # no safetensors installed
    monkeypatch.setattr(bundle_save.torch, "save", _disk_full)
    logs, dumps = tmp_path / "logs", tmp_path / "dumps"
    cfg = GuardConfig(policy=policy, log_dir=str(logs), dump_dir=str(dumps))
    labels = torch.ones_like(inject(Q, LAYOUT, "surplus_feature").input_ids)
    if policy == "raise":
        with pytest.raises(MediaAlignmentError) as info:
            merge_a_fault(cfg, labels=labels)
        assert type(info.value) is MediaAlignmentError and "replay bundle" not in str(info.value)
    else:
        res = merge_a_fault(cfg, labels=labels)
        assert res.report.dropped and (res.labels == cfg.ignore_index).any()
    s = summarize(logs, jobs=1)
    assert s.count(policy) == 1  # the record was written although the bundle was not
    assert not list(dumps.glob("*.bundle"))


def test_record_is_written_before_the_bundle(tmp_path, monkeypatch):
    """The bundle writer sees the record already on disk (a crash in between keeps it); the
    raise names the bundle, whose replay reproduces the mismatch."""
    seen = []
    real = bundle_save.save_bundle

    def spy(*args, **kwargs):
        seen.append(summarize(tmp_path / "logs", jobs=1).count("raise"))
        return real(*args, **kwargs)

    monkeypatch.setitem(providers._PROVIDED, "bundle", spy)  # the writer the fault path calls
    cfg = GuardConfig(log_dir=str(tmp_path / "logs"), dump_dir=str(tmp_path / "dumps"))
    with pytest.raises(MediaAlignmentError) as info:
        merge_a_fault(cfg)
    assert seen == [1] and "replay bundle:" in str(info.value)
    path = str(info.value).split("replay bundle: ")[1].strip()
    assert path.endswith(".bundle") and main(["replay", path]) == 1
