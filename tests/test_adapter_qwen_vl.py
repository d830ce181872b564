"""install_qwen_vl on transformers' real Qwen2.5-VL and Qwen3-VL classes (tiny random configs,
CPU; batches from ``megatron_media_guard.testing.qwen_vl``): what is Qwen's own (MRoPE, deepstack,
grid rows, repair, explicit samples, token types). What every family keeps (aligned bit for bit
in one transfer, raise naming the sample, drop, remove, set_items, keep_tower) is
tests/families/test_contract.py's; the drop's loss mask and bundle through ``install_from_args``
tests/test_launcher_qwen_vl.py's. The seed failure: the token ids carry the engine's shorter
runs, the pixels and grids the trainer's larger size.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from family_checks import records, spy

from megatron_media_guard import Grammar, GuardConfig, MediaAlignmentError, MediaGuard, MediaItem
from megatron_media_guard.core.host import count_transfers
from megatron_media_guard.core.outcome import StageOutcome
from megatron_media_guard.errors import MediaInputError
from megatron_media_guard.geometry import PatchMergeGeometry

pytest.importorskip("transformers.models.qwen3_vl")
pytest.importorskip("PIL")

from megatron_media_guard.adapters import install_qwen_vl, install_vlm
from megatron_media_guard.families import qwen
from megatron_media_guard.testing.qwen_vl import (
    IMAGE,
    VIDEO,
    Sample,
    build_batch,
    patch_of,
    seed_failure,
    smooth_clip,
    smooth_image,
    source_items,
    tiny_model,
)

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
ENGINE, TRAINER = 12, 30  # pixel budgets in merged cells
BIG = smooth_image(150, 200, 1)  # shrunk by the engine
CLIP = smooth_clip(4, 150, 180, 2)  # shrunk by the engine
SMALL = smooth_image(60, 84, 3)  # the same under both budgets
SAMPLES = [Sample((("image", BIG),)), Sample((("video", CLIP),)), Sample((("image", SMALL),))]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


model_for = functools.cache(tiny_model)  # one model per family, built once


def trainer_batch(samples, family: str, **kw) -> dict:
    """The batch the trainer's processor makes: runs, pixels and grids at its budget."""
    cells = (patch_of(family) * 2) ** 2
    return build_batch(samples, family, patch_of(family), TRAINER * cells, **kw)


def guard_for(family: str, policy: str, consensus=None, **cfg) -> MediaGuard:
    f = patch_of(family) * 2  # one geometry per modality, as for the processors' own budgets
    geo = PatchMergeGeometry(
        patch=patch_of(family), merge=2, min_pixels=f * f, max_pixels=TRAINER * f * f
    )
    return MediaGuard(
        GuardConfig(policy=policy, fallback="drop", **cfg),
        grammar=Grammar.qwen2_vl(),
        geometry={"image": geo, "video": geo},
        consensus=consensus,
    )


class Recorder:
    """A consensus that records each round's local outcome."""

    def __init__(self):
        self.seen = []

    def agree(self, local):
        self.seen.append(local)
        return StageOutcome.local(local, 0)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_a_dropped_video_takes_its_second_per_grid_ts_along(as_tensor):
    """Qwen2.5-VL's seconds per grid row follow the kept video rows, as a list or a tensor, in
    the model hook's rewrite and in check_batch (the same rewrite)."""
    from megatron_media_guard.families.collate import check_batch

    family = "qwen2_5_vl"
    clips = [SAMPLES[1], Sample((("video", smooth_clip(4, 56, 56, 5)),))]  # 2nd: same sizes
    _, mixed = seed_failure(family, clips, ENGINE, TRAINER)
    mixed["second_per_grid_ts"] = torch.tensor([1.0, 2.0]) if as_tensor else [1.0, 2.0]
    model = model_for(family)
    checked = check_batch("qwen_vl", mixed, config=model.config)
    assert checked.report.actions == ("drop", "keep")
    got = checked.batch["second_per_grid_ts"]
    assert (got.tolist() if as_tensor else got) == [2.0]
    guard = guard_for(family, "drop")
    with spy(model.model) as (seen, _), torch.no_grad(), install_qwen_vl(model, guard) as h:
        model(**mixed)
    assert h.last_result.report.actions == ("drop", "keep")
    got = seen["second_per_grid_ts"]
    assert (got.tolist() if as_tensor else got) == [2.0]
    assert torch.equal(seen["video_grid_thw"], checked.batch["video_grid_thw"])


