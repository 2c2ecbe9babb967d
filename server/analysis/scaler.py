"""Diverging GradScaler: a collapsed scale, streaks of skipped steps, too many skips, a
scale that keeps falling. A healthy scaler (a few skips while it calibrates, one halving
per growth interval) raises nothing."""

from __future__ import annotations

import numpy as np

from ampwatch.server.analysis.causes import Cause
from ampwatch.server.analysis.context import RunContext, compute_dtype, scale_column
from ampwatch.server.analysis.draft import Detection, FindingDraft, recent_steps
from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.analysis.localize import (
    Localization,
    diverged_before,
    dtype_word,
    explain,
    fix_for_cause,
)
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.analysis.window import Window
from ampwatch.server.store.series import StepSeries

KIND = FindingKind.SCALER_DIVERGENCE


def true_runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start positions and lengths of the runs of True in a 1-D bool array."""
    padded = np.concatenate(([False], mask, [False])).astype(np.int8)
    edges = np.diff(padded)
    starts = np.flatnonzero(edges == 1)
    return starts, np.flatnonzero(edges == -1) - starts


def rolling_sum(values: np.ndarray, window: int) -> np.ndarray:
    """Sum of the last `window` entries (fewer at the start) at every position."""
    total = np.concatenate(([0], np.cumsum(values)))
    upper = np.arange(1, values.size + 1)
    return total[upper] - total[np.maximum(upper - window, 0)]


def calibration_mask(series: StepSeries, run: RunContext, settings: AnalysisSettings) -> np.ndarray:
    """Per step, whether it belongs to the scaler's initial calibration: from the rank's
    first step until the first run of `calibration_clean_steps` unskipped steps, and
    never beyond `calibration_max_steps`."""
    steps = series.steps
    start = run.first_step if run.first_step is not None else (int(steps[0]) if len(steps) else 0)
    limit = start + settings.calibration_max_steps
    early = (steps >= start) & (steps < limit)
    if not early.any():
        return early
    clean = early & ~series.skipped
    starts, lengths = true_runs(clean)
    settled = starts[lengths >= settings.calibration_clean_steps]
    end = int(steps[settled[0]]) if settled.size else limit
    return early & (steps < end)


def _episode(series: StepSeries, rows: np.ndarray) -> tuple[int, int]:
    steps = series.steps
    return int(steps[rows[0]]), int(steps[rows[-1]])


def _draft(check: str, severity: str, message: str, series: StepSeries, rows: np.ndarray,
           occurrence_rows: np.ndarray, active: bool, why: dict, evidence: dict,
           settings: AnalysisSettings) -> FindingDraft:
    first, last = _episode(series, rows)
    occurrences = series.steps[occurrence_rows]
    return FindingDraft(
        kind=KIND, key=f"{KIND}:{check}", severity=severity,  # type: ignore[arg-type]
        message=message, step=first, last_step=last, layer=why["layer"],
        evidence={"check": check, **why, **evidence,
                  "steps": recent_steps(occurrences, settings.evidence_steps)},
        occurrences=occurrences, active=active,
    )


def _fix(why: dict) -> str:
    return fix_for_cause(why["cause"], why["layer"], why["dtype"])


def _why(series: StepSeries, loc: Localization, run: RunContext, rows: np.ndarray,
         settings: AnalysisSettings) -> dict:
    """What made the steps at `rows` go wrong (`explain`), in the run's dtype; divergence
    when the gradients ran away before the window's first non-finite step."""
    dtype = compute_dtype(series, run)
    why = {**explain(loc, rows, run), "dtype": dtype}
    first = np.flatnonzero(loc.nonfinite)
    if first.size and not loc.input_nonfinite[first[0]] \
            and diverged_before(series, int(first[0]), dtype, settings) is not None:
        why.update(cause=Cause.DIVERGENCE, layer=None)
    return why


def _collapse(series, loc, run, settings) -> FindingDraft | None:
    scale = scale_column(series)
    low = np.isfinite(scale) & (scale <= settings.scale_critical)
    if not low.any():
        return None
    rows = np.flatnonzero(low)
    why = _why(series, loc, run, np.flatnonzero(series.skipped[: rows[-1] + 1]), settings)
    lowest = float(np.nanmin(scale[rows]))
    message = (f"The loss scale fell to {settings.scale_critical:g} or below at step "
               f"{int(series.steps[rows[0]])} (lowest {lowest:g}): "
               f"{dtype_word(why['dtype'])} can no longer hold the gradients; {_fix(why)}.")
    return _draft("scale_collapse", "critical", message, series, rows, rows, bool(low[-1]),
                  why, {"loss_scale": lowest}, settings)


