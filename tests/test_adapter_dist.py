"""Adapters on 4 gloo ranks: a pre-check that fails on one rank before the stage's
collective still joins it, so every rank raises naming that rank instead of hanging."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks

from megatron_media_guard import Grammar, GuardConfig, MediaGuard, MediaGuardError, MediaItem
from megatron_media_guard.adapters import guard_merge_fn, install_llava, install_mimo
from megatron_media_guard.diagnostics import RankInfo
from megatron_media_guard.ranks.consensus import StageConsensus

llava_mod = pytest.importorskip("megatron.core.models.multimodal.llava_model")
mimo_mod = pytest.importorskip("megatron.core.models.mimo.model.base")

TOK, L, H = -200, 2, 4
IMG = 50
PAD = 99


class TinyMimo:
    align_embeddings_by_token_positions = mimo_mod.MimoModel.align_embeddings_by_token_positions

    def __init__(self):
        self.special_token_ids = {"images": IMG}


def _merge(inputs_embeds, input_ids, image_features):
    return inputs_embeds.masked_scatter((input_ids == PAD).unsqueeze(-1), image_features)


def _llava(bad: bool) -> None:
    ids = torch.tensor([[1, TOK, 2, 3], [4, 5, TOK, 7]])
    if bad:
        ids = ids.unsqueeze(0)  # [1, b, s]: the adapter's own shape check fails
    from llava_standins import LLaVAStandIn  # the release's stand-in ``self``

    model = LLaVAStandIn(64, img_seq_len=L, image_token=TOK)
    guard = _guard(GuardConfig(), "llava", StageConsensus())
    install_llava(model, guard, step_provider=lambda: 7)
    nit = torch.ones(2, dtype=torch.int)
    model._preprocess_data(
        torch.randn(L, 2, H),
        torch.randn(2, 4, H),
        ids,
        torch.ones(2, 4),
        torch.zeros(2, 4, dtype=torch.long),
        False,
        None,
        TOK,
        nit,
    )


def _mimo(bad: bool) -> None:
    ids = torch.tensor([[1, IMG, IMG, 2], [3, 4, IMG, 5]])
    embs = {"text": torch.randn(5, H), "images": torch.randn(3, H)}
    if bad:
        embs["video"] = torch.randn(1, H)  # no special token: the adapter's own check
    model = TinyMimo()
    install_mimo(model, _guard(GuardConfig(), "mimo", StageConsensus()), step_provider=lambda: 7)
    model.align_embeddings_by_token_positions(embs, ids, model.special_token_ids)


def _generic(bad: bool, provider_fails: bool = False) -> None:
    ids = torch.tensor([[1, PAD, PAD, 2], [3, PAD, 4, 5]])
    items = [MediaItem(2, sample=0), MediaItem(1, sample=1)]
    if bad:  # an item of a modality the features mapping lacks: _features_for fails
        items = [MediaItem(2, sample=0, modality="audio"), MediaItem(1, sample=1)]

    def provider():
        if provider_fails:
            raise RuntimeError("the data loader lost the item metadata")
        return items

    guard = _guard(GuardConfig(), "generic", StageConsensus())
    fn = guard_merge_fn(_merge, guard, items_provider=provider, step_provider=lambda: 7)
    return fn(torch.zeros(2, 4, H), ids, {"image": torch.randn(3, H)})


def _guard(config, kind, consensus):
    grammar = {
        "llava": Grammar.llava(TOK),
        "mimo": Grammar({"images": IMG}),
        "generic": Grammar({"image": PAD}),
    }[kind]
    rank = RankInfo(rank=torch.distributed.get_rank())
    return MediaGuard(config, grammar, rank=rank, consensus=consensus)


CASES = {  # name: (culprit rank, call(bad))
    "llava": (2, _llava),
    "mimo": (1, _mimo),
    "generic": (3, _generic),
    "provider": (0, lambda bad: _generic(False, provider_fails=bad)),
}


def adapters_worker(rank: int, world: int) -> dict:
    out = {}
    for name, (culprit, fn) in CASES.items():
        try:
            fn(rank == culprit)
            out[name] = {"raised": None}
        except MediaGuardError as err:  # any library error: the culprit's own, the peers'
            out[name] = {
                "raised": type(err).__name__,
                "msg": str(err),
                "culprit": err.context.get("culprit_rank"),
                "where": err.context.get("where"),
            }
        except Exception as err:
            out[name] = {"raised": type(err).__name__, "msg": str(err), "culprit": None}
    # the ranks are still in step: an aligned call on every rank goes through
    out["after"] = tuple(_generic(False).shape)
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_pre_check_failure_on_one_rank_raises_on_every_rank():
    # pg_timeout above the bound: a rank left waiting shows up as a hang, not a gloo error
    res = run_ranks(adapters_worker, 4, timeout=60, pg_timeout=100)
    own = {
        "llava": "LLaVA input_ids must be [b, s]",
        "mimo": "no special token id for modality 'video'",
        "generic": "item 0 has modality 'audio'",
        "provider": "the data loader lost the item metadata",
    }
    for name, (culprit, _) in CASES.items():
        for rank, o in enumerate(res):
            r = o[name]
            assert own[name] in r.get("msg", ""), (name, rank, r)
            if rank == culprit:
                assert r["culprit"] is None
                if name == "provider":  # not a library error: re-raised as it is
                    assert r["raised"] == "RuntimeError"
                else:  # wrapped once with the where-context
                    assert r["msg"].count(f"rank {culprit}, step 7") == 1, r["msg"]
                    assert r["where"] == f"rank {culprit}, step 7, microbatch 0"
            else:
                # the culprit's failure is a wrong call, not its data: the peers stop with it
                # (ConsensusError), none of them skips it as a data fault
                assert r["raised"] == "ConsensusError" and r["culprit"] == culprit, r
                assert f"failed on rank {culprit}" in r["msg"]
    assert all(o["after"] == (2, 4, H) for o in res)
