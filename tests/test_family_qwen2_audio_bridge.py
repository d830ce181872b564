"""install_vlm on Megatron-Bridge 0.6.2's real ``Qwen2AudioModel`` (its ``__init__`` and
forward from the wheel, CPU): transformers' tiny audio encoder and projector built by Bridge
itself from the fixture's config, the language model :class:`TinyLanguageModel` (megatron-core's
GPTModel attention needs CUDA), a stand-in provider config with the attributes the class reads.
Bridge checks only the batch total before its ``masked_scatter``: +k/-k runs silently
unguarded. Bridge merges audio whenever ``input_features`` is given: the guard passes it as
None. Runs under ``scripts/test_mcore019.sh``."""

from __future__ import annotations

import pytest
import torch
from family_checks import records

from megatron_media_guard import GuardConfig, MediaAlignmentError
from megatron_media_guard.testing import bridge as loader

pytest.importorskip("transformers.models.qwen2_audio")
REASON = loader.missing()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(120)]

from megatron_media_guard.adapters import install_vlm  # noqa: E402
from megatron_media_guard.families.spec import bridge_embed  # noqa: E402
from megatron_media_guard.testing.families import qwen2_audio as F  # noqa: E402
from megatron_media_guard.testing.families.base import Media  # noqa: E402


def aud(frames: int, tokens: int | None = None) -> Media:
    return Media("audio", (frames,), tokens)


ALIGNED = [[aud(100)], [], [aud(20), aud(61)]]
PLUS_MINUS = [[aud(100, 26)], [aud(60, 14)], [aud(61)]]  # 25 + 1, 15 - 1, aligned


@pytest.fixture(scope="module")
def bridge():
    from megatron_media_guard.testing.bridge_models_hf import qwen2_audio

    with loader.bridge_modules(loader.find_root()):
        full = F.tiny_model()
        yield qwen2_audio(full), full


def forward(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch.kwargs)


def test_aligned_batch_is_bit_identical(bridge):
    model, full = bridge
    b = F.make_batch(full, ALIGNED)
    ref = forward(model, b)
    with install_vlm(model, GuardConfig()):
        assert torch.equal(forward(model, b), ref)


def test_short_run_raises_in_bridge_and_names_the_sample_guarded(bridge, tmp_path):
    model, full = bridge
    b = F.make_batch(full, [[aud(100)], [aud(60, 14)]])
    with pytest.raises(ValueError, match="do not match"):  # Bridge's batch total: no sample
        forward(model, b)
    h = install_vlm(model, GuardConfig(log_dir=str(tmp_path)))
    with h, pytest.raises(MediaAlignmentError, match=r"sample 1\b"):
        forward(model, b)
    recs = records(tmp_path)
    assert any(r["event"] == "raise" and r["sample"] == 1 for r in recs)


def test_plus_minus_k_is_silent_unguarded_and_raises_guarded(bridge):
    model, full = bridge
    b = F.make_batch(full, PLUS_MINUS)
    forward(model, b)  # Bridge's batch-total check passes: 55 tokens, 55 features
    with install_vlm(model, GuardConfig()), pytest.raises(MediaAlignmentError, match=r"sample 0\b"):
        forward(model, b)


def test_drop_keeps_the_aligned_sample_feeds_no_feature_and_remove_restores(bridge):
    model, full = bridge
    b = F.make_batch(full, PLUS_MINUS)
    h = install_vlm(model, GuardConfig(policy="drop"))
    with h:
        out = forward(model, b)
    assert h.last_result.report.actions == ("drop", "drop", "keep")
    alone = F.make_batch(full, [PLUS_MINUS[2]])
    n = alone.lengths[0]
    torch.testing.assert_close(out[2, :n], forward(model, alone)[0], atol=1e-5, rtol=1e-5)
    for s in (0, 1):  # a dropped row decodes its own token embeddings: no feature placed
        ids = b.input_ids[s : s + 1, : b.lengths[s]]
        with torch.no_grad():
            text = model(input_ids=ids, inputs_embeds=bridge_embed(model, ids))[0]
        torch.testing.assert_close(out[s, : b.lengths[s]], text, atol=1e-5, rtol=1e-5)
    h.remove()
    forward(model, b)  # Bridge's own forward again: silent


@pytest.mark.parametrize("mode, runs", [("always", 1), ("never", 0)])
def test_a_text_only_micro_batch_keeps_bridges_tower_in_step(bridge, mode, runs):
    """keep_tower (docs/PARALLEL.md): the dummy through Bridge's own tower and projector."""
    from tower_check import check_keeps_tower

    model, full = bridge
    media, text = (F.make_batch(full, s).kwargs for s in ([[aud(100)]], [[], []]))
    check_keeps_tower(
        model,
        mode,
        runs,
        media=media,
        text=text,
        out=lambda o: o,
        towers=[model.audio_tower, model.multi_modal_projector],
        decoder=model.language_model.lm,  # Bridge calls language_model.forward: no hook there
    )