def streak_rows(series: StepSeries, calibrating: np.ndarray,
                settings: AnalysisSettings) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of the skip streaks long enough to report, with their starts and lengths."""
    starts, lengths = true_runs(series.skipped & ~calibrating)
    long = lengths >= settings.skip_streak_warning
    starts, lengths = starts[long], lengths[long]
    rows = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)]
                          or [np.zeros(0, dtype=np.int64)])
    return rows, starts, lengths


def _streak(series, loc, run, settings, calibrating) -> FindingDraft | None:
    rows, starts, lengths = streak_rows(series, calibrating, settings)
    if not rows.size:
        return None
    longest = int(lengths.max())
    ongoing = bool(starts[-1] + lengths[-1] == len(series))
    severity = "critical" if longest >= settings.skip_streak_critical else "warning"
    why = _why(series, loc, run, rows, settings)
    first, last = _episode(series, rows)
    message = (f"GradScaler skipped {longest} consecutive steps (steps {first}-{last}), "
               f"so the model is not training; {_fix(why)}.")
    return _draft("skip_streak", severity, message, series, rows, rows, ongoing, why,
                  {"longest_streak": longest,
                   "current_streak": int(lengths[-1]) if ongoing else 0}, settings)


def _skip_ratio(series, loc, run, settings, uncounted) -> FindingDraft | None:
    skipped = series.skipped & ~uncounted
    window = settings.skip_ratio_window
    n_skipped = rolling_sum(skipped.astype(np.int64), window)
    # a very short growth interval skips often by design: judge it against twice that rate
    threshold = max(settings.skip_ratio_warning, 2.0 / (run.growth_interval + 1))
    # a young run is judged as if its missing history were clean
    high = n_skipped > threshold * window
    if not high.any():
        return None
    rows = np.flatnonzero(high)
    span = np.arange(max(rows[0] - window + 1, 0), rows[-1] + 1)
    occurrence_rows = span[skipped[span]]
    most = int(n_skipped[rows].max())
    share = most / window
    why = _why(series, loc, run, occurrence_rows, settings)
    message = (f"{most} of the last {window} steps ({share:.0%}, more than {threshold:.0%}) "
               f"were skipped outside any long streak, so training is wasting steps; "
               f"{_fix(why)}.")
    return _draft("skip_ratio", "warning", message, series, rows, occurrence_rows,
                  bool(high[-1]), why,
                  {"skipped": most, "window": window, "share": round(share, 4)}, settings)


def _decline(series, loc, run, settings, uncounted) -> FindingDraft | None:
    before = series.column("loss_scale")
    after = series.column("scale_after")
    # without scale_after, the next step's scale is what this step's update() set
    after = np.where(np.isnan(after), np.append(before[1:], np.nan), after)
    counted = ~uncounted & np.isfinite(before) & np.isfinite(after)
    halved = counted & (after < before)
    grown = counted & (after > before)
    net = rolling_sum(halved.astype(np.int64) - grown.astype(np.int64), settings.decline_window)
    falling = net >= settings.decline_halvings
    if not falling.any():
        return None
    rows = np.flatnonzero(falling)
    span = np.arange(max(rows[0] - settings.decline_window + 1, 0), rows[-1] + 1)
    occurrence_rows = span[halved[span]]
    worst_net = int(net[rows].max())
    why = _why(series, loc, run, occurrence_rows, settings)
    fix = (_fix(why) if why["cause"] else
           "growing gradients push it down: lower the learning rate or lengthen warmup, "
           "and clip gradients after scaler.unscale_()")
    message = (f"The loss scale is in steady decline: {worst_net} more halvings than "
               f"doublings within {settings.decline_window} steps; {fix}.")
    return _draft("scale_decline", "warning", message, series, rows, occurrence_rows,
                  bool(falling[-1]), why,
                  {"net_halvings": worst_net, "window": settings.decline_window,
                   "loss_scale": float(before[np.isfinite(before)][-1])}, settings)


def _trailing_skips(series: StepSeries) -> np.ndarray:
    """Rows of the run of skipped steps the window ends on (none when its last step was
    applied)."""
    applied = np.flatnonzero(~series.skipped)
    return np.arange(applied[-1] + 1 if applied.size else 0, len(series))


def detect_scaler_divergence(window: Window, settings: AnalysisSettings) -> Detection:
    """The four scaler checks over the window. The slow ones (skip share, decline) stay
    quiet while a collapse or a streak is active and ignore the skips of reported streaks
    and of the run of skips the window ends on: they would repeat a streak's story."""
    series, run = window.series, window.run
    covers = (f"{KIND}:",)
    if not len(series) or not series.has("loss_scale").any():
        return Detection(covers=covers)
    loc = window.loc
    calibrating = calibration_mask(series, run, settings)
    fast = [d for d in (_collapse(series, loc, run, settings),
                        _streak(series, loc, run, settings, calibrating)) if d]
    drafts = list(fast)
    if not any(d.active for d in fast):
        # skips inside reported streaks are that finding's story, not a slow trend; so
        # are the skips the window ends on: a streak in the making, judged once it ended
        # or grew long enough to report (else the batch boundary decides the finding)
        uncounted = calibrating.copy()
        uncounted[streak_rows(series, calibrating, settings)[0]] = True
        uncounted[_trailing_skips(series)] = True
        drafts += [d for d in (_skip_ratio(series, loc, run, settings, uncounted),
                               _decline(series, loc, run, settings, uncounted)) if d]
    return Detection(drafts=drafts, covers=covers)
