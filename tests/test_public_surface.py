"""What a user imports from the top level, and the one error family they catch.

- ``from megatron_media_guard import install_vlm, check_batch, ...`` gives the functions users
  call (and the geometries, the errors, the result types), lazily: importing the package
  imports no torch; ``dir()`` lists those names, not the module's helpers.
- ``MediaGuardError`` is the root; ``MediaAlignmentError`` (a fault in the data) and
  ``MediaInputError`` (a wrong call) are siblings under it, so a trainer that skips a batch on
  ``except MediaAlignmentError`` does not swallow its own wrong call.
"""

from __future__ import annotations

import sys

import pytest

import megatron_media_guard as mmg
from megatron_media_guard import (
    ConsensusError,
    DropBudgetExceeded,
    MediaAlignmentError,
    MediaGuardError,
    MediaInputError,
)

# (public name, module that defines it): what a user calls, one screen of names
PUBLIC = {
    "install_vlm": "megatron_media_guard.adapters.vlm_install",
    "install_from_args": "megatron_media_guard.adapters.launcher",
    "check_batch": "megatron_media_guard.families.collate",
    "MediaGuard": "megatron_media_guard.core.guard",
    "GuardConfig": "megatron_media_guard.config",
    "Grammar": "megatron_media_guard.core.grammar",
    "MediaItem": "megatron_media_guard.core.items",
    "parse_runs": "megatron_media_guard.core.runs",
    "MergeResult": "megatron_media_guard.core.outcome",
    "GuardReport": "megatron_media_guard.core.outcome",
    "PatchMergeGeometry": "megatron_media_guard.geometry.patch_merge",
    "RadioTilerGeometry": "megatron_media_guard.geometry.radio",
    "TiledGeometry": "megatron_media_guard.geometry.tiled",
    "FixedGeometry": "megatron_media_guard.geometry.fixed",
    "PixtralGeometry": "megatron_media_guard.geometry.pixtral",
    "AnyresGeometry": "megatron_media_guard.geometry.anyres",
    "MediaGuardError": "megatron_media_guard.errors",
    "MediaAlignmentError": "megatron_media_guard.errors",
    "MediaInputError": "megatron_media_guard.errors",
    "ConsensusError": "megatron_media_guard.errors",
    "DropBudgetExceeded": "megatron_media_guard.errors",
}
# internals that left the top level: each stays importable from its own package
INTERNAL = {
    "Run": "megatron_media_guard.core.runs",
    "ParsedRuns": "megatron_media_guard.core.runs",
    "Finding": "megatron_media_guard.core.runs",
    "FindingKind": "megatron_media_guard.core.runs",
    "AlignmentReport": "megatron_media_guard.core.alignment",
    "SampleReport": "megatron_media_guard.core.alignment",
    "Status": "megatron_media_guard.core.alignment",
    "check_alignment": "megatron_media_guard.core.alignment",
    "GuardRecord": "megatron_media_guard.diagnostics.records",
    "RankInfo": "megatron_media_guard.diagnostics.records",
}


@pytest.mark.parametrize("name,module", sorted(PUBLIC.items()))
def test_public_name_is_the_object_its_module_defines(name, module):
    obj = getattr(mmg, name)
    assert obj is getattr(sys.modules[module], name)
    assert getattr(obj, "__module__", module) == module


def test_all_and_dir_list_exactly_the_public_names():
    public = {*PUBLIC, "__version__"}
    assert set(mmg.__all__) == public and len(mmg.__all__) == len(public)
    # the module's own helpers (importlib, typing, the export table) are not part of it
    assert dir(mmg) == sorted(public)


@pytest.mark.parametrize("name,module", sorted(INTERNAL.items()))
def test_internals_stay_in_their_packages(name, module):
    with pytest.raises(AttributeError):
        getattr(mmg, name)
    __import__(module)
    assert getattr(sys.modules[module], name) is not None


# ---- the error family ------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls,bases",
    [
        (MediaAlignmentError, (MediaGuardError, RuntimeError)),
        (MediaInputError, (MediaGuardError, ValueError)),
        (ConsensusError, (MediaGuardError, RuntimeError)),
        (DropBudgetExceeded, (MediaAlignmentError,)),
    ],
)
def test_one_root_with_a_data_branch_a_call_branch_and_a_ranks_branch(cls, bases):
    assert all(issubclass(cls, b) for b in bases)
    kinds = [issubclass(cls, k) for k in (MediaAlignmentError, MediaInputError, ConsensusError)]
    assert sum(kinds) == 1  # every error is one of the three, never two


def test_with_context_keeps_the_type_and_extends_the_context():
    err = MediaInputError("bad dtype", context={"dtype": "float32"})
    out = err.with_context("MediaGuard.merge (step 3): ", where="step 3")
    assert type(out) is MediaInputError
    assert str(out) == "MediaGuard.merge (step 3): bad dtype"
    assert out.context == {"dtype": "float32", "where": "step 3"}
