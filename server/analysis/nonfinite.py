"""Non-finite localisation: for steps with inf/NaN, the first layer in forward order whose
output went non-finite, the layers whose grads did, and whether the loss or input did.

One finding per (cause, offending layer), so a layer that overflows on every step is one
finding whose count grows, not one finding per step. A forward overflow that a later op
absorbed (the loss and the gradients stayed finite and the step was applied) is a
finding of its own: the activations were silently clipped, the weights are intact.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ampwatch.server.analysis.causes import Cause
from ampwatch.server.analysis.context import RunContext, compute_dtype
from ampwatch.server.analysis.draft import Detection, FindingDraft, recent_steps
from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.analysis.localize import (
    CAUSES,
    FORWARD,
    GRAD,
    INPUT,
    LOSS,
    NO_LAYER,
    Localization,
    diverged_before,
    fix_for_cause,
)
from ampwatch.server.analysis.scaler import calibration_mask
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.analysis.window import Window

KIND = FindingKind.NONFINITE
MAX_LAYERS_LISTED = 20
ABSORBED = len(CAUSES)  # a group of its own: forward inf/NaN that never reached the grads
DIVERGED = ABSORBED + 1  # every non-finite step after the gradients ran away
GROUPS = (*CAUSES, Cause.ABSORBED_OVERFLOW, Cause.DIVERGENCE)


def _what(group: int, layer: str | None, observed: bool, divergence: dict | None) -> str:
    """What the data shows for the first step of a group (`observed`: the layer outputs
    of that step were checked; `divergence`: how the gradients ran away before it)."""
    outputs = ("every layer output was finite" if observed else
               "the layer outputs of that step were not observed")
    if group == DIVERGED and divergence is not None:
        return (f"the first inf/NaN, after the grad norm grew from about "
                f"{divergence['grad_norm_typical']:.3g} to {divergence['grad_norm_peak']:.3g} "
                "while no activation came near its dtype's maximum")
    if group == FORWARD:
        return f"layer {layer!r} is the first in forward order whose output is inf/NaN"
    if group == ABSORBED:
        return (f"layer {layer!r} produced inf/NaN in the forward pass, but the loss and "
                "the gradients stayed finite and the step was applied: a later op (a ReLU, "
                "a max or a mask) absorbed it, so those activations were silently clipped")
    if group == GRAD:
        return f"layer {layer!r} is the first whose gradients went inf/NaN ({outputs})"
    if group == LOSS:
        return f"the loss is inf/NaN while {outputs}"
    if group == INPUT:
        return "the input batch holds inf/NaN"
    return f"the total gradient norm is inf/NaN, no layer's own was recorded ({outputs})"


def _grad_layers(loc: Localization, rows: np.ndarray, run: RunContext,
                 position: np.ndarray) -> list[str]:
    if loc.grad_bad is None:
        return []
    bad = np.flatnonzero(loc.grad_bad[rows].any(axis=0))
    ordered = bad[np.argsort(position[bad])][:MAX_LAYERS_LISTED]
    return [run.layer_name(int(i)) for i in ordered]


def _severity(group: int, reached_weights: np.ndarray) -> str:
    if reached_weights.any():
        return "critical"
    if group in (FORWARD, LOSS, INPUT, ABSORBED, DIVERGED):
        return "warning"
    return "info"


def _first_forward_layer(loc: Localization, rows: np.ndarray, run: RunContext) -> str | None:
    """The first layer whose forward output went non-finite on the first of `rows` that
    has one."""
    first_forward = loc.forward_layer[rows]
    first_forward = first_forward[first_forward != NO_LAYER]
    return run.layer_name(int(first_forward[0])) if first_forward.size else None


def _group_fix(fix: str, severity: str, left_out: int, reached_steps: np.ndarray) -> str:
    """A group's fix, after what became of its steps: left out by the guard, skipped by
    the scaler, or applied (`reached_steps`: those applied with inf/NaN gradients)."""
    if left_out:
        return (f"the ampwatch guard left out {left_out} of these steps, so their inf/NaN "
                f"never reached the weights or the optimizer state; {fix}")
    if severity == "info":
        return (f"GradScaler skipped these steps, which is harmless when rare; if they "
                f"recur, {fix}")
    if severity == "critical":
        return (f"step {int(reached_steps[0])} was applied with inf/NaN gradients, so they "
                f"reached the weights and the optimizer state; {fix}")
    return fix


def _group_evidence(window: Window, g_rows: np.ndarray, reached: np.ndarray,
                    position: Any) -> dict[str, Any]:
    """What a group's steps show: where the inf/NaN was, and what it reached."""
    series, run, loc = window.series, window.run, window.loc
    applied = g_rows[reached[g_rows]]
    return {
        "first_nonfinite_layer": _first_forward_layer(loc, g_rows, run),
        "grad_nonfinite_layers": _grad_layers(loc, g_rows, run, position),
        "loss_nonfinite": bool(loc.loss_nonfinite[g_rows].any()),
        "input_nonfinite": bool(loc.input_nonfinite[g_rows].any()),
        "forward_observed": bool(loc.forward_observed[g_rows].all()),
        "skipped_steps": int(series.skipped[g_rows].sum()),
        "applied_nonfinite_steps": int(applied.size),
        # from the step after it every weight the update touched is inf/NaN
        "first_applied_step": int(series.steps[applied][0]) if applied.size else None,
    }


