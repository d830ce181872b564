"""The Qwen-VL pre-hook's device check against its slow path (no model needed): on random
batches of images and videos, with and without a fault in the grids or the ids, packed or not,
the one-transfer verdict is "aligned" exactly when the per-sample report finds nothing and no
grid row's runs lie in two samples."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_media_guard import Grammar
from megatron_media_guard.adapters.qwen_vl.checks import QwenVLSpec, check_grids
from megatron_media_guard.adapters.qwen_vl.plan import (
    host_rows,
    report_for,
    split_rows,
    token_items,
)
from megatron_media_guard.core.host import count_transfers
from megatron_media_guard.core.runs import TokenLayout, parse_layout
from megatron_media_guard.core.verify import verify

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


@settings(max_examples=150, deadline=None)
@given(
    samples=st.lists(st.lists(media, max_size=3), min_size=1, max_size=3),
    per_group=st.booleans(),
    packed=st.booleans(),
    fault=st.sampled_from(FAULTS),
    k=st.integers(0, 7),
)
def test_device_verdict_agrees_with_the_report(samples, per_group, packed, fault, k):
    spec = QwenVLSpec(video_runs="per_group" if per_group else "one")
    ids, cu, grids = _case(samples, per_group, packed, fault, k)
    lay = TokenLayout(ids, G, cu)
    with count_transfers() as seen:
        check = check_grids(lay, ids, grids, {"image": None, "video": None}, spec)
    assert sum(seen.values()) == 1
    parsed = parse_layout(lay)
    rows = host_rows(grids, spec)
    items, item_row = token_items(rows, parsed, spec, {}, None)
    report = report_for(parsed, items)
    split = split_rows(report, item_row, rows)  # a video's groups in two samples
    assert check.aligned == (report.ok and not split), (report.mismatched, report.orphans, check)
    if fault == "none":
        assert check.aligned
    if fault in ("grid_h", "extra_row") and any(samples):
        assert not check.aligned


def test_pixel_rows_are_checked_against_the_grids():
    spec = QwenVLSpec()
    ids, cu, grids = _case([[("image", 1, 4, 4)]], False, False, "none", 0)
    lay = TokenLayout(ids, G, cu)
    ok = check_grids(lay, ids, grids, {"image": 16, "video": None}, spec)
    bad = check_grids(lay, ids, grids, {"image": 15, "video": None}, spec)
    assert ok.aligned and not ok.pixel_rows_bad and not ok.types_bad
    assert bad.pixel_rows_bad and not bad.aligned


# ---- the fingerprint: pinned to its formula, and the ids' part equal to the core's ---------

MIX, MIX_GRID = 0x5851F42D4C957F2D, 0x2545F4914F6CDD1D


def _signed(v: int) -> int:
    return (v + 2**63) % 2**64 - 2**63


def _reference_fingerprint(ids: torch.Tensor, grids) -> int:
    """The fingerprint in Python integers: ``sum((id + 1) * (pos * MIX + 1))`` over the flat
    ids plus, per modality with rows, ``sum(g * (j * MIX_GRID + code + 1))`` over its flat
    grid, mod 2**64 (the value every rank of a micro-batch group must reproduce bit for bit)."""
    fp = sum((int(t) + 1) * (p * MIX + 1) for p, t in enumerate(ids.reshape(-1).tolist()))
    for mod in ("image", "video"):
        g = grids.get(mod)
        if g is not None and g.shape[0]:
            code = G.modality_code(mod)
            fp += sum(v * (j * MIX_GRID + code + 1) for j, v in enumerate(g.reshape(-1).tolist()))
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
    spec = QwenVLSpec(video_runs="per_group" if per_group else "one")
    ids, cu, grids = _case(samples, per_group, packed, "none", 0)
    ids[..., 0] = 2**40 + 12345  # large ids: the products wrap
    lay = TokenLayout(ids, G, cu)
    check = check_grids(lay, ids, grids, {"image": None, "video": None}, spec)
    assert check.fingerprint == _reference_fingerprint(ids, grids)


@pytest.mark.parametrize("shape", [(1, 1), (2, 9), (3, 1000)])
def test_text_only_fingerprint_equals_the_core_verify_fingerprint(shape):
    ids = torch.randint(0, 2**31, shape, generator=torch.Generator().manual_seed(shape[1]))
    lay = TokenLayout(ids, G)
    check = check_grids(lay, ids, {"image": None, "video": None}, {}, QwenVLSpec())
    core = verify(lay, ids.reshape(-1), [], [], None, None)
    assert check.fingerprint == core.fingerprint == _reference_fingerprint(ids, {})
