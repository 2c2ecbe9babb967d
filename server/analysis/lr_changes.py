"""A learning-rate change as a finding of its own (`lr_change`, info), from the learning
rate the agent records each step (param group 0's).

A change is the recorded rate rising `spike_lr_jump` (3) times or more from one recorded
step to the next: a loop or a scheduler that set it, not a schedule's ramp (a linear
warmup rises at most 2x a step once it left 0, and a rise from 0 has no factor). A fall is
no finding: a smaller step cannot push training off course.

It is a note, not an alert: a deliberate change (a restart of a cosine schedule, a
resumed run's new rate) is healthy. It is where the story starts when something follows:
a loss spike labelled `lr_change` takes it into its card, and so do the weight growths
that began at it (server/findings/incident_folds.py). With neither it is still told, on
its own card: the run's rate moved, and the weights that it moved say so. Active while the
rate stays at or above `spike_lr_jump` times its value before the change.
"""

from __future__ import annotations

import numpy as np

from ampwatch.server.analysis.causes import Cause
from ampwatch.server.analysis.draft import Detection, FindingDraft
from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.analysis.window import Window

FIX = ("if it was not meant, undo or soften the change (a smaller step, or a warmup to "
       "the new rate)")


def detect_lr_changes(window: Window, settings: AnalysisSettings) -> Detection:
    """An `lr_change` finding per step where the recorded learning rate rose
    `spike_lr_jump` times or more over the step recorded before it."""
    series = window.series
    lr = series.column("lr")
    known = np.isfinite(lr)
    steps, values = series.steps[known], lr[known]
    drafts = []
    for i in rises(values, settings.spike_lr_jump):
        before, after, step = float(values[i - 1]), float(values[i]), int(steps[i])
        factor = after / before
        message = (f"The learning rate rose {factor:.3g}x at step {step}, from {before:.3g} "
                   f"to {after:.3g}. Fix: {FIX}.")
        drafts.append(FindingDraft(
            kind=FindingKind.LR_CHANGE, code="lr_change", key=f"lr_change:{step}",
            severity="info", message=message, step=step, last_step=step,
            evidence={"cause": Cause.LR_CHANGE, "lr_before": before, "lr_after": after,
                      "lr_step": step, "lr_factor": factor, "fix": FIX},
            occurrences=np.array([step], dtype=np.int64),
            active=bool(values[-1] >= settings.spike_lr_jump * before)))
    return Detection(drafts)


def rises(values: np.ndarray, factor: float) -> np.ndarray:
    """Indices i >= 1 where values[i] is `factor` times values[i - 1] or more, the value
    before positive (a rise from 0 or below has no factor)."""
    if values.size < 2:
        return np.zeros(0, dtype=np.int64)
    before, after = values[:-1], values[1:]
    return np.flatnonzero((before > 0) & (after >= factor * before)) + 1
