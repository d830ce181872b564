"""Geometry families: forward counts, the exact inverse, fidelity classes, bad input."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from megatron_media_guard.errors import MediaAlignmentError, MediaInputError
from megatron_media_guard.geometry import (
    FIDELITIES,
    AnyresGeometry,
    FixedGeometry,
    GeometryError,
    PatchMergeGeometry,
    PixtralGeometry,
    RadioTilerGeometry,
    Solution,
    TiledGeometry,
)
from megatron_media_guard.geometry.solution import divisor_pairs

SEED_HW = (1080, 2400)  # a 2400x1080 (W x H) frame
RADIO, RADIO_T2 = RadioTilerGeometry(), RadioTilerGeometry(temporal_patch=2)


def pm_replay_budget(sol: Solution) -> dict:
    """The pixel budget a patch-merge engine-replay names (its knob, in ``reason``; the
    other knob open: min_pixels 1 under a max_pixels, no max_pixels under a min_pixels)."""
    if "max_pixels=" in sol.reason:
        return {"min_pixels": 1, "max_pixels": sol.budget}
    return {"min_pixels": sol.budget, "max_pixels": max(sol.budget, 1 << 62)}


def assert_exact(geo, hw, sol: Solution, target: int | None = None) -> None:
    """A solution is exact or named (docs/GEOMETRY.md, "Solution and fidelity"): unreachable
    with a reason, no size, no tokens; else ``target`` tokens, the size its grid (or tiles) times
    the patch (tile), and the family's sizing at the budget it names gives them."""
    assert sol.fidelity in FIDELITIES and sol.reason
    if not sol.reachable:
        assert sol.tokens == 0 and sol.size_hw is None
        return
    assert target is None or sol.tokens == target
    if isinstance(geo, (PatchMergeGeometry, PixtralGeometry, RadioTilerGeometry)):
        assert sol.size_hw == (geo.patch * sol.grid[0], geo.patch * sol.grid[1])
    if isinstance(geo, TiledGeometry):  # a thumbnail with every grid but one tile
        assert sol.size_hw == (sol.tiles[1] * geo.tile, sol.tiles[0] * geo.tile)
        assert sol.thumbnail == (geo.thumbnail and sol.tiles != (1, 1))
    src, budget = (hw if sol.fidelity == "engine-replay" else sol.size_hw), {}
    if isinstance(geo, RadioTilerGeometry):
        assert geo.min_num_patches <= sol.budget <= (geo.cap or sol.budget)
        budget = {"budget": sol.budget}
        assert geo.grid_for(src, sol.budget) == sol.grid
    elif isinstance(geo, PatchMergeGeometry):
        budget = {"min_pixels": sol.budget, "max_pixels": sol.budget}
        if sol.fidelity == "engine-replay":
            budget = pm_replay_budget(sol)
        assert geo.size_for(src, sol.num_frames, **budget) == sol.size_hw
    else:
        src = sol.size_hw
    assert geo.tokens(src, sol.num_frames, **budget) == sol.tokens


# ---- the seed case (README, docs/GEOMETRY.md) ----------------------------------------------------
@pytest.mark.parametrize(
    ("count", "max_len", "text", "budget", "tokens"),
    [
        (16, 32768, 100, 8165, 2010),  # the seed: 16 frames shrunk to 2010 each
        (1, 32768, 100, 13312, 2550),  # a fitting request: unconstrained
        (4, 4096, 4000, 1024, 240),  # no room left for media: min_num_patches each
        (0, 100, 0, None, None),  # no media
    ],
)
def test_engine_budget_per_request(count, max_len, text, budget, tokens):
    items = RADIO.engine_tokens([SEED_HW] * count, max_model_len=max_len, prompt_text_len=text)
    assert [(it.budget, it.tokens) for it in items] == [(budget, tokens)] * count
    # each item's reported budget replays its count
    assert all(RADIO.tokens(SEED_HW, budget=it.budget) == tokens for it in items)
    if count == 16:
        assert {(it.grid, it.size_hw) for it in items} == {((60, 134), (960, 2144))}
        assert 16 * RADIO.tokens(SEED_HW) == 40800  # what the static trainer projected


SWEEP_SIZES = [
    (1080, 2400),
    (2400, 1080),
    (512, 512),
    (768, 1024),
    (3000, 4000),
    (200, 3200),
    (1600, 900),
]
SWEEP_BUDGETS = [512, 1024, 2048, 4096, 8165, 13312, 20000]


