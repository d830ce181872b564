"""megatron_media_guard: per-sample, per-rank guard for merging media features into text
embeddings in vision-language training (Megatron, Megatron-Bridge, transformers).

The public surface::

    # guard a model of a known family (docs/FAMILIES.md), or every one a Megatron launcher built
    handle = install_vlm(model, GuardConfig(policy="drop", log_dir="logs"), tokenizer=tok)
    group = install_from_args(model, args)
    # check a batch before the trainer (collate function, rollout worker): no model, no tower
    checked = check_batch("glm4v", batch, config=model.config, tokenizer=tok)
    # the merge itself, for a model no family knows (repair: geometry=, encoder=)
    guard = MediaGuard(GuardConfig(policy="drop"), grammar=Grammar.qwen2_vl())
    res = guard.merge(embeddings, input_ids, features, items, loss_mask=lm, labels=labels)
    res.embeddings, res.loss_mask, res.labels, res.report       # MergeResult, GuardReport

The names below (``__all__``) are the public surface; everything else lives in its package.
They load on first use (PEP 562): ``import megatron_media_guard`` and its torch-free parts
(``diagnostics``, ``media-guard report``, ``--help``) import no torch. docs/ARCHITECTURE.md.
"""

import importlib as _importlib
import typing as _typing

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "install_vlm": ".adapters.vlm_install",
    "install_from_args": ".adapters.launcher",
    "check_batch": ".families.collate",
    "MediaGuard": ".core.guard",
    "GuardConfig": ".config",
    "Grammar": ".core.grammar",
    "MediaItem": ".core.items",
    "parse_runs": ".core.runs",
    "MergeResult": ".core.outcome",
    "GuardReport": ".core.outcome",
    "PatchMergeGeometry": ".geometry.patch_merge",
    "RadioTilerGeometry": ".geometry.radio",
    "TiledGeometry": ".geometry.tiled",
    "FixedGeometry": ".geometry.fixed",
    "PixtralGeometry": ".geometry.pixtral",
    "AnyresGeometry": ".geometry.anyres",
    "MediaGuardError": ".errors",
    "MediaAlignmentError": ".errors",
    "MediaInputError": ".errors",
    "ConsensusError": ".errors",
    "DropBudgetExceeded": ".errors",
}

# the same names as _EXPORTS, spelled out for type checkers (tests/test_public_surface.py)
__all__ = [
    "AnyresGeometry",
    "ConsensusError",
    "DropBudgetExceeded",
    "FixedGeometry",
    "Grammar",
    "GuardConfig",
    "GuardReport",
    "MediaAlignmentError",
    "MediaGuard",
    "MediaGuardError",
    "MediaInputError",
    "MediaItem",
    "MergeResult",
    "PatchMergeGeometry",
    "PixtralGeometry",
    "RadioTilerGeometry",
    "TiledGeometry",
    "__version__",
    "check_batch",
    "install_from_args",
    "install_vlm",
    "parse_runs",
]


# before a torch-side name resolves, what the core calls but may not import registers with
# core/providers.py (ranks/: the default consensus and rank; replay/: the bundle writer)
_TORCH_SIDE = (".core.", ".families.", ".adapters.")
_PROVIDERS = (".ranks.defaults", ".replay.bundle_save")


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if module.startswith(_TORCH_SIDE):
        for provider in _PROVIDERS:
            _importlib.import_module(provider, __name__)
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    """The public names only (not this module's helpers, nor the subpackages loaded so far)."""
    return sorted(__all__)


if _typing.TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from .adapters.launcher import install_from_args
    from .adapters.vlm_install import install_vlm
    from .config import GuardConfig
    from .core.grammar import Grammar
    from .core.guard import MediaGuard
    from .core.items import MediaItem
    from .core.outcome import GuardReport, MergeResult
    from .core.runs import parse_runs
    from .errors import (
        ConsensusError,
        DropBudgetExceeded,
        MediaAlignmentError,
        MediaGuardError,
        MediaInputError,
    )
    from .families.collate import check_batch
    from .geometry import (
        AnyresGeometry,
        FixedGeometry,
        PatchMergeGeometry,
        PixtralGeometry,
        RadioTilerGeometry,
        TiledGeometry,
    )
