"""install_vlm on transformers' real ``InternVLForConditionalGeneration`` (tiny random config,
CPU): tiles of ``image_seq_length`` features, images' and video frames' tiles in one
``pixel_values`` on one token, tiles per image never reaching the model.

With ``set_items`` (one item per image, ``SEQ`` * its tiles, and one per video frame) every
fault is caught per sample (the shared contract and InternVL's own faults: ``tests/families/``);
without them the engine cuts the one block of tile features by the runs and says, in a
``check`` record, that only the total was checked. Inputs from ``testing/families/internvl.py``
(transformers' real ``GotOcr2ImageProcessorPil``); the plain class under the faults:
``tests/test_fixture_plain.py``.
"""

from __future__ import annotations

import pytest
import torch
from family_checks import guarded_forward, img, records, vid
from family_checks import hidden_forward as forward

from megatron_media_guard import GuardConfig, MediaAlignmentError
from megatron_media_guard.geometry.tiled import TiledGeometry

pytest.importorskip("transformers.models.internvl")
pytest.importorskip("PIL")

from megatron_media_guard.testing.families import internvl as F

pytestmark = pytest.mark.timeout(120)
TOKENS = {"<img>": F.IMG_START, "</img>": F.IMG_END}
ONE, WIDE, TALL = img(56, 56), img(56, 112), img(100, 40)
VID = vid(3)
CHECK = "only the total was checked"


@pytest.fixture(scope="module")
def model():
    return F.tiny_model(seed=0)


@pytest.mark.parametrize("hw", [(56, 56), (56, 112), (100, 40), (60, 300), (90, 100)])
def test_tile_counts_are_the_processors_and_the_geometrys(model, hw):
    b = F.make_batch(model, [[img(*hw)]])
    geo = TiledGeometry(tile=F.TILE, tokens_per_tile=F.SEQ, max_tiles=F.MAX_TILES)
    assert b.items[0][2] == geo.tokens(hw)


def without_items(model, samples, config):
    """(batch, (hidden states, output), last result) of a guarded call given no ``set_items``."""
    return guarded_forward(F, model, samples, config, tokenizer=TOKENS, run=forward)


BY_RUNS = {
    "images": [[WIDE, ONE], [TALL]],
    "video": [[VID], [vid(2)]],
    "mixed image+video": [[WIDE, VID], [ONE, TALL]],
    "+k/-k, unseen": [[img(56, 56, n=6)], [img(56, 112, n=10)], [TALL]],
}


@pytest.mark.parametrize("name", list(BY_RUNS))
def test_without_set_items_only_the_total_is_checked(model, name, tmp_path):
    """Cut by the runs every sample is kept, the plain model's output (a +k/-k too), and the
    record says only the total was checked (with ``set_items``: tests/families/)."""
    cfg = GuardConfig(log_dir=str(tmp_path))
    b, (hidden, _), res = without_items(model, BY_RUNS[name], cfg)
    assert res.report.actions == ("keep",) * len(BY_RUNS[name])
    torch.testing.assert_close(hidden, F.plain_hidden(model, b), atol=1e-6, rtol=1e-6)
    checks = [r for r in records(tmp_path) if r["event"] == "check"]
    assert checks and all(CHECK in r["reason"] for r in checks)


def test_without_set_items_a_net_short_run_still_raises(model, tmp_path):
    """The total is off; the blame falls on the last run, which takes what is left."""
    with pytest.raises(MediaAlignmentError):
        without_items(model, [[img(56, 112, n=10)], [ONE]], GuardConfig(log_dir=str(tmp_path)))
