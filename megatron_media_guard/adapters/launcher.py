"""Megatron-LM launcher integration (docs/MEGATRON.md): ``pretrain(...,
extra_args_provider=add_media_guard_args)``, then ``install_from_args(model, get_args())``.

A ``MEDIA_GUARD_*`` environment variable overrides the matching ``--media-guard-*`` argument,
which overrides the default (:meth:`GuardConfig.with_env`; the budget's and MEDIA_GUARD_DISABLE
parsed with the same rules).
"""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Mapping
from functools import partial
from typing import Any, Literal

from ..config import GuardConfig, parse_bool, parse_int, parse_names
from ..core.grammar import Grammar
from ..core.guard import MediaGuard
from ..diagnostics import get_logger
from ..errors import MediaInputError
from ..families import find_family, no_family
from ..families.spec import check_tokenizer
from ..ranks.budget import DropBudget
from ..ranks.consensus import StageConsensus, dist_ready
from .hooks import HandleGroup, ItemsProvider
from .step_end import StepEnd
from .vlm_install import INSTALLERS, guard_for

#: the GuardConfig fields the arguments set as they are (``args.media_guard_<field>``)
_CONFIG_ARGS = ("policy", "fallback", "log_dir", "nonfinite", "dump_dir", "generated", "keep_tower")
StepEndChoice = Literal["auto", "zero_grad_buffer", "optimizer", "manual"]

#: the "media guard" argument group: ``--media-guard-<name>`` and its argparse options
_ARGS: dict[str, dict[str, Any]] = {
    "policy": dict(
        choices=("raise", "drop", "repair"),
        help="On a placeholder/feature mismatch: raise (default), drop the sample, or repair "
        "(re-project; falls back per --media-guard-fallback).",
    ),
    "fallback": dict(
        choices=("drop", "raise"),
        help="What repair does for a sample it cannot repair (default drop).",
    ),
    "log-dir": dict(help="Directory for the per-rank media_guard.rankNNNNN.jsonl diagnostics."),
    "nonfinite": dict(
        choices=("raise", "drop", "off"),
        help="NaN/Inf in an item's features: raise (default), drop its sample, or off.",
    ),
    "generated": dict(
        choices=("text", "drop", "raise"),
        help="A placeholder under the loss outside any media region (the policy generated "
        "it): feed it as text and keep the sample (default), drop the sample, or raise.",
    ),
    "keep-tower": dict(
        choices=("always", "on_drop", "never"),
        help="When a micro-batch feeds the vision tower nothing, run it on a dummy input "
        "(Qwen-VL): always (default: text-only too; FSDP2 / DDP need it), on_drop, never.",
    ),
    "allowed-fidelity": dict(
        nargs="+",
        metavar="FIDELITY",
        help="Repair fidelity classes applied (engine-replay unique closest-aspect); "
        "space or comma separated. Default: engine-replay unique.",
    ),
    "drop-budget-step": dict(
        type=float, help="Fail when more than this fraction of a step's samples is dropped."
    ),
    "drop-budget-window": dict(
        type=float,
        help="Fail when more than this fraction is dropped over --media-guard-window-steps.",
    ),
    "window-steps": dict(type=int, help="Steps in the drop-budget window (default 100)."),
    "dump-dir": dict(
        help="GuardConfig.dump_dir: save a replay bundle of each mismatched micro-batch here "
        "(media-guard replay BUNDLE; holds token ids and pixels: sensitive). Every merge; "
        "LLaVA only for an image token too many or too few (docs/MEGATRON.md).",
    ),
    "disable": dict(action="store_true", default=False, help="Do not install the guard."),
}


