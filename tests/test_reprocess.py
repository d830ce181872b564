"""check_batch repairs from the original media (families/reprocess.py, families/pinning.py):
ids written by an engine that sized one item smaller than the static batch; the repair must
return the rows and grid row the processor makes of the original at the engine's size (max abs
difference 0), the aligned item untouched, and the tiny model must take the result. Oracles:
the real PIL image processors (Qwen-VL, GLM-4V, Ernie); Nemotron Omni's own grid and patch
functions around its torchvision float path; for videos,
:mod:`megatron_media_guard.testing.video_processors` (the processors' own source around
torchvision's uint8 resize).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as Fn
from family_checks import records
from originals import picture
from PIL import Image
from test_check_batch import CASES as BATCH_CASES

from megatron_media_guard import GuardConfig, MediaAlignmentError
from megatron_media_guard.core.items import MediaItem
from megatron_media_guard.core.plan import ItemRepair
from megatron_media_guard.families import FAMILIES
from megatron_media_guard.families.collate import check_batch
from megatron_media_guard.families.pinning import PINS, RadioPin
from megatron_media_guard.families.reprocess import Reprocessor
from megatron_media_guard.geometry import RadioTilerGeometry
from megatron_media_guard.testing import video_processors
from megatron_media_guard.testing.families import ernie4_5_vl, glm4v, nemotron_omni
from megatron_media_guard.testing.families.base import Media
from megatron_media_guard.testing.qwen_fixture import QwenFixture

pytest.importorskip("transformers.models.glm4v.image_processing_pil_glm4v")

NEMOTRON_TOKENS = BATCH_CASES["nemotron_omni"].tokens


def radio_oracle(img: Image.Image, budget: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """Nemotron Omni's image processor on ``img`` at ``budget`` patches: its own grid and patch
    functions, the torchvision float path between them."""
    fns = nemotron_omni.processor_functions()
    gh, gw = fns["get_patch_grid_size"](img.height, img.width, 16, 2, 1024, budget)
    x = torch.from_numpy(np.asarray(img.convert("RGB"))).permute(2, 0, 1)[None].float()
    x = Fn.interpolate(x, (16 * gh, 16 * gw), mode="bicubic", antialias=True, align_corners=False)
    mean = torch.tensor((0.48145466, 0.4578275, 0.40821073)) * 255.0
    std = torch.tensor((0.26862954, 0.26130258, 0.27577711)) * 255.0
    x = (x - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    return fns["convert_image_to_patches"](x, 16)[0], (gh, gw)


@dataclass(frozen=True)
class Case:
    """One family: its fixture, its PIL image processor (None: own arithmetic), the grid
    input, its tokenizer stand-in, and how the static trainer and the engine process an
    original."""

    family: str
    fixture: Any
    processor: Any
    grid: str = "image_grid_thw"
    tokenizer: Any = None

    def static(self, img):
        if self.processor is None:
            grid = RadioTilerGeometry().grid_for((img.height, img.width))
            rows = RadioPin().run(None, img, SimpleNamespace(grid=grid)).rows
            return rows, grid
        out = self.processor(images=[img], return_tensors="pt")
        return out["pixel_values"], tuple(out[self.grid][0].tolist())

    def engine(self, img):
        """The engine's processing at a smaller budget: rows, grid row, tokens."""
        if self.processor is None:
            rows, grid = radio_oracle(img, 1024)  # an over-full request: 1024 patches each
            return rows, grid, grid[0] * grid[1] // 4
        lo = self.processor.size.shortest_edge
        out = self.processor(
            images=[img], size={"shortest_edge": lo, "longest_edge": lo * 3}, return_tensors="pt"
        )
        grid = tuple(out[self.grid][0].tolist())
        return out["pixel_values"], grid, int(np.prod(grid)) // 4


def pil(path: str):
    """``transformers.models.<module>.<class>()``, a PIL image processor."""
    module, cls = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"transformers.models.{module}"), cls)()


FAMILY_CASES = {
    "qwen_vl": Case(
        "qwen_vl",
        QwenFixture("qwen2_5_vl"),
        pil("qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil"),
    ),
    "glm4v": Case("glm4v", glm4v, pil("glm4v.image_processing_pil_glm4v.Glm4vImageProcessorPil")),
    "ernie4_5_vl": Case(
        "ernie4_5_vl",
        ernie4_5_vl,
        pil("ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe.Ernie4_5_VLMoeImageProcessorPil"),
    ),
    "nemotron_omni": Case("nemotron_omni", nemotron_omni, None, "image_grid_hw", NEMOTRON_TOKENS),
}
CASES = sorted(FAMILY_CASES)


