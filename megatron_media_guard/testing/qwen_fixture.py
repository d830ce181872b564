"""Qwen-VL as a family fixture (``tiny_model()`` / ``make_batch(model, samples)``, the API of
:mod:`megatron_media_guard.testing.families`) for tests and benchmarks that size items by their
grids (never imported by the runtime): the ids a Qwen-VL processor writes for given grids, on
:mod:`megatron_media_guard.testing.qwen_vl`'s tiny models (default token ids). The caller puts
the pixels and grids beside them (the static processing's, in the data-side repair checks).

- image ``Media("image", (h, w))``: ``<|vision_start|>`` ``<|image_pad|>``x(h*w/4)
  ``<|vision_end|>`` (``tokens``: the run's length when it differs);
- video ``Media("video", (t, h, w))``: Qwen2.5-VL one run of t*h*w/4; Qwen3-VL t runs of h*w/4,
  each after its timestamp text (two random text ids here); ``tokens``: the video's total, the
  difference on its last run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_media_guard.testing import qwen_vl
from megatron_media_guard.testing.families.base import FamilyBatch, Media, right_pad

PAD = 151643  # <|endoftext|>


@dataclass(frozen=True)
class QwenFixture:
    """family: ``qwen2_5_vl`` or ``qwen3_vl`` (``qwen_vl.tiny_model``'s)."""

    family: str

    def tiny_model(self) -> torch.nn.Module:
        return qwen_vl.tiny_model(self.family)

    def runs(self, m: Media) -> tuple[int, list[int]]:
        """The placeholder id and the run lengths of one item."""
        if m.modality == "image":
            n = m.size[0] * m.size[1] // 4
            return qwen_vl.IMAGE, [n if m.tokens is None else int(m.tokens)]
        t, h, w = m.size
        lens = [h * w // 4] * t if self.family == "qwen3_vl" else [t * h * w // 4]
        lens[-1] += 0 if m.tokens is None else int(m.tokens) - sum(lens)
        return qwen_vl.VIDEO, lens

    def make_batch(self, model, samples, *, seed: int = 0) -> FamilyBatch:
        """``input_ids``, ``attention_mask``, ``mm_token_type_ids`` of ``samples`` (module doc);
        no pixels."""
        del model
        rng, rows, runs = np.random.default_rng(seed), [], []
        for sample in samples:
            row, sruns = list(rng.integers(100, 1000, 4)), []
            for m in sample:
                pad, lens = self.runs(m)
                for n in lens:
                    row += list(rng.integers(100, 1000, 2)) if self.family == "qwen3_vl" else []
                    row += [qwen_vl.START, *[pad] * n, qwen_vl.END]
                    sruns.append((m.modality, n))
                row += list(rng.integers(100, 1000, 3))
            rows.append([int(x) for x in row])
            runs.append(sruns)
        ids, attn = right_pad(rows, PAD)
        types = (ids == qwen_vl.IMAGE).long() + 2 * (ids == qwen_vl.VIDEO).long()
        kw = {"input_ids": ids, "attention_mask": attn, "mm_token_type_ids": types}
        return FamilyBatch(kw, [], runs, [len(r) for r in rows])


__all__ = ["QwenFixture"]
