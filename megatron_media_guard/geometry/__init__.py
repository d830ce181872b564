"""Geometry families: how a processor turns pixels into a token count, and back (each a
``Geometry``: ``tokens``, ``size_for``, ``solve``; docs/GEOMETRY.md). Pure Python: imports only
``errors`` and ``config`` from the package.
"""

from megatron_media_guard.geometry.anyres import AnyresGeometry
from megatron_media_guard.geometry.fixed import FixedGeometry
from megatron_media_guard.geometry.patch_merge import PatchMergeGeometry
from megatron_media_guard.geometry.pixtral import PixtralGeometry
from megatron_media_guard.geometry.radio import RadioEngineItem, RadioTilerGeometry
from megatron_media_guard.geometry.solution import (
    FIDELITIES,
    HW_KINDS,
    Fidelity,
    Geometry,
    GeometryError,
    HwKind,
    Solution,
)
from megatron_media_guard.geometry.tiled import TiledGeometry

__all__ = [
    "FIDELITIES",
    "HW_KINDS",
    "AnyresGeometry",
    "Fidelity",
    "FixedGeometry",
    "Geometry",
    "GeometryError",
    "HwKind",
    "PatchMergeGeometry",
    "PixtralGeometry",
    "RadioEngineItem",
    "RadioTilerGeometry",
    "Solution",
    "TiledGeometry",
]
