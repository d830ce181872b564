"""What the family tests share: media of a sample, the per-rank records a guarded call wrote, a
raise naming the culprit sample (message and ``raise`` record), the decoder's inputs, forwards."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaItem, install_vlm
from megatron_media_guard.diagnostics import GuardRecord, RankInfo, build_record, json_dumps
from megatron_media_guard.replay.bundle_save import save_bundle
from megatron_media_guard.testing import TEST_GRAMMARS, inject
from megatron_media_guard.testing.families.base import Media
from megatron_media_guard.testing.families.internvl import SEQ


def img(*size, n=None):
    """An image of ``size`` (its fixture's units) with ``n`` placeholders (None: its count)."""
    return Media("image", size, n)


def vid(*size, n=None):
    return Media("video", size, n)


def aud(*size, n=None):
    return Media("audio", size, n)


def records(log_dir) -> list[dict]:
    """Every record of the per-rank JSONL logs under ``log_dir``."""
    return [
        json.loads(line)
        for f in Path(log_dir).glob("*.jsonl")
        for line in f.read_text().splitlines()
    ]


def raised_samples(
    run: Callable[[], object], bad: int | set[int], log_dir, item: str | None = None
) -> set[int]:
    """Runs ``run`` (a guarded call under ``policy="raise"`` logging to ``log_dir``), which
    must raise :class:`MediaAlignmentError` naming ``bad`` (its first sample, for a set; and
    ``item`` on that sample's line, where given); returns the samples of the ``raise`` records
    it wrote."""
    first = bad if isinstance(bad, int) else min(bad)
    match = rf"(?m)^\s*sample {first} .*{re.escape(item)}" if item else rf"sample {first}\b"
    with pytest.raises(MediaAlignmentError, match=match):
        run()
    return {r["sample"] for r in records(log_dir) if r["event"] == "raise"}


def decoder_inputs(decoder, run: Callable[[], object]):
    """(the ``inputs_embeds`` keyword ``decoder`` received in its first call while ``run()``
    ran: what the merge handed the language model, ``run()``'s result)."""
    seen = []
    hook = decoder.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["inputs_embeds"].detach().clone()), with_kwargs=True
    )
    try:
        out = run()
    finally:
        hook.remove()
    return seen[0], out


@contextlib.contextmanager
def spy(module, take=lambda out: out):
    """Keyword arguments the module's forward got last, and ``take`` of each output as it
    returns (the model may change the output object after); the hooks removed after."""
    seen, outs = {}, []
    hooks = (
        module.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True),
        module.register_forward_hook(lambda m, a, o: outs.append(take(o))),
    )
    try:
        yield seen, outs
    finally:
        for h in hooks:
            h.remove()


def logits(model, kw: dict) -> torch.Tensor:
    """The logits of one forward on ``kw`` under no_grad."""
    with torch.no_grad():
        return model(**kw).logits


def response(b) -> torch.Tensor:
    """Labels on each sample's last two tokens of batch ``b`` (its response; the prompt is not
    trained), -100 elsewhere."""
    labels = torch.full_like(b.input_ids, -100)
    for s, n in enumerate(b.lengths):
        labels[s, n - 2 : n] = b.input_ids[s, n - 2 : n]
    return labels


def hidden_forward(model, kw: dict):
    """(final hidden states of ``model.model``, output) of one forward under no_grad, where
    the wide vocabulary dominates CPU time: logits for the last position only unless labels
    are given (the loss needs them all)."""
    seen = []
    hook = model.model.register_forward_hook(lambda m, a, o: seen.append(o.last_hidden_state))
    extra = {} if "labels" in kw else {"logits_to_keep": 1}
    try:
        with torch.no_grad():
            out = model(**kw, **extra)
    finally:
        hook.remove()
    return seen[0], out


def record_line(event: str, rank: int | None = 0, **fields) -> str:
    """One schema-v1 record line as the writer makes it (no I/O, no newline), at a fixed
    time unless ``time=`` is given."""
    time = fields.pop("time", "2026-01-01T00:00:00.000000+00:00")
    rec = build_record(GuardRecord(event, **fields), RankInfo(rank=rank), time=time, host="h",
                       pid=1, caller="t:t")  # fmt: skip
    return json_dumps(rec)


def saved_bundle(d, **config):
    """A replay bundle of a two-sample Qwen batch with a surplus feature in sample 0 (rank 1,
    step 3; ``config``: the GuardConfig's fields), saved under ``d``."""
    q = TEST_GRAMMARS["qwen"]
    batch = inject(q, [[("image", 4)], [("image", 3)]], "surplus_feature")
    path = save_bundle(d, input_ids=batch.input_ids, items=batch.items, grammar=q,
                       config=GuardConfig(**config), rank=RankInfo(rank=1), step=3)  # fmt: skip
    assert path is not None
    return path