@pytest.mark.parametrize("install", [install_vlm, install_qwen_vl], ids=lambda f: f.__name__)
def test_repair_from_the_configs_geometry_matches_the_engine_sizes(family, install, tmp_path):
    """No geometry= from the user (a config, or a guard without one): the vision config's patch
    / merge / temporal patch with the processor's default budgets (a count below the static
    minimum is still the engine's at a smaller one) repair both items from their originals'
    sizes. The repaired batch is the engine-sized one: one tower call as the plain forward, the
    features and the loss; the grids, the token types (not given: derived from the ids) and the
    MRoPE positions (given: left to the model, which recomputes them from the new grids); on
    Qwen3-VL the deepstack rows."""
    engine, mixed = seed_failure(family, SAMPLES, ENGINE, TRAINER)
    model = model_for(family)
    s = dict(patch=patch_of(family), merge=2, temporal_patch=2)
    geometry = (
        {"image": PatchMergeGeometry.qwen3_vl(**s), "video": PatchMergeGeometry.qwen3_vl_video(**s)}
        if family == "qwen3_vl"
        else PatchMergeGeometry.qwen2_vl(**s)
    )
    assert qwen.geometry(model) == geometry
    cfg = GuardConfig(policy="repair", fallback="drop", log_dir=str(tmp_path))
    guard = cfg if install is install_vlm else MediaGuard(cfg, grammar=Grammar.qwen2_vl())
    args = ("mm_token_type_ids", "image_grid_thw", "video_grid_thw")

    def positions(b: dict) -> torch.Tensor:
        rope = model.model.get_rope_index
        return rope(b["input_ids"], *(b[k] for k in args), attention_mask=b["attention_mask"])[0]

    with (
        spy(model.model) as (seen, _),
        spy(model.model.language_model) as (lm, _),
        spy(model.model.visual, lambda o: o.pooler_output) as (_, tower_out),
        torch.no_grad(),
    ):
        ref = model(**engine, labels=engine["input_ids"])
        ref_feats, plain_calls = torch.cat(tower_out), len(tower_out)
        ref_deep = [lm.get(k) for k in ("visual_pos_masks", "deepstack_visual_embeds")]
        tower_out.clear()
        with install(model, guard) as h:
            h.set_items(source_items(SAMPLES, mixed))  # the originals' sizes: an engine replay
            stale = dict(mixed, mm_token_type_ids=None, position_ids=positions(engine))
            out = model(**stale, labels=engine["input_ids"])
    assert h.last_result.report.actions == ("repair", "repair", "keep")
    reasons = [str(r.get("reason")) for r in records(tmp_path)]
    assert not any("no geometry" in r for r in reasons), reasons
    assert len(tower_out) == plain_calls  # one encode per modality, as the plain forward
    for k in args:
        assert torch.equal(seen[k], engine[k]), k
    assert seen["position_ids"] is None
    assert torch.equal(positions(seen), positions(engine))  # MRoPE follows the repaired grids
    cos = torch.nn.functional.cosine_similarity(torch.cat(tower_out), ref_feats, dim=-1)
    print(f"feature cosine to the engine-sized encode: mean {cos.mean():.5f}, min {cos.min():.5f}")
    assert cos.mean() > 0.999 and cos.min() > 0.99, cos
    assert abs(out.loss.item() - ref.loss.item()) < 1e-2 * ref.loss.item()
    if family == "qwen3_vl":  # deepstack follows the repaired items
        mask, embeds = lm["visual_pos_masks"], lm["deepstack_visual_embeds"]
        assert torch.equal(mask, ref_deep[0])
        assert torch.equal(mask, (engine["input_ids"] == IMAGE) | (engine["input_ids"] == VIDEO))
        assert len(embeds) == 2
        for mine, want in zip(embeds, ref_deep[1]):
            assert mine.shape == want.shape == (int(mask.sum()), 64)
            assert torch.nn.functional.cosine_similarity(mine, want, dim=-1).min() > 0.99


