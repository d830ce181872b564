"""The RADIO solver against grids vLLM 0.32.0's own ``DynamicResolutionImageTiler`` wrote.

The engine grids below were recorded from the engine's code (``scripts/engine_radio_sweep.py
--engine``, the Nemotron Omni config: patch 16, downsample 0.5, min/max 1024/13312 patches);
no vLLM is needed here. For each request: the library's replay of the shared budget gives the
engine's grids, and the solver reaches every run both with the source size (the engine's grid,
engine-replay, unless the count is the tiler's for two grids of that source) and with only the
trainer's frame (a grid the tiler keeps unchanged at an engine budget, never engine-replay).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_geometry import assert_exact

from megatron_media_guard.geometry import RadioTilerGeometry

GEO = RadioTilerGeometry(min_num_patches=1024, max_num_patches=13312)
LO, HI = 1024, 13312  # every per-item budget the engine gives

# (max_model_len, prompt text tokens, media sizes (W, H), the engine's grids (ph, pw))
ENGINE = [
    # the strips: budget 1152 patches; the upscale then the evenness step down leave
    # a grid below min_num_patches (208x4 = 832)
    (8192, 7900, [(33, 2000)], [(208, 4)]),
    (8192, 7900, [(3000, 40)], [(4, 254)]),
    # an over-full request: 1024 patches, no upscale at exactly the minimum
    (8192, 8188, [(96, 96)], [(6, 6)]),
    # the seed: 16 frames of 2400x1080 in a near-32k prompt
    (32768, 100, [(2400, 1080)] * 16, [(60, 134)] * 16),
    # one count, two grids: 41x41 native at 1684 patches and at 1724 (see AMBIGUOUS)
    (8192, 7767, [(641, 641)], [(40, 42)]),
    (8192, 7757, [(641, 641)], [(42, 40)]),
    (8192, 6000, [(33, 2000), (2000, 33), (4000, 3000), (96, 96)], [(126, 4), (4, 126), (68, 90), (6, 6)]),
    (
        16384,
        15000,
        [(2400, 1080), (1080, 2400), (512, 512), (16, 2010)] * 4,
        [(24, 56), (56, 24), (32, 32), (126, 2)] * 4,
    ),
    # tiny images: each gets 1024 patches (the request's floor), upscaled to 32x32
    (8192, 8000, [(1, 1), (8, 8), (3, 5), (28, 28)], [(32, 32)] * 4),
    (32768, 0, [(4000, 3000)], [(100, 132)]),
    (12288, 11000, [(64, 4000), (4000, 64), (1920, 1080), (333, 777)], [(250, 4), (4, 250), (34, 62), (48, 20)]),
]  # fmt: skip
# (source (H, W), tokens): the tiler gives that count as two grids at two engine budgets
AMBIGUOUS = {((641, 641), 420)}


def _runs():
    for _, _, sizes, grids in ENGINE:
        for (w, h), g in zip(sizes, grids):
            yield (h, w), g


@pytest.mark.parametrize(("max_len", "text", "sizes", "grids"), ENGINE)
def test_replay_is_the_engines_grid(max_len, text, sizes, grids):
    items = GEO.engine_tokens([(h, w) for w, h in sizes], max_len, text)
    assert [it.grid for it in items] == grids
    assert [it.tokens for it in items] == [(a // 2) * (b // 2) for a, b in grids]
    assert all(LO <= it.budget <= HI for it in items)


@pytest.mark.parametrize(("hw", "grid"), sorted(set(_runs())))
def test_every_run_is_reached_from_the_source_and_from_the_frame(hw, grid):
    tokens = (grid[0] // 2) * (grid[1] // 2)
    frame = GEO.size_for(hw)  # what the static trainer made of the source
    sol = GEO.solve(tokens, frame, hw_kind="frame")
    assert sol.fidelity in ("unique", "closest-aspect")  # never claimed as the engine's
    assert_exact(GEO, frame, sol, tokens)  # a grid kept unchanged at an engine budget
    sol = GEO.solve(tokens, hw)
    assert sol.reachable and sol.tokens == tokens, sol.reason
    assert LO <= sol.budget <= HI and GEO.grid_for(hw, sol.budget) == sol.grid  # the tiler's
    if (hw, tokens) in AMBIGUOUS:
        assert sol.fidelity == "closest-aspect"
        assert "does not tell which the engine used" in sol.reason
        assert "40x42" in sol.reason and "42x40" in sol.reason
    else:
        assert (sol.fidelity, sol.grid) == ("engine-replay", grid), sol.reason
        assert sol.size_hw == (16 * grid[0], 16 * grid[1])


@settings(max_examples=200, deadline=None)
@given(a=st.integers(1, 3328), b=st.integers(1, 3328))
def test_property_an_even_grid_at_most_1024_patches_is_kept_at_1024(a, b):
    """The fact the frame-only solver leans on: at a budget of exactly min_num_patches there
    is no upscale (it needs budget > min), so any even grid of up to 1024 patches is kept."""
    ph, pw = 2 * a, 2 * b
    if ph * pw <= LO:
        assert GEO.grid_for((16 * ph, 16 * pw), LO) == (ph, pw)


@settings(max_examples=200, deadline=None)
@given(
    a=st.integers(1, 1664),
    b=st.integers(1, 1664),
    frame=st.tuples(st.integers(1, 6000), st.integers(1, 6000)),
)
def test_property_any_count_the_tiler_keeps_is_reached_from_any_frame(a, b, frame):
    """For a grid the tiler keeps unchanged at some engine budget, solve() reaches its count
    from any frame size, with a grid kept at the answer's budget."""
    ph, pw = 2 * a, 2 * b
    x = max(LO, ph * pw)
    if x > HI or GEO.grid_for((16 * ph, 16 * pw), x) != (ph, pw):
        return
    sol = GEO.solve(a * b, frame, hw_kind="frame")
    assert sol.reachable
    assert_exact(GEO, frame, sol, a * b)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 4000), st.integers(1, 4000)), min_size=1, max_size=16),
    max_len=st.sampled_from([8192, 16384, 32768]),
    room=st.integers(0, 8192),
)
def test_property_every_run_of_a_request_is_reached_both_ways(sizes, max_len, room):
    """Random requests (the library's replay of the engine's budget, checked against the engine
    by the sweep script): every run comes back from the source, as the tiler's own sizing of
    that source, and from the trainer's frame alone."""
    text = max(0, max_len - 4 - room)
    for hw, it in zip(sizes, GEO.engine_tokens(sizes, max_len, text)):
        src = GEO.solve(it.tokens, hw)
        assert src.reachable and src.tokens == it.tokens
        assert GEO.grid_for(hw, src.budget) == src.grid
        assert src.grid == it.grid or src.fidelity == "closest-aspect"
        frame = GEO.solve(it.tokens, GEO.size_for(hw), hw_kind="frame")
        assert frame.reachable
        assert_exact(GEO, GEO.size_for(hw), frame, it.tokens)
