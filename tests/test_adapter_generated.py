"""Placeholders the policy generated, through the model adapters: a tiny real transformers
Qwen2.5-VL under ``install_qwen_vl`` and megatron-core's LLaVA ``_preprocess_data`` under
``install_llava`` (the loss mask alone marks them: a collapsed grammar has no regions)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_media_guard import Grammar, GuardConfig, MediaAlignmentError, MediaGuard
from megatron_media_guard.diagnostics import RankInfo

pytest.importorskip("transformers")

from megatron_media_guard.adapters import install_qwen_vl
from megatron_media_guard.testing.qwen_vl import (
    IMAGE,
    Sample,
    build_batch,
    patch_of,
    smooth_image,
    tiny_model,
)

FAMILY = "qwen2_5_vl"
TEXT = 151643  # <|endoftext|>: the adapter's text id for this config


@pytest.fixture(scope="module")
def qwen():
    model = tiny_model(FAMILY)
    samples = [Sample((("image", smooth_image(60, 84, s)),)) for s in range(3)]
    batch = build_batch(samples, FAMILY, patch_of(FAMILY), 30 * (patch_of(FAMILY) * 2) ** 2, text=5)
    ids = batch["input_ids"]
    n = ids.shape[1]
    labels = torch.full_like(ids, -100)
    labels[:, n - 4 :] = ids[:, n - 4 :]  # the response
    at = [n - 3, n - 2]
    bad = ids.clone()
    bad[1, at] = IMAGE  # two <|image_pad|> the policy wrote in sample 1's response
    types = batch["mm_token_type_ids"].clone()
    types[1, at] = 1  # as a processor would mark them
    by_hand = ids.clone()
    by_hand[1, at] = TEXT
    rollout = dict(batch, input_ids=bad, mm_token_type_ids=types)
    return model, rollout, dict(batch, input_ids=by_hand), labels, at


def qwen_guard(generated, policy="drop", **kw):
    cfg = GuardConfig(policy=policy, generated=generated, **kw)
    return MediaGuard(cfg, Grammar.qwen2_vl(), consensus=False)


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_qwen_vl_generated_pads_are_fed_as_text(qwen, policy, tmp_path):
    model, rollout, by_hand, labels, at = qwen
    with torch.no_grad():
        ref = model(**by_hand, labels=labels)
        with install_qwen_vl(model, qwen_guard("text", policy, log_dir=str(tmp_path))) as h:
            out = model(**rollout, labels=labels)
    rep = h.last_result.report
    assert rep.actions == ("keep",) * 3 and rep.generated == ((1, tuple(at)),)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    seen = {}
    probe = model.get_input_embeddings().register_forward_pre_hook(
        lambda m, a: seen.update(ids=a[0])
    )  # the ids the model itself embeds
    with torch.no_grad(), install_qwen_vl(model, qwen_guard("text", policy)):
        model(**rollout, labels=labels)
    probe.remove()
    assert seen["ids"][1, at].tolist() == [TEXT, TEXT]
    recs = [json.loads(x) for x in next(tmp_path.glob("*.jsonl")).read_text().splitlines()]
    fed = [r for r in recs if r["action"] == "text"]
    assert [(r["sample"], r["extra"]["positions"], r["extra"]["text_id"]) for r in fed] == [
        (1, at, TEXT)
    ]


def test_qwen_vl_generated_drop_and_raise(qwen):
    model, rollout, by_hand, labels, at = qwen
    with torch.no_grad():
        ref = model(**by_hand, labels=labels)
        with install_qwen_vl(model, qwen_guard("drop", "raise")) as h:
            out = model(**rollout, labels=labels)
        assert h.last_result.report.actions == ("keep", "drop", "keep")
        assert torch.equal(out.logits[0], ref.logits[0]) and torch.equal(
            out.logits[2], ref.logits[2]
        )
        assert h.last_result.labels[1].eq(-100).all()
        with (
            install_qwen_vl(model, qwen_guard("raise", "drop")),
            pytest.raises(
                MediaAlignmentError,
                match=rf"sample 1 row 1: generated placeholder at row 1 positions \{at}",
            ),
        ):
            model(**rollout, labels=labels)


def test_qwen_vl_without_labels_keeps_todays_behaviour(qwen):
    model, rollout, *_ = qwen
    with torch.no_grad(), install_qwen_vl(model, qwen_guard("text", "drop")) as h:
        model(**rollout)
    assert h.last_result.report.actions == ("keep", "drop", "keep")
    assert h.last_result.report.generated == ()


# ---- LLaVA (megatron-core's own _preprocess_data) -------------------------------------------

TOK, L, H = -200, 3, 4


def llava_call(model, x, ids, lm):
    return model._preprocess_data(
        x["emb"], x["lang"], ids, lm, x["lab"], False, None, TOK, x["nit"]
    )


@pytest.fixture
def llava():
    pytest.importorskip("megatron.core.models.multimodal.llava_model")
    from llava_standins import LLaVAStandIn

    g = torch.Generator().manual_seed(0)
    b, s = 3, 10
    ids = torch.randint(1, 50, (b, s), generator=g)
    tiles = []
    for r, (pos, t) in enumerate([(1, 2), (2, 1), (3, 2)]):  # one image per sample, prompt
        ids[r, pos] = TOK
        tiles.append(t)
    T = sum(tiles)
    x = {
        "emb": torch.randn(L, T, H, generator=g),
        "lang": torch.randn(b, s, H, generator=g),
        "lab": torch.randint(0, 50, (b, s), generator=g),
        "nit": torch.tensor(tiles, dtype=torch.int),
    }
    lm = torch.zeros(b, s)
    lm[:, 6:] = 1  # the response
    bad = ids.clone()
    bad[1, [7, 8]] = TOK  # the policy wrote two image tokens in sample 1's response
    by_hand = ids.clone()
    by_hand[1, [7, 8]] = 0  # what the forward embedded there: token 0
    return (
        (lambda: LLaVAStandIn(64, True, True, 1, False, img_seq_len=L, image_token=TOK)),
        x,
        bad,
        by_hand,
        lm,
    )


def llava_guard(generated, policy="drop"):
    cfg = GuardConfig(policy=policy, generated=generated)
    return MediaGuard(cfg, Grammar.llava(TOK), rank=RankInfo(rank=0), consensus=False)


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_llava_generated_image_tokens_are_fed_as_text_before_the_expansion(llava, policy):
    from megatron_media_guard.adapters import install_llava

    make, x, bad, by_hand, lm = llava
    ref = llava_call(make(), x, by_hand, lm)
    model = make()
    with install_llava(model, llava_guard("text", policy)) as h:
        out = llava_call(model, x, bad, lm)
    assert h.last_result.actions == ("keep",) * 3 and h.last_result.ok
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_llava_generated_drop_raise_and_no_loss_mask(llava):
    from megatron_media_guard.adapters import install_llava

    make, x, bad, _by_hand, lm = llava
    model = make()
    with install_llava(model, llava_guard("drop", "raise")) as h:
        llava_call(model, x, bad, lm)
    assert h.last_result.actions == ("keep", "drop", "keep")
    with (
        install_llava(make(), llava_guard("raise", "drop")) as h,
        pytest.raises(
            MediaAlignmentError, match=r"generated placeholder at row 1 positions \[7, 8\]"
        ),
    ):
        llava_call(h.module, x, bad, lm)
    with (
        install_llava(make(), llava_guard("text", "raise")) as h,
        pytest.raises(MediaAlignmentError, match=r"sample 1") as err,
    ):  # no loss mask: as before the change, a count fault
        llava_call(h.module, x, bad, None)
    assert "generated" not in str(err.value)