def test_radio_sweep_7_sizes_x_7_budgets():
    """Counts the tiler gives at 49 budgets, solved back: at an engine budget (1024..13312)
    the grid itself, an engine-replay; below (512) a frame kept at 1024 (no upscale there);
    past the cap (20000) unreachable where the count needs more than 13312 patches."""
    unreachable = set()
    for hw in SWEEP_SIZES:
        for budget in SWEEP_BUDGETS:
            target = RADIO.tokens(hw, budget=budget)
            sol = RADIO.solve(target, hw)
            assert_exact(RADIO, hw, sol, target)
            if 4 * target > 13312:
                assert not sol.reachable and "above max_num_patches" in sol.reason
                unreachable.add((hw, budget))
                continue
            if 1024 <= budget <= 13312:
                assert sol.fidelity == "engine-replay" and sol.grid == RADIO.grid_for(hw, budget)
    assert unreachable == {((3000, 4000), 20000)}


# ---- solve, every family ------------------------------------------------------------------------
PM, QWEN2 = PatchMergeGeometry(), PatchMergeGeometry.qwen2_vl()
TILES, NO_THUMB, MIN_2 = TiledGeometry(), TiledGeometry(thumbnail=False), TiledGeometry(min_tiles=2)
FIXED, PIX = FixedGeometry(), PixtralGeometry(longest_edge=224)
TILES_512, GEMMA = TiledGeometry(tile=512), FixedGeometry(256, (896, 896))
SRC, FRAME = "source", "frame"
ER, UQ, CA, UN = FIDELITIES  # engine-replay, unique, closest-aspect, unreachable