def add_media_guard_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the "media guard" argument group; returns the parser (``extra_args_provider``)."""
    g = parser.add_argument_group(title="media guard")
    for name, options in _ARGS.items():
        g.add_argument(f"--media-guard-{name}", **{"default": None, **options})
    return parser


def config_from_args(args: Any, environ: Mapping[str, str] | None = None) -> GuardConfig:
    """The :class:`GuardConfig` of the ``--media-guard-*`` arguments, then the
    ``MEDIA_GUARD_*`` environment overrides (environment wins)."""
    kw: dict[str, Any] = {}
    for field in _CONFIG_ARGS:
        v = getattr(args, f"media_guard_{field}", None)
        if v is not None:
            kw[field] = v
    fid = getattr(args, "media_guard_allowed_fidelity", None)
    if fid is not None:
        kw["allowed_fidelity"] = parse_names(fid if isinstance(fid, str) else ",".join(fid))
    return GuardConfig(**kw, environ={}).with_env(environ)


def _float(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise MediaInputError(f"MEDIA_GUARD_{name.upper()} must be a number, got {raw!r}") from None


def _setting(args: Any, attr: str, environ, parse) -> Any:
    """``MEDIA_GUARD_<NAME>`` parsed (when set), else ``args.media_guard_<name>``."""
    raw = (os.environ if environ is None else environ).get(attr.upper())
    if raw is not None:
        return parse(attr.removeprefix("media_guard_"), raw)
    return getattr(args, attr, None)


def disabled(args: Any, environ: Mapping[str, str] | None = None) -> bool:
    """``--media-guard-disable``, or MEDIA_GUARD_DISABLE=1/true/yes/on (0/false/no/off
    re-enables; empty, none or auto leaves the argument in charge)."""
    val = _setting(args, "media_guard_disable", environ, partial(parse_bool, allow_none=True))
    return bool(getattr(args, "media_guard_disable", False)) if val is None else val


def budget_from_args(args: Any, environ: Mapping[str, str] | None = None) -> Any:
    """A :class:`DropBudget`, or None when no limit is set."""
    step = _setting(args, "media_guard_drop_budget_step", environ, _float)
    window = _setting(args, "media_guard_drop_budget_window", environ, _float)
    steps = _setting(args, "media_guard_window_steps", environ, parse_int)
    if step is None and window is None:
        return None
    return DropBudget(step, window, 100 if steps is None else steps)


def find_vlm(chunk: Any) -> tuple[str, Any] | None:
    """``(family name, module)`` inside one model chunk (:func:`~..families.find_family`:
    through wrappers, then the submodules, the outermost first), or None."""
    m, spec = find_family(chunk)
    return None if spec is None else (spec.name, m)


def install_from_args(
    model: Any,
    args: Any,
    grammar: Grammar | None = None,
    *,
    items_provider: ItemsProvider | None = None,
    step_end: StepEndChoice = "auto",
    environ: Mapping[str, str] | None = None,
    tokenizer: Any = None,
) -> HandleGroup:
    """Install the guard on every module of ``model`` (one module or the virtual-pipeline
    chunks, possibly DDP/Float16Module-wrapped) that a family of the registry knows, one
    :class:`MediaGuard` per family shared by the chunks; steps end outside the forward per
    ``step_end`` (a :class:`~.step_end.StepEnd`). Each step: docs/MEGATRON.md, Launcher.
    Returns a :class:`HandleGroup` (empty when disabled).
    """
    log = get_logger()
    if step_end not in typing.get_args(StepEndChoice):
        raise MediaInputError(
            f"install_from_args: step_end must be one of {list(typing.get_args(StepEndChoice))}, "
            f"got {step_end!r}"
        )
    check_tokenizer(tokenizer, "install_from_args")
    if disabled(args, environ):
        log.info("[media-guard] disabled (--media-guard-disable / MEDIA_GUARD_DISABLE)")
        return HandleGroup()
    try:
        config = config_from_args(args, environ)
        budget = budget_from_args(args, environ)
    except MediaInputError as err:  # a bad --media-guard-* value or MEDIA_GUARD_* variable
        raise err.with_context("install_from_args: ") from None
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    found = [(i, *find_family(c)) for i, c in enumerate(chunks)]
    targets = [(i, spec.name, m, spec) for i, m, spec in found if spec is not None]
    if not targets:
        names = [type(c).__name__ for c in chunks]
        raise no_family("install_from_args", f"the model chunks {names} (nor their wrappers)")
    consensus = StageConsensus.from_parallel_state(budget=budget)
    rank = consensus.rank_info()
    distributed = dist_ready()

    def step_provider() -> int | None:
        step = getattr(args, "curr_iteration", None)
        return step if isinstance(step, int) else None

    common = dict(
        items_provider=items_provider,
        step_provider=step_provider,
        auto_step_end=False if distributed else None,
    )
    guards: dict[str, MediaGuard] = {}
    group = HandleGroup()
    for _, kind, m, spec in targets:
        if kind not in guards:
            try:
                guards[kind] = guard_for(
                    spec, m, config, tokenizer, grammar=grammar, rank=rank, consensus=consensus
                )
            except MediaInputError as err:  # a token the config and the tokenizer lack
                raise err.with_context("install_from_args: ") from None
            consensus.bind(guards[kind])
        extra = {"loss_mask_inplace": True} if spec.apply == "inputs" else {}
        install = INSTALLERS[spec.apply]
        group.append(install(m, guards[kind], spec, tokenizer, **common, **extra))
    ends = StepEnd([h.guard for h in group], step_provider)
    hook: StepEnd | None = None
    if step_end in ("auto", "zero_grad_buffer"):
        hook = ends.on_method(chunks[0], "zero_grad_buffer")
        if hook is None and step_end == "zero_grad_buffer":
            raise MediaInputError(
                f"install_from_args: step_end='zero_grad_buffer', but {type(chunks[0]).__name__} "
                "has no zero_grad_buffer (wrap the model in megatron-core's DDP first, or pass "
                "step_end='optimizer' / 'manual')"
            )
    if hook is None and step_end in ("auto", "optimizer"):
        hook = ends.on_optimizer_step()
    if hook is not None:
        group.append(hook)
    log.info(
        "[media-guard] installed on %s (policy %s, log_dir %s, dump_dir %s, budget %s)",
        ", ".join(f"chunk {i}: {kind}" for i, kind, _, _ in targets),
        config.policy,
        config.log_dir,
        config.dump_dir,
        "off" if budget is None else "on",
    )
    return group
