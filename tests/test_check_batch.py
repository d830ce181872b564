"""``families.collate.check_batch`` on every registered family with a fixture: an aligned batch
is kept as it is; one run short, or +k/-k across two samples, raises naming the sample (its id
and size) or drops it, and the plain model's forward on the returned batch gives every kept
sample its own forward's output. Its wrong calls name check_batch and what to pass.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field

import pytest
import torch
from family_checks import aud, img, logits, raised_samples, records, vid
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaItem
from megatron_media_guard.core.host import count_transfers
from megatron_media_guard.errors import MediaInputError
from megatron_media_guard.families import family_names
from megatron_media_guard.families.collate import check_batch
from megatron_media_guard.families.inputs import take_items
from megatron_media_guard.families.spec import ModalitySpec, Token, model_encodes
from megatron_media_guard.testing.families.base import Media as M

pytest.importorskip("transformers")
pytest.importorskip("PIL")

pytestmark = pytest.mark.timeout(300)


@dataclass(frozen=True)
class Case:
    """fixture: its module under testing/families; tokens: the markers the config lacks;
    samples: three aligned samples, the first media of samples 0 and 1 single-run items of at
    least two placeholders (the faults shift them); items: pass per-item counts (InternVL);
    sized: the items have a pixel size to name."""

    fixture: str
    samples: tuple
    tokens: dict = field(default_factory=dict)
    items: bool = False
    sized: bool = True


CASES = {
    "nemotron_omni": Case(
        "nemotron_omni",
        # (no video beside images: the plain model cannot take both in one batch)
        ([img(4, 4), aud(40)], [img(2, 4)], [aud(40)]),
        tokens={"<img>": 3, "</img>": 4, "<so_start>": 6, "<so_end>": 7},
    ),
    "gemma3": Case("gemma3", ([img(32, 32)], [img(20, 64)], [img(40, 30)])),
    "kimi_k25": Case("kimi_k25", ([img(4, 6)], [img(4, 4)], [vid(6, 4, 4)])),
    "internvl": Case(
        "internvl",
        ([img(56, 112)], [img(56, 56)], [img(100, 40)]),
        tokens={"<img>": 151665, "</img>": 151666},
        items=True,
    ),
    "qwen2_audio": Case("qwen2_audio", ([aud(100)], [aud(40)], [aud(60)]), sized=False),
    "qwen3_omni": Case(
        "qwen3_omni",
        ([img(4, 6), aud(100)], [img(8, 4), aud(100)], [aud(100)]),
        tokens={"<|vision_end|>": 151653, "<|audio_end|>": 151648},
    ),
    "glm4v": Case("glm4v", ([img(56, 84)], [img(56, 56)], [img(84, 56)])),
    "ernie4_5_vl": Case("ernie4_5_vl", ([img(56, 84)], [img(56, 56)], [img(84, 56)])),
    "mistral3": Case(
        "mistral3",
        ([img(56, 84)], [img(56, 56)], [img(28, 56)]),
        tokens={"[IMG_BREAK]": 12, "[IMG_END]": 13},
    ),
    "llava_onevision": Case(
        "llava_onevision",
        # sample 2 holds two images (base + 1 each): a drop beside it keeps its counts
        ([img(56, 56)], [img(60, 130)], [img(56, 56), img(100, 40)]),
    ),
    "qwen_vl": Case("qwen3_5", ([img(64, 64)], [img(64, 96)], [img(96, 64)])),
}
#: registered families with no fixture here: megatron-core's merges (no processor batch)
NO_FIXTURE = {"llava": "megatron-core LLaVA (collapsed tokens)", "mimo": "megatron-core MIMO"}


@functools.cache
def fixture(name: str):
    """(case, fixture module, tiny model): one model per family, for the session."""
    case = CASES[name]
    F = importlib.import_module(f"megatron_media_guard.testing.families.{case.fixture}")
    return case, F, F.tiny_model(seed=0)


def faulty(b, samples, deltas: dict[int, int]):
    """``samples`` with the first media of sample s written ``deltas[s]`` placeholders off."""
    got: dict = {}  # (sample, modality) -> the feature counts of its items, in prompt order
    for s, mod, n in b.items:
        got.setdefault((s, mod), []).append(n)
    out = []
    for s, sample in enumerate(samples):
        sample = list(sample)
        if s in deltas:
            m = sample[0]
            sample[0] = M(m.modality, m.size, got[(s, m.modality)][0] + deltas[s])
        out.append(sample)
    return out


def check(name, case, b, **kw):
    items = [MediaItem(n, modality=mod) for _, mod, n in b.items] if case.items else None
    tok = case.tokens or None
    return check_batch(name, b.kwargs, config=b.model_config, tokenizer=tok, items=items, **kw)


def batch(F, model, samples):
    b = F.make_batch(model, samples)
    b.model_config = model.config
    return b


FAULTS = {"one run short": {1: -1}, "+k/-k across two samples": {0: 1, 1: -1}}
NAMES = sorted(CASES)


@pytest.mark.parametrize(
    "name, samples, transfers",
    [
        # the runs are checked against the counts on the device (InternVL's tiles against the
        # given items): the verdict is the one transfer
        *[(name, None, 1) for name in NAMES],
        ("nemotron_omni", [[vid(4, 2, 2), aud(40)], [vid(4, 2, 2)]], 1),
        # images and video on the one <image> token with no per-token type: the counts and
        # every run ride in the verdict, the lengths telling the items apart (the plain model
        # takes no such batch)
        ("nemotron_omni", [[img(4, 4), vid(4, 2, 2)], [aud(40)]], 1),
    ],
)
def test_an_aligned_batch_is_kept_as_it_is(name, samples, transfers):
    case, F, model = fixture(name)
    b = batch(F, model, samples or case.samples)
    with count_transfers() as n:
        checked = check(name, case, b)
    assert checked.report.actions == ("keep",) * len(samples or case.samples)
    assert checked.dropped == () and sum(n.values()) == transfers, n
    assert all(checked.batch[k] is v for k, v in b.kwargs.items())


@pytest.mark.parametrize("fault", list(FAULTS))
def test_images_beside_video_on_one_token_never_keep_a_fault(fault):
    """Nemotron Omni's images and video on its one <image> token, no per-token type: the runs
    told apart by their lengths (read with the verdict) keep no faulty sample, and the sample
    with no run on that token is kept."""
    case, F, model = fixture("nemotron_omni")
    samples = [[img(4, 4), vid(4, 2, 2)], [img(8, 4), vid(4, 2, 2)], [aud(40)]]
    b = batch(F, model, faulty(batch(F, model, samples), samples, FAULTS[fault]))
    dropped = check("nemotron_omni", case, b).dropped
    assert set(FAULTS[fault]) <= set(dropped) and 2 not in dropped, dropped


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("name", NAMES)
def test_a_fault_raises_naming_the_sample_or_drops_it_for_the_plain_model(name, fault, tmp_path):
    """Raise: the error and the record name the sample, its id and its size. Drop: the plain
    model's forward on the returned batch gives every kept sample its own forward's output."""
    case, F, model = fixture(name)
    b = batch(F, model, faulty(batch(F, model, case.samples), case.samples, FAULTS[fault]))
    cfg = GuardConfig(policy="raise", log_dir=str(tmp_path))
    sids = ["rollout-a", "rollout-b", "rollout-c"]
    bad = min(FAULTS[fault])

    def run():
        check(name, case, b, guard=cfg, sample_ids=sids)

    assert bad in raised_samples(run, bad, tmp_path)
    rec = next(r for r in records(tmp_path) if r["event"] == "raise" and r["sample"] == bad)
    assert rec["sample_id"] == sids[bad]
    with pytest.raises(MediaAlignmentError) as err:
        run()
    assert repr(sids[bad]) in str(err.value)
    if case.sized:
        assert rec["frame_hw"] is not None
        h, w = rec["frame_hw"]
        assert f"{h}x{w} (HxW)" in str(err.value)

    checked = check(name, case, b)
    assert set(checked.dropped) == set(FAULTS[fault])
    got = logits(model, checked.batch)
    for k in {0, 1, 2} - set(FAULTS[fault]):
        own = batch(F, model, [case.samples[k]])
        want = logits(model, own.kwargs)[0, : own.lengths[0]]
        torch.testing.assert_close(got[k, : b.lengths[k]], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "samples, modality, grid",
    [
        # a 2-frame video's runs (4 + 4) before an image one placeholder over (5)
        ([[vid(2, 4, 4), img(4, 4, n=5)], [img(4, 4)]], "image", [1, 4, 4]),
        # a video one placeholder short (3) before an image of its length (4)
        ([[vid(1, 4, 4, n=3), img(4, 4)], [img(4, 4)]], "video", [1, 4, 4]),
    ],
)
def test_a_shared_tokens_runs_go_to_the_items_their_types_name(samples, modality, grid, tmp_path):
    """GLM4V's video runs on the image token: on the fault path each run takes the next item of
    the modality its ``mm_token_type_ids`` name (as the ``inputs`` mode does), so the record
    names the mismatched item, not the one the run lengths would pair with it."""
    _case, F, model = fixture("glm4v")
    b = batch(F, model, samples)
    cfg = GuardConfig(policy="drop", log_dir=str(tmp_path))
    checked = check_batch("glm4v", b.kwargs, config=model.config, guard=cfg)
    assert checked.dropped == (0,)
    (rec,) = [r for r in records(tmp_path) if r["event"] == "drop"]
    assert (rec["modality"], rec["grid"]) == (modality, grid)


# ---- wrong calls: a MediaInputError that names check_batch and what to pass (issue 27) ----


MAKE = {  # the batch made wrong
    None: lambda kw: kw,
    "no grid": lambda kw: {k: kw[k] for k in ("input_ids", "pixel_values")},
    "float ids": lambda kw: dict(kw, input_ids=kw["input_ids"].float()),
    "float labels": lambda kw: dict(kw, labels=kw["input_ids"].float()),
}
TIED = [MediaItem(1, sample=1), MediaItem(1, sample=0)]  # the model places items in order
TILES = CASES["internvl"].tokens


@pytest.mark.parametrize(
    "family, make, kw, match",
    [
        ("glm4v", "no grid", {}, r"check_batch: glm4v's image inputs lack 'image_grid_thw'"),
        ("glm4v", "float ids", {}, r"^check_batch: input_ids must hold integer"),
        ("glm4v", "float labels", {}, r"^check_batch \(.*\): labels must be integer"),
        ("mistral3", None, {"config": None}, r"check_batch\('mistral3', \.\.\.\) needs config="),
        ("mistral3", None, {}, r"^check_batch: .*pass tokenizer="),
        ("mistral3", None, {"tokenizer": "my-tok"}, r"check_batch: tokenizer='my-tok' cannot"),
        ("glm4v", None, {"sample_ids": ["a"]}, "1 sample_ids for 2 samples"),
        ("glm4v", None, {"items": TIED}, r"check_batch: items= set MediaItem\.sample"),
        ("glm4v", None, {"media": [None] * 3}, r"check_batch\(media=...\) has 3 originals for 2"),
        # InternVL's processor drops which tiles are whose: items= says it, in whole tiles
        ("internvl", None, {"tokenizer": TILES}, r"internvl: the inputs hold \d+ rows .*items="),
        ("internvl", None, {"tokenizer": TILES, "items": [MediaItem(4)] * 2}, "whole rows"),
    ],
)
def test_a_wrong_call_names_check_batch_and_what_to_pass(family, make, kw, match):
    _case, F, model = fixture(family)
    b = batch(F, model, [[img(56, 56)], [img(56, 84)]])
    with pytest.raises(MediaInputError, match=match) as err:
        check_batch(family, MAKE[make](dict(b.kwargs)), **{"config": model.config, **kw})
    assert "MediaGuard" not in str(err.value) and "install_vlm" not in str(err.value)


def test_an_unknown_family_lists_each_name_once():
    """The refusal install_vlm gives (its lines checked in test_wrong_calls)."""
    with pytest.raises(
        MediaInputError, match=r"^check_batch: no family knows the name 'gemma'"
    ) as err:
        check_batch("gemma", {"input_ids": torch.zeros(1, 2, dtype=torch.long)}, config=object())
    assert err.value.context["families"] == list(family_names())


def test_records_carry_the_ids_the_grid_and_the_size_as_in_training(tmp_path):
    """sample_ids by sample, or items= by item (its sample_id and source size); the grid and
    the frame size from the batch's image_grid_thw."""
    _case, F, model = fixture("glm4v")
    b = batch(F, model, [[img(56, 56)], [img(56, 84, n=5)]])
    thw = b.kwargs["image_grid_thw"][1].tolist()
    items = [MediaItem(1, sample_id="img-a"), MediaItem(1, sample_id="img-b", source_hw=(9, 9))]
    for run, ids, sid in [("a", {"sample_ids": [7, 8]}, 8), ("b", {"items": items}, "img-b")]:
        cfg = GuardConfig(policy="drop", log_dir=str(tmp_path / run))
        check_batch("glm4v", b.kwargs, config=model.config, guard=cfg, **ids)
        (rec,) = [r for r in records(tmp_path / run) if r["event"] == "drop"]
        assert (rec["sample"], rec["sample_id"], rec["grid"]) == (1, sid, thw)
        assert rec["frame_hw"] == [14 * thw[1], 14 * thw[2]]


