"""install_vlm on transformers' real ``Mistral3ForConditionalGeneration`` (tiny random config,
CPU): Pixtral images as rows of ``[IMG]`` split by ``[IMG_BREAK]`` and closed by ``[IMG_END]``.

Inputs come from ``testing/families/mistral3.py`` (processed sizes, the processor's grammar and
padding). Aligned batches are compared with the plain model on the same batch; kept samples of
a guarded faulty batch with the same sample's plain forward in a batch of its own.

The fixture's arithmetic against the processor's own code comes first: ``PixtralImageProcessorPil``
(resize, ``image_sizes``, padding), ``PixtralProcessor.replace_image_token`` (grammar; the class
needs torchvision, so its function is taken from the module source), the model's feature split.
The plain class under the faults: ``tests/test_fixture_plain.py``; the shared contract and the
family's own faults: ``tests/families/``.
"""

from __future__ import annotations

import ast
import importlib.util
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from family_checks import records

from megatron_media_guard import GuardConfig, MediaGuard, MediaItem
from megatron_media_guard.families import mistral3 as spec_mod
from megatron_media_guard.repair.reproject import resize_frames

pytest.importorskip("transformers.models.mistral3")

from megatron_media_guard.adapters import install_vlm
from megatron_media_guard.testing.families import mistral3 as F
from megatron_media_guard.testing.families.base import Media

pytestmark = pytest.mark.timeout(120)

TOKENS = {"[IMG_BREAK]": F.BREAK_ID, "[IMG_END]": F.END_ID}


def img(h: int, w: int, tokens: int | None = None) -> Media:
    return Media("image", (h, w), tokens)


@pytest.fixture(scope="module")
def model():
    return F.tiny_model(seed=0)


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
        size={"longest_edge": F.LONGEST_EDGE}, patch_size={"height": 28, "width": 28}
    )
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ORIG_SIZES
    ]
    out = proc(images, return_tensors="pt")
    want = [F.resized_size(h, w) for h, w in ORIG_SIZES]
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
        patch_size=14, spatial_merge_size=2, image_token=F.IMAGE_TOKEN,
        image_break_token=F.BREAK_TOKEN, image_end_token=F.END_TOKEN,
    )  # fmt: skip
    text = _replace_image_token()(proc, {"image_sizes": [size]}, 0)
    names = {10: F.IMAGE_TOKEN, F.BREAK_ID: F.BREAK_TOKEN, F.END_ID: F.END_TOKEN}
    run = F.image_run(F.num_features(*size), size[1] // 28, 10)
    assert "".join(names[i] for i in run) == text
    assert run.count(10) == F.num_features(*size) == (size[0] // 28) * (size[1] // 28)


def test_feature_split_matches_model(model):
    b = F.make_batch(model, [[img(56, 84), img(28, 28)], [img(84, 56)]])
    with torch.no_grad():
        feats = model.model.get_image_features(
            pixel_values=b.kwargs["pixel_values"], image_sizes=b.kwargs["image_sizes"]
        ).pooler_output
    assert [f.shape[0] for f in feats] == [n for _, _, n in b.items] == [6, 1, 6]
    assert b.runs == [[("image", 6), ("image", 1)], [("image", 6)]]


def logits(model, kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(**kwargs).logits


def own(model, sample) -> torch.Tensor:
    b = F.make_batch(model, [sample])
    return logits(model, b.kwargs)[0, : b.lengths[0]]


def guarded(model, samples, config=None, items=None, guard=None, **kw):
    b = F.make_batch(model, samples, **kw)
    with install_vlm(model, guard or config or GuardConfig(), tokenizer=TOKENS) as h:
        if items is not None:
            h.set_items(items)
        out = logits(model, b.kwargs)
        return b, out, h.last_result


ALL = [img(28, 56)]  # an aligned sample beside every fault: it must stay its own forward


def test_repair_reencodes_at_the_engines_longest_edge(model, tmp_path):
    """The trainer's image is 112x168 (4x6 cells); the engine wrote 6 placeholders: the resize
    with a smaller longest edge (2x3 cells) replayed, the item's own pixels re-encoded."""
    cfg = GuardConfig(policy="repair", log_dir=str(tmp_path))
    samples = [[img(112, 168, tokens=6)], ALL]
    # the original's size (the engine sized it): a frame alone would be a guess, not a replay
    source = [MediaItem(0, sample=0, source_hw=(112, 168)), MediaItem(0, sample=1)]
    b, out, res = guarded(model, samples, cfg, items=source)
    assert res.report.actions == ("repair", "keep")
    rec = next(r for r in records(tmp_path) if r["event"] == "repair")
    assert (rec["fidelity"], rec["grid"], rec["extra"]["size_hw"]) == (
        "engine-replay",
        [4, 6],
        [56, 84],
    )
    # by hand: the same pixels resized to 56x84, fed to the plain model with the same ids
    small = resize_frames(b.kwargs["pixel_values"][:1, :, :112, :168], (56, 84))
    pv = torch.zeros(2, 3, 56, 84)
    pv[0] = small[0]
    pv[1, :, :28, :56] = b.kwargs["pixel_values"][1, :, :28, :56]
    fixed = {**b.kwargs, "pixel_values": pv, "image_sizes": torch.tensor([[56, 84], [28, 56]])}
    torch.testing.assert_close(out, logits(model, fixed), atol=1e-5, rtol=1e-5)


def test_repair_falls_back_where_no_grid_fits(model, tmp_path):
    """61 cells (prime): only 1x61, beyond the tower's 8 cells per side."""
    cfg = GuardConfig(policy="repair", fallback="drop", log_dir=str(tmp_path))
    _, _, res = guarded(model, [[img(56, 84, tokens=61)], ALL], cfg)
    assert res.report.actions == ("drop", "keep")
    recs = records(tmp_path)
    assert any("unreachable" in (r.get("reason") or "") for r in recs if r["event"] == "repair")


def test_a_guard_built_by_hand_with_the_family_grammar(model):
    guard = MediaGuard(GuardConfig(), grammar=spec_mod.SPEC.grammar(model, TOKENS))
    _, _, res = guarded(model, [[img(56, 84)], [img(84, 56)]], guard=guard)
    assert res.report.actions == ("keep", "keep")
