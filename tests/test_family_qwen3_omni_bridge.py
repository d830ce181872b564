"""install_vlm on Megatron-Bridge 0.6.2's real ``Qwen3OmniThinkerModel`` (inside its
``Qwen3OmniModel``; provider, ``__init__``, forwards and rope from the wheel, CPU): its own
transformers vision and audio encoders built from the tiny thinker config, the language model
transformers' tiny Qwen3-Omni text model (``testing/bridge_models_omni.py`` says what stands
in). Bridge's forward takes no ``inputs_embeds``: the guard (``apply="inputs"``) rewrites the
inputs and lets Bridge's own merge run. Unguarded, a short image run, a +k/-k and a swap run
silently, and a short audio run silently loses features. Runs under ``scripts/test_mcore019.sh``."""

from __future__ import annotations

import argparse

import pytest
import torch
from family_checks import aud, img, records, vid

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaItem
from megatron_media_guard.testing import bridge as loader

pytest.importorskip("transformers.models.qwen3_omni_moe")
REASON = loader.missing()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(180)]

from megatron_media_guard.adapters import install_vlm  # noqa: E402
from megatron_media_guard.adapters.launcher import (  # noqa: E402
    add_media_guard_args,
    install_from_args,
)
from megatron_media_guard.families import qwen3_omni_bridge as spec_mod  # noqa: E402
from megatron_media_guard.families.collate import check_batch  # noqa: E402
from megatron_media_guard.testing.families import qwen3_omni as F  # noqa: E402

TEXT = 151643  # the spec's text token: a dropped sample's placeholders


# Bridge's audio merge pairs rows with clips (zip, strict): one clip per row wherever audio is
ALIGNED = {
    "image": [[img(4, 4)], [img(2, 4), img(2, 2)], []],
    "video": [[vid(2, 4, 4)], [vid(1, 2, 4)]],
    "audio": [[aud(100)], [aud(61)]],
    "mixed": [[aud(100), img(4, 4)], [img(2, 4), aud(61), vid(2, 2, 4)]],
}
# name: (samples, swap, the samples named and dropped); every case keeps its last, aligned sample
FAULTS = {
    "short image run": ([[img(4, 4, n=3)], [img(2, 4)]], None, (0,)),
    "+k/-k": ([[img(4, 4, n=5)], [img(2, 4, n=1)], [img(2, 2)]], None, (0, 1)),
    "swap": ([[img(4, 4)], [img(2, 4)], [img(2, 2)]], (0, 1), (0, 1)),
    "short audio run": ([[aud(100, n=12)], [aud(61)]], None, (0,)),
    "mixed, video +1": ([[aud(120), vid(2, 4, 4, n=9)], [aud(61), img(2, 4)]], None, (0,)),
}


@pytest.fixture(scope="module")
def bridge():
    from megatron_media_guard.testing.bridge_models_omni import qwen3_omni

    with loader.bridge_modules(loader.find_root()):
        full = F.tiny_model()
        yield qwen3_omni(full), full


def forward(model, kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(**kwargs)


def alone(model, full, sample) -> torch.Tensor:
    return forward(model, F.make_batch(full, [sample]).kwargs)[0]


def test_the_registry_finds_the_thinker_as_the_bridge_spec(bridge):
    """Bridge's own forward keywords (``apply="inputs"``), not the transformers spec."""
    from megatron_media_guard.families import find_family

    model, _ = bridge
    target, spec = find_family(model)
    assert type(target).__name__ == "Qwen3OmniThinkerModel" and target is model.thinker
    assert spec is spec_mod.SPEC


@pytest.mark.parametrize("case", list(ALIGNED))
def test_aligned_batches_are_bit_identical(bridge, case):
    model, full = bridge
    kw = F.make_batch(full, ALIGNED[case]).kwargs
    ref = forward(model, kw)
    with install_vlm(model, GuardConfig()) as h:
        assert torch.equal(forward(model, kw), ref)
    assert set(h.last_result.report.actions) == {"keep"}


@pytest.mark.parametrize("case", list(FAULTS))
def test_a_fault_is_named_raised_dropped_alone_and_remove_restores(bridge, case, tmp_path):
    """Unguarded: Bridge's total check, or silent (a short image run: its trim cuts the batch's
    last feature, sample 1, aligned, gets sample 0's). Guarded: raised naming the samples;
    dropped, each kept sample its own forward, a dropped one's placeholders decoded as text.
    Removed: Bridge's own forward again, bit for bit."""
    model, full = bridge
    samples, swap, bad = FAULTS[case]
    b = F.make_batch(full, samples, swap=swap)
    ref = None
    if case == "mixed, video +1":  # more placeholders than features: Bridge's total check
        with pytest.raises(ValueError, match="exceed produced features"):
            forward(model, b.kwargs)
    else:
        ref = forward(model, b.kwargs)  # Bridge trims or scatters by batch totals: silent
    if case == "short image run":
        n = b.lengths[1]
        assert not torch.allclose(ref[1, :n], alone(model, full, samples[1]), atol=1e-4)
    h = install_vlm(model, GuardConfig(log_dir=str(tmp_path)))
    with h, pytest.raises(MediaAlignmentError, match=rf"sample {bad[0]}\b"):
        forward(model, b.kwargs)
    assert {r["sample"] for r in records(tmp_path) if r["event"] == "raise"} == set(bad)
    with install_vlm(model, GuardConfig(policy="drop")) as h:
        out = forward(model, b.kwargs)
    assert h.last_result.report.dropped == bad
    c = full.config
    pads = torch.tensor([c.image_token_id, c.video_token_id, c.audio_token_id])
    for s, sample in enumerate(samples):
        n = b.lengths[s]
        if s in bad:  # its placeholders decode as text: no feature placed there
            ids = b.input_ids[s : s + 1, :n]
            ids = ids.masked_fill(torch.isin(ids, pads), TEXT)
            want = forward(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})[0]
        else:
            want = alone(model, full, sample)
        torch.testing.assert_close(out[s, :n], want, atol=1e-5, rtol=1e-5)
    if ref is not None:
        assert torch.equal(forward(model, b.kwargs), ref)


