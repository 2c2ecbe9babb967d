"""Columnar step series: how a run's steps live in memory and in the database.

A batch of steps is stored as one row of packed arrays (see `models.Batch`): a float64
matrix of per-step scalars (`SCALAR_FIELDS` columns), a presence mask for them, and
float32 matrices of per-layer values. Queries concatenate the rows of a step range
into one `StepSeries`; detectors, the API and the pages all read that form.

Missing values: scalars use the mask; per-layer values use `MISSING` (-1.0), which no
norm, abs-max or time can take. NaN and infinities are stored as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ampwatch.server.fields import DTYPES
from ampwatch.wire import GUARD_REASONS
from ampwatch.wire import steps as step_fields

MISSING = np.float32(-1.0)

# Order is the storage format (see Batch.format): wire/steps.py declares them, append only
SCALAR_FIELDS: tuple[str, ...] = step_fields.names()
FIELD_INDEX = {name: i for i, name in enumerate(SCALAR_FIELDS)}
BOOL_FIELDS = frozenset(step_fields.names("bool"))
INT_FIELDS = frozenset(step_fields.names("count", "step", "layer"))

# dtype names <-> small integer codes (0 = none / missing): `fields.DTYPES` by index
DTYPE_CODE = {name: i for i, name in enumerate(DTYPES)}
RAW_FORMAT = 1  # a batch row's packed columns as they are (`Batch.format`)
COMPRESSED_FORMAT = 2  # the same, each compressed (server/store/codec.py): what is stored


def guard_code(reason: str) -> int:
    """A step guard reason's stored code (1..; 0 is none)."""
    return GUARD_REASONS.index(reason) + 1


def guard_reason(code: float) -> str | None:
    return GUARD_REASONS[int(code) - 1] if 1 <= code <= len(GUARD_REASONS) else None


def dtype_name(code: int) -> str | None:
    return DTYPES[code] or None if 0 <= code < len(DTYPES) else None


@dataclass
class StepSeries:
    """Steps of one run and rank, sorted by step, as columns.

    scalars: (n, len(SCALAR_FIELDS)) float64; present: same shape, bool.
    layer_grad: (n, L) float32 or None when no step carried per-layer grads.
    act_*: activation samples at `act_step` (m,), each (m, L); act_grad_zero: the share
    of exactly-zero grad elements per layer on those steps (None: never counted).
    """

    scalars: np.ndarray
    present: np.ndarray
    layer_grad: np.ndarray | None
    act_step: np.ndarray
    act_absmax: np.ndarray | None
    act_dtype: np.ndarray | None
    act_time: np.ndarray | None
    n_layers: int
    events: list[dict] = field(default_factory=list)
    act_grad_zero: np.ndarray | None = None

    @property
    def steps(self) -> np.ndarray:
        return self.scalars[:, 0].astype(np.int64)

    def __len__(self) -> int:
        return self.scalars.shape[0]

    def column(self, name: str) -> np.ndarray:
        """One scalar column; missing entries are NaN (use `has` to tell them apart)."""
        i = FIELD_INDEX[name]
        col = self.scalars[:, i].copy()
        col[~self.present[:, i]] = np.nan
        return col

    def has(self, name: str) -> np.ndarray:
        return self.present[:, FIELD_INDEX[name]]

    @property
    def skipped(self) -> np.ndarray:
        i = FIELD_INDEX["skipped"]
        return (self.scalars[:, i] != 0) & self.present[:, i]

    @property
    def guarded(self) -> np.ndarray:
        """Per step, the step guard's reason code (0: not left out by the guard)."""
        i = FIELD_INDEX["guarded"]
        return np.where(self.present[:, i], self.scalars[:, i], 0).astype(np.int64)

    @classmethod
    def empty(cls, n_layers: int) -> StepSeries:
        k = len(SCALAR_FIELDS)
        return cls(
            scalars=np.zeros((0, k)),
            present=np.zeros((0, k), dtype=bool),
            layer_grad=None,
            act_step=np.zeros(0, dtype=np.int64),
            act_absmax=None,
            act_dtype=None,
            act_time=None,
            n_layers=n_layers,
        )

    def take(self, index: np.ndarray) -> StepSeries:
        """The steps at positional `index` (activation samples whose step is kept)."""
        kept_steps = self.steps[index]
        act_keep = np.isin(self.act_step, kept_steps)
        kept = set(kept_steps.tolist()) if self.events else set()
        return StepSeries(
            scalars=self.scalars[index],
            present=self.present[index],
            layer_grad=None if self.layer_grad is None else self.layer_grad[index],
            act_step=self.act_step[act_keep],
            act_absmax=None if self.act_absmax is None else self.act_absmax[act_keep],
            act_dtype=None if self.act_dtype is None else self.act_dtype[act_keep],
            act_time=None if self.act_time is None else self.act_time[act_keep],
            n_layers=self.n_layers,
            events=[e for e in self.events if e.get("step") in kept],
            act_grad_zero=(None if self.act_grad_zero is None
                           else self.act_grad_zero[act_keep]),
        )


