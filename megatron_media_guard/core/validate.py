"""Input checks for the merge: a clear error for bad input, never a silent coercion."""

from __future__ import annotations

import torch

from ..errors import MediaInputError
from .runs import TokenLayout


def check_inputs(
    embeddings: torch.Tensor,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    loss_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    seq_first: bool,
    lay: TokenLayout,
) -> torch.Tensor:
    """Validates shapes, dtypes and devices; returns the embeddings as a ``[b, s, h]`` view."""
    if not isinstance(embeddings, torch.Tensor) or not embeddings.is_floating_point():
        what = (
            embeddings.dtype if isinstance(embeddings, torch.Tensor) else type(embeddings).__name__
        )
        raise MediaInputError(f"embeddings must be a floating-point tensor, got {what}")
    if embeddings.element_size() < 2:
        raise MediaInputError(
            f"embeddings are {embeddings.dtype}: merge in bf16, fp16 or fp32 (8-bit floats "
            "have no NaN/Inf reductions or scatter on every device)"
        )
    if embeddings.dim() != 3:
        raise MediaInputError(
            "embeddings must be [b, s, h] (or [s, b, h] with seq_first=True), got "
            f"{tuple(embeddings.shape)}"
        )
    emb = embeddings.transpose(0, 1) if seq_first else embeddings
    b, s = lay.batch, lay.row_length  # not empty: the layout refused an empty batch
    if emb.shape[:2] != (b, s):
        layout = "[s, b, h]" if seq_first else "[b, s, h]"
        raise MediaInputError(
            f"embeddings {tuple(embeddings.shape)} (read as {layout}) do not match input_ids "
            f"{tuple(input_ids.shape)}; pass seq_first=True for [s, b, h]"
        )
    if input_ids.device != embeddings.device:
        raise MediaInputError(f"input_ids on {input_ids.device}, embeddings on {embeddings.device}")
    if features.numel() or features.shape[0]:
        if features.device != embeddings.device:
            raise MediaInputError(
                f"features on {features.device}, embeddings on {embeddings.device}"
            )
        if features.dtype != embeddings.dtype:
            raise MediaInputError(
                f"features are {features.dtype}, embeddings {embeddings.dtype}: cast the projector "
                "output explicitly (the guard does not convert silently)"
            )
        if features.shape[1] != embeddings.shape[2]:
            raise MediaInputError(
                f"features hidden size {features.shape[1]} != embeddings hidden size "
                f"{embeddings.shape[2]}"
            )
    check_masks(loss_mask, labels, b, s, embeddings.device)
    return emb


def check_masks(
    loss_mask: object, labels: object, b: int, s: int, device: torch.device | None
) -> None:
    """``loss_mask`` / ``labels`` are ``[b, s]`` tensors (on ``device`` when given) and labels
    are integer ids; None passes. Shared by the merge and the last pipeline stage."""
    for name, t in (("loss_mask", loss_mask), ("labels", labels)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (b, s):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise MediaInputError(f"{name} must be [b, s] = {(b, s)}, got {got}")
        if device is not None and t.device != device:
            raise MediaInputError(f"{name} on {t.device}, embeddings on {device}")
    if isinstance(labels, torch.Tensor) and labels.is_floating_point():
        raise MediaInputError(f"labels must be integer token ids, got {labels.dtype}")


def check_labels_dtype(labels: torch.Tensor | None, ignore_index: int) -> None:
    """Refuses labels whose dtype cannot hold ``ignore_index`` (uint8 would wrap -100 to 156
    and train a dropped sample on token 156): checked on every call, not at the first drop."""
    if labels is None or not isinstance(labels, torch.Tensor):
        return
    dt = labels.dtype
    ok = dt != torch.bool and not labels.is_complex()
    if ok:
        info = torch.finfo(dt) if labels.is_floating_point() else torch.iinfo(dt)
        ok = info.min <= ignore_index <= info.max
    if not ok:
        raise MediaInputError(
            f"labels of dtype {dt} cannot hold ignore_index {ignore_index} (a dropped sample's "
            "labels would wrap to a real token id): pass int64 (or int32) labels, or set "
            "GuardConfig.ignore_index to a value the dtype holds",
            context={"labels_dtype": str(dt), "ignore_index": ignore_index},
        )
