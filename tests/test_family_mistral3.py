"""install_vlm on transformers' real ``Mistral3ForConditionalGeneration`` (tiny random config,
CPU): Pixtral images as rows of ``[IMG]`` split by ``[IMG_BREAK]`` and closed by ``[IMG_END]``.

The fixture (``testing/families/mistral3.py``) against the processor's own code first:
``PixtralImageProcessorPil`` (resize, ``image_sizes``, padding),
``PixtralProcessor.replace_image_token`` (its function taken from the module source: the class
needs torchvision); then repair. The plain class under the faults:
``tests/test_fixture_plain.py``; the shared contract and the family's own faults:
``tests/families/``.
"""

from __future__ import annotations

import ast
import importlib.util
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from family_checks import guarded_forward, img, records

from megatron_media_guard import GuardConfig, MediaItem
from megatron_media_guard.repair.reproject import resize_frames

pytest.importorskip("transformers.models.mistral3")

from megatron_media_guard.testing.families import mistral3 as F

pytestmark = pytest.mark.timeout(120)

TOKENS = {"[IMG_BREAK]": F.BREAK_ID, "[IMG_END]": F.END_ID}


@pytest.fixture(scope="module")
def model():
    return F.tiny_model(seed=0)


ORIG_SIZES = [(30, 30), (28, 28), (27, 29), (100, 60), (1541, 17), (3000, 2000), (1540, 1540),
              (777, 1999)]  # fmt: skip


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


def test_repair_reencodes_at_the_engines_longest_edge(model, tmp_path):
    """The trainer's image is 112x168 (4x6 cells); the engine wrote 6 placeholders: the resize
    with a smaller longest edge (2x3 cells) replayed, the item's own pixels re-encoded."""
    cfg = GuardConfig(policy="repair", log_dir=str(tmp_path))
    samples = [[img(112, 168, n=6)], [img(28, 56)]]
    # the original's size (the engine sized it): a frame alone would be a guess, not a replay
    source = [MediaItem(0, sample=0, source_hw=(112, 168)), MediaItem(0, sample=1)]
    b, out, res = guarded_forward(F, model, samples, cfg, source, TOKENS)
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
    with torch.no_grad():
        ref = model(**fixed).logits
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=1e-5)