@functools.cache
def model_of(fixture):
    """One tiny model per fixture, for the session."""
    return fixture.tiny_model()


def batch_for(case: Case, imgs, tokens: list[int | None], one_sample: bool = False):
    """The static trainer's batch of one image per sample (``one_sample``: all in one), the
    ids with ``tokens`` per run."""
    model = model_of(case.fixture)
    static = [case.static(im) for im in imgs]
    media = [Media("image", tuple(g[-2:]), tokens=t) for (_, g), t in zip(static, tokens)]
    samples = [media] if one_sample else [[m] for m in media]
    kw = dict(case.fixture.make_batch(model, samples).kwargs)
    kw["pixel_values"] = torch.cat([r for r, _ in static])
    kw[case.grid] = torch.tensor([list(g) for _, g in static])
    return model, kw, static


def run(case: Case, kw, imgs, model, **cfg):
    guard = GuardConfig(policy="repair", **cfg)
    hf = dict(config=model.config, tokenizer=case.tokenizer, processor=case.processor)
    return check_batch(case.family, kw, guard=guard, media=imgs, **hf)


@pytest.mark.parametrize("family", CASES)
def test_a_short_run_is_repaired_to_what_the_processor_makes_at_the_engines_size(family):
    case = FAMILY_CASES[family]
    imgs = [picture(300, 500, 1), picture(120, 150, 2)]
    rows, grid, n = case.engine(imgs[0])
    model, kw, static = batch_for(case, imgs, [n, None])
    assert static[0][0].shape[0] != rows.shape[0]  # the trainer's item is bigger than the run
    proc = case.processor
    settings = None if proc is None else proc.to_dict()
    out = run(case, kw, imgs, model)
    assert out.report.actions == ("repair", "keep")
    (done,) = out.reprocessed
    assert (done.modality, done.index, done.sample, done.tokens) == ("image", 0, 0, n)
    assert done.fidelity == "engine-replay" and tuple(done.grid) == grid
    # a processor is pinned by its own budget knobs, per call: its settings as they were
    assert done.how == ("own-arithmetic" if proc is None else "pinned")
    assert settings == (None if proc is None else proc.to_dict())
    assert out.matched == {("image", 0)}
    b = out.batch
    assert b[case.grid].tolist() == [list(grid), list(static[1][1])]
    got = b["pixel_values"][: rows.shape[0]]
    assert got.shape == rows.shape and (got - rows).abs().max().item() == 0.0
    assert torch.equal(b["pixel_values"][rows.shape[0] :], static[1][0])  # aligned: untouched
    assert torch.equal(b["input_ids"], kw["input_ids"])
    with torch.no_grad():  # the model takes it: every run gets its count
        model(**b)


FALLBACKS = {  # why: (no original given, no processor given, GuardConfig, the reason says)
    "no original": (True, False, {}, "no original"),
    "fidelity": (False, False, {"allowed_fidelity": ("unique",)}, "fidelity engine-replay not"),
    "no processor": (False, True, {}, "no processor given"),
}


@pytest.mark.parametrize(
    "family, why",
    [(f, w) for f in CASES for w in FALLBACKS if f != "nemotron_omni" or w != "no processor"],
)
def test_a_repair_that_cannot_be_made_falls_back_saying_why(family, why, tmp_path):
    """No original, a fidelity the config does not allow, or a processor family without its
    processor: the sample takes the fallback (drop, or raise), the record says why."""
    no_original, no_processor, cfg, says = FALLBACKS[why]
    case = FAMILY_CASES[family]
    imgs = [picture(300, 500, 1)]
    model, kw, _ = batch_for(case, imgs, [case.engine(imgs[0])[2]])
    media = [None] if no_original else imgs
    case = replace(case, processor=None) if no_processor else case
    out = run(case, kw, media, model, log_dir=str(tmp_path), **cfg)
    assert out.report.actions == ("drop",) and out.reprocessed == ()
    (rec,) = [r for r in records(tmp_path) if r["event"] == "repair"]
    assert rec["action"] == "fallback:drop" and says in rec["reason"], rec["reason"]
    with pytest.raises(MediaAlignmentError, match=says):
        run(case, kw, media, model, fallback="raise", **cfg)


@pytest.mark.parametrize("family", CASES)
def test_a_sample_is_repaired_only_when_all_its_items_are(family):
    """Two short images in one sample, the second without its original: the sample falls
    back whole (dropped), nothing of it is re-processed into the batch."""
    case = FAMILY_CASES[family]
    imgs = [picture(300, 500, 1), picture(260, 300, 5)]
    model, kw, _ = batch_for(case, imgs, [case.engine(im)[2] for im in imgs], one_sample=True)
    out = run(case, kw, [imgs[0], None], model)
    assert out.report.actions == ("drop",) and out.reprocessed == () and out.matched == set()


