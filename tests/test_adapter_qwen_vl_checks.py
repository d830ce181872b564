"""The ``inputs`` mode's device check (``families.inputs.verify_tables`` on the Qwen-VL spec's
count tables) against its slow path (no model needed): on random batches of images and
videos, with and without a fault in the grids or the ids, packed or not, the one-transfer
verdict is "aligned" exactly when the per-sample report finds nothing and no grid row's runs
lie in two samples.

A Qwen3-VL video whose temporal groups land in two samples (every run as long as its grid row
says, the batch totals agree, but one video's groups feed two samples' runs) is found on the
device (an item's runs must lie in one sample), never kept or repaired (on the real Qwen3-VL:
tests/test_adapter_qwen_vl.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_media_guard import Grammar
from megatron_media_guard.adapters.vlm_inputs import patch_rows_bad
from megatron_media_guard.core.alignment import align
from megatron_media_guard.core.host import count_transfers
from megatron_media_guard.core.interleave import token_order
from megatron_media_guard.core.items import MediaItem
from megatron_media_guard.core.runs import TokenLayout, parse_layout
from megatron_media_guard.core.verify import verify
from megatron_media_guard.families import qwen
from megatron_media_guard.families.inputs import count_tables, counted, verify_tables
from megatron_media_guard.families.inputs_items import split_items
from megatron_media_guard.families.spec import present

G = Grammar.qwen2_vl()
IMG, VID, START, END = G.placeholders["image"], G.placeholders["video"], G.start_id, G.end_id
TEXT = 7

media = st.tuples(
    st.sampled_from(["image", "video"]),
    st.integers(1, 3),
    st.sampled_from([2, 4, 6]),
    st.sampled_from([2, 4]),
)
FAULTS = ("none", "grid_h", "swap_rows", "extra_row", "lose_placeholder", "extra_placeholder")


def _tokens(items, per_group: bool) -> list[int]:
    row = [TEXT, TEXT]
    for mod, t, h, w in items:
        tok = IMG if mod == "image" else VID
        t = 1 if mod == "image" else t
        if mod == "video" and per_group:
            for _ in range(t):
                row += [TEXT, START, *[tok] * (h * w // 4), END]
        else:
            row += [START, *[tok] * (t * h * w // 4), END]
        row += [TEXT]
    return row


def _case(samples, per_group, packed, fault, k):
    rows = [_tokens(s, per_group) for s in samples]
    if packed:
        ids = torch.tensor([[t for r in rows for t in r]])
        cu = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()])
    else:
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        cu = None
    grid = {"image": [], "video": []}
    for s in samples:
        for mod, t, h, w in s:
            grid[mod].append([1 if mod == "image" else t, h, w])
    mods = [m for m in ("image", "video") if grid[m]]
    if fault != "none" and mods:
        m = mods[k % len(mods)]
        g = grid[m]
        if fault == "grid_h":
            g[k % len(g)][1] += 2
        elif fault == "swap_rows" and len(g) > 1:
            g[0], g[-1] = g[-1], g[0]
        elif fault == "extra_row":
            g.append([1, 2, 2])
        else:
            flat = ids.reshape(-1)
            pos = torch.nonzero((flat == IMG) | (flat == VID)).flatten()
            p = int(pos[k % len(pos)])
            if fault == "lose_placeholder":
                flat[p] = TEXT
            else:
                flat[p + 1 if flat[p + 1] in (IMG, VID) else p] = int(flat[p])
                flat[p - 1 if flat[p - 1] in (IMG, VID) else p] = int(flat[p])
    grids = {m: torch.tensor(grid[m]) if grid[m] else None for m in grid}
    return ids, cu, grids


def _config(per_group: bool):
    """A config as the spec reads it: Qwen3-VL's videos one run per temporal group."""
    kind = "qwen3_vl" if per_group else "qwen2_5_vl"
    return SimpleNamespace(model_type=kind, vision_config=SimpleNamespace(spatial_merge_size=2))


