"""check_batch's repair from the original media (families/reprocess.py), on CPU: items repaired,
the largest absolute difference between the repaired pixel rows and the processor's own output
at the engine's size, and the time per repaired item.

One batch per family, one image per sample, every image sized smaller by the engine than by the
static trainer: Qwen-VL (a tiny Qwen2.5-VL config), GLM-4V and Ernie 4.5 VL with their real PIL
image processors (the engine's ``longest_edge`` a quarter of the static processing's pixels),
Nemotron Omni with its own arithmetic (the engine's shared budget of 16 frames in a near-full
32k request, the seed's case for 2400x1080; its oracle: the processor's own grid and patch
functions from the installed source around the float bicubic resize and fused normalization of
its torchvision backend).

Videos (one per sample, 4 frames, ``VIDEO_SIZES``): Qwen2.5-VL and Ernie 4.5 VL (one run per
video; Ernie with ``draw_on_frames=False``), Qwen3-VL and GLM-4V (a run per temporal group),
the engine's video processor at a quarter of the static processing's pixels; the oracle is the
video processor's own code compiled from the installed source (``smart_resize``, ``patchify``,
Ernie's ``_preprocess``, the defaults) around torchvision's uint8 resize
(``testing/video_processors.py``: the processors import torchvision).

    python -m benchmarks.bench_reprocess
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from megatron_media_guard import GuardConfig
from megatron_media_guard.families.collate import check_batch
from megatron_media_guard.families.pinning import CLIP_MEAN, CLIP_STD, RadioPin
from megatron_media_guard.geometry import RadioTilerGeometry
from megatron_media_guard.testing import video_processors
from megatron_media_guard.testing.families import ernie4_5_vl, glm4v, nemotron_omni
from megatron_media_guard.testing.families.base import Media
from megatron_media_guard.testing.qwen_fixture import QwenFixture

SIZES = [(300, 500), (480, 640), (1080, 2400), (2000, 33), (768, 1024), (1024, 768)]
VIDEO_SIZES = [(224, 336), (360, 640), (480, 854), (720, 1280)]
FRAMES = 4
TOKENS = {
    "<img>": nemotron_omni.IMG_START,
    "</img>": nemotron_omni.IMG_END,
    "<so_start>": nemotron_omni.SO_START,
    "<so_end>": nemotron_omni.SO_END,
}


def picture(h: int, w: int, seed: int) -> Image.Image:
    rs = np.random.RandomState(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([np.sin(x / (7 + c) + y / (11 + c) + rs.rand() * 6) for c in range(3)], -1)
    return Image.fromarray(
        (base * 100 + 128 + rs.randint(-20, 20, (h, w, 3))).clip(0, 255).astype(np.uint8)
    )


def patch_merge_case(name, fixture, processor):
    def static(img):
        out = processor(images=[img], return_tensors="pt")
        return out["pixel_values"], tuple(out["image_grid_thw"][0].tolist())

    def engine(img, static_grid):
        px = int(np.prod(static_grid)) * 14 * 14 // 4
        size = {"shortest_edge": processor.size.shortest_edge, "longest_edge": max(px, 12544)}
        out = processor(images=[img], size=size, return_tensors="pt")
        grid = tuple(out["image_grid_thw"][0].tolist())
        return out["pixel_values"], grid, int(np.prod(grid)) // 4

    return name, fixture, processor, "image_grid_thw", static, engine, None, name


def radio_case(max_model_len: int, prompt: int):
    geo, fns = RadioTilerGeometry(), nemotron_omni.processor_functions()

    def static(img):
        grid = geo.grid_for((img.height, img.width))
        return RadioPin().run(None, img, SimpleNamespace(grid=grid)).rows, grid

    def engine(img, static_grid):
        hw = (img.height, img.width)
        (item,) = {
            it.budget: it for it in geo.engine_tokens([hw] * 16, max_model_len, prompt)
        }.values()
        gh, gw = fns["get_patch_grid_size"](*hw, 16, 2, 1024, item.budget)
        x = torch.from_numpy(np.array(img)).permute(2, 0, 1)[None].float()
        x = F.interpolate(
            x, (16 * gh, 16 * gw), mode="bicubic", antialias=True, align_corners=False
        )
        m, s = torch.tensor(CLIP_MEAN) * 255.0, torch.tensor(CLIP_STD) * 255.0
        x = (x - m.view(1, 3, 1, 1)) / s.view(1, 3, 1, 1)
        return fns["convert_image_to_patches"](x, 16)[0], (gh, gw), gh * gw // 4

    label = f"nemotron_omni (16 media, max_model_len {max_model_len}, prompt {prompt})"
    return "nemotron_omni", nemotron_omni, None, "image_grid_hw", static, engine, TOKENS, label


def measure(case) -> dict:
    name, fixture, processor, grid_key, static, engine = case[:6]
    tokenizer, label = case[6], case[7]
    model = fixture.tiny_model()
    imgs = [picture(h, w, k) for k, (h, w) in enumerate(SIZES)]
    stat = [static(im) for im in imgs]
    eng = [engine(im, g) for im, (_, g) in zip(imgs, stat)]
    samples = [[Media("image", tuple(g[-2:]), tokens=n)] for (_, g), (_, _, n) in zip(stat, eng)]
    kw = dict(fixture.make_batch(model, samples).kwargs)
    kw["pixel_values"] = torch.cat([r for r, _ in stat])
    kw[grid_key] = torch.tensor([list(g) for _, g in stat])
    t0 = time.perf_counter()
    out = check_batch(
        name,
        kw,
        config=model.config,
        tokenizer=tokenizer,
        guard=GuardConfig(policy="repair"),
        media=imgs,
        processor=processor,
    )
    wall = time.perf_counter() - t0
    return _row(label, out, eng, "pixel_values", grid_key, wall)


def measure_video(label: str, family: str, fixture, processor: str, **overrides) -> dict:
    """One batch of ``VIDEO_SIZES`` clips, each sized by the engine's video processor at a
    quarter of the static processing's pixels per frame (module docstring)."""
    model = fixture.tiny_model()
    clips = [
        np.stack([np.asarray(picture(h, w, 10 * k + f)) for f in range(FRAMES)])
        for k, (h, w) in enumerate(VIDEO_SIZES)
    ]
    stat = [video_processors.process(processor, c) for c in clips]
    cfg = video_processors.settings(processor) | overrides
    p, f = cfg["patch_size"], cfg["patch_size"] * cfg["merge_size"]
    share = FRAMES if video_processors.shares_budget(processor) else 1
    eng = [
        video_processors.process(
            processor, c, {"shortest_edge": f * f, "longest_edge": share * gh * gw * p * p // 4}
        )
        for c, (_, (_, gh, gw)) in zip(clips, stat)
    ]
    samples = [[Media("video", g)] for _, g in eng]
    kw = dict(fixture.make_batch(model, samples).kwargs)
    kw["pixel_values_videos"] = torch.cat([r for r, _ in stat])
    kw["video_grid_thw"] = torch.tensor([list(g) for _, g in stat])
    t0 = time.perf_counter()
    out = check_batch(
        family,
        kw,
        config=model.config,
        guard=GuardConfig(policy="repair"),
        media={"video": [list(c) for c in clips]},
        processor={"video": cfg},
    )
    wall = time.perf_counter() - t0
    return _row(label, out, eng, "pixel_values_videos", "video_grid_thw", wall)


def _row(label: str, out, eng, pixels: str, grid: str, wall: float) -> dict:
    """One table row: the returned items' rows against the engine's (``eng``: per item its
    ``(rows, grid)``), the repairs and their time."""
    rows = out.batch[pixels].split(out.batch[grid].prod(-1).tolist())
    kept = [k for k, a in enumerate(out.report.actions) if a != "drop"]
    diff = max(
        (a - eng[k][0]).abs().max().item() if a.shape == eng[k][0].shape else float("inf")
        for a, k in zip(rows, kept)
    )
    per = [d.duration_ms for d in out.reprocessed]
    return {
        "case": label,
        "items": len(eng),
        "mismatched": sum(a != "keep" for a in out.report.actions),
        "dropped": len(out.report.dropped),
        "repaired": len(out.reprocessed),
        "fidelity": sorted({d.fidelity for d in out.reprocessed}),
        "how": sorted({d.how for d in out.reprocessed}),
        "max_abs": diff,
        "ms_per_item_median": statistics.median(per) if per else None,
        "ms_per_item_max": max(per) if per else None,
        "check_batch_ms_per_item": wall * 1e3 / len(eng),
    }


def _image_cases(quick: bool) -> list:
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeImageProcessorPil,
    )
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    cases = [
        lambda: patch_merge_case("qwen_vl", QwenFixture("qwen2_5_vl"), Qwen2VLImageProcessorPil()),
        lambda: patch_merge_case("glm4v", glm4v, Glm4vImageProcessorPil()),
        lambda: patch_merge_case("ernie4_5_vl", ernie4_5_vl, Ernie4_5_VLMoeImageProcessorPil()),
        lambda: radio_case(32768, 32768 - 8200),  # the seed's: 2400x1080 -> 2010 tokens each
        lambda: radio_case(8192, 8192 - 100),  # over-full: 1024 patches each
    ]
    return cases[:1] if quick else cases


