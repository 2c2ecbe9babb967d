"""FP8 casts that lose values: elements flushed to zero, elements clipped at the format's
maximum, and scales that no longer fit the tensor.

FP8 fails silently: nothing becomes inf. With dynamic tensorwise scaling (torchao's
default) one outlier sets the amax, and every small element of the tensor falls below the
format's smallest subnormal (`fp8_underflow`). With delayed scaling (Transformer Engine's
default) the scale comes from an amax history, so a growing tensor outgrows it: first the
amax passes what the scale covers (`fp8_stale_scale`), then elements clip (`fp8_saturation`).
Judged on the agent's sampled FP8 statistics (server/store/fp8_samples.py).
"""

from __future__ import annotations

import numpy as np

from ampwatch.server.analysis.context import RunContext
from ampwatch.server.analysis.draft import Detection, FindingDraft, recent_steps
from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.analysis.window import Window
from ampwatch.server.store.fp8_samples import ROLES, Fp8Window

FORMAT_MAX = {"e4m3": 448.0, "e5m2": 57344.0, "e4m3fnuz": 240.0, "e5m2fnuz": 57344.0}
# half the smallest subnormal: a scaled value at or below it rounds to zero
FORMAT_FLUSH = {"e4m3": 2.0**-10, "e5m2": 2.0**-17, "e4m3fnuz": 2.0**-11, "e5m2fnuz": 2.0**-18}
UNDERFLOW, SATURATION, STALE_SCALE = (FindingKind.FP8_UNDERFLOW, FindingKind.FP8_SATURATION,
                                     FindingKind.FP8_STALE_SCALE)
TENSOR_WORDS = {"input": "input", "weight": "weight", "grad": "output gradient"}


def _fix(kind: FindingKind, recipe: str) -> str:
    delayed = recipe.startswith("delayed")
    if kind == UNDERFLOW:
        if delayed:
            return ("use current (per-step) scaling or a shorter amax history, or keep this "
                    "layer in bf16")
        if "tensorwise" in recipe:
            return ("scale per row (torchao: Float8LinearConfig.from_recipe_name(\"rowwise\")) "
                    "so an outlier only costs its own row, find and clip the outlier, or keep "
                    "this layer in bf16 (convert_to_float8_training's module_filter_fn)")
        return "find and clip the outlier, or keep this layer in bf16"
    return ("shorten the amax history (DelayedScaling(amax_history_len=...)), switch to "
            "current (dynamic) scaling, or keep this layer in bf16")


def _episodes(window: Fp8Window, flags: np.ndarray,
              evaluated: np.ndarray) -> list[tuple[int, np.ndarray, bool]]:
    """(layer, steps flagged, still flagged at the layer's latest sample) per layer."""
    out = []
    for layer in np.flatnonzero(flags.any(axis=0)):
        seen = np.flatnonzero(evaluated[:, layer])
        out.append((int(layer), window.steps[flags[:, layer]], bool(flags[seen[-1], layer])))
    return out


def detect_fp8(window: Window, settings: AnalysisSettings) -> Detection:
    """Every FP8 finding of the window's FP8 samples; covers each (layer, tensor) it holds
    samples of."""
    samples, run = window.fp8, window.run
    if samples is None or not len(samples):
        return Detection()
    drafts: list[FindingDraft] = []
    covers: list[str] = []
    for r, role in enumerate(ROLES):
        evaluated = samples.present[:, r]
        if not evaluated.any():
            continue
        amax, scale, rms, saturated, underflow = (samples.values[:, r, k] for k in range(5))
        fmax = np.array([FORMAT_MAX.get(str((run.layer(i).attrs if run.layer(i) else {})
                                            .get(f"fp8_{role}_format")), np.nan)
                         for i in range(samples.values.shape[-1])])
        with np.errstate(invalid="ignore", divide="ignore"):
            covered = amax * scale / fmax  # > 1: the tensor outgrew its scale
        flags = {
            UNDERFLOW: evaluated & (underflow > settings.fp8_underflow_share),
            SATURATION: evaluated & (saturated > settings.fp8_saturation_share),
            STALE_SCALE: evaluated & _runs_of(covered > 1.0 + 1e-6,
                                              settings.fp8_stale_samples),
        }
        for kind, flag in flags.items():
            for layer, steps, active in _episodes(samples, flag, evaluated):
                rows = flag[:, layer]
                drafts.append(_draft(kind, run, role, layer, steps, active, rows,
                                     amax, rms, scale, saturated, underflow, covered,
                                     settings))
            for layer in np.flatnonzero(evaluated.any(axis=0)):
                covers.append(f"{kind}:{run.layer_name(int(layer))}:{role}")
    flagged = {d.key for d in drafts if d.active}
    return Detection(drafts=drafts, covers=tuple(k for k in covers if k not in flagged))


