"""Sound and packed dynamic resolution on megatron-core 0.19.2's own
``LLaVAModel._preprocess_data`` (stand-in ``self`` with the attributes 0.19.2 reads), one row
per sample. Packed THD rows and the Omni contract: ``test_adapter_llava_omni``."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

llava_mod = pytest.importorskip("megatron.core.models.multimodal.llava_model")

from llava_standins import (  # noqa: E402
    HAS_MCORE019,
    NEEDS_MCORE019,
    Mcore019LLaVAStandIn,
    kept_identical,
    same,
)
from llava_standins import omni_guard as guard  # noqa: E402
from llava_standins import omni_standin as standin  # noqa: E402
from omni_batches import IMAGE, SOUND, Example, build  # noqa: E402
from omni_batches import IMAGES_SOUND as EXAMPLES  # noqa: E402

from megatron_media_guard import (  # noqa: E402
    Grammar,
    GuardConfig,
    MediaAlignmentError,
    MediaGuard,
    MediaItem,
)
from megatron_media_guard.adapters import install_llava  # noqa: E402
from megatron_media_guard.core.host import count_transfers  # noqa: E402

pytestmark = pytest.mark.skipif(not HAS_MCORE019, reason=NEEDS_MCORE019)
LLaVAModel = llava_mod.LLaVAModel

ITEMS = [MediaItem(n, sample=s) for n, s in ((6, 0), (6, 1), (4, 1), (8, 2))]


def call(model, batch):
    return model._preprocess_data(**batch.kwargs())


def guarded(batch, policy="raise", items=None, maxlen=4096, cfg=None, **kw):
    model = standin(batch, maxlen, **kw)
    handle = install_llava(model, guard(policy, **(cfg or {})))
    handle.set_step(9)
    handle.set_items(items)
    return model, handle


def short_sound(b):
    b.sound_embeddings_len = torch.tensor([5, 2, 7])


def clips_of_five_rows(b):
    b.sound_embeddings = b.sound_embeddings[:5]  # 5 rows per clip, all placed when padded


def encoder_hidden_state(b):
    b.sound_embeddings, b.sound_embeddings_len = torch.randn(3, 2, 8), None


PAD = {"sound_pad_to_clip_duration": True}
PADDED = [Example(images=[(64, 64)], mel_frames=40)] * 2


@pytest.mark.parametrize(
    "examples, change, kw",
    [
        (EXAMPLES, short_sound, {"pre": False}),  # only the first stage can see the sound
        (PADDED, clips_of_five_rows, PAD),  # every row of a clip is placed
        # a stage without the encoders passes ``encoder_hidden_state`` as the sound embeddings
        # and no lengths: megatron-core reads it only at sound tokens, so neither does the guard
        ([Example(images=[(64, 64)])] * 2, encoder_hidden_state, {}),
    ],
    ids=["last-stage", "pad-to-clip-duration", "encoder-hidden-state"],
)
def test_aligned_calls_are_bit_identical_with_one_transfer(examples, change, kw):
    batch = build(examples)
    change(batch)
    ref = call(standin(batch, **kw), batch)
    model, handle = guarded(batch, "drop", **kw)
    with count_transfers() as seen:
        out = call(model, batch)
    assert sum(seen.values()) == 1, dict(seen)
    assert same(ref, out) and handle.last_result.ok


def test_release_defaults_negative_ids():
    """0.19.2's own defaults: image token -200 (one per image, tiles x img_seq_len), sound -300."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (2, 12), generator=g)
    ids[0, 1], ids[1, 2], ids[0, 4:7], ids[1, 5:7] = -200, -200, -300, -300
    args = dict(
        image_embeddings=torch.randn(3, 3, 4, generator=g),
        language_embeddings=torch.randn(2, 12, 4, generator=g),
        input_ids=ids,
        loss_mask=torch.ones(2, 12),
        labels=torch.randint(0, 50, (2, 12), generator=g),
        use_inference_kv_cache=False,
        inference_context=None,
        image_token_index=-200,
        num_image_tiles=torch.tensor([1, 2], dtype=torch.int),
        sound_embeddings=torch.randn(4, 2, 4, generator=g),
        sound_embeddings_len=torch.tensor([3, 2]),
    )
    ref = LLaVAModel._preprocess_data(Mcore019LLaVAStandIn(img_seq_len=3), **args)
    model = Mcore019LLaVAStandIn(img_seq_len=3)
    install_llava(model, MediaGuard(GuardConfig(), Grammar.llava(-200)))
    assert same(ref, model._preprocess_data(**args))
    args["sound_embeddings_len"] = torch.tensor([2, 2])
    with pytest.raises(MediaAlignmentError, match=r"sample 0 row 0, sound item 0.*3 sound tokens"):
        model._preprocess_data(**args)


def extra_sound_token(b):
    b.input_ids = b.input_ids.clone()
    b.input_ids[1, 0] = SOUND  # a text token becomes a sound token: 4 tokens, 3 rows


