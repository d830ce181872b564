"""The smoke job's synthetic micro-batch stream and its named fault scenarios.

Every data-parallel rank gets, at every step, four samples in the Qwen2-VL grammar
(small test token ids, ``synthetic.TEST_GRAMMARS["qwen"]``)::

    sample 0: text, one image, text
    sample 1: text, one 4-frame video, text
    sample 2: text, two images of different sizes, text
    sample 3: text only

Image and video sizes are drawn per (data-parallel rank, step) from a seeded generator, so
tensor-parallel peers hold identical micro-batches. Placeholder counts come from a small
patch-merge geometry (patch 4, merge 2, temporal patch 2), which is exactly what the smoke
model's vision tower produces, so repair can re-project media for real.

A scenario's fault lands on one data-parallel rank (with its tensor-parallel peers) at one
step; every other micro-batch is clean. The faults are the ones of ``synthetic.FAULTS``,
built here on real media so the features come from the vision tower (see ``FAULT_SPECS``).
Pure Python and torch; no torch.distributed, no megatron.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from ..config import GuardConfig
from ..core.items import MediaItem
from ..geometry import PatchMergeGeometry
from .faults import FAULTS, PAD_ID, TEST_GRAMMARS, TEXT_HIGH, TEXT_LOW
from .names import DEFAULT_POLICIES, POLICIES  # noqa: F401  (torch-free, for --help)

Policy = Literal["raise", "drop", "repair"]
SCENARIOS: tuple[str, ...] = FAULTS

GRAMMAR = TEST_GRAMMARS["qwen"]
VOCAB = 1152  # > TEXT_HIGH, divisible by common tensor-parallel sizes
GEOMETRY = PatchMergeGeometry(patch=4, merge=2, temporal_patch=2, min_pixels=256, max_pixels=4096)
ALLOWED_FIDELITY = GuardConfig(environ={}).allowed_fidelity
IMAGE_SIZES: tuple[tuple[int, int], ...] = ((40, 56), (48, 40), (30, 70), (36, 60), (52, 36))
VIDEO_SIZES: tuple[tuple[int, int], ...] = ((32, 48), (24, 40))
VIDEO_FRAMES = 4
ENGINE_SHRINK = 0.55  # budget_shrink: the engine's pixel budget, as a fraction of the static one
NUM_SAMPLES = 4


@dataclass(frozen=True)
class FaultSpec:
    """One scenario: what it breaks, which samples, and the status the guard must find."""

    name: str
    what: str
    samples: tuple[int, ...]
    statuses: tuple[str, ...]  # alignment.Status value per touched sample
    repairable: bool  # the guard may re-project (plan.REPAIRABLE and no suspected swap)
    #: the loss trains on the faulty placeholders: generated, fed as text, the sample kept
    #: under every policy (GuardConfig.generated="text"), one ``check`` record per rank
    fed_as_text: bool = False


FAULT_SPECS: dict[str, FaultSpec] = {
    f.name: f
    for f in (
        FaultSpec("none", "clean micro-batches everywhere", (), (), False),
        FaultSpec(
            "budget_shrink",
            "the engine sized sample 1's video at 55% of the pixel budget; the trainer "
            "projected it at the static budget (the seed failure)",
            (1,),
            ("surplus",),
            True,
        ),
        FaultSpec(
            "extra_pad",
            "sample 0's image run holds one placeholder too many",
            (0,),
            ("deficit",),
            True,
        ),
        FaultSpec(
            "offsetting",
            "+1 feature for sample 0's image, -1 for sample 2's first: batch totals agree",
            (0, 2),
            ("surplus", "deficit"),
            True,
        ),
        FaultSpec(
            "surplus_feature", "sample 0's image has one feature too many", (0,), ("surplus",), True
        ),
        FaultSpec(
            "cut_by_max_len",
            "the sequence limit falls inside sample 2's last image run",
            (2,),
            ("truncated",),
            False,
        ),
        FaultSpec(
            "literal_placeholder",
            "a user typed the image placeholder in sample 3's text (where the loss does not "
            "train: its next token is padding)",
            (3,),
            ("malformed",),
            False,
        ),
        FaultSpec(
            "swapped_items",
            "sample 2's two images swapped in feature order (equal totals)",
            (2,),
            ("length_mismatch",),
            False,
        ),
        FaultSpec(
            "cross_swap",
            "sample 0's image and sample 2's first image exchanged between the samples "
            "(batch totals agree): a suspected swap, never repaired",
            (0, 2),
            ("deficit", "surplus"),
            False,
        ),
        FaultSpec(
            "video_grid",
            "the trainer decoded 2 more frames of sample 1's video: one more temporal group",
            (1,),
            ("surplus",),
            True,
        ),
        FaultSpec(
            "generated_placeholder",
            "the policy generated an image placeholder in sample 3's response, under the "
            "loss (RL rollouts): fed as text, the sample kept under every policy",
            (3,),
            ("malformed",),
            False,
            fed_as_text=True,
        ),
    )
}
assert set(FAULT_SPECS) == set(FAULTS), "every synthetic fault needs a smoke scenario"


@dataclass(frozen=True)
class MediaSpec:
    """One media item as the data pipeline describes it; pixels are drawn from ``seed``.

    source_hw: the original size; the pixels are at the processor's size for it
    (``size_hw``); num_frames: frames the trainer decoded (1 for an image).
    feature_delta: feature rows added (> 0) or removed (< 0) after encoding (a count fault).
    """

    sample: int
    modality: Literal["image", "video"]
    source_hw: tuple[int, int]
    num_frames: int
    seed: int
    sample_id: str
    feature_delta: int = 0

    @property
    def size_hw(self) -> tuple[int, int]:
        return GEOMETRY.size_for(self.source_hw, self.num_frames)

    @property
    def natural(self) -> int:
        """Features the vision tower yields for the pixels."""
        return GEOMETRY.tokens(self.source_hw, self.num_frames)

    @property
    def num_features(self) -> int:
        return self.natural + self.feature_delta

    def pixels(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[3, H, W]`` (image) or ``[T, 3, H, W]`` (video) at ``size_hw``."""
        g = torch.Generator().manual_seed(self.seed)
        shape = (
            (3, *self.size_hw) if self.modality == "image" else (self.num_frames, 3, *self.size_hw)
        )
        return torch.randn(shape, generator=g).to(device)

    def item(self, pixels: torch.Tensor | None = None) -> MediaItem:
        return MediaItem(
            self.num_features,
            sample=self.sample,
            modality=self.modality,
            sample_id=self.sample_id,
            num_frames=self.num_frames if self.modality == "video" else None,
            frame_hw=self.size_hw,
            pixels=pixels,
            source_hw=self.source_hw,
        )


