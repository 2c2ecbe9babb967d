"""AMP mistakes in the training loop and setup (the pitfall table of the GradScaler
reference). Each finding names the first step it was seen and how to fix it.

Loop pitfalls are a property of the code, which does not change mid-run: once seen they
stay open (later sightings update them). Setup pitfalls follow the environment and the
layer table, and resolve when those change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ampwatch.server.analysis.context import (
    BF16,
    FP16,
    MIXED,
    autocast_codes,
    compute_dtype,
)
from ampwatch.server.analysis.draft import Detection, FindingDraft, recent_steps
from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.analysis.window import Window
from ampwatch.server.store.series import FIELD_INDEX, StepSeries

KIND = FindingKind.PITFALL


@dataclass(frozen=True)
class LoopPitfall:
    code: str
    severity: str
    what: str
    fix: str
    steps: Callable[[StepSeries], np.ndarray]  # per step: committed here
    # (series, per-step hits, settings) -> (severity, what the cost was, evidence)
    judge: Callable[[StepSeries, np.ndarray, AnalysisSettings],
                    tuple[str, str, dict]] | None = None


def _reported(series: StepSeries, name: str) -> np.ndarray:
    """A scalar column with missing and NaN entries as 0 (as np.nan_to_num reads them,
    without its cost, which showed on ingest)."""
    i = FIELD_INDEX[name]
    values = series.scalars[:, i]
    return np.where(series.present[:, i] & ~np.isnan(values), values, 0.0)


def _flag(series: StepSeries, name: str) -> np.ndarray:
    return _reported(series, name) != 0


def _count_above(series: StepSeries, name: str, limit: int) -> np.ndarray:
    return series.has(name) & (_reported(series, name) > limit)


def _mixed_dtypes(series: StepSeries) -> np.ndarray:
    codes = autocast_codes(series)
    low = (codes == FP16) | (codes == BF16)
    if not low.any():
        return codes == MIXED
    usual = np.bincount(codes[low]).argmax()
    return (codes == MIXED) | (low & (codes != usual))


def _scaler_skipped(series: StepSeries) -> np.ndarray:
    """Steps a GradScaler skipped: skipped under a loss scale, not left out by the step
    guard (docs/guard.md tells its users to step the scheduler as usual)."""
    return series.skipped & series.has("loss_scale") & (series.guarded == 0)


def _scheduler_after_skip(series: StepSeries) -> np.ndarray:
    # a step's scheduler_steps counts the calls since the previous optimizer step, so a
    # scheduler step after skipped step i shows up in step i+1's record
    stepped_next = np.append(_count_above(series, "scheduler_steps", 0)[1:], False)
    following = np.append(np.diff(series.steps) == 1, False)
    return _scaler_skipped(series) & stepped_next & following


def _schedule_drift(series: StepSeries, hits: np.ndarray,
                    settings: AnalysisSettings) -> tuple[str, str, dict]:
    """Each scheduler step on a skipped step puts the schedule one step ahead of the
    optimizer: the cost is that lead as a share of the steps the optimizer took. A
    probing GradScaler (one skip per growth interval) leads by well under 1%: info.
    The words name the steps judged and each count's denominator, so the card reads
    beside the run's skipped KPI and its own count (the run's, over every pass)."""
    ahead = int(hits.sum())
    skipped = int(_scaler_skipped(series).sum())
    applied = int((~series.skipped).sum())
    share = ahead / max(applied, 1)
    severity = "warning" if share >= settings.scheduler_drift_warning else "info"
    first, last = int(series.steps[0]), int(series.steps[-1])
    cost = (f"in steps {first}-{last} it stepped on {ahead} of the {skipped} skipped "
            f"step{'s' if skipped != 1 else ''}, so the LR schedule ran {ahead} "
            f"step{'s' if ahead != 1 else ''} ahead of the optimizer, which stepped "
            f"{applied} times ({share:.1%} ahead)")
    return severity, cost, {"schedule_ahead_steps": ahead, "optimizer_steps": applied,
                            "skipped_steps": skipped, "drift_share": round(share, 4)}


LOOP_PITFALLS = (
    LoopPitfall(
        "clip_before_unscale", "warning",
        "gradients were clipped or read while still scaled by the loss scale",
        "call scaler.unscale_(optimizer) before torch.nn.utils.clip_grad_norm_",
        lambda s: _flag(s, "clip_before_unscale"),
    ),
    LoopPitfall(
        "scheduler_on_skipped_step", "warning",
        "the LR scheduler stepped on a step GradScaler skipped",
        "step the scheduler only when the optimizer stepped (skip it when "
        "scaler.get_scale() decreased in update())",
        _scheduler_after_skip,
        _schedule_drift,
    ),
    LoopPitfall(
        "fp16_without_scaler", "warning",
        "fp16 autocast ran without a GradScaler, so small gradients underflow to zero",
        "wrap the loop with scaler = torch.amp.GradScaler(): scaler.scale(loss).backward(), "
        "scaler.step(optimizer), scaler.update()",
        lambda s: (autocast_codes(s) == FP16) & ~s.has("loss_scale"),
    ),
    LoopPitfall(
        "mixed_autocast_dtypes", "warning",
        "autocast used both float16 and bfloat16",
        "choose one autocast dtype and pass it everywhere (torch.autocast(device_type, "
        "dtype=...))",
        _mixed_dtypes,
    ),
    LoopPitfall(
        "eval_without_autocast", "warning",
        "evaluation forwards ran without the autocast that training uses",
        "run validation under the same torch.autocast (without a GradScaler)",
        lambda s: _count_above(s, "eval_forwards_no_autocast", 0),
    ),
    LoopPitfall(
        "update_without_step", "warning",
        "scaler.update() was called more often than the optimizer stepped",
        "with gradient accumulation call scaler.step() and scaler.update() once per "
        "optimizer step, after the last micro-batch",
        lambda s: _count_above(s, "scaler_updates", 1),
    ),
)


def detect_loop_pitfalls(window: Window, settings: AnalysisSettings) -> Detection:
    """One finding per pitfall code seen in the window's steps; never resolved by absence."""
    series = window.series
    drafts = []
    if not len(series):
        return Detection()
    for pitfall in LOOP_PITFALLS:
        hits = pitfall.steps(series)
        steps = series.steps[hits]
        if not steps.size:
            continue
        severity, what, evidence = pitfall.severity, pitfall.what, {}
        if pitfall.judge is not None:
            severity, cost, evidence = pitfall.judge(series, hits, settings)
            what = f"{what}: {cost}"
        drafts.append(FindingDraft(
            kind=KIND, code=pitfall.code, key=f"{KIND}:{pitfall.code}",
            severity=severity,  # type: ignore[arg-type]
            message=f"Step {int(steps[0])}: {what}; {pitfall.fix}.",
            step=int(steps[0]), last_step=int(steps[-1]),
            evidence={**evidence, "steps": recent_steps(steps, settings.evidence_steps)},
            occurrences=steps,
        ))
    return Detection(drafts=drafts)


