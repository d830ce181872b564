"""Synthetic batches with named faults, for tests, benchmarks and the smoke launcher.

A batch is described per sample as a list of media (modality, feature count); the
builder lays out text, region markers and placeholders in a grammar's token ids,
and a fault rewrites either the tokens or the items the way a real pipeline breaks.
The per-token reference parser lives in ``megatron_media_guard.testing``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..core.grammar import Grammar
from ..core.items import MediaItem
from .names import FAULTS, Fault  # noqa: F401  (the names live torch-free, for --help)

TEXT_LOW, TEXT_HIGH = 1000, 1100  # text token ids used by the builder
PAD_ID = 0

#: small token-id grammars for tests (distinct from text ids)
TEST_GRAMMARS = {
    "qwen": Grammar.qwen2_vl(image_pad=5, video_pad=6, vision_start=3, vision_end=4),
    "internvl": Grammar.internvl(image_context=7, img_start=8, img_end=9),
    "pixtral": Grammar.pixtral(img=10, img_break=11, img_end=12),
    "plain": Grammar({"image": 13, "video": 14}),
}


@dataclass(frozen=True)
class SyntheticBatch:
    input_ids: torch.Tensor  # [b, s]
    items: tuple[MediaItem, ...]
    layout: tuple[tuple[tuple[str, int], ...], ...]  # per sample: (modality, placeholders)
    faulty_samples: tuple[int, ...]  # samples the fault touched
    fault: str

    def features(self, hidden: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
        """``[sum(n_i), hidden]``: item i's rows hold ``i + 1`` in column 0 (traceable)."""
        g = torch.Generator().manual_seed(seed)
        total = sum(it.num_features for it in self.items)
        f = torch.randn(total, hidden, generator=g).to(dtype)
        k = 0
        for i, it in enumerate(self.items):
            f[k : k + it.num_features, 0] = i + 1
            k += it.num_features
        return f


def _run_tokens(grammar: Grammar, modality: str, n: int, cols: int = 4) -> list[int]:
    tok = grammar.placeholders[modality]
    if grammar.break_ids:  # Pixtral: rows of `cols` placeholders, breaks between, end last
        body: list[int] = []
        for r in range(0, n, cols):
            body += [tok] * min(cols, n - r) + [grammar.break_ids[0]]
        body[-1] = grammar.end_id if grammar.end_id is not None else body[-1]
        if grammar.start_id is not None and n:  # a marked grammar with breaks: open it
            body = [grammar.start_id, *body]
        return body if n else []
    out = [tok] * n
    if grammar.start_id is not None:
        out = [grammar.start_id, *out]
    if grammar.end_id is not None:
        out = [*out, grammar.end_id]
    return out


def build_batch(
    grammar: Grammar,
    samples: Sequence[Sequence[tuple[str, int]]],
    *,
    seq_len: int | None = None,
    text: int = 3,
    explicit_samples: bool = True,
    seed: int = 0,
    sample_ids: bool = True,
) -> SyntheticBatch:
    """Lays out each sample as ``text (run text)*`` and pads rows to ``seq_len``."""
    rng = random.Random(seed)
    rows: list[list[int]] = []
    items: list[MediaItem] = []
    for s, media in enumerate(samples):
        row = [rng.randrange(TEXT_LOW, TEXT_HIGH) for _ in range(text)]
        for modality, n in media:
            row += _run_tokens(grammar, modality, n)
            row += [rng.randrange(TEXT_LOW, TEXT_HIGH) for _ in range(text)]
            items.append(
                MediaItem(
                    n,
                    sample=s if explicit_samples else None,
                    modality=modality,
                    sample_id=f"s{s}" if sample_ids else None,
                    num_frames=4 if modality == "video" else None,
                    frame_hw=(56, 84),
                )
            )
        rows.append(row)
    width = max(len(r) for r in rows) if seq_len is None else seq_len
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        r = r[:width]
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    layout = tuple(tuple(m) for m in samples)
    return SyntheticBatch(ids, tuple(items), layout, (), "none")


def random_layout(
    rng: random.Random, batch: int, max_items: int = 3, max_len: int = 6, modalities=("image",)
) -> list[list[tuple[str, int]]]:
    return [
        [
            (rng.choice(modalities), rng.randint(1, max_len))
            for _ in range(rng.randint(0, max_items))
        ]
        for _ in range(batch)
    ]


