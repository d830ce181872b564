"""Run parsing: table-driven findings per grammar, and the vectorized parser against a
per-token reference loop on random batches; marker pairs nested right inside another pair's
region (``Grammar.inner``, Qwen3-Omni's audio in video) on structured rows with one
corruption."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_media_guard import Grammar, MediaInputError, MediaItem, parse_runs
from megatron_media_guard.core.runs import FindingKind, TokenLayout
from megatron_media_guard.replay.bundle import load_bundle
from megatron_media_guard.replay.bundle_save import save_bundle
from megatron_media_guard.testing import TEST_GRAMMARS, build_batch, reference_runs

Q = TEST_GRAMMARS["qwen"]  # image 5, video 6, start 3, end 4
# plus a grammar no built-in family has: start and end markers and break tokens
GRAMMARS = {**TEST_GRAMMARS, "marked_breaks": Grammar({"image": 15}, 16, 17, (18,))}
P = TEST_GRAMMARS["pixtral"]  # img 10, break 11, end 12
T = 1000  # a text token

F = FindingKind
# audio in video: the audio pair nests right inside a vision region (G); without inner, FLAT
VS, VE, IMG, VID, AS, AE, AUD = 3, 4, 5, 6, 7, 9, 8
G = Grammar(
    {"image": IMG, "video": VID, "audio": AUD},
    start_id=VS,
    end_id=VE,
    regions=((AS, AE),),
    inner=((AS, AE),),
)
FLAT = Grammar({"image": IMG, "video": VID, "audio": AUD}, VS, VE, regions=((AS, AE),))


@pytest.mark.parametrize(
    ("grammar", "row", "runs", "findings"),
    [
        # well formed: one image, one video
        (Q, [T, 3, 5, 5, 5, 4, T, 3, 6, 6, 4], [(2, 5, 3, "image"), (8, 10, 2, "video")], []),
        # placeholder typed in user text
        (Q, [T, 5, T, 3, 5, 4], [(1, 2, 1, "image"), (4, 5, 1, "image")], [(F.OUTSIDE_REGION, 1)]),
        # end without start
        (Q, [T, 4, T], [], [(F.END_WITHOUT_START, 1)]),
        # nested start
        (Q, [3, 5, 3, 5, 4], [(1, 2, 1, "image"), (3, 4, 1, "image")], [(F.NESTED_START, 2)]),
        # region open, then text: unterminated
        (Q, [3, 5, 5, T, 4], [(1, 3, 2, "image")], [(F.UNTERMINATED, 2)]),
        # cut by the row end (sequence limit)
        (Q, [T, 3, 5, 5], [(2, 4, 2, "image")], [(F.CUT_BY_ROW_END, 1)]),
        # modality switch inside one region splits the run
        (Q, [3, 5, 5, 6, 4], [(1, 3, 2, "image"), (3, 4, 1, "video")], []),
        # Pixtral: breaks take no feature; last break replaced by end
        (P, [T, 10, 10, 11, 10, 10, 12, T], [(1, 6, 4, "image")], []),
        # Pixtral: run not closed by [IMG_END]
        (P, [10, 10, 11, 10, T], [(0, 4, 3, "image")], [(F.UNTERMINATED, 3)]),
        # Pixtral: cut by the row end
        (P, [T, 10, 10, 11, 10], [(1, 5, 3, "image")], [(F.CUT_BY_ROW_END, 4)]),
        # Pixtral: breaks only
        (P, [T, 11, 12], [(1, 2, 0, "break")], [(F.EMPTY_RUN, 1)]),
        # Pixtral: end without a run
        (P, [T, 12, T], [], [(F.END_WITHOUT_START, 1)]),
        # the seed's expanded Nemotron prompt: <image> / <img> / </img> = 99 / 98 / 97
        (
            Grammar({"image": 99}, start_id=98, end_id=97),
            [10, 98, 99, 99, 97, 11, 98, 99, 99, 99, 97],
            [(2, 4, 2, "image"), (7, 10, 3, "image")],
            [],
        ),
        # collapsed (LLaVA): each token its own run
        (
            Grammar.llava(),
            [T, -200, -200, T, -200],
            [(1, 2, 1, "image"), (2, 3, 1, "image"), (4, 5, 1, "image")],
            [],
        ),
        # audio in video: one region, video and audio runs alternating
        (
            G,
            [T, VS, AS, VID, VID, AUD, AUD, AUD, VID, VID, AUD, AE, VE, T],
            [(3, 5, 2, "video"), (5, 8, 3, "audio"), (8, 10, 2, "video"), (10, 11, 1, "audio")],
            [],
        ),
        # a plain audio region and a plain video region beside it
        (G, [T, AS, AUD, AE, T, VS, VID, VE], [(2, 3, 1, "audio"), (6, 7, 1, "video")], []),
        # nested markers around nothing
        (G, [T, VS, AS, AE, VE, T], [], []),
        # the nested start never closed before the region's end
        (
            G,
            [VS, AS, VID, AUD, VE, T],
            [(2, 3, 1, "video"), (3, 4, 1, "audio")],
            [(F.UNTERMINATED, 4)],
        ),
        # a nested end whose region opened without a nested start
        (
            G,
            [VS, VID, AUD, AE, VE],
            [(1, 2, 1, "video"), (2, 3, 1, "audio")],
            [(F.END_WITHOUT_START, 3)],
        ),
        # an audio start inside a vision region, not right after its start: a nested start
        (
            G,
            [VS, VID, AS, AUD, AE, VE],
            [(1, 2, 1, "video"), (3, 4, 1, "audio")],
            [(F.NESTED_START, 2), (F.END_WITHOUT_START, 4)],
        ),
        # an inner pair does not nest in itself
        (
            G,
            [AS, AS, AUD, AE, AE],
            [(2, 3, 1, "audio")],
            [(F.NESTED_START, 1), (F.END_WITHOUT_START, 4)],
        ),
        # one bad region does not taint the next one
        (
            G,
            [VS, AS, VID, VE, VS, AS, VID, AE, VE],
            [(2, 3, 1, "video"), (6, 7, 1, "video")],
            [(F.UNTERMINATED, 3)],
        ),
        # a run right before the nested end is closed; text there is not
        (G, [VS, AS, VID, T, AE, VE], [(2, 3, 1, "video")], [(F.UNTERMINATED, 2)]),
    ],
)
def test_parse_table(grammar, row, runs, findings):
    parsed = parse_runs(torch.tensor([row]), grammar)
    assert [(r.start, r.end, r.length, r.modality) for r in parsed.runs] == runs
    assert [(f.kind, f.position) for f in parsed.findings] == findings


@pytest.mark.parametrize(
    ("grammar", "row", "cu", "runs", "findings"),  # runs: (sample, length)
    [
        # the second packed sample's region is cut by the boundary
        (
            Q,
            [T, 3, 5, 5, 4, T, 3, 5, 5, 3, 5, 4],
            [0, 5, 9, 12],
            [(0, 2), (1, 2), (2, 1)],
            [(F.CUT_BY_BOUNDARY, 1, 6)],
        ),
        # a run never spans a boundary
        (TEST_GRAMMARS["plain"], [13] * 6, [0, 2, 6], [(0, 2), (1, 4)], []),
        # a placeholder in the padding after the last sample
        (Q, [3, 5, 4, T, 5, 0], [0, 4], [(0, 1), (1, 1)], [(F.IN_PADDING, None, 4)]),
    ],
)
def test_packed_findings_name_the_packed_sample(grammar, row, cu, runs, findings):
    parsed = parse_runs(torch.tensor([row]), grammar, torch.tensor(cu))
    assert [(r.sample, r.length) for r in parsed.runs] == runs
    assert [(f.kind, f.sample, f.position) for f in parsed.findings] == findings


INNER = dict(placeholders={"image": IMG, "audio": AUD}, start_id=VS, end_id=VE, regions=((AS, AE),))
LONG = torch.zeros(2, 4, dtype=torch.long)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: parse_runs(torch.zeros(2, 2, 2, dtype=torch.long), Q), r"\[b, s\]"),
        (lambda: parse_runs(LONG, Q, torch.tensor([0, 4])), "one row"),
        (lambda: parse_runs(LONG[:1], Q, torch.tensor([0.0, 4.0])), "integer offsets"),
        (lambda: Grammar({}), "at least one"),
        (lambda: Grammar({"image": 1.5}), "must be an int"),
        (lambda: Grammar({"image": 3}, start_id=3, end_id=4), "distinct"),
        (lambda: Grammar({"image": 3}, start_id=1, collapsed=True), "collapsed"),
        (lambda: Grammar({"image": 20, "video": 21}, break_ids=(23,)), "one placeholder"),
        (lambda: Grammar({"image": 5}, text_id=5), "text_id 5 is one of the grammar's own"),
        (lambda: Grammar(**INNER, inner=((AS, VE),)), "must be marker pairs"),
        (lambda: Grammar(**INNER, inner=((AS, AE), (VS, VE))), "stay outer"),
        (lambda: Grammar.qwen2_vl().modality_code("audio"), "not in grammar"),
    ],
)
def test_bad_input_is_named(call, match):
    with pytest.raises(MediaInputError, match=match):
        call()


def test_presets():
    q = Grammar.qwen2_vl()
    assert dict(q.placeholders) == {"image": 151655, "video": 151656}
    assert (q.start_id, q.end_id) == (151652, 151653)
    assert Grammar.llava().collapsed and dict(Grammar.llava().placeholders) == {"image": -200}
    assert Grammar.pixtral(1, 2, 3).break_ids == (2,)
    assert q.text_id == 151643 and Grammar.llava().neutral_text_id() == 0
    assert Grammar({"image": 0, "video": 1}, start_id=2, end_id=3).neutral_text_id() == 4


def _random_ids(rng: random.Random, grammar: Grammar, b: int, s: int) -> torch.Tensor:
    vocab = [T, T + 1, *grammar.placeholders.values(), *grammar.break_ids]
    vocab += [t for t in (grammar.start_id, grammar.end_id) if t is not None]
    return torch.tensor([[rng.choice(vocab) for _ in range(s)] for _ in range(b)])


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(GRAMMARS)),
    seed=st.integers(0, 2**31),
    b=st.integers(1, 3),
    s=st.integers(1, 40),
)
def test_vectorized_parser_matches_reference_loop(name, seed, b, s):
    """Random token soup (any malformation): the runs equal the per-token loop's."""
    g = GRAMMARS[name]
    ids = _random_ids(random.Random(seed), g, b, s)
    parsed = parse_runs(ids, g)
    got = [(r.sample, r.start, r.end, r.length, r.modality) for r in parsed.runs]
    assert got == reference_runs(ids, g)
    # every finding names a real position and sample
    for f in parsed.findings:
        assert 0 <= f.position < s and f.sample == f.row


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["qwen", "internvl", "pixtral", "marked_breaks"]),
    seed=st.integers(0, 2**31),
)
def test_well_formed_batches_have_no_findings(name, seed):
    rng = random.Random(seed)
    g = GRAMMARS[name]
    mods = tuple(g.placeholders)
    layout = [
        [(rng.choice(mods), rng.randint(1, 9)) for _ in range(rng.randint(0, 3))] for _ in range(3)
    ]
    batch = build_batch(g, layout, seed=seed)
    parsed = parse_runs(batch.input_ids, g)
    assert parsed.findings == ()
    assert [r.length for r in parsed.runs] == [n for m in layout for _, n in m]


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(sorted(GRAMMARS)),
    seed=st.integers(0, 2**31),
    s=st.integers(1, 30),
    packed=st.booleans(),
)
def test_fast_structure_check_agrees_with_findings(name, seed, s, packed):
    """The aligned path's sync-free count is zero exactly when the full parse finds nothing."""
    g = GRAMMARS[name]
    rng = random.Random(seed)
    if rng.random() < 0.5:  # well-formed rows, sometimes cut, so both outcomes occur
        layout = [
            [
                (rng.choice(tuple(g.placeholders)), rng.randint(1, 4))
                for _ in range(rng.randint(0, 3))
            ]
        ]
        text = rng.choice([0, 2]) if layout[0] else 2  # rows may open with a region marker
        ids = build_batch(g, layout, seed=seed, text=text).input_ids[:, : max(1, s * 2)]
    else:
        ids = _random_ids(rng, g, 1 if packed else 2, s)
    cu = None
    if packed:
        ids = ids[:1]
        n = ids.shape[1]
        cuts = sorted(rng.sample(range(1, n + 1), k=min(n, rng.randint(1, 3))))
        cu = torch.tensor([0, *cuts])
    lay = TokenLayout(ids, g, cu)
    start, end = lay.run_bounds()
    fast = int(lay.structure_violations(start, end))
    full = bool((lay.finding_codes(start, end) != 0).any())
    assert (fast > 0) == full


