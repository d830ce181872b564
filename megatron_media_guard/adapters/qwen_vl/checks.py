"""What the Qwen-VL pre-hook reads from a forward call: the model's sizes, the grid rows, and the
aligned-path check of the placeholder runs against them, on the device.

The number of features of every item is a pure function of its grid row
(``t * h * w / merge**2``), so the runs in ``input_ids`` can be checked against the grids before
the vision tower runs. Items are the grid rows, images and videos each in their own order (the
order the model consumes them in); Qwen3-VL's videos put one run per temporal group (each
preceded by its timestamp text), so there a video row stands for ``t`` runs of ``h * w / m**2``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any, Literal

import torch

from ...core.grammar import Grammar
from ...core.host import to_host
from ...core.runs import TokenLayout
from ...core.verify import fingerprint_weights as id_weights
from ...errors import MediaInputError
from ...families import qwen
from ...families.spec import attr_path
from ..forward_hook import CallArgs

VideoRuns = Literal["one", "per_group"]
MODALITIES: tuple[str, str] = ("image", "video")
PIXELS = {"image": "pixel_values", "video": "pixel_values_videos"}
GRIDS = {"image": "image_grid_thw", "video": "video_grid_thw"}
QWEN_TEXT_PAD = 151643  # <|endoftext|>, the Qwen2 tokenizer's pad token

# odd 63-bit multiplier for the grid rows' part of the fingerprint (the ids' part is the
# core's: core.verify's per-position weights, so both checks hash the ids the same way)
_MIX_GRID = 0x2545F4914F6CDD1D


@dataclass(frozen=True)
class QwenVLSpec:
    """The sizes and token ids of one Qwen-VL model (read from ``model.config``).

    video_runs: ``"one"`` run per video (Qwen2-VL / 2.5-VL) or one ``"per_group"`` of
    ``temporal_patch`` frames (Qwen3-VL, each group after its timestamp text).
    text_id: the token id a dropped sample's placeholders become (harmless text).
    channels: image channels (``patch_dim`` = channels * temporal_patch * patch**2 values a
    patch row holds).
    """

    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    patch: int = 14
    temporal_patch: int = 2
    merge: int = 2
    video_runs: VideoRuns = "one"
    text_id: int = QWEN_TEXT_PAD
    channels: int = 3

    @property
    def patch_dim(self) -> int:
        return self.channels * self.temporal_patch * self.patch * self.patch

    def grammar(self) -> Grammar:
        """The family spec's grammar (``FamilySpec.grammar``) with these ids."""
        g = Grammar.qwen2_vl(
            self.image_token_id,
            self.video_token_id,
            self.vision_start_token_id,
            self.vision_end_token_id,
            self.text_id,
        )
        return replace(g, name=qwen.SPEC.name)

    def check_grammar(self, grammar: Grammar) -> None:
        want = self.grammar()
        got = (dict(grammar.placeholders), grammar.start_id, grammar.end_id)
        exp = (dict(want.placeholders), want.start_id, want.end_id)
        if got != exp:
            raise MediaInputError(
                f"the guard's grammar (placeholders, start, end) {got} differs from the model's "
                f"config {exp}; build the guard with Grammar.qwen2_vl(image_pad, video_pad, "
                "vision_start, vision_end) from the model's token ids"
            )


def spec_from_model(model: Any, text_id: int | None = None) -> QwenVLSpec:
    """Token ids and sizes of ``model`` as the family spec reads them (``families/qwen.py``:
    ``model.config``, transformers' or the Bridge provider's, with the Qwen2-VL defaults)."""
    cfg = getattr(model, "config", None)
    fam = qwen.SPEC
    image, video = fam.modality("image"), fam.modality("video")
    vocab = attr_path(cfg, "text_config.vocab_size", "vocab_size")
    if text_id is None:
        text_id = attr_path(cfg, *fam.text.config)
        if text_id is None and (vocab is None or int(vocab) > QWEN_TEXT_PAD):
            text_id = QWEN_TEXT_PAD
        if text_id is None:
            raise MediaInputError("no pad token id in the model's config: pass drop_token_id=")
    s = qwen.sizes(model)
    channels = attr_path(cfg, "vision_config.in_channels", "vision_config.in_chans")
    spec = QwenVLSpec(
        image_token_id=image.placeholder.resolve(model),
        video_token_id=video.placeholder.resolve(model),
        vision_start_token_id=image.start.resolve(model),
        vision_end_token_id=image.end.resolve(model),
        patch=s["patch"],
        temporal_patch=s["temporal_patch"],
        merge=s["merge"],
        video_runs="per_group" if qwen.is_qwen3(model) else "one",
        text_id=int(text_id),
        channels=3 if channels is None else int(channels),
    )
    specials = set(spec.grammar().placeholders.values())
    specials |= {spec.vision_start_token_id, spec.vision_end_token_id}
    if spec.text_id in specials:
        raise MediaInputError(
            f"drop token id {spec.text_id} is a vision token of the model; pass a text id "
            "(drop_token_id=)"
        )
    return spec


