"""The smoke job's tiny vision-language model, built from megatron-core parts that run on CPU.

- vision tower (torch): a patch embedding over temporal groups of frames followed by a
  ``merge x merge`` concatenation of neighbouring patches, so one item of pixel size
  (H, W) and T frames yields ``ceil(T / temporal_patch) * (H / f) * (W / f)`` features
  with ``f = patch * merge`` -- exactly what :class:`~megatron_media_guard.geometry.
  PatchMergeGeometry` counts. Images are fed as ``temporal_patch`` copies of themselves.
- projector: megatron-core ``MultimodalProjector`` (column/row tensor-parallel MLP).
- language embedding: megatron-core ``LanguageModelEmbedding`` (vocab-parallel, learned
  absolute positions), ``[s, b, h]``.
- decoder and LM head (torch): one causal ``nn.TransformerEncoderLayer`` and a linear head
  (megatron-core's attention needs CUDA).

The merge in between is the guard's. Needs megatron-core ``parallel_state`` initialized
(a single gloo rank is enough; see :func:`single_process_parallel_state`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from ..core.guard import MediaGuard
from ..core.outcome import MergeResult
from ..errors import MediaInputError
from .scenarios import GEOMETRY, TEXT_LOW, VOCAB, MicroBatch


@dataclass(frozen=True)
class ModelSize:
    hidden: int = 32
    vision_width: int = 16
    heads: int = 4
    ffn: int = 64
    max_seq: int = 256


class PatchMergeTower(torch.nn.Module):
    """Pixels ``[C, H, W]`` (image) or ``[T, C, H, W]`` (video) -> ``[t * H/f * W/f, merge**2 * width]``.

    H and W must be multiples of ``f = patch * merge``; a video's T is padded to a multiple
    of ``temporal_patch`` by repeating its last frame (the Qwen processors' rule).
    """

    def __init__(self, patch: int, merge: int, temporal_patch: int, width: int, channels: int = 3):
        super().__init__()
        self.patch, self.merge, self.temporal_patch = patch, merge, temporal_patch
        self.embed = torch.nn.Conv2d(channels * temporal_patch, width, patch, stride=patch)
        self.out_dim = merge * merge * width

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        tp = self.temporal_patch
        if pixels.dim() == 3:
            frames = pixels.unsqueeze(0).expand(tp, *pixels.shape)
        else:
            frames = pixels
            pad = -frames.shape[0] % tp
            if pad:
                frames = torch.cat([frames, frames[-1:].expand(pad, *frames.shape[1:])])
        groups = rearrange(frames, "(t tp) c h w -> t (tp c) h w", tp=tp)
        x = self.embed(groups)  # [t, width, H/p, W/p]
        m = self.merge
        return rearrange(x, "t d (hb mh) (wb mw) -> (t hb wb) (mh mw d)", mh=m, mw=m)


class TinyVLM(torch.nn.Module):
    """Vision tower + megatron projector -> guarded merge into megatron embeddings -> decoder."""

    def __init__(self, size: ModelSize = ModelSize(), tp: int | None = None):
        super().__init__()
        tp = tp or parallel_state.get_tensor_model_parallel_world_size()
        common = dict(
            num_layers=1,
            hidden_size=size.hidden,
            num_attention_heads=size.heads,
            use_cpu_initialization=True,
            tensor_model_parallel_size=tp,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        self.size = size
        self.vision = PatchMergeTower(
            GEOMETRY.patch, GEOMETRY.merge, GEOMETRY.temporal_patch, size.vision_width
        )
        proj_cfg = TransformerConfig(ffn_hidden_size=size.ffn, add_bias_linear=True, **common)
        self.projector = MultimodalProjector(
            proj_cfg,
            MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            "mlp",
            input_size=self.vision.out_dim,
        )
        emb_cfg = TransformerConfig(**common)
        self.embedding = LanguageModelEmbedding(
            emb_cfg, VOCAB, size.max_seq, position_embedding_type="learned_absolute"
        )
        self.decoder = torch.nn.TransformerEncoderLayer(
            size.hidden, size.heads, size.ffn, dropout=0.0, batch_first=True
        )
        self.head = torch.nn.Linear(size.hidden, VOCAB)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """One item's features ``[n, hidden]`` (the repair encoder)."""
        return self.projector(self.vision(pixels))

    def features(self, pixels: Sequence[torch.Tensor], deltas: Sequence[int]) -> torch.Tensor:
        """Every item's features, concatenated ``[sum n_i, hidden]``.

        deltas: per item, feature rows appended (repeating the last, > 0) or removed (< 0)
        after the tower: the smoke's count faults.
        """
        parts = []
        for px, d in zip(pixels, deltas):
            f = self.vision(px)
            if d > 0:
                f = torch.cat([f, f[-1:].expand(d, f.shape[1])])
            elif d < 0:
                f = f[:d]
            parts.append(f)
        return self.projector(torch.cat(parts))

    def forward(
        self,
        mb: MicroBatch,
        guard: MediaGuard,
        step: int,
        pixels: Sequence[torch.Tensor],
        loss_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, MergeResult]:
        """Loss (mean over unmasked text tokens) and the guard's merge result.

        loss_mask: ``[b, s]``; default: every position whose next token is text.
        """
        ids = mb.input_ids
        b, s = ids.shape
        if s > self.size.max_seq:
            raise MediaInputError(f"micro-batch of {s} tokens > max_seq {self.size.max_seq}")
        feats = self.features(pixels, [m.feature_delta for m in mb.media])
        pos = torch.arange(s, device=ids.device).expand(b, s)
        emb = self.embedding(ids, pos)  # [s, b, h]
        labels, text = next_token_targets(ids)
        loss_mask = text if loss_mask is None else loss_mask
        res = guard.merge(
            emb,
            ids,
            feats,
            mb.items(pixels),
            loss_mask=loss_mask,
            labels=labels,
            seq_first=True,
            step=step,
            microbatch=0,
            encoder=self.encode,
        )
        x = res.embeddings.transpose(0, 1)  # [b, s, h]
        causal = torch.nn.Transformer.generate_square_subsequent_mask(s, device=ids.device)
        x = self.decoder(x, src_mask=causal, is_causal=True)
        logits = self.head(x)
        ce = F.cross_entropy(
            logits.reshape(b * s, -1), res.labels.reshape(-1), reduction="none", ignore_index=-100
        )
        mask = res.loss_mask.reshape(-1).to(ce.dtype)
        return (ce * mask).sum() / mask.sum().clamp(min=1.0), res


def next_token_targets(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels ``[b, s]`` (the next token; -100 where it is not text) and loss mask (float)."""
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    text = labels >= TEXT_LOW
    return labels.masked_fill(~text, -100), text.float()


def sync_gradients(model: torch.nn.Module, group) -> None:
    """Average gradients over the data-parallel ``group`` in one all-reduce (what DDP does)."""
    size = dist.get_world_size(group) if group is not None else 1
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if size == 1:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p))
        offset += n


def param_checksum(model: torch.nn.Module) -> float:
    """Sum of every parameter in float64 (equal on data-parallel replicas in sync)."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum() for p in model.parameters()))


@contextlib.contextmanager
def single_process_parallel_state() -> Iterator[None]:
    """A one-rank gloo process group with megatron-core ``parallel_state`` (TP1 PP1), torn down
    on exit. For running the model in one process (tests, demos)."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized")
    with tempfile.TemporaryDirectory(prefix="media_guard_pg_") as tmp:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{os.path.join(tmp, 'store')}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )
        try:
            parallel_state.initialize_model_parallel(1, 1)
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
