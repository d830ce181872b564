"""PixtralGeometry against transformers' own ``PixtralImageProcessorPil`` (the oracle: its
``image_sizes`` for real PIL images), and its inverse as a property: every count the resize
gives with some longest edge is solved by replaying that edge."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_media_guard.geometry import GeometryError, PixtralGeometry

SIZES = [(30, 30), (28, 28), (27, 29), (100, 60), (1541, 17), (3000, 2000), (777, 1999), (5, 900)]
EDGES = [1540, 1024, 200, 56]


def _processor_sizes(sizes, edge: int) -> list[list[int]]:
    from PIL import Image
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    # what PixtralProcessor passes: patch_size * spatial_merge_size = 28
    proc = PixtralImageProcessorPil(
        size={"longest_edge": edge}, patch_size={"height": 28, "width": 28}
    )
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    return proc(images, return_tensors="pt")["image_sizes"].tolist()


@pytest.mark.parametrize("edge", EDGES)
def test_size_for_matches_the_processor(edge):
    pytest.importorskip("PIL")
    geo = PixtralGeometry(longest_edge=edge)
    sizes = [hw for hw in SIZES if min(hw) * edge >= max(hw)]  # no side resized to 0
    want = _processor_sizes(sizes, edge)
    assert [list(geo.size_for(hw)) for hw in sizes] == want
    assert [geo.tokens(hw) for hw in sizes] == [(h // 28) * (w // 28) for h, w in want]
    for hw in set(SIZES) - set(sizes):  # an empty side is an error, as in the processor
        with pytest.raises(ValueError, match="Size must contain"):
            _processor_sizes([hw], edge)
        with pytest.raises(GeometryError, match="empty"):
            geo.size_for(hw)


CASES = [  # (hw, target): an engine-replay edge exists for each
    ((3000, 2000), 55 * 37),  # the configured edge itself: 1540x1036
    ((3000, 2000), 12),
    ((1000, 700), 1),
    ((112, 168), 6),
]


@pytest.mark.parametrize("hw,target", CASES)
def test_replayed_edge_gives_the_processors_own_size(hw, target):
    pytest.importorskip("PIL")
    sol = PixtralGeometry().solve(target, hw)
    assert sol.fidelity == "engine-replay" and sol.tokens == target
    assert _processor_sizes([hw], sol.budget) == [list(sol.size_hw)]
    assert sol.grid == (sol.size_hw[0] // 14, sol.size_hw[1] // 14)


@settings(max_examples=200, deadline=None)
@given(h=st.integers(1, 4000), w=st.integers(1, 4000), edge=st.integers(1, 1540))
def test_every_count_a_longest_edge_gives_is_replayed(h, w, edge):
    geo = PixtralGeometry()
    assume(min(h, w) * edge >= max(h, w))  # else a side resizes to 0 (the processor fails)
    n = geo.tokens((h, w), longest_edge=edge)
    sol = geo.solve(n, (h, w))
    cells = geo.size_for((h, w), longest_edge=edge)
    if max(cells) <= 1540:
        assert sol.fidelity == "engine-replay"
        assert sol.size_hw == cells  # each side is monotone in the edge: the grid is unique
        assert geo.size_for((h, w), longest_edge=sol.budget) == cells
    assert sol.tokens == n