def _video_cases(quick: bool) -> list:
    cases = [
        ("qwen_vl videos (Qwen2.5-VL: one run)", "qwen_vl", QwenFixture("qwen2_5_vl"), "qwen2_vl"),
        (
            "qwen_vl videos (Qwen3-VL: a run per group)",
            "qwen_vl",
            QwenFixture("qwen3_vl"),
            "qwen3_vl",
        ),
        ("glm4v videos (a run per group)", "glm4v", glm4v, "glm4v"),
        (
            "ernie4_5_vl videos (one run, draw_on_frames=False)",
            "ernie4_5_vl",
            ernie4_5_vl,
            "ernie4_5_vl",
        ),
    ]
    return cases[:1] if quick else cases


def run(quick: bool = False) -> list[dict]:
    """Rows for ``python -m benchmarks``: per case the items repaired, the largest pixel
    difference from the processor's own output at the engine's size, the time per item."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = [measure(make()) for make in _image_cases(quick)]
        for label, family, fixture, processor in _video_cases(quick):
            extra = {"draw_on_frames": False} if family == "ernie4_5_vl" else {}
            results.append(measure_video(label, family, fixture, processor, **extra))
    finally:
        torch.set_num_threads(threads)
    rows = []
    for d in results:
        note = (
            f"{d['repaired']}/{d['mismatched']} mismatched of {d['items']} repaired, "
            f"{'/'.join(d['fidelity'])}, {'/'.join(d['how'])}; CPU, 1 thread"
        )
        rows.append(
            dict(
                benchmark=f"reprocess/{d['case']}",
                metric="max abs vs the processor at the engine's size",
                value=d["max_abs"],
                target="<= 0",
                note=note,
            )
        )
        rows.append(
            dict(
                benchmark=f"reprocess/{d['case']}",
                metric="ms per repaired item, median",
                value=d["ms_per_item_median"],
                target="info",
                note=f"max {d['ms_per_item_max']:.1f}",
            )
        )
    return rows


def main() -> None:
    print(f"sizes (H, W): {SIZES}; videos: {FRAMES} frames each, sizes {VIDEO_SIZES}")
    for row in run():
        print(row)


if __name__ == "__main__":
    main()
