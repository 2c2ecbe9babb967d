"""fp16 range risks per layer: forward outputs close to fp16's maximum (overflow next),
and gradients flushed to zero (underflow, measured as the share of exactly-zero grad
elements)."""

from __future__ import annotations

import numpy as np

from ampwatch.server.analysis.context import FP16, RunContext, is_fp16_run
from ampwatch.server.analysis.draft import Detection, FindingDraft, recent_steps
from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.analysis.window import Window
from ampwatch.server.store.series import MISSING, StepSeries

OVERFLOW, UNDERFLOW = FindingKind.OVERFLOW_RISK, FindingKind.UNDERFLOW_RISK


def _layer_keys(run: RunContext, kind: str) -> np.ndarray:
    """`kind:name` per layer index of the table, made once per table (covers list
    every evaluated layer on every batch)."""
    return run.table.derived(f"{kind}_keys", lambda table: np.array(
        [f"{kind}:{name}" for name in table.names], dtype=object))


def _recent(steps: np.ndarray, last_step: int, settings: AnalysisSettings) -> np.ndarray:
    return steps > last_step - settings.risk_window


def detect_overflow_risk(window: Window, settings: AnalysisSettings) -> Detection:
    """Layers whose fp16 forward output abs-max came within `overflow_factor` of 65504.

    Judged on the activation samples; a layer is covered (and resolved) once a sample
    within the last `risk_window` steps shows it back in range.
    """
    series, run = window.series, window.run
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
            kind=OVERFLOW, key=f"{OVERFLOW}:{name}", severity="warning",
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
    keys = _layer_keys(run, OVERFLOW)
    covers = tuple(keys[evaluated[evaluated < keys.size]])
    if flagged:
        covers = tuple(k for k in covers if k not in flagged)
    return Detection(drafts=drafts, covers=covers)


def detect_underflow_risk(window: Window, settings: AnalysisSettings) -> Detection:
    """fp16 runs: layers whose gradients are mostly exactly zero, measured.

    The agent counts each layer's exactly-zero grad elements on sampled steps; a layer is
    flagged when `underflow_zero_share` or more of its grad elements were zero on more
    than `underflow_share` of the last `risk_window` steps that measured it. Embedding
    lookups are left out (rows not looked up have zero grads by design), and so are
    skipped steps. Costs O(samples x layers).
    """
    series, run = window.series, window.run
    zeros = series.act_grad_zero
    if zeros is None or not len(series.act_step) or not is_fp16_run(series, run):
        return Detection()
    n_layers = series.n_layers
    lookups = run.table.mask(lambda x: "Embedding" in x.type and not x.attrs.get("tied_to"),
                             n_layers)
    recent = _recent(series.act_step, int(series.steps[-1]), settings)
    skipped_steps = series.steps[series.skipped]
    recent &= ~np.isin(series.act_step, skipped_steps)
    measured = zeros[recent]
    valid = (measured != MISSING) & np.isfinite(measured) & ~lookups
    low = valid & (measured >= settings.underflow_zero_share)
    n_valid = valid.sum(axis=0)
    share = np.divide(low.sum(axis=0), n_valid, out=np.zeros(n_layers), where=n_valid > 0)
    evaluated = n_valid > 0
    flagged = evaluated & (share > settings.underflow_share)
    steps = series.act_step[recent]
    no_scaler = not series.has("loss_scale").any()
    fix = ("use torch.amp.GradScaler with fp16" if no_scaler else
           "find what keeps the loss scale low (see the scaler findings), raise init_scale, "
           "or train in bf16, whose range needs no scaling")
    drafts = []
    counts = run.param_counts(n_layers)
    for layer in np.flatnonzero(flagged):
        name = run.layer_name(int(layer))
        low_steps = steps[low[:, layer]]
        typical = float(np.median(measured[valid[:, layer], layer]))
        rms = _scaled_rms(series, low_steps, measured[low[:, layer], layer], int(layer),
                          int(counts[layer]))
        evidence = {"zero_share": round(typical, 4),
                    "threshold": settings.underflow_zero_share,
                    "share_of_steps": round(float(share[layer]), 4),
                    "scaled_rms": rms,
                    "steps": recent_steps(low_steps, settings.evidence_steps)}
        head = (f"Layer {name!r}: {typical:.0%} of its gradient elements are exactly zero "
                f"(median of the measured steps; {share[layer]:.0%} of them at or above "
                f"{settings.underflow_zero_share:.0%})")
        if rms is not None and rms >= settings.underflow_rms_floor:
            # values this far above fp16's smallest normal are not flushed: the zeros are
            # exact zeros the model made (saturated or dead activations, masked inputs)
            drafts.append(FindingDraft(
                kind=UNDERFLOW, key=f"{UNDERFLOW}:{name}", severity="info", code="model_zeros",
                message=(f"{head}, but not from fp16 underflow: its nonzero gradients, scaled, "
                         f"have an RMS of {rms:.3g}, far above fp16's smallest normal "
                         f"(6.1e-05), so fp32 or a larger loss scale would give the same "
                         "zeros; the model makes them (saturated or dead activations, masked "
                         "inputs). Nothing to change in the precision."),
                step=int(low_steps[0]), last_step=int(low_steps[-1]), layer=name,
                evidence=evidence, occurrences=low_steps))
            continue
        drafts.append(FindingDraft(
            kind=UNDERFLOW, key=f"{UNDERFLOW}:{name}", severity="warning",
            message=(f"{head}, the mark of fp16 underflow: small gradients are flushed to "
                     f"zero{_rms_words(rms)}; {fix}."),
            step=int(low_steps[0]), last_step=int(low_steps[-1]), layer=name,
            evidence=evidence, occurrences=low_steps,
        ))
    keys = _layer_keys(run, UNDERFLOW)
    unflagged = np.flatnonzero(evaluated & ~flagged)
    covers = tuple(keys[unflagged[unflagged < keys.size]])
    return Detection(drafts=drafts, covers=covers)


def _scaled_rms(series: StepSeries, steps: np.ndarray, zero_share: np.ndarray, layer: int,
                count: int) -> float | None:
    """The median over `steps` of the RMS of the layer's nonzero gradient elements as the
    backward computed them (scaled): its unscaled grad norm x the loss scale over the root
    of its nonzero element count. None when the norm, scale or count is unknown."""
    if series.layer_grad is None or count <= 0 or not steps.size:
        return None
    rows = np.searchsorted(series.steps, steps)
    rows = np.clip(rows, 0, len(series) - 1)
    keep = series.steps[rows] == steps
    norms = series.layer_grad[rows[keep], layer].astype(np.float64)
    scale = series.column("loss_scale")[rows[keep]]
    scale = np.where(np.isfinite(scale), scale, 1.0)  # no scaler: the gradients as they are
    nonzero = count * (1.0 - zero_share[keep])
    ok = np.isfinite(norms) & (norms >= 0) & (nonzero >= 1)
    if not ok.any():
        return None
    return float(np.median(norms[ok] * scale[ok] / np.sqrt(nonzero[ok])))


def _rms_words(rms: float | None) -> str:
    return "" if rms is None else f" (its nonzero gradients, scaled, have an RMS of {rms:.3g})"
