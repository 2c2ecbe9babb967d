"""An incident as a tracker is told it (agent/mirror, `ampwatch export --to`): what changed,
what went wrong, where, since when, what to do, where to read more, which bundle."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ampwatch.wire.bundles import bundle_name

CHANGES = ("opened", "escalated", "resolved", "reopened", "handled")


def first_change(status: str) -> str:
    """The change an incident first seen with `status` is told as: opened, handled or
    resolved."""
    return "opened" if status == "open" else status


@dataclass(frozen=True)
class IncidentNote:
    id: int
    change: str  # one of CHANGES
    status: str  # open, handled (a person marked it, quiet since: open nowhere), resolved
    severity: str
    headline: str
    layer: str | None
    step: int | None
    fix: str | None
    link: str
    bundle: str | None  # the bundle file's name (`ampwatch replay` reads it), if any

    @classmethod
    def from_incident(cls, incident: dict[str, Any], change: str, link: str,
                      bundle: str | None, message: str | None = None) -> IncidentNote:
        """From the API's incident JSON; an incident without a headline (one finding of
        no known cause) is told by its finding's `message`, else its first timeline entry."""
        timeline = incident.get("timeline") or []
        headline = incident.get("headline") or message or (
            timeline[0]["what"] if timeline else str(incident.get("cause") or "finding"))
        return cls(id=int(incident["id"]), change=change, status=incident["status"],
                   severity=incident["severity"], headline=headline,
                   layer=incident.get("layer"), step=incident.get("step"),
                   fix=incident.get("fix"), link=link, bundle=bundle)

    def title(self) -> str:
        return f"ampwatch: {self.severity} incident {self.change}: {self.headline}"[:250]

    def one_line(self) -> str:
        where = f" in {self.layer}" if self.layer and self.layer != "-" else ""
        since = f" from step {self.step}" if self.step is not None else ""
        return (f"{self.status} ({self.severity}, {self.change}){since}{where}: "
                f"{self.headline}")[:5000]

    def markdown(self) -> str:
        lines = [f"**{self.severity} incident {self.change}** ({self.status}): {self.headline}",
                 "", f"- layer: {self.layer or '-'}"]
        if self.step is not None:  # a setup finding (a model too small for AMP) has none
            lines.append(f"- first step: {self.step}")
        if self.fix:
            lines.append(f"- fix: {self.fix}")
        if self.bundle:
            lines.append(f"- bundle: {self.bundle} (`ampwatch replay` reproduces the step)")
        lines.append(f"- ampwatch: {self.link}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def bundle_for(incident: dict[str, Any], bundles: list[dict[str, Any]]) -> str | None:
    """The name of the bundle of the incident's rank recorded nearest after its first step
    (within its steps), None when there is none."""
    first, last = incident.get("step"), incident.get("last_step")
    if first is None:
        return None
    steps = [b["step"] for b in bundles if b.get("rank") == incident.get("rank")
             and b["step"] >= first and (last is None or b["step"] <= last)]
    return bundle_name(min(steps)) if steps else None