def _inputs(ids, grids, pixels=None):
    out = {"input_ids": ids, "image_grid_thw": grids["image"], "video_grid_thw": grids["video"]}
    for m, name in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        if grids[m] is not None:
            rows = int(grids[m].prod(-1).sum()) if pixels is None else pixels[m]
            out[name] = torch.zeros(rows, 1)
    return out


def _tables(ids, grids, per_group):
    """(modalities present, their count tables) of the batch, as the spec reads it."""
    inputs = _inputs(ids, grids)
    mods = present(qwen.SPEC, inputs)
    return mods, count_tables(qwen.SPEC, mods, _config(per_group), inputs)


def _check(lay, ids, grids, per_group):
    return verify_tables(lay, *_tables(ids, grids, per_group))


def _report(lay, ids, grids, per_group):
    """The host path: the items from the read tables, in token order, the per-sample report
    and the model-level items whose runs lie in two samples."""
    mods, tables = _tables(ids, grids, per_group)
    enc = counted(qwen.SPEC, mods, tables)
    items = [
        MediaItem(int(f.shape[0]), modality=m.name) for m in mods for f in enc[m.name].features
    ]
    parent = [k for m in mods for k in enc[m.name].parent]
    order = token_order(ids, G, items, parent)
    items, parent = [items[i] for i in order], [parent[i] for i in order]
    _, split = split_items(lay, items, parent)
    return align(parse_layout(lay), items), split


@settings(max_examples=150, deadline=None)
@given(
    samples=st.lists(st.lists(media, max_size=3), min_size=1, max_size=3),
    per_group=st.booleans(),
    packed=st.booleans(),
    fault=st.sampled_from(FAULTS),
    k=st.integers(0, 7),
)
def test_device_verdict_agrees_with_the_report(samples, per_group, packed, fault, k):
    ids, cu, grids = _case(samples, per_group, packed, fault, k)
    lay = TokenLayout(ids, G, cu)
    with count_transfers() as seen:
        verdict, _ = _check(lay, ids, grids, per_group)
    assert sum(seen.values()) == 1
    aligned = verdict.bad_runs == 0 and verdict.findings == 0
    report, split = _report(lay, ids, grids, per_group)
    assert aligned == (report.ok and not split), (report.mismatched, report.orphans, verdict)
    if fault == "none":
        assert aligned
    if fault in ("grid_h", "extra_row") and any(samples):
        assert not aligned


def test_pixel_rows_are_checked_against_the_grids():
    ids, _, grids = _case([[("image", 1, 4, 4)]], False, False, "none", 0)
    mods = qwen.SPEC.modalities
    for rows, bad in ((16, 0), (15, 1)):
        inputs = _inputs(ids, grids, {"image": rows})
        got = patch_rows_bad(inputs, mods)  # the device scalar the verdict reads
        assert int(got) == bad


# ---- the fingerprint: pinned to its formula, and the ids' part equal to the core's ---------

MIX, MIX_GRID = 0x5851F42D4C957F2D, 0x2545F4914F6CDD1D


def _signed(v: int) -> int:
    return (v + 2**63) % 2**64 - 2**63


