"""The Mistral 3 / Pixtral fixture on the real transformers class (tiny random config, CPU).

1. the fixture's arithmetic against the processor's own code: ``PixtralImageProcessorPil`` (resize,
   ``image_sizes``, padding), ``PixtralProcessor.replace_image_token`` (grammar; the class needs
   torchvision, so its function is taken from the module source), the model's feature split;
2. aligned batches: each sample's logits equal its own batch's;
3. the unguarded behaviour, pinned: a short run raises (the message counts features x hidden),
   +k/-k runs silently with sample 0's features in sample 1's row, a swap of two images of
   different size between samples runs silently with the wrong features.
"""

from __future__ import annotations

import ast
import importlib.util
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_media_guard.testing.families import mistral3 as fam
from megatron_media_guard.testing.families.base import Media

pytestmark = pytest.mark.timeout(120)


def img(h: int, w: int, tokens: int | None = None) -> Media:
    return Media("image", (h, w), tokens)


@pytest.fixture(scope="module")
def model():
    return fam.tiny_model(seed=0)


def _lm_embeds(model, kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, the ``inputs_embeds`` the language model received)."""
    seen = {}

    def grab(_mod, args, kw):
        seen["emb"] = kw["inputs_embeds"].detach().clone()

    h = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            logits = model(**kwargs).logits
    finally:
        h.remove()
    return logits, seen["emb"]


def _own(model, sample, seed=0):
    b = fam.make_batch(model, [sample], seed=seed)
    with torch.no_grad():
        return model(**b.kwargs).logits[0]


# -- 1. oracles ---------------------------------------------------------------------------------

ORIG_SIZES = [
    (30, 30),
    (28, 28),
    (27, 29),
    (100, 60),
    (1541, 17),
    (3000, 2000),
    (1540, 1540),
    (777, 1999),
]


def test_resize_and_layout_match_pixtral_image_processor():
    from PIL import Image
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    # what PixtralProcessor passes: patch_size * spatial_merge_size = 28, Mistral-Small-3.1's size
    proc = PixtralImageProcessorPil(
        size={"longest_edge": fam.LONGEST_EDGE}, patch_size={"height": 28, "width": 28}
    )
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ORIG_SIZES
    ]
    out = proc(images, return_tensors="pt")
    want = [fam.resized_size(h, w) for h, w in ORIG_SIZES]
    assert out["image_sizes"].tolist() == [list(s) for s in want]
    assert out["image_sizes"].dtype == torch.long
    pv = out["pixel_values"]
    assert pv.dtype == torch.float32
    assert tuple(pv.shape) == (len(want), 3, max(h for h, _ in want), max(w for _, w in want))
    for n, (h, w) in enumerate(want):  # top-left, zero padding right and below
        assert pv[n, :, h:, :].abs().sum() == 0 and pv[n, :, :, w:].abs().sum() == 0


def _replace_image_token():
    """``PixtralProcessor.replace_image_token`` from the module's source (the class itself is a
    torchvision-requiring dummy here)."""
    spec = importlib.util.find_spec("transformers.models.pixtral.processing_pixtral")
    tree = ast.parse(Path(spec.origin).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PixtralProcessor")
    fn = next(
        n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "replace_image_token"
    )
    space: dict = {}
    exec(compile(ast.Module([fn], []), "processing_pixtral", "exec"), space)
    return space["replace_image_token"]


@pytest.mark.parametrize("size", [(28, 28), (56, 84), (84, 56), (1540, 1036)])
def test_grammar_matches_processor(size):
    proc = types.SimpleNamespace(
        patch_size=14, spatial_merge_size=2, image_token=fam.IMAGE_TOKEN,
        image_break_token=fam.BREAK_TOKEN, image_end_token=fam.END_TOKEN,
    )  # fmt: skip
    text = _replace_image_token()(proc, {"image_sizes": [size]}, 0)
    names = {10: fam.IMAGE_TOKEN, fam.BREAK_ID: fam.BREAK_TOKEN, fam.END_ID: fam.END_TOKEN}
    run = fam.image_run(fam.num_features(*size), size[1] // 28, 10)
    assert "".join(names[i] for i in run) == text
    assert run.count(10) == fam.num_features(*size) == (size[0] // 28) * (size[1] // 28)


def test_feature_split_matches_model(model):
    b = fam.make_batch(model, [[img(56, 84), img(28, 28)], [img(84, 56)]])
    with torch.no_grad():
        feats = model.model.get_image_features(
            pixel_values=b.kwargs["pixel_values"], image_sizes=b.kwargs["image_sizes"]
        ).pooler_output
    assert [f.shape[0] for f in feats] == [n for _, _, n in b.items] == [6, 1, 6]
    assert b.runs == [[("image", 6), ("image", 1)], [("image", 6)]]


# -- 2. aligned ---------------------------------------------------------------------------------

ALIGNED = {
    "one_each": [[img(56, 84)], [img(84, 56)]],
    "ragged": [[img(28, 28), img(84, 84)], [], [img(56, 28)]],
    "text_only_and_two": [[], [img(112, 56), img(28, 56)]],
}


@pytest.mark.parametrize("name", sorted(ALIGNED))
def test_aligned_each_sample_equals_its_own_batch(model, name):
    samples = ALIGNED[name]
    b = fam.make_batch(model, samples)
    with torch.no_grad():
        logits = model(**b.kwargs).logits
    for s, sample in enumerate(samples):
        n = b.lengths[s]
        torch.testing.assert_close(logits[s, :n], _own(model, sample), atol=1e-5, rtol=0)


# -- 3. unguarded -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "samples",
    [
        [[img(56, 84, tokens=5)]],  # short run
        [[img(56, 84)], [img(28, 56, tokens=1)]],  # short in one sample of two
        [[img(56, 84, tokens=7)]],  # surplus
    ],
)
def test_unguarded_count_mismatch_raises(model, samples):
    b = fam.make_batch(model, samples)
    n_tok = sum(n for r in b.runs for _, n in r)
    n_feat = sum(n for _, _, n in b.items) * model.config.text_config.hidden_size
    with pytest.raises(ValueError, match=f"tokens: {n_tok}, features: {n_feat}$"):
        model(**b.kwargs)


@pytest.mark.parametrize("k", [1, 2])
def test_unguarded_plus_minus_k_is_silent_and_moves_features(model, k):
    # sample 0: 6 features, 6 + k placeholders; sample 1: 6 features, 6 - k placeholders
    b = fam.make_batch(model, [[img(56, 84, tokens=6 + k)], [img(84, 56, tokens=6 - k)]])
    _, emb = _lm_embeds(model, b.kwargs)
    with torch.no_grad():
        feats = model.model.get_image_features(
            pixel_values=b.kwargs["pixel_values"], image_sizes=b.kwargs["image_sizes"]
        ).pooler_output
    pos0 = (b.input_ids[0] == 10).nonzero().flatten()
    pos1 = (b.input_ids[1] == 10).nonzero().flatten()
    # sample 0's row takes its 6 features and then the first k of sample 1's image
    torch.testing.assert_close(emb[0, pos0[6:]], feats[1][:k])
    # sample 1's row gets the rest: the wrong rows of its own image
    torch.testing.assert_close(emb[1, pos1], feats[1][k:])


def test_unguarded_swap_is_silent_and_wrong(model):
    samples = [[img(56, 84)], [img(28, 56)]]  # 6 and 2 features
    b = fam.make_batch(model, samples, swap=(0, 1))
    logits, emb = _lm_embeds(model, b.kwargs)  # no error: totals are a permutation
    with torch.no_grad():
        feats = model.model.get_image_features(
            pixel_values=b.kwargs["pixel_values"], image_sizes=b.kwargs["image_sizes"]
        ).pooler_output
    pos0 = (b.input_ids[0] == 10).nonzero().flatten()
    # sample 0's 6 placeholders: the small image's 2 features, then 4 of its own (swapped) image
    torch.testing.assert_close(emb[0, pos0], torch.cat([feats[0], feats[1][:4]]))
    for s, sample in enumerate(samples):
        assert not torch.allclose(logits[s, : b.lengths[s]], _own(model, sample), atol=1e-3)