def test_a_size_no_budget_reaches_is_resized_by_the_processors_own_resize():
    """A closest-aspect solution (no budget lands there): the original resized to the solved
    size with the processor's resampling, then processed without resizing; equal to PIL's
    bicubic resize of the original fed to the processor with ``do_resize=False``."""
    case = FAMILY_CASES["glm4v"]
    img = picture(300, 500, 1)
    from megatron_media_guard.families.glm4v import geometry

    geo = geometry()
    n = next(k for k in range(40, 400) if geo.solve(k, (300, 500)).fidelity == "closest-aspect")
    model, kw, _ = batch_for(case, [img], [n])
    out = run(case, kw, [img], model, allowed_fidelity=("engine-replay", "closest-aspect"))
    (done,) = out.reprocessed
    assert done.how == "resized" and done.fidelity == "closest-aspect" and done.tokens == n
    h, w = done.size_hw
    ref = case.processor(
        images=[img.resize((w, h), Image.BICUBIC)], do_resize=False, return_tensors="pt"
    )
    assert torch.equal(out.batch["pixel_values"], ref["pixel_values"])
    assert out.batch["image_grid_thw"].tolist() == ref["image_grid_thw"].tolist()


def one_more():
    """A processor that cannot be pinned to the run: GLM-4V's, whose output always holds one
    merged cell (one token) more than it should."""
    from transformers.image_processing_utils import BatchFeature
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    class OneMore(Glm4vImageProcessorPil):
        def preprocess(self, images, **kw):
            out = super().preprocess(images, **kw)
            pv, (_, h, w) = out["pixel_values"], out["image_grid_thw"][0].tolist()
            n = h * w // 4 + 1
            grid = torch.tensor([[1, 2, 2 * n]])
            return BatchFeature(
                {"pixel_values": pv.new_zeros(4 * n, pv.shape[1]), "image_grid_thw": grid}
            )

    return OneMore()


def test_a_processor_that_cannot_be_pinned_is_refused_and_left_as_it_was(tmp_path):
    case = FAMILY_CASES["glm4v"]
    img = picture(300, 500, 1)
    _, _, n = case.engine(img)
    model, kw, _ = batch_for(case, [img], [n])
    stub = one_more()
    before = stub.to_dict()
    stubbed = replace(case, processor=stub)
    with pytest.raises(MediaAlignmentError, match="does not uniquely determine") as err:
        run(stubbed, kw, [img], model, fallback="raise", log_dir=str(tmp_path))
    assert f"gives {n + 1} tokens" in str(err.value) and f"run of {n}" in str(err.value)
    out = run(stubbed, kw, [img], model)
    assert out.report.actions == ("drop",) and out.reprocessed == ()
    assert "pixel_values" not in out.batch  # dropped, never an inferred grid
    assert stub.to_dict() == before
    (rec,) = [r for r in records(tmp_path) if r["event"] == "repair"]
    assert rec["action"] == "fallback:raise" and "does not uniquely determine" in rec["reason"]


def test_a_static_video_against_a_longer_rollout_is_refused_naming_both_totals():
    """Nemotron Omni (no video pin: fixed patches per frame): a 6-frame 32x32 video is 3
    tubelets of one token (3 placeholders); the rollout wrote 4 (its last run 2)."""
    model = model_of(nemotron_omni)
    b = nemotron_omni.make_batch(model, [[Media("video", (6, 2, 2), tokens=4)]])
    frames = [picture(32, 32, k) for k in range(6)]
    with pytest.raises(MediaAlignmentError) as err:
        run(FAMILY_CASES["nemotron_omni"], b.kwargs, [frames], model, fallback="raise")
    msg = str(err.value)
    for part in ("gives 3 placeholders", "the rollout 4", "6 frames", "first mismatching run: 2"):
        assert part in msg, (part, msg)
    assert "video_target_num_patches" in msg and "no grid inferred" in msg


