"""The vision tower kept in step under data-parallel wrappers: 2 gloo ranks on CPU, the real tiny
transformers Qwen2.5-VL under ``install_qwen_vl`` (``policy="drop"``), 3 SGD steps per scenario,
under FSDP2 as NeMo-RL shards a VLM (each decoder layer, the vision tower, the root) and DDP
(``find_unused_parameters=False``). Rank 0 trains on an image and a text sample; rank 1 has every
image dropped (step 1: every sample) or is text-only.

Each step: the loss is finite and every gradient equals the reference (an unwrapped copy on each
rank's batch with the drop done by hand and the same dummy tower call, averaged over the ranks);
the dropping / text-only rank's tower gradient is zero; the parameters agree after the steps.
"""

from __future__ import annotations

import pytest
from dist_harness import data_parallel, full_grads, run_ranks

pytest.importorskip("transformers.models.qwen2_5_vl")
pytest.importorskip("PIL")

FAMILY = "qwen2_5_vl"
STEPS = 3
LR = 0.05


def _batches(scenario: str, step: int) -> list[tuple[dict, set[int]]]:
    """Per rank: the batch and its samples the guard must drop."""
    from test_adapter_qwen_vl import BIG, ENGINE, SMALL, TRAINER, trainer_batch

    from megatron_media_guard.testing.qwen_vl import Sample, seed_failure, smooth_image

    good = trainer_batch([Sample((("image", SMALL),)), Sample(())], FAMILY, text=6)
    big = [Sample((("image", BIG),)), Sample((("image", smooth_image(150, 200, 2)),))]
    if scenario == "text":
        other = trainer_batch([Sample(()), Sample(())], FAMILY, text=9)
        return [(good, set()), (other, set())]
    if step == 1:  # every sample of the micro-batch dropped
        _, bad = seed_failure(FAMILY, big, ENGINE, TRAINER)
        return [(good, set()), (bad, {0, 1})]
    _, bad = seed_failure(FAMILY, [big[0], Sample(())], ENGINE, TRAINER)
    return [(good, set()), (bad, {0})]


def _by_hand(batch: dict, drop: set[int], text_id: int) -> tuple[dict, object]:
    """The drop done by hand: (inputs, labels). Only dropped samples hold media here."""
    import torch

    from megatron_media_guard.testing.qwen_vl import IMAGE, VIDEO

    ids = batch["input_ids"]
    labels = ids.clone()
    if not drop:
        return dict(batch), labels
    rows = torch.zeros(ids.shape[0], 1, dtype=torch.bool)
    rows[sorted(drop)] = True
    ph = ((ids == IMAGE) | (ids == VIDEO)) & rows
    out = dict(batch, input_ids=ids.masked_fill(ph, text_id))
    out["mm_token_type_ids"] = batch["mm_token_type_ids"].masked_fill(ph, 0)
    out.update(pixel_values=None, image_grid_thw=None)
    return out, labels.masked_fill(rows, -100)


def _reference_loss(model, batch: dict, labels, merge: int):
    """The plain model's loss, with the dummy tower call (one merge x merge cell of zeros)
    kept at a zero weight when the batch feeds the tower nothing; every label ignored: a zero
    that depends on the logits (the plain mean over no label would be NaN)."""
    import torch

    tower = model.model.visual
    dummy = None
    if batch.get("pixel_values") is None:
        patch_dim = tower.patch_embed.proj.weight[0].numel()
        o = tower(torch.zeros(merge * merge, patch_dim), grid_thw=torch.tensor([[1, merge, merge]]))
        dummy = (o.last_hidden_state.sum() + o.pooler_output.sum()) * 0.0
    out = model(**batch, labels=labels)
    loss = out.logits.sum() * 0.0 if bool(labels.eq(-100).all()) else out.loss
    return loss if dummy is None else loss + dummy


