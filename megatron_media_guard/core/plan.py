"""The plan: per sample and per item, what the guard does; a pure function of the ids
(through the report and the verdict), the items and the config, so ranks holding the same
micro-batch reach the same plan without communication."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from ..config import GuardConfig
from .alignment import AlignmentReport, Status
from .cache import kept
from .generated import Generated
from .items import MediaItem
from .verify import Verdict

Action = Literal["keep", "drop", "repair", "raise"]
#: how far each action goes: where several findings of one sample ask for different actions,
#: the sample takes the one that goes furthest (:func:`worst`)
SEVERITY: dict[str, int] = {"keep": 0, "repair": 1, "drop": 2, "raise": 3}


def worst(a: Action, b: Action) -> Action:
    """The action of ``a`` and ``b`` that goes further (keep < repair < drop < raise)."""
    return a if SEVERITY[a] >= SEVERITY[b] else b


def dropping_action(config: GuardConfig) -> Action:
    """What a sample no repair can fix takes: the policy, ``fallback`` under ``repair``."""
    return config.fallback if config.policy == "repair" else config.policy


#: statuses a re-projection can fix: one run per item, same modalities, only the media
#: size differs. Equal totals with different lengths (LENGTH_MISMATCH) look like swapped
#: items: resizing each to the other's run would train on the wrong image, so no.
REPAIRABLE = frozenset({Status.SURPLUS, Status.DEFICIT})


@dataclass(frozen=True)
class ItemRepair:
    """Re-project ``item`` (caller's index) of ``sample`` to ``target`` features."""

    item: int
    sample: int
    target: int
    run: int  # index of its run within the sample


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]  # per sample
    repairs: tuple[ItemRepair, ...]
    digest: int
    #: (sample, why) where the plan overrides what the status alone would do ("suspected swap")
    reasons: tuple[tuple[int, str], ...] = ()
    #: (sample, positions in its row) of placeholders the policy generated (core/generated.py)
    generated: tuple[tuple[int, tuple[int, ...]], ...] = ()

    # (membership and count first: most plans keep everything, and each call reads these)
    @property
    def dropped(self) -> tuple[int, ...]:
        if "drop" not in self.actions:
            return ()
        return tuple(i for i, a in enumerate(self.actions) if a == "drop")

    @property
    def fatal(self) -> tuple[int, ...]:
        if "raise" not in self.actions:
            return ()
        return tuple(i for i, a in enumerate(self.actions) if a == "raise")

    def with_actions(self, actions: Sequence[Action], repairs: Sequence[ItemRepair]) -> Plan:
        """The plan after repairs were attempted (failed ones fell back)."""
        new = digest(self.digest, actions, repairs)
        return Plan(tuple(actions), tuple(repairs), new, self.reasons, self.generated)


def digest(*parts: object) -> int:
    """A 63-bit digest of JSON-able parts (the same on every rank and platform)."""
    return _hash(_dumps(parts).encode())


def item_signature(items: Sequence[MediaItem]) -> list[tuple]:
    return [
        (it.num_features, it.sample, it.modality, it.num_frames, it.frame_hw, it.grid_thw)
        for it in items
    ]


_ENCODED: dict[tuple, str] = {}


def plan_digest_of(fingerprint: int, runs: int, items, knobs, actions, repairs) -> int:
    """``digest(fingerprint, runs, item_signature(items), knobs, actions, repairs)`` with the
    items' and knobs' JSON cached (a training run repeats them; most of the cost)."""
    sig = item_signature(items)
    try:
        key = (tuple(sig), tuple(knobs[:3]), tuple(knobs[3]))
        mid = kept(_ENCODED, 64, key, lambda: _dumps(sig) + ", " + _dumps(knobs))
    except TypeError:  # an unhashable field: encode every time
        mid = None
    if mid is None or not (type(fingerprint) is int and type(runs) is int):
        return digest(fingerprint, runs, sig, knobs, actions, repairs)
    acts = _ACTIONS.get(tuple(actions)) or _dumps(actions)  # most calls: every sample kept
    reps = _dumps(repairs) if repairs else "[]"
    return _hash(f"[{fingerprint}, {runs}, {mid}, {acts}, {reps}]".encode())


# the JSON of the all-keep actions of batches of up to 64 samples
_ACTIONS = {("keep",) * n: json.dumps(["keep"] * n) for n in range(65)}


def _dumps(part: object) -> str:
    return json.dumps(part, default=repr, sort_keys=True)