def extra_image_token(b):
    b.input_ids = b.input_ids.clone()
    b.input_ids[1, 2] = IMAGE  # an image token the entries do not have


def image_and_sound(b):
    extra_sound_token(b)
    extra_image_token(b)


FAULTS = {
    "sound-short": (
        short_sound,
        ["sample 1 row 1, sound item 1", "3 sound tokens", "2 sound_embeddings_len"],
    ),
    "extra-sound-token": (
        extra_sound_token,
        ["sample 1 row 1, sound item 1", "4 sound tokens", "3 sound_"],
    ),
    "image+sound": (
        image_and_sound,
        ["sample 1", "3 image tokens", "2 num_image_tiles", "4 sound"],
    ),
}


@pytest.mark.parametrize("policy", ["raise", "drop"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_sound_faults_in_one_sample(fault, policy):
    batch = build(EXAMPLES)
    ref = call(standin(batch), batch)
    inject, parts = FAULTS[fault]
    inject(batch)
    with pytest.raises(RuntimeError):  # what megatron-core does on its own (a shape error)
        call(standin(batch), batch)
    model, handle = guarded(batch, policy, items=ITEMS)
    if policy == "raise":
        with pytest.raises(MediaAlignmentError) as e:
            call(model, batch)
        for part in ["rank 1", "step 9", "1 of 3 samples", *parts]:
            assert part in str(e.value), part
        assert e.value.context["sample"] == 1
        return
    out = call(model, batch)
    assert handle.last_result.dropped == (1,) and handle.last_result.mode == "restructure"
    assert {(f.modality, f.check) for f in handle.last_result.faults} >= {("sound", "count")}
    kept_identical(out, ref, {1})


def no_sound_lengths(b):
    b.sound_embeddings_len = None


def image_layout_by_tiles(b):
    b.image_embeddings = b.image_embeddings.view(1, 24, 8)  # [img_seq_len, tiles, h]


def padded_extra_sound_token(b):
    clips_of_five_rows(b)
    extra_sound_token(b)


@pytest.mark.parametrize(
    "examples, change, kw, match",
    [
        (EXAMPLES, short_sound, {"post": False}, "last pipeline stage cannot see the sound"),
        (EXAMPLES, no_sound_lengths, {}, "no sound_embeddings_len"),
        (EXAMPLES, image_layout_by_tiles, {}, r"expected \[24 \(sum of num_image_tiles\), 1"),
        (PADDED, padded_extra_sound_token, PAD, "cannot drop: with sound_pad_to_clip_duration"),
    ],
)
def test_faults_that_raise_under_drop(examples, change, kw, match):
    batch = build(examples)
    change(batch)
    model, _ = guarded(batch, "drop", **kw)
    with pytest.raises(MediaAlignmentError, match=match):
        call(model, batch)


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_nonfinite_sound_rows(policy):
    batch = build(EXAMPLES)
    batch.sound_embeddings = batch.sound_embeddings.clone()
    batch.sound_embeddings[6, 1, 0] = float("nan")  # clip 1 has 3 rows: row 6 is never placed
    model, handle = guarded(batch, "raise", cfg={"nonfinite": policy})
    call(model, batch)
    assert handle.last_result.ok
    batch.sound_embeddings[2, 2, 1] = float("inf")  # clip 2, a placed row
    ref = call(standin(batch), batch)
    if policy == "raise":
        with pytest.raises(MediaAlignmentError, match=r"sample 2 row 2, sound item 2.*nonfinite"):
            call(model, batch)
        return
    out = call(model, batch)
    assert handle.last_result.dropped == (2,) and handle.last_result.mode == "zero"
    assert torch.isfinite(out[0]).all()
    kept_identical(out, ref, {2})


# ---- packed dynamic resolution: img_seq_len 1, per-image counts, [sum, 1, h] --------------


def nan_in_image_2(b):
    b.image_embeddings = b.image_embeddings.clone()
    b.image_embeddings[13, 0, 2] = float("nan")  # image 2 (sample 1) holds rows 12..15


# row 1: text 0..11, <img> 12, its image 13..16, </img> 17, <so_start> 18, sound 19..23
SOUND_PAST = [Example(text=t, images=[(64, 64)], mel_frames=40) for t in (2, 12)]
LONG = [Example(images=[(64, 64)])] * 2 + [Example(images=[(64, 64), (256, 256)])]  # 64 rows
ONE_DROP = {  # examples, fault, guarded(...) arguments, the fault found, the drop's mode
    "sound-past-max-length": (
        SOUND_PAST,
        None,
        {"maxlen": 21},
        {"sample": 1, "modality": "sound", "check": "max_length", "item": 1, "got": (2,)},
        "zero",
    ),
    "dynamic-count": (
        EXAMPLES,
        extra_image_token,
        {"items": ITEMS},
        {"sample": 1, "modality": "image", "check": "count", "expected": (3,), "got": (2,)},
        "restructure",
    ),
    "dynamic-max-length": (
        LONG,
        None,
        {"maxlen": 40},
        {"sample": 2, "check": "max_length", "item": 3, "tiles": 64},
        "zero",
    ),
    "dynamic-nan": (
        EXAMPLES,
        nan_in_image_2,
        {"policy": "raise", "cfg": {"nonfinite": "drop"}},
        {"sample": 1, "check": "nonfinite", "item": 2, "item_in_sample": 1, "got": (1,)},
        "zero",
    ),
}


@pytest.mark.parametrize("case", list(ONE_DROP))
def test_one_fault_drops_its_sample_the_others_bit_identical(case):
    """Sound past the max length; packed dynamic resolution (img_seq_len 1, per-image
    counts, ``[sum, 1, h]``): an image token too many, an image past the max length, NaN."""
    examples, inject, kw, want, mode = ONE_DROP[case]
    batch = build(examples)
    assert batch.dynamic and batch.image_embeddings.shape[1:] == (1, 8)
    ref = call(standin(batch, kw.get("maxlen", 4096)), batch)
    if inject is not None:
        inject(batch)
    model, handle = guarded(batch, **{"policy": "drop", **kw})
    out = call(model, batch)
    (f,) = handle.last_result.faults
    assert {k: getattr(f, k) for k in want} == want
    assert handle.last_result.dropped == (want["sample"],) and handle.last_result.mode == mode
    kept_identical(out, ref, {want["sample"]})


def test_packed_dynamic_count_fault_without_items_drops_every_image_sample():
    batch = build([*EXAMPLES, Example(mel_frames=24)])  # the last sample: text and sound
    extra_image_token(batch)
    model, handle = guarded(batch, "drop")
    out = call(model, batch)
    assert handle.last_result.dropped == (0, 1, 2)
    assert (out[2][3] != 0).any() and (out[2][:3] == 0).all()


def test_sound_metadata_places_a_clip_the_walk_cannot():
    batch = build([Example(mel_frames=40), Example(), Example(mel_frames=56)])
    ref = call(standin(batch), batch)
    # sample 1 holds no sound token, yet a clip of 1 row sits between the other two
    snd = batch.sound_embeddings
    batch.sound_embeddings = torch.cat([snd[:, :1], snd[:, :1], snd[:, 1:]], 1)
    batch.sound_embeddings_len = torch.tensor([5, 1, 7])
    model, handle = guarded(batch, "drop")
    call(model, batch)
    assert handle.last_result.dropped == (0, 2)  # without metadata: every sound sample
    items = [MediaItem(5, 0, "sound"), MediaItem(1, 1, "sound"), MediaItem(7, 2, "sound")]
    handle.set_items(items)
    out = call(model, batch)
    (f,) = handle.last_result.faults
    assert (f.sample, f.modality, f.item, f.expected, f.got) == (1, "sound", 1, (0,), (1,))
    kept_identical(out, ref, {1})


def test_children_see_the_same_release():
    """Spawned test processes (the 4-rank tests) import megatron-core from the same place."""
    import megatron.core

    code = "import importlib.util as u; print(u.find_spec('megatron.core').origin)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == megatron.core.__file__


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_sound_tokens_without_sound_embeddings(policy):
    """0.19.2's forward passes an empty [0, 0, 0] sound tensor when the batch has no clips:
    megatron-core then fails on the sound tokens (``torch.cat`` of no rows)."""
    batch = build(EXAMPLES)
    ref = call(standin(batch), batch)
    batch.sound_embeddings = torch.zeros(0, 0, 0)
    batch.sound_embeddings_len = torch.zeros(0, dtype=torch.long)
    with pytest.raises(ValueError, match="non-empty list"):
        call(standin(batch), batch)
    model, handle = guarded(batch, policy)
    if policy == "raise":
        with pytest.raises(MediaAlignmentError, match="no clip can be assigned"):
            call(model, batch)
        return
    out = call(model, batch)
    assert handle.last_result.dropped == (0, 1, 2)
    assert (out[2] == 0).all() and out[0].shape == ref[0].shape


def test_drop_under_context_parallel_layout():
    """With context_parallel_lm > 1 the merged embeddings stay [b, S, h]."""
    batch = build(EXAMPLES)
    ref = call(standin(batch, cp=2), batch)
    short_sound(batch)
    model, handle = guarded(batch, "drop", cp=2)
    out = call(model, batch)
    assert handle.last_result.dropped == (1,)
    assert (out[0][1] == 0).all() and torch.equal(out[0][[0, 2]], ref[0][[0, 2]])


def test_release_signature():
    """0.19.2's ``_preprocess_data`` as the adapter reads it: the 0.16 positional parameters,
    then keyword-only packed dynamic resolution and sound."""
    params = inspect.signature(LLaVAModel._preprocess_data).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional[-3:] == ["inference_context", "image_token_index", "num_image_tiles"]
    kw = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
    assert kw == [
        "inference_params",
        "is_packed_dynamic_res",
        "sound_embeddings",
        "sound_embeddings_len",
        "sound_timestamps",
    ]
    assert "imgs_sizes" not in params and "media_token_counts" not in params