@pytest.mark.parametrize(
    ("geo", "target", "hw", "frames", "kind", "fidelity", "fields", "reason_has"),
    [
        # RADIO: a source's replay, a prime count (1x2011 or 2011x1), past the cap, a count no
        # engine budget sizes the seed to (a 10x40 frame is kept at 1024), clips
        (RADIO, 2010, SEED_HW, 1, SRC, ER, {"grid": (60, 134)}, "budget"),
        (RADIO, 2550, SEED_HW, 1, SRC, ER, {"grid": (68, 150)}, "budget"),
        (RADIO, 2011, SEED_HW, 1, SRC, CA, {"grid": (2, 4022)}, "2 grids"),
        (RADIO, 3329, SEED_HW, 1, SRC, UN, {}, "above max_num_patches 13312"),
        (RADIO, 100, SEED_HW, 1, SRC, CA, {"grid": (10, 40)}, "at 1024 patches"),
        (RADIO, 0, SEED_HW, 1, SRC, UN, {}, "target is 0"),
        (RADIO_T2, 3 * 2010, SEED_HW, 5, SRC, ER, {"grid": (60, 134)}, "per group"),
        (RADIO_T2, 3 * 2010 + 1, SEED_HW, 5, SRC, UN, {}, "3 temporal groups"),
        # 8x149 native at 1025: the upscale overshoots to 8x143, the evenness step gives 8x142 =
        # 1136 > 1025 patches: still the engine's grid (pinned at 1028, a multiple of 4 a
        # one-image request can have); 8x151 lands there only at 1025..1038 and a 128x2272
        # frame is kept only from 1043: the engine's grid all the same
        (RADIO, 284, (112, 2369), 1, SRC, ER, {"grid": (8, 142), "budget": 1028}, ""),
        (RADIO, 284, (112, 2401), 1, SRC, ER, {"grid": (8, 142), "budget": 1028}, ""),
        # the examples; the frame of the 33x2000 strip (208x6 patches at the static
        # budget): 208 tokens are 832 patches, below the minimum, kept only at exactly 1024; a
        # frame above the minimum is kept at its own patch count; past the cap nothing is kept
        (RADIO, 208, (2000, 33), 1, SRC, ER, {"grid": (208, 4), "budget": 1028}, ""),
        (RADIO, 9, (512, 512), 1, FRAME, CA, {"grid": (6, 6), "budget": 1024}, ""),
        (RADIO, 208, (3328, 96), 1, FRAME, CA, {"grid": (208, 4), "budget": 1024}, ""),
        (RADIO, 11, (64, 352), 1, FRAME, CA, {"grid": (2, 22), "budget": 1024}, ""),
        (RADIO, 1, (512, 512), 1, FRAME, UQ, {"grid": (2, 2), "budget": 1024}, ""),
        (RADIO, 2010, (1088, 2400), 1, FRAME, CA, {"grid": (60, 134), "budget": 8040}, ""),
        (RADIO, 3329, (1088, 2400), 1, FRAME, UN, {}, ""),
        # patch-merge: past the static budget the engine's max_pixels may be larger (its shrink
        # path steps over 1281 and 1000: a kept frame) or smaller (1x3 cells)
        (PM, 1281, SEED_HW, 1, SRC, CA, {}, "min_pixels = max_pixels = 1004304"),
        (PM, 3354, SEED_HW, 1, SRC, ER, {}, "max_pixels=2629536"),
        (PM, 3, SEED_HW, 1, SRC, ER, {}, "max_pixels=3176"),
        (QWEN2, 1000, SEED_HW, 1, SRC, CA, {"size_hw": (560, 1400), "budget": 784000}, ""),
        (PM, 211, (1000, 1000), 1, SRC, UN, {}, "aspect ratio above 200"),  # prime
        (PM, 289, (100, 2000), 1, SRC, UQ, {}, "only the grid 17x17"),  # not 1x289
        (PM, 10, (10, 2500), 1, SRC, UN, {}, "exceeds 200"),  # the media is rejected
        # 29x5615 (aspect 194) resizes to 28x5628 = 1x201 cells (aspect 201): the processor
        # rejects that frame when fed back, but the engine resized the source: a replay
        (PM, 201, (29, 5615), 1, SRC, ER, {}, "1x201 merged cells"),
        (PM, 0, (100, 100), 1, SRC, UN, {}, "target is 0"),
        # 112 = 7x16 cells: 1080x2400 under max_pixels 100000
        (PM, 3 * 112, SEED_HW, 5, SRC, ER, {}, "7x16 merged cells x 3 group(s)"),
        (PM, 3 * 112 + 1, SEED_HW, 5, SRC, UN, {}, "not divisible by the 3 temporal"),
        (PM, 2 * 112, SEED_HW, 4, SRC, ER, {}, "x 2 group(s)"),
        (PM, 2 * 100, SEED_HW, 4, SRC, CA, {}, "grids of 100 cells"),
        # tiles
        (TILES, 300, (1000, 1000), 1, SRC, UN, {}, "multiple of 256"),
        (TILES, 512, (1000, 1000), 1, SRC, UN, {}, "thumbnail"),
        (TILES, 256, (1000, 1000), 1, SRC, ER, {"tiles": (1, 1)}, "max_tiles=1"),
        (TILES, 5 * 256, (1000, 1000), 1, SRC, ER, {"tiles": (2, 2)}, "max_tiles=4"),
        (TILES, 7 * 256, (1000, 1000), 1, SRC, CA, {"tiles": (2, 3)}, "4 grids"),
        (TILES, 13 * 256, (1000, 1000), 1, SRC, CA, {}, "grids"),
        (TILES, 14 * 256, (1000, 1000), 1, SRC, UN, {}, "outside [1, 12]"),
        (TILES, 4 * 768, (448, 896), 4, SRC, ER, {"tiles": (2, 1)}, "max_tiles=2"),
        (TILES, 1000, (448, 896), 3, SRC, UN, {}, "not divisible by 3 frames"),
        (NO_THUMB, 512, (448, 896), 1, SRC, ER, {"tiles": (2, 1)}, "2 tiles"),
        (NO_THUMB, 256, (448, 896), 1, SRC, ER, {"tiles": (1, 1)}, ""),
        (MIN_2, 256, (448, 896), 1, SRC, UN, {}, "outside [2, 12]"),
        (TILES_512, 1024, (512, 1536), 1, SRC, ER, {"tiles": (3, 1)}, ""),
        # fixed: one size, one count per frame
        (FIXED, 576, SEED_HW, 1, SRC, ER, {"size_hw": (336, 336)}, ""),
        (FIXED, 2 * 576, (5, 5), 2, SRC, ER, {}, ""),
        (FIXED, 2 * 576, (5, 5), 1, SRC, UN, {}, "2 images/crops"),
        (FIXED, 577, (5, 5), 1, SRC, UN, {}, ""),
        (GEMMA, 256, (10, 10), 1, SRC, ER, {"size_hw": (896, 896)}, ""),
        # Pixtral at longest edge 224 (8 cells a side): 7x7 alone fits; 1x7 and 7x1 fit (1x7
        # is closer in aspect); 4x6 is larger than the image: no edge gives it
        (PIX, 6, (56, 84), 1, SRC, ER, {"size_hw": (56, 84)}, ""),
        (PIX, 49, (56, 84), 1, SRC, UQ, {"size_hw": (196, 196)}, ""),
        (PIX, 7, (56, 84), 1, SRC, CA, {"size_hw": (28, 196)}, ""),
        (PIX, 24, (56, 84), 1, SRC, CA, {"size_hw": (112, 168)}, ""),
        (PIX, 0, (56, 84), 1, SRC, UN, {}, ""),
        (PIX, 61 * 67, (56, 84), 1, SRC, UN, {}, ""),
    ],
)
def test_solve_table(geo, target, hw, frames, kind, fidelity, fields, reason_has):
    sol = geo.solve(target, hw, frames, hw_kind=kind)
    assert sol.fidelity == fidelity and reason_has in sol.reason, sol
    assert {k: getattr(sol, k) for k in fields} == fields
    assert sol.num_frames == frames and sol.reachable == (fidelity != UN)
    assert_exact(geo, hw, sol, target)
    with pytest.raises(AttributeError):  # frozen
        sol.tokens = 1  # type: ignore[misc]


