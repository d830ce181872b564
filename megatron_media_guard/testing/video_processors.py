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

``Ernie4_5_VLMoeVideoProcessor`` sizes and patchifies inside its ``_preprocess``: that method and
its ``_prepare_input_videos`` (the odd last frame repeated; ``draw_on_frames=False``: its default
draws timestamps with a font file) are compiled and run with a stand-in ``self`` whose
``resize`` is the same torchvision uint8 resize and whose ``rescale_and_normalize`` is the
backend's fused one; ``smart_resize`` from its image processor's module.
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import importlib.util
import inspect
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

MODULES = {
    "qwen2_vl": ("transformers.models.qwen2_vl.video_processing_qwen2_vl", "Qwen2VLVideoProcessor"),
    "qwen3_vl": ("transformers.models.qwen3_vl.video_processing_qwen3_vl", "Qwen3VLVideoProcessor"),
    "glm4v": ("transformers.models.glm4v.video_processing_glm4v", "Glm4vVideoProcessor"),
    "ernie4_5_vl": (
        "transformers.models.ernie4_5_vl_moe.video_processing_ernie4_5_vl_moe",
        "Ernie4_5_VLMoeVideoProcessor",
    ),
}
_ERNIE_SIZING = "transformers.models.ernie4_5_vl_moe.image_processing_ernie4_5_vl_moe"
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


def _tree(module: str) -> tuple[ast.Module, str]:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    return ast.parse(Path(spec.origin).read_text()), spec.origin


def _compiled(nodes: list[ast.stmt], origin: str, ns: dict[str, Any]) -> dict[str, Any]:
    flags = __future__.annotations.compiler_flag  # annotations name torchvision types
    exec(compile(ast.Module(body=nodes, type_ignores=[]), origin, "exec", flags=flags), ns)
    return ns


def _def(body: list[ast.stmt], name: str) -> ast.FunctionDef:
    return next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)


def processor(name: str) -> dict[str, Any]:
    """``{"smart_resize", "patchify" or "_preprocess" and "_prepare_input_videos",
    "defaults"}`` of video processor ``name`` (``MODULES``), compiled from the installed
    source."""
    if name not in _CACHE:
        module, cls = MODULES[name]
        tree, origin = _tree(module)
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
        ns: dict[str, Any] = {"math": math, "torch": torch}
        if name == "ernie4_5_vl":
            sizing, sizing_origin = _tree(_ERNIE_SIZING)
            _compiled([_def(sizing.body, "smart_resize")], sizing_origin, ns)
            ns.update(_runtime())
            methods = [_def(body, "_preprocess"), _def(body, "_prepare_input_videos")]
        else:
            methods = [_def(tree.body, "smart_resize"), _def(body, "patchify")]
        _compiled(methods, origin, ns)
        names, defaults = _names(), {"rescale_factor": 1 / 255, "do_rescale": True}
        for n in body:
            if isinstance(n, ast.Assign) and len(n.targets) == 1:
                target = n.targets[0]
                if isinstance(target, ast.Name):
                    with contextlib.suppress(Exception):  # a default no video path reads
                        defaults[target.id] = _value(n.value, names)
        _CACHE[name] = {m.name: ns[m.name] for m in methods} | {
            "smart_resize": ns["smart_resize"],
            "defaults": defaults,
        }
    return _CACHE[name]


def _runtime() -> dict[str, Any]:
    """The names Ernie's compiled methods use (none imports torchvision)."""
    from transformers import image_utils, video_utils
    from transformers.image_processing_utils import BatchFeature
    from transformers.utils.import_utils import is_tracing

    return {
        "np": np,
        "BatchFeature": BatchFeature,
        "ChannelDimension": image_utils.ChannelDimension,
        "PILImageResampling": image_utils.PILImageResampling,
        "SizeDict": image_utils.SizeDict,
        "get_image_size": image_utils.get_image_size,
        "infer_channel_dimension_format": image_utils.infer_channel_dimension_format,
        "group_videos_by_shape": video_utils.group_videos_by_shape,
        "reorder_videos": video_utils.reorder_videos,
        "is_tracing": is_tracing,
    }


def _uint8_resize(videos: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    """torchvision's tensor resize of uint8 frames on CPU (bicubic, antialias): its native
    uint8 kernel; frames already at the size as they are."""
    if tuple(videos.shape[-2:]) == tuple(hw):
        return videos
    x = videos.reshape(-1, *videos.shape[-3:])
    x = F.interpolate(x, size=tuple(hw), mode="bicubic", antialias=True, align_corners=False)
    return x.reshape(*videos.shape[:-2], *hw)


def _fused(videos: torch.Tensor, d: dict[str, Any]) -> torch.Tensor:
    """The torchvision backend's fused rescale-and-normalize."""
    mean = torch.tensor(d["image_mean"]) * (1.0 / d["rescale_factor"])
    std = torch.tensor(d["image_std"]) * (1.0 / d["rescale_factor"])
    return videos.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))


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
        "draw_on_frames",
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
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)  # T C H W
    if name == "ernie4_5_vl":
        return _ernie(p, video, size)
    t, height, width = video.shape[0], video.shape[-2], video.shape[-1]
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
    x = _fused(_uint8_resize(video, (h, w)), d)[None]  # B T C H W
    rows, gt, gh, gw = p["patchify"](
        None, x, patch_size=patch, merge_size=merge, temporal_patch_size=tp
    )
    return rows[0], (gt, gh, gw)


def _ernie(p: dict[str, Any], video: torch.Tensor, size: dict[str, int]):
    d = p["defaults"]
    me = SimpleNamespace(
        temporal_patch_size=d["temporal_patch_size"],
        resize=lambda v, size, resample: _uint8_resize(v, (size.height, size.width)),
        rescale_and_normalize=lambda v, *args: _fused(v, d),
    )
    videos = p["_prepare_input_videos"](
        me,
        [video],
        input_data_format=p["_preprocess"].__globals__["ChannelDimension"].FIRST,
        video_metadata=[None],
        draw_on_frames=False,
    )
    out = p["_preprocess"](
        me,
        videos,
        do_resize=True,
        size=dict(size),
        resample=d["resample"],
        do_rescale=True,
        rescale_factor=d["rescale_factor"],
        do_normalize=True,
        image_mean=d["image_mean"],
        image_std=d["image_std"],
        patch_size=d["patch_size"],
        merge_size=d["merge_size"],
    )
    return out["pixel_values_videos"], tuple(out["video_grid_thw"][0].tolist())


__all__ = ["MODULES", "process", "processor", "settings", "shares_budget"]
