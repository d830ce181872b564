"""The grammars family specs build (marker pairs per modality, placeholders shared by two
modalities): a hypothesis property that the device verdict of the aligned path equals the
per-sample report of the full parse, and table-driven checks of what the grammar accepts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_media_guard import Grammar, GuardConfig, MediaGuard, MediaInputError, MediaItem
from megatron_media_guard.core.interleave import interleave
from megatron_media_guard.families import nemotron_omni

IMG_S, IMG_E, IMG, SO_S, SO_E, SO = 3, 4, 5, 6, 7, 8
TEXT = list(range(20, 40))
NEMOTRON = nemotron_omni.SPEC.grammar(
    SimpleNamespace(config=SimpleNamespace(image_token_id=IMG, audio_token_id=SO)),
    {"<img>": IMG_S, "</img>": IMG_E, "<so_start>": SO_S, "<so_end>": SO_E},
)
MARKERS = {"image": (IMG_S, IMG, IMG_E), "video": (IMG_S, IMG, IMG_E), "audio": (SO_S, SO, SO_E)}


def test_the_nemotron_spec_grammar_has_two_marker_pairs_and_a_shared_placeholder():
    g = NEMOTRON
    assert dict(g.placeholders) == {"image": IMG, "audio": SO}
    assert (g.start_ids, g.end_ids) == ((IMG_S, SO_S), (IMG_E, SO_E))
    assert dict(g.aliases) == {"video": "image"}
    assert g.modality_code("video") == g.modality_code("image") != g.modality_code("audio")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(regions=((9, 10),)), "set both first"),
        (dict(start_id=1, end_id=2, regions=((1, 10),)), "distinct"),
        (dict(aliases={"image": "image"}), "must name a new modality"),
        (dict(aliases={"video": "audio"}), "must name a new modality"),
    ],
)
def test_bad_regions_and_aliases_are_refused(kwargs, match):
    with pytest.raises(MediaInputError, match=match):
        Grammar({"image": 5}, **kwargs)


def _batch(samples):
    rows, items = [], []
    for s, media in enumerate(samples):
        row = TEXT[:3]
        for mod, n in media:
            a, ph, b = MARKERS[mod]
            row = [*row, a, *[ph] * n, b, *TEXT[3:5]]
            items.append(MediaItem(n, sample=s, modality=mod))
        rows.append(row)
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    return ids, items


MEDIA = st.tuples(st.sampled_from(["image", "video", "audio"]), st.integers(1, 5))


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    samples=st.lists(st.lists(MEDIA, max_size=3), min_size=1, max_size=4),
    data=st.data(),
    fault=st.sampled_from(["none", "length", "modality", "cut"]),
)
def test_property_device_verdict_equals_the_per_sample_report(samples, data, fault):
    ids, items = _batch(samples)
    if fault != "none" and items:
        k = data.draw(st.integers(0, len(items) - 1))
        it = items[k]
        if fault == "length":
            items[k] = MediaItem(it.num_features + 1, sample=it.sample, modality=it.modality)
        elif fault == "modality":  # audio <-> image token: a real change; image <-> video: none
            other = "audio" if it.modality != "audio" else "image"
            items[k] = MediaItem(it.num_features, sample=it.sample, modality=other)
        else:  # the row's last token replaced by an opening marker: an unterminated region
            ids[it.sample, -1] = IMG_S
    guard = MediaGuard(GuardConfig(policy="drop"), grammar=NEMOTRON, consensus=False)
    report = guard.check(ids, items)
    feats = torch.randn(sum(i.num_features for i in items), 4)
    res = guard.merge(torch.randn(*ids.shape, 4), ids, feats, items)
    assert res.report.ok == report.ok
    assert set(res.report.dropped) == {s.sample for s in report.mismatched}


@pytest.mark.parametrize(
    "runs, first, second, groups, samples, want",
    [
        ([2, 4, 4], [2], [4, 4], [0, 0], [0, 1, 1], ([0, 1, 1], True)),
        ([4, 4, 4], [4], [4, 4], [0, 0], [0, 1, 1], ([0, 1, 1], True)),  # tubelets stay together
        ([4, 4, 4], [4], [4, 4], [0, 0], [0, 0, 0], (None, False)),  # order open: not unique
        ([4, 2], [2], [4], [0], [0, 0], ([1, 0], True)),
        ([3, 4], [2], [4], [0], [0, 0], (None, False)),  # no interleaving fits
        ([4, 4], [4], [4], None, None, (None, False)),
    ],
)
def test_interleave(runs, first, second, groups, samples, want):
    got, unique = interleave(runs, first, second, groups=groups, run_samples=samples)
    if want[0] is None and not want[1] and got is not None:
        assert not unique  # several fit: one is returned, flagged as not unique
    else:
        assert (got, unique) == want
