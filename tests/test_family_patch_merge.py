"""GLM-4V and Ernie 4.5 VL on transformers' real classes (tiny random config, CPU), one
:class:`GridCase` each: grids and geometry are the PIL image processor's; a short image run is
repaired at the processor's grid (equal to the plain model fed that image by hand);
``check_batch`` drops the short sample. The shared contract (GLM-4V's mixed image and video
samples, a short video run's fallback included): ``tests/families/``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from family_checks import guarded_forward, img, own_logits, records, vid
from test_check_batch import fixture as check_batch_fixture

from megatron_media_guard import GuardConfig, MediaItem
from megatron_media_guard.families.collate import check_batch
from megatron_media_guard.repair.pixels import from_frames, to_frames
from megatron_media_guard.repair.reproject import resize_frames

pytest.importorskip("transformers.models.glm4v")
pytest.importorskip("transformers.models.ernie4_5_vl_moe")
pytest.importorskip("PIL")

from megatron_media_guard.adapters import install_vlm

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class GridCase:
    """family: the registry's name and the fixture's; processor: its PIL image processor
    (module, class); check: a batch whose sample 1 is short, and the grid rows ``check_batch``
    keeps (key, rows)."""

    family: str
    processor: tuple[str, str]
    check: list
    kept: tuple[str, list]

    @property
    def F(self):
        return importlib.import_module(f"megatron_media_guard.testing.families.{self.family}")

    @property
    def spec(self):
        return importlib.import_module(f"megatron_media_guard.families.{self.family}")


CASES = {
    c.family: c
    for c in [
        GridCase(
            "glm4v",
            ("glm4v.image_processing_pil_glm4v", "Glm4vImageProcessorPil"),
            # videos only: check_batch orders images and frame runs by the length
            # interleaving, not by mm_token_type_ids
            check=[[vid(2, 4, 4)], [vid(2, 4, 4, n=7)], [vid(2, 2, 4)]],
            kept=("video_grid_thw", [[2, 4, 4], [2, 2, 4]]),
        ),
        GridCase(
            "ernie4_5_vl",
            (
                "ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe",
                "Ernie4_5_VLMoeImageProcessorPil",
            ),
            check=[[vid(2, 4, 4), img(4, 6)], [img(8, 4, n=5)], [img(2, 4)]],
            kept=("image_grid_thw", [[1, 4, 6], [1, 2, 4]]),
        ),
    ]
}
NAMES = sorted(CASES)


def test_the_registry_routes_glm_4_5v_moe_to_glm4v():
    """GLM-4.5V's MoE class, of which no tiny model is built (the dense class: the contract,
    ``tests/families/``)."""
    assert "Glm4vMoeForConditionalGeneration" in CASES["glm4v"].spec.SPEC.classes["transformers."]


@pytest.mark.parametrize(
    "hw", [(50, 60), (224, 224), (300, 171), (1080, 2400), (20, 400), (3000, 4000)]
)
@pytest.mark.parametrize("name", NAMES)
def test_grids_and_geometry_are_the_pil_image_processors(name, hw):
    """The fixture's resize arithmetic gives the processor's ``image_grid_thw`` and patches;
    the spec's geometry sizes the image as the processor does, and solving for that count
    gives that grid back."""
    from PIL import Image

    case = CASES[name]
    module, cls = case.processor
    proc = getattr(importlib.import_module(f"transformers.models.{module}"), cls)()
    out = proc(images=[Image.fromarray(np.zeros((*hw, 3), np.uint8))], return_tensors="pt")
    t, h, w = case.F.image_grid(*hw)
    assert out["image_grid_thw"].tolist() == [[t, h, w]]
    assert tuple(out["pixel_values"].shape) == (t * h * w, case.F.PATCH_DIM)
    geo = case.spec.geometry()
    assert geo.tokens(hw) == t * h * w // 4
    sol = geo.solve(t * h * w // 4, hw)
    assert (sol.fidelity, sol.grid) == ("engine-replay", (h, w))


@pytest.mark.parametrize("name", NAMES)
def test_repair_reencodes_the_image_at_the_processors_grid(name, tmp_path):
    """An 8x12-patch image (24 features) whose run holds 12: re-encoded at the grid the
    processor's own resize gives for 12 (6x8 patches), its grid row replaced for M-RoPE;
    equal to the plain model fed that image by hand."""
    case = CASES[name]
    model, P = check_batch_fixture(name)[2], case.F.PATCH
    cfg = GuardConfig(policy="repair", log_dir=str(tmp_path))
    samples = [[img(8, 12, n=12)], [img(2, 4)]]
    # the original's size (the engine sized it): a frame alone would be a guess, not a replay
    source = [
        MediaItem(0, sample=0, source_hw=(8 * P, 12 * P)),
        MediaItem(0, sample=1, source_hw=(2 * P, 4 * P)),
    ]
    b, out, res = guarded_forward(case.F, model, samples, cfg, source)
    assert res.report.actions == ("repair", "keep")
    rec = next(r for r in records(tmp_path) if r["event"] == "repair")
    assert (rec["fidelity"], rec["grid"]) == ("engine-replay", [6, 8])
    kw, tp = b.kwargs, getattr(case.F, "TEMPORAL_PATCH", 1)
    qwen = {"patch": P, "temporal_patch": tp, "merge": 2}
    frames = to_frames(kw["pixel_values"][:96], "qwen_patches", grid_thw=(1, 8, 12), **qwen)
    small = resize_frames(frames[:1], (84, 112)).expand(tp, -1, -1, -1)
    small, _ = from_frames(small, "qwen_patches", **qwen)
    fixed = dict(
        kw,
        pixel_values=torch.cat([small, kw["pixel_values"][96:]]),
        image_grid_thw=torch.tensor([[1, 6, 8], [1, 2, 4]]),
    )
    with torch.no_grad():
        ref = model(**fixed).logits
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_check_batch_before_the_trainer_drops_the_bad_sample_without_a_model(name):
    """The spec's own counts on the processor's outputs (no model): the sample whose run is
    short loses its media; the checked batch then runs through the plain model."""
    case = CASES[name]
    model = check_batch_fixture(name)[2]
    b = case.F.make_batch(model, case.check)
    checked = check_batch(name, b.kwargs, config=model.config)
    assert checked.report.actions == ("keep", "drop", "keep")
    key, rows = case.kept
    assert checked.batch[key].tolist() == rows
    with torch.no_grad():
        got = model(**checked.batch).logits
    for k in (0, 2):
        want = own_logits(case.F, model, case.check[k])
        torch.testing.assert_close(got[k, : b.lengths[k]], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_missing_token_types_is_a_clear_error(name):
    case = CASES[name]
    model = check_batch_fixture(name)[2]
    b = case.F.make_batch(model, [[img(4, 6)]])
    b.kwargs.pop("mm_token_type_ids")
    with install_vlm(model, GuardConfig()), pytest.raises(Exception, match="mm_token_type_ids"):
        model(**b.kwargs)
