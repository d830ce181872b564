"""install_vlm on transformers' real ``Glm4vForConditionalGeneration`` (tiny random config, CPU):
images and video frame runs on ONE image token, M-RoPE positions from ``mm_token_type_ids``.

Inputs come from ``testing/families/glm4v.py``. Every guarded sample is compared with the same
sample's plain forward in a batch of its own; a sample holding both images and videos (which the
plain model cannot take) with its features placed by hand, run by run, and the model's own
``get_rope_index`` positions.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaItem
from megatron_media_guard.repair.pixels import from_frames, to_frames
from megatron_media_guard.repair.reproject import resize_frames

pytest.importorskip("transformers.models.glm4v")

from megatron_media_guard.adapters import install_vlm
from megatron_media_guard.families import family_of
from megatron_media_guard.families import glm4v as spec_mod
from megatron_media_guard.testing.families import glm4v as F
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
    """``sample``'s logits in a batch of its own, plain model: ``[len, vocab]``. Images and
    videos together the plain model cannot take: their features are then placed by hand, run
    by run in token order, with the model's own M-RoPE positions."""
    b = F.make_batch(model, [sample])
    if {m.modality for m in sample} != {"image", "video"}:
        return logits(model, b)[0, : b.lengths[0]]
    kw = b.kwargs
    with torch.no_grad():
        im = model.get_image_features(kw["pixel_values"], kw["image_grid_thw"]).pooler_output
        vd = model.get_video_features(kw["pixel_values_videos"], kw["video_grid_thw"])
        frames = [
            g
            for (_, h, w), v in zip(kw["video_grid_thw"].tolist(), vd.pooler_output)
            for g in v.split(h * w // 4)
        ]
        queue = {"image": list(im), "video": frames}
        emb = model.get_input_embeddings()(b.input_ids)
        pos = (b.input_ids[0] == model.config.image_token_id).nonzero().flatten().tolist()
        at = 0
        for mod, n in b.runs[0]:
            f = queue[mod].pop(0)
            assert f.shape[0] == n
            emb[0, pos[at : at + n]] = f
            at += n
        rope = model.model.get_rope_index(
            b.input_ids,
            kw["mm_token_type_ids"],
            kw["image_grid_thw"],
            kw["video_grid_thw"],
            attention_mask=kw["attention_mask"],
        )[0]
        out = model(inputs_embeds=emb, position_ids=rope, attention_mask=kw["attention_mask"])
    return out.logits[0, : b.lengths[0]]


def guarded(model, samples, config=None, items=None, **kw):
    b = F.make_batch(model, samples, **kw)
    with install_vlm(model, config or GuardConfig()) as h:
        if items is not None:
            h.set_items(items)
        with torch.no_grad():
            out = model(**b.kwargs)
        return b, out, h.last_result


ALIGNED = [
    ("images", [[img(4, 6)], [img(8, 4), img(2, 2)]]),
    ("videos", [[vid(2, 4, 4)], [vid(3, 2, 4)]]),
    ("image and video across samples", [[vid(2, 2, 4)], [img(4, 4), img(2, 2)]]),
    ("image then video, equal runs", [[img(4, 4), vid(2, 4, 4)], [vid(2, 4, 4), img(4, 4)]]),
]


@pytest.mark.parametrize("name,samples", ALIGNED, ids=[n for n, _ in ALIGNED])
def test_aligned_batches_equal_each_samples_own_forward(model, name, samples):
    b, out, res = guarded(model, samples)
    assert res.report.actions == ("keep",) * len(samples)
    for k, s in enumerate(samples):
        torch.testing.assert_close(out.logits[k, : b.lengths[k]], own(model, s), atol=1e-5, rtol=0)


def test_plain_model_cannot_take_a_mixed_batch(model):
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        logits(model, F.make_batch(model, ALIGNED[3][1]))


def test_repair_reencodes_the_image_at_the_processors_grid(model, tmp_path):
    """An 8x12-patch image (24 features) whose run holds 12: re-encoded at the grid the
    processor's own resize gives for 12 (6x8 patches), its grid row replaced for M-RoPE;
    equal to the plain model fed that image by hand."""
    cfg = GuardConfig(policy="repair", log_dir=str(tmp_path))
    samples = [[img(8, 12, tokens=12)], [img(2, 4)]]
    # the original's size (the engine sized it): a frame alone would be a guess, not a replay
    source = [
        MediaItem(0, sample=0, source_hw=(8 * F.PATCH, 12 * F.PATCH)),
        MediaItem(0, sample=1, source_hw=(2 * F.PATCH, 4 * F.PATCH)),
    ]
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
    qwen = {"patch": 14, "temporal_patch": 2, "merge": 2}
    frames = to_frames(kw["pixel_values"][:96], "qwen_patches", grid_thw=(1, 8, 12), **qwen)
    small, _ = from_frames(
        resize_frames(frames[:1], (84, 112)).expand(2, -1, -1, -1), "qwen_patches", **qwen
    )
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
    samples = [[vid(2, 4, 4)], [vid(2, 4, 4, tokens=7)]]
    _, _, res = guarded(model, samples, cfg)
    assert res.report.actions == ("keep", "drop")


@pytest.mark.parametrize("hw", [(50, 60), (224, 224), (300, 171), (20, 400), (3000, 4000)])
def test_geometry_matches_the_pil_image_processor(hw):
    """Oracle: the spec's geometry sizes an image as ``Glm4vImageProcessorPil`` does, and
    solving for that count gives that grid back."""
    from PIL import Image
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    out = Glm4vImageProcessorPil()(
        images=[Image.fromarray(np.zeros((*hw, 3), np.uint8))], return_tensors="pt"
    )
    t, h, w = out["image_grid_thw"][0].tolist()
    geo = spec_mod.geometry()
    assert geo.tokens(hw) == t * h * w // 4
    sol = geo.solve(t * h * w // 4, hw)
    assert (sol.fidelity, sol.grid) == ("engine-replay", (h, w))


def test_set_items_names_sample_ids(model, tmp_path):
    samples = [[vid(2, 4, 4)], [vid(2, 4, 4, tokens=7)]]
    items = [
        MediaItem(0, sample=0, modality="video", sample_id="a"),
        MediaItem(0, sample=1, modality="video", sample_id="b"),
    ]
    with pytest.raises(MediaAlignmentError, match="sample_id 'b'"):
        guarded(model, samples, GuardConfig(log_dir=str(tmp_path)), items=items)


def test_registry_knows_glm4v_and_glm45v(model):
    from transformers import Glm4vMoeForConditionalGeneration

    assert family_of(model) is spec_mod.SPEC
    assert Glm4vMoeForConditionalGeneration.__module__.startswith("transformers.")
    assert Glm4vMoeForConditionalGeneration.__name__ in spec_mod.SPEC.classes["transformers."]


def test_missing_token_types_is_a_clear_error(model):
    b = F.make_batch(model, [[img(4, 6)]])
    b.kwargs.pop("mm_token_type_ids")
    with install_vlm(model, GuardConfig()), pytest.raises(Exception, match="mm_token_type_ids"):
        logits(model, b)


def test_check_batch_before_the_trainer_drops_the_bad_sample_without_a_model(model):
    """The spec's own counts on the processor's outputs (no model): the sample whose frame run
    is short loses its video; the checked batch then runs through the plain model. (Videos
    only: check_batch orders images and frame runs by the length interleaving, not by
    mm_token_type_ids.)"""
    from megatron_media_guard.families.collate import check_batch

    samples = [[vid(2, 4, 4)], [vid(2, 4, 4, tokens=7)], [vid(2, 2, 4)]]
    b = F.make_batch(model, samples)
    checked = check_batch("glm4v", b.kwargs, config=model.config)
    assert checked.report.actions == ("keep", "drop", "keep")
    out = checked.batch
    assert out["video_grid_thw"].tolist() == [[2, 4, 4], [2, 2, 4]]
    with torch.no_grad():
        got = model(**out).logits
    for k in (0, 2):
        torch.testing.assert_close(
            got[k, : b.lengths[k]], own(model, samples[k]), atol=1e-5, rtol=0
        )
