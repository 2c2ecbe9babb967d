"""Incidents: the findings that share one root cause, told as one story.

A layer whose fp16 output grows until it overflows raises up to four findings: an
overflow risk, then non-finite steps, then a skip streak, then the scale at or below 1.
They have one cause (forward overflow) and one layer, so they form one incident with a
headline, the first step, the fix and a timeline. An overflow that a later op absorbed
(a ReLU turning -inf into 0) is the same cause a step earlier; zero gradients of the layer
or of layers after it (in forward order), the overflow risk of a layer after it that
carries its values on, and the gradient overflows of the layer or of a layer after it
that began before its overflow ended (its growing outputs make the gradients of the layers
fed by them outgrow the loss scale, so the scaler falls for them first) are its
symptoms: all join its incident. Findings with no known cause are an incident of their
own. Pure functions of the findings (API or ORM shaped) and the layer order: no database.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ampwatch.server.analysis.causes import Cause
from ampwatch.server.analysis.draft import SEVERITY_RANK
from ampwatch.server.analysis.kinds import FROM_EVIDENCE, KINDS, FindingKind
from ampwatch.server.analysis.localize import dtype_word, fix_for_cause
from ampwatch.server.analysis.spikes import spike_story
from ampwatch.server.findings.incident_folds import (
    _get,
    first_applied,
    fold_into_clip_before_unscale,
    fold_into_lr_changes,
    fold_into_poisoning_steps,
    fold_into_weight_jumps,
    fold_sibling_growths,
    grown_layers,
)
from ampwatch.server.findings.overflow_folds import (
    fold_downstream_risks,
    fold_gradient_overflows,
    fold_precursors_into_overflows,
    fold_spikes_into_overflows,
    overflow_upstream,
)

FIRST_NONFINITE = "first non-finite step"
# what a finding says happened, in the order a root cause plays out
STAGES = {
    (FindingKind.OVERFLOW_RISK, None): (0, "outputs close to fp16's maximum"),
    (FindingKind.NONFINITE, None): (1, FIRST_NONFINITE),
    (FindingKind.RANKS, "first_nonfinite_rank"): (1, "this rank went non-finite first"),
    (FindingKind.RANKS, "scaler_disagreement"): (2, "this rank's scaler disagrees"),
    (FindingKind.RANKS, "straggler"): (5, "this rank is a straggler"),
    (FindingKind.SCALER_DIVERGENCE, "scale_decline"): (2, "loss scale falling"),
    (FindingKind.SCALER_DIVERGENCE, "skip_ratio"): (2, "many steps skipped"),
    (FindingKind.SCALER_DIVERGENCE, "skip_streak"): (3, "steps skipped in a row"),
    (FindingKind.SCALER_DIVERGENCE, "scale_collapse"): (4, "loss scale at or below 1"),
    (FindingKind.UNDERFLOW_RISK, None): (3, "gradients mostly exactly zero"),
    (FindingKind.LR_CHANGE, None): (0, "the learning rate rose"),
}
# causes that are one cause seen at two stages: the layer's inf first absorbed by a later
# op, then reaching the loss; grouped under the first name
SAME_CAUSE = {Cause.ABSORBED_OVERFLOW: Cause.FORWARD_OVERFLOW}
# findings that are symptoms of an overflowing layer upstream (or of the layer itself)
SYMPTOMS = (FindingKind.UNDERFLOW_RISK,)
RISK = FindingKind.OVERFLOW_RISK
HEADLINES = {
    Cause.DIVERGENCE: "Training diverged: the gradients ran away before any value overflowed",
    Cause.FORWARD_OVERFLOW: "Layer {layer!r} overflows {dtype} in the forward pass",
    Cause.ABSORBED_OVERFLOW: "Layer {layer!r} overflows in the forward pass; a later op "
                         "silently clipped it",
    Cause.GRAD_OVERFLOW: "Gradients of layer {layer!r} are inf/NaN",
    Cause.NONFINITE_LOSS: "The loss is inf/NaN",
    Cause.NONFINITE_INPUT: "The input batch holds inf/NaN",
    Cause.WEIGHT_JUMP: "The weights of layer {layer!r} jumped at step {step}",
    "weight_growth": "The weights of layer {layer!r} grew from step {step}",
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
    if evidence.get("cause") == Cause.LOSS_SPIKE:  # one incident per spike, named by its step
        return Cause.LOSS_SPIKE, f"step {evidence.get('spike_step')}"
    if evidence.get("cause") == Cause.LR_CHANGE:  # one incident per change, named by its step
        return Cause.LR_CHANGE, f"step {evidence.get('lr_step')}"
    if evidence.get("cause"):
        cause = evidence["cause"]
        culprit = evidence.get("layer") or layer
        if cause in (Cause.FORWARD_OVERFLOW, Cause.ABSORBED_OVERFLOW, Cause.GRAD_OVERFLOW) \
                and not culprit:
            return None
        return cause, culprit or "-"
    return None


def needs_layer_order(findings: Iterable[Any]) -> bool:
    """Whether grouping `findings` can use the layer order (a query): only what may join
    an overflow or a weight jump upstream of it (zero gradients, overflow risks, gradient
    overflows, what follows a weight jump)."""
    return any(_get(f, "kind") in (*SYMPTOMS, RISK, FindingKind.WEIGHT_JUMP)
               or (_get(f, "evidence") or {}).get("cause") == Cause.GRAD_OVERFLOW for f in findings)


def _stage(finding: Any) -> tuple[int, str]:
    kind = _get(finding, "kind")
    check = (_get(finding, "evidence") or {}).get("check")
    return STAGES.get((kind, check)) or STAGES.get((kind, None)) or (5, kind.replace("_", " "))


def _order(finding: Any) -> tuple:
    step = _get(finding, "step")
    return (step is None, step or 0, _stage(finding)[0], _get(finding, "id"))


def group_incidents(findings: Iterable[Any],
                    layer_order: Mapping[str, int] | None = None) -> list[Incident]:
    """Group a run's findings (open and resolved) by (rank, cause, layer). With
    `layer_order` (layer name -> forward position), what a layer after an overflowing one
    shows of it joins its incident: zero gradients (of the layer itself too, also without
    the order), an overflow risk begun no earlier than it, when the overflowing layer
    went non-finite (its values carried on through a ReLU or a residual), and gradient
    overflows (with the scaler's findings about them) begun no later than its last
    non-finite step (the scaler fell for the gradients its growing outputs fed). A loss spike
    shortly before or during a layer's overflow on its rank joins that layer's incident.

    Returns incidents open first, most severe first, then by first step. An incident is
    open while any of its findings is; its severity is the worst of its open findings
    (of all of them once resolved). O(n log n + n x overflowing layers).
    """
    order = layer_order or {}
    groups: dict[tuple, list[Any]] = {}
    symptoms = []
    for finding in findings:
        cause = root_cause(finding)
        if cause is None and _get(finding, "kind") in SYMPTOMS and _get(finding, "layer"):
            symptoms.append(finding)
            continue
        key = ((_get(finding, "run_id"), _get(finding, "rank"),
                SAME_CAUSE.get(cause[0], cause[0]), cause[1]) if cause
               else ("finding", _get(finding, "id")))
        groups.setdefault(key, []).append(finding)
    fold_downstream_risks(groups, order)
    fold_gradient_overflows(groups, order)
    fold_spikes_into_overflows(groups)
    fold_into_weight_jumps(groups, order)
    fold_sibling_growths(groups)
    fold_into_lr_changes(groups)
    fold_into_poisoning_steps(groups)
    fold_into_clip_before_unscale(groups)
    fold_precursors_into_overflows(groups, order)
    for symptom in symptoms:
        key = overflow_upstream(groups, order, _get(symptom, "run_id"), _get(symptom, "rank"),
                                _get(symptom, "layer"))
        groups.setdefault(key or ("finding", _get(symptom, "id")), []).append(symptom)
    incidents = [_incident(sorted(members, key=_order), key) for key, members in groups.items()]
    return sorted(incidents, key=lambda i: (i.status != "open", -SEVERITY_RANK[i.severity],
                                            i.step is None, i.step or 0, i.id))


def _only_risks(members: list[Any]) -> bool:
    """Whether what is open of the incident (all of it once resolved) is overflow risks
    and their symptoms: a layer close to the maximum, not yet over it."""
    open_kinds = {_get(f, "kind") for f in members if _get(f, "status") == "open"} or \
        {_get(f, "kind") for f in members}
    return RISK in open_kinds and open_kinds <= {RISK, *SYMPTOMS}


def _risk_headline(layer: str | None, members: list[Any], dtype: str | None) -> str:
    """The one wording of a risk, for the API, the cards and `ampwatch show` alike."""
    evidence = max((_get(f, "evidence") or {} for f in members if _get(f, "kind") == RISK),
                   key=lambda e: float(e.get("absmax") or 0))
    limit = float(evidence.get("limit") or 65504.0)
    return (f"Layer {layer!r} is approaching {dtype_word(dtype)}'s maximum: "
            f"{short_number(float(evidence.get('absmax') or 0), 2)} of {limit:g}")


def short_number(value: float, digits: int) -> str:
    """5.5e4 for 54,800 at 2 digits (a number read at a glance, not copied)."""
    mantissa, exponent = f"{value:.{digits - 1}e}".split("e")
    return f"{mantissa}e{int(exponent)}" if abs(value) >= 1e4 else f"{value:.{digits}g}"


def _incident(members: list[Any], key: tuple) -> Incident:
    lead = members[0]
    cause = None if key[0] == "finding" else (_cause_name(members, key[2]), key[3])
    live = [f for f in members if _get(f, "status") == "open"]
    worst = max(live or members, key=lambda f: SEVERITY_RANK[_get(f, "severity")])
    steps = [_get(f, "step") for f in members if _get(f, "step") is not None]
    lasts = [_get(f, "last_step") if _get(f, "last_step") is not None else _get(f, "step")
             for f in members]
    lasts = [s for s in lasts if s is not None]
    layer = cause[1] if cause and cause[1] != "-" else _get(lead, "layer")
    headline = fix = None
    applied = first_applied(members)
    timeline = [TimelineEntry(step=_get(f, "step"),
                              what=_what(f, layer, cause and key[2], applied),
                              finding=_get(f, "id"),
                              severity=_get(f, "severity")) for f in members]
    if cause is not None and cause[0] == Cause.MISALIGNED:
        layer, headline, fix, timeline = _misaligned(members)
    elif cause is not None and cause[0] == Cause.WEIGHT_JUMP:
        weights = next(f for f in members if _get(f, "kind") == FindingKind.WEIGHT_JUMP
                       or (_get(f, "evidence") or {}).get("cause") == Cause.WEIGHT_JUMP)
        evidence = _get(weights, "evidence") or {}
        shape = "weight_growth" if "growth_step" in evidence else "weight_jump"
        moved = grown_layers(members)
        if len(moved) > 1:  # siblings scaled together: their parent, each named
            layer = moved[0].rsplit(".", 1)[0]
            headline = (f"Layers {', '.join(repr(m.rsplit('.', 1)[1]) for m in moved)} of "
                        f"{layer!r}: their weights grew together from step "
                        f"{_get(weights, 'step')}")
        else:
            headline = HEADLINES[shape].format(layer=layer, step=_get(weights, "step"))
        fix = str(evidence.get("fix", ""))
        fix = fix[0].upper() + fix[1:] + "." if fix else None
    elif cause is not None and cause[0] == Cause.LR_CHANGE:
        # the change's step: the growths it set off began at the sample before it
        layer, headline, fix = _lr_change_story(members)
        steps = [_get(f, "step") for f in members if _get(f, "kind") == FindingKind.LR_CHANGE]
    elif cause is not None and cause[0] == Cause.LOSS_SPIKE:
        layer, headline, fix = spike_story([(_get(f, "kind"), _get(f, "layer"),
                                             _get(f, "evidence") or {}) for f in members])
    elif cause is not None:
        # the run's compute dtype, as its findings' evidence names it (fp16 when none does)
        dtype = next((e["dtype"] for e in (_get(f, "evidence") or {} for f in members)
                      if e.get("dtype")), None)
        headline = (_risk_headline(layer, members, dtype) if _only_risks(members) else
                    HEADLINES.get(cause[0], "Steps went inf/NaN").format(
                        layer=layer, dtype=dtype_word(dtype)))
        # the remedy after "what happened: " (the headline already says what happened)
        fix = fix_for_cause(cause[0], layer, dtype).split(": ", 1)[-1]
        fix = fix[0].upper() + fix[1:] + "."
    headline = _with_guard(headline, members)
    timeline = _first_once(timeline)
    return Incident(
        id=min(_get(f, "id") for f in members), run_id=_get(lead, "run_id"),
        rank=_get(lead, "rank"), cause=cause[0] if cause else None, layer=layer,
        severity=_get(worst, "severity"), status="open" if live else "resolved",
        step=min(steps, default=None), last_step=max(lasts, default=None),
        headline=headline, fix=fix, findings=[_get(f, "id") for f in members],
        timeline=timeline,
    )


def _lr_change_story(members: list[Any]) -> tuple[None, str, str | None]:
    """(layer, headline, fix) of a learning-rate change's card: the change, and the layers
    whose weights it set growing (folded in by `fold_into_lr_changes`)."""
    change = next(f for f in members if _get(f, "kind") == FindingKind.LR_CHANGE)
    evidence = _get(change, "evidence") or {}
    headline = (f"The learning rate rose {float(evidence.get('lr_factor') or 0):.3g}x at step "
                f"{_get(change, 'step')}")
    moved = grown_layers(members)
    if moved:
        headline += (f"; the weights of {', '.join(repr(m) for m in moved[:3])}"
                     + (f" and {len(moved) - 3} more" if len(moved) > 3 else "")
                     + " grew from it")
    fix = str(evidence.get("fix", ""))
    return None, headline, (fix[0].upper() + fix[1:] + ".") if fix else None


def _first_once(timeline: list[TimelineEntry]) -> list[TimelineEntry]:
    """One timeline names one step "first": a later non-finite finding of the same
    incident (a second rank, a return after it resolved) reads "non-finite again"."""
    first = min((e.step for e in timeline if e.what == FIRST_NONFINITE and e.step is not None),
                default=None)
    told, entries = False, []
    for entry in timeline:
        again = entry.what == FIRST_NONFINITE and (told or entry.step != first)
        told |= entry.what == FIRST_NONFINITE and not again
        entries.append(replace(entry, what="non-finite again") if again else entry)
    return entries


def _with_guard(headline: str | None, members: list[Any]) -> str | None:
    """The headline, with what the agent's step guard did about it (docs/guard.md)."""
    left_out = sum(int((_get(f, "evidence") or {}).get("guarded_steps") or 0)
                   for f in members)
    if not left_out or headline is None:
        return headline
    return (f"{headline}; the ampwatch guard left out {left_out} "
            f"step{'s' if left_out > 1 else ''}, so their updates never reached the weights")


def _cause_name(members: list[Any], grouped: str) -> str:
    """The cause an incident is told as: of causes grouped as one, the one that went
    furthest (an absorbed overflow that later reached the loss is a forward overflow)."""
    named = {(_get(f, "evidence") or {}).get("cause") for f in members}
    if (grouped == Cause.FORWARD_OVERFLOW and Cause.FORWARD_OVERFLOW not in named
            and Cause.ABSORBED_OVERFLOW in named):
        return Cause.ABSORBED_OVERFLOW
    return grouped


def _what(finding: Any, layer: str | None, grouped: str | None,
          applied: int | None = None) -> str:
    """A timeline entry's words; a symptom in another layer names that layer. In a
    forward overflow's story, the non-finite steps of a gradient overflow are its
    gradients', not its outputs' first inf/NaN; after `applied` (the incident's first step
    applied with inf/NaN gradients) what happened is that update's doing."""
    what = _stage(finding)[1]
    other = _get(finding, "layer")
    step = _get(finding, "step")
    if applied is not None and step is not None and step > applied:
        return (f"weights inf/NaN after step {applied}'s update: {what}"
                + (f" in layer {other!r}" if other and other != layer else ""))
    if grouped == Cause.FORWARD_OVERFLOW and _get(finding, "kind") == FindingKind.NONFINITE \
            and (_get(finding, "evidence") or {}).get("cause") == Cause.GRAD_OVERFLOW:
        return "gradients inf/NaN" + (f" in layer {other!r}" if other and other != layer
                                      else "")
    if _get(finding, "kind") in SYMPTOMS and other and other != layer:
        return f"{what} in layer {other!r}"
    return what


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