def _capability(environment: dict) -> float | None:
    value = environment.get("compute_capability")
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _on_gpu(environment: dict) -> bool:
    return str(environment.get("device", "")).startswith("cuda")


def _setup_draft(code: str, severity: str, message: str, evidence: dict,
                 series: StepSeries) -> FindingDraft:
    first = int(series.steps[0]) if len(series) else None
    return FindingDraft(kind=KIND, code=code, key=f"{KIND}:{code}",
                        severity=severity,  # type: ignore[arg-type]
                        message=message, step=first, evidence=evidence)


def detect_setup_pitfalls(window: Window, settings: AnalysisSettings) -> Detection:
    """bf16 on a GPU before compute capability 8.0, a GradScaler with bf16 (info), a model
    too small to gain from AMP (info). Judged only once the compute dtype is known."""
    series, run = window.series, window.run
    dtype = compute_dtype(series, run)
    if dtype is None:
        return Detection()
    env = run.environment
    drafts = []
    codes = ["bf16_unsupported_device", "scaler_with_bf16", "small_model"]
    capability = _capability(env)
    if dtype == "bfloat16" and _on_gpu(env) and capability is not None \
            and capability < settings.bf16_min_capability:
        drafts.append(_setup_draft(
            "bf16_unsupported_device", "warning",
            f"bf16 autocast on {env.get('device_name') or 'a GPU'} (compute capability "
            f"{capability:g}, below {settings.bf16_min_capability:g}) is emulated and slow: "
            "use float16 with a GradScaler on this GPU.",
            {"compute_capability": capability, "device_name": env.get("device_name")}, series))
    has_scaler = run.scaler is not None or bool(series.has("loss_scale").any())
    if dtype == "bfloat16" and has_scaler:
        drafts.append(_setup_draft(
            "scaler_with_bf16", "info",
            "A GradScaler is used with bf16, whose fp32-sized range needs no loss scaling: "
            "drop the scaler (plain loss.backward() and optimizer.step()).",
            {"autocast_dtype": dtype}, series))
    total = run.total_params
    if dtype in ("float16", "bfloat16") and run.layers and total < settings.small_model_params:
        drafts.append(_setup_draft(
            "small_model", "info",
            f"The model has {total:,} parameters (under {settings.small_model_params:,}): "
            "it is likely memory- or overhead-bound and gains little from AMP; measure with "
            "the speed check and stay in fp32 if it is under 1.1x.",
            {"param_count": total, "threshold": settings.small_model_params}, series))
    return Detection(drafts=drafts, covers=tuple(f"{KIND}:{c}" for c in codes))
