"""fp16 range risks per layer: forward outputs close to fp16's maximum (overflow next),
and scaled gradients below fp16's normal range (flushed to zero)."""

from __future__ import annotations

import numpy as np

from ampwatch.server.analysis.context import FP16, RunContext, is_fp16_run
from ampwatch.server.analysis.draft import Detection, FindingDraft, recent_steps
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.series import MISSING, StepSeries


def _layer_keys(run: RunContext, kind: str) -> np.ndarray:
    """`kind:name` per layer index of the table, made once per table (covers list
    every evaluated layer on every batch)."""
    return run.table.derived(f"{kind}_keys", lambda table: np.array(
        [f"{kind}:{name}" for name in table.names], dtype=object))


def _recent(steps: np.ndarray, last_step: int, settings: AnalysisSettings) -> np.ndarray:
    return steps > last_step - settings.risk_window


def detect_overflow_risk(series: StepSeries, run: RunContext,
                         settings: AnalysisSettings) -> Detection:
    """Layers whose fp16 forward output abs-max came within `overflow_factor` of 65504.

    Judged on the activation samples; a layer is covered (and resolved) once a sample
    within the last `risk_window` steps shows it back in range.
    """
    absmax = series.act_absmax
    if absmax is None or not len(series.act_step) or not len(series):
        return Detection()
    if series.act_dtype is not None:
        fp16 = series.act_dtype == FP16
    else:
        fp16 = np.full(absmax.shape, is_fp16_run(series, run))
    sampled = fp16 & (absmax != MISSING) & np.isfinite(absmax)
    limit = settings.fp16_max / settings.overflow_factor
    near = sampled & (absmax >= limit)
    recent = _recent(series.act_step, int(series.steps[-1]), settings)
    evaluated = np.flatnonzero((sampled & recent[:, None]).any(axis=0))
    drafts = []
    for layer in np.flatnonzero(near.any(axis=0)):
        hits = near[:, layer]
        steps = series.act_step[hits]
        peak = float(absmax[hits, layer].max())
        name = run.layer_name(int(layer))
        drafts.append(FindingDraft(
            kind="overflow_risk", key=f"overflow_risk:{name}", severity="warning",
            message=(f"Layer {name!r} produced fp16 outputs up to {peak:.4g}, within "
                     f"{settings.overflow_factor:g}x of fp16's maximum {settings.fp16_max:g} "
                     f"(step {int(steps[0])}): normalise or scale down what feeds it, run it "
                     "in fp32 (torch.autocast(device_type, enabled=False)), or train in bf16."),
            step=int(steps[0]), last_step=int(steps[-1]), layer=name,
            evidence={"absmax": peak, "limit": settings.fp16_max,
                      "headroom": settings.fp16_max / peak,
                      "steps": recent_steps(steps, settings.evidence_steps)},
            occurrences=steps, active=bool((hits & recent).any()),
        ))
    flagged = {d.key for d in drafts if d.active}
    keys = _layer_keys(run, "overflow_risk")
    covers = tuple(keys[evaluated[evaluated < keys.size]])
    if flagged:
        covers = tuple(k for k in covers if k not in flagged)
    return Detection(drafts=drafts, covers=covers)


def detect_underflow_risk(series: StepSeries, run: RunContext,
                          settings: AnalysisSettings) -> Detection:
    """fp16 runs: layers whose scaled gradients sit below fp16's normal range.

    A layer's typical scaled gradient element is estimated as
    loss_scale * grad_norm / sqrt(param_count) (the RMS of its scaled grads); it is
    flagged when that sits below `fp16_min_normal` on more than `underflow_share` of
    the last `risk_window` steps. Skipped and non-finite steps are left out.
    """
    grads = series.layer_grad
    if grads is None or not len(series) or not is_fp16_run(series, run):
        return Detection()
    n_layers = series.n_layers
    params = run.param_counts(n_layers)
    scale = series.column("loss_scale")
    scale = np.where(np.isfinite(scale) & (scale > 0), scale, 1.0)
    recent = _recent(series.steps, int(series.steps[-1]), settings) & ~series.skipped
    window = grads[recent]
    # > 0 leaves out MISSING (-1), NaN and -inf; < inf leaves out +inf
    valid = (window > 0) & (window < np.inf) & (params > 0)
    rms = window * scale[recent, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        rms /= np.sqrt(params)  # in place: one (steps x layers) float64 temporary, not two
    low = valid & (rms < settings.fp16_min_normal)
    n_valid = valid.sum(axis=0)
    share = np.divide(low.sum(axis=0), n_valid, out=np.zeros(n_layers), where=n_valid > 0)
    evaluated = n_valid > 0
    flagged = evaluated & (share > settings.underflow_share)
    steps = series.steps[recent]
    no_scaler = not series.has("loss_scale").any()
    fix = ("use torch.amp.GradScaler with fp16" if no_scaler else
           "find what keeps the loss scale low (see the scaler findings), raise init_scale, "
           "or train in bf16, whose range needs no scaling")
    drafts = []
    for layer in np.flatnonzero(flagged):
        name = run.layer_name(int(layer))
        low_steps = steps[low[:, layer]]
        typical = float(np.median(rms[valid[:, layer], layer]))
        drafts.append(FindingDraft(
            kind="underflow_risk", key=f"underflow_risk:{name}", severity="warning",
            message=(f"Layer {name!r}: its scaled gradients (about {typical:.2g} per element) "
                     f"sit below fp16's normal range {settings.fp16_min_normal:.2g} on "
                     f"{share[layer]:.0%} of recent steps, so they are flushed to zero; {fix}."),
            step=int(low_steps[0]), last_step=int(low_steps[-1]), layer=name,
            evidence={"scaled_grad_rms": typical, "min_normal": settings.fp16_min_normal,
                      "share": round(float(share[layer]), 4),
                      "param_count": int(params[layer]),
                      "steps": recent_steps(low_steps, settings.evidence_steps)},
            occurrences=low_steps,
        ))
    keys = _layer_keys(run, "underflow_risk")
    unflagged = np.flatnonzero(evaluated & ~flagged)
    covers = tuple(keys[unflagged[unflagged < keys.size]])
    return Detection(drafts=drafts, covers=covers)

