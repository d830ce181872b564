"""The shape every family fixture shares: what a sample holds and what a batch gives the model.

A sample is a list of :class:`Media` in prompt (token) order. ``make_batch`` builds the token ids
with the family's real grammar, the pixel / audio inputs and the count metadata exactly as the
family's processor would (or from its own arithmetic where the processor needs torchvision), and
can inject the faults the guard exists for:

- ``Media(..., tokens=n)``: the item's run gets ``n`` placeholders instead of its feature count
  (a short run, a surplus, +k in one sample and -k in another);
- ``swap=(i, j)``: items ``i`` and ``j`` (consumption order, see :attr:`FamilyBatch.items`)
  exchange their pixels and count metadata, the token ids unchanged.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

#: A small vocabulary for the tiny models whose configs name start / end / placeholder ids per
#: modality (GLM-4V, Ernie 4.5 VL): their real 100k-150k-row vocabularies made the logits, not
#: the model, the cost of every test. Random text ids come from ``SMALL_TEXT_IDS``, below the
#: special ids at the vocabulary's top.
SMALL_VOCAB = 4096
SMALL_TEXT_IDS = (1000, 4000)
SMALL_SPECIAL_IDS = dict(
    image_start_token_id=4001,
    image_end_token_id=4002,
    video_start_token_id=4003,
    video_end_token_id=4004,
    image_token_id=4005,
    video_token_id=4006,
)

Modality = Literal["image", "video", "audio"]


@dataclass(frozen=True)
class Media:
    """One media item of a sample.

    size: family-specific and documented by the family's ``make_batch``: an image's patch grid
        ``(h, w)`` or pixel size ``(H, W)``, a video's ``(frames, h, w)``, an audio clip's mel
        frames ``(L,)``, a tile count ``(tiles,)``.
    tokens: placeholders written for this item's run(s) in the ids when it differs from the
        feature count (fault injection); None: aligned. A tuple: the lengths of each of the
        item's runs, for items laid out as several runs (Qwen3-Omni's audio in video).
    """

    modality: Modality
    size: tuple[int, ...]
    tokens: int | tuple[int, ...] | None = None


@dataclass
class FamilyBatch:
    """kwargs: what ``model.forward`` takes (``input_ids``, ``attention_mask``, pixel / audio
    inputs, count metadata), CPU tensors, rows right-padded (``attention_mask`` 0 on the pad).
    items: per item in the model's consumption order: ``(sample, modality, feature count)``.
    runs: per sample, ``(modality, placeholder count)`` of each run in token order.
    lengths: per sample, its unpadded length in the row.
    """

    kwargs: dict[str, Any]
    items: list[tuple[int, str, int]]
    runs: list[list[tuple[str, int]]]
    lengths: list[int] = field(default_factory=list)

    @property
    def input_ids(self) -> torch.Tensor:
        return self.kwargs["input_ids"]


def right_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, s]`` ids and attention mask from ragged rows, right-padded with ``pad_id``."""
    s = max(len(r) for r in rows)
    ids = torch.full((len(rows), s), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), s), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


@contextlib.contextmanager
def swapped(obj: Any, **values: Any) -> Iterator[None]:
    """``obj``'s attributes (a module's constants or classes) set to ``values`` inside the
    block, restored after."""
    old = {k: getattr(obj, k) for k in values}
    for k, v in values.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


def rng(seed: int, *key: object) -> torch.Generator:
    """A generator seeded by ``seed`` and ``key`` (a stable hash of their ``repr``): the same
    sample always gets the same pixels and text, whatever else is in the batch."""
    return torch.Generator().manual_seed(zlib.crc32(repr((seed, *key)).encode()))