@dataclass(frozen=True, eq=False)
class MicroBatch:
    """input_ids ``[4, s]``; media in feature order; runs: placeholder counts laid out per sample."""

    input_ids: torch.Tensor
    media: tuple[MediaSpec, ...]
    runs: tuple[tuple[int, ...], ...]
    fault: str
    faulty_samples: tuple[int, ...]

    def pixels(self, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        return [m.pixels(device) for m in self.media]

    def items(self, pixels: Sequence[torch.Tensor] | None = None) -> list[MediaItem]:
        px = list(pixels) if pixels is not None else [None] * len(self.media)
        return [m.item(p) for m, p in zip(self.media, px)]


def _run(modality: str, n: int) -> list[int]:
    return [GRAMMAR.start_id, *[GRAMMAR.placeholders[modality]] * n, GRAMMAR.end_id]


def micro_batch(fault: str, dp_rank: int, step: int, seed: int = 0) -> MicroBatch:
    """The micro-batch data-parallel rank ``dp_rank`` gets at ``step``, with ``fault`` applied."""
    if fault not in FAULT_SPECS:
        raise KeyError(f"unknown scenario {fault!r}; one of {list(FAULT_SPECS)}")
    rng = random.Random(f"media-guard-smoke:{seed}:{dp_rank}:{step}")
    img0 = rng.choice(IMAGE_SIZES)
    vid = rng.choice(VIDEO_SIZES)
    img_a, img_b = rng.sample(IMAGE_SIZES, 2)
    base = 1_000_003 * (seed + 1) + 1009 * dp_rank + 17 * step

    def sid(s: int) -> str:
        return f"dp{dp_rank}-step{step}-s{s}"

    media = [
        MediaSpec(0, "image", img0, 1, base + 0, sid(0)),
        MediaSpec(1, "video", vid, VIDEO_FRAMES, base + 1, sid(1)),
        MediaSpec(2, "image", img_a, 1, base + 2, sid(2)),
        MediaSpec(2, "image", img_b, 1, base + 3, sid(2)),
    ]
    if fault == "cross_swap":  # two images of different sizes (35 and 24 features)
        media[0] = replace(media[0], source_hw=(40, 56))
        media[2] = replace(media[2], source_hw=(52, 36))
    runs = [[m.natural for m in media if m.sample == s] for s in range(NUM_SAMPLES)]
    if fault == "budget_shrink":
        h, w = media[1].size_hw
        runs[1] = [GEOMETRY.tokens(vid, VIDEO_FRAMES, max_pixels=int(h * w * ENGINE_SHRINK))]
    elif fault == "extra_pad":
        runs[0][0] += 1
    elif fault == "offsetting":
        media[0] = replace(media[0], feature_delta=+1)
        media[2] = replace(media[2], feature_delta=-1)
    elif fault == "surplus_feature":
        media[0] = replace(media[0], feature_delta=+1)
    elif fault == "swapped_items":
        media[2], media[3] = media[3], media[2]
    elif fault == "cross_swap":  # the media travel, the sample labels stay
        a, b = media[0], media[2]
        media[0] = replace(b, sample=a.sample, sample_id=a.sample_id)
        media[2] = replace(a, sample=b.sample, sample_id=b.sample_id)
    elif fault == "video_grid":
        media[1] = replace(media[1], num_frames=VIDEO_FRAMES + GEOMETRY.temporal_patch)

    modality = {s: [m.modality for m in media if m.sample == s] for s in range(NUM_SAMPLES)}
    if fault == "swapped_items":  # the tokens keep the original order
        modality[2] = ["image", "image"]
    rows: list[list[int]] = []
    for s in range(NUM_SAMPLES):
        row = [rng.randrange(TEXT_LOW, TEXT_HIGH) for _ in range(4 if runs[s] else 12)]
        for mod, n in zip(modality[s], runs[s]):
            row += _run(mod, n) + [rng.randrange(TEXT_LOW, TEXT_HIGH) for _ in range(3)]
        rows.append(row)
    if fault == "literal_placeholder":  # the last text token: its next is padding, untrained
        rows[3][-1] = GRAMMAR.placeholders["image"]
    if fault == "generated_placeholder":
        # one placeholder mid-response: the smoke trains on positions whose next token is
        # text, so this position is under the loss (a second one right before it would not be)
        rows[3][6] = GRAMMAR.placeholders["image"]
    if fault == "cut_by_max_len":
        # the limit cuts the last run of sample 2 two placeholders before its end
        # (3 text tokens + the end token + 2 placeholders fall past the limit)
        others = max(len(r) for i, r in enumerate(rows) if i != 2)
        limit = len(rows[2]) - 6
        if limit < others:  # sample 2 is the longest row: lengthen its prompt text
            rows[2][:0] = [rng.randrange(TEXT_LOW, TEXT_HIGH) for _ in range(others - limit)]
            limit = others
        rows[2] = rows[2][:limit]
    width = max(len(r) for r in rows)
    ids = torch.full((NUM_SAMPLES, width), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return MicroBatch(
        ids,
        tuple(media),
        tuple(tuple(r) for r in runs),
        fault,
        FAULT_SPECS[fault].samples,
    )


@dataclass(frozen=True)
class RepairAttempt:
    """One item the guard re-projects under ``policy="repair"`` and whether it may."""

    item: int  # index in feature order
    sample: int
    target: int
    fidelity: str
    allowed: bool


def repair_attempts(mb: MicroBatch) -> tuple[RepairAttempt, ...]:
    """The items of ``mb``'s repairable faulty samples whose count differs from their run."""
    spec = FAULT_SPECS[mb.fault]
    if not spec.repairable:
        return ()
    out = []
    for s in spec.samples:
        idx = [i for i, m in enumerate(mb.media) if m.sample == s]
        for i, run in zip(idx, mb.runs[s]):
            m = mb.media[i]
            if m.num_features == run:
                continue
            sol = GEOMETRY.solve(run, m.source_hw, m.num_frames)
            ok = bool(sol.reachable) and sol.fidelity in ALLOWED_FIDELITY
            out.append(RepairAttempt(i, s, run, str(sol.fidelity), ok))
    return tuple(out)


def expected_actions(mb: MicroBatch, policy: str) -> dict[int, str]:
    """Per faulty sample: ``raise`` / ``drop`` / ``repair`` (fallback: drop); ``keep`` for
    placeholders fed as text."""
    if FAULT_SPECS[mb.fault].fed_as_text:
        return dict.fromkeys(mb.faulty_samples, "keep")
    if policy != "repair":
        return dict.fromkeys(mb.faulty_samples, policy)
    spec = FAULT_SPECS[mb.fault]
    attempts = repair_attempts(mb)
    out = {}
    for s in mb.faulty_samples:
        mine = [a for a in attempts if a.sample == s]
        out[s] = "repair" if spec.repairable and mine and all(a.allowed for a in mine) else "drop"
    return out
