"""Folds of incidents (server/findings/incidents.py) whose cause is not an overflow: a
layer's weight jump absorbs what follows it downstream, and the clip-before-unscale pitfall
the optimizer states it starves; and the small accessors both modules share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ampwatch.server.analysis.causes import Cause
from ampwatch.server.analysis.kinds import KINDS, FindingKind

# the causes a layer's moved weights can set off at or after it (not a bad input)
AFTER_WEIGHTS = (Cause.FORWARD_OVERFLOW, Cause.ABSORBED_OVERFLOW, Cause.GRAD_OVERFLOW,
                 Cause.DIVERGENCE, Cause.NONFINITE_LOSS, Cause.LOSS_SPIKE)


def _get(finding: Any, name: str) -> Any:
    return finding[name] if isinstance(finding, Mapping) else getattr(finding, name)


def may_follow(members: list[Any], cause: Cause) -> bool:
    """Whether every finding of a group is of a kind that declares it may follow from
    `cause` (kinds.py's `follows`)."""
    return all(cause in (spec.follows if (spec := KINDS.get(_get(f, "kind"))) else ())
               for f in members)


def _code(finding: Any) -> str | None:
    """The finding's code; hand-made findings may leave it out."""
    return (finding.get("code") if isinstance(finding, Mapping)
            else getattr(finding, "code", None))


def _first_step(members: list[Any]) -> int | None:
    return min((s for f in members if (s := _get(f, "step")) is not None), default=None)


def _last_step(members: list[Any]) -> int:
    return max((s for f in members
                if (s := _get(f, "last_step") if _get(f, "last_step") is not None
                    else _get(f, "step")) is not None), default=-1)


def _moved(members: list[Any]) -> tuple[int, set[str] | None] | None:
    """What a weight-jump group's weights can explain: (the first step: the step after the
    sample before a jump, or where a growth began rising; for a growth, the layers after
    it whose outputs grew with it (server/analysis/weights.py), None for a jump, whose
    step-sized rescale explains everything after it). None without either."""
    for finding in members:
        evidence = _get(finding, "evidence") or {}
        if _get(finding, "kind") != FindingKind.WEIGHT_JUMP:
            continue
        if _code(finding) == "weight_jump" and evidence.get("before_step") is not None:
            return evidence["before_step"] + 1, None
        if _code(finding) == "weight_growth" and evidence.get("growth_step") is not None:
            return evidence["growth_step"], set(evidence.get("carried") or ())
    return None


def _of_gradients(members: list[Any]) -> bool:
    """Whether every finding of a group is about a gradient tensor (an FP8 cast's `grad`):
    gradients flow backward, so a layer before the moved weights gets their larger
    gradients too."""
    return all((_get(f, "evidence") or {}).get("tensor") == "grad" for f in members)


def fold_into_weight_jumps(groups: dict[tuple, list[Any]], order: Mapping[str, int]) -> None:
    """Move what followed a layer's weight jump into its incident: on its rank, groups
    whose kinds all declare they may follow a weight jump (kinds.py) and, when grouped by
    a cause, of one it can set off (an overflow, gradient overflow, divergence, non-finite
    loss or loss spike, not a bad input), begun after the sample before the jump while
    the weights stayed moved (or since a growth began rising: a growth alone is info, but
    the top card must name the layer where the growth starts, not the first one downstream
    to cross a line), in that layer or one after it in forward order (or with no layer; or
    before it, for a gradient's FP8 cast); for a growth, only in that layer or one whose
    outputs grew with it, or a gradient overflow of the layer just after one of those
    (its weights' gradients are taken on the grown output). The larger weights explain
    them."""
    jumps = [key for key in groups if key[0] != "finding" and key[2] == Cause.WEIGHT_JUMP]
    for key in sorted(jumps, key=lambda k: _first_step(groups[k]) or 0):
        if key not in groups:
            continue
        moved = _moved(groups[key])
        if moved is None:
            continue
        begun, reach = moved
        end, position = _last_step(groups[key]), order.get(key[3])
        for other in [k for k in groups if k != key]:
            members = groups[other]
            lead = members[0]
            if (_get(lead, "run_id"), _get(lead, "rank")) != key[:2]:
                continue
            follows = may_follow(members, Cause.WEIGHT_JUMP) and (
                other[0] == "finding" or other[2] in AFTER_WEIGHTS)
            layer = other[3] if other[0] != "finding" else _get(lead, "layer")
            if reach is None:
                at = order.get(layer) if layer not in (None, "-") else None
                downstream = (layer in (None, "-", key[3]) or layer.startswith("step ")
                              or (position is not None and at is not None and at >= position)
                              or _of_gradients(members))
            else:  # a growth: its own layer, those whose outputs grew with it, a module
                # holding it (computed from its weights), and gradients flowing back through it
                named = {layer, *(_get(f, "layer") for f in members)} - {None}
                output = max(order, key=order.get) if order else None
                downstream = bool(named & (reach | {key[3]})) or any(
                    # the loss is the output's: a growth carried to it explains a spike
                    not name or name.startswith("step ") for name in named | {layer}
                ) and output in reach | {key[3]} or any(
                    key[3].startswith(f"{name}.") for name in named) or (
                    other[0] != "finding" and other[2] == Cause.GRAD_OVERFLOW
                    and order.get(layer) is not None and (
                        (position is not None and order[layer] <= position)
                        # its weights' gradients are taken on an input that grew: the
                        # output of the grown layer or of one carried, just before it
                        or order[layer] - 1 in {order[n] for n in reach | {key[3]}
                                                if n in order}))
            first = _first_step(members)
            if follows and downstream and first is not None and begun <= first <= end:
                groups[key] += groups.pop(other)


def fold_sibling_growths(groups: dict[tuple, list[Any]]) -> None:
    """Merge the weight growths of sibling layers (one parent module: an attention's
    q_proj and k_proj) that began at the same sample into one group: scaled together,
    they are one cause (the product they feed grows with both), one card."""
    growths: dict[tuple, list[tuple]] = {}
    for key, members in groups.items():
        span = _growth_span(members) if key[0] != "finding" and key[2] == Cause.WEIGHT_JUMP \
            else None
        if span is not None and "." in key[3]:
            growths.setdefault((*key[:2], key[3].rsplit(".", 1)[0], span[0]), []).append(key)
    for siblings in growths.values():
        first, *rest = sorted(siblings, key=lambda k: k[3])
        for other in rest:
            groups[first] += groups.pop(other)


def grown_layers(members: list[Any]) -> list[str]:
    """The layers whose weights moved, of an incident's weight findings, in order."""
    return sorted({_get(f, "layer") for f in members
                   if _get(f, "kind") == FindingKind.WEIGHT_JUMP and _get(f, "layer")})


def fold_into_lr_changes(groups: dict[tuple, list[Any]]) -> None:
    """Move what a learning-rate change set off into one card. A loss spike named after the
    change (`lr_change`, at `lr_step`) takes the change's own note, the weight growths that
    began between their last sample before the change and the first after it (every
    layer the larger updates moved, with what they explain), and the groups whose kinds
    may follow moved weights begun at or after the change, before the spike ended or while
    it is open (the logits the larger updates grow). A change no spike followed takes its
    weight growths into its own note (server/analysis/lr_changes.py). One change, one
    card."""
    spikes = [key for key, members in groups.items()
              if key[0] != "finding" and key[2] == Cause.LOSS_SPIKE
              and _lr_step(members) is not None]
    notes = [key for key in groups if key[0] != "finding" and key[2] == Cause.LR_CHANGE]
    for key in [*spikes, *notes]:
        if key not in groups:
            continue
        lead, changed, end = groups[key][0], _lr_step(groups[key]), _last_step(groups[key])
        spiked = key[2] == Cause.LOSS_SPIKE
        still_open = any(_get(f, "status") == "open" for f in groups[key])
        for other in [k for k in groups if k != key]:
            members = groups[other]
            if (_get(members[0], "run_id"), _get(members[0], "rank")) != \
                    (_get(lead, "run_id"), _get(lead, "rank")):
                continue
            growth = _growth_span(members)
            first = _first_step(members)
            if other[0] != "finding" and other[2] == Cause.LR_CHANGE:
                set_off = spiked and _lr_step(members) == changed
            elif growth is not None:
                set_off = growth[0] <= changed <= growth[1]
            else:
                set_off = (spiked and other[0] == "finding"
                           and may_follow(members, Cause.WEIGHT_JUMP)
                           and first is not None and changed <= first
                           and (first <= end or still_open))
            if set_off:
                groups[key] += groups.pop(other)


def _lr_step(members: list[Any]) -> int | None:
    """The step of the learning-rate change a group is told from: its spike's cause, or
    its own change note."""
    for f in members:
        evidence = _get(f, "evidence") or {}
        if evidence.get("lr_step") is not None and (
                _get(f, "kind") == FindingKind.LR_CHANGE
                or (_get(f, "kind") == FindingKind.LOSS_SPIKE
                    and evidence.get("label") == "lr_change")):
            return evidence["lr_step"]
    return None


def _growth_span(members: list[Any]) -> tuple[int, int] | None:
    """(last sample before, first sample after) the start of a weight growth group's
    growth; None for any other group."""
    for f in members:
        evidence = _get(f, "evidence") or {}
        if _get(f, "kind") == FindingKind.WEIGHT_JUMP and _code(f) == "weight_growth" \
                and evidence.get("growth_step") is not None:
            return evidence["growth_step"], evidence.get("rise_step", evidence["growth_step"])
    return None


def fold_into_poisoning_steps(groups: dict[tuple, list[Any]]) -> None:
    """Move what began after a step applied with inf/NaN gradients into that step's
    incident: from the next step the weights it updated are inf/NaN, so every layer they
    feed goes non-finite, the scaler skips and the loss is NaN; a consequence of that
    step (its cause: a bad input, an overflow), not a cause of its own. Groups whose kinds
    may follow moved weights (kinds.py), of the same run and rank, begun after the first
    such step; the earliest poisoning step takes them."""
    poisoned = sorted(
        ((applied, key) for key, members in groups.items()
         if (applied := first_applied(members)) is not None), key=lambda item: item[0])
    for applied, key in poisoned:
        if key not in groups:
            continue
        lead = groups[key][0]
        for other in [k for k in groups if k != key]:
            members = groups[other]
            first = _first_step(members)
            if (_get(members[0], "run_id"), _get(members[0], "rank")) == \
                    (_get(lead, "run_id"), _get(lead, "rank")) \
                    and first is not None and first > applied \
                    and may_follow(members, Cause.WEIGHT_JUMP):
                groups[key] += groups.pop(other)


def first_applied(members: list[Any]) -> int | None:
    """The first step of a group applied with inf/NaN gradients (the nonfinite detector's
    evidence); None when none was."""
    return min((step for f in members
                if (step := (_get(f, "evidence") or {}).get("first_applied_step")) is not None),
               default=None)


def fold_into_clip_before_unscale(groups: dict[tuple, list[Any]]) -> None:
    """Move the groups whose kinds may follow the pitfall (kinds.py: the optimizer
    states, eps dominating or the second moment at zero) of its run, begun no earlier,
    into the clip-before-unscale pitfall: clipping the
    scaled gradients makes the update the optimizer sees loss-scale times smaller, which
    is exactly what starves Adam's moments; one fix (unscale_ before clipping) for all."""
    pitfalls = [key for key, members in groups.items() if key[0] == "finding"
                and _get(members[0], "kind") == "pitfall"
                and _code(members[0]) == Cause.CLIP_BEFORE_UNSCALE]
    for key in pitfalls:
        run_id, began = _get(groups[key][0], "run_id"), _first_step(groups[key]) or 0
        for other in [k for k, members in groups.items() if k != key]:
            members = groups[other]
            if may_follow(members, Cause.CLIP_BEFORE_UNSCALE) \
                    and _get(members[0], "run_id") == run_id \
                    and (_first_step(members) or 0) >= began:
                groups[key] += groups.pop(other)
