"""Nemotron 3 Nano Omni (transformers ``NemotronH_Omni_Reasoning_V3``): a tiny random model and
batches laid out as ``NemotronH_Omni_Reasoning_V3Processor`` lays them out.

No tokenizer runs offline, and the image processor imports torchvision (no CPU build here), so
the ids are built from this module's marker ids and the processor's own arithmetic:

- image ``size=(gh, gw)``: the patch grid (both even), as ``image_grid_hw`` holds it;
  ``<img>`` ``<image>``x(gh*gw/4) ``</img>``; ``pixel_values`` ``[sum gh*gw, 3*16*16]`` float32,
  made by the image processor's own ``convert_image_to_patches`` (row-major patches,
  channel-major, read from the installed source file, see :func:`processor_functions`);
  :func:`image_grid` gives the grid the processor picks for a pixel size.
- video ``size=(frames, gh, gw)``: ``ceil(frames/2)`` tubelets of a ``16gh x 16gw`` frame; one
  ``<img>`` ``<image>``x(gh*gw/4) ``</img>`` run per tubelet on the *image* token, each after the
  processor's "Frame k sampled at t seconds[ and frame k+1 sampled at t' seconds]: " label
  (2 fps), runs joined by "\\n"; ``pixel_values_videos`` ``[V, T, 2*3, H, W]`` stacked (every
  video of a batch must share ``(T, H, W)``; the last tubelet repeats the last frame).
- audio ``size=(L,)``: L real mel frames; ``<so_start>`` ``<so_embedding>``xN ``<so_end>`` with
  N = ``audio_tower._get_subsampling_output_length(L + 1)``; ``input_features``
  ``[clips, max L + 1, mel]`` float32 (zero past L, as the Parakeet feature extractor pads) and
  ``input_features_mask`` ``[clips, max L + 1]`` bool (True on the first L frames).

Text (random ids and the video labels, one id per character) uses ids >= ``TEXT_LO``.
Marker ids chosen in the tiny vocabulary (the config has none by default; the real ones come
from the tokenizer): see the constants below; ``config.image_token_id`` = ``IMAGE``,
``config.audio_token_id`` = ``SO_EMBED``, ``config.video_token_id`` stays None (forward never
reads it: video runs use the image token).

Items are consumed images first (batch order), then videos, then audio clips;
``FamilyBatch.items`` gives each the sample of its run and the count its (possibly swapped)
inputs give.
``Media.tokens`` for a video is its total over all tubelet runs, the difference put on its
last run.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_media_guard.errors import MediaInputError
from megatron_media_guard.testing.families.base import FamilyBatch, Media, right_pad

FAMILY = "nemotron_omni"

PAD, BOS = 0, 1
IMG_START, IMG_END, IMAGE = 3, 4, 5  # <img>, </img>, <image>
SO_START, SO_END, SO_EMBED = 6, 7, 8  # <so_start>, <so_end>, <so_embedding>
TEXT_LO, VOCAB = 16, 128
PATCH, MERGE, TEMPORAL, MEL = 16, 2, 2, 16
FPS = 2.0


def tiny_config(**overrides: Any):
    """Tiny random config: text 3 layers (mamba, attention, mlp; hidden 32), RADIO depth 1
    (hidden 32), Parakeet depth 1 (hidden 32, 16 mel bins, subsampling 8)."""
    from transformers import NemotronH_Omni_Reasoning_V3_Config

    kwargs: dict[str, Any] = dict(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=32,
            layer_types=["linear_attention", "full_attention", "mlp"],
            num_hidden_layers=None,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=64,
            ssm_state_size=8,
            mamba_num_heads=4,
            mamba_head_dim=16,
            n_groups=1,
            chunk_size=16,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=2,
        ),
        vision_config=dict(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_img_size=256,
            video_temporal_patch_size=TEMPORAL,
            num_registers=1,
            num_cls_tokens=2,
        ),
        audio_config=dict(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            num_mel_bins=MEL,
            subsampling_conv_channels=8,
            conv_kernel_size=3,
            projection_hidden_size=32,
            projection_bias=False,
        ),
        projector_hidden_size=32,
        vision_hidden_size=32,
        image_token_id=IMAGE,
        audio_token_id=SO_EMBED,
    )
    kwargs.update(overrides)
    return NemotronH_Omni_Reasoning_V3_Config(**kwargs)


def tiny_model(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """``NemotronH_Omni_Reasoning_V3`` (the class is its own ForConditionalGeneration), eval,
    float32; ``overrides`` go to the top-level config (e.g. ``video_pruning_rate=0.5``)."""
    from transformers import NemotronH_Omni_Reasoning_V3

    torch.manual_seed(seed)
    model = NemotronH_Omni_Reasoning_V3(tiny_config(**overrides)).float().eval()
    # the default init (std 0.02) makes projected features ~5e-3: too faint to tell a sample's
    # logits from another's at atol 1e-5; unit-scale projections make every feature count
    with torch.no_grad():
        for proj in (model.multi_modal_projector, model.embed_audio):
            for lin in (proj.linear_1, proj.linear_2):
                lin.weight.normal_(0.0, lin.in_features**-0.5)
    return model


_FUNCS: dict[str, Any] = {}


def processor_functions() -> dict[str, Any]:
    """``get_patch_grid_size`` and ``convert_image_to_patches`` of the installed
    ``image_processing_nemotron_h_omni.py``, compiled from its source: the module imports
    torchvision at the top, the two functions need only ``math`` and ``torch``."""
    if not _FUNCS:
        name = "transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni"
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None
        tree = ast.parse(Path(spec.origin).read_text())
        wanted = {"get_patch_grid_size", "convert_image_to_patches"}
        body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
        ns: dict[str, Any] = {"math": math, "torch": torch}
        exec(compile(ast.Module(body=body, type_ignores=[]), spec.origin, "exec"), ns)
        _FUNCS.update({k: ns[k] for k in wanted})
    return _FUNCS


def image_grid(
    height: int,
    width: int,
    *,
    n_images: int = 1,
    min_num_patches: int = 1024,
    max_num_patches: int = 13312,
    max_model_len: int = 16384,
) -> tuple[int, int]:
    """The ``(gh, gw)`` the image processor picks for an ``H x W`` image in a call of
    ``n_images`` (its ``_preprocess`` budget, then ``get_patch_grid_size``)."""
    budget = max((max_model_len - 4) * MERGE**2, min_num_patches * n_images)
    if max_num_patches:
        budget = min(budget, max_num_patches)
    budget = max(budget, min_num_patches)
    grid = processor_functions()["get_patch_grid_size"]
    return grid(height, width, PATCH, MERGE, min_num_patches, budget)


def frame_label(tubelet: int, frames: int) -> str:
    """The processor's label before tubelet ``tubelet`` (``replace_video_token``, source fps
    ``FPS``, frames sampled at indices 0..frames-1)."""
    duration_ms = int(1000.0 / FPS)
    parts = []
    for off in range(TEMPORAL):
        k = tubelet * TEMPORAL + off
        if k >= frames:
            break
        prefix = "Frame" if off == 0 else "frame"
        parts.append(f"{prefix} {k + 1} sampled at {k * duration_ms / 1000.0:.2f} seconds")
    return " and ".join(parts) + ": "


def text_ids(text: str) -> list[int]:
    """One id per character (printable ASCII -> ``TEXT_LO`` + ord - 32)."""
    return [TEXT_LO + (ord(c) - 32) % (VOCAB - TEXT_LO) for c in text]


def _count(model, m: Media) -> int:
    if m.modality == "image":
        gh, gw = m.size
        if gh % MERGE or gw % MERGE:
            raise MediaInputError(f"image grid {m.size} must be even on both sides")
        return gh * gw // MERGE**2
    if m.modality == "video":
        frames, gh, gw = m.size
        return math.ceil(frames / TEMPORAL) * (gh * gw // MERGE**2)
    (length,) = m.size
    return int(model.audio_tower._get_subsampling_output_length(torch.tensor([length + 1]))[0])


def _sample_rng(sample: Sequence[Media], seed: int) -> torch.Generator:
    """Content depends on the seed and the sample's media (not on ``tokens`` or its position in
    the batch), so a sample alone and in a batch gets the same text and pixels."""
    key = repr((seed, [(m.modality, tuple(m.size)) for m in sample])).encode()
    return torch.Generator().manual_seed(zlib.crc32(key))


def make_batch(
    model,
    samples: Sequence[Sequence[Media]],
    *,
    text_len: int = 6,
    swap: tuple[int, int] | None = None,
    seed: int = 0,
) -> FamilyBatch:
    """Ids, pixels, audio and metadata of ``samples`` (module docstring: sizes and layout)."""
    to_patches = processor_functions()["convert_image_to_patches"]
    rows: list[list[int]] = []
    runs: list[list[tuple[str, int]]] = []
    found: dict[str, list[tuple[int, int, Any]]] = {"image": [], "video": [], "audio": []}
    for s, sample in enumerate(samples):
        g = _sample_rng(sample, seed)

        def text(n: int, g=g) -> list[int]:
            return torch.randint(TEXT_LO, VOCAB, (n,), generator=g).tolist()

        row, sruns = [BOS, *text(text_len)], []
        for m in sample:
            n = _count(model, m)
            k = n if m.tokens is None else m.tokens
            if m.modality == "image":
                gh, gw = m.size
                img = torch.randn(1, 3, gh * PATCH, gw * PATCH, generator=g)
                found["image"].append((s, n, (to_patches(img, PATCH)[0], (gh, gw))))
                row += [IMG_START, *[IMAGE] * k, IMG_END]
                sruns.append(("image", k))
            elif m.modality == "video":
                frames, gh, gw = m.size
                clip = torch.randn(frames, 3, gh * PATCH, gw * PATCH, generator=g)
                if pad := -frames % TEMPORAL:
                    clip = torch.cat([clip, clip[-1:].expand(pad, -1, -1, -1)])
                tubelets = clip.reshape(-1, TEMPORAL * 3, gh * PATCH, gw * PATCH)
                found["video"].append((s, n, tubelets))
                t, per = tubelets.shape[0], gh * gw // MERGE**2
                for i in range(t):
                    r = per + (k - n if i == t - 1 else 0)
                    row += [*(text_ids("\n") if i else []), *text_ids(frame_label(i, frames))]
                    row += [IMG_START, *[IMAGE] * r, IMG_END]
                    sruns.append(("video", r))
            elif m.modality == "audio":
                (length,) = m.size
                found["audio"].append((s, n, torch.randn(length, MEL, generator=g)))
                row += [SO_START, *[SO_EMBED] * k, SO_END]
                sruns.append(("audio", k))
            else:
                raise MediaInputError(f"unknown modality {m.modality!r}")
            row += text(text_len)
        rows.append(row)
        runs.append(sruns)

    order = [(mod, i) for mod in ("image", "video", "audio") for i in range(len(found[mod]))]
    counts = {mod: [n for _, n, _ in found[mod]] for mod in found}
    payload = {mod: [p for _, _, p in found[mod]] for mod in found}
    if swap is not None:
        (ma, a), (mb, b) = order[swap[0]], order[swap[1]]
        if ma != mb:
            raise MediaInputError(f"swap {swap}: items of different modality ({ma}, {mb})")
        for lst in (payload[ma], counts[ma]):
            lst[a], lst[b] = lst[b], lst[a]
    # items: the sample of the run, the count the (possibly swapped) inputs give
    items = [(found[mod][i][0], mod, counts[mod][i]) for mod, i in order]

    ids, attn = right_pad(rows, PAD)
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": attn}
    if payload["image"]:
        kwargs["pixel_values"] = torch.cat([p for p, _ in payload["image"]])
        kwargs["image_grid_hw"] = torch.tensor([hw for _, hw in payload["image"]], dtype=torch.long)
    if payload["video"]:
        shapes = {tuple(v.shape) for v in payload["video"]}
        if len(shapes) > 1:
            raise MediaInputError(f"videos of one batch must stack, got tubelet shapes {shapes}")
        kwargs["pixel_values_videos"] = torch.stack(payload["video"])
    if payload["audio"]:
        clips = payload["audio"]
        width = max(c.shape[0] for c in clips) + 1
        feats = torch.zeros(len(clips), width, MEL)
        mask = torch.zeros(len(clips), width, dtype=torch.bool)
        for i, c in enumerate(clips):
            feats[i, : c.shape[0]] = c
            mask[i, : c.shape[0]] = True
        kwargs["input_features"] = feats
        kwargs["input_features_mask"] = mask
    return FamilyBatch(kwargs=kwargs, items=items, runs=runs, lengths=[len(r) for r in rows])


def plain_logits(model, batch: FamilyBatch) -> torch.Tensor:
    """``model(**batch.kwargs).logits`` under no_grad."""
    with torch.no_grad():
        return model(**batch.kwargs).logits
