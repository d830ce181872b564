"""install_vlm on Megatron-Bridge 0.6.2's real ``Gemma3VLModel`` (its ``__init__`` and forward
from the wheel, CPU): its own SigLIP tower and ``Gemma3VLMultimodalProjector`` from the fixture's
tiny config, the language model :class:`Gemma3LanguageModel` (megatron-core's GPTModel attention
needs CUDA) decoding under the attention biases Bridge computes from ``input_ids``, a stand-in
provider config with the attributes the class reads. Bridge checks only the batch total before
its ``masked_scatter``: +k/-k runs silently unguarded. Runs under ``scripts/test_mcore019.sh``."""

from __future__ import annotations

import pytest
import torch

from megatron_media_guard import GuardConfig, MediaAlignmentError
from megatron_media_guard.testing import bridge as loader

pytest.importorskip("transformers.models.gemma3")
REASON = loader.missing()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(120)]

from megatron_media_guard.adapters import install_vlm  # noqa: E402
from megatron_media_guard.testing.families import gemma3 as F  # noqa: E402
from megatron_media_guard.testing.families.base import Media  # noqa: E402

ALL = [Media("image", (32, 32))]
PLUS_MINUS = [[Media("image", (40, 24), 5)], [Media("image", (24, 40), 3)], ALL]


@pytest.fixture(scope="module")
def bridge():
    from megatron_media_guard.testing.bridge_models_hf import gemma3_vl

    with loader.bridge_modules(loader.find_root()):
        full = F.tiny_model()
        yield gemma3_vl(full), full


def forward(model, batch) -> torch.Tensor:
    """Bridge's forward has no ``token_type_ids``: it computes the image blocks from the ids."""
    kw = {k: v for k, v in batch.kwargs.items() if k != "token_type_ids"}
    with torch.no_grad():
        return model(**kw)[0]


def test_aligned_batch_is_bit_identical(bridge):
    model, full = bridge
    b = F.make_batch(full, [[Media("image", (40, 24))], [], [*ALL, Media("image", (24, 40))]])
    ref = forward(model, b)
    with install_vlm(model, GuardConfig()):
        assert torch.equal(forward(model, b), ref)


def test_short_run_raises_in_bridge_and_names_the_sample_guarded(bridge):
    model, full = bridge
    b = F.make_batch(full, [ALL, [Media("image", (32, 32), 3)]])
    with pytest.raises(ValueError, match="does not match"):  # Bridge's batch total: no sample
        forward(model, b)
    with install_vlm(model, GuardConfig()), pytest.raises(MediaAlignmentError, match=r"sample 1\b"):
        forward(model, b)


def test_plus_minus_k_is_silent_unguarded_and_raises_guarded(bridge):
    model, full = bridge
    b = F.make_batch(full, PLUS_MINUS)
    forward(model, b)  # Bridge's batch-total check passes: 12 tokens, 12 features
    with install_vlm(model, GuardConfig()), pytest.raises(MediaAlignmentError, match=r"sample 0\b"):
        forward(model, b)


def test_drop_keeps_the_aligned_sample_and_remove_restores(bridge):
    model, full = bridge
    b = F.make_batch(full, PLUS_MINUS)
    h = install_vlm(model, GuardConfig(policy="drop"))
    with h:
        out = forward(model, b)
    assert h.last_result.report.actions == ("drop", "drop", "keep")
    alone = F.make_batch(full, [ALL])
    n = alone.lengths[0]
    torch.testing.assert_close(out[2, :n], forward(model, alone)[0], atol=1e-5, rtol=1e-5)
    h.remove()
    forward(model, b)  # Bridge's own forward again: silent


def test_a_dropped_sample_gets_no_feature_and_no_image_block(bridge):
    """A dropped sample keeps its soft tokens' own embeddings (no feature placed) and its soft
    tokens are text in the ids Bridge builds its attention biases from (no bidirectional
    block): its row equals Bridge's forward on exactly that, the sample alone."""
    from megatron_media_guard.families.spec import bridge_embed

    model, full = bridge
    b = F.make_batch(full, PLUS_MINUS)
    with install_vlm(model, GuardConfig(policy="drop")):
        out = forward(model, b)
    n = b.lengths[0]
    ids = b.kwargs["input_ids"][:1, :n]
    text = ids.masked_fill(ids == F.IMAGE, F.PAD)
    with torch.no_grad():
        alone = model(input_ids=text, inputs_embeds=bridge_embed(model, ids))[0]
        image_block = model(input_ids=ids, inputs_embeds=bridge_embed(model, ids))[0]
    torch.testing.assert_close(out[0, :n], alone[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out[0, :n], image_block[0], atol=1e-3)  # the biases differ


@pytest.mark.parametrize("mode, runs", [("always", 1), ("never", 0)])
def test_a_text_only_micro_batch_keeps_bridges_tower_in_step(bridge, mode, runs):
    """keep_tower (docs/PARALLEL.md): the dummy through Bridge's bound get_image_features."""
    from tower_check import check_keeps_tower

    model, full = bridge
    media, text = (
        {k: v for k, v in F.make_batch(full, s).kwargs.items() if k != "token_type_ids"}
        for s in ([ALL], [[], []])
    )
    check_keeps_tower(
        model,
        mode,
        runs,
        media=media,
        text=text,
        tokenizer=None,
        out=lambda o: o[0],
        towers=[model.vision_tower, model.multi_modal_projector],
        decoder=model.language_model.lm,  # Bridge calls language_model.forward: no hook there
    )
