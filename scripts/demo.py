"""The seed failure on a small batch: a generation engine shrank a video's frames to fit
the prompt budget (2010 placeholders a frame), the trainer re-processed them at its
static budget (2550 features a frame). Today's merge fails on batch totals; the guard
names the sample and item, then drops just that sample and training goes on.

Run: ``python scripts/demo.py [--log-dir DIR]`` (CPU, a few seconds). The per-rank log goes
to DIR when given, else to a temporary directory removed at exit.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaGuard, MediaItem
from megatron_media_guard.core.grammar import Grammar
from megatron_media_guard.testing import build_batch

FRAMES = 4  # the seed had 16 frames; 4 keeps the demo small
ENGINE_TOKENS, TRAINER_TOKENS = 2010, 2550  # RADIO tiler at 2400x1080, with and without budget


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-dir", default=None, help="keep the per-rank log here")
    args = parser.parse_args(argv)
    if args.log_dir is not None:
        return run(args.log_dir, keep=True)
    with tempfile.TemporaryDirectory(prefix="media_guard_demo_") as log_dir:
        return run(log_dir, keep=False)


def run(log_dir: str, *, keep: bool) -> int:
    grammar = Grammar.qwen2_vl()
    # sample 0: a short image; sample 1: the video the engine shrank
    batch = build_batch(grammar, [[("image", 64)], [("video", ENGINE_TOKENS)] * FRAMES])
    items = [
        MediaItem(64, sample=0, sample_id="ok-0"),
        *[
            MediaItem(
                TRAINER_TOKENS,
                sample=1,
                modality="video",
                sample_id="rollout-17",
                num_frames=FRAMES,
                frame_hw=(1080, 2400),
            )
            for _ in range(FRAMES)
        ],
    ]
    b, s = batch.input_ids.shape
    h = 64
    emb = torch.randn(b, s, h)
    feats = torch.randn(sum(it.num_features for it in items), h)
    ids = batch.input_ids

    print("== today's merge: masked_scatter with a batch-total check ==")
    mask = torch.isin(ids, torch.tensor(list(grammar.placeholders.values())))
    print(
        f"found {int(mask.sum())} valid placeholders for {feats.shape[0]} projected features"
        " -> crash, no sample, no item, no rank named\n"
    )

    print("== guard, policy=raise ==")
    try:
        MediaGuard(GuardConfig(policy="raise", log_dir=log_dir), grammar=grammar).merge(
            emb, ids, feats, items, step=12
        )
    except MediaAlignmentError as err:
        print(err, "\n")

    print("== guard, policy=drop ==")
    res = MediaGuard(GuardConfig(policy="drop", log_dir=log_dir), grammar=grammar).merge(
        emb, ids, feats, items, loss_mask=torch.ones(b, s), step=12
    )
    print(
        f"actions per sample: {res.report.actions}; loss tokens kept per sample: "
        f"{res.loss_mask.sum(1).int().tolist()}"
    )
    log = Path(log_dir) / "media_guard.rank00000.jsonl"
    lines = log.read_text().splitlines()
    where = log if keep else "a temporary directory, removed now (--log-dir DIR keeps it)"
    print(f"per-rank log: {len(lines)} record(s) in {where}")
    return 0 if res.report.dropped == (1,) else 1


if __name__ == "__main__":
    raise SystemExit(main())
