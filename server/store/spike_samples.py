"""Spike signals of sampled steps (docs/spikes.md): packing them into `SpikeSample` rows,
reading a step range back as a `SpikeWindow`, and folding a signal into a layers x step
buckets matrix for the layers page's heatmaps.

A row is one float32 block (signals x layers, NaN where a layer was not measured),
compressed (server/store/codec.py): most entries are NaN (only attention layers have a logit,
only the output layer a log-partition), which the codec's delta planes store in a few
bytes. Sampled, so a 1,000,000-step run holds about 100,000 rows per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ampwatch.server.db import StepPages, dialect_insert
from ampwatch.server.fields import missing_entries
from ampwatch.server.models import SpikeSample
from ampwatch.server.schemas.batches import SpikesIn, StepIn
from ampwatch.server.store.codec import decode_column, encode_array
from ampwatch.wire import encode_float

SIGNALS = tuple(SpikesIn.model_fields)  # storage order follows the wire schema
READ_ROWS = 1000  # samples read per query: memory does not grow with the run


@dataclass
class SpikeWindow:
    """Sampled steps (m,) and values (m, signals, L) float64, NaN where not measured."""

    steps: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return int(self.steps.size)

    def signal(self, name: str) -> np.ndarray:
        """(m, L) values of one signal."""
        return self.values[:, SIGNALS.index(name)]

    @classmethod
    def empty(cls, n_layers: int) -> SpikeWindow:
        return cls(np.zeros(0, np.int64), np.zeros((0, len(SIGNALS), n_layers)))


def spike_length_errors(steps: list[StepIn], n_layers: int) -> list[str]:
    """Complaints about spike vectors whose length is not the run's layer count."""
    errors = []
    for s in steps:
        for name in SIGNALS if s.spikes is not None else ():
            vector = getattr(s.spikes, name)
            if vector is not None and len(vector) != n_layers:
                errors.append(f"step {s.step}: spikes.{name} has {len(vector)} entries, the "
                              f"run's layer table has {n_layers}")
        if len(errors) >= 5:
            break
    return errors


def _pack(spikes: SpikesIn, n_layers: int) -> bytes:
    values = np.full((len(SIGNALS), n_layers), np.nan, dtype=np.float32)
    for k, name in enumerate(SIGNALS):
        vector = getattr(spikes, name)
        if vector is not None:
            vector = np.array(vector, dtype=np.float64)
            vector[missing_entries(vector)] = np.nan
            values[k] = vector
    return encode_array(values)


def _unpack(row) -> np.ndarray:
    raw = np.frombuffer(decode_column(row.values, 4), dtype=np.float32)
    stored = raw.reshape(-1, row.n_layers)
    if stored.shape[0] == len(SIGNALS):
        return stored
    # a row stored before the later signals existed (weight_norm): NaN for them
    out = np.full((len(SIGNALS), row.n_layers), np.nan, dtype=np.float32)
    out[: stored.shape[0]] = stored
    return out


def store_spike_samples(session: Session, run_id: str, rank: int, steps: list[StepIn],
                        n_layers: int) -> int:
    """Upsert the spike signals of `steps` (inside the caller's transaction); returns how
    many steps carried some. Assumes `spike_length_errors` found nothing."""
    rows = [{"run_id": run_id, "rank": rank, "step": s.step, "n_layers": n_layers,
             "values": _pack(s.spikes, n_layers)} for s in steps if s.spikes is not None]
    if rows:
        insert = dialect_insert(session, SpikeSample)
        session.execute(insert.on_conflict_do_update(
            index_elements=["run_id", "rank", "step"],
            set_={c: insert.excluded[c] for c in ("n_layers", "values")}), rows)
    return len(rows)


_SAMPLES = StepPages(SpikeSample, (SpikeSample.step, SpikeSample.n_layers, SpikeSample.values))


def _samples(session: Session, run_id: str, rank: int, start: int | None, end: int | None):
    """The rank's stored samples with start <= step <= end in step order, READ_ROWS a query."""
    return _SAMPLES.rows(session, run_id, rank, start, end, READ_ROWS)


def _fit(values: np.ndarray, n_layers: int) -> np.ndarray:
    """A sample stored with another layer count, cut or padded with NaN to `n_layers`."""
    if values.shape[1] == n_layers:
        return values
    out = np.full((values.shape[0], n_layers), np.nan, dtype=values.dtype)
    keep = min(n_layers, values.shape[1])
    out[:, :keep] = values[:, :keep]
    return out


def load_spike_window(session: Session, run_id: str, rank: int, n_layers: int, *,
                      start: int | None = None, end: int | None = None) -> SpikeWindow:
    """The rank's samples with start <= step <= end, sorted by step, `n_layers` wide."""
    steps, values = [], []
    for row in _samples(session, run_id, rank, start, end):
        steps.append(row.step)
        values.append(_fit(_unpack(row), n_layers))
    if not steps:
        return SpikeWindow.empty(n_layers)
    return SpikeWindow(np.array(steps, dtype=np.int64), np.stack(values).astype(np.float64))


def spike_matrix(session: Session, run_id: str, rank: int, signal: str, layers: list[int],
                 *, start: int | None, end: int | None, buckets: int) -> dict:
    """Layers x step buckets of one signal (the largest value per bucket; None where a
    bucket has none), shaped like `services.series.matrix_query`'s answer without the run fields.
    Reads READ_ROWS samples at a time; memory is layers x buckets."""
    bounds = [SpikeSample.run_id == run_id, SpikeSample.rank == rank]
    if start is not None:
        bounds.append(SpikeSample.step >= start)
    if end is not None:
        bounds.append(SpikeSample.step <= end)
    count, first, last = session.execute(select(
        func.count(), func.min(SpikeSample.step), func.max(SpikeSample.step)).where(*bounds)).one()
    wanted = np.array(layers, dtype=np.int64)
    if not count:
        return {"step_start": [], "step_end": [], "values": [[] for _ in layers]}
    k = SIGNALS.index(signal)
    n_buckets = min(buckets, count)
    edges = np.linspace(first, last + 1, n_buckets + 1)
    out = np.full((wanted.size, n_buckets), -np.inf)
    used = np.zeros(n_buckets, dtype=bool)
    for row in _samples(session, run_id, rank, first, last):
        column = _fit(_unpack(row), max(row.n_layers, int(wanted.max(initial=-1)) + 1))[k]
        which = min(int(np.searchsorted(edges, row.step, side="right")) - 1, n_buckets - 1)
        out[:, which] = np.fmax(out[:, which], np.nan_to_num(column[wanted], nan=-np.inf))
        used[which] = True
    out = out[:, used]
    starts = np.ceil(edges[:-1]).astype(np.int64)[used]
    ends = np.minimum(np.ceil(edges[1:]).astype(np.int64) - 1, last)[used]
    values = [[None if np.isneginf(v) else encode_float(float(v)) for v in row] for row in out]
    return {"step_start": starts.tolist(), "step_end": ends.tolist(), "values": values}
