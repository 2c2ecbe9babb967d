"""A folded finding's words inside its card: what it saw, never its own advice where its
card names another cause.

The scaler's, the non-finite and the FP8 findings end their message with the remedy for
the cause they saw (localize.fix_for_cause: "layer X overflows fp16 in the forward pass,
which no loss scale can fix: run it in fp32 ..."). Folded into a card of another cause (a
weight jump, whose fix says precision is not the cause), that sentence contradicts the
card; inside the card it reads as the card's consequence instead. Pure function of the
finding (API or ORM shaped) and its incident."""

from __future__ import annotations

from typing import Any

from ampwatch.server.analysis.causes import Cause
from ampwatch.server.analysis.localize import fix_for_cause
from ampwatch.server.findings.incident_folds import _get

# causes told as one (an absorbed overflow is a forward overflow seen a step earlier)
_SAME = {Cause.ABSORBED_OVERFLOW: Cause.FORWARD_OVERFLOW}


def told_in_card(finding: Any, cause: str | None, headline: str | None) -> str:
    """`finding`'s message as its card (of `cause`, titled `headline`) tells it: when the
    finding names a cause of its own that is not the card's, its remedy sentence is
    replaced by the card's cause; otherwise its message unchanged."""
    message = _get(finding, "message")
    evidence = _get(finding, "evidence") or {}
    own = evidence.get("cause")
    if (not own or not cause or not headline
            or _SAME.get(own, own) == _SAME.get(cause, cause)):
        return message
    layer = evidence["layer"] if "layer" in evidence else _get(finding, "layer")
    sentence = fix_for_cause(own, layer, evidence.get("dtype"))
    diagnosis = sentence.split(": ", 1)[0]
    at = message.find(diagnosis)
    if at < 0:
        return message
    told = headline[0].lower() + headline[1:]
    return f"{message[:at]}a consequence of this card's cause: {told}; follow its fix."
