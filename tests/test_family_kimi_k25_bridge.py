"""install_vlm on Megatron-Bridge 0.6.2's real ``KimiK25VLModel`` (its provider, ``__init__``,
``_extract_image_features``, ``_merge_input_ids_with_image_features`` and forward from the
wheel, CPU). ``hf_model_path`` is a local directory (``testing/bridge_models_kimi.py``): a
``config.json`` and a stand-in remote ``modeling_kimi_k25.py`` over transformers' native Kimi
K2.5 tower and projector, loaded by Bridge through ``get_class_from_dynamic_module``; the
language model is transformers' tiny DeepSeek-V3 text model (megatron-core's MLA GPTModel needs
CUDA). Runs under ``scripts/test_mcore019.sh``.

What the plain class does (pinned here): its pre-expanded merge checks only the batch total
(``final_embedding[image_mask] = feats``): +k/-k and swaps run silently; a short run takes its
"truncated pre-expanded" branch, which re-cuts the features per sample: silent too (a short
first image of two hands its last feature to the second image's run); more placeholders than
features fall through to its dynamic expansion and crash with a bare shape error.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from family_checks import records

from megatron_media_guard import GuardConfig, MediaAlignmentError
from megatron_media_guard.testing import bridge as loader

pytest.importorskip("transformers.models.kimi_k25")
REASON = loader.missing()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(180)]

from megatron_media_guard.adapters import install_vlm  # noqa: E402
from megatron_media_guard.adapters.launcher import find_vlm  # noqa: E402
from megatron_media_guard.families import find_family  # noqa: E402
from megatron_media_guard.families import kimi_k25 as spec_mod  # noqa: E402
from megatron_media_guard.families.spec import bridge_embed  # noqa: E402
from megatron_media_guard.testing.families import kimi_k25 as F  # noqa: E402
from megatron_media_guard.testing.families.base import Media  # noqa: E402


def img(h: int, w: int, tokens: int | None = None) -> Media:
    return Media("image", (h, w), tokens)


ALIGNED = [[img(4, 4)], [], [img(2, 4), img(4, 2)]]
SHORT = [[img(4, 4, 3), img(2, 4)], [img(2, 2)]]  # sample 0's first run one short
PLUS_MINUS = [[img(4, 4, 5)], [img(2, 4, 1)], [img(4, 2)]]  # 4 + 1, 2 - 1, aligned
SWAP = [[img(4, 4)], [img(2, 4)], [img(4, 2)]]  # images 0 and 1 exchanged: 2 for 4, 4 for 2


@pytest.fixture(scope="module")
def bridge(tmp_path_factory):
    from megatron_media_guard.testing import bridge_models_kimi as K

    tmp = tmp_path_factory.mktemp("kimi_k25")
    with loader.bridge_modules(loader.find_root()):
        full = F.tiny_model()
        hf_dir = K.write_hf_dir(tmp / "checkpoint", full)
        with K.local_remote_code(tmp):
            model = K.kimi_k25_vl(full, hf_dir, pad_id=F.PAD_ID)
        tokens = {
            "<|media_begin|>": full.config.vision_start_token_id,
            "<|media_end|>": full.config.vision_end_token_id,
        }
        yield model, full, tokens


def forward(model, kwargs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**kwargs)


def decoder_inputs(model, kwargs: dict) -> torch.Tensor:
    """The ``[b, s, h]`` embeddings the language model decodes (Bridge calls its language
    model's ``forward`` directly: the hook sits on the text model inside)."""
    seen = []
    hook = model.language_model.lm.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["inputs_embeds"]), with_kwargs=True
    )
    try:
        forward(model, kwargs)
    finally:
        hook.remove()
    return seen[0]


def test_bridge_builds_its_tower_from_the_local_remote_code(bridge):
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25VisionModel

    model, _, _ = bridge
    assert type(model).__module__ == "megatron.bridge.models.kimi_vl.modeling_kimi_k25_vl"
    tower = type(model.vision_tower)
    assert tower.__name__ == "MoonViT3dPretrainedModel"
    assert tower.__module__.startswith("transformers_modules.")  # get_class_from_dynamic_module
    assert isinstance(model.vision_tower, Kimi_K25VisionModel)  # transformers' own tower
    assert find_family(model)[1] is spec_mod.BRIDGE
    wrapped = SimpleNamespace(module=model)  # a DDP-style wrapper, as install_from_args sees it
    assert find_vlm(wrapped) == ("kimi_k25", model)


@pytest.mark.parametrize(
    "extra",
    [{}, {"labels": True}, {"attention_mask": None}, {"labels": True, "position_ids": True}],
    ids=["logits", "labels", "no-attention-mask", "caller-positions"],
)
def test_aligned_batch_is_bit_identical(bridge, extra):
    """Bridge's merge also sets the positions from the attention mask (over a caller's), the
    labels' placeholders to ignore_index (the stand-in's per-token loss sees any other label)
    and no attention mask: the guard's after-merge step does the same."""
    model, full, tokens = bridge
    b = F.make_batch(full, ALIGNED)
    kw = dict(b.kwargs)
    if extra.get("labels"):
        kw["labels"] = b.input_ids.clone()
    if extra.get("position_ids"):
        kw["position_ids"] = torch.zeros_like(b.input_ids)
    if "attention_mask" in extra:
        kw["attention_mask"] = None
    ref = forward(model, kw)
    h = install_vlm(model, GuardConfig(), tokenizer=tokens)
    with h:
        assert torch.equal(forward(model, kw), ref)
    assert h.last_result.report.actions == ("keep", "keep", "keep")