# ---- patch-merge (Qwen) ------------------------------------------------------------------------
def test_patch_merge_published_configs():
    q2, q3 = PatchMergeGeometry.qwen2_vl(), PatchMergeGeometry.qwen3_vl()
    assert (q2.factor, q2.min_pixels, q2.max_pixels) == (28, 3136, 16384 * 28 * 28)
    assert PatchMergeGeometry.qwen2_5_vl() == q2
    assert (q3.factor, q3.min_pixels, q3.max_pixels) == (32, 64 * 32 * 32, 16384 * 32 * 32)
    assert q2.tokens((1080, 2400)) == round(1080 / 28) * round(2400 / 28)  # no resize needed
    assert PatchMergeGeometry.qwen2_vl(max_pixels=1000 * 784).max_pixels == 1000 * 784
    assert PatchMergeGeometry(max_aspect=300).tokens((10, 2500)) > 0  # 250:1, past the default


@pytest.mark.parametrize(
    ("hw", "knob", "pixels"),  # an engine with its own max_pixels (shrink) or min_pixels (grow)
    [(SEED_HW, "max_pixels", px) for px in (100_000, 333_333, 1_000_000, 5_000_000)]
    + [((100, 200), "min_pixels", px) for px in (100_000, 400_000, 2_000_000)],
)
def test_patch_merge_replays_the_engine_budget(hw, knob, pixels):
    geo = PatchMergeGeometry.qwen2_vl()
    target = geo.tokens(hw, **{knob: pixels})
    sol = geo.solve(target, hw)
    assert sol.fidelity == "engine-replay" and f"{knob}=" in sol.reason
    assert sol.size_hw == geo.size_for(hw, **{knob: pixels})
    assert geo.tokens(hw, **{knob: sol.budget}) == target
    assert geo.tokens(hw, **{knob: sol.budget - 1}) < target  # the smallest such budget