@pytest.mark.parametrize("install", ["install_vlm", "loss_mask_inplace", "install_from_args"])
def test_drop_ignores_the_labels_and_masks_the_loss(bridge, install):
    """In the result and by ``mask_loss`` (the caller's labels not written); with
    ``loss_mask_inplace`` in the caller's ``loss_mask`` too: Megatron-LM's path
    (``install_from_args``), Bridge's step builds its loss from the loss_mask it passed."""
    model, full = bridge
    b = F.make_batch(full, FAULTS["short image run"][0])
    labels = torch.roll(b.input_ids, -1, 1)
    lm = torch.ones(b.input_ids.shape)
    kw = {**b.kwargs, "labels": labels, "loss_mask": lm}
    if install == "install_from_args":
        argv = ["--media-guard-policy", "drop"]
        args = add_media_guard_args(argparse.ArgumentParser()).parse_args(argv)
        installed = install_from_args([model], args, step_end="manual", environ={})
        assert [h.module for h in installed] == [model.thinker]
        h = installed[0]
    else:
        inplace = install == "loss_mask_inplace"
        installed = h = install_vlm(model, GuardConfig(policy="drop"), loss_mask_inplace=inplace)
    with installed:
        loss = forward(model, kw)  # per-token loss [b, s]
    assert loss.shape == b.input_ids.shape
    assert h.last_result.report.actions == ("drop", "keep")
    assert h.last_result.loss_mask[0].eq(0).all() and h.last_result.loss_mask[1].eq(1).all()
    assert h.last_result.labels[0].eq(-100).all() and labels[0].ne(-100).all()  # not in place
    written = install != "install_vlm"  # loss_mask_inplace: the caller's loss_mask zeroed
    assert lm[0].eq(0 if written else 1).all() and lm[1].eq(1).all()
    masked, _ = h.mask_loss(torch.ones(b.input_ids.shape))
    assert masked[0].eq(0).all() and masked[1].eq(1).all()


def test_repair_falls_back_with_the_engines_reason(bridge, tmp_path):
    model, full = bridge
    kw = F.make_batch(full, FAULTS["short audio run"][0]).kwargs
    cfg = GuardConfig(policy="repair", fallback="drop", log_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="no mismatch can be repaired"):
        h = install_vlm(model, cfg)
    with h:
        forward(model, kw)
    assert h.last_result.report.actions == ("drop", "keep")
    recs = records(tmp_path)
    reasons = [r["reason"] for r in recs if r["event"] == "repair"]
    assert reasons and all("no geometry for qwen3_omni" in r for r in reasons)


def test_set_step_and_set_items_reach_the_records(bridge, tmp_path):
    model, full = bridge
    kw = F.make_batch(full, FAULTS["short audio run"][0]).kwargs
    meta = [MediaItem(13, modality="audio", sample_id="clip-a"), MediaItem(8, modality="audio")]
    h = install_vlm(model, GuardConfig(log_dir=str(tmp_path)))
    h.set_step(7)
    h.set_items(meta)
    with (
        h,
        pytest.raises(MediaAlignmentError, match=r"(?s)step 7\b.*sample 0 \(sample_id 'clip-a'\)"),
    ):
        forward(model, kw)
    recs = records(tmp_path)
    assert any(
        r["event"] == "raise" and r["sample_id"] == "clip-a" and r["step"] == 7 for r in recs
    )


def test_check_batch_with_the_bridge_spec_feeds_bridge_a_consistent_batch(bridge):
    """The collate check shares the drop: its batch runs on the plain class, kept samples
    as their own forwards (the dropped sample's audio clip stays, paired with its row)."""
    model, full = bridge
    samples = FAULTS["mixed, video +1"][0]
    checked = check_batch(
        spec_mod.SPEC, F.make_batch(full, samples).kwargs, config=model.thinker.config
    )
    assert checked.dropped == (0,)
    assert checked.batch["input_features"].shape[0] == 2  # the dropped row's clip stays
    assert "pixel_values_videos" not in checked.batch  # its only video left
    out, n = forward(model, checked.batch), F.make_batch(full, samples).lengths[1]
    torch.testing.assert_close(out[1, :n], alone(model, full, samples[1]), atol=1e-5, rtol=1e-5)


def test_bridges_audio_path_calls_an_encoder_method_transformers_lacks(bridge, monkeypatch):
    """Measured: the released class raises on every audio call with transformers 5.x (the
    fixture binds the method; testing/bridge_models_omni.py). The guard does not hide it."""
    model, full = bridge
    monkeypatch.delattr(model.thinker.audio_model, "_get_feat_extract_output_lengths")
    kw = F.make_batch(full, ALIGNED["audio"]).kwargs
    with pytest.raises(AttributeError, match="_get_feat_extract_output_lengths"):
        forward(model, kw)
