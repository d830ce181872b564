"""Media items as the vision side sees them, and the features that go with them."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from ..errors import MediaInputError

SAMPLE_ID_MAX_LEN = 1024  # characters of a string sample_id
SAMPLE_ID_INT_BOUND = 1 << 63  # |int sample_id| below this (fits int64 / JSON readers)


def check_sample_id(sid: object) -> str | int | None:
    """``sample_id`` as a plain ``str`` or ``int`` (numpy/torch integers converted), or None;
    refused here otherwise, so that no record or message written later fails on it."""
    if sid is None:
        return None
    if isinstance(sid, str):
        text = str.__str__(sid)  # a str subclass's own __str__/__repr__ are never called
        if len(text) > SAMPLE_ID_MAX_LEN:
            raise MediaInputError(
                f"MediaItem.sample_id is a string of {len(text):,} characters; at most "
                f"{SAMPLE_ID_MAX_LEN} (use a short key, e.g. a hash of the long one)"
            )
        return text
    if isinstance(sid, numbers.Integral) and not isinstance(sid, bool):
        try:
            value = operator.index(sid)
        except Exception:
            value = None
        if type(value) is int and -SAMPLE_ID_INT_BOUND < value < SAMPLE_ID_INT_BOUND:
            return value
        bits = f" of {value.bit_length()} bits" if type(value) is int else ""
        raise MediaInputError(
            f"MediaItem.sample_id is an integer{bits}; |sample_id| must be < 2**63"
        )
    raise MediaInputError(
        f"MediaItem.sample_id must be a str, an int or None, got {type(sid).__name__} "
        "(pass str(x) or int(x) of your id)"
    )


@dataclass(frozen=True)
class MediaItem:
    """One media item (an image, its tiles, a video tubelet group), in feature order.

    num_features: its feature rows. sample: its sample (batch row or packed sample), for
        every item or none (then runs are matched to items in order). sample_id: the data
        pipeline's id, carried into diagnostics. num_frames / frame_hw: frames and the (H, W)
        its features were computed at. pixels: for repair, never logged (``layout``:
        ``"image"`` ``[C, H, W]`` / ``[T, C, H, W]``, or ``"qwen_patches"`` with ``grid_thw``).
        source_hw: the media's (H, W) before any processor resize, for the solver.
    """

    num_features: int
    sample: int | None = None
    modality: str = "image"
    sample_id: str | int | None = None
    num_frames: int | None = None
    frame_hw: tuple[int, int] | None = None
    pixels: torch.Tensor | None = field(default=None, compare=False, repr=False)
    layout: str = "image"
    grid_thw: tuple[int, int, int] | None = None
    source_hw: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        n = self.num_features
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise MediaInputError(f"MediaItem.num_features must be an int >= 0, got {n!r}")
        s = self.sample
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
            raise MediaInputError(f"MediaItem.sample must be an int >= 0 or None, got {s!r}")
        object.__setattr__(self, "sample_id", check_sample_id(self.sample_id))


@dataclass(frozen=True)
class Batch:
    """Items and their ``[sum(num_features), h]`` features (the caller's order); ``order``
    sorts the items by sample (stable): token order."""

    items: tuple[MediaItem, ...]
    features: torch.Tensor
    offsets: tuple[int, ...]  # start row of item i in ``features`` (caller's order), plus total
    order: tuple[int, ...]
    explicit: bool

    def rows(self, i: int) -> tuple[int, int]:
        return self.offsets[i], self.offsets[i + 1]


def normalize(
    features: torch.Tensor | Sequence[torch.Tensor],
    items: Sequence[MediaItem] | None,
    num_samples: int,
) -> Batch:
    """Items checked against ``features`` (``[sum(n_i), h]``, or a list of ``[n_i, h]`` whose
    items may be omitted), the features as one tensor."""
    if items is not None:
        items = tuple(items)
        for it in items:
            if not isinstance(it, MediaItem):
                raise MediaInputError(f"items must be MediaItem, got {type(it).__name__}")
    if isinstance(features, torch.Tensor):
        if features.dim() != 2:
            raise MediaInputError(
                f"features must be [sum(num_features), hidden], got shape {tuple(features.shape)}"
            )
        if items is None:
            raise MediaInputError("items are required when features come as one packed tensor")
        total = sum(it.num_features for it in items)
        if total != features.shape[0]:
            raise MediaInputError(
                f"items declare {total} feature rows in all, features tensor has "
                f"{features.shape[0]}",
                context={"declared": total, "rows": features.shape[0]},
            )
        packed = features
    else:
        parts = list(features)
        if items is None:
            items = tuple(MediaItem(int(p.shape[0]) if p.dim() == 2 else 0) for p in parts)
        if len(parts) != len(items):
            raise MediaInputError(f"{len(parts)} feature tensors for {len(items)} items")
        for i, (p, it) in enumerate(zip(parts, items)):
            if not isinstance(p, torch.Tensor) or p.dim() != 2:
                shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
                raise MediaInputError(f"features[{i}] must be a [n, hidden] tensor, got {shape}")
            if p.shape[0] != it.num_features:
                raise MediaInputError(
                    f"item {i} declares {it.num_features} features, its tensor has {p.shape[0]}",
                    context={"item": i, "declared": it.num_features, "rows": p.shape[0]},
                )
        if parts:
            if len({(p.dtype, p.device, p.shape[1]) for p in parts}) > 1:
                raise MediaInputError(
                    "per-item feature tensors differ in dtype, device or hidden size"
                )
            packed = torch.cat(parts) if len(parts) > 1 else parts[0]
        else:
            packed = torch.empty(0, 0)
    offsets = (0, *accumulate([it.num_features for it in items]))
    samples = [it.sample for it in items]
    given = len(samples) - samples.count(None)
    order = tuple(range(len(items)))
    if given:
        if given < len(samples):
            raise MediaInputError("give MediaItem.sample for every item or for none")
        bad = [(i, s) for i, s in enumerate(samples) if s >= num_samples]
        if bad:
            i, s = bad[0]
            raise MediaInputError(
                f"item {i} names sample {s}, the batch has {num_samples} samples",
                context={"item": i, "sample": s, "num_samples": num_samples},
            )
        order = tuple(sorted(order, key=samples.__getitem__))
    return Batch(items, packed, offsets, order, given > 0)


def metadata_batch(items: Sequence[MediaItem], num_samples: int) -> Batch:
    """Items with ``[n_i, 0]`` features: checks and plans from metadata alone."""
    return normalize(
        [torch.empty(getattr(it, "num_features", 0), 0) for it in items], items, num_samples
    )
