"""The MIMO adapter runs megatron-core's own MimoModel.align_embeddings_by_token_positions."""

from __future__ import annotations

import pytest
import torch

base_mod = pytest.importorskip("megatron.core.models.mimo.model.base")
MimoModel = base_mod.MimoModel

from devices import DEVICES  # noqa: E402
from family_checks import records  # noqa: E402

from megatron_media_guard import (  # noqa: E402
    Grammar,
    GuardConfig,
    MediaAlignmentError,
    MediaGuard,
    MediaInputError,
    MediaItem,
)
from megatron_media_guard.adapters import guarded_by, install_mimo  # noqa: E402
from megatron_media_guard.core.host import count_transfers  # noqa: E402

IMG, AUD = 50, 51
SPECIAL = {"images": IMG, "audio": AUD}
H = 4


class TinyMimo:
    align_embeddings_by_token_positions = MimoModel.align_embeddings_by_token_positions

    def __init__(self):
        self.special_token_ids = dict(SPECIAL)


def make(rows, seed=0):
    """rows: per sample, text token ids and (placeholder token, run length) pairs."""
    items, counts, seqs = [], {"images": 0, "audio": 0}, []
    for b, row in enumerate(rows):
        toks = []
        for x in row:
            if isinstance(x, tuple):
                tok, n = x
                mod = "images" if tok == IMG else "audio"
                toks += [tok] * n
                items.append(MediaItem(n, sample=b, modality=mod))
                counts[mod] += n
            else:
                toks.append(x)
        seqs.append(toks)
    s = max(len(t) for t in seqs)
    ids = torch.tensor([t + [0] * (s - len(t)) for t in seqs])
    g = torch.Generator().manual_seed(seed)
    n_text = int(((ids != IMG) & (ids != AUD)).sum())
    embs = {"text": torch.randn(n_text, H, generator=g)}
    for mod, n in counts.items():
        if n:
            embs[mod] = torch.randn(n, H, generator=g) + 100
    return ids, embs, items


def run(model, ids, embs):
    return model.align_embeddings_by_token_positions(embs, ids, model.special_token_ids)


def guarded(items=None, **config):
    """A TinyMimo under ``install_mimo(config=GuardConfig(**config))``, ``items`` set for its
    next call."""
    model = TinyMimo()
    handle = install_mimo(model, config=GuardConfig(**config))
    handle.set_items(items)
    return model, handle


ROWS = [
    [1, (IMG, 3), 2, (AUD, 2), 3],
    [4, 5, (IMG, 2), 6],
    [7, 8, 9],  # text only
]


@pytest.mark.parametrize("with_items", [True, False])
@pytest.mark.parametrize("rows", [ROWS, [[1, (IMG, 2), 2], [(IMG, 3), 3, 4]]])
def test_aligned_is_bit_identical_and_counts_no_text(rows, with_items):
    ids, embs, items = make(rows)
    ref = run(TinyMimo(), ids, embs)
    model, handle = guarded(items if with_items else None, policy="drop")
    with count_transfers() as seen:
        out = run(model, ids, embs)
    assert out.shape == (ids.shape[1], ids.shape[0], H) and out.is_contiguous()
    assert torch.equal(out, ref)
    assert handle.last_result.report.ok
    assert not any("text" in why for why in seen)  # from the totals, or the parsed runs
    if with_items:
        assert sum(seen.values()) == 1  # the merge's verdict only


def faulty(compensating=False):
    """+1 image row in sample 0, -1 in sample 1: the totals agree, the original merges
    silently. compensating: one text row short and one image row extra instead of sample 1's
    -1 (the totals still add up to b*s)."""
    ids, embs, _ = make(ROWS)
    if compensating:
        embs["text"] = embs["text"][:-1]
        embs["images"] = torch.cat([embs["images"], embs["images"][:1]])
    items = [
        MediaItem(4, sample=0, modality="images"),
        MediaItem(2, sample=0, modality="audio"),
        MediaItem(2 if compensating else 1, sample=1, modality="images"),
    ]
    return ids, embs, items


def test_errors_the_original_passes_are_caught_under_raise():
    ids, embs, items = faulty()
    run(TinyMimo(), ids, embs)  # megatron-core: no error, image rows shifted between samples
    model, handle = guarded(policy="raise")
    handle.set_step(5)
    for comp, parts in ((False, ("sample 1", "step 5")), (True, ("text tokens",))):
        ids, embs, items = faulty(comp)
        handle.set_items(items)
        with pytest.raises(MediaAlignmentError) as e:
            run(model, ids, embs)
        assert all(p in str(e.value) for p in ("sample 0", *parts))
        assert e.value.context["sample"] == 0


def test_drop_keeps_other_samples_and_exposes_the_loss_mask():
    ids, embs, items = faulty()
    ref = run(TinyMimo(), ids, embs)
    model, handle = guarded(items, policy="drop")
    out = run(model, ids, embs)
    assert handle.last_result.report.dropped == (0, 1)
    assert torch.equal(out[:, 2], ref[:, 2])
    assert (out[:, :2][(ids[:2] == IMG).T] == 0).all()  # no foreign rows merged
    lm = torch.ones(3, ids.shape[1])
    labels = torch.full((3, ids.shape[1]), 7)
    lm2, labels2 = handle.mask_loss(lm, labels)
    assert (lm2[:2] == 0).all() and (lm2[2] == 1).all()
    assert (labels2[:2] == -100).all() and (labels2[2] == 7).all()
    assert torch.equal(handle.last_result.loss_mask[:2], torch.zeros(2, ids.shape[1]))
    run(model, ids, embs)  # the items went with the call: inferred from the runs, all agree
    assert handle.last_result.report.ok


