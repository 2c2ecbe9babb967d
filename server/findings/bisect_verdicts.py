"""The verdicts of `ampwatch replay --bisect` in the incidents' fixes. Replaying a bundle's
step is the project's own check of a cause: once it has run, the incident the bundle
belongs to gives the fix it found (the upcast that makes the step finite, or that the
cause is not the precision) instead of its cause's general remedy, which may recommend
the very upcast the replay refuted.

A bundle belongs to the incident of its rank that covers its step and began last (the one
the bad step started, not a condition that was already open): the run page's card links
it by the same rule. Pure functions; no database.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ampwatch.server.findings.incident_folds import _get
from ampwatch.server.findings.incidents import Incident
from ampwatch.wire.bundles import BisectVerdict

REPLAY = "ampwatch replay --bisect"


def reported_by(verdict: Mapping[str, Any]) -> str:
    """Who sent a verdict, for people: the sender's own `source` and the token it held
    (its short hash), or that it held none, so nothing vouches for it."""
    source = verdict.get("source") or "an unnamed sender"
    token = verdict.get("token")
    held = f"with the server's token {token}" if token else "without a token, unverified"
    return f"{source} {held}"


def incident_bundles(incidents: Iterable[Any], bundles: Iterable[Mapping[str, Any]]
                     ) -> dict[int, Mapping[str, Any]]:
    """Incident id -> its bundle (the first by step when several are its own); incidents
    and bundles as API JSON or objects with the same names."""
    incidents = [i for i in incidents if _get(i, "step") is not None]
    found: dict[int, Mapping[str, Any]] = {}
    for bundle in sorted(bundles, key=lambda b: b["step"]):
        covering = [i for i in incidents if _get(i, "rank") == bundle["rank"]
                    and _get(i, "step") <= bundle["step"]
                    <= (_get(i, "last_step") or _get(i, "step"))]
        if covering:
            found.setdefault(_get(max(covering, key=lambda i: _get(i, "step")), "id"), bundle)
    return found


def with_verdicts(incidents: list[Incident], bundles: Iterable[Mapping[str, Any]]
                  ) -> list[Incident]:
    """`incidents`, the fix of each whose bundle carries a verdict (`bisect`, as
    PUT .../bisect stored it) told by that verdict; a bundle whose step did not fail
    again when replayed changes nothing."""
    judged = incident_bundles(incidents, [b for b in bundles if b.get("bisect")])
    for incident in incidents:
        bundle = judged.get(incident.id)
        fix = bundle and bisect_fix(bundle["bisect"], bundle["step"], incident.layer,
                                    bundle.get("trigger"))
        if fix:
            incident.fix = fix
    return incidents


def bisect_fix(verdict: Mapping[str, Any], step: int, layer: str | None,
               trigger: str | None = None) -> str | None:
    """The fix a bisect verdict of step `step` calls for, on the incident's `layer`, and who
    reported it; None when the replay could not judge (the step did not fail again).
    `trigger`: what recorded the bundle (a loss spike is bad while finite)."""
    found = verdict.get("verdict")
    told = f"{REPLAY}, reported by {reported_by(verdict)}"
    if found == BisectVerdict.NOT_PRECISION:
        weights = f"the weights of layer {layer!r}" if layer else "the weights"
        outcome = ("is finite but still spikes: it was flagged as a loss spike, not an "
                   "overflow" if trigger == "loss_spike" else "still fails")
        return (f"Replaying step {step} with every layer in fp32 {outcome} ({told}): "
                f"the cause is not the precision; check {weights} and the learning rate, "
                "then the data.")
    if found == BisectVerdict.INPUT_NONFINITE:
        return (f"Replaying step {step} fails in any precision: its input holds inf/NaN "
                f"({told}); validate the data (torch.isfinite) before the forward pass "
                "and fix the loader.")
    if found != BisectVerdict.FIXED:
        return None
    fp8 = list(verdict.get("fp8_modules") or ())
    fp32 = [m for m in verdict.get("modules") or () if m not in fp8]
    keep = [f"keep {_names(fp32)} in fp32"] if fp32 else []
    if fp8:
        keep.append(f"keep {_names(fp8)} out of FP8 (convert_to_float8_training's "
                    "module_filter_fn)")
    upcast = " and ".join(keep)
    return (f"{upcast[0].upper()}{upcast[1:]}: replaying step {step} so makes it finite "
            f"({told}; it prints the code to paste).")


def _names(modules: list[str]) -> str:
    return ", ".join(repr(m) for m in modules)
