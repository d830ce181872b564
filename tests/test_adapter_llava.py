"""The LLaVA adapter runs megatron-core's own LLaVAModel._preprocess_data on CPU."""

from __future__ import annotations

import types

import pytest
import torch

llava_mod = pytest.importorskip("megatron.core.models.multimodal.llava_model")
LLaVAModel = llava_mod.LLaVAModel

from devices import DEVICES  # noqa: E402
from family_checks import records  # noqa: E402
from llava_standins import LLaVAStandIn, kept_identical, same  # noqa: E402

from megatron_media_guard import (  # noqa: E402
    Grammar,
    GuardConfig,
    MediaAlignmentError,
    MediaGuard,
    MediaInputError,
    MediaItem,
)
from megatron_media_guard.adapters import guarded_by, install_llava  # noqa: E402
from megatron_media_guard.core.host import count_transfers  # noqa: E402
from megatron_media_guard.core.outcome import StageOutcome  # noqa: E402
from megatron_media_guard.diagnostics import RankInfo  # noqa: E402

TOK = -200
L = 3  # img_seq_len
H = 4


def make_batch(layout, s=10, seed=0):
    """layout: per sample, a list of (position, tiles). Returns the call's arguments."""
    g = torch.Generator().manual_seed(seed)
    b = len(layout)
    ids = torch.randint(1, 50, (b, s), generator=g)
    tiles = []
    for r, imgs in enumerate(layout):
        for pos, t in imgs:
            ids[r, pos] = TOK
            tiles.append(t)
    nit = torch.tensor(tiles, dtype=torch.int)
    T = sum(tiles)
    emb = torch.randn(L, T, H, generator=g) + torch.arange(T).view(1, T, 1) * 10
    lang = torch.randn(b, s, H, generator=g)
    lm = torch.ones(b, s)
    lab = torch.randint(0, 50, (b, s), generator=g)
    return {"emb": emb, "lang": lang, "ids": ids, "lm": lm, "lab": lab, "nit": nit}


def call(model, x, cache=False, **over):
    """``model._preprocess_data`` on the batch ``x``, its entries ``over`` replaced."""
    x = {**x, **over}
    return model._preprocess_data(
        x["emb"], x["lang"], x["ids"], x["lm"], x["lab"], cache, None, TOK, x["nit"]
    )


def guard_for(policy="raise", **cfg):
    """A guard of the collapsed ``<image>`` token as rank 3, its config ``cfg``."""
    return MediaGuard(GuardConfig(policy=policy, **cfg), Grammar.llava(TOK), rank=RankInfo(rank=3))


def guarded(policy="raise", items=None, cfg=None, **kw):
    """A stand-in built with ``kw``, guarded as rank 3 at step 7 with ``items`` as metadata."""
    model = LLaVAStandIn(**kw)
    handle = install_llava(model, guard_for(policy, **(cfg or {})))
    handle.set_step(7)
    handle.set_items(items)
    return model, handle


LAYOUT = [[(1, 2)], [(2, 1), (5, 1)], [(3, 2)]]  # sample 1 holds two images
# with max length 8 only sample 2's image ([3, 9) after expansion) crosses it
CROSS = [[(1, 1)], [(2, 1), (3, 1)], [(3, 2)]]


def extra_token_batch():
    """Sample 1 holds an extra <image> token: the metadata (returned) gives it one image."""
    x = make_batch([[(1, 2)], [(2, 1), (5, 1)], [(3, 1)]])
    x["nit"] = torch.tensor([2, 1, 1], dtype=torch.int)
    x["emb"] = x["emb"][:, :4]
    return x, [MediaItem(6, sample=0), MediaItem(3, sample=1), MediaItem(3, sample=2)]


ALIGNED = make_batch(LAYOUT)
NO_IMAGES = {**make_batch([[], []]), "emb": torch.zeros(0, 0, 0), "lab": None}


@pytest.mark.parametrize(
    ("x", "kw"),
    [
        (ALIGNED, {}),
        (ALIGNED, {"pre": False}),
        (ALIGNED, {"post": False}),
        (ALIGNED, {"cp": 2}),
        (ALIGNED, {"pp": True, "maxlen": 24}),
        (ALIGNED, {"maxlen": 12}),  # text cut by the max length: not an image, still aligned
        (NO_IMAGES, {}),  # and labels None
    ],
)
def test_aligned_batch_is_bit_identical_with_one_transfer(x, kw):
    ref = call(LLaVAStandIn(**kw), x)
    model, handle = guarded("drop", **kw)
    with count_transfers() as seen:
        out = call(model, x)
    assert same(ref, out) and sum(seen.values()) == 1
    assert handle.last_result.ok and handle.last_result.mode == "as-is"