def test_qwen3_video_frames_share_the_budget():
    geo = PatchMergeGeometry.qwen3_vl_video()
    hb, wb = geo.size_for((2160, 3840), num_frames=8)
    assert 8 * hb * wb <= geo.max_pixels < 8 * (hb + 32) * (wb + 32)
    assert geo.tokens((2160, 3840), 8) == 4 * (hb // 32) * (wb // 32)
    with pytest.raises(GeometryError, match="shorter than temporal_patch"):
        geo.tokens((100, 100), 1)
    assert not geo.solve(64, (100, 100), 1).reachable


# ---- forward counts ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("geo", "hw", "frames", "tokens", "size"),
    [
        (RADIO, SEED_HW, 1, 2550, (1088, 2400)),  # the seed, unconstrained: 68x150 patches
        (TILES, (448, 896), 1, 3 * 256, (448, 896)),  # 2 tiles + thumbnail
        (TILES, (448, 448), 1, 256, (448, 448)),  # one tile, no thumbnail
        (TILES, (1000, 1000), 1, 10 * 256, (1344, 1344)),  # aspect tie: area > half canvas
        (TILES, (100, 5000), 1, 13 * 256, (448, 5376)),
        (FIXED, SEED_HW, 1, 576, (336, 336)),
        (FIXED, (1, 1), 3, 3 * 576, (336, 336)),
    ],
)
def test_forward_counts(geo, hw, frames, tokens, size):
    assert geo.tokens(hw, frames) == tokens
    assert geo.size_for(hw, frames) == size
    if isinstance(geo, RadioTilerGeometry):  # the native grid, kept as it is
        assert geo.native(hw) == geo.grid_for(hw) == (size[0] // 16, size[1] // 16)
    if isinstance(geo, TiledGeometry):
        assert geo.tiles_for(hw) == (size[1] // geo.tile, size[0] // geo.tile)


# ---- bad input ----------------------------------------------------------------------------------
FAMILIES = [
    PatchMergeGeometry(),
    RadioTilerGeometry(),
    TiledGeometry(),
    FixedGeometry(),
    PixtralGeometry(),
    AnyresGeometry(pinpoints=((384, 384), (384, 768))),
]


@pytest.mark.parametrize("geo", FAMILIES, ids=lambda g: type(g).__name__)
@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda g: g.tokens((0, 10)), r"positive.*\(0, 10\)"),
        (lambda g: g.tokens((-5, 10)), "positive"),
        (lambda g: g.tokens((10,)), "pair"),
        (lambda g: g.tokens("ab"), "integer"),
        (lambda g: g.tokens((1.5, 10)), "integer"),
        (lambda g: g.tokens((True, 10)), "integer"),
        (lambda g: g.tokens((10, 10), 0), "num_frames must be >= 1"),
        (lambda g: g.size_for((10, -1)), "positive"),
        (lambda g: g.solve(-1, (10, 10)), "target token count must be >= 0, got -1"),
        (lambda g: g.solve(2.5, (10, 10)), "integer"),
        (lambda g: g.solve(10, (0, 0)), "positive"),
    ],
)
def test_bad_input_raises_media_input_error(geo, call, match):
    with pytest.raises(MediaInputError, match=match) as info:
        call(geo)
    assert isinstance(info.value, GeometryError)
    assert not isinstance(info.value, MediaAlignmentError)  # a wrong call, not a data fault


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: PatchMergeGeometry(min_pixels=10, max_pixels=5), "min_pixels 10 > max_pixels 5"),
        (lambda: PatchMergeGeometry(patch=0), "patch must be >= 1"),
        (lambda: RadioTilerGeometry(pixel_shuffle=0), "pixel_shuffle must be >= 1"),
        (lambda: RadioTilerGeometry(budget=-3), "budget must be >= 1"),
        (lambda: TiledGeometry(min_tiles=5, max_tiles=4), "min_tiles 5 > max_tiles 4"),
        (lambda: FixedGeometry(size=(0, 336)), "positive"),
        (lambda: PixtralGeometry(longest_edge=0), "longest_edge"),
        (lambda: AnyresGeometry(pinpoints=((56, 60),), tile=56), "multiples of 56"),
        (lambda: AnyresGeometry(pinpoints=((56, 56),), tile=56, max_tiles=0), "max_tiles"),
        (lambda: RadioTilerGeometry().engine_tokens([SEED_HW], 0, 0), "max_model_len"),
        (lambda: RadioTilerGeometry().engine_tokens([SEED_HW], 100, -1), "prompt_text_len"),
        (lambda: RadioTilerGeometry().engine_tokens([(0, 3)], 100, 0), "positive"),
        (lambda: RadioTilerGeometry().solve(9, SEED_HW, hw_kind="original"), "hw_kind must be"),
    ],
)
def test_bad_config_or_call_is_named(call, match):
    with pytest.raises(GeometryError, match=match):
        call()


# ---- properties ---------------------------------------------------------------------------------
sides = st.integers(min_value=28, max_value=6000)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


