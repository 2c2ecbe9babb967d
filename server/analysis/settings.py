"""Detector thresholds: one validated object, nested in the server settings as `analysis`
(environment variables like AMPWATCH_ANALYSIS__SKIP_STREAK_WARNING=8)."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

FP16_MAX = 65504.0


class AnalysisSettings(BaseModel):
    """Detector thresholds (docs/architecture.md, "Finding kinds and detectors"); what
    the defaults flag is checked by the fault suite of docs/diagnosis.md."""

    enabled: bool = True

    # diverging scaler
    scale_critical: float = Field(1.0, ge=0, description="scale at or below: critical")
    skip_streak_warning: int = Field(5, ge=2, description="consecutive skipped steps: warning")
    skip_streak_critical: int = Field(20, ge=2, description="consecutive skipped steps: critical")
    skip_ratio_warning: float = Field(0.05, gt=0, lt=1, description="skipped share of the window")
    skip_ratio_window: int = Field(500, ge=10, description="steps the skipped share is taken over")
    decline_halvings: int = Field(3, ge=1, description="halvings minus doublings: warning")
    decline_window: int = Field(200, ge=10, description="steps the net decline is counted over")
    calibration_clean_steps: int = Field(
        10, ge=1, description="calibration ends at the first run of this many unskipped steps"
    )
    calibration_max_steps: int = Field(200, ge=0, description="calibration never lasts longer")

    # non-finite values, overflow and underflow
    nonfinite_resolve_steps: int = Field(
        100, ge=1, description="clean steps after which a non-finite finding is resolved"
    )
    fp16_max: float = Field(FP16_MAX, gt=0)
    overflow_factor: float = Field(2.0, ge=1, description="abs-max within fp16_max / this")
    underflow_share: float = Field(
        0.5, gt=0, le=1, description="share of recent measured steps that must show underflow"
    )
    underflow_rms_floor: float = Field(
        2.0**-6, gt=0, description="the scaled RMS of a layer's nonzero gradients at or over "
        "which its exact zeros are the model's own, not fp16 underflow (256x fp16's "
        "smallest normal)")
    underflow_zero_share: float = Field(
        0.5, gt=0, le=1, description="a layer's share of exactly-zero grad elements: underflow"
    )
    risk_window: int = Field(200, ge=1, description="recent steps overflow/underflow are judged on")
    divergence_growth: float = Field(
        1e4, gt=1, description="grad norm growth over its typical value before the first "
        "non-finite step that makes the cause divergence"
    )

    # FP8 casts (server/analysis/fp8.py)
    fp8_underflow_share: float = Field(
        0.01, gt=0, le=1, description="share of a tensor's elements flushed to zero: warning"
    )
    fp8_saturation_share: float = Field(
        0.001, gt=0, le=1, description="share of a tensor's elements clipped at the max: warning"
    )
    fp8_stale_samples: int = Field(
        2, ge=1, description="consecutive samples whose amax outgrew the scale: stale scale"
    )

    # loss spikes and their causes (server/analysis/spikes.py, docs/spikes.md)
    spike_reference_steps: int = Field(
        50, ge=5, description="recent clean steps a loss is compared with (median and spread)")
    spike_min_history: int = Field(20, ge=5, description="clean steps before a spike can be seen")
    spike_spread_factor: float = Field(
        6.0, gt=0, description="a loss this many robust spreads over the median: a spike")
    spike_min_rise: float = Field(
        0.1, gt=0, description="... and at least this share over the median")
    spike_lookback_steps: int = Field(
        200, ge=10, description="steps before a spike searched for what grew")
    spike_growth_factor: float = Field(
        5.0, gt=1, description="a signal this many times its earlier level names the cause")
    spike_update_jump: float = Field(
        2.0, gt=1, description="an update ratio this many times its level: update_ratio_spike")
    spike_grad_jump: float = Field(
        2.0, gt=1, description="a grad norm this many times its median with the spike: bad batch")
    spike_lr_jump: float = Field(
        3.0, gt=1, description="a recorded learning rate this many times (or this many times "
        "under) the one before it: a change the spike may follow")
    spike_lr_steps: int = Field(
        20, ge=1, description="steps before a spike a learning-rate rise is looked for in")
    spike_critical_steps: int = Field(
        50, ge=1, description="a loss still not back this many steps after its spike began: "
        "critical (the damage stayed)")
    spike_layers_share: float = Field(
        0.5, gt=0, le=1, description="share of measured layers whose update ratio jumped "
        "together: the optimizer's doing, not one layer's")
    spike_settle_share: float = Field(
        0.25, gt=0, lt=1, description="after a one-step jump, a tail under this share of "
        "its rise is the bad step's after-effect (still a bad batch)")
    weight_jump_factor: float = Field(
        100.0, gt=1, description="a layer's weight norm this many times (or this many "
        "times under) its previous sample: weight_jump, a rescale (server/analysis/weights.py)")
    weight_growth_factor: float = Field(
        10.0, gt=1, description="a layer's weight norm grown this many times, rising on every "
        "sample: weight_growth (info: evidence, it may be harmless)")
    precursor_factor: float = Field(
        10.0, gt=1, description="attention logit or log-partition this many times its level: "
        "a precursor warning before any spike")
    precursor_logit_error: float = Field(
        0.25, gt=0, description="... and its rounding error in the dtype it is computed in "
        "(half an ulp, |x|*eps/2) at least this many nats, so softmax weights are off by up "
        "to exp(this): 64 in bf16, 512 in fp16 (server/analysis/logit_floor.py)")
    adam_eps_share: float = Field(
        0.5, gt=0, le=1, description="share of a layer's elements with eps dominating sqrt(v)")
    adam_v_zero_share: float = Field(
        0.05, gt=0, le=1,
        description="share of a layer's elements with a zero second moment and a gradient")
    optimizer_state_samples: int = Field(
        3, ge=1, description="consecutive samples over those shares before a warning")

    # layers and model
    misaligned_warning_share: float = Field(
        0.2, ge=0, le=1,
        description="a misaligned layer doing this share of the matmul FLOPs: warning"
    )
    scheduler_drift_warning: float = Field(
        0.05, gt=0, le=1,
        description="LR schedule steps ahead of the optimizer, as a share of its steps: warning"
    )
    small_model_params: int = Field(10_000_000, ge=0)
    bf16_min_capability: float = Field(8.0, ge=0)

    # speed check verdicts
    speedup_stay_fp32: float = Field(1.1, gt=0, description="below: stay in fp32")
    speedup_use_amp: float = Field(1.5, gt=0, description="above: use AMP")

    # comparing ranks
    straggler_factor: float = Field(
        1.5, ge=1, description="a rank's own step time over the others' median by this factor")
    straggler_min_ms: float = Field(10.0, ge=0, description="... and by at least this much")
    straggler_share: float = Field(
        0.6, gt=0, le=1, description="... and the slowest rank on this share of the steps")
    straggler_min_steps: int = Field(4, ge=1, description="steps compared before judging")
    rank_window_steps: int = Field(
        200, ge=10, description="steps of every rank re-read when the ranks are compared")

    # incremental analysis on ingest
    history_steps: int = Field(500, ge=10, description="stored steps re-read before each batch")
    merge_gap_steps: int = Field(
        500, ge=0, description="a condition back within this many steps reopens its finding"
    )
    evidence_steps: int = Field(20, ge=1, description="most recent steps listed in evidence")

    @model_validator(mode="after")
    def _ordered(self) -> AnalysisSettings:
        if self.skip_streak_critical < self.skip_streak_warning:
            raise ValueError("skip_streak_critical must be >= skip_streak_warning")
        if self.speedup_use_amp < self.speedup_stay_fp32:
            raise ValueError("speedup_use_amp must be >= speedup_stay_fp32")
        return self
