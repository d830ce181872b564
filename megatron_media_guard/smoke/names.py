"""The smoke job's names (faults, policies), torch-free: ``media-guard smoke --help`` lists
them without importing torch (``faults`` and ``scenarios`` build the batches and import it)."""

from __future__ import annotations

from typing import Literal

Fault = Literal[
    "none",
    "budget_shrink",  # the engine shrank every item of a sample: fewer placeholders than features
    "extra_pad",  # one run holds one placeholder too many
    "offsetting",  # +k in one sample, -k in another: batch totals still agree
    "surplus_feature",  # one item has one feature too many
    "cut_by_max_len",  # the last run of a sample is cut by the sequence limit
    "literal_placeholder",  # a user typed the placeholder token in text
    "swapped_items",  # two items of different lengths swapped in feature order
    "cross_swap",  # two items of different lengths exchanged between two samples
    "video_grid",  # a video's temporal groups disagree (features for one more group)
    "generated_placeholder",  # the policy generated placeholders in a response (RL rollouts)
]
FAULTS: tuple[str, ...] = Fault.__args__  # type: ignore[attr-defined]

POLICIES: tuple[str, ...] = ("raise", "drop", "repair")
DEFAULT_POLICIES: tuple[str, ...] = ("raise", "drop")