@pytest.mark.parametrize("mod", ["image", "video"])
def test_every_registered_family_has_a_pin_or_refuses_saying_why(mod):
    """A pin re-processes the media of a family that sizes them with a geometry and keeps them
    as patch rows with a grid; every other family's repair is refused naming why (a video's:
    both totals and the first mismatching run)."""
    media = picture(64, 64, 0) if mod == "image" else [picture(64, 64, k) for k in range(4)]
    n = 1 if mod == "image" else 2  # a video of two runs, the second planned 4 short
    for spec in FAMILIES:
        if not any(m.name == mod for m in spec.modalities):
            continue
        pin = PINS.get((spec.name, mod))
        if pin is not None and not isinstance(pin, str):
            grids = {g for m in spec.modalities if m.name == mod for g in m.patches.values()}
            assert spec.geometry is not None and grids
            assert not hasattr(pin, "grid_input") or pin.grid_input in grids
            continue
        items = [MediaItem(16, modality=mod) for _ in range(n)]
        fix = ItemRepair(item=n - 1, sample=0, target=12, run=n - 1)
        got, facts = Reprocessor(spec, None, items, [0] * n, [media]).reprocess(
            fix,
            SimpleNamespace(repairs=(fix,)),
            SimpleNamespace(items=tuple(items)),
            SimpleNamespace(config=GuardConfig(policy="repair")),
        )
        why = pin if isinstance(pin, str) else f"{spec.name} has no video pin"
        why = f"{spec.name} images are not re-processed" if mod == "image" else why
        assert got is None and why in facts["reason"], (spec.name, facts)
        if mod == "video":
            assert "gives 32 placeholders in 2 run(s), the rollout 28" in facts["reason"]
            assert "4 frames" in facts["reason"] and "first mismatching run: 1" in facts["reason"]


@pytest.mark.parametrize("family", ["qwen_vl", "glm4v", "nemotron_omni"])
def test_a_list_of_originals_is_paired_per_modality_whatever_the_token_order(family):
    """``media=[...]`` lists every image, then every video (the model's order), while the
    items come in token order: a video before an image in the ids still gets its own original."""
    spec = next(s for s in FAMILIES if s.name == family)
    items = [MediaItem(4, modality="video"), MediaItem(4, modality="image")]  # token order
    rep = Reprocessor(spec, None, items, [0, 0], ["image 0", "video 0"])
    assert rep.media == {("image", 0): "image 0", ("video", 0): "video 0"}


def clip(t: int, h: int, w: int, seed: int = 0) -> list[Image.Image]:
    return [picture(h, w, seed + k) for k in range(t)]


def frames_array(frames: list[Image.Image]) -> np.ndarray:
    return np.stack([np.asarray(f) for f in frames])


@dataclass(frozen=True)
class VideoCase:
    """One family's videos: its spec, its fixture, its video processor (oracle), and the
    engine's smaller budget (``size`` of the video processor); as_array: the originals passed
    as arrays ``[T, H, W, C]`` (else lists of PIL frames); overrides: settings over the
    processor's defaults (Ernie: ``draw_on_frames=False``; None: no video processor given)."""

    family: str
    fixture: Any
    processor: str
    engine_size: dict
    as_array: bool = False
    overrides: tuple | None = ()

    def model(self):
        return model_of(self.fixture)

    def settings(self) -> dict | None:
        if self.overrides is None:
            return None
        return video_processors.settings(self.processor) | dict(self.overrides)

    def batch(self, videos, grids, tokens=None):
        """The rollout's ids for one video per sample at ``grids`` (its runs), the static
        processing's pixels and grids."""
        tokens = tokens or [None] * len(videos)
        samples = [[Media("video", g, tokens=n)] for g, n in zip(grids, tokens)]
        kw = dict(self.fixture.make_batch(self.model(), samples).kwargs)
        static = [video_processors.process(self.processor, frames_array(v)) for v in videos]
        kw["pixel_values_videos"] = torch.cat([r for r, _ in static])
        kw["video_grid_thw"] = torch.tensor([list(g) for _, g in static])
        return kw, static

    def check(self, kw, videos, **cfg):
        guard = GuardConfig(policy="repair", **cfg)
        media = {"video": [frames_array(v) if self.as_array else v for v in videos]}
        hf = dict(config=self.model().config, processor={"video": self.settings()})
        return check_batch(self.family, kw, guard=guard, media=media, **hf)


VIDEO_CASES = {
    "qwen2_5_vl": VideoCase(
        "qwen_vl",
        QwenFixture("qwen2_5_vl"),
        "qwen2_vl",
        {"shortest_edge": 3136, "longest_edge": 28 * 28 * 40},
    ),
    "qwen3_vl": VideoCase(
        "qwen_vl",
        QwenFixture("qwen3_vl"),
        "qwen3_vl",
        {"shortest_edge": 4096, "longest_edge": 4 * 32 * 32 * 30},
    ),
    "glm4v": VideoCase(
        "glm4v",
        glm4v,
        "glm4v",
        {"shortest_edge": 112 * 112, "longest_edge": 4 * 28 * 28 * 40},
        as_array=True,
    ),
    "ernie4_5_vl": VideoCase(
        "ernie4_5_vl",
        ernie4_5_vl,
        "ernie4_5_vl",
        {"shortest_edge": 3136, "longest_edge": 28 * 28 * 40},
        overrides=(("draw_on_frames", False),),
    ),
}


