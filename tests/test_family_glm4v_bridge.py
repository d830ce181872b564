"""install_vlm on Megatron-Bridge 0.6.2's real ``GLM45VModel`` (its provider, ``__init__`` and
forward from the wheel, CPU): transformers' tiny GLM-4V vision tower built by Bridge itself,
the language model :class:`TinyLanguageModel` (megatron-core's GPTModel attention needs CUDA).
Bridge computes its M-RoPE itself from ``input_ids``, ``mm_token_type_ids`` and the grids, and
checks only the batch total before its ``masked_scatter``: +k/-k then fails in its rope with a
shape error, and a batch with images and videos fails at the check (both scatter into every
image token). Runs under
``scripts/test_mcore019.sh``."""

from __future__ import annotations

import importlib

import pytest
import torch

from megatron_media_guard import GuardConfig, MediaAlignmentError
from megatron_media_guard.testing import bridge as loader

pytest.importorskip("transformers.models.glm4v")
REASON = loader.missing()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(120)]

from megatron_media_guard.adapters import install_vlm  # noqa: E402
from megatron_media_guard.families import find_family  # noqa: E402
from megatron_media_guard.families import glm4v as spec_mod  # noqa: E402
from megatron_media_guard.testing.families import glm4v as F  # noqa: E402
from megatron_media_guard.testing.families.base import Media  # noqa: E402

IMG = [Media("image", (4, 4))]
VID = [Media("video", (2, 4, 4))]
PLUS_MINUS = [[Media("image", (4, 6), 7)], [Media("image", (4, 6), 5)], IMG]


@pytest.fixture(scope="module")
def bridge():
    from megatron_media_guard.testing.bridge_models import GLM45V, glm45v

    with loader.bridge_modules(loader.find_root()):
        importlib.import_module(GLM45V)
        full = F.tiny_model()
        yield glm45v(full), full


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
        [VID, [Media("video", (1, 4, 6))]],
    ],
    ids=["images", "videos"],
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
    with pytest.raises(RuntimeError, match="shape mismatch"):
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
    with pytest.raises(RuntimeError, match="shape mismatch"):
        forward(model, b)  # Bridge's own forward again


def test_images_and_videos_in_one_batch_run_guarded_as_each_alone(bridge):
    model, full = bridge
    samples = [IMG, VID]
    b = F.make_batch(full, samples)
    with pytest.raises(Exception):  # noqa: B017 - the images' features meet every image token
        forward(model, b)
    with install_vlm(model, GuardConfig()):
        out = forward(model, b)
    for i, s in enumerate(samples):
        n = b.lengths[i]
        torch.testing.assert_close(out[i, :n], alone(model, full, s), atol=1e-5, rtol=1e-5)
