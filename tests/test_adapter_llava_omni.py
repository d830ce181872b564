"""Megatron-Bridge's Nemotron Omni batches through megatron-core 0.19.2's own
``LLaVAModel._preprocess_data`` (stand-in ``self``; batches built as Bridge's collate does,
see ``omni_batches``): aligned batches are bit-identical, packed THD sub-samples are named
and dropped one by one through the ``packed_seq_params`` the forward pre-hook captures."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

llava_mod = pytest.importorskip("megatron.core.models.multimodal.llava_model")
from llava_standins import HAS_MCORE019, NEEDS_MCORE019, kept_identical, same  # noqa: E402
from llava_standins import omni_guard as guard  # noqa: E402
from llava_standins import omni_standin as standin  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from omni_batches import IMAGE, IMAGES_SOUND, SOUND, Example, build  # noqa: E402

from megatron_media_guard import MediaAlignmentError  # noqa: E402
from megatron_media_guard.adapters import guarded_by, install_llava  # noqa: E402
from megatron_media_guard.core.host import count_transfers  # noqa: E402

pytestmark = pytest.mark.skipif(not HAS_MCORE019, reason=NEEDS_MCORE019)
LLaVAModel = llava_mod.LLaVAModel


class OmniForwardStandIn(torch.nn.Module):
    """An ``nn.Module`` whose ``forward`` takes the leading parameters of 0.19.2's
    ``LLaVAModel.forward`` (Bridge calls it by keyword) and runs the real
    ``_preprocess_data`` on the batch's prepared embeddings, as the real forward does after
    its encoders: the place where the adapter's pre-hook reads ``packed_seq_params``."""

    _preprocess_data = LLaVAModel._preprocess_data

    def __init__(self, batch):
        super().__init__()
        for k, v in vars(standin(batch)).items():
            setattr(self, k, v)
        self.batch = batch

    def forward(
        self,
        images,
        input_ids,
        position_ids,
        attention_mask,
        labels=None,
        loss_mask=None,
        inference_context=None,
        num_image_tiles=None,
        image_token_index=None,
        runtime_gather_output=None,
        packed_seq_params=None,
    ):
        return self._preprocess_data(**self.batch.kwargs())


def run_forward(model, batch, positions=True):
    """Bridge's call of the forward on the batch as one THD row."""
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=batch.cu_seqlens_q,
        cu_seqlens_kv=batch.cu_seqlens_q,
        cu_seqlens_q_padded=batch.cu_seqlens_q_padded,
        cu_seqlens_kv_padded=batch.cu_seqlens_q_padded,
    )
    pos = batch.position_ids if positions else None
    return model(None, batch.input_ids, pos, None, packed_seq_params=params)


def unguarded(batch):
    return LLaVAModel._preprocess_data(standin(batch), **batch.kwargs())


VIDEO = [
    Example(images=[(512, 512)], video_frames=5),
    Example(video_frames=4, mel_frames=30),
    Example(images=[(512, 512)]),
]


def test_forward_stand_in_takes_the_release_forward_parameters():
    mine = list(inspect.signature(OmniForwardStandIn.forward).parameters)
    real = list(inspect.signature(LLaVAModel.forward).parameters)
    assert real[: len(mine)] == mine


def test_batches_follow_the_contract():
    b = build(IMAGES_SOUND)
    assert b.dynamic and b.img_seq_len == 1 and IMAGE > 0 and SOUND > 0
    assert b.num_image_tiles.tolist() == [6, 6, 4, 8]  # (H/32) * (W/32) per image
    assert b.image_embeddings.shape == (24, 1, 8)
    assert b.sound_embeddings_len.tolist() == [5, 3, 7] == (b.input_ids == SOUND).sum(1).tolist()
    v = build(VIDEO)
    # one entry per image or tubelet: 1 + 3 (5 frames) + 2 + 1
    assert v.img_seq_len == 256 and v.num_image_tiles.tolist() == [1] * 7
    assert (v.input_ids == IMAGE).sum().item() == 7


