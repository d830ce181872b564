"""install_llava / install_from_args on Megatron-Bridge 0.6.2's real ``NemotronVLModel`` /
``NemotronOmniModel`` (from its wheel, ``megatron_media_guard.testing.bridge``) around a real
megatron-core 0.19.2 ``LLaVAModel``, the whole forward on CPU, called by keyword as Bridge's
``nemotron_omni_step`` does. Stand-ins (``testing.bridge_models``): the CLIP tower, the GPT
decoder block and the sound encoder (CUDA-only). ``sound_clips`` is always a tensor (Bridge's
``[1, 1]`` zero sentinel for no sound). Run by scripts/test_mcore019.sh; skipped elsewhere.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_media_guard import Grammar, GuardConfig, MediaAlignmentError, MediaGuard, MediaItem
from megatron_media_guard.testing import bridge as loader

REASON = loader.missing()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

from megatron_media_guard.adapters import install_llava  # noqa: E402
from megatron_media_guard.adapters.launcher import (  # noqa: E402
    add_media_guard_args,
    find_vlm,
    install_from_args,
)
from megatron_media_guard.testing.bridge_models import (  # noqa: E402
    NEMOTRON_OMNI,
    NEMOTRON_VL,
    TinySound,
)

IMAGE, SOUND, SEQ, TILE = 12, 14, 16, 4  # TILE: embeddings per 28x28 tile
MEL = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One gloo rank with megatron-core's model-parallel state (the LLaVAModel's layers need
    it), the loader in place, both wrappers built once."""
    dist = pytest.importorskip("torch.distributed")
    from megatron.core import parallel_state as ps

    store = tmp_path_factory.mktemp("store") / "pg"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    try:
        with loader.bridge_modules(loader.find_root()):
            from megatron_media_guard.testing import bridge_models

            yield {k: bridge_models.nemotron(k) for k in ("vl", "omni")}
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def batch(images=(1, 2, 1), sound=(0, 0, 0), seed=0) -> dict:
    """Bridge's forward kwargs for 3 samples: ``images[i]`` image tokens in sample i (one
    28x28 tile each), ``sound[i]`` mel frames of its clip (0: none)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(20, 90, (3, SEQ), generator=g)
    for i, n in enumerate(images):
        ids[i, 2 : 2 + 3 * n : 3] = IMAGE
    frames = [f for f in sound if f]
    for i, f in enumerate(sound):
        if f:
            rows = int(TinySound.rows(torch.tensor(f)))
            ids[i, 10 : 10 + rows] = SOUND
    n = sum(images)
    out = dict(
        images=torch.randn(n, 3, 28, 28, generator=g),
        input_ids=ids,
        position_ids=torch.arange(SEQ).expand(3, -1),
        attention_mask=None,
        labels=ids.roll(-1, 1),
        loss_mask=torch.ones(3, SEQ),
        num_image_tiles=torch.ones(n, dtype=torch.int),
        sound_clips=torch.zeros(1, 1),
    )
    if frames:
        out["sound_clips"] = torch.randn(len(frames), max(frames), MEL, generator=g)
        out["sound_length"] = torch.tensor(frames)
    return out


def guard(policy="raise"):
    return MediaGuard(GuardConfig(policy=policy), Grammar.llava(IMAGE))


def test_the_wrappers_are_bridge_classes_around_a_real_llava_model(models):
    from megatron.core.models.multimodal.llava_model import LLaVAModel

    for kind, name in (("vl", NEMOTRON_VL), ("omni", NEMOTRON_OMNI)):
        w = models[kind]
        assert type(w).__module__ == name and isinstance(w.llava_model, LLaVAModel)
        assert type(w).forward.__code__.co_filename.startswith(loader.find_root())
        assert not hasattr(w, "_preprocess_data")
        assert find_vlm(w) == ("llava", w.llava_model)


def run(model, kw: dict):
    with torch.no_grad():
        return model(**kw)


def same_rows(a, b, rows, upto=None):
    return all(torch.equal(x[rows, :upto], y[rows, :upto]) for x, y in zip(a, b))


SOUNDS = (40, 0, 24)  # clips of 5 and 3 rows in samples 0 and 2


def short_clip(kw: dict) -> dict:
    """The encoder gives sample 2's clip one row fewer than its sound tokens."""
    return dict(kw, sound_length=torch.tensor([40, 16]))


@pytest.mark.parametrize("kind", ["vl", "omni"])
def test_aligned_forward_is_bit_identical(models, kind):
    w = models[kind]
    kw = batch(sound=SOUNDS if kind == "omni" else (0, 0, 0))
    plain = run(w, kw)
    with install_llava(w, guard()) as h:
        out = run(w, kw)
    assert h.module is w.llava_model
    assert same_rows(plain, out, slice(None)) and h.last_result.ok
    assert h.last_result.actions == ("keep",) * 3 and h.last_result.mode == "as-is"


