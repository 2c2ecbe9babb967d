"""The detector registry: each detector, the inputs it judges and the finding kinds it
raises. The service runs detectors from here only, so a detector missing here never runs;
tests/server/analysis/test_registry.py fails when a `detect_*` function or a finding kind
is left out (docs/architecture.md, "Add a finding kind")."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

from ampwatch.server.analysis.alignment import detect_misaligned_layers
from ampwatch.server.analysis.draft import Detection
from ampwatch.server.analysis.fp8 import detect_fp8
from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.analysis.lr_changes import detect_lr_changes
from ampwatch.server.analysis.nonfinite import detect_nonfinite
from ampwatch.server.analysis.pitfalls import detect_loop_pitfalls, detect_setup_pitfalls
from ampwatch.server.analysis.precision import detect_precision_map
from ampwatch.server.analysis.ranges import detect_overflow_risk, detect_underflow_risk
from ampwatch.server.analysis.ranks import detect_rank_findings
from ampwatch.server.analysis.scaler import detect_scaler_divergence
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.analysis.speed import detect_speed
from ampwatch.server.analysis.spikes import detect_spikes
from ampwatch.server.analysis.weights import detect_weight_jumps
from ampwatch.server.analysis.window import Window

Detector = Callable[[Window, AnalysisSettings], Detection]


class Inputs(StrEnum):
    """What a detector judges, which decides when the service runs it."""

    STEPS = "steps"  # the rank's recent steps, on every batch
    SETUP = "setup"  # the layer table and environment (rank 0), on registration and batches
    RANKS = "ranks"  # every rank's steps over one window, when all ranks passed a step
    FP8 = "fp8"  # the rank's sampled FP8 statistics, on batches that carry them
    SPIKES = "spikes"  # the rank's loss and spike signals, on batches with either


@dataclass(frozen=True)
class DetectorSpec:
    detect: Detector
    inputs: Inputs
    kinds: tuple[FindingKind, ...]


K = FindingKind
# In the order they run: on a batch, findings are inserted in this order.
DETECTORS: tuple[DetectorSpec, ...] = (
    DetectorSpec(detect_scaler_divergence, Inputs.STEPS, (K.SCALER_DIVERGENCE,)),
    DetectorSpec(detect_nonfinite, Inputs.STEPS, (K.NONFINITE,)),
    DetectorSpec(detect_overflow_risk, Inputs.STEPS, (K.OVERFLOW_RISK,)),
    DetectorSpec(detect_underflow_risk, Inputs.STEPS, (K.UNDERFLOW_RISK,)),
    DetectorSpec(detect_precision_map, Inputs.STEPS, (K.PRECISION_MAP,)),
    DetectorSpec(detect_loop_pitfalls, Inputs.STEPS, (K.PITFALL,)),
    DetectorSpec(detect_speed, Inputs.STEPS, (K.SPEED,)),
    DetectorSpec(detect_lr_changes, Inputs.STEPS, (K.LR_CHANGE,)),
    DetectorSpec(detect_misaligned_layers, Inputs.SETUP, (K.MISALIGNED_LAYER,)),
    DetectorSpec(detect_setup_pitfalls, Inputs.SETUP, (K.PITFALL,)),
    DetectorSpec(detect_rank_findings, Inputs.RANKS, (K.RANKS,)),
    DetectorSpec(detect_fp8, Inputs.FP8,
                 (K.FP8_UNDERFLOW, K.FP8_SATURATION, K.FP8_STALE_SCALE)),
    DetectorSpec(detect_spikes, Inputs.SPIKES,
                 (K.LOSS_SPIKE, K.SPIKE_PRECURSOR, K.OPTIMIZER_STATE)),
    DetectorSpec(detect_weight_jumps, Inputs.SPIKES, (K.WEIGHT_JUMP,)),
)


def run_detectors(window: Window, settings: AnalysisSettings,
                  inputs: Iterable[Inputs]) -> list[Detection]:
    """Every registered detector of `inputs` on one window, in registry order; pure (no
    database)."""
    wanted = set(inputs)
    return [spec.detect(window, settings) for spec in DETECTORS if spec.inputs in wanted]