def _runs_of(flag: np.ndarray, length: int) -> np.ndarray:
    """True where `flag` has held for at least `length` consecutive samples (per column)."""
    run = np.zeros(flag.shape[1:], dtype=np.int64)
    out = np.zeros_like(flag)
    for i in range(flag.shape[0]):
        run = np.where(flag[i], run + 1, 0)
        out[i] = run >= length
    return out


def _draft(kind: FindingKind, run: RunContext, role: str, layer: int, steps: np.ndarray,
           active: bool, rows: np.ndarray, amax, rms, scale, saturated, underflow, covered,
           settings: AnalysisSettings) -> FindingDraft:
    info = run.layer(layer)
    attrs = info.attrs if info else {}
    name = run.layer_name(layer)
    recipe = str(attrs.get("fp8_recipe", "unknown recipe"))
    fmt = str(attrs.get(f"fp8_{role}_format", "fp8"))
    first = int(np.flatnonzero(rows)[0])
    tensor = TENSOR_WORDS[role]
    peak_amax = float(np.nanmax(amax[rows, layer]))
    evidence = {"tensor": role, "format": fmt, "recipe": recipe, "amax": peak_amax,
                "scale": float(scale[first, layer]),
                "steps": recent_steps(steps, settings.evidence_steps)}
    if kind == UNDERFLOW:
        share = float(np.nanmax(underflow[rows, layer]))
        ratio = float(amax[first, layer] / rms[first, layer]) if rms[first, layer] > 0 else None
        flush_below = FORMAT_FLUSH.get(fmt, np.nan) / float(scale[first, layer])
        evidence |= {"underflow_share": share, "outlier_ratio": ratio,
                     "flush_below": flush_below}
        outlier = f" ({ratio:,.0f}x the RMS)" if ratio else ""
        # per-row scales: `scale` is the smallest row's, and the bound holds for that row
        where = "" if "tensorwise" in recipe else " in the row with the smallest scale"
        message = (f"Layer {name!r}: up to {share:.1%} of its {tensor}'s elements flushed to "
                   f"zero when cast to {fmt} ({recipe}) from step {int(steps[0])}: the abs-max "
                   f"{float(amax[first, layer]):.3g}{outlier} set a scale of "
                   f"{float(scale[first, layer]):.3g}, so every element{where} below "
                   f"{flush_below:.2g} in magnitude became 0. Fix: {_fix(kind, recipe)}.")
        severity = "warning"
    elif kind == SATURATION:
        share = float(np.nanmax(saturated[rows, layer]))
        evidence |= {"saturated_share": share,
                     "amax_over_covered": float(np.nanmax(covered[rows, layer]))}
        message = (f"Layer {name!r}: up to {share:.2%} of its {tensor}'s elements were clipped "
                   f"at {fmt}'s maximum from step {int(steps[0])}: the tensor outgrew the "
                   f"scale its amax history gave it ({recipe}). Fix: {_fix(kind, recipe)}.")
        severity = "warning"
    else:
        grown = float(np.nanmax(covered[rows, layer]))
        evidence |= {"amax_over_covered": grown}
        message = (f"Layer {name!r}: its {tensor}'s abs-max outgrew what its FP8 scale "
                   f"covers (up to {grown:.2f}x) on {settings.fp8_stale_samples}+ consecutive "
                   f"samples, the streak reaching that length at step {int(steps[0])}: the "
                   f"amax history lags a growing tensor ({recipe}). Fix: {_fix(kind, recipe)}.")
        severity = "info"
    return FindingDraft(kind=kind, key=f"{kind}:{name}:{role}", severity=severity,
                        message=message, step=int(steps[0]), last_step=int(steps[-1]),
                        layer=name, evidence=evidence, occurrences=steps, active=active)