def detect_nonfinite(window: Window, settings: AnalysisSettings) -> Detection:
    """Group the window's non-finite steps by cause and offender.

    Gradient overflows that the GradScaler skipped during its initial calibration are
    how it finds its scale, not findings. Severity follows cost: critical when the step
    was applied with non-finite gradients (inf/NaN reached the weights and the optimizer
    state); warning when a step was lost to a forward, loss or input fault, or a forward
    overflow was absorbed; info for gradient overflows the scaler skipped.
    """
    series, run = window.series, window.run
    covers = (f"{KIND}:",)
    if not len(series):
        return Detection(covers=covers)
    loc = window.loc
    skipped = series.skipped
    # a step the agent's step guard left out is never a scaler calibrating
    benign = ((loc.cause >= GRAD) & skipped & calibration_mask(series, run, settings)
              & (series.guarded == 0))
    rows = np.flatnonzero(loc.nonfinite & ~benign)
    if not rows.size:
        return Detection(covers=covers)

    reached = ~skipped & loc.grad_nonfinite
    guarded = series.guarded
    grads_known = series.has("grad_norm")
    absorbed = ((loc.cause == FORWARD) & ~skipped & ~loc.grad_nonfinite & grads_known
                & ~loc.loss_nonfinite)
    groups = np.where(absorbed, ABSORBED, loc.cause)
    dtype = compute_dtype(series, run)
    # gradients that ran away before the first inf/NaN explain every later one (but a
    # bad input batch): one divergence, not an overflow per layer it reached
    divergence = diverged_before(series, int(rows[0]), dtype, settings)
    if divergence is not None:
        groups[rows[groups[rows] != INPUT]] = DIVERGED
    layer = np.where(np.isin(groups[rows], (FORWARD, ABSORBED)), loc.forward_layer[rows],
                     np.where(groups[rows] == GRAD, loc.grad_layer[rows], NO_LAYER))
    key = groups[rows] * (series.n_layers + 1) + (layer + 1)
    position = run.forward_position(series.n_layers)
    last_step = int(series.steps[-1])
    drafts = []
    for k in np.unique(key):
        g_rows = rows[key == k]
        group, layer_index = divmod(int(k), series.n_layers + 1)
        layer_index -= 1
        name = None if layer_index == NO_LAYER else run.layer_name(layer_index)
        steps = series.steps[g_rows]
        severity = _severity(group, reached[g_rows])
        left_out = int((guarded[g_rows] > 0).sum())
        fix = _group_fix(fix_for_cause(GROUPS[group], name, dtype), severity, left_out,
                         series.steps[g_rows[reached[g_rows]]])
        drafts.append(FindingDraft(
            kind=KIND,
            key=f"{KIND}:{GROUPS[group]}:{name or '-'}",
            severity=severity,
            message=(f"Step {int(steps[0])}: "
                     f"{_what(group, name, bool(loc.forward_observed[g_rows[0]]), divergence)} "
                     f"({steps.size} step{'s' if steps.size > 1 else ''} in the last "
                     f"{len(series)}); {fix}."),
            step=int(steps[0]),
            last_step=int(steps[-1]),
            layer=name,
            evidence={
                "cause": GROUPS[group], "dtype": dtype,
                **(divergence if group == DIVERGED and divergence else {}),
                **_group_evidence(window, g_rows, reached, position),
                "guarded_steps": left_out,
                "steps": recent_steps(steps, settings.evidence_steps),
            },
            occurrences=steps,
            active=last_step - int(steps[-1]) < settings.nonfinite_resolve_steps,
        ))
    return Detection(drafts=drafts, covers=covers)