def test_short_run_is_recut_silently_by_bridge_and_raises_guarded(bridge, tmp_path):
    model, full, tokens = bridge
    b = F.make_batch(full, SHORT)
    emb = decoder_inputs(model, b.kwargs)  # Bridge's truncated pre-expanded branch: no error
    with torch.no_grad():
        feats = model._extract_image_features(b.kwargs["pixel_values"], b.kwargs["image_grid_thw"])
    runs = (b.input_ids[0] == full.config.image_token_id).nonzero().flatten()
    second = runs[3]  # the first placeholder of image 1's run
    assert torch.equal(emb[0, second], feats[0][3])  # image 0's last feature, in image 1's run
    h = install_vlm(model, GuardConfig(log_dir=str(tmp_path)), tokenizer=tokens)
    with h, pytest.raises(MediaAlignmentError, match=r"sample 0\b"):
        forward(model, b.kwargs)
    recs = records(tmp_path)
    assert any(r["event"] == "raise" and r["sample"] == 0 for r in recs)


@pytest.mark.parametrize(
    "samples, swap, named",
    [(PLUS_MINUS, None, (0, 1)), (SWAP, (0, 1), (0, 1))],
    ids=["plus-minus-k", "swap"],
)
def test_silent_in_bridge_named_guarded(bridge, samples, swap, named):
    model, full, tokens = bridge
    b = F.make_batch(full, samples, swap=swap)
    forward(model, b.kwargs)  # the batch total matches: Bridge's 1:1 scatter runs
    h = install_vlm(model, GuardConfig(), tokenizer=tokens)
    with h, pytest.raises(MediaAlignmentError) as err:
        forward(model, b.kwargs)
    found = {int(n) for n in re.findall(r"^  sample (\d+)\b", str(err.value), re.M)}
    assert found == set(named)  # the aligned sample 2 is not named


def test_surplus_placeholders_crash_bridge_bare_and_raise_guarded(bridge):
    model, full, tokens = bridge
    b = F.make_batch(full, [[img(2, 2)], [img(4, 4, 5)]])
    with pytest.raises(RuntimeError, match="shape mismatch"):  # its dynamic expansion
        forward(model, b.kwargs)
    h = install_vlm(model, GuardConfig(), tokenizer=tokens)
    with h, pytest.raises(MediaAlignmentError, match=r"sample 1\b"):
        forward(model, b.kwargs)


@pytest.mark.parametrize(
    "samples, swap, actions",
    [
        ([*SHORT, [img(4, 2)]], None, ("drop", "keep", "keep")),
        (PLUS_MINUS, None, ("drop", "drop", "keep")),
        (SWAP, (0, 1), ("drop", "drop", "keep")),
    ],
    ids=["short", "plus-minus-k", "swap"],
)
def test_drop_keeps_each_aligned_sample_equal_to_its_own_forward(bridge, samples, swap, actions):
    model, full, tokens = bridge
    b = F.make_batch(full, samples, swap=swap)
    h = install_vlm(model, GuardConfig(policy="drop"), tokenizer=tokens)
    with h:
        logits = forward(model, b.kwargs)
        loss = forward(model, dict(b.kwargs, labels=b.input_ids.clone()))
    assert h.last_result.report.actions == actions
    for s, act in enumerate(actions):
        n = b.lengths[s]
        if act == "keep":
            alone = F.make_batch(full, [samples[s]])
            ref = forward(model, alone.kwargs)[0]
            ref_loss = forward(model, dict(alone.kwargs, labels=alone.input_ids.clone()))[0]
            torch.testing.assert_close(loss[s, :n], ref_loss, atol=1e-5, rtol=1e-5)
        else:  # a dropped row decodes its own token embeddings: no feature placed
            ids = b.input_ids[s : s + 1, :n]
            ref = forward(model, {"input_ids": ids, "inputs_embeds": bridge_embed(model, ids)})[0]
            assert (h.last_result.labels[s, :n] == -100).all()  # its loss is ignored
        torch.testing.assert_close(logits[s, :n], ref, atol=1e-5, rtol=1e-5)


def test_remove_restores_bridges_own_forward(bridge):
    model, full, tokens = bridge
    b = F.make_batch(full, PLUS_MINUS)
    h = install_vlm(model, GuardConfig(), tokenizer=tokens)
    with pytest.raises(MediaAlignmentError):
        forward(model, b.kwargs)
    h.remove()
    forward(model, b.kwargs)  # Bridge's own forward again: silent


@pytest.mark.parametrize("mode, runs", [("always", 1), ("never", 0)])
def test_a_text_only_micro_batch_keeps_bridges_tower_in_step(bridge, mode, runs):
    """keep_tower (docs/PARALLEL.md): the dummy through Bridge's own tower and projector."""
    from tower_check import check_keeps_tower

    model, full, tokens = bridge
    media, text = (F.make_batch(full, s).kwargs for s in ([[img(2, 2)]], [[], []]))
    check_keeps_tower(
        model,
        mode,
        runs,
        media=media,
        text=text,
        out=lambda o: o,
        towers=[model.vision_tower, model.mm_projector],
        decoder=model.language_model.lm,  # Bridge calls language_model.forward: no hook there
        tokenizer=tokens,
    )