def _hash(blob: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little") >> 1


#: a cross-sample swap (A's item fed to B and B's to A) passes every total, and a re-projection
#: would resize each to the other's run: such samples take the fallback, never a repair
SWAP_REASON = "suspected swap"


def suspected_swaps(report: AlignmentReport, statuses: Collection[Status]) -> dict[int, str]:
    """Samples (with ``statuses``) whose mismatches exchanged items explain, and why: an
    item as long as another sample's mismatched run (same modality), or mismatched runs and
    items that agree as multisets over two or more samples."""
    pairs = [
        (rep.sample, exp, got, mod)
        for rep in report.mismatched
        if rep.status in statuses
        for exp, got, mod in zip(rep.expected, rep.got, rep.item_modalities)
        if exp != got
    ]
    out: dict[int, str] = {}
    for smp, _, got, mod in pairs:
        other = next((o for o, exp, _, m in pairs if o != smp and m == mod and exp == got), None)
        if other is not None:
            out[smp] = (
                f"{SWAP_REASON}: an item of sample {smp} has {got} features, the length of a "
                f"mismatched run of sample {other}"
            )
    samples = sorted({smp for smp, *_ in pairs})
    if len(samples) > 1:
        runs = Counter((exp, mod) for _, exp, _, mod in pairs)
        feats = Counter((got, mod) for _, _, got, mod in pairs)
        if runs == feats:
            for smp in samples:
                out.setdefault(
                    smp,
                    f"{SWAP_REASON}: the mismatched runs of samples {samples} and their items' "
                    "feature counts agree as multisets, paired differently",
                )
    return dict(sorted(out.items()))


def build_plan(
    num_samples: int,
    items: Sequence[MediaItem],
    verdict: Verdict,
    report: AlignmentReport | None,
    config: GuardConfig,
    nonfinite_samples: frozenset[int] = frozenset(),
    generated: Generated | None = None,
    call_faults: Sequence[str] = (),
) -> Plan:
    """Keep / repair / drop / raise for every sample (``report`` None: the aligned path).
    nonfinite_samples: samples with NaN/Inf features (``config.nonfinite``). Suspected swaps
    take ``config.fallback`` under ``repair`` (``Plan.reasons`` says why). generated: the
    policy's placeholders (``config.generated``). call_faults: findings about the whole call
    (``fault_checks``): every sample takes the policy."""
    actions: list[Action] = ["keep"] * num_samples
    repairs: list[ItemRepair] = []
    reasons: dict[int, str] = {}
    if report is not None:
        for rep in report.mismatched:
            repairable = rep.status in REPAIRABLE and rep.run_modalities == rep.item_modalities
            repair = config.policy == "repair" and repairable
            actions[rep.sample] = "repair" if repair else dropping_action(config)
            repairs += [
                ItemRepair(item=rep.items[k], sample=rep.sample, target=exp, run=k)
                for k, (exp, got) in enumerate(zip(rep.expected, rep.got))
                if exp != got
            ]
        if config.policy == "repair":
            # items exchanged between samples are never resized to each other's runs
            reasons = suspected_swaps(report, REPAIRABLE)
            for smp in reasons:
                actions[smp] = config.fallback
    if generated is not None and config.generated != "text":
        gen_act: Action = config.generated  # type: ignore[assignment]
        for smp, why in generated.reasons(gen_act).items():
            actions[smp] = worst(actions[smp], gen_act)
            reasons[smp] = "; ".join(filter(None, (why, reasons.get(smp))))
    for smp in nonfinite_samples:
        actions[smp] = worst(actions[smp], "raise" if config.nonfinite == "raise" else "drop")
    repairs = [r for r in repairs if actions[r.sample] == "repair"]
    knobs = [config.policy, config.fallback, config.nonfinite, list(config.allowed_fidelity)]
    plan_digest = plan_digest_of(
        verdict.fingerprint,
        verdict.runs,
        items,
        knobs,
        actions,
        [(r.item, r.target) for r in repairs],
    )
    gen = () if generated is None else tuple((g.sample, g.positions) for g in generated.samples)
    if gen:
        plan_digest = digest(plan_digest, config.generated, gen)
    if call_faults:
        actions = [worst(dropping_action(config), a) for a in actions]
        for smp in range(num_samples):
            reasons[smp] = "; ".join(filter(None, ("; ".join(call_faults), reasons.get(smp))))
        repairs = []
        plan_digest = digest(plan_digest, call_faults)
    return Plan(tuple(actions), tuple(repairs), plan_digest, tuple(reasons.items()), gen)