@pytest.mark.parametrize(
    ("name", "row", "cu", "malformed"),
    [
        ("qwen", [3, 5, 5, 4, T, 3, 5, 4], [0, 4, 8], False),  # packed samples open with a start
        ("marked_breaks", [T, 16, 15, 15, 18, 15, 17, T], None, False),  # breaks inside a region
        ("marked_breaks", [T, 16, 18, 17, T], None, True),  # a run of breaks alone
        ("marked_breaks", [T, 16, 15, 17, 16, 18, 18, 17], None, True),  # its second region
        ("marked_breaks", [T, 15, 18, 15, 17, T, T, T], None, True),  # no start
        ("marked_breaks", [T, 16, 15, 18, 15, T, 17, T], None, True),  # unterminated
        ("marked_breaks", [T, 16, 15, 18, 15, 15, 15, 15], None, True),  # cut by the row end
    ],
)
def test_sync_free_structure_count(monkeypatch, name, row, cu, malformed):
    """The sync-free count (no ``nonzero``) agrees with the finding codes."""
    g = GRAMMARS[name]
    lay = TokenLayout(torch.tensor([row]), g, None if cu is None else torch.tensor(cu))
    start, end = lay.run_bounds()
    full = bool((lay.finding_codes(start, end) != 0).any())
    real = torch.nonzero

    def no_nonzero(*a, **k):
        raise AssertionError("structure_violations called nonzero")

    monkeypatch.setattr(torch, "nonzero", no_nonzero)
    fast = int(lay.structure_violations(start, end))
    monkeypatch.setattr(torch, "nonzero", real)
    assert full == malformed
    assert (fast > 0) == malformed


# ---- marker pairs nested inside another pair's region (Grammar.inner) ----------------
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
    ids = torch.tensor([[T, VS, AS, VID, AUD, AE, VE]])
    items = [MediaItem(1, sample=0, modality="video"), MediaItem(1, sample=0, modality="audio")]
    got = load_bundle(save_bundle(tmp_path, input_ids=ids, items=items, grammar=G)).grammar
    assert got.inner == ((AS, AE),)
    assert parse_runs(ids, got).findings == ()