# metadata: sample 1 owns one image, sample 2 two; the tokens say 2 and 1
SWAPPED = [MediaItem(6, sample=0), MediaItem(3, sample=1)]
SWAPPED += [MediaItem(3, sample=2, sample_id="s2"), MediaItem(6, sample=2, sample_id="s2")]


@pytest.mark.parametrize(
    ("layout", "literal", "maxlen", "items", "sample", "parts"),
    [
        (LAYOUT, None, 64, SWAPPED, 1, ["2 image tokens", "1 num_image_tiles", "'s2'"]),
        # a literal <image> typed in text: the totals disagree
        (LAYOUT, (0, 7), 64, None, 0, ["5 image tokens for 4 num_image_tiles"]),
        # sample 2's image expands to [3, 9): megatron-core would cut it silently; samples 0
        # and 1 fit (their text is cut: fine)
        (CROSS, None, 8, None, 2, ["2, image item 3", "[3, 9)", "language_max_sequence_length 8"]),
    ],
    ids=["count", "totals", "crosses-max-length"],
)
def test_raise_names_rank_step_sample_and_image(layout, literal, maxlen, items, sample, parts):
    x = make_batch(layout)
    if literal is not None:
        x["ids"][literal] = TOK
    model, _ = guarded("raise", items, maxlen=maxlen)
    with pytest.raises(MediaAlignmentError) as e:
        call(model, x)
    for part in ("rank 3", "step 7", f"sample {sample} row {sample}", *parts):
        assert part in str(e.value), part
    assert e.value.context["sample"] == sample


@pytest.mark.parametrize("last", [[(3, 2)], [(8, 1)]], ids=["crosses", "beyond"])
def test_drop_crossing_image_keeps_others_bit_identical_logs_and_masks_the_loss(last, tmp_path):
    maxlen = 8
    x = make_batch([*CROSS[:2], last])
    ref = call(LLaVAStandIn(maxlen=maxlen), x)
    model, handle = guarded("drop", cfg={"log_dir": str(tmp_path)}, maxlen=maxlen)
    emb, labels, lmask = call(model, x)
    res = handle.last_result
    assert res.dropped == (2,) and res.mode == "zero"
    assert emb.shape == ref[0].shape  # same width: the layout is kept
    kept_identical((emb, labels, lmask), ref, {2})  # its (truncated) tiles were not merged
    (drop,) = [r for r in records(tmp_path) if r["event"] == "drop"]
    assert drop["rank"] == 3
    assert (drop["sample"], drop["step"], drop["extra"]["check"]) == (2, 7, "max_length")
    assert drop["tiles"] == last[0][1]
    # the training step's own tensors of the expanded layout, masked out of place
    ones = torch.ones_like(lmask)
    lm, lab = handle.mask_loss(ones, torch.zeros_like(labels))
    assert lm.sum(1).tolist() == [maxlen, maxlen, 0] and torch.equal(ones, torch.ones_like(lm))
    assert (lab[2] == -100).all() and (lab[:2] == 0).all()
    with pytest.raises(MediaInputError, match=r"one row per sample \(3\)"):
        handle.mask_loss(torch.ones(2, maxlen))


def test_drop_count_mismatch_restructures_and_keeps_others():
    x, items = extra_token_batch()
    x["emb"] = x["emb"].detach().requires_grad_(True)
    model, handle = guarded("drop", items)
    emb, labels, lmask = call(model, x)
    assert handle.last_result.dropped == (1,) and handle.last_result.mode == "restructure"
    # kept samples: what the unguarded merge gives for them on their own
    sub = {k: x[k][[0, 2]] for k in ("lang", "ids", "lm", "lab")}
    sub["emb"] = torch.cat([x["emb"][:, :2], x["emb"][:, 3:]], 1)
    sub["nit"] = torch.tensor([2, 1], dtype=torch.int)
    ref = call(LLaVAStandIn(), sub)
    # the dropped sample: zeros (no foreign tile), nothing to learn
    at = [0, 0, 1]  # the reference row of each output row (row 1: dropped)
    kept_identical((emb, labels, lmask), (ref[0][:, at], ref[1][at], ref[2][at]), {1})
    # the removed tile (sample 1's) stays in the graph with a zero gradient
    emb.sum().backward()
    g = x["emb"].grad
    assert g is not None and (g[:, 2] == 0).all() and (g[:, [0, 1, 3]] == 1).all()


