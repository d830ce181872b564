"""Placeholders the policy generated, through megatron-core's LLaVA ``_preprocess_data`` under
``install_llava`` (the loss mask alone marks them: a collapsed grammar has no regions). The
family engine's are every family's (tests/families/test_contract.py), the merge's
tests/test_generated.py's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core.models.multimodal.llava_model")

from llava_standins import LLaVAStandIn
from test_adapter_llava import TOK, call, guard_for, make_batch, same

from megatron_media_guard import MediaAlignmentError
from megatron_media_guard.adapters import install_llava


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


@pytest.mark.parametrize(
    ("generated", "policy", "loss_mask", "want"),
    [
        ("text", "raise", True, ("keep",) * 3),  # fed as text before the expansion
        ("text", "drop", True, ("keep",) * 3),
        ("drop", "raise", True, ("keep", "drop", "keep")),
        ("raise", "drop", True, r"generated placeholder at row 1 positions \[7, 8\]"),
        ("text", "raise", False, r"sample 1"),  # no loss mask: as before the change, a count fault
    ],
)
def test_llava_generated_image_tokens(llava, generated, policy, loss_mask, want):
    x, bad, by_hand = llava
    lm = {} if loss_mask else {"lm": None}
    model = LLaVAStandIn()
    with install_llava(model, guard_for(policy, generated=generated)) as h:
        if isinstance(want, str):
            with pytest.raises(MediaAlignmentError, match=want) as err:
                call(model, x, ids=bad, **lm)
            assert ("generated" in str(err.value)) == loss_mask
            return
        out = call(model, x, ids=bad)
    assert h.last_result.actions == want
    if generated == "text":  # what the forward embedded there by hand: token 0
        assert h.last_result.ok and same(out, call(LLaVAStandIn(), x, ids=by_hand))
