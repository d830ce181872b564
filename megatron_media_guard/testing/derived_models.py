"""Tiny random transformers VLMs that no written family spec names, for the derived families
(``families/derived.py``; tests and benchmarks only; batches: ``derived_batch.py``).

One :class:`Case` per class: ``build()`` a tiny random model (default special token ids,
vision depth 1-2, hidden 32, 1-2 text layers), ``item(modality, size, gen)`` one media item's
forward inputs, ``collate(items)`` the call's media keywords from ``(sample, modality, inputs)``
in prompt order, ``sizes`` per modality a small and a large item, ``attr`` the output attribute
the forward reads where it is not ``pooler_output``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
TXT = dict(SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
CLIP = dict(SMALL, num_attention_heads=2, image_size=16, patch_size=4)
HEAD = dict(num_attention_heads=2, num_key_value_heads=2, head_dim=16)


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], torch.nn.Module]
    item: Callable[[str, tuple, torch.Generator], dict]
    collate: Callable[[list[tuple[int, str, dict]]], dict]
    sizes: Mapping[str, tuple[tuple, ...]]  # per modality: sizes; two of different counts
    attr: Mapping[str, str] = field(default_factory=dict)  # output attribute if not pooler


def by_modality(**per: Callable) -> Callable:
    """collate: each modality's items through its own collate, merged."""

    def collate(items):
        out: dict = {}
        for m, fn in per.items():
            out.update(fn([it for it in items if it[1] == m]))
        return out

    return collate


def stack(*keys: str) -> Callable:
    def collate(items):
        return {k: torch.cat([kw[k] for _, _, kw in items]) for k in keys} if items else {}

    return collate


def _pixels(*shape: int) -> Callable:
    def item(m, size, g):
        return {"pixel_values": torch.randn(1, *shape, generator=g)}

    return item


def _tiny(prefix: str, **config: Any) -> Callable[[], torch.nn.Module]:
    """``<prefix>ForConditionalGeneration(<prefix>Config(**config))``, seeded, float32, eval;
    the projector's weights drawn at unit scale (transformers' init makes some features ~1e-7)."""

    def build():
        import transformers

        torch.manual_seed(0)
        cfg = getattr(transformers, f"{prefix}Config")(**config)
        model = getattr(transformers, f"{prefix}ForConditionalGeneration")(cfg).float().eval()
        with torch.no_grad():  # features at the embeddings' scale, so a misplaced one shows
            for name, p in model.named_parameters():
                if "multi_modal_projector" in name and p.dim() == 2:
                    p.normal_(0.0, p.shape[1] ** -0.5)
        return model

    return build


# ---- the classes ------------------------------------------------------------------------


