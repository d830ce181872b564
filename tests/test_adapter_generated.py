"""Placeholders the policy generated, through megatron-core's LLaVA ``_preprocess_data`` under
``install_llava`` (the loss mask alone marks them: a collapsed grammar has no regions). The
family engine's are every family's (tests/families/test_contract.py), the merge's
tests/test_generated.py's."""

from __future__ import annotations

import pytest
import torch
from test_adapter_llava import TOK, TinyLLaVA, call, make_batch  # skips without megatron-core

from megatron_media_guard import Grammar, GuardConfig, MediaAlignmentError, MediaGuard
from megatron_media_guard.adapters import install_llava
from megatron_media_guard.diagnostics import RankInfo


@pytest.fixture
def llava():
    """(batch, ids where the policy wrote two image tokens in sample 1's response, the ids the
    forward embedded there by hand: token 0); the loss mask covers the responses."""
    x = make_batch([[(1, 2)], [(2, 1)], [(3, 2)]])  # one image per sample, in the prompt
    x["lm"] = torch.zeros_like(x["lm"])
    x["lm"][:, 6:] = 1
    bad, by_hand = x["ids"].clone(), x["ids"].clone()
    bad[1, [7, 8]] = TOK
    by_hand[1, [7, 8]] = 0
    return x, bad, by_hand


def llava_guard(generated, policy="drop"):
    cfg = GuardConfig(policy=policy, generated=generated)
    return MediaGuard(cfg, Grammar.llava(TOK), rank=RankInfo(rank=0), consensus=False)


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_llava_generated_image_tokens_are_fed_as_text_before_the_expansion(llava, policy):
    x, bad, by_hand = llava
    ref = call(TinyLLaVA(), x, ids=by_hand)
    model = TinyLLaVA()
    with install_llava(model, llava_guard("text", policy)) as h:
        out = call(model, x, ids=bad)
    assert h.last_result.actions == ("keep",) * 3 and h.last_result.ok
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_llava_generated_drop_raise_and_no_loss_mask(llava):
    x, bad, _by_hand = llava
    model = TinyLLaVA()
    with install_llava(model, llava_guard("drop", "raise")) as h:
        call(model, x, ids=bad)
    assert h.last_result.actions == ("keep", "drop", "keep")
    with (
        install_llava(TinyLLaVA(), llava_guard("raise", "drop")) as h,
        pytest.raises(
            MediaAlignmentError, match=r"generated placeholder at row 1 positions \[7, 8\]"
        ),
    ):
        call(h.module, x, ids=bad)
    with (
        install_llava(TinyLLaVA(), llava_guard("text", "raise")) as h,
        pytest.raises(MediaAlignmentError, match=r"sample 1") as err,
    ):  # no loss mask: as before the change, a count fault
        call(h.module, x, ids=bad, lm=None)
    assert "generated" not in str(err.value)