@pytest.mark.parametrize("case", sorted(VIDEO_CASES))
def test_a_short_video_is_repaired_from_its_frames_to_what_the_processor_makes(case):
    """The engine's video processor at a smaller budget wrote the first video's runs; the
    check re-processes it from its frames: rows and grid equal to the video processor's own
    at the engine's size (max abs 0); the aligned video's rows untouched; the model takes it."""
    vc = VIDEO_CASES[case]
    videos = [clip(4, 224, 336, 1), clip(2, 112, 140, 7)]
    eng_rows, eng_grid = video_processors.process(
        vc.processor, frames_array(videos[0]), vc.engine_size
    )
    aligned = video_processors.process(vc.processor, frames_array(videos[1]))
    kw, static = vc.batch(videos, [eng_grid, aligned[1]])
    assert static[0][0].shape[0] > eng_rows.shape[0]  # the trainer's video is the bigger one
    out = vc.check(kw, videos)
    assert out.report.actions == ("repair", "keep")
    (done,) = out.reprocessed
    t, h, w = eng_grid
    tokens = t * h * w // (8 if vc.family == "ernie4_5_vl" else 4)  # Ernie: t counts frames
    assert (done.modality, done.index, done.sample, done.tokens) == ("video", 0, 0, tokens)
    assert done.fidelity == "engine-replay" and done.how == "own-arithmetic"
    assert tuple(done.grid) == eng_grid and out.matched == {("video", 0)}
    b = out.batch
    assert b["video_grid_thw"].tolist() == [list(eng_grid), list(aligned[1])]
    got = b["pixel_values_videos"][: eng_rows.shape[0]]
    assert got.shape == eng_rows.shape and (got - eng_rows).abs().max().item() == 0.0
    assert torch.equal(b["pixel_values_videos"][eng_rows.shape[0] :], static[1][0])
    assert torch.equal(b["input_ids"], kw["input_ids"])
    with torch.no_grad():
        vc.model()(**b)


UNDETERMINED = "does not uniquely determine"


@pytest.mark.parametrize(
    "case, extra, frames, change, needles",
    [
        # a run per temporal group: one frame size gives every group the same run, so runs
        # that differ (the last one 4 short) determine no size
        *[
            (c, -4, 4, {}, [UNDETERMINED, "gives every temporal group the same run", "{runs}"])
            for c in ("qwen3_vl", "glm4v")
        ],
        # Qwen2.5-VL: one run of t*h*w/4 over 2 temporal groups; an odd count lands on no size
        ("qwen2_5_vl", 1, 4, {}, [UNDETERMINED, "not divisible by the 2 temporal groups"]),
        # Qwen3-VL: the rollout wrote the 2 runs of a 4-frame video; 6 frames make 3 groups
        ("qwen3_vl", 0, 6, {}, [UNDETERMINED, "frames make 3 temporal", "wrote 2 runs"]),
        # Ernie's video processor draws timestamps on the frames by default (a font file): a
        # video processed so is refused, naming it, never re-processed without the drawing
        ("ernie4_5_vl", 0, 4, {"overrides": ()}, ["draw_on_frames"]),
        # no video processor given (processor={"video": None})
        ("qwen3_vl", 0, 4, {"overrides": None}, ["no video processor given"]),
    ],
)
def test_a_video_no_frame_size_explains_is_refused_saying_why(case, extra, frames, change, needles):
    vc = VIDEO_CASES[case]
    videos = [clip(4, 224, 336, 1)]
    _, (t, h, w) = video_processors.process(vc.processor, frames_array(videos[0]), vc.engine_size)
    kw, _ = vc.batch(videos, [(t, h, w)], [t * h * w // 4 + extra if extra else None])
    vc = replace(vc, **change)
    if change.get("overrides") == ():  # the processor's defaults: Ernie's draws
        assert vc.settings()["draw_on_frames"] is True
    originals = [clip(frames, 224, 336, 1)]
    with pytest.raises(MediaAlignmentError) as err:
        vc.check(kw, originals, fallback="raise")
    runs = f"runs [{h * w // 4}, {h * w // 4 - 4}]"
    assert all(n.format(runs=runs) in str(err.value) for n in needles), str(err.value)
    out = vc.check(kw, originals)  # never guessed: the sample dropped
    assert out.report.actions == ("drop",) and out.reprocessed == ()
    assert "pixel_values_videos" not in out.batch
