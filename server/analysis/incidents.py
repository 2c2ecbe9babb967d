"""Incidents: the findings that share one root cause, told as one story.

A layer whose fp16 output grows until it overflows raises up to four findings: an
overflow risk, then non-finite steps, then a skip streak, then the scale at or below 1.
They have one cause (forward overflow) and one layer, so they form one incident with a
headline, the first step, the fix and a timeline. Findings with no known cause are an
incident of their own. Pure functions of the findings (API or ORM shaped): no database.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ampwatch.server.analysis.draft import SEVERITY_RANK
from ampwatch.server.analysis.kinds import FROM_EVIDENCE, KINDS
from ampwatch.server.analysis.localize import dtype_word, fix_for_cause

# what a finding says happened, in the order a root cause plays out
STAGES = {
    ("overflow_risk", None): (0, "outputs close to fp16's maximum"),
    ("nonfinite", None): (1, "first non-finite step"),
    ("ranks", "first_nonfinite_rank"): (1, "this rank went non-finite first"),
    ("ranks", "scaler_disagreement"): (2, "this rank's scaler disagrees"),
    ("ranks", "straggler"): (5, "this rank is a straggler"),
    ("scaler_divergence", "scale_decline"): (2, "loss scale falling"),
    ("scaler_divergence", "skip_ratio"): (2, "many steps skipped"),
    ("scaler_divergence", "skip_streak"): (3, "steps skipped in a row"),
    ("scaler_divergence", "scale_collapse"): (4, "loss scale at or below 1"),
}
HEADLINES = {
    "divergence": "Training diverged: the gradients ran away before any value overflowed",
    "forward_overflow": "Layer {layer!r} overflows {dtype} in the forward pass",
    "absorbed_overflow": "Layer {layer!r} overflows in the forward pass; a later op "
                         "silently clipped it",
    "grad_overflow": "Gradients of layer {layer!r} are inf/NaN",
    "nonfinite_loss": "The loss is inf/NaN",
    "nonfinite_input": "The input batch holds inf/NaN",
}


@dataclass(frozen=True)
class TimelineEntry:
    step: int | None
    what: str
    finding: int  # the finding's id
    severity: str


@dataclass
class Incident:
    """One root cause. `id`: the id of its earliest finding, stable while that finding
    exists. `headline` and `fix` are None for an incident of one finding without a
    known cause (its message says it all)."""

    id: int
    run_id: str
    rank: int
    cause: str | None
    layer: str | None
    severity: str
    status: str
    step: int | None
    last_step: int | None
    headline: str | None
    fix: str | None
    findings: list[int] = field(default_factory=list)
    timeline: list[TimelineEntry] = field(default_factory=list)

    @property
    def problem(self) -> bool:
        """An open incident worth acting on (warning or critical), not a note."""
        return self.status == "open" and self.severity != "info"


def _get(finding: Any, name: str) -> Any:
    return finding[name] if isinstance(finding, Mapping) else getattr(finding, name)


def root_cause(finding: Any) -> tuple[str, str] | None:
    """(cause, layer) that the finding is a symptom of; None when the data names none.
    An overflow risk is the early sign of the forward overflow of its layer."""
    spec = KINDS.get(_get(finding, "kind"))
    if spec is None or spec.cause is None:
        return None
    if not spec.per_layer:  # one fix for all of them (misaligned: pad to the table's sizes)
        return spec.cause, "-"
    layer = _get(finding, "layer")
    if spec.cause != FROM_EVIDENCE:
        return (spec.cause, layer) if layer else None
    evidence = _get(finding, "evidence") or {}
    if evidence.get("cause"):
        cause = evidence["cause"]
        culprit = evidence.get("layer") or layer
        if cause in ("forward_overflow", "absorbed_overflow", "grad_overflow") and not culprit:
            return None
        return cause, culprit or "-"
    return None


def _stage(finding: Any) -> tuple[int, str]:
    kind = _get(finding, "kind")
    check = (_get(finding, "evidence") or {}).get("check")
    return STAGES.get((kind, check)) or STAGES.get((kind, None)) or (5, kind.replace("_", " "))


def _order(finding: Any) -> tuple:
    step = _get(finding, "step")
    return (step is None, step or 0, _stage(finding)[0], _get(finding, "id"))


def group_incidents(findings: Iterable[Any]) -> list[Incident]:
    """Group a run's findings (open and resolved) by (rank, cause, layer).

    Returns incidents open first, most severe first, then by first step. An incident is
    open while any of its findings is; its severity is the worst of its open findings
    (of all of them once resolved). O(n log n) in the number of findings.
    """
    groups: dict[tuple, list[Any]] = {}
    for finding in findings:
        cause = root_cause(finding)
        key = ((_get(finding, "run_id"), _get(finding, "rank"), *cause) if cause
               else ("finding", _get(finding, "id")))
        groups.setdefault(key, []).append(finding)
    incidents = [_incident(sorted(members, key=_order)) for members in groups.values()]
    return sorted(incidents, key=lambda i: (i.status != "open", -SEVERITY_RANK[i.severity],
                                            i.step is None, i.step or 0, i.id))


def _incident(members: list[Any]) -> Incident:
    lead = members[0]
    cause = root_cause(lead)
    live = [f for f in members if _get(f, "status") == "open"]
    worst = max(live or members, key=lambda f: SEVERITY_RANK[_get(f, "severity")])
    steps = [_get(f, "step") for f in members if _get(f, "step") is not None]
    lasts = [_get(f, "last_step") if _get(f, "last_step") is not None else _get(f, "step")
             for f in members]
    lasts = [s for s in lasts if s is not None]
    layer = cause[1] if cause and cause[1] != "-" else _get(lead, "layer")
    headline = fix = None
    timeline = [TimelineEntry(step=_get(f, "step"), what=_stage(f)[1], finding=_get(f, "id"),
                              severity=_get(f, "severity")) for f in members]
    if cause is not None and cause[0] == "misaligned":
        layer, headline, fix, timeline = _misaligned(members)
    elif cause is not None:
        # the run's compute dtype, as its findings' evidence names it (fp16 when none does)
        dtype = next((e["dtype"] for e in (_get(f, "evidence") or {} for f in members)
                      if e.get("dtype")), None)
        headline = HEADLINES.get(cause[0], "Steps went inf/NaN").format(
            layer=layer, dtype=dtype_word(dtype))
        # the remedy after "what happened: " (the headline already says what happened)
        fix = fix_for_cause(cause[0], layer, dtype).split(": ", 1)[-1]
        fix = fix[0].upper() + fix[1:] + "."
    return Incident(
        id=min(_get(f, "id") for f in members), run_id=_get(lead, "run_id"),
        rank=_get(lead, "rank"), cause=cause[0] if cause else None, layer=layer,
        severity=_get(worst, "severity"), status="open" if live else "resolved",
        step=min(steps, default=None), last_step=max(lasts, default=None),
        headline=headline, fix=fix, findings=[_get(f, "id") for f in members],
        timeline=timeline,
    )


def _misaligned(members: list[Any]) -> tuple[str | None, str, str, list[TimelineEntry]]:
    """Layer (when one), headline, fix and one entry per dimension, largest share first."""
    evidence = [_get(f, "evidence") or {} for f in members]
    layers = list(dict.fromkeys(_get(f, "layer") for f in members))
    dims = "dimension" if len(members) == 1 else "dimensions"
    where = f"layer {layers[0]!r}" if len(layers) == 1 else f"{len(layers)} layers"
    multiple = evidence[0].get("multiple")
    headline = f"{len(members)} {dims} of {where} misaligned for tensor cores"
    fix = ("Pad each to the size in the misaligned-layer table"
           + (f" (a multiple of {multiple}; 64 is best)." if multiple else "."))
    share = [e.get("flops_share") or 0 for e in evidence]
    order = sorted(range(len(members)), key=lambda i: -share[i])
    timeline = []
    for i in order:
        found, dim = members[i], evidence[i]
        what = (f"{_get(found, 'layer')}: {str(dim.get('dimension', '')).replace('_', ' ')} "
                f"{dim.get('value')} -> {dim.get('padded')}")
        timeline.append(TimelineEntry(step=_get(found, "step"), what=what,
                                      finding=_get(found, "id"),
                                      severity=_get(found, "severity")))
    return (layers[0] if len(layers) == 1 else None), headline, fix, timeline


def incident_of(incidents: Iterable[Incident]) -> dict[int, int]:
    """finding id -> id of the incident it belongs to."""
    return {finding: incident.id for incident in incidents for finding in incident.findings}
