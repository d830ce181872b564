"""install_vlm on transformers' real ``Ernie4_5_VLMoeForConditionalGeneration`` (tiny random
config, CPU): images and videos on their own tokens, M-RoPE positions from ``mm_token_type_ids``,
``moe_mm_token_type_ids`` routing to the vision experts.

Inputs come from ``testing/families/ernie4_5_vl.py``. Every guarded sample is compared with the
same sample's plain forward in a batch of its own.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaItem
from megatron_media_guard.repair.pixels import from_frames, to_frames
from megatron_media_guard.repair.reproject import resize_frames

pytest.importorskip("transformers.models.ernie4_5_vl_moe")

from megatron_media_guard.adapters import install_vlm
from megatron_media_guard.families import ernie4_5_vl as spec_mod
from megatron_media_guard.families import family_of
from megatron_media_guard.testing.families import ernie4_5_vl as F
from megatron_media_guard.testing.families.base import Media


def img(h, w, tokens=None):
    return Media("image", (h, w), tokens)


def vid(t, h, w, tokens=None):
    return Media("video", (t, h, w), tokens)


@pytest.fixture(scope="module")
def model():
    return F.tiny_model()


def logits(model, b):
    with torch.no_grad():
        return model(**b.kwargs).logits


def own(model, sample):
    """``sample``'s logits in a batch of its own, plain model: ``[len, vocab]``."""
    b = F.make_batch(model, [sample])
    return logits(model, b)[0, : b.lengths[0]]


def guarded(model, samples, config=None, items=None, **kw):
    b = F.make_batch(model, samples, **kw)
    with install_vlm(model, config or GuardConfig()) as h:
        if items is not None:
            h.set_items(items)
        with torch.no_grad():
            out = model(**b.kwargs)
        return b, out, h.last_result


def test_repair_reencodes_the_image_at_the_processors_grid(model, tmp_path):
    """An 8x12-patch image (24 features) whose run holds 12: re-encoded at the grid the
    processor's own resize gives for 12 (6x8 patches), its grid row replaced for M-RoPE;
    equal to the plain model fed that image by hand."""
    cfg = GuardConfig(policy="repair", log_dir=str(tmp_path))
    samples = [[img(8, 12, tokens=12)], [img(2, 4)]]
    # the original's size (the engine sized it): a frame alone would be a guess, not a replay
    source = [MediaItem(0, sample=0, source_hw=(8 * 14, 12 * 14)), MediaItem(0, sample=1)]
    b, out, res = guarded(model, samples, cfg, items=source)
    assert res.report.actions == ("repair", "keep")
    rec = next(
        json.loads(x)
        for f in tmp_path.glob("*.jsonl")
        for x in f.read_text().splitlines()
        if '"repair"' in x
    )
    assert (rec["fidelity"], rec["grid"]) == ("engine-replay", [6, 8])
    kw = b.kwargs
    qwen = {"patch": 14, "temporal_patch": 1, "merge": 2}
    frames = to_frames(kw["pixel_values"][:96], "qwen_patches", grid_thw=(1, 8, 12), **qwen)
    small, _ = from_frames(resize_frames(frames, (84, 112)), "qwen_patches", **qwen)
    fixed = dict(
        kw,
        pixel_values=torch.cat([small, kw["pixel_values"][96:]]),
        image_grid_thw=torch.tensor([[1, 6, 8], [1, 2, 4]]),
    )
    with torch.no_grad():
        ref = model(**fixed).logits
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=1e-5)


def test_video_repair_falls_back(model, tmp_path):
    cfg = GuardConfig(policy="repair", fallback="drop", log_dir=str(tmp_path))
    _, _, res = guarded(model, [[vid(2, 4, 4)], [vid(2, 4, 4, tokens=3)]], cfg)
    assert res.report.actions == ("keep", "drop")


@pytest.mark.parametrize("hw", [(50, 60), (224, 224), (300, 171), (20, 400), (3000, 4000)])
def test_geometry_matches_the_pil_image_processor(hw):
    """Oracle: the spec's geometry sizes an image as ``Ernie4_5_VLMoeImageProcessorPil`` does,
    and solving for that count gives that grid back."""
    from PIL import Image
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeImageProcessorPil,
    )

    out = Ernie4_5_VLMoeImageProcessorPil()(
        images=[Image.fromarray(np.zeros((*hw, 3), np.uint8))], return_tensors="pt"
    )
    t, h, w = out["image_grid_thw"][0].tolist()
    geo = spec_mod.geometry()
    assert geo.tokens(hw) == t * h * w // 4
    sol = geo.solve(t * h * w // 4, hw)
    assert (sol.fidelity, sol.grid) == ("engine-replay", (h, w))


def test_set_items_names_sample_ids(model, tmp_path):
    samples = [[vid(2, 4, 4)], [vid(2, 4, 4, tokens=3)]]
    items = [
        MediaItem(0, sample=0, modality="video", sample_id="a"),
        MediaItem(0, sample=1, modality="video", sample_id="b"),
    ]
    with pytest.raises(MediaAlignmentError, match="sample_id 'b'"):
        guarded(model, samples, GuardConfig(log_dir=str(tmp_path)), items=items)


def test_registry_knows_the_model(model):
    assert family_of(model) is spec_mod.SPEC


def test_check_batch_before_the_trainer_drops_the_bad_sample_without_a_model(model):
    """The spec's own counts on the processor's outputs (no model): the sample whose image run
    is short loses its media; the checked batch then runs through the plain model."""
    from megatron_media_guard.families.collate import check_batch

    samples = [[vid(2, 4, 4), img(4, 6)], [img(8, 4, tokens=5)], [img(2, 4)]]
    b = F.make_batch(model, samples)
    checked = check_batch("ernie4_5_vl", b.kwargs, config=model.config)
    assert checked.report.actions == ("keep", "drop", "keep")
    assert checked.batch["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 4]]
    with torch.no_grad():
        got = model(**checked.batch).logits
    for k in (0, 2):
        torch.testing.assert_close(
            got[k, : b.lengths[k]], own(model, samples[k]), atol=1e-5, rtol=0
        )
