"""Guard configuration."""

from __future__ import annotations

import functools
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields, replace
from typing import Literal

from .errors import MediaInputError

Policy = Literal["raise", "drop", "repair"]
Fallback = Literal["drop", "raise"]
NonFinite = Literal["raise", "drop", "off"]
FidelityName = Literal["engine-replay", "unique", "closest-aspect", "unreachable"]

_POLICIES = ("raise", "drop", "repair")
_FALLBACKS = ("drop", "raise")
_NONFINITE = ("raise", "drop", "off")
_FIDELITIES = ("engine-replay", "unique", "closest-aspect")


@dataclass(frozen=True)
class GuardConfig:
    """What the guard does when placeholders and features disagree.

    Each field not passed takes its ``MEDIA_GUARD_<FIELD>`` environment variable when set
    (``MEDIA_GUARD_LOG_DIR=/runs/x/media_guard``, ``MEDIA_GUARD_POLICY=drop``, ...), else its
    default: **argument, then environment, then default**. ``GuardConfig(environ={})`` reads
    no variable; :meth:`with_env` lets the environment win over every field.

    policy: ``"raise"`` a :class:`MediaAlignmentError`; ``"drop"`` the sample (loss masked,
        labels ignored, no foreign feature merged); ``"repair"`` re-project the mismatched
        items to the placeholder count, applying ``fallback`` where that is not possible.
    fallback: what ``repair`` does for a sample it cannot repair.
    log_dir: where each rank writes ``media_guard.rank{rank:05d}.jsonl``; None: logger only.
    nonfinite: NaN/Inf in an item's features: raise, drop its sample, or "off" (no check;
        saves one read of the features on the aligned path).
    allowed_fidelity: repair solutions of these classes are applied; others fall back.
    ignore_index: the label value the loss ignores.
    fp8: pad the re-encoded patch sequence for transformer-engine FP8 (None: detect).
    dump_dir: save a replay bundle of each mismatched micro-batch here (token ids, item
        metadata, the mismatched items' pixels: sensitive data); None: no bundles.
    dump_pixels / dump_features: include the mismatched items' pixels / features.
    dump_max: at most this many bundles per rank and directory (None: no limit).
    fp8_multiple: the multiple to pad to when FP8 is active (None: ask transformer-engine's
        recipe, 16 when it cannot say; 32 for MXFP8).
    """

    policy: Policy = "raise"
    fallback: Fallback = "drop"
    log_dir: str | None = None
    nonfinite: NonFinite = "raise"
    allowed_fidelity: tuple[FidelityName, ...] = ("engine-replay", "unique")
    ignore_index: int = -100
    fp8: bool | None = None
    fp8_multiple: int | None = None
    dump_dir: str | None = None
    dump_pixels: bool = True
    dump_features: bool = False
    dump_max: int | None = 16

    def __post_init__(self) -> None:
        _one_of("policy", self.policy, _POLICIES)
        _one_of("fallback", self.fallback, _FALLBACKS)
        _one_of("nonfinite", self.nonfinite, _NONFINITE)
        if isinstance(self.allowed_fidelity, str):
            raise MediaInputError(
                f"GuardConfig.allowed_fidelity must be a tuple of names, got the string "
                f"{self.allowed_fidelity!r} (write ({self.allowed_fidelity!r},))"
            )
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise MediaInputError(
                f"GuardConfig.ignore_index must be an int, got {self.ignore_index!r}"
            )
        fid = tuple(self.allowed_fidelity)
        for f in fid:
            _one_of("allowed_fidelity", f, _FIDELITIES)
        object.__setattr__(self, "allowed_fidelity", fid)
        if self.fp8_multiple is not None and self.fp8_multiple < 1:
            raise MediaInputError(f"fp8_multiple must be >= 1, got {self.fp8_multiple}")
        for name in ("log_dir", "dump_dir"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        if self.dump_max is not None and self.dump_max < 1:
            raise MediaInputError(f"dump_max must be >= 1 or None, got {self.dump_max}")

    def with_env(self, environ: Mapping[str, str] | None = None) -> GuardConfig:
        """Overrides from ``MEDIA_GUARD_<FIELD>`` environment variables (e.g. MEDIA_GUARD_POLICY=drop;
        MEDIA_GUARD_ALLOWED_FIDELITY=engine-replay,unique): here the environment wins over every
        field of ``self``, explicit or not (the Megatron launcher's order)."""
        env = os.environ if environ is None else environ
        return _checked(env, lambda changes: replace(self, **changes), _env_changes(env, ()))


def _env_changes(env: Mapping[str, str], skip: Collection[str]) -> dict[str, object]:
    """The fields ``MEDIA_GUARD_<FIELD>`` variables of ``env`` set (except those in ``skip``),
    parsed; a variable that does not parse is a MediaInputError naming it."""
    changes: dict[str, object] = {}
    for f in fields(GuardConfig):
        raw = env.get(f"MEDIA_GUARD_{f.name.upper()}")
        if raw is None or f.name in skip:
            continue
        if f.name == "allowed_fidelity":
            changes[f.name] = tuple(x.strip() for x in raw.split(",") if x.strip())
        elif f.name == "ignore_index":
            changes[f.name] = parse_int(f.name, raw)
        elif f.name in ("fp8_multiple", "dump_max"):
            changes[f.name] = None if raw.lower() in ("", "none") else parse_int(f.name, raw)
        elif f.name in ("fp8", "dump_pixels", "dump_features"):
            changes[f.name] = parse_bool(f.name, raw, allow_none=f.name == "fp8")
        elif f.name in ("log_dir", "dump_dir"):
            changes[f.name] = raw or None  # set but empty: off
        else:
            changes[f.name] = raw
    return changes


def _checked(env: Mapping[str, str], build, changes: dict[str, object]):
    """``build(changes)``; a MediaInputError it raises names the variables it came from."""
    try:
        return build(changes)
    except MediaInputError as err:
        if not changes:
            raise
        names = ", ".join(
            f"MEDIA_GUARD_{k.upper()}={env[f'MEDIA_GUARD_{k.upper()}']!r}" for k in changes
        )
        raise err.with_context(f"from the environment ({names}): ") from None


_dataclass_init = GuardConfig.__init__


@functools.wraps(_dataclass_init)
def _init_with_env(
    self: GuardConfig, *args: object, environ: Mapping[str, str] | None = None, **kwargs: object
) -> None:
    """``GuardConfig(...)``: each field not given takes its ``MEDIA_GUARD_<FIELD>`` variable
    when set, else its default (an argument wins over the environment, which wins over the
    default). ``environ``: the variables to read (default ``os.environ``; ``{}``: none)."""
    env = os.environ if environ is None else environ
    given = {f.name for f in fields(GuardConfig)[: len(args)]} | set(kwargs)
    changes = _parse_or_name(env, given)
    _checked(env, lambda ch: _dataclass_init(self, *args, **kwargs, **ch), changes)


def _parse_or_name(env: Mapping[str, str], given: Collection[str]) -> dict[str, object]:
    try:
        return _env_changes(env, given)
    except MediaInputError as err:
        raise err.with_context("GuardConfig from the environment: ") from None


GuardConfig.__init__ = _init_with_env  # type: ignore[method-assign]


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise MediaInputError(f"GuardConfig.{name} must be one of {list(allowed)}, got {value!r}")


def parse_bool(name: str, raw: str, *, allow_none: bool = False) -> bool | None:
    """``MEDIA_GUARD_<NAME>`` as a boolean (1/true/yes/on, 0/false/no/off); with ``allow_none``,
    ''/none/auto give None. Anything else is an error naming the variable."""
    val = {"1": True, "true": True, "yes": True, "on": True}.get(raw.strip().lower())
    if val is None:
        val = {"0": False, "false": False, "no": False, "off": False}.get(raw.strip().lower())
    if val is None and not (allow_none and raw.lower() in ("", "none", "auto")):
        raise MediaInputError(f"MEDIA_GUARD_{name.upper()} must be true/false, got {raw!r}")
    return val


def parse_int(name: str, raw: str) -> int:
    """``MEDIA_GUARD_<NAME>`` as an integer; an error naming the variable otherwise."""
    try:
        return int(raw)
    except ValueError:
        raise MediaInputError(
            f"MEDIA_GUARD_{name.upper()} must be an integer, got {raw!r}"
        ) from None