OWN_COUNT_FAMILIES = [
    PatchMergeGeometry(),
    PatchMergeGeometry.qwen2_vl(),
    PatchMergeGeometry.qwen3_vl(),
    PatchMergeGeometry.qwen3_vl_video(),
    PatchMergeGeometry(min_pixels=200 * 784, max_pixels=300 * 784),
    TiledGeometry(),
    TiledGeometry(thumbnail=False),
    TiledGeometry(tile=512, max_tiles=6),
    FixedGeometry(),
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    h=st.integers(1, 6000),
    w=st.integers(1, 6000),
    frames=st.integers(1, 9),
    cfg=st.sampled_from(OWN_COUNT_FAMILIES),
)
def test_property_own_count_is_an_engine_replay(h, w, frames, cfg):
    """The processor's own count for the source comes back as its own sizing of the source
    (patch-merge: whether or not it would keep that frame when fed back: the max(f, .) clamp,
    odd T in Qwen3 video, rounding past the aspect cap)."""
    if isinstance(cfg, PatchMergeGeometry):
        assume(min(h, w) >= 28 and max(h, w) / min(h, w) <= 200)
        assume(not cfg.temporal_budget or frames >= 2)
    n = cfg.tokens((h, w), frames)
    sol = cfg.solve(n, (h, w), frames)
    assert sol.fidelity == "engine-replay" and sol.size_hw == cfg.size_for((h, w), frames), sol
    assert_exact(cfg, (h, w), sol, n)
    if isinstance(cfg, PatchMergeGeometry):
        f, (hb, wb) = cfg.factor, sol.size_hw
        assert n == math.ceil(frames / cfg.temporal_patch) * (hb // f) * (wb // f)
    if isinstance(cfg, TiledGeometry):
        assert sol.tiles == cfg.tiles_for((h, w))


@SETTINGS
@given(
    h=st.integers(1, 8000),
    w=st.integers(1, 8000),
    cfg=st.sampled_from(
        [
            RadioTilerGeometry(),
            RadioTilerGeometry(min_num_patches=256, max_num_patches=4096),
            RadioTilerGeometry(budget=8165),
        ]
    ),
    budget=st.one_of(st.none(), st.integers(1024, 13312)),
)
def test_property_radio_solves_any_engine_count(h, w, cfg, budget):
    """Every count the tiler gives a source at an engine budget comes back as the tiler's own
    sizing of that source (the upscale-then-evenness grids below min_num_patches included);
    a replay where only one grid of that count is the tiler's, else closest-aspect (the
    count does not tell the budget apart), and then the engine's grid is one of those."""
    assume(budget is None or budget >= cfg.min_num_patches)
    if budget is not None and cfg.cap is not None:
        budget = min(budget, cfg.cap)
    n = cfg.tokens((h, w), budget=budget)
    sol = cfg.solve(n, (h, w))
    assert sol.fidelity in ("engine-replay", "closest-aspect"), sol
    assert_exact(cfg, (h, w), sol, n)
    assert cfg.grid_for((h, w), sol.budget) == sol.grid  # the tiler's grid for the source
    if sol.fidelity == "engine-replay":
        assert sol.grid == cfg.grid_for((h, w), budget)
    else:
        assert "does not tell which the engine used" in sol.reason


@SETTINGS
@given(h=st.integers(1, 8000), w=st.integers(1, 8000), target=st.integers(0, 5000))
def test_property_radio_any_target_is_exact_or_named(h, w, target):
    assert_exact(RADIO, (h, w), RADIO.solve(target, (h, w)), target)


@SETTINGS
@given(
    h=sides,
    w=sides,
    target=st.integers(0, 17000),
    frames=st.integers(1, 6),
    cfg=st.sampled_from([PatchMergeGeometry(), PatchMergeGeometry.qwen2_vl()]),
)
def test_property_patch_merge_any_target_is_exact_or_named(h, w, target, frames, cfg):
    assume(max(h, w) / min(h, w) <= 200)
    sol = cfg.solve(target, (h, w), frames)
    assert_exact(cfg, (h, w), sol, target)
    g = math.ceil(frames / cfg.temporal_patch)
    if not sol.reachable and target and target % g == 0:
        # every grid a*b = n is past the aspect cap (a budget of its own area keeps any other)
        n = target // g
        assert all(max(a, b) / min(a, b) > cfg.max_aspect for a, b in divisor_pairs(n))


# ---- the budget search against an exhaustive scan ------------------------------------------
def test_patch_merge_replay_matches_an_exhaustive_scan():
    geo = PatchMergeGeometry(patch=7, merge=2, min_pixels=1, max_pixels=10**9)
    rng = random.Random(8)
    for _ in range(6):
        h, w = rng.randint(20, 160), rng.randint(20, 160)
        natural = geo.size_for((h, w))
        area = natural[0] * natural[1]
        reach = {geo.tokens((h, w), max_pixels=m) for m in range(1, area + 1)}
        reach |= {geo.tokens((h, w), min_pixels=m) for m in range(area, 3 * area, 7)}
        for n in range(1, 3 * area // 196):
            found = geo._replay(h, w, 1, n)
            if n in reach:
                assert found is not None, (h, w, n)
            if found is not None:
                knob, budget, cells = found
                assert cells[0] * cells[1] == n
                assert geo.tokens((h, w), **{knob: budget}) == n
