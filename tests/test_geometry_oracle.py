"""Geometry against the real processors (HF transformers on CPU, no weights).

- Qwen2-VL: the image processor's ``image_grid_thw`` for ~30 images, its own
  ``smart_resize`` for several hundred sizes, and solved sizes fed back through both.
- Qwen3-VL video: the video processor's ``smart_resize`` (frames share the budget).
- RADIO: HF's Nemotron-H Omni ``get_patch_grid_size`` (the static-budget tiler), read from
  the installed source (its module needs torchvision, which the CPU suite does not have).
"""

from __future__ import annotations

import importlib.util
import math
import random

import numpy as np
import pytest
from test_geometry import pm_replay_budget

from megatron_media_guard.geometry import GeometryError, PatchMergeGeometry, RadioTilerGeometry
from megatron_media_guard.testing.families import nemotron_omni

transformers = pytest.importorskip("transformers")

try:  # transformers 5.x without torchvision
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil as QwenProcessor,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
except ImportError:  # older layouts
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
        Qwen2VLImageProcessor as QwenProcessor,
    )
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

CONFIGS = {
    "hf-default": PatchMergeGeometry(),
    "qwen2-vl": PatchMergeGeometry.qwen2_vl(),
    "small": PatchMergeGeometry(min_pixels=64 * 784, max_pixels=256 * 784),
    "qwen3-vl": PatchMergeGeometry.qwen3_vl(),
}


def oracle_hw(geo: PatchMergeGeometry, hw: tuple[int, int]) -> tuple[int, int] | None:
    """The installed smart_resize's (H', W'); None where it rejects the size."""
    px = {"min_pixels": geo.min_pixels, "max_pixels": geo.max_pixels}
    try:
        return tuple(smart_resize(*hw, factor=geo.factor, **px))
    except ValueError:
        return None


def processor_tokens(geo: PatchMergeGeometry, hw: tuple[int, int]) -> int:
    """Tokens from the full HF image processor: prod(image_grid_thw) / merge^2."""
    proc = QwenProcessor(
        patch_size=geo.patch,
        merge_size=geo.merge,
        temporal_patch_size=geo.temporal_patch,
        size={"shortest_edge": geo.min_pixels, "longest_edge": geo.max_pixels},
    )
    image = np.zeros((*hw, 3), dtype=np.uint8)
    out = proc(images=image, return_tensors="np", input_data_format="channels_last")
    (thw,) = np.asarray(out["image_grid_thw"]).tolist()
    return math.prod(thw) // geo.merge**2


