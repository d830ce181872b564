"""AnyresGeometry against transformers' own LLaVA-OneVision code (the oracle): for every size it
solves, the real ``LlavaOnevisionImageProcessorPil`` run on a synthetic image of that size gives
tiles and ``image_sizes`` from which the tiny model's own ``get_image_features`` makes exactly
the solved count; and ``tokens`` equals the processor's ``_get_number_of_features``."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_media_guard.geometry import AnyresGeometry
from megatron_media_guard.testing.families import llava_onevision as F

pytest.importorskip("transformers.models.llava_onevision")
pytestmark = pytest.mark.timeout(120)

GEO = AnyresGeometry(pinpoints=F.PINPOINTS, tile=F.TILE, patch=14, max_tiles=9)


@pytest.fixture(scope="module")
def model():
    return F.tiny_model()


def _processor_count(h: int, w: int, model) -> int:
    """``LlavaOnevisionProcessor._get_number_of_features`` on a stand-in ``self`` (the
    processor itself cannot be built without torchvision)."""
    from transformers.models.llava_onevision.processing_llava_onevision import (
        LlavaOnevisionProcessor as P,
    )

    cfg = model.config
    me = types.SimpleNamespace(
        num_image_tokens=GEO.side**2,
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        vision_aspect_ratio=cfg.vision_aspect_ratio,
        image_processor=types.SimpleNamespace(image_grid_pinpoints=cfg.image_grid_pinpoints),
    )
    me._get_unpadded_features = types.MethodType(P._get_unpadded_features, me)
    return P._get_number_of_features(me, h, w, F.TILE, F.TILE)


def _model_count(sizes, model) -> list[int]:
    """The real Pil processor on random images of ``sizes`` (one image a sample), then the
    model's own ``get_image_features``: its feature count per image."""
    from PIL import Image
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    ip = LlavaOnevisionImageProcessorPil(
        size={"height": F.TILE, "width": F.TILE}, image_grid_pinpoints=F.PINPOINTS
    )
    rng = np.random.default_rng(0)
    ims = [[Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))] for h, w in sizes]
    out = ip(ims, return_tensors="pt")
    assert out["image_sizes"].tolist() == [list(s) for s in sizes]
    with torch.no_grad():
        feats = model.model.get_image_features(
            out["pixel_values"], out["image_sizes"], batch_num_images=out["batch_num_images"]
        ).pooler_output
    return [f.shape[0] for f in feats]


SIZES = [(56, 56), (100, 60), (3000, 2000), (20, 20), (57, 2500), (333, 999), (1, 1), (7, 300)]


def test_tokens_match_the_processor_and_the_model(model):
    want = [_processor_count(h, w, model) for h, w in SIZES]
    assert [GEO.tokens(hw) for hw in SIZES] == want
    assert _model_count(SIZES[:6], model) == want[:6]
    assert want == [F.llava_onevision_num_features(h, w, model.config) for h, w in SIZES]


TABLE = [  # (hw, target, fidelity, size_hw)
    ((100, 60), 16 + 8 * 5, "engine-replay", (100, 60)),  # its own count: the size is kept
    ((100, 60), 40, "closest-aspect", (112, 41)),  # 8x2 features + newlines on a 2x1 grid
    ((100, 60), 16 + 12 * 13, "closest-aspect", (168, 154)),  # 12x12 (the cap): near square
    ((56, 56), 17, "unreachable", None),  # base + 1 is the multi-image count, never anyres
    # a 0-row map: a sliver unpads to no rows (a 14x337 image does); a 13x56 one too
    ((56, 56), 16, "closest-aspect", (13, 56)),
    ((56, 56), 10**6, "unreachable", None),  # beyond the cap
]


@pytest.mark.parametrize("hw,target,fidelity,size", TABLE)
def test_solve_classes(model, hw, target, fidelity, size):
    sol = GEO.solve(target, hw)
    assert (sol.fidelity, sol.size_hw) == (fidelity, size), sol.reason
    assert sol.tokens == (target if size else 0)
    if size is not None:
        assert _model_count([size], model) == [target]
        assert sol.tiles == (GEO.size_for(size)[1] // F.TILE, GEO.size_for(size)[0] // F.TILE)


@settings(max_examples=25, deadline=None)
@given(
    hw=st.tuples(st.integers(1, 800), st.integers(1, 800)),
    src=st.tuples(st.integers(14, 400), st.integers(14, 400)),
)
def test_every_count_of_some_image_is_solved_and_the_model_agrees(model, hw, src):
    """A count some image gives (within the lattice's aspect range) is reached for any image,
    and the processor + model on the solved size make exactly that many features."""
    n = GEO.tokens(src)
    sol = GEO.solve(n, hw)
    assert sol.reachable and sol.tokens == n, sol.reason
    assert GEO.tokens(sol.size_hw) == n
    assert _model_count([sol.size_hw], model) == [n]
    if sol.fidelity == "closest-aspect":  # nothing on the lattice is closer in aspect
        h, w = hw
        d = abs(np.log(sol.size_hw[0] * w / (sol.size_hw[1] * h)))
        assert all(abs(np.log(a * w / (b * h))) >= d - 1e-12 for a, b in GEO._candidates(n, h, w))


def test_every_count_of_a_sliver_is_reached():
    """Slivers unpad to few rows (down to none): every count such images give is reached,
    from any image size (the lattice once stepped over some: a 14x337 image's count 16)."""
    counts = {GEO.tokens((h, w)) for h in range(1, 57) for w in range(300, 340)}
    counts |= {GEO.tokens((w, h)) for h in range(1, 57) for w in range(300, 340)}
    assert GEO.side**2 in counts  # the 0-row map
    for n in sorted(counts):
        sol = GEO.solve(n, (1, 1))
        assert sol.reachable and GEO.tokens(sol.size_hw) == n, (n, sol.reason)
