"""Expected vs observed outcome of each smoke scenario x policy, and the table that shows them.

The expectation is computed from what the smoke injects (the scenario's micro-batch on the
fault rank at the fault step, the policy, the geometry's repair fidelity) and the topology;
the observation from what every rank reported and from the per-rank JSONL files (read with
``report.summarize``). Both are an :class:`Outcome`; any field that differs is a mismatch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from .scenarios import FAULT_SPECS, expected_actions, micro_batch, repair_attempts

RankSteps = tuple[tuple[int, int, tuple[int, ...]], ...]  # (rank, step, samples or items)


@dataclass(frozen=True)
class Outcome:
    """How one scenario x policy run ended, across all ranks.

    raised_step / culprit / steps_done: the distinct values over the ranks (one value when
    the ranks agree). drops / repairs: (rank, step, samples dropped / items repaired).
    events: (rank, event, count) in the per-rank JSONL files.
    """

    raised_ranks: tuple[int, ...]
    raised_step: tuple[int, ...]
    culprit: tuple[int, ...]
    names_culprit: bool
    steps_done: tuple[int, ...]
    drops: RankSteps
    repairs: RankSteps
    loss_finite: bool
    replicas_in_sync: bool
    events: tuple[tuple[int, str, int], ...]


def _events(by_rank: Mapping[int, Mapping[str, int]]) -> tuple[tuple[int, str, int], ...]:
    return tuple(
        sorted(
            (r, e, n) for r, per in by_rank.items() if r is not None for e, n in per.items() if n
        )
    )


def expected(
    scenario: str,
    policy: str,
    dp_of: Sequence[int],
    fault_rank: int,
    fault_step: int,
    steps: int,
    seed: int = 0,
) -> Outcome:
    """What must happen. dp_of: data-parallel rank of each global rank."""
    world = len(dp_of)
    group = tuple(r for r in range(world) if dp_of[r] == dp_of[fault_rank])
    mb = micro_batch(scenario, dp_of[fault_rank], fault_step, seed)
    faulty = mb.faulty_samples if fault_step < steps else ()
    events: dict[int, dict[str, int]] = {r: {} for r in range(world)}
    if faulty and FAULT_SPECS[scenario].fed_as_text:  # kept: one "check" record per sample
        for r in group:
            events[r]["check"] = len(faulty)
        faulty = ()
    if faulty and policy == "raise":
        for r in range(world):
            # a stage of one rank decides alone: no consensus record
            events[r] = {"consensus": int(world > 1), "step": fault_step}
            if r in group:
                events[r]["raise"] = len(faulty)
        return Outcome(
            raised_ranks=tuple(range(world)),
            raised_step=(fault_step,),
            culprit=(min(group),),
            names_culprit=True,
            steps_done=(fault_step,),
            drops=(),
            repairs=(),
            loss_finite=True,
            replicas_in_sync=True,
            events=_events(events),
        )
    for r in range(world):
        events[r]["step"] = steps
    drops: RankSteps = ()
    repairs: RankSteps = ()
    if faulty:
        acts = expected_actions(mb, policy)
        dropped = tuple(s for s in faulty if acts[s] == "drop")
        attempts = repair_attempts(mb) if policy == "repair" else ()
        fixed = tuple(sorted(a.item for a in attempts if acts[a.sample] == "repair"))
        if dropped:
            drops = tuple((r, fault_step, dropped) for r in group)
        if fixed:
            repairs = tuple((r, fault_step, fixed) for r in group)
        for r in group:
            events[r].update(drop=len(dropped), repair=len(attempts))
    return Outcome(
        raised_ranks=(),
        raised_step=(),
        culprit=(),
        names_culprit=False,
        steps_done=(steps,),
        drops=drops,
        repairs=repairs,
        loss_finite=True,
        replicas_in_sync=True,
        events=_events(events),
    )


def observed(observations: Sequence, by_rank: Mapping[int | None, Mapping[str, int]]) -> Outcome:
    """What happened: ``observations`` are the ranks' ``worker.Observation`` for one run;
    ``by_rank`` is ``report.summarize(run_dir).by_rank``."""
    raised = [o for o in observations if o.raised_step is not None]
    return Outcome(
        raised_ranks=tuple(sorted(o.rank for o in raised)),
        raised_step=tuple(sorted({o.raised_step for o in raised})),
        culprit=tuple(sorted({o.culprit for o in raised if o.culprit is not None})),
        names_culprit=bool(raised) and all(o.names_culprit for o in raised),
        steps_done=tuple(sorted({o.steps_done for o in observations})),
        drops=tuple(sorted((o.rank, s, tuple(x)) for o in observations for s, x in o.drops)),
        repairs=tuple(
            sorted((o.rank, s, tuple(sorted(x))) for o in observations for s, x in o.repairs)
        ),
        loss_finite=all(o.finite for o in observations),
        replicas_in_sync=all(o.in_sync for o in observations),
        events=_events({r: v for r, v in by_rank.items() if r is not None}),
    )


def mismatches(want: Outcome, got: Outcome) -> list[str]:
    """One line per field that differs."""
    return [
        f"{f.name}: expected {getattr(want, f.name)!r}, observed {getattr(got, f.name)!r}"
        for f in fields(Outcome)
        if getattr(want, f.name) != getattr(got, f.name)
    ]


def _ranks(rs: Sequence[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ",".join(map(str, rs))


def _by_step(entries: RankSteps) -> dict[tuple[int, tuple[int, ...]], list[int]]:
    out: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for r, s, x in entries:
        out.setdefault((s, x), []).append(r)
    return out


def describe(o: Outcome, world: int, steps: int) -> str:
    """A short phrase for the table (the same words for expected and observed)."""
    if o.raised_ranks:
        every = len(o.raised_ranks) == world > 1
        who = f"all {world}" if every else _ranks(o.raised_ranks)
        at = ",".join(map(str, o.raised_step))
        named = ",".join(map(str, o.culprit)) or "?"
        return f"{who} raised at step {at} naming rank {named}"
    parts = []
    for (s, x), rs in _by_step(o.drops).items():
        parts.append(f"{_ranks(rs)} dropped sample {','.join(map(str, x))} at step {s}")
    for (s, x), rs in _by_step(o.repairs).items():
        parts.append(f"{_ranks(rs)} repaired item {','.join(map(str, x))} at step {s}")
    fed = sorted({r for r, e, _ in o.events if e == "check"})
    if fed:  # the only check records the smoke writes: generated placeholders fed as text
        parts.append(f"{_ranks(fed)} fed generated placeholders as text")
    if not parts:
        parts.append("all aligned")
    done = ",".join(map(str, o.steps_done))
    parts.append(f"{done}/{steps} steps" + ("" if o.loss_finite else ", loss NOT finite"))
    return "; ".join(parts)


@dataclass(frozen=True)
class Row:
    scenario: str
    policy: str
    expected: str
    observed: str
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def table(rows: Sequence[Row]) -> str:
    """scenario x policy -> expected vs observed, with ok / MISMATCH."""
    head = ("scenario", "policy", "expected", "observed", "result")
    body = [
        (r.scenario, r.policy, r.expected, r.observed, "ok" if r.ok else "MISMATCH") for r in rows
    ]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
