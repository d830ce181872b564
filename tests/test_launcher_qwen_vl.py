"""``install_from_args`` on transformers' real Qwen2.5-VL and Qwen3-VL classes (tiny random
configs, CPU): found through wrappers, guarded as the arguments say, and restored by
``remove()``. The seed failure (token ids sized by the engine, pixels and grids by the trainer)
drops or raises as configured."""

from __future__ import annotations

import argparse
import functools

import pytest
import torch

from megatron_media_guard import MediaAlignmentError, MediaInputError

pytest.importorskip("transformers.models.qwen3_vl")
pytest.importorskip("PIL")

from test_adapter_qwen_vl import ENGINE, SAMPLES, TRAINER  # the seed failure's samples

from megatron_media_guard.adapters.launcher import (
    add_media_guard_args,
    find_vlm,
    install_from_args,
)
from megatron_media_guard.families import qwen
from megatron_media_guard.testing.qwen_vl import seed_failure, tiny_model

CASES = [(f, head) for f in ("qwen2_5_vl", "qwen3_vl") for head in (True, False)]
model_for = functools.cache(tiny_model)  # one model per (family, head), built once


@functools.cache
def batches(family: str) -> tuple[dict, dict]:
    return seed_failure(family, SAMPLES, ENGINE, TRAINER)


def parse(argv):
    return add_media_guard_args(argparse.ArgumentParser()).parse_args(argv)


class Wrapper(torch.nn.Module):
    """DistributedDataParallel stand-in: the model under ``.module``, ``zero_grad_buffer``."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.zero_grad_buffer = lambda: None


@pytest.fixture(params=CASES, ids=[f"{f}-{'head' if h else 'model'}" for f, h in CASES])
def case(request):
    family, head = request.param
    engine, mixed = batches(family)
    return model_for(family, head), engine, mixed, "logits" if head else "last_hidden_state"


def _state(model):
    return (dict(model._forward_pre_hooks), dict(model._forward_hooks), set(vars(model)))


@pytest.mark.parametrize(
    "module, name, want",
    [
        ("megatron.bridge.models.qwen_vl.modeling_qwen25_vl", "Qwen25VLModel", "qwen_vl"),
        ("megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model", "Qwen3VLModel", "qwen_vl"),
        ("my_project.models", "Qwen25VLModel", None),  # the name alone is not enough
        ("megatron.bridge.models.gpt", "GPTModel", None),
    ],
)
def test_find_vlm_knows_megatron_bridge_classes_by_name_and_package(module, name, want):
    cls = type(name, (torch.nn.Module,), {"__module__": module})
    sub = type("Sub", (cls,), {"__module__": "user.code"})  # a subclass counts
    for m in (cls(), sub()):
        assert find_vlm(Wrapper(m)) == (None if want is None else (want, m))


def test_install_from_args_guards_the_model_and_remove_restores_it(case, tmp_path):
    """The seed failure dropped: its samples' loss masked, a bundle to replay saved."""
    from megatron_media_guard.replay.bundle import load_bundle

    model, engine, mixed, key = case
    before = _state(model)
    with torch.no_grad():
        plain = model(**engine)[key]
    chunk = Wrapper(model)
    argv = ["--media-guard-policy", "drop", "--media-guard-dump-dir", str(tmp_path)]
    group = install_from_args([chunk], parse(argv), environ={})
    assert [h.kind for h in group] == ["vlm", "step_end"]
    h = group[0]
    assert h.module is model and h.loss_mask_inplace and h.guard.config.policy == "drop"
    assert h.guard.grammar == qwen.SPEC.grammar(model)
    assert type(h.guard.consensus).__name__ == "StageConsensus"
    with torch.no_grad():
        assert torch.equal(model(**engine)[key], plain)  # aligned: untouched
        assert h.last_result.report.ok
        ids = mixed["input_ids"]
        given = {"labels": ids.clone()} if key == "logits" else {}
        model(**mixed, **given)  # the plain model raises on this batch (a batch-total mismatch)
    assert h.last_result.report.actions == ("drop", "drop", "keep")
    mask, labels = h.mask_loss(torch.ones(ids.shape), ids)
    assert mask[:2].eq(0).all() and mask[2].eq(1).all()
    assert labels[:2].eq(-100).all() and torch.equal(labels[2], ids[2])
    assert not given or torch.equal(h.last_result.labels, labels)
    [path] = tmp_path.glob("*.bundle")  # the mismatched batch, to replay
    bundle = load_bundle(path)
    assert torch.equal(bundle.input_ids, ids)
    assert bundle.items[0].grid_thw == tuple(mixed["image_grid_thw"][0].tolist())
    group.remove()
    assert _state(model) == before
    assert "zero_grad_buffer" in vars(chunk)
    with torch.no_grad():
        assert torch.equal(model(**engine)[key], plain)
        with pytest.raises(ValueError, match=r"features and .* tokens do not match"):
            model(**mixed)


def test_the_default_policy_raises_naming_the_item(case):
    """(A drop: above; a repair from the config's geometry: tests/test_adapter_qwen_vl.py;
    disabled, nothing installed: tests/test_launcher.py.)"""
    model, _, mixed, _ = case
    before = _state(model)
    group = install_from_args([model], parse([]), step_end="manual", environ={})
    raised = pytest.raises(MediaAlignmentError, match=r"image item 0 \(\d+x\d+ \(HxW\), grid 1x")
    with group, raised, torch.no_grad():
        model(**mixed)
    assert _state(model) == before


def test_a_grammar_that_is_not_the_models_is_refused(case):
    from megatron_media_guard import Grammar

    model = case[0]
    before = _state(model)
    wrong = Grammar.qwen2_vl(5, 6, 7, 8)
    with pytest.raises(MediaInputError, match=r"differs from the qwen_vl model.s"):
        install_from_args([model], parse([]), grammar=wrong, environ={})
    assert _state(model) == before