def random_sizes(seed: int, count: int, top: int, thin: bool = True) -> list[tuple[int, int]]:
    """Seeded (H, W): mostly ordinary, some narrow, and (thin=True) some near the aspect cap."""
    rng = random.Random(seed)
    sizes = []
    while len(sizes) < count:
        h = rng.randint(1, top)
        choices = [rng.randint(1, top), rng.randint(1, 60)]
        if thin:
            choices.append(h * rng.randint(150, 250))
        sizes.append((h, rng.choice(choices)))
    return sizes


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sizes_and_solved_sizes_match_smart_resize(name):
    """size_for is the installed smart_resize (what it rejects raises and is never solved);
    solved sizes round-trip through it: an engine-replay is its resize of the source at the
    budget found, any other answer a frame it keeps at min_pixels = max_pixels = budget."""
    geo, f = CONFIGS[name], CONFIGS[name].factor
    rng = random.Random(11)
    accepted = rejected = reachable = 0
    for hw in random_sizes(seed=len(name), count=300, top=5000):
        want = oracle_hw(geo, hw)
        if want is None:
            with pytest.raises(GeometryError):
                geo.size_for(hw)
            assert not geo.solve(1, hw).reachable
            rejected += 1
            continue
        assert geo.size_for(hw) == want, hw
        own = geo.tokens(hw)
        assert own == (want[0] // f) * (want[1] // f), hw
        accepted += 1
        for target in {own, rng.randint(1, 2 * own + 8), rng.randint(1, 16384)}:
            sol = geo.solve(target, hw)
            if not sol.reachable:
                continue
            reachable += 1
            if sol.fidelity != "engine-replay":
                px = {"min_pixels": sol.budget, "max_pixels": sol.budget}
                kept = smart_resize(*sol.size_hw, factor=f, **px)
                assert tuple(kept) == sol.size_hw, (hw, target, sol)
                assert (kept[0] // f) * (kept[1] // f) == target
            else:
                replay = smart_resize(*hw, factor=f, **pm_replay_budget(sol))
                assert tuple(replay) == sol.size_hw, (hw, target, sol)
    assert accepted >= 200 and rejected >= 10 and reachable > 150


@pytest.mark.parametrize("name", ["hf-default", "small"])
def test_tokens_match_the_full_processor(name):
    geo = CONFIGS[name]
    sizes = [(1, 1), (27, 29), (50, 60), (300, 400), (224, 224), (97, 1203), (1000, 700)]
    sizes += [(1080, 2400), (2000, 3000), *random_sizes(seed=7, count=8, top=900, thin=False)]
    for hw in sizes:
        assert oracle_hw(geo, hw) is not None
        assert geo.tokens(hw) == processor_tokens(geo, hw), hw


def test_qwen3_video_matches_its_smart_resize():
    mod = pytest.importorskip("transformers.models.qwen3_vl.video_processing_qwen3_vl")
    geo = PatchMergeGeometry.qwen3_vl_video()
    px = {"min_pixels": geo.min_pixels, "max_pixels": geo.max_pixels}
    rng = random.Random(2)
    for _ in range(300):
        t = rng.randint(2, 64)
        hw = (rng.randint(1, 4000), rng.randint(1, 4000))
        try:
            want = tuple(mod.smart_resize(t, *hw, temporal_factor=2, factor=geo.factor, **px))
        except ValueError:
            with pytest.raises(GeometryError):
                geo.size_for(hw, t)
            continue
        assert geo.size_for(hw, t) == want, (hw, t)
        assert geo.tokens(hw, t) == math.ceil(t / 2) * (want[0] // 32) * (want[1] // 32)


def test_radio_tiler_matches_hf_get_patch_grid_size():
    """HF's get_patch_grid_size, compiled from the installed source (no torchvision needed)."""
    if importlib.util.find_spec("transformers.models.nemotron_h_omni") is None:
        pytest.skip("this transformers has no nemotron_h_omni")
    hf = nemotron_omni.processor_functions()["get_patch_grid_size"]
    rng = random.Random(9)
    configs = [RadioTilerGeometry(), RadioTilerGeometry(min_num_patches=256, max_num_patches=4096)]
    for geo in configs:
        for _ in range(400):
            hw = (rng.randint(1, 5000), rng.choice([rng.randint(1, 5000), rng.randint(1, 80)]))
            budget = rng.choice([geo.min_num_patches, rng.randint(geo.min_num_patches, 20000)])
            try:
                want = tuple(hf(hw[0], hw[1], 16, 2, geo.min_num_patches, budget))
            except ZeroDivisionError:
                with pytest.raises(GeometryError):
                    geo.grid_for(hw, budget)
                continue
            assert geo.grid_for(hw, budget) == want, (hw, budget)
    # the seed's 1080x2400 and the fixture's grids, at its static budget of 13312 patches
    for hw, grid in [((1080, 2400), (68, 150)), ((2400, 1080), (150, 68)),
                     ((224, 224), (32, 32)), ((100, 3000), (8, 188))]:  # fmt: skip
        assert tuple(hf(*hw, 16, 2, 1024, 13312)) == nemotron_omni.image_grid(*hw) == grid
        assert RadioTilerGeometry(budget=13312).grid_for(hw) == grid
        assert RadioTilerGeometry().grid_for(hw) == grid
