"""Placeholders the policy generated, through megatron-core's LLaVA ``_preprocess_data`` under
``install_llava`` (the loss mask alone marks them: a collapsed grammar has no regions). The
family engine's are every family's (tests/families/test_contract.py), the merge's
tests/test_generated.py's."""

from __future__ import annotations

import pytest
import torch

from megatron_media_guard import Grammar, GuardConfig, MediaAlignmentError, MediaGuard
from megatron_media_guard.diagnostics import RankInfo

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
