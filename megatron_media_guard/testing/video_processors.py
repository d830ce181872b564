"""transformers' patch-merge video processors run without torchvision: an oracle for the data
side's video repair (tests and benchmarks; never imported by the runtime).

``Qwen2VLVideoProcessor``, ``Qwen3VLVideoProcessor`` and ``Glm4vVideoProcessor`` import
torchvision at the top of their modules (no CPU build here), so their own code is compiled from
the installed source: the module's ``smart_resize``, the class's ``patchify`` (a plain function
of its arguments) and the class's defaults (``size``, ``patch_size``, ``image_mean``, ...).
Between them, what their ``_preprocess`` does: ``resize`` (``smart_resize`` at the call's
``size``, with the frame count where the processor passes it), torchvision's tensor resize of
uint8 frames on CPU (``F.interpolate`` on the uint8 tensor, bicubic, antialias: torchvision's
native uint8 path there; frames already at the size are returned as they are), the backend's
fused rescale-and-normalize, then ``patchify``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

MODULES = {
    "qwen2_vl": ("transformers.models.qwen2_vl.video_processing_qwen2_vl", "Qwen2VLVideoProcessor"),
    "qwen3_vl": ("transformers.models.qwen3_vl.video_processing_qwen3_vl", "Qwen3VLVideoProcessor"),
    "glm4v": ("transformers.models.glm4v.video_processing_glm4v", "Glm4vVideoProcessor"),
}
_CACHE: dict[str, dict[str, Any]] = {}


def _names() -> dict[str, Any]:
    from transformers import image_utils

    return {k: getattr(image_utils, k) for k in dir(image_utils) if k.isupper()} | {
        "PILImageResampling": image_utils.PILImageResampling
    }


def _value(node: ast.AST, names: dict[str, Any]) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return eval(compile(ast.Expression(node), "<default>", "eval"), {}, names)


def processor(name: str) -> dict[str, Any]:
    """``{"smart_resize", "patchify", "defaults"}`` of video processor ``name`` (``MODULES``),
    compiled from the installed source."""
    if name not in _CACHE:
        module, cls = MODULES[name]
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None
        tree = ast.parse(Path(spec.origin).read_text())
        fn = next(
            n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize"
        )
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
        patchify = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == "patchify")
        ns: dict[str, Any] = {"math": math, "torch": torch}
        exec(compile(ast.Module(body=[fn, patchify], type_ignores=[]), spec.origin, "exec"), ns)
        names, defaults = _names(), {"rescale_factor": 1 / 255, "do_rescale": True}
        for n in body:
            if isinstance(n, ast.Assign) and len(n.targets) == 1:
                target = n.targets[0]
                if isinstance(target, ast.Name):
                    with contextlib.suppress(Exception):  # a default no video path reads
                        defaults[target.id] = _value(n.value, names)
        _CACHE[name] = {
            "smart_resize": ns["smart_resize"],
            "patchify": ns["patchify"],
            "defaults": defaults,
        }
    return _CACHE[name]


def settings(name: str) -> dict[str, Any]:
    """The processor's defaults a caller passes as its ``video_preprocessor_config``."""
    d = processor(name)["defaults"]
    keys = (
        "image_mean",
        "image_std",
        "rescale_factor",
        "do_rescale",
        "do_normalize",
        "patch_size",
        "merge_size",
        "temporal_patch_size",
        "resample",
        "size",
    )
    return {k: d[k] for k in keys if k in d}


def shares_budget(name: str) -> bool:
    """Whether the processor's frames share its pixel budget (its ``smart_resize`` takes the
    frame count: Qwen3-VL, GLM-4V), else the budget is per frame (Qwen2-VL)."""
    return "num_frames" in inspect.signature(processor(name)["smart_resize"]).parameters


def process(
    name: str, frames: np.ndarray, size: dict[str, int] | None = None
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One clip ``[T, H, W, 3]`` uint8 as video processor ``name`` makes it at ``size``
    (``{"shortest_edge": min_pixels, "longest_edge": max_pixels}``; default its own):
    ``(pixel_values_videos, (t, h, w))``."""
    p = processor(name)
    d = p["defaults"]
    size = size or d["size"]
    patch, merge, tp = d["patch_size"], d["merge_size"], d["temporal_patch_size"]
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)[None]  # B T C H W
    t, height, width = video.shape[1], video.shape[-2], video.shape[-1]
    kw = dict(
        height=height,
        width=width,
        factor=patch * merge,
        min_pixels=size["shortest_edge"],
        max_pixels=size["longest_edge"],
    )
    if shares_budget(name):
        kw.update(num_frames=t, temporal_factor=tp)
    h, w = p["smart_resize"](**kw)
    x = video.reshape(-1, *video.shape[2:])
    if (h, w) != (height, width):
        x = F.interpolate(x, size=(h, w), mode="bicubic", antialias=True, align_corners=False)
    x = x.reshape(1, t, 3, h, w)
    mean = torch.tensor(d["image_mean"]) * (1.0 / d["rescale_factor"])
    std = torch.tensor(d["image_std"]) * (1.0 / d["rescale_factor"])
    x = x.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    rows, gt, gh, gw = p["patchify"](
        None, x, patch_size=patch, merge_size=merge, temporal_patch_size=tp
    )
    return rows[0], (gt, gh, gw)


__all__ = ["MODULES", "process", "processor", "settings", "shares_budget"]
