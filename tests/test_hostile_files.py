"""Hostile files for the post-mortem tools: ``media-guard report`` over rank files that are
special, unreadable, deeply nested, not UTF-8, full of escape sequences or huge strings, and
``media-guard replay`` over bundles that declare more than they hold or lie in their
metadata. Each case: counted or refused with a reason, the rest of the post-mortem kept,
never a hang (every test has a hard timeout), never a traceback, the right exit code."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_media_guard import GuardConfig, MediaItem, RankInfo
from megatron_media_guard.cli import main
from megatron_media_guard.diagnostics import (
    GuardRecord,
    build_record,
    file_name,
    get_logger,
    json_dumps,
    report_lines,
)
from megatron_media_guard.diagnostics.report import summarize
from megatron_media_guard.diagnostics.report_format import format_summary
from megatron_media_guard.errors import MediaInputError
from megatron_media_guard.replay import bundle_load
from megatron_media_guard.replay.bundle import FORMAT
from megatron_media_guard.replay.bundle_save import save_bundle
from megatron_media_guard.replay.rerun import replay_main
from megatron_media_guard.testing import TEST_GRAMMARS, inject

pytestmark = pytest.mark.timeout(60)
Q = TEST_GRAMMARS["qwen"]


@pytest.fixture(autouse=True)
def _quiet_logger():
    get_logger().setLevel(logging.ERROR)
    yield
    get_logger().setLevel(logging.INFO)


def line(event="drop", rank=0, step=1, mb=0, time="2026-01-01T00:00:00.000000+00:00", **kw):
    rec = build_record(
        GuardRecord(event, step=step, microbatch=mb, **kw),
        RankInfo(rank=rank),
        time=time,
        host="h",
        pid=1,
        caller="t:t",
    )
    return json_dumps(rec) + "\n"


GOOD = [line(sample_id="s0", reason="surplus: 5 features for 4 placeholders (+1)")] * 3


def good_file(d: Path, rank: int = 0) -> Path:
    p = d / file_name(rank)
    p.write_text("".join(GOOD))
    return p


# ---- report: special files named like rank files ------------------------------------------


def _fifo(p):
    os.mkfifo(p)


def _char_device(p):
    os.symlink("/dev/urandom", p)


def _zero_device(p):
    os.symlink("/dev/zero", p)


def _directory(p):
    p.mkdir()


def _dangling(p):
    os.symlink(p.parent / "nowhere", p)


def _loop(p):
    os.symlink(p.absolute(), p)


SPECIAL = {
    "fifo": (_fifo, "FIFO"),
    "urandom": (_char_device, "character device"),
    "zero": (_zero_device, "character device"),
    "directory": (_directory, "directory"),
    "dangling_symlink": (_dangling, "No such file"),
    "symlink_loop": (_loop, "symbolic links"),
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

    monkeypatch.setattr(report_lines.os, "open", deny)
    s = summarize(tmp_path, jobs=1)
    assert s.records == 3 and "Permission denied" in s.skipped_files[str(bad)]


def test_report_of_a_directory_of_special_files_only_via_subprocess(tmp_path):
    """End to end, in a fresh process with a hard timeout: a FIFO never hangs the command."""
    os.mkfifo(tmp_path / file_name(0))
    done = subprocess.run(
        [sys.executable, "-m", "megatron_media_guard", "report", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["records"] == 0 and "FIFO" in next(iter(out["skipped_files"].values()))


# ---- report: hostile content ---------------------------------------------------------------

HOSTILE_LINES = {
    "deep_array": "[" * 3000 + "]" * 3000 + "\n",
    "deep_object": '{"a":' * 3000 + "1" + "}" * 3000 + "\n",
    "deep_inside_record": '{"schema":1,"event":"drop","extra":' + "[" * 5000 + "]" * 5000 + "}\n",
    "bad_utf8_in_string": None,  # bytes, below
    "glued_torn_record": '{"schema":1,"event":"dro' + GOOD[0],
    "huge_int": '{"schema":1,"event":"drop","sample_id":' + "9" * 5000 + "}\n",
}


@pytest.mark.parametrize("case", sorted(HOSTILE_LINES))
def test_hostile_lines_are_malformed_and_the_rest_is_kept(tmp_path, case):
    p = tmp_path / file_name(0)
    bad = (
        b'{"schema":1,"event":"drop","reason":"\xff\xfe"}\n'
        if HOSTILE_LINES[case] is None
        else HOSTILE_LINES[case].encode()
    )
    p.write_bytes(GOOD[0].encode() + bad + GOOD[1].encode())
    s = summarize(tmp_path, jobs=1)
    assert (s.records, s.malformed, s.count("drop")) == (2, 1, 2)
    assert not s.torn_files


def test_control_characters_never_reach_the_terminal(tmp_path):
    esc = "\x1b[2J\x1b]0;owned\x07\r\x9b"
    p = tmp_path / file_name(0)
    p.write_text(line("raise", sample_id=esc, reason=f"x{esc}y", action=esc) + "".join(GOOD))
    text = format_summary(summarize(tmp_path, jobs=1))
    assert not any((ord(ch) < 32 and ch != "\n") or 0x7F <= ord(ch) <= 0x9F for ch in text)
    assert "\\x1b[2J" in text  # shown, escaped


def test_huge_strings_are_cut_in_the_summary(tmp_path):
    p = tmp_path / file_name(0)
    with p.open("w") as f:
        for i in range(300):
            big = f"{i}-" + "x" * 50_000
            f.write(line("raise", sample_id=big[:1000], reason="r " * 20_000, action=big))
    s = summarize(tmp_path, jobs=1)
    assert s.records == 300
    assert max(len(str(k)) for k, _ in s.top_sample_ids) <= 210
    assert max(len(k) for k in s.by_action) <= 130 and max(len(k) for k in s.by_reason) <= 130
    text = format_summary(s)
    assert max(len(x) for x in text.splitlines()) < 400
    assert len(json.dumps(s.to_dict())) < 200_000


# ---- report: reading a smoke directory of several runs -----------------------------------


def test_smoke_directory_names_the_run_and_labels_consensus(tmp_path):
    for run, rank in (("raise.policy", 1), ("drop.policy", 0)):
        d = tmp_path / run
        d.mkdir()
        (d / file_name(rank)).write_text(
            line(
                "raise" if run.startswith("raise") else "drop",
                rank=rank,
                action="raise" if run.startswith("raise") else "drop",
                reason="surplus: 10200 features for 8040 placeholders in the last video item",
            )
            + line("consensus", rank=rank, action="raise")
        )
    s = summarize(tmp_path, jobs=1)
    assert s.by_action == {"drop": 1, "raise": 1, "raise (consensus)": 2}
    text = format_summary(s)
    assert "[raise.policy/media_guard.rank00001.jsonl:1]" in text
    assert "not raises of its own" in text


@pytest.mark.parametrize("limit", [20, 40, 57])
def test_reasons_are_not_cut_mid_word(limit):
    from megatron_media_guard.diagnostics.records import cut_words

    text = "surplus: 10200 features for 8040 placeholders in the last video item"
    out = cut_words(text, limit)
    assert len(out) <= limit and out.endswith("...")
    assert text.startswith(out[:-3]) and text[len(out) - 3] == " "


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
    import megatron_media_guard.diagnostics.report_aggregate as agg

    real = agg.template_match
    try:
        agg.template_match = lambda line: None  # every line parsed in full
        slow = summarize(d, jobs=1).to_dict()
    finally:
        agg.template_match = real
    assert fast == slow


# ---- report and --help stay torch-free --------------------------------------------------

TORCH_FREE_REPORT = """
import sys
from megatron_media_guard.cli import main
code = main(["report", sys.argv[1], "--json"])
print("TORCH:" + ",".join(sorted(m for m in sys.modules if m.split(".")[0] == "torch"))[:200])
sys.exit(code)
"""


def test_report_command_imports_no_torch(tmp_path):
    good_file(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", TORCH_FREE_REPORT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "TORCH:", done.stdout[-300:]


# ---- replay: hostile bundles ----------------------------------------------------------------


def _good_bundle(d: Path) -> Path:
    batch = inject(Q, [[("image", 4)], [("image", 3)]], "surplus_feature")
    return save_bundle(
        d,
        input_ids=batch.input_ids,
        items=batch.items,
        grammar=Q,
        config=GuardConfig(),
        rank=RankInfo(rank=1),
        step=3,
    )


def _meta_and_tensors(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        return json.loads(fh.metadata()[FORMAT]), {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118


def _torch_bundle(d: Path, meta: dict, tensors: dict) -> Path:
    p = d / "hostile.bundle"
    torch.save({FORMAT: json.dumps(meta), "tensors": tensors}, p)
    return p


def _stride0(d, meta, tensors):
    """A few KB on disk; a [1, 3e8] int64 view of one element (2.4 GB once expanded)."""
    n = 300_000_000
    meta["tensors"]["input_ids"] = {"dtype": "int64", "shape": [1, n]}
    return _torch_bundle(d, meta, {"input_ids": torch.zeros(1, 1, dtype=torch.long).expand(1, n)})


def _zip_bomb(d, meta, tensors):
    """A deflated torch zip: small on disk, its directory declares 8 MB (limit here 1 MB)."""
    n = 1_000_000
    meta["tensors"]["input_ids"] = {"dtype": "int64", "shape": [1, n]}
    plain = _torch_bundle(d, meta, {"input_ids": torch.zeros(1, n, dtype=torch.long)})
    out = d / "bomb.bundle"
    with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
    assert out.stat().st_size < 100_000
    return out


def _st_file(d: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    p = d / "hostile.bundle"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return p


def _st_huge_shape(d, meta, tensors):
    spec = {"dtype": "I64", "shape": [1, 10**12], "data_offsets": [0, 8 * 10**12]}
    return _st_file(d, {"__metadata__": {FORMAT: json.dumps(meta)}, "input_ids": spec}, b"\0" * 8)


def _st_header_length(d, meta, tensors):
    p = d / "hostile.bundle"
    p.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    return p


def _st_deep_header(d, meta, tensors):
    return _st_file(d, {"__metadata__": {FORMAT: "[" * 5000 + "]" * 5000}}, b"")


def _meta(mutate):
    def make(d, meta, tensors):
        from safetensors.torch import save_file

        mutate(meta)
        p = d / "hostile.bundle"
        save_file(tensors, str(p), metadata={FORMAT: json.dumps(meta)})
        return p

    return make


def _item(key, value):
    return _meta(lambda m: m["items"][0].__setitem__(key, value))


HOSTILE_BUNDLES = {
    "stride0_view": (_stride0, "limit"),
    "zip_bomb": (_zip_bomb, "uncompressed"),
    "st_shape_past_the_file": (_st_huge_shape, "data offsets"),
    "st_header_length": (_st_header_length, "header declares"),
    "st_deep_metadata": (_st_deep_header, "invalid"),
    "items_not_a_list": (_meta(lambda m: m.__setitem__("items", 5)), "items"),
    "num_features_str": (_item("num_features", "five"), "num_features"),
    "num_features_huge": (_item("num_features", 10**30), "num_features"),
    "frame_hw_garbage": (_item("frame_hw", [1, 2, 3, {"a": 1}]), "frame_hw"),
    "sample_id_huge": (_item("sample_id", "x" * 100_000), "sample_id"),
    "sample_id_object": (_item("sample_id", {"a": 1}), "sample_id"),
    "grammar_missing": (_meta(lambda m: m.pop("grammar")), "grammar"),
    "grammar_id_str": (_meta(lambda m: m["grammar"].__setitem__("start_id", "x")), "start_id"),
    "rank_extra_key": (_meta(lambda m: m.__setitem__("rank", {"bogus": 1})), "rank"),
    "config_bad": (_meta(lambda m: m.__setitem__("config", {"policy": 7})), "policy"),
    "report_a_list": (_meta(lambda m: m.__setitem__("report", [1])), "report"),
    "mismatched_sample_str": (
        _meta(lambda m: m["report"].__setitem__("mismatched", [{"sample": "z"}])),
        "mismatched",
    ),
    "step_str": (_meta(lambda m: m.__setitem__("step", "x")), "step"),
    "tensors_a_list": (_meta(lambda m: m.__setitem__("tensors", [1])), "tensors"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_BUNDLES))
def test_hostile_bundle_exits_2_with_one_line(tmp_path, case, capsys):
    make, why = HOSTILE_BUNDLES[case]
    meta, tensors = _meta_and_tensors(_good_bundle(tmp_path))
    path = make(tmp_path, meta, tensors)
    assert replay_main([str(path), "--max-bytes", str(1 << 20)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("media-guard replay: ") and why in err, err
    assert "Traceback" not in err


def test_good_bundle_still_reproduces_with_exit_1(tmp_path, capsys):
    path = _good_bundle(tmp_path)
    assert replay_main([str(path), "--max-bytes", str(1 << 20)]) == 1
    assert "Media alignment failed" in capsys.readouterr().out


def test_the_limit_is_configurable_and_checked_before_loading(tmp_path, monkeypatch, capsys):
    path = _good_bundle(tmp_path)
    loaded = []
    real = bundle_load.torch.load
    monkeypatch.setattr(
        bundle_load.torch, "load", lambda *a, **k: loaded.append(1) or real(*a, **k)
    )
    assert replay_main([str(path), "--max-bytes", "16"]) == 2
    assert "limit" in capsys.readouterr().err and not loaded
    monkeypatch.setenv("MEDIA_GUARD_REPLAY_MAX_BYTES", "16")
    assert replay_main([str(path)]) == 2
    monkeypatch.setenv("MEDIA_GUARD_REPLAY_MAX_BYTES", "lots")
    assert replay_main([str(path)]) == 2
    assert "MEDIA_GUARD_REPLAY_MAX_BYTES" in capsys.readouterr().err


def test_token_ids_are_bounded_tighter_than_bytes(tmp_path, capsys):
    ids = torch.full((1, 40_000), 1, dtype=torch.long)  # 320 KB, 40k tokens
    path = save_bundle(tmp_path, input_ids=ids, items=[], grammar=Q)
    assert replay_main([str(path), "--max-bytes", str(1 << 20)]) == 2  # 16,384 tokens admitted
    assert "token ids" in capsys.readouterr().err
    assert replay_main([str(path), "--max-bytes", str(4 << 20)]) == 0  # aligned: no media


# ---- MediaItem refuses what diagnostics could not carry ---------------------------------


@pytest.mark.parametrize(
    "sid, ok",
    [
        ("abc", True),
        (7, True),
        (-(2**63) + 1, True),
        (torch.tensor(5), False),  # str(x) or int(x) of it
        (2**63, False),
        (10**5000, False),
        ("x" * 1025, False),
        (1.5, False),
        (object(), False),
        (True, False),
        (b"id", False),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, bool) else str(v),
)
def test_sample_id_is_checked_at_construction(sid, ok):
    if ok:
        item = MediaItem(3, sample_id=sid)
        assert type(item.sample_id) in (str, int)
    else:
        with pytest.raises(MediaInputError, match="sample_id"):
            MediaItem(3, sample_id=sid)


def test_str_subclass_with_a_hostile_repr_is_stored_as_a_plain_str():
    class Evil(str):
        def __repr__(self):
            raise RuntimeError("boom")

    item = MediaItem(3, sample_id=Evil("id-1"))
    assert type(item.sample_id) is str and repr(item.sample_id) == "'id-1'"


def test_streams_are_not_left_open(tmp_path):
    """The reader closes every file it opened (no descriptor leak over many files)."""
    for r in range(50):
        good_file(tmp_path, r)
    before = len(os.listdir("/proc/self/fd"))
    summarize(tmp_path, jobs=1)
    assert len(os.listdir("/proc/self/fd")) <= before