def test_raise_names_the_sample_and_clip_drop_keeps_the_others_and_remove_restores(models):
    w = models["omni"]
    good = batch(sound=SOUNDS)
    ref = run(w, good)
    with install_llava(w, guard()) as h:
        h.set_step(5)
        with pytest.raises(MediaAlignmentError) as e:
            run(w, short_clip(good))
    for part in ("step 5", "sound item 1", "3 sound tokens", "2 sound_embeddings_len"):
        assert part in str(e.value), part
    h = install_llava(w, guard("drop"))
    loss, mask = run(w, short_clip(good))
    assert h.last_result.actions == ("keep", "keep", "drop")
    assert same_rows((loss, mask), ref, slice(0, 2))
    assert mask[2].eq(0).all() and mask[:2].eq(ref[1][:2]).all()
    h.remove()
    assert not {"_preprocess_data", "forward"} & set(vars(w.llava_model))
    with pytest.raises(RuntimeError, match="shape mismatch"):  # the plain model
        run(w, short_clip(good))


def test_image_count_fault_on_nemotron_vl(models):
    w = models["vl"]
    kw = batch(images=(1, 2, 2))  # 5 image tokens, 4 tiles: sample 2 has one too many
    kw["images"], kw["num_image_tiles"] = kw["images"][:4], kw["num_image_tiles"][:4]
    with pytest.raises(RuntimeError, match="split_with_sizes"):  # the plain model
        run(w, kw)
    with install_llava(w, guard("drop")) as h:  # no item metadata: nobody can be cleared
        run(w, kw)
    assert h.last_result.actions == ("drop",) * 3
    with install_llava(w, guard()) as h:
        h.set_items([MediaItem(TILE, sample=s) for s in (0, 1, 1, 2)])
        with pytest.raises(MediaAlignmentError) as e:
            run(w, kw)
    assert "1 of 3 samples" in str(e.value) and "sample 2" in str(e.value)
    with install_llava(w, guard("drop")) as h:
        h.set_items([MediaItem(TILE, sample=s) for s in (0, 1, 1, 2)])
        loss, mask = run(w, kw)
    assert h.last_result.actions == ("keep", "keep", "drop")
    ref_kw = dict(kw, input_ids=kw["input_ids"].clone())
    ref_kw["input_ids"][2][ref_kw["input_ids"][2] == IMAGE] = 50  # sample 2 as text
    ref_kw["images"], ref_kw["num_image_tiles"] = kw["images"][:3], kw["num_image_tiles"][:3]
    ref = run(w, ref_kw)
    n = SEQ + 2 * (TILE - 1)  # sample 1's merged length
    assert same_rows((loss, mask), ref, slice(0, 2), n) and mask[2].eq(0).all()


def packed(kw: dict, align: int = 8) -> dict:
    """The 3 samples as one THD row, as Bridge's in-batch packing gives it: each compact row
    followed by the gap its merged length is padded by, positions restarting per sample,
    ``cu_seqlens_q`` the merged lengths, ``cu_seqlens_q_padded`` the padded ones."""
    from megatron.core.packed_seq_params import PackedSeqParams

    ids, n_img = kw["input_ids"], (kw["input_ids"] == IMAGE).sum(1).tolist()
    merged = [SEQ + n * (TILE - 1) for n in n_img]
    padded = [-(-m // align) * align for m in merged]
    rows = [torch.cat([r, torch.full((p - m,), 2)]) for r, m, p in zip(ids, merged, padded)]
    pos = [torch.arange(len(r)) for r in rows]
    cum = lambda v: torch.tensor([0, *torch.tensor(v).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    out = dict(kw, input_ids=torch.cat(rows)[None], position_ids=torch.cat(pos)[None])
    out["labels"] = out["input_ids"].roll(-1, 1)
    out["loss_mask"] = torch.ones(out["input_ids"].shape)
    out["packed_seq_params"] = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cum(merged),
        cu_seqlens_kv=cum(merged),
        cu_seqlens_q_padded=cum(padded),
        cu_seqlens_kv_padded=cum(padded),
    )
    return out


def test_packed_thd_drop_through_the_wrapper(models):
    w = models["omni"]
    good = packed(batch(sound=SOUNDS))
    ref = run(w, good)
    with install_llava(w, guard("drop")) as h:
        loss, mask = run(w, short_clip(good))
    res = h.last_result
    assert res.packed and res.actions == ("keep", "keep", "drop")
    for sp in res.spans[:2]:  # the kept sub-samples: bit-identical
        sl = slice(sp.merged_start, sp.merged_end)
        assert torch.equal(loss[:, sl], ref[0][:, sl]) and torch.equal(mask[:, sl], ref[1][:, sl])
    sp = res.spans[2]
    assert mask[0, sp.merged_start : sp.merged_end].eq(0).all()


class DDP(torch.nn.Module):
    """A ``.module`` wrapper (as Megatron's DDP / Float16Module)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, **kw):
        return self.module(**kw)


def test_install_from_args_finds_the_llava_model_through_the_wrapper(models):
    w = models["omni"]
    parser = add_media_guard_args(argparse.ArgumentParser())
    args = parser.parse_args(["--media-guard-policy", "drop"])
    chunk = DDP(w)
    assert find_vlm(chunk) == ("llava", w.llava_model)
    group = install_from_args([chunk], args, step_end="manual", environ={})
    try:
        assert [h.kind for h in group] == ["llava"] and group[0].module is w.llava_model
        run(chunk, short_clip(batch(sound=SOUNDS)))
        assert group[0].last_result.actions == ("keep", "keep", "drop")
    finally:
        group.remove()
    assert "_preprocess_data" not in vars(w.llava_model)
