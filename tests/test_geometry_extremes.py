"""Every geometry's solver at extreme aspect ratios and huge targets: exact answers (the
budget search is bounded without losing landings; see docs/BENCHMARKS.md for its time)."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_geometry import assert_exact

from megatron_media_guard.geometry import (
    FixedGeometry,
    GeometryError,
    PatchMergeGeometry,
    RadioTilerGeometry,
    TiledGeometry,
)
from megatron_media_guard.geometry.radio_search import landing_budgets
from megatron_media_guard.geometry.solution import divisor_pairs, divisors, pick

FAMILIES = {  # name: (geometry, frames)
    "qwen2-vl": (PatchMergeGeometry.qwen2_vl(), 1),
    "qwen3-vl-video": (PatchMergeGeometry.qwen3_vl_video(), 4),
    "radio": (RadioTilerGeometry(), 1),
    "radio-uncapped": (RadioTilerGeometry(max_num_patches=None), 1),
    "radio-upscaling": (RadioTilerGeometry(factor_max=2.0), 1),
    "tiles": (TiledGeometry(), 1),
    "fixed": (FixedGeometry(), 1),
}
ASPECTS = [1, 199, 200, 201, 1000, 5000, 100_000]
SHORT_SIDES = [1, 16, 28, 300]


def extreme_sizes():
    for a in ASPECTS:
        for short in SHORT_SIDES:
            yield (short, short * a)
            yield (short * a, short)


def exhaustive_grids(geo: RadioTilerGeometry, hw) -> dict[int, set]:
    """Patch count -> the grids the tiler gives ``hw`` at some budget in [min, cap]."""
    grids: dict[int, set] = {}
    for b in range(max(geo.min_num_patches, 1), geo.cap + 1):
        try:
            g = geo.grid_for(hw, b)
        except GeometryError:
            continue
        grids.setdefault(g[0] * g[1], set()).add(g)
    return grids


@pytest.mark.parametrize("name", list(FAMILIES))
def test_extreme_aspects_solve_exactly(name):
    geo, frames = FAMILIES[name]
    replays = 0
    for hw in extreme_sizes():
        try:
            own = geo.tokens(hw, frames)
        except GeometryError:  # e.g. past the processor's aspect limit
            own = None
        targets = {1, 64, 4096, 16384, 720_720, 2**20} | ({own, own + 1} if own else set())
        for target in sorted(targets):
            assert_exact(geo, hw, geo.solve(target, hw, frames), target)
        if own and not isinstance(geo, (FixedGeometry, TiledGeometry)):
            # the processor's own count for the media comes back as an engine replay
            replays += geo.solve(own, hw, frames).fidelity == "engine-replay"
    if not isinstance(geo, (FixedGeometry, TiledGeometry)):
        assert replays > 0


@pytest.mark.parametrize(
    "geo",
    [
        RadioTilerGeometry(min_num_patches=64, max_num_patches=1536),
        RadioTilerGeometry(min_num_patches=256, max_num_patches=2048),
        RadioTilerGeometry(min_num_patches=300, max_num_patches=3000, pixel_shuffle=3),
    ],
    ids=["min64", "min256", "shuffle3"],
)
@pytest.mark.parametrize(
    "hw",
    [(16, 3200), (3200, 16), (40, 40000), (1, 1000), (300, 60_000), (1021, 767), (2389, 37)],
)
def test_radio_landings_match_an_exhaustive_scan(geo, hw):
    """The walk skips budget segments that cannot land: none that can is lost (extreme
    aspects and ordinary sizes alike)."""
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


# ---- the helpers the inverse leans on ------------------------------------------------------
@pytest.mark.parametrize(
    "n, expected",
    [
        (0, []),
        (-6, []),
        (12, [1, 2, 3, 4, 6, 12]),
        (2 * 1_000_003, [1, 2, 1_000_003, 2_000_006]),  # a large prime factor left over
    ],
)
def test_divisors_table(n, expected):
    assert divisors(n) == expected
    assert list(divisor_pairs(n)) == [(a, n // a) for a in expected]


@given(st.integers(1, 200_000))
@settings(max_examples=300, deadline=None)
def test_divisors_match_trial_division(n):
    assert divisors(n) == [a for a in range(1, n + 1) if n % a == 0]


def _pick_by_key(candidates, hw, scale):
    """pick()'s documented order, spelled with min(key=...): aspect, area, rows, first."""
    area = hw[0] * hw[1]

    def key(rc):
        r, c = rc
        return (
            Fraction(max(r * hw[1], c * hw[0]), min(r * hw[1], c * hw[0])),
            abs(r * scale[0] * c * scale[1] - area),
            r,
        )

    return min(candidates, key=key)


@pytest.mark.parametrize(
    "candidates, hw, best",
    [
        ([(3, 2), (12, 2)], (30, 10), (12, 2)),  # 2x either way of 3:1: the area decides
        ([(6, 1), (3, 2)], (3, 1), (3, 2)),  # aspect and area tie: fewest rows
        ([(4, 2), (2, 1)], (2, 1), (2, 1)),  # same aspect: the area closer to 2x1 px
        ([(4, 2), (2, 4)], (1, 1), (2, 4)),  # fewest rows, not the first listed
    ],
)
def test_pick_tie_order(candidates, hw, best):
    assert pick(candidates, hw, (1, 1))[0] == best


@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=30),
    st.tuples(st.integers(1, 5000), st.integers(1, 5000)),
    st.sampled_from([(1, 1), (16, 16), (28, 28)]),
)
@settings(max_examples=300, deadline=None)
def test_pick_matches_its_documented_order(candidates, hw, scale):
    best, fidelity, count = pick(candidates, hw, scale)
    assert best == _pick_by_key(candidates, hw, scale)
    assert count == len(candidates)
    assert fidelity == ("unique" if count == 1 else "closest-aspect")


@pytest.mark.parametrize(
    "geo",
    [
        RadioTilerGeometry(min_num_patches=64, max_num_patches=1536),
        RadioTilerGeometry(pixel_shuffle=3, min_num_patches=100, max_num_patches=2000),
        RadioTilerGeometry(factor_max=2.0, min_num_patches=64, max_num_patches=1536),
        RadioTilerGeometry(factor_max=0.9, min_num_patches=64, max_num_patches=1536),
    ],
    ids=["min64", "shuffle3", "upscaling", "factor0.9"],
)
@pytest.mark.parametrize("n", [1, 6, 16, 100, 255, 384, 720720])
def test_kept_grids_match_an_exhaustive_scan_of_engine_budgets(geo, n):
    """The grids of n tokens the tiler keeps unchanged at some engine budget (every budget
    in [min_num_patches, max_num_patches] tried), each with a budget that keeps it."""
    d = geo.pixel_shuffle
    budgets = range(max(geo.min_num_patches, 1), geo.cap + 1)

    def keeps(grid, budget):  # the tiler gives a (16*ph, 16*pw) frame its own grid
        try:
            return geo.grid_for((16 * grid[0], 16 * grid[1]), budget) == grid
        except GeometryError:  # it divides by zero there
            return False

    expected = [
        (d * a, d * b)
        for a, b in divisor_pairs(n)
        if d * d * n <= 2 * geo.cap and any(keeps((d * a, d * b), x) for x in budgets)
    ]
    kept = geo._kept_grids(n) if d * d * n <= geo._kept_bound() else []
    assert [g for g, _ in kept] == expected
    assert all(keeps(g, b) and b in budgets for g, b in kept)
