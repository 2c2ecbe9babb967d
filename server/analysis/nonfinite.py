"""Non-finite localisation: for steps with inf/NaN, the first layer in forward order whose
output went non-finite, the layers whose grads did, and whether the loss or input did.

One finding per (cause, offending layer), so a layer that overflows on every step is one
finding whose count grows, not one finding per step.
"""

from __future__ import annotations

import numpy as np

from ampwatch.server.analysis.context import RunContext
from ampwatch.server.analysis.draft import Detection, FindingDraft, recent_steps
from ampwatch.server.analysis.localize import (
    CAUSES,
    FORWARD,
    GRAD,
    INPUT,
    LOSS,
    NO_LAYER,
    Localization,
    fix_for_cause,
    localize,
)
from ampwatch.server.analysis.scaler import calibration_mask
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.series import StepSeries

KIND = "nonfinite"
MAX_LAYERS_LISTED = 20


def _what(cause: int, layer: str | None) -> str:
    if cause == FORWARD:
        return f"layer {layer!r} is the first in forward order whose output is inf/NaN"
    if cause == GRAD:
        return f"layer {layer!r} is the first whose gradients went inf/NaN"
    if cause == LOSS:
        return "the loss is inf/NaN while every sampled layer output is finite"
    if cause == INPUT:
        return "the input batch holds inf/NaN"
    return "the total gradient norm is inf/NaN (no per-layer detail was recorded)"


def _grad_layers(loc: Localization, rows: np.ndarray, run: RunContext,
                 position: np.ndarray) -> list[str]:
    if loc.grad_bad is None:
        return []
    bad = np.flatnonzero(loc.grad_bad[rows].any(axis=0))
    ordered = bad[np.argsort(position[bad])][:MAX_LAYERS_LISTED]
    return [run.layer_name(int(i)) for i in ordered]


def detect_nonfinite(series: StepSeries, run: RunContext, settings: AnalysisSettings,
                     loc: Localization | None = None) -> Detection:
    """Group the window's non-finite steps by cause and offender.

    Gradient overflows that the GradScaler skipped during its initial calibration are
    how it finds its scale, not findings. Severity: critical when a non-finite step was
    not skipped (inf/NaN reached the weights), warning for forward/loss/input causes,
    info for gradient overflows the scaler skipped.
    """
    covers = (f"{KIND}:",)
    if not len(series):
        return Detection(covers=covers)
    loc = loc or localize(series, run)
    skipped = series.skipped
    benign = (loc.cause >= GRAD) & skipped & calibration_mask(series, run, settings)
    rows = np.flatnonzero(loc.nonfinite & ~benign)
    if not rows.size:
        return Detection(covers=covers)

    layer = np.where(loc.cause[rows] == FORWARD, loc.forward_layer[rows],
                     np.where(loc.cause[rows] == GRAD, loc.grad_layer[rows], NO_LAYER))
    group = loc.cause[rows] * (series.n_layers + 1) + (layer + 1)
    position = run.forward_position(series.n_layers)
    last_step = int(series.steps[-1])
    drafts = []
    for g in np.unique(group):
        g_rows = rows[group == g]
        cause, layer_index = divmod(int(g), series.n_layers + 1)
        layer_index -= 1
        name = None if layer_index == NO_LAYER else run.layer_name(layer_index)
        steps = series.steps[g_rows]
        reached_weights = ~skipped[g_rows]
        if reached_weights.any():
            severity = "critical"
        elif cause in (FORWARD, LOSS, INPUT):
            severity = "warning"
        else:
            severity = "info"
        fix = fix_for_cause(CAUSES[cause], name)
        if severity == "info":
            fix = (f"GradScaler skipped these steps, which is harmless when rare; if they "
                   f"recur, {fix}")
        elif severity == "critical":
            fix = f"inf/NaN reached the weights (the step was not skipped); {fix}"
        first_forward = loc.forward_layer[g_rows]
        first_forward = first_forward[first_forward != NO_LAYER]
        drafts.append(FindingDraft(
            kind=KIND,
            key=f"{KIND}:{CAUSES[cause]}:{name or '-'}",
            severity=severity,
            message=(f"Step {int(steps[0])}: {_what(cause, name)} ({steps.size} "
                     f"step{'s' if steps.size > 1 else ''} in the last {len(series)}); {fix}."),
            step=int(steps[0]),
            last_step=int(steps[-1]),
            layer=name,
            evidence={
                "cause": CAUSES[cause],
                "first_nonfinite_layer": (run.layer_name(int(first_forward[0]))
                                          if first_forward.size else None),
                "grad_nonfinite_layers": _grad_layers(loc, g_rows, run, position),
                "loss_nonfinite": bool(loc.loss_nonfinite[g_rows].any()),
                "input_nonfinite": bool(loc.input_nonfinite[g_rows].any()),
                "skipped_steps": int(skipped[g_rows].sum()),
                "steps": recent_steps(steps, settings.evidence_steps),
            },
            occurrences=steps,
            active=last_step - int(steps[-1]) < settings.nonfinite_resolve_steps,
        ))
    return Detection(drafts=drafts, covers=covers)
