"""Marker pairs nested right inside another pair's region (``Grammar.inner``, Qwen3-Omni's audio
in video): table-driven parses, and hypothesis properties on structured rows with one
corruption: the runs equal the per-token reference loop's, a clean row has no finding, and the
aligned path's sync-free count is zero exactly when the full parse finds nothing."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_media_guard import Grammar, MediaInputError, parse_runs
from megatron_media_guard.core.runs import FindingKind, TokenLayout
from megatron_media_guard.testing import reference_runs

VS, VE, IMG, VID, AS, AE, AUD = 3, 4, 5, 6, 7, 9, 8
T = 1000
G = Grammar(
    {"image": IMG, "video": VID, "audio": AUD},
    start_id=VS,
    end_id=VE,
    regions=((AS, AE),),
    inner=((AS, AE),),
)
FLAT = Grammar({"image": IMG, "video": VID, "audio": AUD}, VS, VE, regions=((AS, AE),))
F = FindingKind


@pytest.mark.parametrize(
    ("row", "runs", "findings"),
    [
        # audio in video: one region, video and audio runs alternating
        (
            [T, VS, AS, VID, VID, AUD, AUD, AUD, VID, VID, AUD, AE, VE, T],
            [(3, 5, 2, "video"), (5, 8, 3, "audio"), (8, 10, 2, "video"), (10, 11, 1, "audio")],
            [],
        ),
        # a plain audio region and a plain video region beside it
        ([T, AS, AUD, AE, T, VS, VID, VE], [(2, 3, 1, "audio"), (6, 7, 1, "video")], []),
        # nested markers around nothing
        ([T, VS, AS, AE, VE, T], [], []),
        # the nested start never closed before the region's end
        (
            [VS, AS, VID, AUD, VE, T],
            [(2, 3, 1, "video"), (3, 4, 1, "audio")],
            [(F.UNTERMINATED, 4)],
        ),
        # a nested end whose region opened without a nested start
        (
            [VS, VID, AUD, AE, VE],
            [(1, 2, 1, "video"), (2, 3, 1, "audio")],
            [(F.END_WITHOUT_START, 3)],
        ),
        # an audio start inside a vision region, not right after its start: a nested start
        (
            [VS, VID, AS, AUD, AE, VE],
            [(1, 2, 1, "video"), (3, 4, 1, "audio")],
            [(F.NESTED_START, 2), (F.END_WITHOUT_START, 4)],
        ),
        # an inner pair does not nest in itself
        (
            [AS, AS, AUD, AE, AE],
            [(2, 3, 1, "audio")],
            [(F.NESTED_START, 1), (F.END_WITHOUT_START, 4)],
        ),
        # one bad region does not taint the next one
        (
            [VS, AS, VID, VE, VS, AS, VID, AE, VE],
            [(2, 3, 1, "video"), (6, 7, 1, "video")],
            [(F.UNTERMINATED, 3)],
        ),
        # a run right before the nested end is closed; text there is not
        ([VS, AS, VID, T, AE, VE], [(2, 3, 1, "video")], [(F.UNTERMINATED, 2)]),
    ],
)
def test_parse_table(row, runs, findings):
    parsed = parse_runs(torch.tensor([row]), G)
    assert [(r.start, r.end, r.length, r.modality) for r in parsed.runs] == runs
    assert [(f.kind, f.position) for f in parsed.findings] == findings


def test_without_inner_the_same_row_is_a_nested_start():
    row = torch.tensor([[VS, AS, VID, AUD, AE, VE]])
    assert [f.kind for f in parse_runs(row, FLAT).findings] == [F.NESTED_START, F.END_WITHOUT_START]
    assert parse_runs(row, G).findings == ()


def test_packed_boundary_between_the_markers_nests_nothing():
    # sample 0 ends right after its vision start: the audio start opens sample 1's own region
    ids = torch.tensor([[T, VS, AS, AUD, AE, T]])
    parsed = parse_runs(ids, G, torch.tensor([0, 2, 6]))
    assert [(r.sample, r.modality) for r in parsed.runs] == [(1, "audio")]
    assert [(f.kind, f.sample) for f in parsed.findings] == [(F.CUT_BY_BOUNDARY, 0)]


@pytest.mark.parametrize(
    ("inner", "match"),
    [(((AS, VE),), "must be marker pairs"), (((AS, AE), (VS, VE)), "stay outer")],
)
def test_inner_pairs_are_validated(inner, match):
    with pytest.raises(MediaInputError, match=match):
        Grammar({"image": IMG, "audio": AUD}, VS, VE, regions=((AS, AE),), inner=inner)


def _region(rng: random.Random) -> list[int]:
    kind = rng.choice(["image", "video", "audio", "aiv"])
    if kind == "audio":
        return [AS, *[AUD] * rng.randint(1, 4), AE]
    if kind != "aiv":
        return [VS, *[IMG if kind == "image" else VID] * rng.randint(1, 4), VE]
    body = [rng.choice([VID, AUD]) for _ in range(rng.randint(0, 8))]
    return [VS, AS, *body, AE, VE]


def _row(rng: random.Random, corrupt: bool) -> list[int]:
    row = [T]
    for _ in range(rng.randint(0, 3)):
        row += [*_region(rng), T + rng.randint(0, 3)]
    if corrupt:
        i = rng.randrange(len(row))
        op = rng.choice(["drop", "replace", "insert"])
        tok = rng.choice([VS, VE, AS, AE, VID, AUD, T])
        row = (
            row[:i] + row[i + 1 :]
            if op == "drop"
            else [*row[:i], tok, *row[i + (op == "replace") :]]
        )
    return row or [T]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31), corrupt=st.booleans(), packed=st.booleans())
def test_property_structured_rows(seed, corrupt, packed):
    rng = random.Random(seed)
    rows = [_row(rng, corrupt and k == 0) for k in range(1 if packed else 2)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [T] * (width - len(r)) for r in rows])
    cu = None
    if packed:
        n = ids.shape[1]
        cu = torch.tensor([0, *sorted(rng.sample(range(1, n + 1), k=min(n, rng.randint(1, 3))))])
    parsed = parse_runs(ids, G, cu)
    if not packed:
        got = [(r.sample, r.start, r.end, r.length, r.modality) for r in parsed.runs]
        assert got == reference_runs(ids, G)
        if not corrupt:
            assert parsed.findings == ()
    lay = TokenLayout(ids, G, cu)
    start, end = lay.run_bounds()
    fast = int(lay.structure_violations(start, end))
    assert (fast > 0) == bool((lay.finding_codes(start, end) != 0).any())


def test_a_replay_bundle_keeps_the_inner_pairs(tmp_path):
    from megatron_media_guard import MediaItem
    from megatron_media_guard.replay.bundle import load_bundle
    from megatron_media_guard.replay.bundle_save import save_bundle

    ids = torch.tensor([[T, VS, AS, VID, AUD, AE, VE]])
    items = [MediaItem(1, sample=0, modality="video"), MediaItem(1, sample=0, modality="audio")]
    got = load_bundle(save_bundle(tmp_path, input_ids=ids, items=items, grammar=G)).grammar
    assert got.inner == ((AS, AE),)
    assert parse_runs(ids, got).findings == ()