def _llava_next_item(m, size, g):
    h, w = size  # pixels; tiles: the best pinpoint's + the base tile
    tiles = (h // 16) * (w // 16) + 1
    pv = torch.zeros(1, 5, 3, 16, 16)
    pv[0, :tiles] = torch.randn(tiles, 3, 16, 16, generator=g)
    return {"pixel_values": pv, "image_sizes": torch.tensor([[h, w]])}


def _tiles(m, size, g):  # size: (tiles,) of 16 x 16
    return {"pixel_values": torch.randn(size[0], 3, 16, 16, generator=g)}


def _per_sample_tiles(items):
    """Idefics3 / SmolVLM: ``pixel_values [b, max_images, 3, S, S]``, zero images as padding."""
    if not items:
        return {}
    b = max(s for s, _, _ in items) + 1
    per = [[kw["pixel_values"] for s2, _, kw in items if s2 == s] for s in range(b)]
    per = [torch.cat(p) if p else torch.zeros(0, 3, 16, 16) for p in per]
    n = max(p.shape[0] for p in per)
    pv = torch.zeros(b, n, 3, 16, 16)
    for s, p in enumerate(per):
        pv[s, : p.shape[0]] = p
    return {"pixel_values": pv}


def _gemma4_patches(h: int, w: int, g, pad: int = 64):
    """(patch rows [pad, 3*4*4], positions [pad, 2] (x, y), -1 padding) of an h x w grid."""
    pv = torch.zeros(pad, 48)
    pos = torch.full((pad, 2), -1, dtype=torch.long)
    pv[: h * w] = torch.randn(h * w, 48, generator=g)
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    pos[: h * w] = torch.stack([xs.flatten(), ys.flatten()], -1)
    return pv, pos


def _gemma4_item(m, size, g):
    if m == "image":
        pv, pos = _gemma4_patches(*size, g)
        return {"pixel_values": pv[None], "image_position_ids": pos[None]}
    if m == "video":  # size: (frames, h, w)
        f, h, w = size
        pv, pos = zip(*[_gemma4_patches(h, w, g) for _ in range(f)])
        return {
            "pixel_values_videos": torch.stack(pv),
            "video_position_ids": torch.stack(pos),
            "num_frames_per_video": torch.tensor([f]),
        }
    (t,) = size  # audio: mel frames, padded to 48
    x = torch.zeros(1, 48, 128)
    x[0, :t] = torch.randn(t, 128, generator=g)
    mask = torch.zeros(1, 48, dtype=torch.bool)
    mask[0, :t] = True
    return {"input_features": x, "input_features_mask": mask}


def _qwen_omni_item(m, size, g):
    if m in ("image", "video"):
        t, h, w = size  # grid (t, h, w) in patches; rows of 3 * 2 * 4 * 4
        key = "pixel_values" if m == "image" else "pixel_values_videos"
        grid = "image_grid_thw" if m == "image" else "video_grid_thw"
        out = {key: torch.randn(t * h * w, 96, generator=g), grid: torch.tensor([[t, h, w]])}
        if m == "video":
            out["video_second_per_grid"] = torch.tensor([1.0])
        return out
    (t,) = size
    x = torch.zeros(1, 16, 64)
    x[0, :, :t] = torch.randn(16, t, generator=g)
    mask = torch.zeros(1, 64, dtype=torch.long)
    mask[0, :t] = 1
    return {"input_features": x, "feature_attention_mask": mask}


def _molmo2_item(m, size, g):
    """size: (crops,) of 2 x 2 patches of 14 px; each crop pooled 2 patches per token."""
    (c,) = size
    return {
        "pixel_values": torch.randn(c, 4, 588, generator=g),
        "image_token_pooling": torch.arange(4 * c).view(2 * c, 2),
        "image_grids": torch.tensor([[1, c, 1, c]]),
    }


def _molmo2_collate(items):
    """Pooling indices point into the call's flat patches: each item's offset by those before."""
    if not items:
        return {}
    out, at = stack("pixel_values", "image_grids")(items), 0
    pools = []
    for _, _, kw in items:
        pools.append(kw["image_token_pooling"] + at)
        at += kw["pixel_values"].shape[0] * 4
    return {**out, "image_token_pooling": torch.cat(pools)}


CASES: tuple[Case, ...] = (
    Case(
        "llava",
        _tiny(
            "Llava",
            vision_config=dict(CLIP, model_type="clip_vision_model"),
            text_config=dict(TXT, model_type="llama", vocab_size=32064),
        ),
        _pixels(3, 16, 16),
        stack("pixel_values"),
        {"image": ((1,),)},
    ),
    Case(
        "paligemma",
        _tiny(
            "PaliGemma",
            vision_config=dict(CLIP, model_type="siglip_vision_model", projection_dim=32),
            text_config=dict(TXT, model_type="gemma", vocab_size=257216),
            projection_dim=32,
        ),
        _pixels(3, 16, 16),
        stack("pixel_values"),
        {"image": ((1,),)},
    ),
    Case(
        "llava_next",
        _tiny(
            "LlavaNext",
            vision_config=dict(CLIP, model_type="clip_vision_model"),
            text_config=dict(TXT, model_type="llama", vocab_size=32064),
            image_grid_pinpoints=[[16, 16], [16, 32], [32, 16], [32, 32]],
        ),
        _llava_next_item,
        stack("pixel_values", "image_sizes"),
        {"image": ((16, 16), (16, 32))},
    ),
    Case(
        "aya_vision",
        _tiny(
            "AyaVision",
            vision_config=dict(CLIP, model_type="siglip_vision_model"),
            text_config=dict(TXT, model_type="cohere2"),
            downsample_factor=2,
        ),
        _tiles,
        stack("pixel_values"),
        {"image": ((2,), (3,))},
    ),
    Case(
        "cohere2_vision",
        _tiny(
            "Cohere2Vision",
            vision_config=dict(CLIP, model_type="siglip_vision_model"),
            text_config=dict(TXT, model_type="cohere2"),
            downsample_factor=2,
        ),
        _tiles,
        stack("pixel_values"),
        {"image": ((1,), (2,))},
    ),
    Case(
        "idefics3",
        _tiny(
            "Idefics3",
            vision_config=dict(CLIP),
            scale_factor=2,
            text_config=dict(TXT, model_type="llama", vocab_size=128260),
        ),
        _tiles,
        _per_sample_tiles,
        {"image": ((2,), (3,))},
    ),
    Case(
        "smolvlm",
        _tiny(
            "SmolVLM",
            vision_config=dict(CLIP),
            scale_factor=2,
            text_config=dict(TXT, model_type="llama", vocab_size=128260),
        ),
        _tiles,
        _per_sample_tiles,
        {"image": ((1,), (2,))},
    ),
    Case(  # pixel shuffle 0.5: 4 x 32 channels into the adapter's MLP
        "llama4",
        _tiny(
            "Llama4",
            vision_config=dict(
                CLIP,
                intermediate_size=128,
                vision_output_dim=32,
                projector_input_dim=32,
                projector_output_dim=32,
                pixel_shuffle_ratio=0.5,
            ),
            text_config=dict(TXT, intermediate_size_mlp=64, num_local_experts=2, moe_layers=[]),
        ),
        _tiles,
        stack("pixel_values"),
        {"image": ((1,), (2,))},
        attr={"image": "last_hidden_state"},
    ),
    Case(  # per-layer inputs (8 per layer), vision pooled 2 x 2, audio subsampled 4x
        "gemma4",
        _tiny(
            "Gemma4",
            text_config=dict(
                TXT,
                num_hidden_layers=2,
                global_head_dim=8,
                hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=262144,
                layer_types=None,
                sliding_window=16,
            ),
            vision_config=dict(
                SMALL,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=16,
                patch_size=4,
                pooling_kernel_size=2,
                position_embedding_size=64,
            ),
            audio_config=dict(
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                subsampling_conv_channels=[128, 4],
                output_proj_dims=32,
                attention_chunk_size=4,
                attention_context_left=5,
            ),
        ),
        _gemma4_item,
        by_modality(
            image=stack("pixel_values", "image_position_ids"),
            video=stack("pixel_values_videos", "video_position_ids", "num_frames_per_video"),
            audio=stack("input_features", "input_features_mask"),
        ),
        {"image": ((2, 4), (4, 4)), "video": ((2, 2, 2), (2, 2, 4)), "audio": ((24,), (40,))},
    ),
    Case(  # the checkpoints' thinker configs set vision_start (its rope reads it)
        "qwen2_5_omni",
        _tiny(
            "Qwen2_5OmniThinker",
            vision_start_token_id=151652,
            text_config=dict(
                SMALL,
                num_attention_heads=4,
                num_key_value_heads=2,
                rope_parameters=dict(
                    rope_type="default", mrope_section=[1, 1, 2], rope_theta=10000.0
                ),
            ),
            vision_config=dict(
                depth=1,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=32,
                fullatt_block_indexes=[0],
                patch_size=4,
                window_size=16,
            ),
            audio_config=dict(
                d_model=32,
                encoder_layers=1,
                encoder_attention_heads=2,
                encoder_ffn_dim=64,
                output_dim=32,
                num_mel_bins=16,
                n_window=8,
                max_source_positions=64,
            ),
        ),
        _qwen_omni_item,
        by_modality(
            image=stack("pixel_values", "image_grid_thw"),
            video=stack("pixel_values_videos", "video_grid_thw", "video_second_per_grid"),
            audio=stack("input_features", "feature_attention_mask"),
        ),
        {"image": ((1, 2, 4), (1, 4, 4)), "video": ((2, 2, 2), (2, 2, 4)), "audio": ((24,), (40,))},
        attr={"audio": "last_hidden_state"},
    ),
    Case(  # adds its features onto the placeholder embeddings; video shares the image token
        "molmo2",
        _tiny(
            "Molmo2",
            vision_config=dict(
                SMALL,
                num_hidden_layers=2,
                image_size=[28, 28],
                patch_size=14,
                num_position_embeddings=4,
                **HEAD,
            ),
            adapter_config=dict(SMALL, vision_feature_layer=[-1, -2], text_hidden_size=32, **HEAD),
            text_config=dict(TXT, vocab_size=152064),
        ),
        _molmo2_item,
        _molmo2_collate,
        {"image": ((1,), (2,))},
    ),
)

CASE = {c.name: c for c in CASES}

__all__ = ["CASE", "CASES", "Case", "by_modality", "stack"]