def concat(parts: list[StepSeries], n_layers: int) -> StepSeries:
    """Join batches into one series sorted by step; a step sent twice keeps its last copy."""
    events = [e for p in parts for e in p.events]
    parts = [p for p in parts if len(p)]
    if not parts:
        series = StepSeries.empty(n_layers)
        series.events = events
        return series
    scalars = np.concatenate([p.scalars for p in parts])
    present = np.concatenate([p.present for p in parts])

    def stack(attr: str, rows: list[int], fill: float | int) -> np.ndarray | None:
        if all(getattr(p, attr) is None for p in parts):
            return None
        blocks = []
        for p, n in zip(parts, rows, strict=True):
            block = getattr(p, attr)
            if block is None:
                dtype = np.uint8 if attr == "act_dtype" else np.float32
                block = np.full((n, n_layers), fill, dtype=dtype)
            blocks.append(block)
        return np.concatenate(blocks)

    layer_grad = stack("layer_grad", [len(p) for p in parts], MISSING)
    act_rows = [len(p.act_step) for p in parts]
    act_step = np.concatenate([p.act_step for p in parts])
    act_absmax = stack("act_absmax", act_rows, MISSING)
    act_dtype = stack("act_dtype", act_rows, 0)
    act_time = stack("act_time", act_rows, MISSING)
    act_grad_zero = stack("act_grad_zero", act_rows, MISSING)

    steps = scalars[:, 0]
    if np.all(np.diff(steps) > 0) and np.all(np.diff(act_step) > 0):
        # batches arrived in order (the usual case): no reordering copies
        return StepSeries(scalars, present, layer_grad, act_step.astype(np.int64), act_absmax,
                          act_dtype, act_time, n_layers, events, act_grad_zero)
    order = np.argsort(steps, kind="stable")
    if np.any(np.diff(steps[order]) == 0):
        # keep the last occurrence of each step
        rev = order[::-1]
        _, first_in_rev = np.unique(steps[rev], return_index=True)
        order = np.sort(rev[first_in_rev])
        order = order[np.argsort(steps[order], kind="stable")]
    act_order = np.argsort(act_step, kind="stable")
    if len(act_step) and np.any(np.diff(act_step[act_order]) == 0):
        rev = act_order[::-1]
        _, first_in_rev = np.unique(act_step[rev], return_index=True)
        act_order = np.sort(rev[first_in_rev])
        act_order = act_order[np.argsort(act_step[act_order], kind="stable")]
    return StepSeries(
        scalars=scalars[order],
        present=present[order],
        layer_grad=None if layer_grad is None else layer_grad[order],
        act_step=act_step[act_order].astype(np.int64),
        act_absmax=None if act_absmax is None else act_absmax[act_order],
        act_dtype=None if act_dtype is None else act_dtype[act_order],
        act_time=None if act_time is None else act_time[act_order],
        n_layers=n_layers,
        events=events,
        act_grad_zero=None if act_grad_zero is None else act_grad_zero[act_order],
    )