@pytest.mark.parametrize(
    "k, change, match",
    [
        (
            0,
            {"modality": "video"},
            r"set_items gave 3 items .* for this call's \{'image': 2, 'video': 1\}",
        ),
        (1, {"sample": None}, r"sample for every item or for none"),
        (
            0,
            {"num_features": 1},
            r"item 0 is image with 1 features; image grid row 0 \(1, \d+, \d+\)",
        ),
    ],
    ids=["modality", "some_samples", "features"],
)
def test_items_that_contradict_the_grids_are_input_errors(k, change, match):
    """One item per grid row, checked against the grids: wrong modalities or samples for some
    items only never take the device path; a declared count that disagrees with its grid row
    is checked on the device and named on the fault path (too few items: above)."""
    family = "qwen2_5_vl"
    model = model_for(family)
    batch = trainer_batch(SAMPLES, family)
    rows = [("image", r) for r in batch["image_grid_thw"].tolist()]
    rows += [("video", r) for r in batch["video_grid_thw"].tolist()]
    items = [
        MediaItem(t * h * w // 4, sample=s, modality=m)
        for (m, (t, h, w)), s in zip(rows, (0, 2, 1))
    ]
    guard = MediaGuard(GuardConfig(policy="drop"), grammar=Grammar.qwen2_vl())
    with torch.no_grad(), install_qwen_vl(model, guard) as h:
        h.set_items(items)
        model(**batch)  # the items as the grids say: aligned
        assert h.last_result.report.ok
        items[k] = dataclasses.replace(items[k], **change)
        h.set_items(items)
        with pytest.raises(MediaInputError, match=match):
            model(**batch)


ROUND = [SAMPLES[0], Sample(())]  # an image and a text-only sample


@pytest.mark.parametrize(
    ("name", "edit", "items"),
    [
        ("pixel rows", lambda b: dict(b, pixel_values=b["pixel_values"][:-1]), None),
        ("no grid", lambda b: dict(b, image_grid_thw=None), None),
        ("items", dict, [MediaItem(1, modality="image"), MediaItem(1, modality="image")]),
    ],
)
def test_an_early_error_joins_the_round_once_as_fatal(name, edit, items):
    """Bad input raised before the round still joins it, once, as fatal: no peer waits for a
    rank that left early."""
    engine, _ = seed_failure("qwen2_5_vl", ROUND, ENGINE, TRAINER)
    model, rec = model_for("qwen2_5_vl"), Recorder()
    with torch.no_grad(), install_qwen_vl(model, guard_for("qwen2_5_vl", "raise", rec)) as h:
        h.set_items(items)
        with pytest.raises(MediaInputError):
            model(**edit(engine))
        assert [o.fatal for o in rec.seen] == [True], name
        model(**engine)  # the next call: one more round, not fatal
    assert [o.fatal for o in rec.seen] == [True, False]


def test_a_failed_resize_falls_back_in_one_round(monkeypatch):
    import megatron_media_guard.families.resize as plan_mod

    def boom(*a, **k):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(plan_mod, "resize_patches", boom)
    _, mixed = seed_failure("qwen2_5_vl", ROUND, ENGINE, TRAINER)
    model, rec = model_for("qwen2_5_vl"), Recorder()
    with torch.no_grad(), install_qwen_vl(model, guard_for("qwen2_5_vl", "repair", rec)) as h:
        model(**mixed)
    assert h.last_result.report.actions == ("drop", "keep")
    assert [(o.fatal, o.dropped, o.repaired) for o in rec.seen] == [(False, 1, 0)]


def test_install_checks_the_guard_geometry_against_the_config(family):
    """(A grammar that is not the model's: tests/test_launcher_qwen_vl.py.)"""
    model = model_for(family)
    other = 16 if family == "qwen2_5_vl" else 14
    geo = {"image": PatchMergeGeometry(patch=other), "video": None}
    bad = MediaGuard(GuardConfig(), grammar=Grammar.qwen2_vl(), geometry=geo)
    with pytest.raises(MediaInputError, match="image geometry has patch"):
        install_qwen_vl(model, bad)


def test_generate_still_works_with_the_hook_installed():
    family = "qwen2_5_vl"
    model = model_for(family)
    batch = {k: v for k, v in trainer_batch(SAMPLES[:1], family).items() if v is not None}
    with torch.no_grad():
        plain = model.generate(**batch, max_new_tokens=2, do_sample=False)
        with install_qwen_vl(model, guard_for(family, "raise")):
            guarded = model.generate(**batch, max_new_tokens=2, do_sample=False)
    assert torch.equal(plain, guarded)


def _rows_out_of_order(batch: dict) -> tuple[dict, list]:
    """The two image rows exchanged (grids and pixels), the items naming each one's sample."""
    pv, grid = batch["pixel_values"], batch["image_grid_thw"]
    n0 = int(grid[0].prod())
    items = [
        MediaItem(int(grid[1].prod()) // 4, sample=2, modality="image"),
        MediaItem(int(grid[0].prod()) // 4, sample=0, modality="image"),
        MediaItem(int(batch["video_grid_thw"][0].prod()) // 4, sample=1, modality="video"),
    ]
    return dict(
        batch, image_grid_thw=grid.flip(0), pixel_values=torch.cat([pv[n0:], pv[:n0]])
    ), items


def _stale_token_types(batch: dict) -> tuple[dict, None]:
    stale = batch["mm_token_type_ids"].clone()
    stale[0, :2] = 1  # text typed as image: get_rope_index would take a grid row for it
    return dict(batch, mm_token_type_ids=stale), None


@pytest.mark.parametrize(
    "edit, action, transfers",
    [
        (_rows_out_of_order, "reordered", None),
        (_stale_token_types, "rebuilt", 1),  # the verdict said it: the rebuild needs no transfer
    ],
)
def test_rows_out_of_order_and_stale_token_types_are_put_right(
    family, edit, action, transfers, tmp_path
):
    """Image rows out of token order with explicit samples are put back; token types that
    disagree with the ids are rebuilt: the plain forward of the right batch."""
    other = smooth_image(84, 56, 4)
    samples = [Sample((("image", SMALL),)), Sample((("video", CLIP),)), Sample((("image", other),))]
    batch = trainer_batch(samples, family)
    edited, items = edit(batch)
    model = model_for(family)
    guard = guard_for(family, "raise", log_dir=str(tmp_path))
    with torch.no_grad():
        want = model(**batch).logits
        with install_qwen_vl(model, guard) as h, count_transfers() as seen:
            h.set_items(items)
            got = model(**edited).logits
    assert h.last_result.report.actions == ("keep",) * 3
    assert torch.equal(got, want)
    assert transfers is None or sum(seen.values()) == transfers, seen
    assert [r["action"] for r in records(tmp_path)] == [action]


def _split_video() -> dict:
    """Two clips the engine sampled 4 frames of each (2 groups each), the trainer 6 of the first
    and 2 of the second: the same 4 groups of the same size, grouped 3 + 1 (the runs of video
    0's third group lie in sample 1: tests/test_adapter_qwen_vl_checks.py)."""

    def clips(frames):
        videos = [smooth_clip(n, 96, 96, seed) for n, seed in zip(frames, (1, 5))]
        return build_batch([Sample((("video", v),)) for v in videos], "qwen3_vl", 16, 12 * 32**2)

    mixed, trainer = clips((4, 4)), clips((6, 2))
    mixed.update(pixel_values_videos=trainer["pixel_values_videos"])
    mixed.update(video_grid_thw=trainer["video_grid_thw"])
    assert mixed["video_grid_thw"][:, 0].tolist() == [3, 1]
    return mixed


def test_real_qwen3_vl_trains_silently_on_the_split_video_and_the_guard_drops_it(tmp_path):
    mixed, model = _split_video(), model_for("qwen3_vl")
    with torch.no_grad():
        model(**mixed)  # the plain model: no error at all
    for policy in ("repair", "drop"):
        with torch.no_grad(), install_qwen_vl(model, guard_for("qwen3_vl", policy)) as h:
            model(**mixed)
        assert h.last_result.report.actions == ("drop", "drop"), policy
    guard = guard_for("qwen3_vl", "raise", log_dir=str(tmp_path))
    with install_qwen_vl(model, guard), pytest.raises(MediaAlignmentError) as err:
        model(**mixed)
    thw = mixed["video_grid_thw"][0].tolist()
    msg = str(err.value)  # both samples, with the video's grid
    assert "sample 0" in msg and "sample 1" in msg and f"grid {'x'.join(map(str, thw))}" in msg
    recs = records(tmp_path)
    assert [r["sample"] for r in recs if r["event"] == "raise"] == [0, 1]
    split = [r for r in recs if r["event"] == "check" and r["action"] == "split"]
    assert [r["reason"] for r in split] == [
        f"video 0 grid {tuple(thw)}: its runs fall in samples [0, 1]"
    ]