def packed_offsets(call: CallArgs, ids: torch.Tensor) -> torch.Tensor | None:
    """Sample offsets of a packed THD row: Megatron's ``packed_seq_params`` (``cu_seqlens_q_padded``
    where set: where each sample starts in the row; else ``cu_seqlens_q``) or transformers'
    ``cu_seq_lens_q``. None for ``[b, s]`` rows (each row one sample)."""
    if ids.dim() != 2 or ids.shape[0] != 1:
        return None
    psp = call.get("packed_seq_params")
    cu = None
    if psp is not None:
        fmt = getattr(psp, "qkv_format", "thd")
        if fmt in (None, "thd"):
            cu = getattr(psp, "cu_seqlens_q_padded", None)
            if cu is None:
                cu = getattr(psp, "cu_seqlens_q", None)
    if cu is None:
        cu = call.get("cu_seq_lens_q")
    if cu is None:
        return None
    return cu.to(ids.device)


@dataclass(frozen=True)
class GridCheck:
    """The aligned-path verdict, as host integers (one transfer)."""

    runs: int
    bad: int
    findings: int
    pixel_rows_bad: int
    types_bad: int  # positions where the given token types / vision masks disagree with the ids
    fingerprint: int

    @property
    def aligned(self) -> bool:
        return self.bad == 0 and self.findings == 0 and self.pixel_rows_bad == 0


def grid_runs(
    grid: torch.Tensor, modality: str, spec: QwenVLSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per grid row: how many placeholder runs it owns and how long each is (device tensors)."""
    m2 = spec.merge * spec.merge
    t, h, w = grid[:, 0], grid[:, 1], grid[:, 2]
    cells = h * w // m2
    if modality == "video" and spec.video_runs == "per_group":
        return t, cells
    return torch.ones_like(t), t * cells


def check_grids(
    lay: TokenLayout,
    ids: torch.Tensor,
    grids: Mapping[str, torch.Tensor | None],
    pixel_rows: Mapping[str, int | None],
    spec: QwenVLSpec,
    samples: Mapping[str, torch.Tensor] | None = None,
    declared: Mapping[str, torch.Tensor] | None = None,
    types: Mapping[str, torch.Tensor] | None = None,
) -> GridCheck:
    """Every run of each modality against its grid row, entirely on the device.

    The ``r``-th run of a modality (token order over the flattened batch) must end where that
    modality's placeholder count reaches the cumulative size of its first ``r + 1`` runs from
    the grids; the run counts must agree. samples: per modality, the sample of each grid row
    (explicit items): each sample then holds as many runs as its rows own. declared: per
    modality, the feature counts the caller's items declare (must equal the grid's). types: the
    call's ``mm_token_type_ids`` / ``image_input_mask`` / ``video_input_mask`` where given
    (counted where they disagree with what the ids say).
    """
    start, end = lay.run_bounds()
    findings = lay.structure_violations(start, end)
    dev = ids.device
    bad = torch.zeros((), dtype=torch.int64, device=dev)
    n_runs = start.sum()
    pix_bad = torch.zeros((), dtype=torch.int64, device=dev)
    fp = torch.zeros((), dtype=torch.int64, device=dev)
    for mod in MODALITIES:
        k = lay.grammar.modality_code(mod)
        is_m = lay.code == k
        start_m = (start & is_m).reshape(-1)
        end_m = (end & is_m).reshape(-1)
        grid = grids.get(mod)
        if grid is None or grid.shape[0] == 0:
            bad = bad + start_m.sum()
            continue
        g = grid.to(dev, torch.int64)
        per_row, size = grid_runs(g, mod, spec)
        if pixel_rows.get(mod) is not None:
            pix_bad = pix_bad + (g.prod(-1).sum() != pixel_rows[mod]).long()
        if declared is not None and mod in declared:
            bad = bad + (declared[mod].to(dev, non_blocking=True) != per_row * size).sum()
        fp = fp + (g * (torch.arange(g.numel(), device=dev).view_as(g) * _MIX_GRID + k + 1)).sum()
        cum_runs = torch.cumsum(per_row, 0)
        base = torch.cumsum(per_row * size, 0) - per_row * size
        run_idx = torch.cumsum(start_m, 0) - 1
        ph_cum = torch.cumsum(is_m.reshape(-1), 0)
        row = torch.searchsorted(cum_runs, run_idx, right=True).clamp(max=g.shape[0] - 1)
        within = run_idx - (cum_runs[row] - per_row[row])
        want = base[row] + size[row] * (within + 1)
        bad = bad + (end_m & ((run_idx >= cum_runs[-1]) | (ph_cum != want))).sum()
        bad = bad + (start_m.sum() != cum_runs[-1]).long()
        if mod == "video" and spec.video_runs == "per_group":
            bad = bad + _rows_across_samples(lay, start & is_m, per_row, cum_runs)
        if samples is not None and mod in samples:
            want_s = torch.zeros(lay.num_samples, dtype=torch.int64, device=dev)
            want_s.index_add_(0, samples[mod].to(dev, non_blocking=True), per_row)
            bad = bad + (lay.runs_per_sample(start & is_m) != want_s).sum()
    types_bad = torch.zeros((), dtype=torch.int64, device=dev)
    for name, given in (types or {}).items():
        types_bad = types_bad + (given.to(dev) != derived_types(ids, spec, name)).sum()
    # the ids' part, as core.verify hashes them: sum((ids + 1) * w) = ids . w + sum(w), the
    # sum of the weights added on the host (int64 wraparound)
    ids64 = ids.reshape(-1).to(torch.int64)
    w, w_sum = id_weights(ids64.numel(), dev)
    fp = fp + (torch.dot(ids64, w) if dev.type == "cpu" else (ids64 * w).sum())
    packed = torch.stack([n_runs, bad, findings.to(torch.int64), pix_bad, types_bad, fp])
    # the one host sync of the aligned path: six integers decide keep-all or diagnose
    vals = to_host(packed, why="Qwen-VL grid check verdict").tolist()
    vals[-1] = (vals[-1] + w_sum + 2**63) % 2**64 - 2**63
    return GridCheck(*vals)


def _rows_across_samples(
    lay: TokenLayout, run_start: torch.Tensor, per_row: torch.Tensor, cum_runs: torch.Tensor
) -> torch.Tensor:
    """Device scalar: sample boundaries that fall inside a grid row's runs (a Qwen3-VL video's
    temporal groups fed to two samples). Each run counts fine on its own, but one video would
    feed two samples. In run-index space: sample ``k`` starts after ``before[k]`` runs of the
    modality; row ``r`` holds runs ``[cum_runs[r] - per_row[r], cum_runs[r])``."""
    counts = lay.runs_per_sample(run_start)
    before = torch.cumsum(counts, 0) - counts
    row = torch.searchsorted(cum_runs, before, right=True)
    inside = row < cum_runs.numel()
    row = row.clamp(max=cum_runs.numel() - 1)
    return (inside & (before > cum_runs[row] - per_row[row])).sum()


TYPE_INPUTS = ("mm_token_type_ids", "image_input_mask", "video_input_mask")


def derived_types(ids: torch.Tensor, spec: QwenVLSpec, name: str) -> torch.Tensor:
    """What the ids say ``name`` must be: ``mm_token_type_ids`` 0 text / 1 image / 2 video
    (int32), or Bridge's boolean ``image_input_mask`` / ``video_input_mask``."""
    if name == "image_input_mask":
        return ids == spec.image_token_id
    if name == "video_input_mask":
        return ids == spec.video_token_id
    tt = torch.zeros_like(ids, dtype=torch.int32)
    tt.masked_fill_(ids == spec.image_token_id, 1)
    return tt.masked_fill_(ids == spec.video_token_id, 2)