def inject(
    grammar: Grammar,
    layout: Sequence[Sequence[tuple[str, int]]],
    fault: str,
    *,
    seed: int = 0,
    **kw,
) -> SyntheticBatch:
    """Builds ``layout`` then applies ``fault``; ``faulty_samples`` names what it touched.

    Needs a layout where the fault fits (e.g. ``offsetting`` needs two samples with media).
    """
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; one of {list(FAULTS)}")
    with_media = [s for s, m in enumerate(layout) if m]
    need = 2 if fault == "offsetting" else (0 if fault == "none" else 1)
    if len(with_media) < need:
        raise ValueError(
            f"fault {fault!r} needs {need} samples with media, layout has {len(with_media)}"
        )
    clean = build_batch(grammar, layout, seed=seed, **kw)
    if fault == "none":
        return clean
    items = list(clean.items)
    first_item = {s: sum(len(m) for m in layout[:s]) for s in range(len(layout))}
    s0 = with_media[0]
    i0 = first_item[s0]
    touched = (s0,)
    if fault == "budget_shrink":  # tokens were laid out small, features come from the big size
        for k in range(len(layout[s0])):
            it = items[i0 + k]
            items[i0 + k] = replace(it, num_features=it.num_features + max(1, it.num_features // 4))
        return replace(clean, items=tuple(items), faulty_samples=touched, fault=fault)
    if fault == "surplus_feature":
        items[i0] = replace(items[i0], num_features=items[i0].num_features + 1)
        return replace(clean, items=tuple(items), faulty_samples=touched, fault=fault)
    if fault == "video_grid":
        groups = 2
        items[i0] = replace(
            items[i0],
            modality=items[i0].modality,
            num_features=items[i0].num_features * (groups + 1) // groups
            if items[i0].num_features >= groups
            else items[i0].num_features + 1,
        )
        return replace(clean, items=tuple(items), faulty_samples=touched, fault=fault)
    new_layout = [list(m) for m in layout]
    if fault == "extra_pad":
        mod, n = new_layout[s0][0]
        new_layout[s0][0] = (mod, n + 1)
    elif fault == "offsetting":
        s1 = with_media[1]
        n0, n1 = new_layout[s0][0][1], new_layout[s1][0][1]
        k = 1
        items[i0] = replace(items[i0], num_features=n0 + k)
        i1 = first_item[s1]
        if n1 <= k:
            raise ValueError("offsetting needs a second run longer than 1")
        items[i1] = replace(items[i1], num_features=n1 - k)
        touched = (s0, s1)
        return replace(clean, items=tuple(items), faulty_samples=touched, fault=fault)
    elif fault in ("swapped_items", "cross_swap"):
        owner = [smp for smp, media in enumerate(layout) for _ in media]  # item -> sample
        pair = next(
            (
                (a, b)
                for a in range(len(items))
                for b in range(a + 1, len(items))
                if items[a].num_features != items[b].num_features
                and items[a].modality == items[b].modality
                and (fault == "swapped_items" or owner[a] != owner[b])
            ),
            None,
        )
        if pair is None:
            where = "" if fault == "swapped_items" else " in two samples"
            raise ValueError(f"{fault} needs two items of different lengths{where}")
        a, b = pair
        ia, ib = items[a], items[b]
        items[a] = replace(ib, sample=ia.sample, sample_id=ia.sample_id)
        items[b] = replace(ia, sample=ib.sample, sample_id=ib.sample_id)
        touched = tuple(sorted({owner[a], owner[b]}))
        return replace(clean, items=tuple(items), faulty_samples=touched, fault=fault)
    elif fault == "literal_placeholder":
        ids = clean.input_ids.clone()
        tok = next(iter(grammar.placeholders.values()))
        ids[s0, 0] = tok  # the first text token of the sample becomes a placeholder
        return replace(clean, input_ids=ids, faulty_samples=touched, fault=fault)
    elif fault == "generated_placeholder":
        # the sample's last text tokens (its response) hold placeholders the policy wrote;
        # under the loss they are text (GuardConfig.generated), with no labels a finding
        ids = clean.input_ids.clone()
        tok = next(iter(grammar.placeholders.values()))
        last = int(torch.nonzero(ids[s0] != PAD_ID).max())
        n = 2 if kw.get("text", 3) >= 3 else 1
        ids[s0, last - n + 1 : last + 1] = tok
        return replace(clean, input_ids=ids, faulty_samples=touched, fault=fault)
    elif fault == "cut_by_max_len":
        ids = clean.input_ids
        row = ids[s0]
        placeholders = torch.isin(row, torch.tensor(list(grammar.placeholders.values())))
        last = int(torch.nonzero(placeholders).max())
        cut = ids.clone()
        cut[s0, last:] = PAD_ID  # the sequence limit fell inside the last run
        return replace(clean, input_ids=cut, faulty_samples=touched, fault=fault)
    rebuilt = build_batch(grammar, new_layout, seed=seed, **kw)
    return replace(rebuilt, items=tuple(items), faulty_samples=touched, fault=fault)