def test_drop_missing_image_token_gives_the_sample_its_entries():
    # sample 1 owns two images by the metadata but holds one image token
    x = make_batch([[(1, 2)], [(2, 1)], [(3, 1)]])
    x["nit"] = torch.tensor([2, 1, 1, 1], dtype=torch.int)
    x["emb"] = torch.randn(L, 5, H).requires_grad_(True)
    items = [MediaItem(6, sample=0), MediaItem(3, sample=1), MediaItem(3, sample=1)]
    items.append(MediaItem(3, sample=2))
    with pytest.raises(RuntimeError):
        call(LLaVAStandIn(), x)  # megatron-core: 3 image tokens for 4 entries
    ref = call(LLaVAStandIn(), {**x, "nit": x["nit"][[0, 1, 3]], "emb": x["emb"][:, [0, 1, 2, 4]]})
    model, handle = guarded("drop", items)
    emb, labels, lmask = call(model, x)
    assert handle.last_result.dropped == (1,) and handle.last_result.mode == "restructure"
    w = ref[0].shape[0]
    for r in (0, 2):
        assert torch.equal(emb[:w, r], ref[0][:, r]) and (emb[w:, r] == 0).all()
        assert torch.equal(lmask[r, :w], ref[2][r]) and (lmask[r, w:] == 0).all()
    assert (emb[:, 1] == 0).all() and (labels[1] == -100).all() and (lmask[1] == 0).all()
    emb.sum().backward()  # every tile stays in the graph; the dropped sample's get zero
    g = x["emb"].grad
    assert (g[:, [2, 3]] == 0).all() and (g[:, [0, 1, 4]] == 1).all()


def test_drop_without_items_drops_every_image_sample_keeps_text_only():
    x = make_batch([[(1, 1)], [], [(3, 1)]])
    x["ids"][2, 6] = TOK  # 3 tokens, 2 entries: cannot say which sample is short
    model, handle = guarded("drop")
    emb, labels, lmask = call(model, x)
    assert handle.last_result.dropped == (0, 2)
    alone = {k: (v[[1]] if k in ("lang", "ids", "lm", "lab") else v) for k, v in x.items()}
    alone["nit"] = torch.zeros(0, dtype=torch.int)
    alone["emb"] = torch.zeros(0, 0, H)
    ref = call(LLaVAStandIn(), alone)
    w = ref[0].shape[0]  # the dropped rows keep their tiles (zeroed): the batch may be wider
    assert torch.equal(emb[:w, 1], ref[0][:, 0]) and (emb[w:, 1] == 0).all()
    assert torch.equal(labels[1, :w], ref[1][0]) and (labels[1, w:] == -100).all()
    assert (lmask[[0, 2]] == 0).all() and (emb[:, [0, 2]] == 0).all()


@pytest.mark.parametrize(
    "bad",
    [
        lambda e: e[:, :-1],  # one tile short: nobody can say whose
        lambda e: e.permute(1, 0, 2),  # [tiles, img_seq_len, h]
        lambda e: e.reshape(1, -1, H),  # rows flattened
        lambda e: e[..., :2],  # hidden size
    ],
    ids=["tile-short", "transposed", "flattened", "hidden"],
)
def test_layout_fault_raises_even_under_drop(bad):
    x = make_batch(LAYOUT)
    x["emb"] = bad(x["emb"])
    model, _ = guarded("drop")
    with pytest.raises(MediaAlignmentError, match="layout: image_embeddings"):
        call(model, x)


@pytest.mark.parametrize("post", [True, False], ids=["drops", "raises-without-the-loss"])
def test_nonfinite_tile_drops_its_sample(post):
    x = make_batch(LAYOUT)
    x["emb"] = x["emb"].clone()
    x["emb"][1, 4, 2] = float("nan")  # tile 4 = sample 2's first tile
    ref = call(LLaVAStandIn(), x)
    model, handle = guarded("raise", cfg={"nonfinite": "drop"}, post=post)
    if not post:  # the last stage could not drop it: the first one raises
        with pytest.raises(MediaAlignmentError, match="last pipeline stage cannot see"):
            call(model, x)
        return
    out = call(model, x)
    assert handle.last_result.dropped == (2,) and torch.isfinite(out[0]).all()
    kept_identical(out, ref, {2})


