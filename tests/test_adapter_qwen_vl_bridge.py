"""install_qwen_vl on Megatron-Bridge 0.6.2's real ``Qwen25VLModel`` / ``Qwen3VLModel`` (from its
wheel through ``megatron_media_guard.testing.bridge``, beside megatron-core 0.19.2's sources):
``loss_mask_inplace`` drops, packed THD micro-batches, repair. Bridge's own ``__init__`` and
``forward`` (inline merges, MRoPE over the packed rows, deepstack), transformers' tiny towers,
``testing.bridge_models.TinyLanguageModel`` decoding each packed sample alone (GPTModel's
attention needs CUDA). Run by scripts/test_mcore019.sh; skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch
from family_checks import records, spy

from megatron_media_guard import Grammar, GuardConfig, MediaGuard
from megatron_media_guard.testing import bridge as loader

pytest.importorskip("transformers.models.qwen3_vl")
pytest.importorskip("PIL")
REASON = loader.missing()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
if REASON is None:
    from megatron.core.packed_seq_params import PackedSeqParams

from test_adapter_qwen_vl import (  # noqa: E402
    BIG,
    CLIP,
    ENGINE,
    SMALL,
    TRAINER,
    guard_for,
    trainer_batch,
)

from megatron_media_guard.adapters import install_qwen_vl  # noqa: E402
from megatron_media_guard.adapters.launcher import find_vlm  # noqa: E402
from megatron_media_guard.testing.bridge_models import QWEN3, QWEN25, segments  # noqa: E402
from megatron_media_guard.testing.qwen_vl import (  # noqa: E402
    IMAGE,
    VIDEO,
    Sample,
    seed_failure,
    source_items,
)

PAD = 0
FAMILIES = ["qwen2_5_vl", "qwen3_vl"]


def test_the_loader_is_explicit_and_reversible():
    """Runs before the module fixture installs it: nothing in place, then all of it, then
    nothing again (the shims' targets restored, Bridge's modules forgotten)."""
    import sys
    import typing

    before = (hasattr(typing, "override"), torch.cuda.nvtx.range_push, list(sys.meta_path))
    assert not any(m.startswith("megatron.bridge") for m in sys.modules)
    with loader.bridge_modules(loader.find_root()):
        import megatron.bridge.models as pkg
        from megatron.bridge.models.qwen_vl import modeling_qwen25_vl  # noqa: F401

        assert not hasattr(pkg, "GPTModelProvider")  # its __init__ (which imports it) never ran
        assert hasattr(typing, "override")
        assert torch.cuda.is_available() or torch.cuda.nvtx.range_push("x") is None
        with pytest.raises(RuntimeError, match="already installed"):
            loader.install(loader.find_root())
    after = (hasattr(typing, "override"), torch.cuda.nvtx.range_push, list(sys.meta_path))
    assert after == before
    assert not any(m.startswith("megatron.bridge") for m in sys.modules)


@pytest.fixture(scope="module")
def models():
    """Bridge's real classes, one per family, built once with the loader in place (it stays
    for the module: ``Qwen3VLModel.forward`` calls ``torch.cuda.nvtx``)."""
    with loader.bridge_modules(loader.find_root()):
        from megatron_media_guard.testing import bridge_models

        yield {"qwen2_5_vl": bridge_models.qwen25_vl(), "qwen3_vl": bridge_models.qwen3_vl()}


def bridge_args(batch: dict) -> dict:
    keys = ("input_ids", "pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw")
    return {k: batch[k] for k in keys}


def pack(batch: dict, align: int = 8, tail: tuple[int, ...] = ()) -> dict:
    """The [b, s] batch as one THD row: each sample's tokens (right padding stripped), padded to
    a multiple of ``align``, with Megatron's ``PackedSeqParams``; ``tail``: tokens after the last
    sample (the row's padding)."""
    ids, attn = batch["input_ids"], batch["attention_mask"]
    lengths = attn.sum(1).tolist()
    pieces, cu, cu_pad = [], [0], [0]
    for r, n in enumerate(lengths):
        padded = -(-n // align) * align
        pieces.append(torch.cat([ids[r, :n], torch.full((padded - n,), PAD)]))
        cu.append(cu[-1] + n)
        cu_pad.append(cu_pad[-1] + padded)
    out = bridge_args(batch)
    out["input_ids"] = torch.cat([*pieces, torch.tensor(tail, dtype=ids.dtype)])[None]
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    out["packed_seq_params"] = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=t(cu),
        cu_seqlens_kv=t(cu),
        cu_seqlens_q_padded=t(cu_pad),
        cu_seqlens_kv_padded=t(cu_pad),
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    return out


SAMPLES = [Sample((("image", SMALL),)), Sample((("image", BIG),)), Sample((("video", CLIP),))]


PLAIN_ERROR = {  # what Bridge's own forward does with the seed batch
    "qwen2_5_vl": (ValueError, r"Image features and image tokens do not match"),
    "qwen3_vl": (AssertionError, r""),  # reorganize_inputs' count assertion, no message
}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_models_are_bridge_classes_from_the_wheel(models, family):
    model = models[family]
    cls = type(model)
    assert cls.__module__ == {"qwen2_5_vl": QWEN25, "qwen3_vl": QWEN3}[family]
    assert cls.__name__ == {"qwen2_5_vl": "Qwen25VLModel", "qwen3_vl": "Qwen3VLModel"}[family]
    assert cls.forward.__code__.co_filename.startswith(loader.find_root())
    assert find_vlm(model) == ("qwen_vl", model)  # the launcher knows the real class


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
@pytest.mark.parametrize("family", FAMILIES)
def test_drop_keeps_sample_0_bit_identical_and_remove_restores_bridges_forward(
    models, family, packed
):
    """Samples 1 and 2 dropped: the caller's loss mask (what Bridge's forward step builds its
    loss from) zeroed on their tokens; sample 0 equals the batch without their media, by hand;
    after ``remove()`` Bridge's own forward again."""
    _, mixed = seed_failure(family, SAMPLES, ENGINE, TRAINER)
    model = models[family]
    to_model = pack if packed else bridge_args
    batch = to_model(mixed)
    labels = batch["input_ids"].clone()
    loss_mask = torch.ones(labels.shape)
    h = install_qwen_vl(model, guard_for(family, "drop"), loss_mask_inplace=True)
    with torch.no_grad():
        loss = model(**batch, labels=labels, loss_mask=loss_mask)
    assert h.last_result.report.actions == ("keep", "drop", "drop")
    h.remove()
    assert not h.installed and not model._forward_pre_hooks and not model._forward_hooks
    if packed:
        spans = [(0, slice(s, s + n)) for s, n in segments(batch["packed_seq_params"])]
    else:
        spans = [(r, slice(None)) for r in range(len(SAMPLES))]
    assert loss_mask[spans[0]].eq(1).all() and all(loss_mask[sp].eq(0).all() for sp in spans[1:])
    # by hand: samples 1 and 2 without media, sample 0's image alone
    ids = mixed["input_ids"].clone()
    ids[1:][(ids[1:] == IMAGE) | (ids[1:] == VIDEO)] = 151643
    alone = seed_failure(family, SAMPLES[:1], ENGINE, TRAINER)[1]
    by_hand = dict(alone, input_ids=ids, attention_mask=mixed["attention_mask"])
    with torch.no_grad():
        want = model(**to_model(by_hand), labels=labels)
    assert torch.equal(loss[spans[0]], want[spans[0]])  # the dropped rows are masked out
    err, match = PLAIN_ERROR[family]
    with torch.no_grad(), pytest.raises(err, match=match):  # Bridge's own forward again
        model(**bridge_args(mixed))


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_thd_repair_matches_the_engine_sized_batch(models, family):
    engine, mixed = seed_failure(family, SAMPLES, ENGINE, TRAINER)
    model = models[family]
    tower = model.visual if family == "qwen2_5_vl" else model.vision_model
    with spy(tower) as (_, calls), torch.no_grad():
        want = model(**pack(engine), labels=pack(engine)["input_ids"])
        plain_calls = len(calls)
        calls.clear()
        packed = pack(mixed)
        with install_qwen_vl(model, guard_for(family, "repair")) as h:
            h.set_items(source_items(SAMPLES, mixed))  # the originals' sizes
            got = model(**packed, labels=packed["input_ids"])
    assert h.last_result.report.actions == ("keep", "repair", "repair")
    assert len(calls) == plain_calls == (2 if family == "qwen2_5_vl" else 1)
    segs = segments(packed["packed_seq_params"])
    s0, n0 = segs[0]
    assert torch.equal(got[0, s0 : s0 + n0], want[0, s0 : s0 + n0])  # untouched sample
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2)


def test_placeholders_in_the_packed_padding_become_text(models, tmp_path):
    packed = pack(trainer_batch(SAMPLES[:1], "qwen2_5_vl"), tail=(PAD, IMAGE, PAD, PAD))
    model = models["qwen2_5_vl"]
    with pytest.raises(ValueError, match="do not match"):  # the plain model counts it
        model(**packed)
    guard = MediaGuard(GuardConfig(policy="drop", log_dir=str(tmp_path)), Grammar.qwen2_vl())
    with torch.no_grad(), install_qwen_vl(model, guard) as h:
        model(**packed)
    assert h.last_result.report.actions == ("keep",)
    assert [r["action"] for r in records(tmp_path) if r["event"] == "check"] == ["ignored"]
