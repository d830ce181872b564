"""``GuardConfig.keep_tower`` on the real tiny transformers Qwen2.5-VL / Qwen3-VL (one process)
where a call had media (all dropped, or fed), with ``inputs_embeds`` and in decoding steps, and
``adapters.tower`` itself (the knob's values: tests/test_config_env.py). A text-only call under each mode is every family's
(tests/families/test_contract.py, tests/tower_check.py); the 2-rank FSDP2 / DDP loops are
tests/test_parallel_tower.py's."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from megatron_media_guard import Grammar, GuardConfig, MediaGuard
from megatron_media_guard.adapters.method_hook import Hook
from megatron_media_guard.adapters.tower import TowerKeeper, float_leaves
from megatron_media_guard.errors import MediaInputError

pytest.importorskip("transformers.models.qwen3_vl")
pytest.importorskip("PIL")

from test_adapter_qwen_vl import ENGINE, SAMPLES, SMALL, TRAINER, trainer_batch

from megatron_media_guard.adapters import install_qwen_vl
from megatron_media_guard.testing.qwen_vl import Sample, seed_failure, tiny_model

FAMILIES = ("qwen2_5_vl", "qwen3_vl")


@functools.cache
def model_for(family: str) -> torch.nn.Module:
    return tiny_model(family).train()


def batch(family: str, kind: str) -> dict:
    if kind == "text":
        return trainer_batch([Sample(()), Sample(())], family, text=7)
    if kind == "image":
        return trainer_batch([Sample((("image", SMALL),)), Sample(())], family)
    return seed_failure(family, SAMPLES[:2], ENGINE, TRAINER)[1]  # "dropped": image and video


def test_keeper_anchors_the_embeddings_once_else_the_output():
    emb = torch.nn.Embedding(10, 4)
    tower = torch.nn.Linear(3, 2)
    keeper = TowerKeeper()
    hook = Hook(emb, "forward", keeper, post=keeper.into_embeddings).install()
    keeper.run(lambda: {"a": tower(torch.zeros(1, 3)), "n": torch.ones(1, dtype=torch.long)})
    e1 = emb(torch.tensor([1, 2]))
    e2 = emb(torch.tensor([3]))  # a second call: already placed
    assert e1.grad_fn.name() == "AddBackward0" and e2.grad_fn.name() == "EmbeddingBackward0"
    assert keeper.attach({"logits": e1}) is None  # the embeddings took it: nothing to add
    e1.sum().backward()
    assert tower.weight.grad is not None and not tower.weight.grad.any()
    keeper.run(lambda: (tower(torch.zeros(1, 3)),))
    out = keeper.attach({"logits": torch.ones(2, requires_grad=True)})  # embeddings not called
    assert out["logits"].grad_fn.name() == "AddBackward0"
    assert keeper.attach({"logits": torch.ones(1)}) is None  # attached once: nothing left
    hook.remove()
    keeper.run(lambda: tower(torch.zeros(1, 3)))
    assert emb(torch.tensor([1])).grad_fn.name() == "EmbeddingBackward0"  # hook gone
    with pytest.raises(MediaInputError, match="no floating-point tensor"):
        keeper.run(lambda: torch.ones(1, dtype=torch.long))
    assert len(float_leaves({"x": [torch.ones(1), None, (torch.zeros(2),)]})) == 2


@contextlib.contextmanager
def _order(model):
    """The calls of the vision tower and the first decoder layer within the block, in order."""
    order: list[str] = []
    hooks = [
        model.model.visual.register_forward_pre_hook(lambda m, a: order.append("visual")),
        model.model.language_model.layers[0].register_forward_pre_hook(
            lambda m, a: order.append("layer0")
        ),
    ]
    try:
        yield order
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "kind, mode, calls",
    [
        ("dropped", "always", 1),
        ("dropped", "on_drop", 1),
        ("dropped", "never", 0),
        ("image", "always", 1),  # the model's own call, no dummy
        ("image", "never", 1),
    ],
)
def test_the_tower_runs_before_the_decoder_and_changes_no_bit(family, kind, mode, calls):
    """Every item dropped: the tower runs (``always``, ``on_drop``) at a zero weight, its
    gradients exact zeros, the loss finite; a call with media is the plain forward bit for bit."""
    model = model_for(family)
    b = batch(family, kind)
    guard = MediaGuard(GuardConfig(policy="drop", keep_tower=mode), grammar=Grammar.qwen2_vl())
    with install_qwen_vl(model, guard) as h:
        want = None
        if kind != "dropped":
            h.remove()
            with torch.no_grad():
                want = model(**b).logits
            h.install_hooks()
        with _order(model) as order:
            got = model(**b, labels=b["input_ids"].clone())
    assert order.count("visual") == calls, order
    if calls:
        assert order.index("visual") < order.index("layer0"), order
    if want is not None:
        assert torch.equal(got.logits, want)  # -0.0 added: the same bits
    assert torch.isfinite(got.loss)
    model.zero_grad(set_to_none=True)
    got.loss.backward()
    if kind == "dropped":
        assert h.last_result.report.actions == ("drop", "drop")
        grads = [p.grad for p in model.model.visual.parameters()]
        assert all((g is not None and not g.any()) if calls else g is None for g in grads)
    model.zero_grad(set_to_none=True)


def test_inputs_embeds_and_decoding_steps():
    """``inputs_embeds`` given: the embeddings never run, the output takes the anchor; a call
    with a KV cache is a decoding step, not a text-only micro-batch: no dummy."""
    family = "qwen2_5_vl"
    model = model_for(family)
    b = batch(family, "text")
    guard = MediaGuard(GuardConfig(), grammar=Grammar.qwen2_vl())
    emb = model.get_input_embeddings()(b["input_ids"]).detach()
    with install_qwen_vl(model, guard), _order(model) as order:
        out = model(inputs_embeds=emb, attention_mask=b["attention_mask"])
        first = list(order)
        with torch.no_grad():
            pre = model(**b, use_cache=True)
            order.clear()
            step = dict(input_ids=b["input_ids"][:, -1:], past_key_values=pre.past_key_values)
            model(**step)
    assert first == ["visual", "layer0"]
    assert out.logits.grad_fn.name() == "AddBackward0"  # anchored at the output
    assert order == ["layer0"]


def test_remove_after_a_forward_that_raised_keeps_no_dummy_graph():
    """A forward that raises between the pre-hook (which ran the dummy tower) and the post-hook
    leaves the anchor, and the dummy call's graph behind it, pending: ``remove()`` lets it go."""
    model = model_for("qwen2_5_vl")
    guard = MediaGuard(GuardConfig(keep_tower="always"), grammar=Grammar.qwen2_vl())

    def boom(module, args):
        raise RuntimeError("decoder failed")

    h = install_qwen_vl(model, guard)
    hook = model.model.language_model.layers[0].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="decoder failed"):
            model(**batch("qwen2_5_vl", "text"))
        assert h.keeper._anchor is not None  # the dummy ran, nothing took its anchor
    finally:
        hook.remove()
        h.remove()
    assert h.keeper._anchor is None
