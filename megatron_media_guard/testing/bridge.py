"""Megatron-Bridge's real model modules on CPU, for tests (never imported by the runtime).

``import megatron.bridge`` fails on a CPU machine: its package ``__init__``s import every model
family, down to Transformer Engine. Its *leaf* modules (``modeling_qwen25_vl``,
``modelling_qwen3_vl/model``, ``modeling_nemotron_vl``, ...) import on CPU beside megatron-core
0.19.2's sources once the ``megatron.bridge.*`` packages are created path-only: a
``sys.meta_path`` finder gives each package its ``__path__`` and skips its ``__init__.py``.
Three shims complete it: ``typing.override`` from ``typing_extensions`` (Python 3.11 lacks it;
0.19.2's ``megatron/training/models`` import it), ``torch.cuda.nvtx.range_push`` / ``range_pop``
as no-ops when CUDA is absent (CPU torch raises; ``Qwen3VLModel.forward`` calls them), and
``omegaconf`` importable (a pure-Python dependency; installed by ``scripts/test_mcore019.sh``).

Nothing happens at import of this module: :func:`install` / :func:`uninstall` (or the
:func:`bridge_modules` context manager) put the finder and the shims in place and take them away
again, restoring what they replaced and dropping the ``megatron.bridge`` modules they loaded.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

ROOT = "megatron.bridge"


class PathOnlyPackages(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds every ``megatron.bridge`` package under ``root`` (the folder holding the
    ``megatron/bridge`` tree) as an empty module with its ``__path__``; modules are left to the
    ordinary path finder, which looks in that ``__path__``."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ROOT and not fullname.startswith(ROOT + "."):
            return None
        folder = os.path.join(self.root, *fullname.split("."))
        if not os.path.isfile(os.path.join(folder, "__init__.py")):
            return None  # a module, or absent: the path finder decides
        spec = importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        spec.submodule_search_locations = [folder]
        spec.origin = os.path.join(folder, "__init__.py")
        return spec

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module) -> None:
        pass  # path-only: the package's __init__.py never runs


def _nvtx_noop(*_args, **_kwargs) -> None:
    return None


@dataclass
class _Installed:
    finder: PathOnlyPackages
    saved: dict = field(default_factory=dict)  # (owner, name) -> previous value or _MISSING


_MISSING = object()
_STATE: list[_Installed] = []


def _set(state: _Installed, owner, name: str, value) -> None:
    state.saved[(owner, name)] = getattr(owner, name, _MISSING)
    setattr(owner, name, value)


def find_root(candidates: tuple[str, ...] | None = None) -> str | None:
    """The folder holding ``megatron/bridge`` (the unpacked wheel): ``$MEGATRON_BRIDGE_ROOT``,
    else ``.bridge062`` in the current directory or beside the package's checkout."""
    if candidates is None:
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = os.environ.get("MEGATRON_BRIDGE_ROOT")
        candidates = tuple(
            p
            for p in (
                env,
                os.path.join(os.getcwd(), ".bridge062"),
                os.path.join(here, ".bridge062"),
            )
            if p
        )
    for c in candidates:
        if os.path.isfile(os.path.join(c, "megatron", "bridge", "models", "__init__.py")):
            return c
    return None


def install(root: str) -> None:
    """Put the path-only finder (first on ``sys.meta_path``) and the shims in place."""
    if _STATE:
        raise RuntimeError("megatron.bridge loader already installed; uninstall() first")
    import torch
    import typing_extensions

    state = _Installed(PathOnlyPackages(root))
    sys.meta_path.insert(0, state.finder)
    if not hasattr(typing, "override"):
        _set(state, typing, "override", typing_extensions.override)
    if not torch.cuda.is_available():
        nvtx = torch.cuda.nvtx
        _set(state, nvtx, "range_push", _nvtx_noop)
        _set(state, nvtx, "range_pop", _nvtx_noop)
    _STATE.append(state)


def uninstall() -> None:
    """Remove the finder, restore what the shims replaced and forget the ``megatron.bridge``
    modules loaded meanwhile."""
    if not _STATE:
        return
    state = _STATE.pop()
    if state.finder in sys.meta_path:
        sys.meta_path.remove(state.finder)
    for (owner, name), old in state.saved.items():
        if old is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, old)
    for name in [m for m in sys.modules if m == ROOT or m.startswith(ROOT + ".")]:
        del sys.modules[name]


@contextmanager
def bridge_modules(root: str) -> Iterator[None]:
    """``install(root)`` for the duration of the block."""
    install(root)
    try:
        yield
    finally:
        uninstall()


def missing() -> str | None:
    """Why Bridge's modules cannot load here (a reason to skip), or None."""
    try:
        import megatron.core as mc
    except ImportError:
        return "megatron-core is not installed"
    version = tuple(int(x) for x in mc.__version__.split("+")[0].split(".")[:2])
    if version < (0, 19):
        return f"Megatron-Bridge 0.6.2 runs on megatron-core 0.19, not {mc.__version__} (run scripts/test_mcore019.sh)"
    if find_root() is None:
        return "no unpacked Megatron-Bridge 0.6.2 wheel (.bridge062/; scripts/test_mcore019.sh fetches it)"
    if importlib.util.find_spec("omegaconf") is None:
        return "omegaconf is not installed (scripts/test_mcore019.sh installs it)"
    return None