@pytest.mark.parametrize("nonfinite", ["raise", "off"])
def test_huge_finite_tiles_are_not_a_nonfinite_fault(nonfinite):
    x = make_batch(LAYOUT)
    x["emb"] = x["emb"].clone()
    x["emb"][:, 4] = 3e38  # the column sum overflows float32; the values are finite
    ref = call(LLaVAStandIn(), x)
    model, handle = guarded("raise", cfg={"nonfinite": nonfinite})
    assert same(call(model, x), ref) and handle.last_result.ok


def test_first_and_last_stage_reach_the_same_plan():
    x, items = extra_token_batch()
    first, hf = guarded("drop", items, post=False)
    last, hl = guarded("drop", items, pre=False)
    e, _, _ = call(first, x)
    _, labels, lmask = call(last, {**x, "emb": None, "lang": None})
    assert hf.last_result.actions == hl.last_result.actions == ("keep", "drop", "keep")
    assert e.shape[0] == labels.shape[1] and (lmask[1] == 0).all()


def test_install_is_per_instance_and_reversible():
    model, handle = guarded()
    other = LLaVAStandIn()
    assert "_preprocess_data" in vars(model) and "_preprocess_data" not in vars(other)
    assert LLaVAStandIn._preprocess_data is LLaVAModel._preprocess_data
    assert model._preprocess_data.__wrapped__ == types.MethodType(
        LLaVAModel._preprocess_data, model
    )
    assert guarded_by(model._preprocess_data) is handle
    handle.remove()  # a second install, a second remove: test_method_hook
    assert "_preprocess_data" not in vars(model) and guarded_by(model._preprocess_data) is None


def test_inference_cache_and_middle_stage_pass_through():
    x = make_batch(LAYOUT)
    model, _ = guarded()
    out = call(model, x, cache=True)
    assert out[0] is x["lang"] and out[1] is x["lm"]  # megatron-core's own early return
    mid, _ = guarded(pre=False, post=False)
    assert call(mid, x) == (None, None, None)


def test_step_provider_closes_steps_and_counts_microbatches():
    x = make_batch(CROSS)
    cons = types.SimpleNamespace(seen=[], steps=[])  # agrees locally, records rounds and ends
    cons.agree = lambda local: cons.seen.append(local) or StageOutcome.local(local, 3)
    cons.on_step_end = lambda step, counts, guard: cons.steps.append((step, dict(counts)))
    guard = MediaGuard(GuardConfig(policy="drop"), Grammar.llava(TOK), consensus=cons)
    step = {"i": 1}
    model = LLaVAStandIn(maxlen=8)
    handle = install_llava(model, guard, step_provider=lambda: step["i"])
    call(model, x)
    call(model, x)
    assert [o.microbatch for o in cons.seen] == [0, 1] and cons.steps == []
    step["i"] = 2
    call(model, x)
    assert cons.steps[0][0] == 1 and cons.steps[0][1]["dropped"] == 2
    assert handle.last_result.step == 2 and handle.last_result.microbatch == 0
    assert len({o.digest for o in cons.seen}) == 1  # same batch, same plan


@pytest.mark.parametrize("device", DEVICES)
def test_drop_paths_on_the_tensors_device(device):
    x, items = extra_token_batch()
    x["emb"], x["lang"] = x["emb"].to(torch.bfloat16), x["lang"].to(torch.bfloat16)
    outs = {}
    for dev in ("cpu", device):
        xd = {k: v.to(dev) for k, v in x.items()}
        for maxlen in (64, 6):  # restructure (count fault), then zero (crossing image)
            model, handle = guarded("drop", items if maxlen == 64 else None, maxlen=maxlen)
            if maxlen == 6:
                xd = {**xd, "ids": xd["ids"].clone()}
                xd["ids"][1, 5] = 7  # sample 1 now holds one image: consistent
            out = call(model, xd)
            assert out[0].device.type == torch.device(dev).type
            outs[dev, maxlen] = ([t.cpu() for t in out], handle.last_result.dropped)
    assert outs["cpu", 64][1] == (1,) and outs["cpu", 6][1] == (0,)
    for maxlen in (64, 6):
        assert outs["cpu", maxlen][1] == outs[device, maxlen][1]
        assert same(outs["cpu", maxlen][0], outs[device, maxlen][0])


def test_standin_has_every_attribute_the_release_reads():
    """The stand-in ``self`` carries what the release's own ``_preprocess_data`` reads."""
    import inspect
    import re

    reads = set(re.findall(r"self\.(\w+)", inspect.getsource(LLaVAModel._preprocess_data)))
    assert reads and reads <= set(vars(LLaVAStandIn()))