def train_worker(rank: int, world: int, layout: str) -> dict:
    import copy

    import torch

    from megatron_media_guard import Grammar, GuardConfig, MediaGuard
    from megatron_media_guard.adapters import install_qwen_vl
    from megatron_media_guard.diagnostics import RankInfo
    from megatron_media_guard.families import qwen
    from megatron_media_guard.ranks.consensus import StageConsensus
    from megatron_media_guard.testing.qwen_vl import tiny_model

    out: dict = {}
    for scenario in ("drop", "text"):
        model = tiny_model(FAMILY).train()
        for table in (model.model.language_model.embed_tokens, model.lm_head):
            table.requires_grad_(False)  # 19.4M of the 19.6M parameters: kept out for speed
        ref = copy.deepcopy(model)
        text_id = qwen.SPEC.text.resolve(model)  # a dropped sample's placeholders become it
        merge = qwen.sizes(model)["merge"]
        guard = MediaGuard(
            GuardConfig(policy="drop"),
            grammar=Grammar.qwen2_vl(),
            rank=RankInfo(rank=rank),
            consensus=StageConsensus(),
        )
        handle = install_qwen_vl(model, guard)
        shard = [*model.model.language_model.layers, model.model.visual]
        wrapped, inner = data_parallel(model, layout, shard)
        params = {n: p for n, p in inner.named_parameters() if p.requires_grad}
        ref_params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
        opt = torch.optim.SGD(list(params.values()), lr=LR, foreach=False)
        ref_opt = torch.optim.SGD(list(ref_params.values()), lr=LR, foreach=False)
        steps = []
        for step in range(STEPS):
            per_rank = _batches(scenario, step)
            batch, _ = per_rank[rank]
            loss = wrapped(**batch, labels=batch["input_ids"].clone()).loss
            loss.backward()
            dropped = guard.counters["dropped"]
            grads = full_grads(params)
            want = {n: torch.zeros_like(p) for n, p in ref_params.items()}
            local = {}
            for r, (b, drop) in enumerate(per_rank):
                hb, labels = _by_hand(b, drop, text_id)
                ref.zero_grad(set_to_none=True)
                rl = _reference_loss(ref, hb, labels, merge)
                rl.backward()
                local[r] = float(rl)
                for n, p in ref_params.items():
                    if p.grad is not None:
                        want[n] += p.grad / world
                if r == 1:  # the dropping / text-only rank: its tower gradient is zero
                    tower = [p.grad for p in ref.model.visual.parameters()]
                    tower_zero = all(g is not None and not g.any() for g in tower)
            missing = [n for n, g in grads.items() if g is None]
            diff = max(float((g - want[n]).abs().max()) for n, g in grads.items() if g is not None)
            for n, p in ref_params.items():
                p.grad = want[n]
            opt.step()
            ref_opt.step()
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
            steps.append(
                dict(
                    loss=float(loss),
                    ref_loss=local[rank],
                    missing=missing,
                    grad_diff=diff,
                    tower_zero=tower_zero,
                    dropped=dropped,
                )
            )
        final = {}
        for n, p in params.items():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            final[n] = float((full.detach() - ref_params[n].detach()).abs().max())
        out[scenario] = dict(steps=steps, param_diff=max(final.values()))
        handle.remove()
    return out


def _check(res: list[dict]) -> None:
    import math

    for rank, r in enumerate(res):
        for scenario, got in r.items():
            where = f"rank {rank}, {scenario}"
            for k, s in enumerate(got["steps"]):
                assert math.isfinite(s["loss"]), (where, k, s)
                assert not s["missing"], (where, k, s["missing"][:5])
                tol = 1e-5 * max(1.0, abs(s["ref_loss"]))
                assert abs(s["loss"] - s["ref_loss"]) <= tol, (where, k, s)
                assert s["grad_diff"] <= 1e-6, (where, k, s["grad_diff"])
                assert s["tower_zero"], (where, k)
            assert got["param_diff"] <= 1e-6, (where, got["param_diff"])
    drops = [s["dropped"] for s in res[1]["drop"]["steps"]]
    assert drops == [1, 3, 4], drops  # cumulative: 1, then 2 (all), then 1
    assert res[0]["drop"]["steps"][-1]["dropped"] == 0


@pytest.mark.dist
@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", ["fsdp2", "ddp"])
def test_dropped_and_text_only_ranks_train_in_step(layout):
    res = run_ranks(train_worker, 2, args=(layout,), timeout=120, pg_timeout=30)
    _check(res)
