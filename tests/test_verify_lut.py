"""The aligned path's checks: the marker-grammar check (core/verify_lut.py) against the tables
check it stands in for (same run count, same structure verdict, same keep-all decision, same
placeholder mask), and the combined run check (length and modality at each run end as one
key) catching any modality swap or length change, for one, two and three modalities."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_media_guard import GuardConfig, MediaGuard, MediaItem
from megatron_media_guard.core import verify as V
from megatron_media_guard.core import verify_lut
from megatron_media_guard.core.grammar import Grammar
from megatron_media_guard.core.runs import TokenLayout, parse_runs
from megatron_media_guard.testing import TEST_GRAMMARS, build_batch

Q = Grammar.qwen2_vl()
INTERN = Grammar.internvl(10, 11, 12)
TEXT = (5, 7)


@st.composite
def batches(draw):
    g = draw(st.sampled_from([Q, INTERN]))
    toks = [*TEXT, g.start_id, g.end_id, *g.placeholders.values()]
    ph = list(g.placeholders.values())
    b, s = draw(st.integers(1, 3)), draw(st.integers(1, 20))
    rows = []
    for _ in range(b):
        if draw(st.booleans()):  # mostly well formed: text and regions of runs
            r: list[int] = []
            while len(r) < s:
                if draw(st.integers(0, 4)) < 2:
                    r.append(draw(st.sampled_from(TEXT)))
                    continue
                body: list[int] = []
                for _ in range(draw(st.integers(0, 2))):
                    body += [draw(st.sampled_from(ph))] * draw(st.integers(1, 4))
                    if draw(st.integers(0, 4)) == 0:  # text inside the region
                        body.append(draw(st.sampled_from(TEXT)))
                r += [g.start_id, *body, g.end_id]
            r = r[:s]
            if draw(st.booleans()):
                r[draw(st.integers(0, s - 1))] = draw(st.sampled_from(toks))
        else:
            r = draw(st.lists(st.sampled_from(toks), min_size=s, max_size=s))
        rows.append(r)
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    ids = torch.tensor(rows, dtype=dtype)
    runs = parse_runs(ids, g).runs
    lens = [r.length for r in runs]
    mods = [g.modality_code(r.modality) for r in runs]
    smp = [r.sample for r in runs]
    if lens and draw(st.booleans()):  # perturb one item
        k = draw(st.integers(0, len(lens) - 1))
        how = draw(st.integers(0, 3))
        if how == 0:
            lens[k] += 1
        elif how == 1:
            del lens[k], mods[k], smp[k]
        elif how == 2 and len(g.placeholders) > 1:
            mods[k] = 1 - mods[k]
        else:
            smp[k] = min(b - 1, smp[k] + 1)
            smp.sort()
    return g, ids, lens, mods, smp if draw(st.booleans()) else None


@settings(max_examples=400, deadline=None)
@given(batches())
def test_marker_check_matches_the_general_check(case):
    g, ids, lens, mods, samples = case
    assert verify_lut.tables(g, False, ids.shape[1], ids.device) is not None
    lay = TokenLayout(ids, g)
    tables = V.item_tables(lens, mods, samples, ids.device)
    fast, _ = V.verify(lay, tables)
    ref = TokenLayout(ids, g)
    runs, findings, bad = (int(v) for v in V._table_parts(ref, tables, ids.device))
    assert fast.runs == runs
    assert (fast.findings == 0) == (findings == 0)
    assert fast.aligned(len(lens)) == (runs == len(lens) and findings == 0 and bad == 0)
    assert torch.equal(lay.ph, ref.ph)


def test_marker_check_is_not_used_where_it_does_not_apply():
    pixtral = Grammar.pixtral(10, 11, 12)
    assert verify_lut.tables(pixtral, False, 8, torch.device("cpu")) is None  # breaks
    assert verify_lut.tables(Q, True, 8, torch.device("cpu")) is None  # packed rows
    far = Grammar({"image": 5}, start_id=1, end_id=10**6)
    assert verify_lut.tables(far, False, 8, torch.device("cpu")) is None  # ids too far apart


@pytest.mark.parametrize("samples", [[0], None])
@pytest.mark.parametrize("extra", [1, 3, 4 + 2, 2 * (4 + 2) + 1])
def test_an_item_longer_than_its_row_never_reads_as_a_later_run(samples, extra):
    """An item declaring more features than its row holds (s = 4 here) is never matched to
    a run of a later sample: its key must not alias ``length + k * (s + 2)`` of row k."""
    img = Q.placeholders["image"]
    ids = torch.tensor([[*TEXT, *TEXT], [Q.start_id, img, Q.end_id, TEXT[0]]])
    n = 4 + extra
    tables = V.item_tables([n], [0], samples, ids.device)
    fast, _ = V.verify(TokenLayout(ids, Q), tables)
    assert not fast.aligned(1)
    # and end to end: the guard diagnoses it (a drop of the sample that holds the run), it
    # does not reach the scatter with one position for n rows
    items = [MediaItem(n, sample=samples[0])] if samples else [MediaItem(n)]
    res = MediaGuard(GuardConfig(policy="drop"), grammar=Q, consensus=False).merge(
        torch.zeros(2, 4, 3), ids, torch.ones(n, 3), items
    )
    assert res.report.dropped and not res.report.ok


# ---- the combined run check ----------------------------------------------------------------
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
    if not items or (fault == "modality" and len(mods) == 1):
        fault = "none"  # nothing to change
    if fault != "none":
        k = data.draw(st.integers(0, len(items) - 1))
        it = items[k]
        if fault == "modality":
            other = data.draw(st.sampled_from([m for m in mods if m != it.modality]))
            items[k] = MediaItem(it.num_features, sample=it.sample, modality=other)
        else:
            items[k] = MediaItem(it.num_features + 1, sample=it.sample, modality=it.modality)
    feats = torch.randn(sum(i.num_features for i in items), 4)
    emb = torch.randn(*batch.input_ids.shape, 4)
    res = MediaGuard(GuardConfig(policy="drop"), grammar=g).merge(
        emb, batch.input_ids, feats, items
    )
    if fault == "none":
        assert res.report.ok and res.report.alignment is None  # decided on the aligned path
    else:
        assert res.report.dropped == (items[k].sample,)
