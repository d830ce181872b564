"""The Qwen-VL pre-hook joins its stage's consensus round exactly once per guarded forward,
also when it raises before the round (bad input) or a repair fails, so no peer waits for a
rank that left early. Real tiny transformers Qwen2.5-VL; a recording consensus."""

from __future__ import annotations

import pytest
import torch

from megatron_media_guard import Grammar, GuardConfig, MediaGuard, MediaItem
from megatron_media_guard.core.outcome import StageOutcome
from megatron_media_guard.errors import MediaInputError
from megatron_media_guard.geometry import PatchMergeGeometry

pytest.importorskip("transformers.models.qwen2_5_vl")
pytest.importorskip("PIL")

from megatron_media_guard.adapters import install_qwen_vl
from megatron_media_guard.testing.qwen_vl import (
    Sample,
    seed_failure,
    smooth_image,
    tiny_model,
)

SAMPLES = [Sample((("image", smooth_image(150, 200, 1)),)), Sample(())]


class Recorder:
    def __init__(self):
        self.seen = []

    def agree(self, local):
        self.seen.append(local)
        return StageOutcome.local(local, 0)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2_5_vl")


def _guard(policy: str, rec: Recorder) -> MediaGuard:
    f = 28
    geo = PatchMergeGeometry(patch=14, merge=2, min_pixels=f * f, max_pixels=30 * f * f)
    cfg = GuardConfig(policy=policy, fallback="drop")
    return MediaGuard(cfg, grammar=Grammar.qwen2_vl(), geometry=geo, consensus=rec)


def _bad_pixels(b):
    return dict(b, pixel_values=b["pixel_values"][:-1])


def _no_grid(b):
    return dict(b, image_grid_thw=None)


def _ok(b):
    return b


@pytest.mark.parametrize(
    ("name", "edit", "items"),
    [
        ("pixel rows", _bad_pixels, None),
        ("no grid", _no_grid, None),
        ("items", _ok, [MediaItem(1, modality="image"), MediaItem(1, modality="image")]),
    ],
)
def test_an_early_error_joins_the_round_once_as_fatal(model, name, edit, items):
    engine, _ = seed_failure("qwen2_5_vl", SAMPLES, 12, 30)
    rec = Recorder()
    with torch.no_grad(), install_qwen_vl(model, _guard("raise", rec)) as h:
        h.set_items(items)
        with pytest.raises(MediaInputError):
            model(**edit(engine))
        assert [o.fatal for o in rec.seen] == [True], name
        model(**engine)  # the next call: one more round, not fatal
    assert [o.fatal for o in rec.seen] == [True, False]


def test_a_failed_resize_falls_back_in_one_round(model, monkeypatch):
    import megatron_media_guard.families.resize as plan_mod

    def boom(*a, **k):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(plan_mod, "resize_patches", boom)
    _, mixed = seed_failure("qwen2_5_vl", SAMPLES, 12, 30)
    rec = Recorder()
    with torch.no_grad(), install_qwen_vl(model, _guard("repair", rec)) as h:
        model(**mixed)
    assert h.last_result.report.actions == ("drop", "keep")
    assert [(o.fatal, o.dropped, o.repaired) for o in rec.seen] == [(False, 1, 0)]
