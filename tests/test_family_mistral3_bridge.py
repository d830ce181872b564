"""install_vlm on Megatron-Bridge 0.6.2's real ``Ministral3Model`` (its ``__init__`` and forward
from the wheel, CPU): transformers' tiny Pixtral tower and projector built by Bridge itself, the
language model :class:`TinyLanguageModel` (megatron-core's GPTModel attention needs CUDA), a
stand-in provider config with the attributes the class reads. Bridge checks only the batch
total before its ``masked_scatter``: +k/-k runs silently unguarded. Runs under
``scripts/test_mcore019.sh``."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from megatron_media_guard import GuardConfig, MediaAlignmentError
from megatron_media_guard.testing import bridge as loader

pytest.importorskip("transformers.models.mistral3")
REASON = loader.missing()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(120)]

from megatron_media_guard.adapters import install_vlm  # noqa: E402
from megatron_media_guard.families import find_family  # noqa: E402
from megatron_media_guard.families import mistral3 as spec_mod  # noqa: E402
from megatron_media_guard.testing.families import mistral3 as F  # noqa: E402
from megatron_media_guard.testing.families.base import Media  # noqa: E402

TOKENS = {"[IMG_BREAK]": F.BREAK_ID, "[IMG_END]": F.END_ID}
ALL = [Media("image", (28, 56))]
PLUS_MINUS = [[Media("image", (56, 84), 7)], [Media("image", (56, 84), 5)], ALL]


@pytest.fixture(scope="module")
def bridge():
    from megatron_media_guard.testing.bridge_models import TinyLanguageModel, one_rank_groups

    with loader.bridge_modules(loader.find_root()):
        mod = importlib.import_module("megatron.bridge.models.ministral3.modeling_ministral3")
        full = F.tiny_model()
        cfg = SimpleNamespace(
            hf_config=full.config,
            image_token_id=full.config.image_token_id,
            share_embeddings_and_output_weights=False,
            sequence_parallel=False,
            _pg_collection=one_rank_groups(),
            provide_language_model=lambda **kw: TinyLanguageModel(full),
        )
        model = mod.Ministral3Model(cfg).eval()
        yield model, full


def forward(model, batch) -> torch.Tensor:
    kw = {k: v for k, v in batch.kwargs.items() if k != "attention_mask"}
    with torch.no_grad():
        return model(**kw)[0]


def test_the_registry_finds_bridges_class(bridge):
    model, _ = bridge
    assert type(model).__module__.startswith("megatron.bridge.")
    assert find_family(model)[1].name == "mistral3"
    assert find_family(model)[1] is spec_mod.BRIDGE  # embeds through its language_model


def test_aligned_batch_is_bit_identical(bridge):
    model, full = bridge
    b = F.make_batch(full, [[Media("image", (56, 84))], [Media("image", (84, 56))], ALL])
    ref = forward(model, b)
    with install_vlm(model, GuardConfig(), tokenizer=TOKENS):
        assert torch.equal(forward(model, b), ref)


def test_plus_minus_k_is_silent_unguarded_and_raises_guarded(bridge):
    model, full = bridge
    b = F.make_batch(full, PLUS_MINUS)
    forward(model, b)  # Bridge's batch-total check passes: 12 tokens, 12 features
    h = install_vlm(model, GuardConfig(), tokenizer=TOKENS)
    with h, pytest.raises(MediaAlignmentError, match=r"sample 0\b"):
        forward(model, b)


def test_drop_keeps_the_aligned_sample_and_remove_restores(bridge):
    model, full = bridge
    b = F.make_batch(full, PLUS_MINUS)
    h = install_vlm(model, GuardConfig(policy="drop"), tokenizer=TOKENS)
    with h:
        out = forward(model, b)
    assert h.last_result.report.actions == ("drop", "drop", "keep")
    alone = F.make_batch(full, [ALL])
    n = alone.lengths[0]
    torch.testing.assert_close(out[2, :n], forward(model, alone)[0], atol=1e-5, rtol=1e-5)
    h.remove()
    forward(model, b)  # Bridge's own forward again: silent


@pytest.mark.parametrize("mode, runs", [("always", 1), ("never", 0)])
def test_a_text_only_micro_batch_keeps_bridges_tower_in_step(bridge, mode, runs):
    """keep_tower (docs/PARALLEL.md): the same dummy through Bridge's bound get_image_features."""
    from tower_check import check_keeps_tower

    model, full = bridge
    media, text = (
        {k: v for k, v in F.make_batch(full, s).kwargs.items() if k != "attention_mask"}
        for s in ([ALL[0:1]], [[], []])
    )
    check_keeps_tower(
        model,
        mode,
        runs,
        media=media,
        text=text,
        tokenizer=TOKENS,
        out=lambda o: o[0],
        towers=[model.vision_tower, model.multi_modal_projector],
        decoder=model.language_model.lm,  # Bridge calls language_model.forward: no hook there
    )
