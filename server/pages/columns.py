"""Wire-form query answers (server/services/series.py) back into numpy columns for the figures.

The JSON twins carry non-finite floats as "NaN"/"Infinity" strings and missing values
as null; a chart needs both told apart: a missing point is left out, a non-finite one
is drawn as a marker of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ampwatch.server.responses import FloatRows
from ampwatch.server.services.series import with_events
from ampwatch.wire import decode_float
from ampwatch.wire import steps as step_fields


def decode_values(values: list) -> tuple[np.ndarray, np.ndarray]:
    """(float64 values, mask of the entries that were sent): "NaN"/"Infinity" strings
    become NaN/inf, null becomes NaN with the mask False."""
    return _as_float(values), ~np.equal(np.array(values, dtype=object), None)


def decode_matrix(rows: list | FloatRows) -> tuple[np.ndarray, np.ndarray]:
    """A layers x buckets matrix, in wire form or as a query left it
    (`server.responses.FloatRows`): (float values, mask of empty cells)."""
    if isinstance(rows, FloatRows):
        missing = np.asarray(rows.missing, dtype=bool)
        return np.where(missing, np.float32(np.nan), rows.matrix), missing.copy()
    if not rows or not rows[0]:
        return np.zeros((len(rows), 0)), np.zeros((len(rows), 0), dtype=bool)
    return _as_float(rows), np.equal(np.array(rows, dtype=object), None)


def _as_float(values: list) -> np.ndarray:
    try:
        # numpy parses "NaN", "Infinity" and "-Infinity" itself, and null as NaN
        return np.array(values, dtype=np.float64)
    except ValueError:
        # any other string: let the wire decoder name it
        return np.vectorize(lambda v: math.nan if v is None else decode_float(v),
                            otypes=[np.float64])(np.array(values, dtype=object))


@dataclass
class StepColumns:
    """One line on the step charts: a rank of a run, or a whole run on /compare.

    values[name]: float64 (NaN where missing or NaN); present[name]: the value was sent.
    """

    label: str
    steps: np.ndarray
    values: dict[str, np.ndarray] = field(default_factory=dict)
    present: dict[str, np.ndarray] = field(default_factory=dict)

    FIELDS = step_fields.charted()  # the scalars a chart draws (wire/steps.py)

    @classmethod
    def from_items(cls, label: str, items: list[dict]) -> StepColumns:
        """From the rows of one rank of `with_events(steps_query(...))`."""
        steps = np.array([item["step"] for item in items], dtype=np.int64)
        columns = cls(label=label, steps=steps)
        for name in (*cls.FIELDS, "elapsed_ms"):  # elapsed_ms: series.with_elapsed
            columns.values[name], columns.present[name] = decode_values(
                [item.get(name) for item in items])
        columns.values["skipped"] = np.array([bool(item.get("skipped")) for item in items],
                                             dtype=bool)
        columns.present["skipped"] = np.ones(len(items), dtype=bool)
        return columns

    def __len__(self) -> int:
        return len(self.steps)

    def finite(self, name: str) -> np.ndarray:
        return np.isfinite(self.values[name])

    def nonfinite(self, name: str) -> np.ndarray:
        """Sent, but NaN or infinite."""
        return self.present[name] & ~np.isfinite(self.values[name])

    @property
    def skipped(self) -> np.ndarray:
        return self.values["skipped"]


def by_rank(steps: dict) -> list[StepColumns]:
    """Split a `steps_query` answer into one StepColumns per rank, lowest rank first."""
    ranks: dict[int, list[dict]] = {}
    for item in with_events(steps):
        ranks.setdefault(item["rank"], []).append(item)
    return [StepColumns.from_items(f"rank {rank}", items)
            for rank, items in sorted(ranks.items())]


@dataclass(frozen=True)
class LayerMatrix:
    """A `matrix_query` answer decoded once: layers x step buckets."""

    layers: list[str]
    step_start: np.ndarray
    step_end: np.ndarray
    values: np.ndarray  # float32 or float64; NaN/inf kept, NaN where empty
    empty: np.ndarray  # bool: the bucket had no value for the layer

    @classmethod
    def from_twin(cls, matrix: dict) -> LayerMatrix:
        values, empty = decode_matrix(matrix["values"])
        return cls(layers=list(matrix["layers"]),
                   step_start=np.asarray(matrix["step_start"], dtype=np.int64),
                   step_end=np.asarray(matrix["step_end"], dtype=np.int64),
                   values=values, empty=empty)
