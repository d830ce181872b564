"""Tiny random transformers VLMs that no written family spec names, and batches for them, for
the derived families (``families/derived.py``; tests and benchmarks only).

One :class:`Case` per class: ``build()`` a tiny random model (default special token ids,
vision depth 1, hidden 32-64, 1-2 text layers), ``item(modality, size, gen)`` one media item's
forward inputs, ``collate(items)`` the call's media keywords from ``(sample, modality, inputs)``
in prompt order. :func:`make_batch` lays each item's runs in the ids from the model's *own*
feature method on that item alone (one run per element / row of its output: an image, a tile,
a clip), with one text token between runs (a tile separator) and text around items;
``Media(..., tokens=n)`` gives the item ``n`` placeholders in all (its last run absorbs the
difference), ``swap=(modality, i, j)`` exchanges two items' inputs, the ids unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .families.base import FamilyBatch, Media, right_pad, rng

TEXT_LO, TEXT_HI = 1000, 1900
TXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
CLIP = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=16,
    patch_size=4,
)


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], torch.nn.Module]
    item: Callable[[str, tuple, torch.Generator], dict]
    collate: Callable[[list[tuple[int, str, dict]]], dict]
    sizes: Mapping[str, tuple[tuple, ...]]  # per modality: sizes; two of different counts
    attr: Mapping[str, str] = field(default_factory=dict)  # output attribute if not pooler


def _cat(key: str, dim: int = 0):
    def collate(items):
        return {key: torch.cat([kw[key] for _, _, kw in items], dim)} if items else {}

    return collate


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


def _seed(make: Callable[[], Any], cls: str) -> Callable[[], torch.nn.Module]:
    def build():
        import transformers

        torch.manual_seed(0)
        return getattr(transformers, cls)(make()).float().eval()

    return build


# ---- the classes ------------------------------------------------------------------------


def _llava():
    from transformers import LlavaConfig

    return LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", **CLIP),
        text_config=dict(model_type="llama", **TXT, vocab_size=32064),
    )


def _paligemma():
    from transformers import PaliGemmaConfig

    return PaliGemmaConfig(
        vision_config=dict(model_type="siglip_vision_model", **CLIP, projection_dim=32),
        text_config=dict(model_type="gemma", **TXT, vocab_size=257216),
        projection_dim=32,
    )


def _llava_next():
    from transformers import LlavaNextConfig

    return LlavaNextConfig(
        vision_config=dict(model_type="clip_vision_model", **CLIP),
        text_config=dict(model_type="llama", **TXT, vocab_size=32064),
        image_grid_pinpoints=[[16, 16], [16, 32], [32, 16], [32, 32]],
    )


def _llava_next_item(m, size, g):
    h, w = size  # pixels; tiles: the best pinpoint's + the base tile
    tiles = (h // 16) * (w // 16) + 1
    pv = torch.zeros(1, 5, 3, 16, 16)
    pv[0, :tiles] = torch.randn(tiles, 3, 16, 16, generator=g)
    return {"pixel_values": pv, "image_sizes": torch.tensor([[h, w]])}


def _aya():
    from transformers import AyaVisionConfig

    return AyaVisionConfig(
        vision_config=dict(model_type="siglip_vision_model", **CLIP),
        text_config=dict(model_type="cohere2", **TXT),
        downsample_factor=2,
    )


def _cohere2_vision():
    from transformers import Cohere2VisionConfig

    return Cohere2VisionConfig(
        vision_config=dict(model_type="siglip_vision_model", **CLIP),
        text_config=dict(model_type="cohere2", **TXT),
        downsample_factor=2,
    )


def _tiles(m, size, g):  # size: (tiles,) of 16 x 16
    return {"pixel_values": torch.randn(size[0], 3, 16, 16, generator=g)}


def _idefics3(cls: str):
    import transformers

    def make():
        return getattr(transformers, cls)(
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=16,
                patch_size=4,
            ),
            text_config=dict(model_type="llama", **TXT, vocab_size=128260),
            scale_factor=2,
        )

    return make


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


def _llama4():
    from transformers import Llama4Config

    return Llama4Config(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=4,
            vision_output_dim=32,
            projector_input_dim=32,
            projector_output_dim=32,
            pixel_shuffle_ratio=0.5,
        ),
        text_config=dict(
            hidden_size=32,
            intermediate_size=64,
            intermediate_size_mlp=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=2,
            moe_layers=[],
        ),
    )


def _gemma4():
    from transformers import Gemma4Config

    return Gemma4Config(
        text_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            global_head_dim=8,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=262144,
            layer_types=None,
            sliding_window=16,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
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
    )


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


def _qwen_omni():
    from transformers import Qwen2_5OmniThinkerConfig

    return Qwen2_5OmniThinkerConfig(  # the checkpoints' thinker configs set vision_start
        vision_start_token_id=151652,
        text_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2], rope_theta=10000.0),
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
    )


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


CASES: tuple[Case, ...] = (
    Case(
        "llava",
        _seed(_llava, "LlavaForConditionalGeneration"),
        _pixels(3, 16, 16),
        stack("pixel_values"),
        {"image": ((1,),)},
    ),
    Case(
        "paligemma",
        _seed(_paligemma, "PaliGemmaForConditionalGeneration"),
        _pixels(3, 16, 16),
        stack("pixel_values"),
        {"image": ((1,),)},
    ),
    Case(
        "llava_next",
        _seed(_llava_next, "LlavaNextForConditionalGeneration"),
        _llava_next_item,
        stack("pixel_values", "image_sizes"),
        {"image": ((16, 16), (16, 32))},
    ),
    Case(
        "aya_vision",
        _seed(_aya, "AyaVisionForConditionalGeneration"),
        _tiles,
        stack("pixel_values"),
        {"image": ((2,), (3,))},
    ),
    Case(
        "cohere2_vision",
        _seed(_cohere2_vision, "Cohere2VisionForConditionalGeneration"),
        _tiles,
        stack("pixel_values"),
        {"image": ((1,), (2,))},
    ),
    Case(
        "idefics3",
        _seed(_idefics3("Idefics3Config"), "Idefics3ForConditionalGeneration"),
        _tiles,
        _per_sample_tiles,
        {"image": ((2,), (3,))},
    ),
    Case(
        "smolvlm",
        _seed(_idefics3("SmolVLMConfig"), "SmolVLMForConditionalGeneration"),
        _tiles,
        _per_sample_tiles,
        {"image": ((1,), (2,))},
    ),
    Case(
        "llama4",
        _seed(_llama4, "Llama4ForConditionalGeneration"),
        _tiles,
        stack("pixel_values"),
        {"image": ((1,), (2,))},
        attr={"image": "last_hidden_state"},
    ),
    Case(
        "gemma4",
        _seed(_gemma4, "Gemma4ForConditionalGeneration"),
        _gemma4_item,
        by_modality(
            image=stack("pixel_values", "image_position_ids"),
            video=stack("pixel_values_videos", "video_position_ids", "num_frames_per_video"),
            audio=stack("input_features", "input_features_mask"),
        ),
        {"image": ((2, 4), (4, 4)), "video": ((2, 2, 2), (2, 2, 4)), "audio": ((24,), (40,))},
    ),
    Case(
        "qwen2_5_omni",
        _seed(_qwen_omni, "Qwen2_5OmniThinkerForConditionalGeneration"),
        _qwen_omni_item,
        by_modality(
            image=stack("pixel_values", "image_grid_thw"),
            video=stack("pixel_values_videos", "video_grid_thw", "video_second_per_grid"),
            audio=stack("input_features", "feature_attention_mask"),
        ),
        {"image": ((1, 2, 4), (1, 4, 4)), "video": ((2, 2, 2), (2, 2, 4)), "audio": ((24,), (40,))},
        attr={"audio": "last_hidden_state"},
    ),
)


# ---- batches ------------------------------------------------------------------------------


def owner(model):
    return model.model if hasattr(model, "model") else model


def own_runs(case: Case, model, modality: str, inputs: dict) -> list[int]:
    """The lengths of one item's runs, from the model's own feature method on it alone."""
    kw = case.collate([(0, modality, inputs)])
    o = owner(model)
    fn = getattr(o, f"get_{modality}_features")
    names = inspect.signature(fn).parameters
    with torch.no_grad():
        out = fn(**{k: v for k, v in kw.items() if k in names}, return_dict=True)
    feats = getattr(out, case.attr.get(modality, "pooler_output"))
    if isinstance(feats, (list, tuple)):
        return [int(f.reshape(-1, f.shape[-1]).shape[0]) for f in feats]
    if feats.dim() == 3 and getattr(out, "attention_mask", None) is not None:
        return [int(out.attention_mask.sum())]
    if feats.dim() == 3:
        return [int(feats.shape[1])] * int(feats.shape[0])
    return [int(feats.shape[0])]


def placeholder(model, modality: str) -> int:
    cfg = model.config
    return int(
        getattr(cfg, f"{modality}_token_id", None) or getattr(cfg, f"{modality}_token_index")
    )


def make_batch(
    case: Case,
    model,
    samples: Sequence[Sequence[Media]],
    *,
    swap: tuple[str, int, int] | None = None,
    seed: int = 0,
) -> FamilyBatch:
    """Ids and media inputs (module docstring); ``batch.items``: (sample, modality, count)."""
    rows, runs, media, items = [], [], [], []
    for s, sample in enumerate(samples):
        g = rng(seed, [(m.modality, m.size) for m in sample])  # the same whatever else
        row = torch.randint(TEXT_LO, TEXT_HI, (4,), generator=g).tolist()
        sruns = []
        for m in sample:
            inputs = case.item(m.modality, m.size, g)
            lens = own_runs(case, model, m.modality, inputs)
            if m.tokens is not None:
                lens[-1] += m.tokens - sum(lens)
            ph = placeholder(model, m.modality)
            for n in lens:
                row += [ph] * n + torch.randint(TEXT_LO, TEXT_HI, (1,), generator=g).tolist()
            row += torch.randint(TEXT_LO, TEXT_HI, (3,), generator=g).tolist()
            sruns += [(m.modality, n) for n in lens]
            media.append([s, m.modality, inputs])
            items.append((s, m.modality, sum(lens)))
        rows.append(row)
        runs.append(sruns)
    if swap is not None:
        mod, i, j = swap
        idx = [k for k, it in enumerate(media) if it[1] == mod]
        a, b = idx[i], idx[j]
        media[a][2], media[b][2] = media[b][2], media[a][2]
    ids, attn = right_pad(rows, TEXT_LO)
    kwargs = {"input_ids": ids, "attention_mask": attn}
    kwargs.update(case.collate([tuple(x) for x in media]))
    if "token_type_ids" in inspect.signature(model.forward).parameters:
        kwargs["token_type_ids"] = torch.zeros_like(ids)
    return FamilyBatch(kwargs, items, runs, [len(r) for r in rows])


def hidden(model, kwargs: dict) -> torch.Tensor:
    """The decoder's last hidden states of one forward (no logits over the vocabulary)."""
    seen = []
    dec = model.get_decoder()
    dec = getattr(dec, "model", dec)  # Llama 4's decoder is a ...ForCausalLM
    hook = dec.register_forward_hook(lambda m, a, o: seen.append(o[0]))
    keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    extra = {"logits_to_keep": 1} if keep and "labels" not in kwargs else {}
    try:
        with torch.no_grad():
            model(**kwargs, **extra)
    except AttributeError as e:  # Llama 4 (5.24): its output fails after the decoder ran
        if not seen or "image_outputs" not in str(e):
            raise
    finally:
        hook.remove()
    return seen[-1]


CASE = {c.name: c for c in CASES}

__all__ = ["CASE", "CASES", "Case", "hidden", "make_batch", "own_runs"]
