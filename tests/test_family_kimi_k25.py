"""install_vlm on transformers' real ``Kimi_K25ForConditionalGeneration`` (tiny random config,
CPU): images and time-pooled video chunks (one grid row and one run per chunk of <= 4 frames),
each on its own placeholder token between ``<|media_begin|>`` / ``<|media_end|>``; what
``set_items`` takes. Inputs from ``testing/families/kimi_k25.py``; its layout and the plain
class under the faults: ``tests/test_fixture_plain.py``; the shared contract and Kimi's own
faults: ``tests/families/``.
"""

from __future__ import annotations

import pytest
from family_checks import guarded_forward, vid

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaItem
from megatron_media_guard.errors import MediaInputError

pytest.importorskip("transformers.models.kimi_k25")

from megatron_media_guard.testing.families import kimi_k25 as F

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model():
    return F.tiny_model(seed=0)


def test_set_items_takes_one_item_per_chunk(model, tmp_path):
    """``num_chunks_per_video`` never reaches the model: a 6-frame video is two chunk items."""
    samples = [[vid(6, 4, 4)], [vid(2, 2, 2, n=3)]]
    one_per_video = [MediaItem(0, sample=s, modality="video") for s in (0, 1)]
    with pytest.raises(MediaInputError, match="set_items gave 2 items"):
        guarded_forward(F, model, samples, items=one_per_video)
    chunks = [
        MediaItem(0, sample=s, modality="video", sample_id=sid)
        for s, sid in ((0, "a"), (0, "a"), (1, "b"))
    ]
    with pytest.raises(MediaAlignmentError, match="sample_id 'b'"):
        guarded_forward(F, model, samples, GuardConfig(log_dir=str(tmp_path)), items=chunks)
