"""Replay bundles: round trip, replay parity with the live raise, corrupt input, no pickle,
exit codes, atomic writes."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import stat
import tempfile
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_media_guard import (
    GuardConfig,
    MediaAlignmentError,
    MediaGuard,
    MediaInputError,
    MediaItem,
)
from megatron_media_guard.cli import main
from megatron_media_guard.core.alignment import check_alignment
from megatron_media_guard.diagnostics import RankInfo
from megatron_media_guard.replay import bundle, bundle_save
from megatron_media_guard.replay.bundle import FORMAT, BundleError, load_bundle, report_summary
from megatron_media_guard.replay.bundle_save import save_bundle
from megatron_media_guard.replay.rerun import replay
from megatron_media_guard.testing import TEST_GRAMMARS, build_batch, inject, random_layout

Q = TEST_GRAMMARS["qwen"]
H = 8
LAYOUT = [[("image", 4), ("image", 6)], [("image", 3)], [("video", 8)], []]
RANK = RankInfo(rank=3, tp=1, pp=0, dp=2, cp=None)
PIXEL_FIELDS = [f.name for f in dataclasses.fields(MediaItem) if f.name != "pixels"]


@pytest.fixture(params=["safetensors", "torch"])
def backend(request, monkeypatch):
    """Every bundle test runs with safetensors and with the torch.save fallback."""
    if request.param == "torch":
        monkeypatch.setattr(bundle_save, "_safetensors", lambda: None)
        monkeypatch.setattr(bundle, "_safetensors", lambda: None)
    return request.param


def packed_batch(ids_dtype=torch.long, pixel_dtype=torch.bfloat16):
    """Two packed samples in one row; sample 1's item has one feature too many.
    Items set every MediaItem field to a non-default value."""
    a = build_batch(Q, [[("image", 3)]]).input_ids
    b = build_batch(Q, [[("video", 5)]], seed=1).input_ids
    ids = torch.cat([a, b, torch.zeros(1, 2, dtype=torch.long)], dim=1).to(ids_dtype)
    cu = torch.tensor([0, a.shape[1], a.shape[1] + b.shape[1]], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    image = (torch.rand(3, 28, 56, generator=g) * 255).to(pixel_dtype)
    video = (torch.rand(4, 3, 28, 28, generator=g) * 255).to(pixel_dtype)
    items = (  # every field: num_features, sample, modality, sample_id, num_frames, frame_hw,
        # pixels, layout, grid_thw, source_hw
        MediaItem(3, 0, "image", "img-0", None, (28, 56), image, "image", (1, 2, 4), (100, 200)),
        MediaItem(6, 1, "video", 17, 4, (28, 28), video, "qwen_patches", (2, 1, 3), (480, 640)),
    )
    return ids, cu, items


def _names(d):
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


# ---- round trip --------------------------------------------------------------------------
@pytest.mark.parametrize("ids_dtype", [torch.long, torch.int32])
@pytest.mark.parametrize("pixel_dtype", [torch.bfloat16, torch.uint8, torch.float32])
def test_round_trip_every_field(tmp_path, backend, ids_dtype, pixel_dtype):
    ids, cu, items = packed_batch(ids_dtype, pixel_dtype)
    feats = torch.randn(9, H).to(torch.bfloat16)
    cfg = GuardConfig(policy="repair", fallback="raise", nonfinite="off", log_dir=str(tmp_path))
    batch = dict(input_ids=ids, items=items, grammar=Q, cu_seqlens=cu, features=feats)
    path = save_bundle(tmp_path / "dump", **batch, config=cfg, rank=RANK, step=12, microbatch=1)
    assert path is not None and path.name == "media_guard.rank00003.step12.mb1.bundle"
    assert (path.read_bytes()[:4] == b"PK\x03\x04") == (backend == "torch")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # sensitive: token ids and pixels
    got = load_bundle(path)
    assert got.input_ids.dtype == ids_dtype and torch.equal(got.input_ids, ids)
    assert got.cu_seqlens.dtype == torch.int32 and torch.equal(got.cu_seqlens, cu)
    assert len(got.items) == len(items)
    for old, new in zip(items, got.items):
        for name in PIXEL_FIELDS:
            assert getattr(new, name) == getattr(old, name), name
            assert type(getattr(new, name)) is type(getattr(old, name)), name
    # only the mismatched sample's item carries pixels and features, bit-exact
    assert got.items[0].pixels is None and 0 not in got.features
    assert got.items[1].pixels.dtype == pixel_dtype
    assert torch.equal(got.items[1].pixels, items[1].pixels)
    assert torch.equal(got.features[1], feats[3:])
    assert got.grammar == Q and got.grammar.name == Q.name
    assert got.config == cfg
    assert got.rank == RANK and (got.step, got.microbatch) == (12, 1)
    assert dict(got.report) == report_summary(check_alignment(ids, items, Q, cu))
    assert got.report["mismatched"][0]["sample"] == 1


def test_include_pixels_false_and_no_pixels(tmp_path, backend):
    ids, cu, items = packed_batch()
    p = save_bundle(
        tmp_path, input_ids=ids, items=items, grammar=Q, cu_seqlens=cu, include_pixels=False
    )
    got = load_bundle(p)
    assert all(it.pixels is None for it in got.items) and not got.features
    assert got.config is None and got.rank is None and got.step is None
    assert p.name == "media_guard.rank00000.stepna.mbna.bundle"


@pytest.mark.parametrize("hard_links", [True, False])
def test_never_overwrites_a_bundle(tmp_path, backend, monkeypatch, hard_links):
    """With hard links (atomic, never overwrites) or without (check, then rename)."""
    if not hard_links:
        monkeypatch.setattr(os, "link", mock.Mock(side_effect=OSError(1, "Not permitted")))
    ids, cu, items = packed_batch()
    kw = dict(input_ids=ids, items=items, grammar=Q, cu_seqlens=cu, rank=RANK, step=5)
    first = save_bundle(tmp_path, microbatch=0, **kw)
    before = first.read_bytes()
    second = save_bundle(tmp_path, microbatch=0, **kw)
    assert second != first and second.name == "media_guard.rank00003.step5.mb0.1.bundle"
    assert first.read_bytes() == before and torch.equal(load_bundle(second).input_ids, ids)
    assert save_bundle(tmp_path, microbatch=0, max_bundles=2, **kw) is None
    assert _names(tmp_path) == sorted([first.name, second.name])


# ---- replay parity with the live raise -----------------------------------------------------
@pytest.mark.parametrize(
    "fault", ["budget_shrink", "offsetting", "swapped_items", "extra_pad", "cut_by_max_len"]
)
@pytest.mark.parametrize("pass_report", [True, False])
def test_replay_reproduces_live_message(tmp_path, backend, fault, pass_report):
    batch = inject(Q, LAYOUT, fault)
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(*batch.input_ids.shape, H, generator=g)
    guard = MediaGuard(GuardConfig(log_dir=str(tmp_path / "logs")), grammar=Q, rank=RANK)
    with pytest.raises(MediaAlignmentError) as info:
        guard.merge(emb, batch.input_ids, batch.features(H), batch.items, step=12, microbatch=1)
    live = str(info.value).splitlines()
    report = guard.check(batch.input_ids, batch.items) if pass_report else None
    path = save_bundle(
        tmp_path / "dump",
        input_ids=batch.input_ids,
        items=batch.items,
        grammar=Q,
        config=guard.config,
        rank=guard.rank,
        step=12,
        microbatch=1,
        report=report,
    )
    res = replay(load_bundle(path))
    again = res.message.splitlines()
    # every sample line and the batch totals; not the live log path (a replay writes no log)
    assert again[1:] == [line for line in live[1:] if "per-rank log" not in line]
    assert any("per-rank log" in line for line in live)
    assert "(replay of rank 3, step 12, microbatch 1)" in again[0]
    assert again[0].replace("replay of ", "") == live[0]
    assert not res.aligned and set(res.mismatched) == set(batch.faulty_samples)
    assert res.saved_mismatched == res.mismatched
    assert all(res.actions[s] == "raise" for s in res.mismatched)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["none", "budget_shrink", "surplus_feature"]))
def test_replay_report_equals_live_check(seed, fault):
    rng = random.Random(seed)
    layout = random_layout(rng, rng.randint(1, 4), modalities=("image", "video"))
    if fault != "none" and not any(layout):
        layout[0] = [("image", 3)]
    batch = inject(Q, layout, fault, seed=seed)
    live = check_alignment(batch.input_ids, batch.items, Q)
    with tempfile.TemporaryDirectory() as d:
        res = replay(
            load_bundle(save_bundle(d, input_ids=batch.input_ids, items=batch.items, grammar=Q))
        )
    assert res.report == live
    assert res.aligned == live.ok == (fault == "none")


# ---- command line ------------------------------------------------------------------------
def test_replay_exit_codes(tmp_path, capsys, backend):
    ok, bad = (
        save_bundle(tmp_path, input_ids=b.input_ids, items=b.items, grammar=Q, rank=RANK, step=2)
        for b in (inject(Q, LAYOUT, "none"), inject(Q, LAYOUT, "budget_shrink"))
    )
    assert main(["replay", str(ok)]) == 0
    assert "Media alignment ok (replay of rank 3, step 2)" in capsys.readouterr().out
    assert main(["replay", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "Media alignment failed (replay of rank 3, step 2)" in out and "sample 0" in out
    assert main(["replay", str(bad), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["aligned"] is False and doc["mismatched"] == [0] == doc["saved_mismatched"]
    assert doc["report"]["mismatched"][0]["status"] == "surplus"
    assert main(["replay"]) == 2  # usage error; bad bundles: test_hostile_replay, test_cli_ops


# ---- corrupt, partial and hostile bundles: tests/test_hostile_replay.py ------------------
def test_safetensors_bundle_without_safetensors_says_so(tmp_path, monkeypatch):
    ids, cu, items = packed_batch()
    path = save_bundle(tmp_path, input_ids=ids, items=items, grammar=Q, cu_seqlens=cu)
    monkeypatch.setattr(bundle, "_safetensors", lambda: None)
    with pytest.raises(BundleError, match="pip install safetensors"):
        load_bundle(path)


# ---- loading never unpickles ----------------------------------------------------------------
def test_loading_never_unpickles(tmp_path, backend, monkeypatch):
    ids, cu, items = packed_batch()
    path = save_bundle(tmp_path, input_ids=ids, items=items, grammar=Q, cu_seqlens=cu)

    def refuse(*a, **k):
        raise AssertionError("pickle used")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    real_load, calls = torch.load, []

    def spy(*a, **k):
        calls.append(k.get("weights_only"))
        return real_load(*a, **k)

    monkeypatch.setattr(torch, "load", spy)
    got = load_bundle(path)
    assert torch.equal(got.input_ids, ids)
    assert calls == ([True] if backend == "torch" else [])


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_malicious_pickle_is_refused_not_run(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.bundle"
    torch.save({FORMAT: "{}", "tensors": {}, "x": _Payload(str(marker))}, path)
    with pytest.raises(BundleError, match="not a readable bundle"):
        load_bundle(path)
    assert not marker.exists()


# ---- atomic writes, I/O errors and bad arguments --------------------------------------------
def _half_written(real):
    def half(tmp, text, tensors):
        real(tmp, text, tensors)
        tmp.write_bytes(tmp.read_bytes()[:50])
        raise OSError(28, "No space left on device")

    return half


@pytest.mark.parametrize("fault", ["mid_write", "publish", "dump_dir_a_file", "under_a_file"])
def test_io_failures_return_none_and_leave_nothing(tmp_path, monkeypatch, capsys, fault):
    """A full disk mid-write, a failing rename, a dump directory that cannot be made: None, one
    logged error, no file (a half bundle never takes a ``.bundle`` name)."""
    ids, cu, items = packed_batch()
    dump = tmp_path / "dumps"
    if fault == "mid_write":
        monkeypatch.setattr(
            bundle_save, "_write_payload", _half_written(bundle_save._write_payload)
        )
    elif fault == "publish":
        fail = mock.Mock(side_effect=OSError(5, "Input/output error"))
        monkeypatch.setattr(os, "link", fail)
        monkeypatch.setattr(os, "replace", fail)
    else:
        dump.write_text("x")
        dump = dump if fault == "dump_dir_a_file" else dump / "sub"
    assert save_bundle(dump, input_ids=ids, items=items, grammar=Q, cu_seqlens=cu) is None
    err = capsys.readouterr().err  # the library logger's stream
    assert err.count("cannot save replay bundle") == 1
    assert _names(tmp_path) == ["dumps"]  # the dump directory (or the file in its way) only
    assert not (tmp_path / "dumps").is_dir() or _names(tmp_path / "dumps") == []
    if fault == "mid_write":
        assert "No space left on device" in err


BAD_ARGS = {
    "float_ids": dict(input_ids=torch.zeros(2, 4)),
    "3d_ids": dict(input_ids=torch.zeros(1, 2, 4, dtype=torch.long)),
    "item_type": dict(items=[object()]),
    "grammar": dict(grammar="qwen"),
    "step": dict(step=-1),
    "microbatch": dict(microbatch=True),
    "rank": dict(rank=3),
    "config": dict(config={"policy": "raise"}),
    "features_rows": dict(features=torch.zeros(5, H)),
    "features_list": dict(features=[torch.zeros(3, H)]),
    "cu_float": dict(cu_seqlens=torch.tensor([0.0, 4.0])),
    "report_items": lambda: dict(
        report=check_alignment(build_batch(Q, [[("image", 2)]]).input_ids, [], Q)
    ),
}
# a sample_id of another type is refused earlier, by MediaItem itself (tests/test_hostile_replay.py)


@pytest.mark.parametrize("case", sorted(BAD_ARGS))
def test_bad_arguments_raise(tmp_path, case):
    ids, cu, items = packed_batch()
    kw = dict(input_ids=ids, items=items, grammar=Q, cu_seqlens=cu)
    bad = BAD_ARGS[case]
    kw.update(bad() if callable(bad) else bad)
    with pytest.raises(MediaInputError):
        save_bundle(tmp_path, **kw)
    assert _names(tmp_path) == []
