"""The drop budget (docs/CONSENSUS.md): a silent flood of dropped samples becomes a named failure.

Checked at step end on counters :class:`~.consensus.StageConsensus` already summed over the
stage (each micro-batch once), so it adds no collective and every rank trips at the same step.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..diagnostics import DiagnosticsLog, GuardRecord, RankInfo
from ..errors import DropBudgetExceeded, MediaInputError

Trip = Literal["step", "window"]


@dataclass(frozen=True)
class BudgetStatus:
    """One step's budget check. Fractions are dropped / samples (None: no samples)."""

    step: int
    samples: int
    dropped: int
    fraction: float | None
    window_samples: int
    window_dropped: int
    window_fraction: float | None
    window_steps: int  # steps in the window so far (the window check needs it full)
    tripped: Trip | None


def _fraction(name: str, v: float | None) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
        raise MediaInputError(f"DropBudget.{name} must be a fraction in [0, 1] or None, got {v!r}")
    return float(v)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


class DropBudget:
    """Fails the run when too many samples are dropped.

    max_fraction_per_step: dropped / samples of one step above this trips (None: no limit).
    max_fraction_window: the same over the last ``window_steps`` steps, once that many were
        seen. A fraction equal to the limit passes. writers: returns TensorBoard-like
        (``add_scalar``) / W&B-like (``log``) writers (StageConsensus fills in Megatron-LM's).
    """

    def __init__(
        self,
        max_fraction_per_step: float | None = None,
        max_fraction_window: float | None = None,
        window_steps: int = 100,
        *,
        writers: Callable[[], Sequence[object]] | None = None,
    ) -> None:
        self.max_fraction_per_step = _fraction("max_fraction_per_step", max_fraction_per_step)
        self.max_fraction_window = _fraction("max_fraction_window", max_fraction_window)
        if isinstance(window_steps, bool) or not isinstance(window_steps, int) or window_steps < 1:
            raise MediaInputError(
                f"DropBudget.window_steps must be an int >= 1, got {window_steps!r}"
            )
        self.window_steps = window_steps
        self.writers = writers
        self._window: deque[tuple[int, int, int]] = deque(maxlen=window_steps)

    def reset(self) -> None:
        self._window.clear()

    def on_step_end(self, step: int, totals: Mapping[str, int], guard: Any = None) -> BudgetStatus:
        """Checks one step's stage-wide ``totals``; DropBudgetExceeded after a ``budget`` record."""
        samples, dropped = int(totals.get("samples", 0)), int(totals.get("dropped", 0))
        self._window.append((step, samples, dropped))
        w_samples = sum(s for _, s, _ in self._window)
        w_dropped = sum(d for _, _, d in self._window)
        frac = dropped / samples if samples else None
        w_frac = w_dropped / w_samples if w_samples else None
        full = len(self._window) == self.window_steps
        tripped: Trip | None = None
        lim = self.max_fraction_per_step
        if lim is not None and frac is not None and frac > lim:
            tripped = "step"
        lim_w = self.max_fraction_window
        if tripped is None and lim_w is not None and full and w_frac is not None and w_frac > lim_w:
            tripped = "window"
        status = BudgetStatus(
            step, samples, dropped, frac, w_samples, w_dropped, w_frac, len(self._window), tripped
        )
        self._log_scalars(step, totals, status)
        if tripped is not None:
            self._trip(status, guard)
        return status

    def _trip(self, s: BudgetStatus, guard: Any) -> None:
        if s.tripped == "step":
            dropped, samples, fraction = s.dropped, s.samples, s.fraction
            limit = self.max_fraction_per_step
            what = (
                f"{dropped} of {samples} samples dropped in this step ({_pct(fraction)}) "
                f"> max_fraction_per_step {_pct(limit)}"
            )
        else:
            dropped, samples, fraction = s.window_dropped, s.window_samples, s.window_fraction
            limit = self.max_fraction_window
            what = (
                f"{dropped} of {samples} samples dropped over the last {s.window_steps} steps "
                f"(steps {self._window[0][0]}..{s.step}, {_pct(fraction)}) > "
                f"max_fraction_window {_pct(limit)}"
            )
        msg = (
            f"Drop budget exceeded at step {s.step}: {what} (summed over the stage's "
            "data-parallel replicas). See the per-rank media_guard logs for the drop records."
        )
        context = {"step": s.step, "tripped": s.tripped, "fraction": fraction, "limit": limit}
        context |= {"dropped": dropped, "samples": samples, "window_steps": s.window_steps}
        log = getattr(guard, "log", None) or DiagnosticsLog(None, RankInfo.from_env())
        log.emit(
            GuardRecord(event="budget", step=s.step, action="raise", reason=msg, extra=context)
        )
        raise DropBudgetExceeded(msg, context=context)

    def _log_scalars(self, step: int, totals: Mapping[str, int], s: BudgetStatus) -> None:
        if self.writers is None:
            return
        counts = ("samples", "dropped", "mismatched", "repaired")
        scalars = {f"media_guard/{k}": float(totals.get(k, 0)) for k in counts}
        if s.fraction is not None:
            scalars["media_guard/drop_fraction"] = s.fraction
        if s.window_fraction is not None:
            scalars["media_guard/drop_fraction_window"] = s.window_fraction
        for w in self.writers():
            if hasattr(w, "add_scalar"):  # TensorBoard SummaryWriter
                for tag, v in scalars.items():
                    if math.isfinite(v):
                        w.add_scalar(tag, v, step)
            elif hasattr(w, "log"):  # wandb
                w.log(scalars, step=step)