@pytest.mark.parametrize(
    "kind, positions",
    [
        ("image+sound", "resets"),
        ("image+video", "resets"),
        ("packed", "resets"),
        ("packed", None),
        ("packed", "no-resets"),  # positions over the whole row: the two walks decide
    ],
)
def test_aligned_omni_batches_are_bit_identical_with_one_transfer(kind, positions):
    packed = kind == "packed"
    batch = build(
        VIDEO if kind == "image+video" else IMAGES_SOUND, pack=packed, pad_to_multiple_of=8
    )
    if positions == "no-resets":
        batch.position_ids = torch.arange(batch.input_ids.shape[1]).view(1, -1)
    ref = unguarded(batch)
    model = OmniForwardStandIn(batch)
    with install_llava(model, guard("drop")) as handle, count_transfers() as seen:
        assert guarded_by(model.forward) is handle  # its pre captures packed_seq_params
        out = run_forward(model, batch, positions is not None)
    assert "forward" not in vars(model) and "_preprocess_data" not in vars(model)  # removed
    res = handle.last_result
    assert same(ref, out) and res.ok and res.mode == "as-is" and sum(seen.values()) == 1
    assert res.packed == packed and res.num_samples == 3
    if packed:
        assert [sp.merged_start for sp in res.spans] == [0, 32, 72]


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_packed_row_sound_fault_in_the_middle_sub_sample(policy):
    batch = build(IMAGES_SOUND, pack=True, pad_to_multiple_of=8)
    ref = unguarded(batch)
    batch.sound_embeddings_len = torch.tensor([5, 2, 7])  # the encoder gave one row fewer
    with pytest.raises(RuntimeError, match="shape mismatch"):
        unguarded(batch)
    model = OmniForwardStandIn(batch)
    handle = install_llava(model, guard(policy))
    handle.set_step(4)
    if policy == "raise":
        with pytest.raises(MediaAlignmentError) as e:
            run_forward(model, batch)
        parts = ["rank 1", "step 4", "sound item 1", "3 sound tokens", "2 sound_embeddings_len"]
        for part in [*parts, "1 of 3 packed sub-samples"]:
            assert part in str(e.value), part
        return
    out = run_forward(model, batch)
    res = handle.last_result
    assert res.dropped == (1,) and res.mode == "restructure"
    kept_identical(out, ref, {1}, res.spans)


def test_packed_row_nan_in_the_middle_sub_sample_drops_only_it():
    batch = build(IMAGES_SOUND, pack=True)
    batch.image_embeddings = batch.image_embeddings.clone()
    batch.image_embeddings[14, 0, 3] = float("nan")  # sub-sample 1's second image: rows 12..15
    ref = unguarded(batch)
    batch.image_embeddings.requires_grad_(True)
    model = OmniForwardStandIn(batch)
    handle = install_llava(model, guard("raise", nonfinite="drop"))
    out = run_forward(model, batch)
    res = handle.last_result
    assert res.dropped == (1,) and res.mode == "zero" and torch.isfinite(out[0]).all()
    (f,) = res.faults
    assert (f.check, f.item, f.item_in_sample) == ("nonfinite", 2, 1)
    kept_identical(out, ref, {1}, res.spans)
    out[0].sum().backward()  # the dropped sub-sample's rows get a zero gradient, no NaN
    g = batch.image_embeddings.grad
    assert (g[6:16] == 0).all() and (g[:6] == 1).all() and (g[16:] == 1).all()
    lm, lab = handle.mask_loss(torch.ones_like(out[2]), torch.zeros_like(out[1]))
    mid = slice(res.spans[1].merged_start, res.spans[1].merged_end)
    assert (lm[:, mid] == 0).all() and lm.sum() == lm.numel() - (mid.stop - mid.start)
    assert (lab[:, mid] == -100).all()


