"""Qwen3-Omni thinker (transformers ``Qwen3OmniMoeThinkerForConditionalGeneration`` / ``...Model``;
grammar and counts: docs/FAMILIES.md; audio in video: ``audio_in_video.py``). The kept items'
own encoder outputs go back in as ``mm_encoder_outputs`` (deepstack); grids, seconds per grid
and ``feature_attention_mask`` stay (dropped rows out) for the model's ``get_rope_index``; set
``config.vision_start_token_id`` (151652; the config lacks it). Bridge: ``qwen3_omni_bridge.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import MediaInputError
from . import audio_in_video as aiv
from .common import PAD
from .mrope import patch_dummy
from .qwen import grid_counts
from .spec import Encoded, FamilySpec, ModalitySpec, Token, count_table, tower_zeros

_AUDIO = ("input_features", "feature_attention_mask", "audio_feature_lengths")


def _visual(kind: str):
    def encode(model: Any, kw) -> Encoded:
        pv, grid = kw[f"pixel_values{'_videos' if kind == 'video' else ''}"], kw[f"{kind}_grid_thw"]
        out = getattr(model, f"get_{kind}_features")(pv, grid, return_dict=True)
        feats = tuple(out.pooler_output)
        if not kw.get("use_audio_in_video"):
            return Encoded(feats, output=out)
        got = aiv.layout(model, kw)  # a video: cut into its region's runs
        return Encoded(feats, output=out, runs=got.runs.get(kind), sample=got.sample[kind])

    return encode


def _encode_audio(model: Any, kw) -> Encoded:
    """The clips back to back, cut by their counts (and runs) after the verdict."""
    x, mask, lengths = (kw.get(n) for n in _AUDIO)
    flat = model.get_audio_features(x, mask, lengths, return_dict=True).last_hidden_state
    got = aiv.layout(model, kw)
    runs, sample = got.runs.get("audio"), got.sample.get("audio")
    return Encoded((flat,), counts=got.tokens, runs=runs, sample=sample, check=got.check)


def audio_counts(config: Any, kw) -> torch.Tensor:
    """Per clip its :func:`~.audio_in_video.clip_tokens` (transformers' and Bridge's spec);
    ``use_audio_in_video`` refused."""
    if kw.get("use_audio_in_video"):
        raise MediaInputError(
            "qwen3_omni: use_audio_in_video=True interleaves video and audio placeholders in "
            "one region; the inputs alone do not attribute those runs (check it in the model: "
            "install_vlm)"
        )
    return count_table(aiv.clip_tokens(config, kw))


def _reuse(model: Any, encoded, kept) -> dict:
    """The kept images' / videos' own encoder outputs (deepstack) as ``mm_encoder_outputs``."""
    mm = {}
    for kind in ("image", "video"):
        keep, o = kept.get(kind), getattr(encoded.get(kind), "output", None)
        if keep and o is not None:
            mm[kind] = type(o)(
                pooler_output=tuple(o.pooler_output[k] for k in keep),
                deepstack_features=[tuple(x[k] for k in keep) for x in o.deepstack_features],
            )
    return {"mm_encoder_outputs": mm} if mm else {}


def _positions(model: Any, kw) -> torch.Tensor | None:
    """The model's own MRoPE positions on the (rewritten) ids and kept grids (None without an
    attention mask); a dropped run's start marker reads as the text after it, as the rope needs."""
    ids, attn = kw["input_ids"], kw.get("attention_mask")
    if attn is None:
        return None
    inner, cfg = getattr(model, "model", model), model.config
    pads = [cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id, cfg.audio_start_token_id]
    pads = torch.tensor(pads, device=ids.device)
    nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    starts = (ids == cfg.audio_start_token_id) | (ids == cfg.vision_start_token_id)
    ids = torch.where(starts & ~torch.isin(nxt, pads), nxt, ids)
    mask = kw.get("feature_attention_mask")
    grids = kw.get("image_grid_thw"), kw.get("video_grid_thw")
    lens = mask.sum(1) if mask is not None else None
    spg, flag = kw.get("video_second_per_grid"), bool(kw.get("use_audio_in_video"))
    pos, deltas = inner.get_rope_index(ids, *grids, attn, flag, lens, spg)
    inner.rope_deltas = deltas  # as the model's own forward leaves it, for decoding
    return pos


def _dummy(model: Any):  # both towers: a patch image (deepstack kept) and one audio chunk
    a = model.config.audio_config
    mel = tower_zeros(model, "audio_tower", 1, a.num_mel_bins, 2 * a.n_window)
    mask = torch.ones(mel.shape[::2], dtype=torch.long, device=mel.device)
    return patch_dummy("visual")(model), model.get_audio_features(mel, mask, return_dict=True)


# vision start from the config only: the model's own rope reads config.vision_start_token_id
_VISION = dict(start=Token(("vision_start_token_id",)), end=Token((), "<|vision_end|>"))
_VIDEO = ("pixel_values_videos", "video_grid_thw", "video_second_per_grid", "use_audio_in_video")

SPEC = FamilySpec(
    name="qwen3_omni",
    classes={
        "transformers.": frozenset(
            {"Qwen3OmniMoeThinkerForConditionalGeneration", "Qwen3OmniMoeThinkerModel"}
        ),
    },
    modalities=(
        ModalitySpec(
            "audio",
            Token(("audio_token_id",), "<|audio_pad|>"),
            _AUDIO,
            _encode_audio,
            start=Token(("audio_start_token_id",), "<|audio_start|>"),
            end=Token((), "<|audio_end|>"),
            keep=_AUDIO[1:],
            rows=_AUDIO,
            counts=audio_counts,
            nests=True,  # audio in video: right inside the video's vision region
        ),
        ModalitySpec(
            "image",
            Token(("image_token_id",), "<|image_pad|>"),
            ("pixel_values", "image_grid_thw"),
            _visual("image"),
            keep=("image_grid_thw",),
            rows=("image_grid_thw",),
            patches={"pixel_values": "image_grid_thw"},
            counts=grid_counts("image"),
            **_VISION,
        ),
        ModalitySpec(
            "video",
            Token(("video_token_id",), "<|video_pad|>"),
            _VIDEO,
            _visual("video"),
            keep=_VIDEO[1:],
            rows=_VIDEO[1:3],
            patches={"pixel_values_videos": "video_grid_thw"},
            counts=grid_counts("video", per_group=False),
            **_VISION,
        ),
    ),
    text=Token(PAD, "<|endoftext|>", 151643),
    positions=_positions,
    reuse=_reuse,
    dummy=_dummy,
    drop_markers=True,  # its rope pairs each audio start with the next clip's length
)
