"""install_vlm on transformers' real ``Mistral3ForConditionalGeneration`` (tiny random config,
CPU): Pixtral images as rows of ``[IMG]`` split by ``[IMG_BREAK]`` and closed by ``[IMG_END]``.

Inputs come from ``testing/families/mistral3.py`` (processed sizes, the processor's grammar and
padding). Aligned batches are compared with the plain model on the same batch; kept samples of
a guarded faulty batch with the same sample's plain forward in a batch of its own.
"""

from __future__ import annotations

import json

import pytest
import torch
from family_checks import records

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaGuard, MediaItem
from megatron_media_guard.errors import MediaInputError
from megatron_media_guard.families import find_family
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
    return F.tiny_model()


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


def test_the_registry_finds_the_family_and_its_grammar(model):
    target, spec = find_family(model)
    assert spec is spec_mod.SPEC and target is model
    g = spec.grammar(model, TOKENS)
    assert (dict(g.placeholders), g.start_id, g.end_id, g.break_ids) == (
        {"image": 10},
        None,
        F.END_ID,
        (F.BREAK_ID,),
    )
    assert find_family(model.model)[1] is spec_mod.SPEC  # Mistral3Model alone too


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
    rec = next(
        json.loads(x)
        for f in tmp_path.glob("*.jsonl")
        for x in f.read_text().splitlines()
        if '"repair"' in x
    )
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


def test_set_items_names_the_sample_id(model, tmp_path):
    items = [MediaItem(0, sample=0, modality="image", sample_id="a")]
    items.append(MediaItem(0, sample=1, modality="image", sample_id="b"))
    with pytest.raises(MediaAlignmentError, match="sample_id 'b'"):
        guarded(model, [ALL, [img(56, 84, tokens=5)]], GuardConfig(log_dir=str(tmp_path)), items)


def test_a_guard_built_by_hand_with_the_family_grammar(model):
    guard = MediaGuard(GuardConfig(), grammar=spec_mod.SPEC.grammar(model, TOKENS))
    _, _, res = guarded(model, [[img(56, 84)], [img(84, 56)]], guard=guard)
    assert res.report.actions == ("keep", "keep")


def test_missing_break_and_end_tokens_are_named(model):
    with pytest.raises(MediaInputError, match=r"\[IMG_END\].*\[IMG_BREAK\]"):
        install_vlm(model, GuardConfig())