def test_totals_mismatch_without_items_names_the_modality():
    ids, embs, _ = make(ROWS)
    embs["images"] = torch.cat([embs["images"], embs["images"][:1]])
    model, _ = guarded(policy="raise")
    with pytest.raises(MediaAlignmentError, match="'images': 6 feature rows for 5 placeholders"):
        run(model, ids, embs)


def test_totals_mismatch_drop_keeps_samples_without_that_modality():
    rows = [[1, (IMG, 3), 2], [4, (AUD, 2), 6], [7, 8, 9]]
    ids, embs, _ = make(rows)
    ref = run(TinyMimo(), ids, embs)
    embs["images"] = torch.cat([embs["images"], embs["images"][:1]]).requires_grad_(True)
    model, handle = guarded(policy="drop")
    out = run(model, ids, embs)
    assert handle.last_result.report.dropped == (0,)
    assert torch.equal(out[:, 1:], ref[:, 1:])
    out.sum().backward()  # the unmerged image rows stay in the graph with a zero gradient
    assert embs["images"].grad is not None and (embs["images"].grad == 0).all()


def test_nonfinite_features_drop_their_sample():
    ids, embs, items = make(ROWS)
    ref = run(TinyMimo(), ids, embs)
    embs["images"] = embs["images"].clone()
    embs["images"][3, 0] = float("nan")  # sample 1's image
    model, handle = guarded(items, policy="raise", nonfinite="drop")
    out = run(model, ids, embs)
    assert handle.last_result.report.dropped == (1,)
    assert torch.isfinite(out).all() and torch.equal(out[:, 0], ref[:, 0])


@pytest.mark.parametrize(
    "mutate, cut, match",
    [
        (lambda e: e.update(text=e["text"][:-1]), None, "17 text tokens in input_ids, 16 text"),
        (lambda e: e.update(text=e["text"][:-1]), 3, "17 text tokens in input_ids, 16 text"),
        (lambda e: e.update(video=e["images"]), None, "no special token id for modality 'video'"),
        (lambda e: None, 2, "items of modality 'images' declare 3"),
    ],
    ids=["text-rows", "text-rows-with-items", "unknown-modality", "items-vs-embeddings"],
)
def test_bad_input_is_a_clear_error(mutate, cut, match):
    ids, embs, items = make(ROWS)
    mutate(embs)
    model = TinyMimo()
    install_mimo(model).set_items(None if cut is None else items[:cut])
    with pytest.raises(MediaInputError, match=match):
        run(model, ids, embs)


def test_guard_grammar_must_match_special_tokens():
    guard = MediaGuard(GuardConfig(), Grammar({"images": 99}))
    with pytest.raises(MediaInputError, match="special_token_ids"):
        install_mimo(TinyMimo(), guard)


def test_install_remove_restores_the_instance():
    model = TinyMimo()
    handle = install_mimo(model)
    assert guarded_by(model.align_embeddings_by_token_positions) is handle
    assert model.align_embeddings_by_token_positions.__wrapped__.__func__ is (
        MimoModel.align_embeddings_by_token_positions
    )
    handle.remove()  # a second install: test_method_hook
    assert "align_embeddings_by_token_positions" not in vars(model)


def test_text_rows_offset_by_the_media_drop_every_sample(tmp_path):
    """Found on the fault path before the stage agrees: one plan drops every sample, one
    record each names the text rows, and the guard counts the drops."""
    ids, embs, items = faulty(compensating=True)
    model, handle = guarded(items, policy="drop", log_dir=str(tmp_path))
    with count_transfers() as seen:
        out = run(model, ids, embs)
    assert seen["MIMO text token count (slow path)"] == 1
    res = handle.last_result
    assert res.report.dropped == (0, 1, 2) and not res.report.ok
    assert out.shape == (ids.shape[1], 3, H)
    lm, _ = handle.mask_loss(torch.ones(ids.shape))
    assert (lm == 0).all() and (res.loss_mask == 0).all()
    drops = [r for r in records(tmp_path) if r["event"] == "drop"]
    assert [r["sample"] for r in drops] == [0, 1, 2]
    assert all("17 text tokens in input_ids, 16 text embeddings" in r["reason"] for r in drops)
    assert handle.guard.counters["dropped"] == 3


@pytest.mark.parametrize("device", DEVICES)
def test_text_placement_and_drop_all_on_the_tensors_device(device):
    ids, embs, items = make(ROWS)
    ids = ids.to(device)
    embs = {k: v.to(device, torch.bfloat16) for k, v in embs.items()}
    ref = run(TinyMimo(), ids, embs)
    model, handle = guarded(items, policy="drop")
    assert torch.equal(run(model, ids, embs), ref)
    ids, embs, items = faulty(compensating=True)
    handle.set_items(items)
    out = run(model, ids.to(device), {k: v.to(device) for k, v in embs.items()})
    assert out.device.type == torch.device(device).type
    assert handle.last_result.report.dropped == (0, 1, 2)
    lm, _ = handle.mask_loss(torch.ones(ids.shape, device=device))
    assert lm.device.type == torch.device(device).type and (lm == 0).all()