@pytest.mark.parametrize("policy", ["raise", "drop"])
@pytest.mark.parametrize("positions", [True, False], ids=["resets", "cu_seqlens-only"])
def test_packed_row_count_fault_in_the_middle_names_the_sub_sample(policy, positions):
    """The forward recomputes the middle sub-sample's second image as 9 tokens (the collate
    packed it as 4): megatron-core would place sub-sample 2 five positions late, silently.
    From cu_seqlens alone a length change in a text-heavy row cannot be placed: every
    sub-sample between the boundaries both walks confirm is named."""
    batch = build(IMAGES_SOUND, pack=True, pad_to_multiple_of=4 if positions else 1)
    batch.num_image_tiles = torch.tensor([6, 6, 9, 8], dtype=torch.int)
    batch.image_embeddings = torch.randn(29, 1, 8)
    unguarded(batch)  # no error
    model = OmniForwardStandIn(batch)
    install_llava(model, guard(policy))
    with pytest.raises(MediaAlignmentError) as e:
        run_forward(model, batch, positions)
    msg = str(e.value)
    if not positions:
        assert "3 of 3 packed sub-samples" in msg
        return
    assert "sample 1 row 0: " in msg and "segment:" in msg and "1 of 3 packed sub-samples" in msg
    assert "sample 0" not in msg and "sample 2" not in msg
    if policy == "drop":
        assert "cannot drop" in msg


def test_packed_row_extra_image_token_in_the_middle():
    """A literal image token typed in sub-sample 1's text: the totals disagree (5 tokens, 4
    entries); the sub-samples around it take their entries from the two ends."""
    batch = build(IMAGES_SOUND, pack=True)
    start = batch.cu_seqlens_q.tolist()  # merged; the compact start of sub-sample 1 is 24
    assert start[1] == 29
    batch.input_ids = batch.input_ids.clone()
    batch.input_ids[0, 24 + 1] = IMAGE
    model = OmniForwardStandIn(batch)
    install_llava(model, guard("drop"))
    with pytest.raises(MediaAlignmentError) as e:
        run_forward(model, batch)
    msg = str(e.value)
    assert "1 of 3 packed sub-samples" in msg and "sample 1 row 0: " in msg and "segment:" in msg
    assert "count: sample holds 3 image tokens, its items 2" in msg
    assert "cannot drop" in msg and e.value.context["sample"] == 1


SIDES = st.sampled_from([64, 96, 128])
EXAMPLE = st.builds(
    Example,
    images=st.lists(st.tuples(SIDES, SIDES), max_size=3),
    mel_frames=st.sampled_from([0, 24, 40]),
    text=st.integers(2, 8),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(examples=st.lists(EXAMPLE, min_size=1, max_size=4), data=st.data())
def test_packed_row_names_the_wrong_sub_sample(examples, data):
    """Random Omni packs: aligned ones pass bit-identically; one image whose forward count
    differs from the collate's, or one image token typed into the text, names exactly its
    sub-sample."""
    batch = build(examples, pack=True, pad_to_multiple_of=data.draw(st.sampled_from([1, 8])))
    model = OmniForwardStandIn(batch)
    handle = install_llava(model, guard("raise"))
    assert same(unguarded(batch), run_forward(model, batch)) and handle.last_result.ok
    owners = [i for i, ex in enumerate(examples) for _ in ex.images]
    kind = data.draw(st.sampled_from(["count", "token"]))
    if kind == "count" and owners:
        j = data.draw(st.integers(0, len(owners) - 1))
        nit = batch.num_image_tiles.clone()
        nit[j] += data.draw(st.sampled_from([-2, 3]))
        batch.num_image_tiles = nit
        batch.image_embeddings = torch.randn(int(nit.sum()), 1, 8)
        bad = owners[j]
    else:
        bad = data.draw(st.integers(0, len(examples) - 1))
        start = sum(len(r) for r in batch.rows[:bad])
        batch.input_ids = batch.input_ids.clone()
        batch.input_ids[0, start] = IMAGE  # its first token is always text
    with pytest.raises(MediaAlignmentError) as e:
        run_forward(model, batch)
    assert e.value.context["sample"] == bad
    assert f"1 of {len(examples)} packed sub-samples" in str(e.value)
