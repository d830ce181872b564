"""The aligned path's combined run check (length and modality at each run end as one key):
any modality swap or length change is caught, for one, two and three modalities."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_media_guard import Grammar, GuardConfig, MediaGuard, MediaItem
from megatron_media_guard.testing import TEST_GRAMMARS, build_batch

GRAMMARS = {n: TEST_GRAMMARS[n] for n in ("qwen", "plain", "internvl", "pixtral")}
GRAMMARS["three"] = Grammar({"image": 13, "video": 14, "audio": 15}, start_id=16, end_id=17)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    name=st.sampled_from(list(GRAMMARS)),
    data=st.data(),
    fault=st.sampled_from(["none", "modality", "length"]),
)
def test_property_aligned_iff_every_item_matches_its_run(name, data, fault):
    g = GRAMMARS[name]
    mods = list(g.placeholders)
    layout = data.draw(
        st.lists(
            st.lists(st.tuples(st.sampled_from(mods), st.integers(1, 6)), max_size=3),
            min_size=1,
            max_size=3,
        )
    )
    batch = build_batch(g, layout, text=2)
    items = list(batch.items)
    if fault != "none" and items:
        k = data.draw(st.integers(0, len(items) - 1))
        it = items[k]
        if fault == "modality" and len(mods) > 1:
            other = data.draw(st.sampled_from([m for m in mods if m != it.modality]))
            items[k] = MediaItem(it.num_features, sample=it.sample, modality=other)
        elif fault == "length":
            items[k] = MediaItem(it.num_features + 1, sample=it.sample, modality=it.modality)
        else:
            fault = "none"
    else:
        fault = "none"
    feats = torch.randn(sum(i.num_features for i in items), 4)
    emb = torch.randn(*batch.input_ids.shape, 4)
    res = MediaGuard(GuardConfig(policy="drop"), grammar=g).merge(
        emb, batch.input_ids, feats, items
    )
    if fault == "none":
        assert res.report.ok and res.report.alignment is None  # decided on the aligned path
    else:
        assert res.report.dropped == (items[k].sample,)
