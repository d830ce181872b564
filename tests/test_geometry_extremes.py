"""Every geometry's solver at extreme aspect ratios and huge targets: exact answers (the
budget search is bounded without losing landings; see docs/BENCHMARKS.md for its time)."""

from __future__ import annotations

import pytest
from test_geometry import exhaustive_grids

from megatron_media_guard.geometry import (
    FIDELITIES,
    FixedGeometry,
    GeometryError,
    PatchMergeGeometry,
    RadioTilerGeometry,
    TiledGeometry,
)
from megatron_media_guard.geometry.radio_search import landing_budgets

FAMILIES = {
    "qwen2-vl": PatchMergeGeometry.qwen2_vl(),
    "qwen3-vl-video": PatchMergeGeometry.qwen3_vl_video(),
    "radio": RadioTilerGeometry(),
    "radio-uncapped": RadioTilerGeometry(max_num_patches=None),
    "radio-upscaling": RadioTilerGeometry(factor_max=2.0),
    "tiles": TiledGeometry(),
    "fixed": FixedGeometry(),
}
ASPECTS = [1, 199, 200, 201, 1000, 5000, 100_000]
SHORT_SIDES = [1, 16, 28, 300]


def extreme_sizes():
    for a in ASPECTS:
        for short in SHORT_SIDES:
            yield (short, short * a)
            yield (short * a, short)


def _frames(name: str) -> int:
    return 4 if name.endswith("video") else 1


def _own_count(geo, hw, frames):
    try:
        return geo.tokens(hw, frames)
    except GeometryError:  # e.g. past the processor's aspect limit
        return None


def assert_exact(geo, hw, frames, target, sol) -> None:
    assert sol.fidelity in FIDELITIES and sol.reason
    if not sol.reachable:
        assert sol.tokens == 0 and sol.size_hw is None
        return
    assert sol.tokens == target
    if isinstance(geo, RadioTilerGeometry):
        if sol.fidelity == "engine-replay":  # the engine's own sizing of hw at that budget
            assert geo.tokens(hw, frames, budget=sol.budget) == target
            assert geo.grid_for(hw, sol.budget) == sol.grid
        else:  # kept as it is under the static budget
            assert geo.tokens(sol.size_hw, frames) == target
    elif isinstance(geo, PatchMergeGeometry) and sol.fidelity == "engine-replay":
        knob = "max_pixels" if "max_pixels" in sol.reason else "min_pixels"
        assert geo.tokens(hw, frames, **{knob: sol.budget}) == target
    else:
        assert geo.tokens(sol.size_hw, frames) == target


@pytest.mark.parametrize("name", list(FAMILIES))
def test_extreme_aspects_solve_exactly(name):
    geo, frames = FAMILIES[name], _frames(name)
    replays = 0
    for hw in extreme_sizes():
        own = _own_count(geo, hw, frames)
        targets = {1, 64, 4096, 16384, 720_720, 2**20} | ({own, own + 1} if own else set())
        for target in sorted(targets):
            sol = geo.solve(target, hw, frames)
            assert_exact(geo, hw, frames, target, sol)
        if own and not isinstance(geo, (FixedGeometry, TiledGeometry)):
            # the processor's own count for the media comes back as an engine replay
            replays += geo.solve(own, hw, frames).fidelity == "engine-replay"
    if not isinstance(geo, (FixedGeometry, TiledGeometry)):
        assert replays > 0


def test_patch_merge_past_its_aspect_limit_is_unreachable_by_name():
    geo = PatchMergeGeometry.qwen2_vl()
    sol = geo.solve(100, (28, 28 * 201))
    assert not sol.reachable and "aspect ratio" in sol.reason


@pytest.mark.parametrize(
    "geo",
    [
        RadioTilerGeometry(min_num_patches=64, max_num_patches=1536),
        RadioTilerGeometry(min_num_patches=256, max_num_patches=2048),
        RadioTilerGeometry(min_num_patches=300, max_num_patches=3000, pixel_shuffle=3),
    ],
    ids=["min64", "min256", "shuffle3"],
)
@pytest.mark.parametrize("hw", [(16, 3200), (3200, 16), (40, 40000), (1, 1000), (300, 60_000)])
def test_radio_landings_at_extreme_aspects_match_an_exhaustive_scan(geo, hw):
    """The walk skips budget segments that cannot land: none that can is lost."""
    ph0, pw0 = geo.native(hw)
    grids = exhaustive_grids(geo, hw)
    for q in sorted(k for k in grids if k):
        found = landing_budgets(geo, ph0, pw0, q)
        assert {g for _, g in found} == grids[q], (hw, q)
        assert all(geo.grid_for(hw, b) == g for b, g in found)
    # counts the tiler never gives at these budgets: nothing found
    for q in (2, 6, 10**6):
        if q not in grids:
            assert landing_budgets(geo, ph0, pw0, q) == []
