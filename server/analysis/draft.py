"""What a detector returns: finding drafts, and which keys it looked at.

Detectors never touch the database; `store.apply_detections` turns drafts into
`Finding` rows (insert, update, resolve).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.wire import encode_tree

Severity = Literal["info", "warning", "critical"]
SEVERITY_RANK: dict[str, int] = {"info": 0, "warning": 1, "critical": 2}
NO_STEPS = np.zeros(0, dtype=np.int64)


@dataclass
class FindingDraft:
    """One condition a detector saw in the window it was given.

    key: stable dedupe key within (run, rank), e.g. "scaler_divergence:streak" or
        "misaligned_layer:fc:out_features".
    step, last_step: first and last step of the episode inside the window (None for
        run-level conditions that no step shows, such as a misaligned layer).
    occurrences: the steps the condition was seen at; the store counts the new ones.
    active: the condition still holds at the end of the window; False resolves it.
    evidence: JSON-ready numbers behind the message; non-finite floats are encoded
        as "NaN"/"Infinity" on construction (Postgres JSON rejects NaN).
    rank: the rank the finding lives on when it is not the analysed rank's (a comparison
        of ranks names the rank it is about); None: the analysed rank.
    """

    kind: FindingKind
    key: str
    severity: Severity
    message: str
    step: int | None = None
    last_step: int | None = None
    layer: str | None = None
    code: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    occurrences: np.ndarray = field(default_factory=lambda: NO_STEPS)
    active: bool = True
    rank: int | None = None

    def __post_init__(self) -> None:
        self.kind = FindingKind(self.kind)  # a kind no member names fails here, in its detector
        self.evidence = encode_tree(self.evidence)
        self.occurrences = np.asarray(self.occurrences, dtype=np.int64)

    @property
    def count(self) -> int:
        """How many times the window shows the condition (1 for run-level conditions)."""
        return int(self.occurrences.size) or 1


@dataclass
class Detection:
    """A detector's result.

    covers: keys (exact, or prefixes ending in ":") the detector evaluated in full: an
    open finding under them that got no draft this time has recovered and is resolved.
    Keys not covered (pitfalls, speed checks) stay open until a draft says otherwise.
    """

    drafts: list[FindingDraft] = field(default_factory=list)
    covers: tuple[str, ...] = ()

    def covered(self, key: str) -> bool:
        return any(key == c or (c.endswith(":") and key.startswith(c)) for c in self.covers)


def worst(severities: list[str]) -> Severity | None:
    """The most severe of `severities`, or None for an empty list."""
    return max(severities, key=SEVERITY_RANK.__getitem__, default=None)  # type: ignore[return-value]


def recent_steps(steps: np.ndarray, limit: int) -> list[int]:
    """The last `limit` of `steps` as plain ints, for evidence."""
    return [int(s) for s in steps[-limit:]]
