"""Guard configuration."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Literal

from .errors import MediaInputError

Policy = Literal["raise", "drop", "repair"]
Fallback = Literal["drop", "raise"]
NonFinite = Literal["raise", "drop", "off"]
FidelityName = Literal["engine-replay", "unique", "closest-aspect", "unreachable"]
KeepTower = Literal["always", "on_drop", "never"]

_POLICIES = ("raise", "drop", "repair")
_FALLBACKS = ("drop", "raise")
_NONFINITE = ("raise", "drop", "off")
_FIDELITIES = ("engine-replay", "unique", "closest-aspect")
_KEEP_TOWER = ("always", "on_drop", "never")


@dataclass(frozen=True)
class GuardConfig:
    """What the guard does when placeholders and features disagree.

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
    keep_tower: when a micro-batch feeds the vision tower nothing, the guard runs it on a
        minimal dummy input before the decoder (its output kept at a zero weight), so every
        data-parallel rank enters it and gives its parameters a gradient: ``"always"`` (also
        text-only micro-batches: what FSDP2 and DDP with ``find_unused_parameters=False``
        need), ``"on_drop"`` (only when all its media were dropped), ``"never"``. Adapters
        that run the tower themselves (Qwen-VL). See docs/PARALLEL.md.
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
    keep_tower: KeepTower = "always"

    def __post_init__(self) -> None:
        _one_of("policy", self.policy, _POLICIES)
        _one_of("fallback", self.fallback, _FALLBACKS)
        _one_of("nonfinite", self.nonfinite, _NONFINITE)
        _one_of("keep_tower", self.keep_tower, _KEEP_TOWER)
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

    def with_env(self, environ: dict[str, str] | None = None) -> GuardConfig:
        """Overrides from ``MEDIA_GUARD_<FIELD>`` environment variables (e.g. MEDIA_GUARD_POLICY=drop;
        MEDIA_GUARD_ALLOWED_FIDELITY=engine-replay,unique)."""
        env = os.environ if environ is None else environ
        changes: dict[str, object] = {}
        for f in fields(self):
            raw = env.get(f"MEDIA_GUARD_{f.name.upper()}")
            if raw is None:
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
        try:
            return replace(self, **changes)
        except MediaInputError as err:
            names = ", ".join(
                f"MEDIA_GUARD_{k.upper()}={env[f'MEDIA_GUARD_{k.upper()}']!r}" for k in changes
            )
            raise err.with_context(f"from the environment ({names}): ") from None


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
