"""install_vlm on Megatron-Bridge 0.6.2's real ``GLM45VModel`` and ``Ernie45VLModel`` (their
providers, ``__init__`` and forward from the wheel, CPU): transformers' tiny vision towers (and
Ernie's resampler) built by Bridge itself, the language model :class:`TinyLanguageModel`
(megatron-core's GPTModel attention needs CUDA). Bridge computes its M-RoPE itself from
``input_ids``, ``mm_token_type_ids`` and the grids (Ernie normalizes its pixels first) and checks
only the batch total before its ``masked_scatter``: +k/-k then fails in its rope with a shape
error; on GLM a batch with images and videos fails at the check (both scatter into every image
token). Runs under ``scripts/test_mcore019.sh``."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import pytest
import torch

from megatron_media_guard import GuardConfig, MediaAlignmentError
from megatron_media_guard.testing import bridge as loader
from megatron_media_guard.testing.families.base import Media

REASON = loader.missing()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(120)]

from megatron_media_guard.adapters import install_vlm  # noqa: E402
from megatron_media_guard.families import ernie4_5_vl, glm4v  # noqa: E402

IMG = [Media("image", (4, 4))]
VID = [Media("video", (2, 4, 4))]
PLUS_MINUS = [[Media("image", (4, 6), 7)], [Media("image", (4, 6), 5)], IMG]


@dataclass(frozen=True)
class Case:
    name: str
    hf: str  # the transformers package the tiny model comes from
    spec: object
    builder: str  # in testing.bridge_models: (module constant, builder function)
    videos: list  # an aligned video batch
    rope_error: str  # Bridge's rope error on +k/-k
    mixed_plain_ok: bool  # the plain Bridge forward takes images and videos in one batch

    def aligned(self) -> list[list]:
        """Aligned batches the plain Bridge forward takes (images, videos, mixed where it can)."""
        out = [[[Media("image", (4, 6))], [Media("image", (6, 4))], IMG], self.videos]
        return out + ([[IMG + VID, VID, [Media("image", (4, 6))]]] if self.mixed_plain_ok else [])


CASES = {
    "glm4v": Case(
        "glm4v",
        "glm4v",
        glm4v,
        "GLM45V:glm45v",
        [VID, [Media("video", (1, 4, 6))]],
        "shape mismatch",
        mixed_plain_ok=False,
    ),
    "ernie4_5_vl": Case(
        "ernie4_5_vl",
        "ernie4_5_vl_moe",
        ernie4_5_vl,
        "ERNIE45VL:ernie45_vl",
        [VID, [Media("video", (2, 4, 6))]],
        "must match the existing size",
        mixed_plain_ok=True,
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def bridge(request):
    case = CASES[request.param]
    pytest.importorskip(f"transformers.models.{case.hf}")
    fx = importlib.import_module(f"megatron_media_guard.testing.families.{case.name}")
    from megatron_media_guard.testing import bridge_models

    const, build = case.builder.split(":")
    with loader.bridge_modules(loader.find_root()):
        importlib.import_module(getattr(bridge_models, const))
        full = fx.tiny_model()
        yield case, fx, getattr(bridge_models, build)(full), full


def forward(model, batch) -> torch.Tensor:
    kw = {k: v for k, v in batch.kwargs.items() if k != "attention_mask"}
    with torch.no_grad():
        return model(**kw)


def alone(fx, model, full, sample) -> torch.Tensor:
    b = fx.make_batch(full, [sample])
    return forward(model, b)[0, : b.lengths[0]]


def test_aligned_batches_are_bit_identical(bridge):
    case, fx, model, full = bridge
    for samples in case.aligned():
        b = fx.make_batch(full, samples)
        ref = forward(model, b)
        with install_vlm(model, GuardConfig()):
            assert torch.equal(forward(model, b), ref), samples


def test_a_short_run_raises_and_names_the_sample(bridge):
    _, fx, model, full = bridge
    b = fx.make_batch(full, [IMG, [Media("image", (4, 6), 5)]])
    with pytest.raises(Exception):  # noqa: B017 - Bridge's own total check, no sample named
        forward(model, b)
    with install_vlm(model, GuardConfig()), pytest.raises(MediaAlignmentError, match=r"sample 1\b"):
        forward(model, b)


def test_plus_minus_k_fails_in_bridges_rope_and_names_the_sample_guarded(bridge):
    """The batch total passes Bridge's check (12 tokens, 12 features); its M-RoPE then gives
    the 7-token run its grid's 6 positions: a shape error naming neither sample nor item."""
    case, fx, model, full = bridge
    b = fx.make_batch(full, PLUS_MINUS)
    with pytest.raises(RuntimeError, match=case.rope_error):
        forward(model, b)
    with install_vlm(model, GuardConfig()), pytest.raises(MediaAlignmentError, match=r"sample 0\b"):
        forward(model, b)


def test_drop_keeps_the_aligned_sample_and_remove_restores(bridge):
    case, fx, model, full = bridge
    b = fx.make_batch(full, PLUS_MINUS)
    h = install_vlm(model, GuardConfig(policy="drop"))
    with h:
        out = forward(model, b)
    assert h.last_result.report.actions == ("drop", "drop", "keep")
    n = b.lengths[2]
    torch.testing.assert_close(out[2, :n], alone(fx, model, full, IMG), atol=1e-5, rtol=1e-5)
    h.remove()
    with pytest.raises(RuntimeError, match=case.rope_error):
        forward(model, b)  # Bridge's own forward again


def test_images_and_videos_in_one_batch_run_guarded_as_each_alone(bridge):
    case, fx, model, full = bridge
    samples = [IMG, VID]
    b = fx.make_batch(full, samples)
    if not case.mixed_plain_ok:
        with pytest.raises(Exception):  # noqa: B017 - the images' features meet every image token
            forward(model, b)
    with install_vlm(model, GuardConfig()):
        out = forward(model, b)
    for i, s in enumerate(samples):
        n = b.lengths[i]
        torch.testing.assert_close(out[i, :n], alone(fx, model, full, s), atol=1e-5, rtol=1e-5)