# ---- the counts are the model's arithmetic (torch ops against the host formula) ----


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4000), st.integers(1, 4000), st.booleans(), st.sampled_from([9, 4, 1]))
def test_llava_onevision_counts_on_the_device_are_the_models(h, w, multi, k):
    """anyres_tokens (torch, float64) equals the fixture's host restatement of
    pack_image_features (itself checked against transformers' in test_family_llava_onevision)
    at the shipped geometry (384-px tiles, patch 14, 36 pinpoints) for any size."""
    from transformers import LlavaOnevisionConfig

    from megatron_media_guard.families.anyres_pixels import anyres_tokens
    from megatron_media_guard.testing.families.llava_onevision import (
        llava_onevision_num_features,
    )

    cfg = LlavaOnevisionConfig(vision_aspect_ratio=f"anyres_max_{k}")
    sizes = torch.tensor([[h, w]])
    got = anyres_tokens(sizes, torch.tensor([multi]), cfg).item()
    assert got == llava_onevision_num_features(h, w, cfg, multi_image=multi)


@pytest.mark.parametrize("rows", [2, 3])
def test_rows_are_fed_in_sample_order_only_one_per_item(rows):
    """``take_items`` (every plan's input rewrite) feeds a ``rows`` input in its items' sample
    order; one that is not one row per item (a derived spec's need not be) is refused."""
    mod = ModalitySpec("image", Token(), ("x",), model_encodes, rows=("x", "image_sizes"))
    inputs, order = {"x": torch.arange(rows), "image_sizes": torch.arange(2)}, {"image": [1, 0]}
    if rows == 3:
        with pytest.raises(MediaInputError, match=r"^x holds 3 rows for 2 image items: .* order"):
            take_items(inputs, [mod], order=order)
    else:
        got = take_items(inputs, [mod], order=order)
        assert {k: v.tolist() for k, v in got.items()} == {"x": [1, 0], "image_sizes": [1, 0]}


def test_an_item_no_run_takes_leaves_the_batch_and_the_plain_model_takes_it():
    """A sample's image written as text (its run gone, its rows still in the batch): the item
    no run takes is noted unused and its rows and grid row leave the batch, the rest kept."""
    case, F, model = fixture("glm4v")
    b = batch(F, model, case.samples)
    cfg, ids, types = model.config, b.kwargs["input_ids"], b.kwargs["mm_token_type_ids"]
    marks = (cfg.image_token_id, cfg.image_start_token_id, cfg.image_end_token_id)
    gone = torch.isin(ids[2], torch.tensor(marks))
    ids, types = ids.clone(), types.clone()
    ids[2, gone], types[2, gone] = 0, 0
    grid = b.kwargs["image_grid_thw"]
    b.kwargs = {**b.kwargs, "input_ids": ids, "mm_token_type_ids": types}
    checked = check("glm4v", case, b)
    assert checked.report.actions == ("keep",) * 3
    assert torch.equal(checked.batch["image_grid_thw"], grid[:2])
    assert checked.batch["pixel_values"].shape[0] == int(grid[:2].prod(-1).sum())
    with torch.no_grad():  # the plain model takes it: every run its item
        model(**checked.batch)
