"""GLM-4V / GLM-4.1V / GLM-4.5V (transformers ``Glm4vForConditionalGeneration``), tiny and random.

Grammar (``Glm4vProcessor``): an image is ``<|begin_of_image|>`` ``<|image|>``×N ``<|end_of_image|>``;
a video is ``<|begin_of_video|>`` then, per temporal patch (2 frames), ``<|begin_of_image|>``
``<|image|>``×(h·w/4) ``<|end_of_image|>`` followed by the frame's timestamp as text, then
``<|end_of_video|>``. Video frames reuse the **image** token (the config's ``video_token_id``,
``<|video|>``, is the prompt-side marker the processor expands, never in the model's ids);
``mm_token_type_ids`` (0 text, 1 image, 2 video) is what tells them apart.

The ids are built from the config's token ids and the processor's own arithmetic (no tokenizer
is needed offline): text is random ids below the special ids (``SMALL_TEXT_IDS``); the
timestamp text after a frame is one stand-in id (``TIMESTAMP_ID + second``) where the real
tokenizer writes the digits of ``int(timestamp)``. Pixel rows are random, ``[Σ patches,
3·2·14·14]`` float32, the layout ``Glm4vImageProcessor.patchify`` writes (rows in 2×2
merge-block order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .base import SMALL_SPECIAL_IDS as SPECIAL_IDS
from .base import SMALL_TEXT_IDS as TEXT_IDS
from .base import SMALL_VOCAB as VOCAB
from .base import FamilyBatch, Media, right_pad, rng

FAMILY = "glm4v"

PATCH = 14
TEMPORAL_PATCH = 2
MERGE = 2
PATCH_DIM = 3 * TEMPORAL_PATCH * PATCH * PATCH
TIMESTAMP_ID = 100  # stand-in id for the timestamp text after each video frame
PAD_ID = 0


def tiny_model(seed: int = 0, **overrides):
    """Tiny random ``Glm4vForConditionalGeneration`` (vision depth 1, hidden 32, 1 text layer;
    vocab ``SMALL_VOCAB`` of ``testing/families/base``, not the real 151552 rows). ``overrides``
    update the top-level config."""
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    text = dict(
        vocab_size=VOCAB,
        pad_token_id=PAD_ID,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [1, 1, 2],
            "partial_rotary_factor": 0.5,
        },
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=32,
        image_size=56,
    )
    cfg = Glm4vConfig(text_config=text, vision_config=vision, **{**SPECIAL_IDS, **overrides})
    torch.manual_seed(seed)
    return Glm4vForConditionalGeneration(cfg).eval().float()


def smart_resize(
    height: int, width: int, *, min_pixels: int = 112 * 112, max_pixels: int = 28 * 28 * 15000
):
    """The image processor's resize target ``(H, W)`` for an image of ``height × width`` pixels
    (``Glm4vImageProcessor`` defaults: factor 28, ``size`` shortest/longest edge = min/max pixels,
    two frames per temporal patch)."""
    factor = PATCH * MERGE
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    frames = TEMPORAL_PATCH
    if frames * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif frames * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid(height: int, width: int) -> tuple[int, int, int]:
    """``image_grid_thw`` row for an image of ``height × width`` pixels; tokens = t·h·w/4."""
    rh, rw = smart_resize(height, width)
    return 1, rh // PATCH, rw // PATCH


def _rng(seed: int, sample: Sequence[Media], k: int, what: str) -> torch.Generator:
    return rng(seed, [(m.modality, m.size) for m in sample], k, what)


def _counts(media: Media) -> tuple[int, int]:
    """(runs, placeholders per run) of an aligned item."""
    if media.modality == "image":
        h, w = media.size
        return 1, h * w // MERGE**2
    if media.modality == "video":
        t, h, w = media.size
        return t, h * w // MERGE**2
    raise ValueError(f"glm4v has no {media.modality!r} modality")


def make_batch(model, samples, *, text_len: int = 6, swap=None, seed: int = 0) -> FamilyBatch:
    """A right-padded batch as ``Glm4vProcessor`` lays it out.

    ``size``: image ``(h, w)`` patch grid (14-px patches, both even; tokens h·w/4); video
    ``(t, h, w)``: t temporal patches of 2 frames each, each one ``<|begin_of_image|>`` run of
    h·w/4 tokens (feature count t·h·w/4). ``Media.tokens`` sets the item's total placeholders;
    for a video the difference lands on its last frame run. Consumption order (``items``,
    ``swap`` indices): every image (sample-major, prompt order), then every video.
    ``items`` are the feature side as passed to the model: after a swap, item i's entry is the
    swapped-in item's (its sample, its count); ``runs`` are the token side.
    """
    cfg = model.config
    rows, types, runs = [], [], []
    pix = {"image": [], "video": []}
    grids = {"image": [], "video": []}
    owners = {"image": [], "video": []}
    for si, sample in enumerate(samples):
        g = _rng(seed, sample, -1, "text")
        ids = torch.randint(*TEXT_IDS, (text_len,), generator=g).tolist()
        tt = [0] * text_len
        sruns = []
        for k, media in enumerate(sample):
            n_runs, per = _counts(media)
            total = media.tokens if media.tokens is not None else n_runs * per
            lens = [per] * (n_runs - 1) + [total - per * (n_runs - 1)]
            if min(lens) < 0:
                raise ValueError(f"tokens={media.tokens} leaves a negative last run")
            code = 1 if media.modality == "image" else 2
            if media.modality == "video":
                ids.append(cfg.video_start_token_id)
                tt.append(0)
            for r, n in enumerate(lens):
                ids += (
                    [cfg.image_start_token_id] + [cfg.image_token_id] * n + [cfg.image_end_token_id]
                )
                tt += [0] + [code] * n + [0]
                if media.modality == "video":
                    ids.append(TIMESTAMP_ID + r)
                    tt.append(0)
            if media.modality == "video":
                ids.append(cfg.video_end_token_id)
                tt.append(0)
            sruns += [(media.modality, n) for n in lens]
            ids += torch.randint(*TEXT_IDS, (2,), generator=_rng(seed, sample, k, "gap")).tolist()
            tt += [0, 0]
            thw = (1, *media.size) if media.modality == "image" else tuple(media.size)
            n_patch = thw[0] * thw[1] * thw[2]
            pix[media.modality].append(
                torch.randn(n_patch, PATCH_DIM, generator=_rng(seed, sample, k, "pix"))
            )
            grids[media.modality].append(thw)
            owners[media.modality].append(si)
        rows.append(ids)
        types.append(tt)
        runs.append(sruns)
    order = [("image", i) for i in range(len(pix["image"]))] + [
        ("video", i) for i in range(len(pix["video"]))
    ]
    if swap is not None:
        (ma, ia), (mb, ib) = order[swap[0]], order[swap[1]]
        if ma != mb:
            raise ValueError("swap exchanges two items of one modality")
        for d in (pix[ma], grids[ma], owners[ma]):
            d[ia], d[ib] = d[ib], d[ia]
    input_ids, attention_mask = right_pad(rows, PAD_ID)
    mm_types, _ = right_pad(types, 0)
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "mm_token_type_ids": mm_types,
    }
    if pix["image"]:
        kwargs["pixel_values"] = torch.cat(pix["image"])
        kwargs["image_grid_thw"] = torch.tensor(grids["image"], dtype=torch.long)
    if pix["video"]:
        kwargs["pixel_values_videos"] = torch.cat(pix["video"])
        kwargs["video_grid_thw"] = torch.tensor(grids["video"], dtype=torch.long)
    items = [(owners[m][i], m, math.prod(grids[m][i]) // MERGE**2) for m, i in order]
    return FamilyBatch(kwargs=kwargs, items=items, runs=runs, lengths=[len(r) for r in rows])