def _reference_fingerprint(ids: torch.Tensor, grids, per_group: bool = False) -> int:
    """The fingerprint in Python integers: ``sum((id + 1) * (pos * MIX + 1))`` over the flat
    ids plus, per modality with items, ``sum(v * (j * MIX_GRID + code + 1))`` over its flat
    ``[runs, tokens]`` table (from its grid rows), mod 2**64 (the value every rank of a
    micro-batch group must reproduce bit for bit)."""
    fp = sum((int(t) + 1) * (p * MIX + 1) for p, t in enumerate(ids.reshape(-1).tolist()))
    for mod in ("image", "video"):
        g = grids.get(mod)
        if g is not None and g.shape[0]:
            code = G.modality_code(mod)
            table = []
            for t, h, w in g.tolist():
                runs, tokens = (
                    (t, h * w // 4) if mod == "video" and per_group else (1, t * h * w // 4)
                )
                table += [runs if tokens else 0, tokens]
            fp += sum(v * (j * MIX_GRID + code + 1) for j, v in enumerate(table))
    return _signed(fp)


@pytest.mark.parametrize(
    "samples, per_group, packed",
    [
        ([[]], False, False),  # text only: the grid part is 0
        ([[("image", 1, 4, 4)]], False, False),
        ([[("image", 1, 2, 4), ("video", 3, 4, 2)], [("video", 2, 2, 2)]], True, False),
        ([[("video", 2, 6, 4)], [], [("image", 1, 4, 2)]], False, True),
    ],
)
def test_fingerprint_is_pinned_to_its_formula(samples, per_group, packed):
    ids, cu, grids = _case(samples, per_group, packed, "none", 0)
    ids[..., 0] = 2**40 + 12345  # large ids: the products wrap
    lay = TokenLayout(ids, G, cu)
    verdict, _ = _check(lay, ids, grids, per_group)
    assert verdict.fingerprint == _reference_fingerprint(ids, grids, per_group)


@pytest.mark.parametrize("shape", [(1, 1), (2, 9), (3, 1000)])
def test_text_only_fingerprint_equals_the_core_verify_fingerprint(shape):
    ids = torch.randint(0, 2**31, shape, generator=torch.Generator().manual_seed(shape[1]))
    lay = TokenLayout(ids, G)
    verdict, _ = _check(lay, ids, {"image": None, "video": None}, False)
    core, _ = verify(lay, [])
    assert verdict.fingerprint == core.fingerprint == _reference_fingerprint(ids, {})


# ---- a video's temporal groups in two samples ------------------------------------------------


def _video_rows(groups_per_sample: list[int], grid_t: list[int], packed: bool):
    """(layout, ids, grids): sample k holds ``groups_per_sample[k]`` groups of 4 cells, the
    grids say ``grid_t`` groups per video."""
    samples = [[("video", n, 4, 4)] if n else [] for n in groups_per_sample]
    ids, cu, _ = _case(samples, True, packed, "none", 0)
    grids = {"image": None, "video": torch.tensor([[t, 4, 4] for t in grid_t])}
    return TokenLayout(ids, G, cu), ids, grids


@pytest.mark.parametrize(
    ("tokens", "grid_t", "split"),
    [
        ([2, 2], [2, 2], False),  # each video in its sample
        ([2, 2], [3, 1], True),  # video 0's third group fed to sample 1's first run
        ([1, 3], [2, 2], True),
        ([3, 0], [1, 2], False),  # two videos in sample 0: no row crosses a sample
        ([1, 0, 1], [2], True),  # across an empty sample
    ],
)
@pytest.mark.parametrize("packed", [False, True])
def test_a_video_row_across_two_samples_is_not_aligned(tokens, grid_t, split, packed):
    lay, ids, grids = _video_rows(tokens, grid_t, packed)
    verdict, _ = _check(lay, ids, grids, per_group=True)
    report, found = _report(lay, ids, grids, per_group=True)
    assert report.ok  # each run is fed the length it holds: only the rows give it away
    assert (verdict.bad_runs == 0) == (not split)
    assert bool(found) == split


@settings(max_examples=60, deadline=None)
@given(
    ts=st.lists(st.integers(1, 3), min_size=2, max_size=4),
    pick=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    packed=st.booleans(),
)
def test_any_group_moved_between_samples_is_found(ts, pick, packed):
    """One video per sample, all of one frame size; the grids move one temporal group from
    video ``j`` to an earlier video ``i``: every run still counts right, the rows do not."""
    i, j = sorted(p % len(ts) for p in pick)
    grid_t = list(ts)
    moved = i < j and ts[j] > 1
    if moved:
        grid_t[i] += 1
        grid_t[j] -= 1
    lay, ids, grids = _video_rows(ts, grid_t, packed)
    verdict, _ = _check(lay, ids, grids, per_group=True)
    _, found = _report(lay, ids, grids, per_group=True)
    assert (verdict.bad_runs == 0) == (not moved)
    assert bool(found) == moved
