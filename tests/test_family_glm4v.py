"""install_vlm on transformers' real ``Glm4vForConditionalGeneration`` (tiny random config, CPU):
images and video frame runs on ONE image token, M-RoPE positions from ``mm_token_type_ids``.

Inputs come from ``testing/families/glm4v.py``. Every guarded sample is compared with the same
sample's plain forward in a batch of its own; a sample holding both images and videos (which the
plain model cannot take) with its features placed by hand, run by run, and the model's own
``get_rope_index`` positions. Repair, the processor's grids, ``set_items`` and ``check_batch``:
``tests/test_family_patch_merge.py`` (with Ernie 4.5 VL); the plain model refusing a mixed
batch: ``tests/test_fixture_plain.py``.
"""

from __future__ import annotations

import pytest
import torch
from family_checks import guarded_forward

from megatron_media_guard import GuardConfig

pytest.importorskip("transformers.models.glm4v")

from megatron_media_guard.adapters import install_vlm
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
    return guarded_forward(F, model, samples, config, items, **kw)


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


def test_missing_token_types_is_a_clear_error(model):
    b = F.make_batch(model, [[img(4, 6)]])
    b.kwargs.pop("mm_token_type_ids")
    with install_vlm(model, GuardConfig()), pytest.raises(Exception, match="mm_token_type_ids"):
        logits(model, b)
