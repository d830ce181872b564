"""Test batches in Megatron-Bridge 0.6's Nemotron Omni data contract (written from its
``nemotron_omni/data/collate_fn.py``; no Bridge code is imported or copied).

What the collate hands the model, and megatron-core 0.19.2's ``LLaVAModel.forward`` passes to
``_preprocess_data``:

- positive token ids from the tokenizer: ``<img>`` / ``</img>`` around ONE image token
  (``img_context_token_id``) per image and per video tubelet ("<img><image></img>");
- dynamic-resolution images: ``num_image_tiles`` = per-image token counts
  ``(H/16/2) * (W/16/2)`` (patch 16, pixel shuffle 2; the forward recomputes them from
  ``imgs_sizes``), embeddings ``[sum, 1, h]``, ``is_packed_dynamic_res=True`` and the model's
  ``img_seq_len`` set to 1 by Bridge's provider;
- temporal video (``use_temporal_video_embedder``): a "This is a video:" line, then per group
  of ``temporal_patch_size`` frames a "Frame k sampled at t seconds: <img><image></img>"
  line; ``num_image_tiles`` entries of 1; embeddings ``[img_seq_len, tubelets, h]``
  (``img_seq_len`` 256 for the 512x512 canvas);
- sound: one ``<so_start>`` + N x ``<so_embedding>`` + ``<so_end>`` block per sample (after the
  last ``</img>``), N = the mel frames halved (rounding up) three times; the sound encoder
  returns ``sound_embeddings_len`` rows per clip, the forward passes ``[T, clips, h]``;
- in-batch packing: the compact rows concatenated into one ``[1, total]`` row; ``cu_seqlens_q``
  holds the rows' lengths after the model-side merge, ``cu_seqlens_q_padded`` the padded ones
  (each compact row followed by the padding gap).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

IMG_START, IMG_END, IMAGE, SO_START, SOUND, SO_END = 10, 11, 12, 13, 14, 15
PAD = 2
PATCH, SHUFFLE, FRAME, TEMPORAL = 16, 2, 512, 2  # TEMPORAL: frames per tubelet
VIDEO_TOKENS = (FRAME // PATCH // SHUFFLE) ** 2  # 256 embeddings per tubelet
H = 8  # hidden size


def image_tokens(height: int, width: int) -> int:
    return (height // PATCH // SHUFFLE) * (width // PATCH // SHUFFLE)


def sound_tokens(mel_frames: int) -> int:
    return max(1, -(-mel_frames // 8))  # halved, rounding up, three times


@dataclass
class Example:
    """One conversation: text lengths around its media, in order."""

    images: list[tuple[int, int]] = field(default_factory=list)
    video_frames: int = 0
    mel_frames: int = 0
    text: int = 6


#: three samples of dynamic-resolution images and a sound clip each (sample 1: two images)
IMAGES_SOUND = [
    Example(images=[(64, 96)], mel_frames=40),
    Example(images=[(96, 64), (64, 64)], mel_frames=24),
    Example(images=[(128, 64)], mel_frames=56),
]


@dataclass
class OmniBatch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    language_embeddings: torch.Tensor
    num_image_tiles: torch.Tensor
    image_embeddings: torch.Tensor
    sound_embeddings: torch.Tensor | None
    sound_embeddings_len: torch.Tensor | None
    dynamic: bool
    img_seq_len: int
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_q_padded: torch.Tensor | None = None
    rows: list[list[int]] = field(default_factory=list)
    position_ids: torch.Tensor | None = None

    def kwargs(self) -> dict:
        """The ``_preprocess_data`` arguments (keyword form of 0.19.2's signature)."""
        return dict(
            image_embeddings=self.image_embeddings,
            language_embeddings=self.language_embeddings,
            input_ids=self.input_ids,
            loss_mask=self.loss_mask,
            labels=self.labels,
            use_inference_kv_cache=False,
            inference_context=None,
            image_token_index=IMAGE,
            num_image_tiles=self.num_image_tiles,
            is_packed_dynamic_res=self.dynamic,
            sound_embeddings=self.sound_embeddings,
            sound_embeddings_len=self.sound_embeddings_len,
        )


def _row(ex: Example, g: torch.Generator, video: bool) -> tuple[list, list]:
    """Compact token ids of one example and its image entries (with the temporal video
    embedder every image is one 512x512 tubelet: an entry of 1)."""
    words = lambda n: torch.randint(20, 90, (n,), generator=g).tolist()  # noqa: E731
    ids, entries = words(ex.text), []
    for hw in ex.images:
        ids += [IMG_START, IMAGE, IMG_END, *words(2)]
        entries.append(1 if video else image_tokens(*hw))
    if ex.video_frames:
        ids += words(3)  # "This is a video:"
        for _ in range(0, ex.video_frames, TEMPORAL):
            ids += [*words(4), IMG_START, IMAGE, IMG_END]  # "Frame k sampled at t seconds:"
            entries.append(1)
    if ex.mel_frames:
        ends = [i for i, t in enumerate(ids) if t == IMG_END]
        at = ends[-1] + 1 if ends else 1
        block = [SO_START] + [SOUND] * sound_tokens(ex.mel_frames) + [SO_END]
        ids = ids[:at] + block + ids[at:]
    return ids + words(ex.text), entries


def build(examples: list[Example], *, pack: bool = False, pad_to_multiple_of: int = 1) -> OmniBatch:
    """The batch the collate + forward would give ``_preprocess_data`` (random features)."""
    g = torch.Generator().manual_seed(0)
    video = any(ex.video_frames for ex in examples)
    rows, entries = [], []
    for ex in examples:
        r, e = _row(ex, g, video)
        rows.append(r)
        entries.append(e)
    flat = [t for e in entries for t in e]
    L = VIDEO_TOKENS if video else 1
    shape = (L, len(flat), H) if video else (sum(flat), 1, H)
    emb = torch.randn(shape, generator=g)
    clips = [sound_tokens(ex.mel_frames) for ex in examples if ex.mel_frames]
    snd = snd_len = None
    if clips:
        snd = torch.randn(max(clips) + 2, len(clips), H, generator=g)  # padded rows past len
        snd_len = torch.tensor(clips)
    merged = [len(r) + sum(t * L - 1 for t in e) for r, e in zip(rows, entries)]
    cu = cu_pad = None
    if pack:
        padded = [-(-m // pad_to_multiple_of) * pad_to_multiple_of for m in merged]
        rows = [r + [PAD] * (p - m) for r, m, p in zip(rows, merged, padded)]  # the gap
        cu = torch.tensor([0, *torch.tensor(merged).cumsum(0).tolist()], dtype=torch.int32)
        cu_pad = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
        ids = torch.tensor([t for r in rows for t in r]).view(1, -1)
        # each compact row keeps its own positions; the gap continues them
        pos = torch.cat([torch.arange(len(r)) for r in rows]).view(1, -1)
    else:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), PAD)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
        pos = torch.arange(width).expand(len(rows), width)
    b, s = ids.shape
    labels = torch.cat([ids[:, 1:], torch.full((b, 1), -100)], 1)
    return OmniBatch(
        input_ids=ids,
        labels=labels,
        loss_mask=torch.ones(b, s),
        language_embeddings=torch.randn(b, s, H, generator=g),
        num_image_tiles=torch.tensor(flat, dtype=torch.int),
        image_embeddings=emb,
        sound_embeddings=snd,
        sound_embeddings_len=snd_len,
        dynamic=not video,
        img_seq_len=L,
        cu_seqlens_q=cu,
        cu_seqlens_q_padded=cu_pad,
        rows=rows,
        position_ids=pos,
    )