def meta_tensors(meta, grids, num_samples: int):
    """Per modality: the samples and declared counts of the caller's items (grid-row order),
    and whether each modality's rows come in token order (their samples never decrease: the
    model feeds the rows to the runs in order)."""
    if meta is None:
        return None, None, True
    n = {m: (0 if grids[m] is None else int(grids[m].shape[0])) for m in MODALITIES}
    if len(meta) != n["image"] + n["video"]:
        raise MediaInputError(
            f"set_items gave {len(meta)} items for {n['image']} image and {n['video']} video "
            "grid rows (one per row: the image rows, then the video rows)"
        )
    parts = {"image": meta[: n["image"]], "video": meta[n["image"] :]}
    for m, its in parts.items():
        bad = [i for i, it in enumerate(its) if it.modality != m]
        if bad:
            raise MediaInputError(
                f"set_items: item {bad[0]} of the {m} rows has modality {its[bad[0]].modality!r}"
            )
    declared = {
        m: torch.tensor([it.num_features for it in its], dtype=torch.int64)
        for m, its in parts.items()
        if its
    }
    has = [it.sample is not None for it in meta]
    if not any(has):
        return None, declared, True
    if not all(has):
        raise MediaInputError("give MediaItem.sample for every item or for none")
    out = [i for i, it in enumerate(meta) if it.sample >= num_samples]
    if out:
        raise MediaInputError(
            f"item {out[0]} names sample {meta[out[0]].sample}, the batch has {num_samples}",
            context={"item": out[0], "num_samples": num_samples},
        )
    samples = {
        m: torch.tensor([it.sample for it in its], dtype=torch.int64)
        for m, its in parts.items()
        if its
    }
    ordered = all(a.sample <= b.sample for its in parts.values() for a, b in pairwise(its))
    return samples, declared, ordered
