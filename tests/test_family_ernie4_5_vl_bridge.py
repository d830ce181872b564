"""install_vlm on Megatron-Bridge 0.6.2's real ``Ernie45VLModel`` (its provider, ``__init__`` and
forward from the wheel, CPU): transformers' tiny Ernie 4.5 VL vision tower and resampler built by Bridge itself,
the language model :class:`TinyLanguageModel` (megatron-core's GPTModel attention needs CUDA).
Bridge normalizes the pixels before its tower and computes its M-RoPE itself from
``input_ids``, ``mm_token_type_ids`` and the grids; it checks only the batch total before its
``masked_scatter``: +k/-k then fails in its rope with a shape error. Runs under
``scripts/test_mcore019.sh``."""

from __future__ import annotations

import importlib

import pytest
import torch

from megatron_media_guard import GuardConfig, MediaAlignmentError
from megatron_media_guard.testing import bridge as loader

pytest.importorskip("transformers.models.ernie4_5_vl_moe")
REASON = loader.missing()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(120)]

from megatron_media_guard.adapters import install_vlm  # noqa: E402
from megatron_media_guard.families import ernie4_5_vl as spec_mod  # noqa: E402
from megatron_media_guard.families import find_family  # noqa: E402
from megatron_media_guard.testing.families import ernie4_5_vl as F  # noqa: E402
from megatron_media_guard.testing.families.base import Media  # noqa: E402

IMG = [Media("image", (4, 4))]
VID = [Media("video", (2, 4, 4))]
PLUS_MINUS = [[Media("image", (4, 6), 7)], [Media("image", (4, 6), 5)], IMG]


@pytest.fixture(scope="module")
def bridge():
    from megatron_media_guard.testing.bridge_models import ERNIE45VL, ernie45_vl

    with loader.bridge_modules(loader.find_root()):
        importlib.import_module(ERNIE45VL)
        full = F.tiny_model()
        yield ernie45_vl(full), full


def forward(model, batch) -> torch.Tensor:
    kw = {k: v for k, v in batch.kwargs.items() if k != "attention_mask"}
    with torch.no_grad():
        return model(**kw)


def alone(model, full, sample) -> torch.Tensor:
    b = F.make_batch(full, [sample])
    return forward(model, b)[0, : b.lengths[0]]


def test_the_registry_finds_bridges_class(bridge):
    model, _ = bridge
    assert type(model).__module__.startswith("megatron.bridge.")
    assert find_family(model)[1] is spec_mod.BRIDGE  # ids with the embeddings, no positions


@pytest.mark.parametrize(
    "samples",
    [
        [[Media("image", (4, 6))], [Media("image", (6, 4))], IMG],
        [VID, [Media("video", (2, 4, 6))]],
        [IMG + VID, VID, [Media("image", (4, 6))]],
    ],
    ids=["images", "videos", "mixed"],
)
def test_aligned_batch_is_bit_identical(bridge, samples):
    model, full = bridge
    b = F.make_batch(full, samples)
    ref = forward(model, b)
    with install_vlm(model, GuardConfig()):
        assert torch.equal(forward(model, b), ref)


def test_a_short_run_raises_and_names_the_sample(bridge):
    model, full = bridge
    b = F.make_batch(full, [IMG, [Media("image", (4, 6), 5)]])
    with pytest.raises(Exception):  # noqa: B017 - Bridge's own total check, no sample named
        forward(model, b)
    with install_vlm(model, GuardConfig()), pytest.raises(MediaAlignmentError, match=r"sample 1\b"):
        forward(model, b)


def test_plus_minus_k_fails_in_bridges_rope_and_names_the_sample_guarded(bridge):
    """The batch total passes Bridge's check (12 tokens, 12 features); its M-RoPE then gives
    the 7-token run its grid's 6 positions: a shape error naming neither sample nor item."""
    model, full = bridge
    b = F.make_batch(full, PLUS_MINUS)
    with pytest.raises(RuntimeError, match="must match the existing size"):
        forward(model, b)
    with install_vlm(model, GuardConfig()), pytest.raises(MediaAlignmentError, match=r"sample 0\b"):
        forward(model, b)


def test_drop_keeps_the_aligned_sample_and_remove_restores(bridge):
    model, full = bridge
    b = F.make_batch(full, PLUS_MINUS)
    h = install_vlm(model, GuardConfig(policy="drop"))
    with h:
        out = forward(model, b)
    assert h.last_result.report.actions == ("drop", "drop", "keep")
    n = b.lengths[2]
    torch.testing.assert_close(out[2, :n], alone(model, full, IMG), atol=1e-5, rtol=1e-5)
    h.remove()
    with pytest.raises(RuntimeError, match="must match the existing size"):
        forward(model, b)  # Bridge's own forward again
