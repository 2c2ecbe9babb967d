"""Every finding kind, declared once: what it means, where it lives (run, rank or layer),
which incident cause it stands for, what fixes it and which page section shows it.

The API's `FindingKind` enum (OpenAPI), `?kind=` validation, incident grouping and the
pages read this table; `registry.DETECTORS` says which detector raises each kind, and
tests/server/analysis/test_registry.py fails when a kind lacks either. Adding a finding
kind: its member here, its `KindSpec`, its detector in the registry, its page section,
its tests (docs/architecture.md, "Add a finding kind").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ampwatch.server.analysis.causes import Cause


class FindingKind(StrEnum):
    """What a finding is about; `code` (when set) names the exact check within the kind."""

    SCALER_DIVERGENCE = "scaler_divergence"
    NONFINITE = "nonfinite"
    OVERFLOW_RISK = "overflow_risk"
    UNDERFLOW_RISK = "underflow_risk"
    MISALIGNED_LAYER = "misaligned_layer"
    PRECISION_MAP = "precision_map"
    PITFALL = "pitfall"
    SPEED = "speed"
    FP8_UNDERFLOW = "fp8_underflow"
    FP8_SATURATION = "fp8_saturation"
    FP8_STALE_SCALE = "fp8_stale_scale"
    RANKS = "ranks"
    LOSS_SPIKE = "loss_spike"
    SPIKE_PRECURSOR = "spike_precursor"
    OPTIMIZER_STATE = "optimizer_state"
    WEIGHT_JUMP = "weight_jump"
    LR_CHANGE = "lr_change"


class Scope(StrEnum):
    """What one finding of the kind is about: the run's setup, one rank's training, or
    one layer of that rank."""

    RUN = "run"
    RANK = "rank"
    LAYER = "layer"


class Section(StrEnum):
    """The page section that shows the kind, besides the overview's incident panel."""

    OVERVIEW = "overview"  # the overview's incident panel only
    LAYERS = "layers"  # also the Layers page's tables
    FP8 = "fp8"  # also the FP8 page


# incident cause taken from the finding's evidence["cause"] (the data names it)
FROM_EVIDENCE = "from_evidence"


@dataclass(frozen=True)
class KindSpec:
    """One finding kind.

    cause: the root cause its findings are a symptom of, for incidents: a cause name,
        FROM_EVIDENCE (the detector writes evidence["cause"]), or None (each finding is an
        incident of its own). per_layer: False groups every finding of the cause into one
        incident (one fix for all of them).
    fix: what to do in general; each finding's message gives the fix for its case.
    follows: the causes its findings may follow from: an incident of one of them that
        they follow (server/findings/incident_folds.py says when) takes them in, and they
        send no alert of their own. "weight_jump" (a layer's rescaled weights),
        "forward_overflow" (a layer overflowing fp16), "clip_before_unscale" (the pitfall).
    """

    kind: FindingKind
    summary: str
    scope: Scope
    section: Section
    fix: str
    cause: Cause | str | None = None  # a Cause, FROM_EVIDENCE or None
    per_layer: bool = True
    follows: tuple[Cause, ...] = ()