def guarded_forward(F, model, samples, config=None, items=None, tokenizer=None, run=None, **kw):
    """``(batch, output, last_result)`` of ``samples`` (fixture module ``F``'s batch) through
    ``install_vlm(model, config, tokenizer=tokenizer)`` (``config``: a GuardConfig or a
    MediaGuard), ``items`` given with ``set_items``; the guard removed. ``run(model, kwargs)``:
    the output (default: the model's forward), e.g. :func:`hidden_forward`."""
    b = F.make_batch(model, samples, **kw)
    with install_vlm(model, config or GuardConfig(), tokenizer=tokenizer) as h:
        if items is not None:
            h.set_items(items)
        with torch.no_grad():
            out = model(**b.kwargs) if run is None else run(model, b.kwargs)
        return b, out, h.last_result


def own_logits(F, model, sample, **kw) -> torch.Tensor:
    """The plain model's logits of ``sample`` in a batch of its own (``kw``: the fixture's
    ``make_batch`` keywords), over its length. Images and videos together, which GLM-4V's and
    Nemotron Omni's plain forwards cannot take: their features placed by hand
    (:func:`placed_by_hand`), the language model run on them."""
    b = F.make_batch(model, [sample], **kw)
    by_hand = _BY_HAND.get(F.__name__.rpartition(".")[2])
    with torch.no_grad():
        if by_hand and {m.modality for m in sample} >= {"image", "video"}:
            return by_hand(F, model, b)[0, : b.lengths[0]]
        return model(**b.kwargs).logits[0, : b.lengths[0]]


def _nemotron_by_hand(F, model, b) -> torch.Tensor:
    kw = b.kwargs
    img = model.get_image_features(kw["pixel_values"], kw["image_grid_hw"]).pooler_output
    vid = model.get_video_features(kw["pixel_values_videos"]).pooler_output
    per = vid[0].shape[0] // kw["pixel_values_videos"].shape[1]  # a tubelet's features
    queue = {"image": list(img), "video": [g for v in vid for g in v.split(per)]}
    emb = placed_by_hand(model, b, F.IMAGE, queue)
    return model.language_model(inputs_embeds=emb, attention_mask=kw["attention_mask"]).logits


def _glm4v_by_hand(F, model, b) -> torch.Tensor:
    """With the model's own M-RoPE positions."""
    kw = b.kwargs
    im = model.get_image_features(kw["pixel_values"], kw["image_grid_thw"]).pooler_output
    vd = model.get_video_features(kw["pixel_values_videos"], kw["video_grid_thw"]).pooler_output
    frames = [  # a video's temporal groups, one run each
        g for (_, h, w), v in zip(kw["video_grid_thw"].tolist(), vd) for g in v.split(h * w // 4)
    ]
    emb = placed_by_hand(
        model, b, model.config.image_token_id, {"image": list(im), "video": frames}
    )
    types_grids = kw["mm_token_type_ids"], kw["image_grid_thw"], kw["video_grid_thw"]
    mask = kw["attention_mask"]
    rope = model.model.get_rope_index(b.input_ids, *types_grids, attention_mask=mask)[0]
    return model(inputs_embeds=emb, position_ids=rope, attention_mask=mask).logits


_BY_HAND = {"nemotron_omni": _nemotron_by_hand, "glm4v": _glm4v_by_hand}


def internvl_items(b) -> list:
    """What a collate that kept InternVL's ``num_patches`` gives ``set_items`` for batch ``b``:
    per tile block in ``pixel_values`` order, its sample and one item per image (its tiles'
    features) or per video frame (one tile's), all of the model's one modality. After a swap a
    block keeps its place (its sample) and brings its tiles (``FamilyBatch.items``)."""
    out = []
    for s, mod, n in b.items:
        sizes = [n] if mod == "image" else [SEQ] * (n // SEQ)
        out += [MediaItem(x, sample=s, modality="image") for x in sizes]
    return out


def placed_by_hand(model, b, token: int, queue: dict[str, list[torch.Tensor]]) -> torch.Tensor:
    """Sample 0's input embeddings of batch ``b`` with its features placed by hand: run by run
    in token order (``b.runs[0]``: (modality, placeholders)), each run taking the next feature
    block of its modality from ``queue``, at the positions of the shared placeholder ``token``.
    The reference where the plain model cannot take a sample's images and videos together."""
    emb = model.get_input_embeddings()(b.input_ids)
    pos = (b.input_ids[0] == token).nonzero().flatten().tolist()
    at = 0
    for mod, n in b.runs[0]:
        f = queue[mod].pop(0)
        assert f.shape[0] == n
        emb[0, pos[at : at + n]] = f
        at += n
    return emb
