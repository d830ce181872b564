"""install_qwen_vl on Megatron-Bridge's keyword contract, including packed THD micro-batches.

Megatron-Bridge 0.6.2's ``Qwen25VLModel`` / ``Qwen3VLModel`` cannot be imported on CPU (their
module imports need Transformer Engine and megatron-core's GPU paths), so the two stand-ins below
copy their ``forward`` signatures exactly (read from the 0.6.2 wheel) and merge inline the way
those forwards do: ``inputs_embeds.masked_scatter(mask, embeds)`` per modality with MRoPE from
``get_rope_index`` over the packed rows unpacked by ``packed_seq_params`` (Qwen2.5-VL), and one
vision call on images and videos reorganized in token order with
``combined_embeddings[vision_mask] = vision_embeds`` plus deepstack (Qwen3-VL). The vision tower,
embeddings, rope index and decoder are transformers' real tiny modules; THD attention is
emulated by running the decoder on each packed sample alone. They return Bridge's output: the
per-token loss ``[b, s]`` with labels, else the logits.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron_media_guard import Grammar, GuardConfig, MediaGuard
from megatron_media_guard.geometry import PatchMergeGeometry

pytest.importorskip("transformers.models.qwen3_vl")
pytest.importorskip("PIL")
PackedSeqParams = pytest.importorskip("megatron.core.packed_seq_params").PackedSeqParams

from megatron_media_guard.adapters import install_qwen_vl  # noqa: E402
from megatron_media_guard.testing.qwen_vl import (  # noqa: E402
    IMAGE,
    VIDEO,
    Sample,
    patch_of,
    seed_failure,
    smooth_clip,
    smooth_image,
    tiny_model,
)

ENGINE, TRAINER = 12, 30
BIG, SMALL = smooth_image(150, 200, 1), smooth_image(60, 84, 3)
CLIP = smooth_clip(4, 150, 180, 2)
PAD = 0


def _config(hf) -> SimpleNamespace:
    c = hf.config
    return SimpleNamespace(
        image_token_id=c.image_token_id,
        video_token_id=c.video_token_id,
        vision_start_token_id=c.vision_start_token_id,
        vision_end_token_id=c.vision_end_token_id,
        vision_config=c.vision_config,
        vocab_size=c.text_config.vocab_size,
        sequence_parallel=False,
    )


def _segments(packed_seq_params, total: int) -> list[tuple[int, int]]:
    """(start, length) of each packed sample: padded starts, unpadded lengths (as Bridge's
    ``unpack_mcore_thd_tensor_for_position_ids``)."""
    cu = packed_seq_params.cu_seqlens_q.tolist()
    padded = packed_seq_params.cu_seqlens_q_padded
    starts = padded.tolist()[:-1] if padded is not None else cu[:-1]
    return [(s, b - a) for s, a, b in zip(starts, cu[:-1], cu[1:])]


class _StandIn(nn.Module):
    def __init__(self, family: str) -> None:
        super().__init__()
        self.full = tiny_model(family)
        self.hf = self.full.model
        self.config = _config(self.hf)
        self.pre_process = self.post_process = True

    def _rope(self, ids, image_grid_thw, video_grid_thw, packed_seq_params, **kw):
        rows, mask, segs = ids, None, None
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            segs = _segments(packed_seq_params, ids.shape[1])
            width = max(n for _, n in segs)
            rows = torch.zeros(len(segs), width, dtype=ids.dtype)
            mask = torch.zeros(len(segs), width, dtype=torch.bool)
            for r, (s, n) in enumerate(segs):
                rows[r, :n], mask[r, :n] = ids[0, s : s + n], True
        tt = torch.zeros_like(rows, dtype=torch.int)
        tt[rows == self.config.image_token_id] = 1
        tt[rows == self.config.video_token_id] = 2
        pos, _ = self.hf.get_rope_index(
            rows, tt, image_grid_thw, video_grid_thw, attention_mask=mask, **kw
        )
        if segs is None:
            return pos, None
        out = torch.zeros(3, 1, ids.shape[1], dtype=pos.dtype)
        for r, (s, n) in enumerate(segs):
            out[:, 0, s : s + n] = pos[:, r, :n]
        return out, segs

    def _decode(self, emb, pos, segs, labels, **kw):
        lm = self.hf.language_model
        if segs is None:
            hidden = lm(inputs_embeds=emb, position_ids=pos, **kw).last_hidden_state
        else:  # THD: every packed sample attends only to itself
            hidden = torch.zeros_like(emb)
            for s, n in segs:
                part = _deepstack_part(kw, s, n)
                sl = slice(s, s + n)
                out = lm(inputs_embeds=emb[:, sl], position_ids=pos[:, :, sl], **part)
                hidden[:, sl] = out.last_hidden_state
        logits = self.full.lm_head(hidden)
        if labels is None:
            return logits
        ce = nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten().clamp(min=0), reduction="none"
        )
        return ce.view(labels.shape)


def _deepstack_part(kw: dict, s: int, n: int) -> dict:
    """The deepstack inputs of one packed sample: its mask columns and its vision rows."""
    if not kw:
        return {}
    mask = kw["visual_pos_masks"]
    before, within = int(mask[:, :s].sum()), int(mask[:, s : s + n].sum())
    if not within:
        return {}
    rows = slice(before, before + within)
    return {
        "visual_pos_masks": mask[:, s : s + n],
        "deepstack_visual_embeds": [e[rows] for e in kw["deepstack_visual_embeds"]],
    }


class Qwen25VLModel(_StandIn):
    """Bridge 0.6.2 ``Qwen25VLModel.forward``: signature and inline merge."""

    def __init__(self) -> None:
        super().__init__("qwen2_5_vl")
        self.visual = self.hf.visual

    def forward(
        self,
        input_ids: torch.LongTensor = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.FloatTensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        mm_token_type_ids: torch.IntTensor | None = None,
        labels: torch.Tensor = None,
        inference_context=None,
        packed_seq_params=None,
        extra_block_kwargs: dict | None = None,
        runtime_gather_output: bool | None = None,
        *,
        inference_params=None,
        loss_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hf = self.hf
        if inputs_embeds is None:
            inputs_embeds = hf.get_input_embeddings()(input_ids)
        if pixel_values is not None:
            out = hf.get_image_features(pixel_values, image_grid_thw, return_dict=True)
            embeds = torch.cat(out.pooler_output, dim=0)
            mask, _ = hf.get_placeholder_mask(input_ids, inputs_embeds, image_features=embeds)
            inputs_embeds = inputs_embeds.masked_scatter(mask, embeds)
        if pixel_values_videos is not None:
            out = hf.get_video_features(pixel_values_videos, video_grid_thw, return_dict=True)
            embeds = torch.cat(out.pooler_output, dim=0)
            _, mask = hf.get_placeholder_mask(input_ids, inputs_embeds, video_features=embeds)
            inputs_embeds = inputs_embeds.masked_scatter(mask, embeds)
        pos, segs = self._rope(
            input_ids,
            image_grid_thw,
            video_grid_thw,
            packed_seq_params,
            second_per_grid_ts=second_per_grid_ts,
        )
        return self._decode(inputs_embeds, pos, segs, labels)


class _Vision(nn.Module):
    """Bridge's vision model call: ``vision_model(hidden_states=, grid_thw=)`` -> (embeds,
    deepstack features)."""

    def __init__(self, visual) -> None:
        super().__init__()
        self.visual = visual

    def forward(self, hidden_states, grid_thw):
        out = self.visual(hidden_states, grid_thw=grid_thw)
        return out.pooler_output, list(out.deepstack_features)


class Qwen3VLModel(_StandIn):
    """Bridge 0.6.2 ``Qwen3VLModel.forward``: signature, one vision call on the items in token
    order, ``combined_embeddings[vision_mask] = vision_embeds``, deepstack."""

    def __init__(self) -> None:
        super().__init__("qwen3_vl")
        self.vision_model = _Vision(self.hf.visual)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor = None,
        attention_mask: torch.Tensor = None,
        labels: torch.Tensor = None,
        loss_mask: torch.Tensor = None,
        inference_params=None,
        packed_seq_params=None,
        extra_block_kwargs: dict | None = None,
        pixel_values: torch.Tensor = None,
        pixel_values_videos: torch.Tensor = None,
        image_grid_thw: torch.Tensor = None,
        video_grid_thw: torch.Tensor = None,
        image_input_mask: torch.Tensor = None,
        video_input_mask: torch.Tensor = None,
        cp_img_num: list[int] | None = None,
        images_padded: list[bool] | None = None,
        inference_context: object | None = None,
        runtime_gather_output: bool | None = None,
        mm_token_type_ids: torch.Tensor = None,
        **kwargs,
    ) -> torch.Tensor:
        img, vid = self.config.image_token_id, self.config.video_token_id
        data, grid = _reorganize(
            input_ids, pixel_values, pixel_values_videos, image_grid_thw, video_grid_thw, img, vid
        )
        if image_input_mask is None:
            image_input_mask = input_ids == img
        if video_input_mask is None:
            video_input_mask = input_ids == vid
        vision_mask = image_input_mask | video_input_mask
        emb = self.hf.get_input_embeddings()(input_ids).clone()
        deepstack = None
        if grid is not None:
            embeds, deepstack = self.vision_model(hidden_states=data, grid_thw=grid)
            emb[vision_mask] = embeds
        pos, segs = self._rope(input_ids, image_grid_thw, video_grid_thw, packed_seq_params)
        kw = {}
        if deepstack is not None:
            kw = {"visual_pos_masks": vision_mask, "deepstack_visual_embeds": deepstack}
        return self._decode(emb, pos, segs, labels, **kw)


def _reorganize(ids, pv, pvv, ig, vg, img, vid):
    """Bridge's ``reorganize_inputs``: both modalities' rows in the order their runs come."""
    if pv is None or pvv is None:
        return (pv, ig) if pvv is None else (pvv, vg)
    flat = ids.reshape(-1)
    vis = (flat == img) | (flat == vid)
    starts = vis & ~torch.cat([torch.zeros(1, dtype=torch.bool), vis[:-1]])
    kinds = flat[starts].tolist()
    parts, grids, k, off = [], [], 0, {"image": 0, "video": 0}
    rows = {"image": iter(ig.tolist()), "video": iter(vg.tolist())}
    src = {"image": pv, "video": pvv}
    while k < len(kinds):
        mod = "image" if kinds[k] == img else "video"
        t, h, w = next(rows[mod])
        parts.append(src[mod][off[mod] : off[mod] + t * h * w])
        grids.append([t, h, w])
        off[mod] += t * h * w
        k += t
    return torch.cat(parts), torch.tensor(grids)


STANDINS = {"qwen2_5_vl": Qwen25VLModel, "qwen3_vl": Qwen3VLModel}
_BUILT: dict = {}


def standin(family: str) -> _StandIn:
    if family not in _BUILT:
        _BUILT[family] = STANDINS[family]().eval()
    return _BUILT[family]


def guard_for(family: str, policy: str) -> MediaGuard:
    f = patch_of(family) * 2
    geo = PatchMergeGeometry(patch=patch_of(family), min_pixels=f * f, max_pixels=TRAINER * f * f)
    return MediaGuard(GuardConfig(policy=policy), grammar=Grammar.qwen2_vl(), geometry=geo)


def bridge_args(batch: dict) -> dict:
    keys = ("input_ids", "pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw")
    return {k: batch[k] for k in keys}


def pack(batch: dict, align: int = 8, tail: tuple[int, ...] = ()) -> dict:
    """The [b, s] batch as one THD row: each sample's tokens (right padding stripped), padded to
    a multiple of ``align``, with Megatron's ``PackedSeqParams``; ``tail``: tokens after the last
    sample (the row's padding)."""
    ids, attn = batch["input_ids"], batch["attention_mask"]
    lengths = attn.sum(1).tolist()
    pieces, cu, cu_pad = [], [0], [0]
    for r, n in enumerate(lengths):
        padded = -(-n // align) * align
        pieces.append(torch.cat([ids[r, :n], torch.full((padded - n,), PAD)]))
        cu.append(cu[-1] + n)
        cu_pad.append(cu_pad[-1] + padded)
    out = bridge_args(batch)
    out["input_ids"] = torch.cat([*pieces, torch.tensor(tail, dtype=ids.dtype)])[None]
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    out["packed_seq_params"] = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=t(cu),
        cu_seqlens_kv=t(cu),
        cu_seqlens_q_padded=t(cu_pad),
        cu_seqlens_kv_padded=t(cu_pad),
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    return out


SAMPLES = [Sample((("image", SMALL),)), Sample((("image", BIG),)), Sample((("video", CLIP),))]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_packed_thd_drop_keeps_the_other_samples_bit_identical(family):
    _, mixed = seed_failure(family, SAMPLES, ENGINE, TRAINER)
    model = standin(family)
    packed = pack(mixed)
    labels = packed["input_ids"].clone()
    loss_mask = torch.ones(labels.shape)
    guard = guard_for(family, "drop")
    with torch.no_grad(), install_qwen_vl(model, guard, loss_mask_inplace=True) as h:
        loss = model(**packed, labels=labels, loss_mask=loss_mask)
    assert h.last_result.report.actions == ("keep", "drop", "drop")
    segs = _segments(packed["packed_seq_params"], labels.shape[1])
    (s0, n0), (s1, n1), (s2, n2) = segs
    # the caller's loss mask (what Bridge's forward step builds its loss from) is zeroed
    assert loss_mask[0, s1 : s1 + n1].eq(0).all() and loss_mask[0, s2 : s2 + n2].eq(0).all()
    assert loss_mask[0, s0 : s0 + n0].eq(1).all()
    # by hand: samples 1 and 2 without media, sample 0's image alone
    ref = dict(packed)
    ids = packed["input_ids"].clone()
    ph = (ids == IMAGE) | (ids == VIDEO)
    ph[0, s0 : s0 + n0] = False
    ids[ph] = 151643
    alone = seed_failure(family, SAMPLES[:1], ENGINE, TRAINER)[1]
    ref.update(input_ids=ids, pixel_values=alone["pixel_values"])
    ref.update(
        image_grid_thw=alone["image_grid_thw"], pixel_values_videos=None, video_grid_thw=None
    )
    with torch.no_grad():
        want = model(**ref, labels=labels)
    assert torch.equal(loss[0, s0 : s0 + n0], want[0, s0 : s0 + n0])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_packed_thd_repair_matches_the_engine_sized_batch(family):
    engine, mixed = seed_failure(family, SAMPLES, ENGINE, TRAINER)
    model = standin(family)
    tower = model.visual if family == "qwen2_5_vl" else model.vision_model
    calls = []
    hook = tower.register_forward_hook(lambda m, a, o: calls.append(1))
    try:
        with torch.no_grad():
            want = model(**pack(engine), labels=pack(engine)["input_ids"])
            plain_calls = len(calls)
            calls.clear()
            packed = pack(mixed)
            with install_qwen_vl(model, guard_for(family, "repair")) as h:
                got = model(**packed, labels=packed["input_ids"])
    finally:
        hook.remove()
    assert h.last_result.report.actions == ("keep", "repair", "repair")
    assert len(calls) == plain_calls == (2 if family == "qwen2_5_vl" else 1)
    segs = _segments(packed["packed_seq_params"], got.shape[1])
    s0, n0 = segs[0]
    assert torch.equal(got[0, s0 : s0 + n0], want[0, s0 : s0 + n0])  # untouched sample
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2)


def test_placeholders_in_the_packed_padding_become_text(tmp_path):
    import json

    from megatron_media_guard.testing.qwen_vl import build_batch

    family = "qwen2_5_vl"
    batch = build_batch(
        SAMPLES[:1], family, patch_of(family), TRAINER * (patch_of(family) * 2) ** 2
    )
    packed = pack(batch, tail=(PAD, IMAGE, PAD, PAD))
    model = standin(family)
    with pytest.raises(ValueError, match="do not match"):  # the plain model counts it
        model(**packed)
    guard = MediaGuard(GuardConfig(policy="drop", log_dir=str(tmp_path)), Grammar.qwen2_vl())
    with torch.no_grad(), install_qwen_vl(model, guard) as h:
        model(**packed)
    assert h.last_result.report.actions == ("keep",)
    recs = [json.loads(x) for x in next(tmp_path.glob("*.jsonl")).read_text().splitlines()]
    assert [r["action"] for r in recs if r["event"] == "check"] == ["ignored"]