KINDS: dict[FindingKind, KindSpec] = {spec.kind: spec for spec in (
    KindSpec(FindingKind.SCALER_DIVERGENCE,
             "the GradScaler's scale collapses, declines or skips too many steps",
             Scope.RANK, Section.OVERVIEW,
             "fix the cause the evidence names (a layer that overflows, a non-finite loss or "
             "input); lower the learning rate when the gradients grow",
             cause=FROM_EVIDENCE,
             follows=(Cause.WEIGHT_JUMP,)),
    KindSpec(FindingKind.NONFINITE,
             "inf/NaN on a step, localised to the first layer, the loss or the input",
             Scope.LAYER, Section.OVERVIEW,
             "run the named layer in fp32 or keep its output in range; check the data",
             cause=FROM_EVIDENCE,
             follows=(Cause.WEIGHT_JUMP,)),
    KindSpec(FindingKind.OVERFLOW_RISK,
             "fp16 forward outputs within a factor of fp16's maximum",
             Scope.LAYER, Section.OVERVIEW,
             "normalise or scale down what feeds the layer, run it in fp32, or train in bf16",
             cause=Cause.FORWARD_OVERFLOW,
             follows=(Cause.WEIGHT_JUMP,)),
    KindSpec(FindingKind.UNDERFLOW_RISK,
             "fp16 gradients mostly exactly zero, measured",
             Scope.LAYER, Section.OVERVIEW,
             "use a GradScaler with fp16, raise its init_scale, or train in bf16",
             follows=(Cause.FORWARD_OVERFLOW, Cause.WEIGHT_JUMP)),
    KindSpec(FindingKind.MISALIGNED_LAYER,
             "a matmul dimension that is not a multiple of the tensor-core alignment",
             Scope.LAYER, Section.LAYERS,
             "pad the dimension to the size the finding names",
             cause=Cause.MISALIGNED, per_layer=False),
    KindSpec(FindingKind.PRECISION_MAP,
             "a layer computed in an unexpected dtype under autocast",
             Scope.LAYER, Section.LAYERS,
             "let matmuls run under autocast; run norms, softmax and losses in fp32"),
    KindSpec(FindingKind.PITFALL,
             "an AMP mistake in the training loop or its setup",
             Scope.RUN, Section.OVERVIEW,
             "the finding's message names the pitfall and its fix"),
    KindSpec(FindingKind.SPEED,
             "the verdict of an fp32-versus-AMP speed check",
             Scope.RUN, Section.OVERVIEW,
             "under 1.1x stay in fp32; above 1.5x use AMP"),
    KindSpec(FindingKind.FP8_UNDERFLOW,
             "elements of an FP8 cast flushed to zero",
             Scope.LAYER, Section.FP8,
             "scale per row, clip the outlier, or keep the layer in bf16",
             follows=(Cause.WEIGHT_JUMP,)),
    KindSpec(FindingKind.FP8_SATURATION,
             "elements of an FP8 cast clipped at the format's maximum",
             Scope.LAYER, Section.FP8,
             "shorten the amax history or switch to current scaling",
             follows=(Cause.WEIGHT_JUMP,)),
    KindSpec(FindingKind.FP8_STALE_SCALE,
             "an FP8 tensor outgrew what its delayed scale covers",
             Scope.LAYER, Section.FP8,
             "shorten the amax history or switch to current scaling",
             follows=(Cause.WEIGHT_JUMP,)),
    KindSpec(FindingKind.RANKS,
             "ranks that disagree: a scaler, the first non-finite rank, a straggler",
             Scope.RANK, Section.OVERVIEW,
             "the finding's message names the rank and what to check on it",
             cause=FROM_EVIDENCE),
    # docs/spikes.md; the findings of one spike carry evidence.cause "loss_spike" and
    # its step, and form one incident
    KindSpec(FindingKind.LOSS_SPIKE,
             "a loss spike, with its likely cause (the code), layer and lead time",
             Scope.RANK, Section.OVERVIEW,
             "the finding names the fix for its cause (qk-layernorm, z-loss, fp32 optimizer "
             "state, a smaller eps, clipping, or the batch)",
             cause=FROM_EVIDENCE,
             follows=(Cause.FORWARD_OVERFLOW, Cause.WEIGHT_JUMP)),
    KindSpec(FindingKind.SPIKE_PRECURSOR,
             "a layer's attention logit or the output log-partition grew 10x over its level",
             Scope.LAYER, Section.OVERVIEW,
             "qk-layernorm or a lower learning rate (attention); z-loss (output)",
             cause=FROM_EVIDENCE,
             follows=(Cause.FORWARD_OVERFLOW, Cause.WEIGHT_JUMP)),
    KindSpec(FindingKind.OPTIMIZER_STATE,
             "Adam's eps dominates, or its second moment underflowed, in a layer",
             Scope.LAYER, Section.OVERVIEW,
             "a smaller eps, fp32 optimizer state, or a larger loss scale",
             cause=FROM_EVIDENCE,
             follows=(Cause.CLIP_BEFORE_UNSCALE, Cause.WEIGHT_JUMP)),
    # server/analysis/weights.py: the layer whose weights moved, a cause of its own
    KindSpec(FindingKind.WEIGHT_JUMP,
             "a layer's sampled weight norm jumped between samples or grew on every one",
             Scope.LAYER, Section.OVERVIEW,
             "find what rescaled the layer's weights at that step (a loop, a load or one "
             "update); clip or lower the learning rate",
             cause=FROM_EVIDENCE),
    # server/analysis/lr_changes.py: a note, where a spike's or a growth's story starts
    KindSpec(FindingKind.LR_CHANGE,
             "the recorded learning rate rose 3x or more from one step to the next",
             Scope.RANK, Section.OVERVIEW,
             "if it was not meant, undo or soften the change (a warmup to the new rate)",
             cause=FROM_EVIDENCE),
)}


def kinds_in(section: Section) -> tuple[FindingKind, ...]:
    """The kinds a page section shows, in declaration order."""
    return tuple(kind for kind, spec in KINDS.items() if spec.section == section)


def kind_help() -> str:
    """One line per kind, for the API's documentation of `kind`."""
    return "\n".join(f"- `{kind}`: {spec.summary}" for kind, spec in KINDS.items())
