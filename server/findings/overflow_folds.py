"""Folds around an overflowing layer: findings its growing outputs explain (risks after
it, gradient overflows it fed, the loss spikes and precursors it pushed up) join its
incident (server/findings/incidents.py groups, then calls these in turn)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ampwatch.server.analysis.causes import Cause
from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.findings.incident_folds import _first_step, _get, _last_step, may_follow

RISK = FindingKind.OVERFLOW_RISK
# the steps before a spike that its detector searches for what grew (the setting's default)
SPIKE_LOOKBACK = AnalysisSettings.model_fields["spike_lookback_steps"].default


def overflow_upstream(groups: Mapping[tuple, list[Any]], order: Mapping[str, int],
                       run_id: str, rank: int, layer: str, *, before: bool = False,
                       went_nonfinite: bool = False) -> tuple | None:
    """The key of the overflow incident of (run, rank) nearest at or before `layer` in
    forward order (`before`: strictly before; `before` or `went_nonfinite`: only one
    that went non-finite, not an overflow risk alone)."""
    position = order.get(layer)
    best, best_position = None, None
    for key, members in groups.items():
        if key[:3] != (run_id, rank, Cause.FORWARD_OVERFLOW) or (before and key[3] == layer):
            continue
        if (before or went_nonfinite) and all(_get(f, "kind") == RISK for f in members):
            continue
        culprit = order.get(key[3])
        if key[3] != layer and (position is None or culprit is None or culprit > position):
            continue
        culprit = culprit if culprit is not None else 0
        if best_position is None or culprit > best_position:
            best, best_position = key, culprit
    return best


def fold_downstream_risks(groups: dict[tuple, list[Any]], order: Mapping[str, int]) -> None:
    """Move each overflow-risk-only group of a layer after an overflowing one, begun no
    earlier than it, into that layer's group."""
    risks = [key for key, members in groups.items()
             if key[0] != "finding" and key[2] == Cause.FORWARD_OVERFLOW
             and all(_get(f, "kind") == RISK for f in members)]
    for key in risks:
        target = overflow_upstream(groups, order, key[0], key[1], key[3], before=True)
        began, target_began = _first_step(groups[key]), target and _first_step(groups[target])
        if target is not None and began is not None and target_began is not None \
                and began >= target_began:
            groups[target] += groups.pop(key)


def fold_gradient_overflows(groups: dict[tuple, list[Any]],
                             order: Mapping[str, int]) -> None:
    """Move each gradient-overflow group of an overflowing layer, or of a layer after it,
    begun no later than that layer's last non-finite step, into that layer's group: the
    layer's growing outputs scale the gradients of the layers they feed, which outgrow
    the loss scale (and the scaler skips and falls) before the outputs outgrow fp16."""
    grads = [key for key in groups if key[0] != "finding" and key[2] == Cause.GRAD_OVERFLOW]
    for key in grads:
        target = overflow_upstream(groups, order, key[0], key[1], key[3], went_nonfinite=True)
        began = _first_step(groups[key])
        if target is not None and began is not None and began <= _last_step(groups[target]):
            groups[target] += groups.pop(key)


def fold_spikes_into_overflows(groups: dict[tuple, list[Any]]) -> None:
    """Move each loss spike into the overflow incident of its rank whose layer went
    non-finite at most SPIKE_LOOKBACK steps after the spike (the window the spike
    detector searches for what grew) or while it lasted: that layer's growing
    activations explain the loss, and the spike is their symptom."""
    spikes = [key for key in groups if key[0] != "finding" and key[2] == Cause.LOSS_SPIKE]
    for key in spikes:
        spike_step = next((step for f in groups[key]
                           if (step := (_get(f, "evidence") or {}).get("spike_step"))
                           is not None), None)
        if spike_step is None:
            continue
        near = []
        for target, members in groups.items():
            if target[:3] != (key[0], key[1], Cause.FORWARD_OVERFLOW) \
                    or all(_get(f, "kind") == RISK for f in members):
                continue
            first, last = _first_step(members), _last_step(members)
            if first is not None and first - SPIKE_LOOKBACK <= spike_step <= last:
                near.append((first, target))
        if near:
            groups[min(near)[1]] += groups.pop(key)


def fold_precursors_into_overflows(groups: dict[tuple, list[Any]],
                                    order: Mapping[str, int]) -> None:
    """Move a precursor with no spike of its own (an output log-partition or attention
    logit grown) of a layer at or after an overflowing one into that layer's incident when
    it began no earlier than the overflow's first sign: the overflowing layer's outputs
    pushed it up, and its fix (z-loss, qk-layernorm) would not help."""
    loose = [key for key, members in groups.items() if key[0] == "finding"
             and _get(members[0], "kind") == FindingKind.SPIKE_PRECURSOR
             and may_follow(members, Cause.FORWARD_OVERFLOW)]
    for key in loose:
        lead = groups[key][0]
        target = overflow_upstream(groups, order, _get(lead, "run_id"), _get(lead, "rank"),
                                    _get(lead, "layer"))
        began = _first_step(groups[key])
        if target is not None and began is not None \
                and began >= (_first_step(groups[target]) or 0):
            groups[target] += groups.pop(key)
