"""FP8 cast statistics of sampled steps: packing them into `Fp8Sample` rows, reading a
step range back as an `Fp8Window` (one row per sampled step; the FP8 signal is sampled,
so a 1,000,000-step run holds about 100,000 rows per rank), and the FP8 report, which
folds the samples into step buckets as it reads them.

A row holds only the columns of the layers the agent measured (the FP8 layers) with
their indices, compressed (server/store/codec.py): a sample of 1,000 layers of which 10 cast
to FP8 is a few hundred bytes, not the 60 KB of a dense float32 3 x 5 x 1,000 block.
Rows stored whole by older servers (`layers` NULL) still read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ampwatch.server.db import StepPages, dialect_insert
from ampwatch.server.fields import missing_entries
from ampwatch.server.models import Fp8Sample, Layer
from ampwatch.server.schemas.batches import Fp8In, StepIn
from ampwatch.server.store.codec import decode_column, encode_array
from ampwatch.wire import FP8_ROLES, FP8_STATS

# the storage layout follows the wire schema's field order (docs/wire-format.md)
ROLES, STATS = FP8_ROLES, FP8_STATS  # Fp8In and Fp8TensorIn hold these fields
def cast_formats(attrs: dict) -> dict[str, str]:
    """The FP8 format of each tensor role an FP8 layer casts, from its layer-table attrs
    (agent/fp8.py); a role kept in high precision is absent."""
    return {role: attrs[f"fp8_{role}_format"] for role in ROLES
            if attrs.get(f"fp8_{role}_format")}


READ_ROWS = 1000  # samples read per query: the report's memory does not grow with the run


@dataclass
class Fp8Window:
    """Sampled steps (m,), values (m, roles, stats, L) float32 (NaN where absent, and
    where the tensor itself was NaN) and present (m, roles, L) bool."""

    steps: np.ndarray
    values: np.ndarray
    present: np.ndarray

    def __len__(self) -> int:
        return int(self.steps.size)

    def stat(self, role: str, name: str) -> np.ndarray:
        """(m, L) values of one statistic of one role."""
        return self.values[:, ROLES.index(role), STATS.index(name)]

    def has(self, role: str) -> np.ndarray:
        return self.present[:, ROLES.index(role)]


def fp8_length_errors(steps: list[StepIn], n_layers: int) -> list[str]:
    """Complaints about FP8 vectors whose length is not the run's layer count."""
    errors = []
    for s in steps:
        if s.fp8 is None:
            continue
        for role in ROLES:
            tensor = getattr(s.fp8, role)
            for name in STATS if tensor is not None else ():
                if len(getattr(tensor, name)) != n_layers:
                    errors.append(f"step {s.step}: fp8.{role}.{name} has "
                                  f"{len(getattr(tensor, name))} entries, the run's layer "
                                  f"table has {n_layers}")
        if len(errors) >= 5:
            break
    return errors


def _pack(fp8: Fp8In, n_layers: int) -> dict[str, bytes]:
    """The stored columns of one sample: the layers with some statistic, and theirs."""
    values = np.full((len(ROLES), len(STATS), n_layers), np.nan, dtype=np.float32)
    present = np.zeros((len(ROLES), n_layers), dtype=bool)
    for r, role in enumerate(ROLES):
        tensor = getattr(fp8, role)
        if tensor is None:
            continue
        for k, name in enumerate(STATS):
            vector = np.array(getattr(tensor, name), dtype=np.float64)
            missing = missing_entries(vector)
            vector[missing] = np.nan
            values[r, k] = vector
            if name == "amax":
                present[r] = ~missing
    kept = np.flatnonzero(present.any(axis=0) | ~np.isnan(values).all(axis=(0, 1)))
    return {"layers": encode_array(kept.astype("<i4")),
            "values": encode_array(values[..., kept]),
            "present": encode_array(present[:, kept])}


def _unpack(row) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A stored sample as (layer indices (k,) ascending, values (roles, stats, k) float32,
    present (roles, k) bool)."""
    if row.layers is None:  # stored whole and raw, every layer
        layers = np.arange(row.n_layers)
        values, present = row.values, row.present
    else:
        layers = np.frombuffer(decode_column(row.layers, 4), dtype="<i4")
        values, present = decode_column(row.values, 4), decode_column(row.present, 1)
    k = layers.size
    return (layers, np.frombuffer(values, dtype=np.float32).reshape(len(ROLES), len(STATS), k),
            np.frombuffer(present, dtype=bool).reshape(len(ROLES), k))


def _gather(row, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The `wanted` layers' columns of a stored sample: values (roles, stats, w), NaN
    where the sample has none, and present (roles, w)."""
    layers, values, present = _unpack(row)
    at = np.searchsorted(layers, wanted)
    held = at < layers.size
    held[held] = layers[at[held]] == wanted[held]
    out = np.full((len(ROLES), len(STATS), wanted.size), np.nan, dtype=np.float32)
    seen = np.zeros((len(ROLES), wanted.size), dtype=bool)
    out[..., held] = values[..., at[held]]
    seen[:, held] = present[:, at[held]]
    return out, seen


def store_fp8_samples(session: Session, run_id: str, rank: int, steps: list[StepIn],
                      n_layers: int) -> int:
    """Upsert the FP8 statistics of `steps` (inside the caller's transaction); returns how
    many steps carried some. Assumes the vectors were checked with `fp8_length_errors`."""
    rows = [{"run_id": run_id, "rank": rank, "step": s.step, "n_layers": n_layers,
             **_pack(s.fp8, n_layers)} for s in steps if s.fp8 is not None]
    if rows:
        insert = dialect_insert(session, Fp8Sample)
        session.execute(insert.on_conflict_do_update(
            index_elements=["run_id", "rank", "step"],
            set_={c: insert.excluded[c] for c in ("n_layers", "values", "present", "layers")}),
            rows)
    return len(rows)


_SAMPLES = StepPages(Fp8Sample, (Fp8Sample.step, Fp8Sample.n_layers, Fp8Sample.values,
                                 Fp8Sample.present, Fp8Sample.layers))


def _samples(session: Session, run_id: str, rank: int, start: int | None, end: int | None):
    """The rank's stored samples with start <= step <= end, in step order, READ_ROWS rows
    a query (a server-side cursor would hold the Postgres connection as long)."""
    return _SAMPLES.rows(session, run_id, rank, start, end, READ_ROWS)


def load_fp8_window(session: Session, run_id: str, rank: int, n_layers: int, *,
                    start: int | None = None, end: int | None = None) -> Fp8Window:
    """The rank's FP8 samples with start <= step <= end, sorted by step, `n_layers` wide
    (dense: for the detectors' bounded windows; rows stored with another layer count are
    cut or padded as absent)."""
    every = np.arange(n_layers)
    steps, values, present = [], [], []
    for row in _samples(session, run_id, rank, start, end):
        sample, seen = _gather(row, every)
        steps.append(row.step)
        values.append(sample)
        present.append(seen)
    if not steps:
        return Fp8Window(np.zeros(0, np.int64),
                         np.zeros((0, len(ROLES), len(STATS), n_layers), np.float32),
                         np.zeros((0, len(ROLES), n_layers), bool))
    return Fp8Window(np.array(steps, dtype=np.int64), np.stack(values), np.stack(present))


class _ShareBuckets:
    """Per (layer, tensor) row, a share folded over step buckets as samples arrive: each
    bucket keeps its largest value (NaN where it saw none). With at most `buckets`
    samples (`count`), every sample is its own bucket. Holds rows x buckets floats."""

    def __init__(self, n_rows: int, count: int, first: int, last: int, buckets: int) -> None:
        self.each = count <= buckets
        self.n_rows = n_rows
        self.steps: list[int] = []
        self.columns: list[np.ndarray] = []
        if not self.each:
            self.edges = np.linspace(first, last + 1, buckets + 1)
            self.out = np.full((n_rows, buckets), -np.inf, dtype=np.float64)
            self.used = np.zeros(buckets, dtype=bool)

    def add(self, step: int, column: np.ndarray) -> None:
        if self.each:
            self.steps.append(step)
            self.columns.append(column)
            return
        which = min(max(int(np.searchsorted(self.edges, step, side="right")) - 1, 0),
                    self.out.shape[1] - 1)
        self.out[:, which] = np.maximum(self.out[:, which], np.nan_to_num(column, nan=-np.inf))
        self.used[which] = True

    def result(self) -> tuple[list[int], list[list[float]]]:
        """(first step of each bucket, rows x buckets values)."""
        if self.each:
            matrix = (np.stack(self.columns, axis=1) if self.columns
                      else np.zeros((self.n_rows, 0), np.float32))
            return self.steps, matrix.tolist()
        out = self.out[:, self.used]
        out[np.isneginf(out)] = np.nan
        return self.edges[:-1].astype(np.int64)[self.used].tolist(), out.tolist()


def fp8_report(session: Session, run_id: str, layers: list, rank: int, *,
               start: int | None, end: int | None, buckets: int) -> dict:
    """A run's FP8 layers with their latest cast statistics, and per (layer, tensor) the
    saturated and flushed-to-zero shares over step buckets (the JSON twin of the FP8 tab).
    `layers`: the run's layer rows (index, name, attrs). Reads the samples READ_ROWS at a
    time and keeps only the FP8 layers' columns: memory is rows x buckets, whatever the
    number of samples and layers."""
    fp8 = [x for x in sorted(layers, key=lambda x: x.index) if (x.attrs or {}).get("fp8_recipe")]
    wanted = np.array([x.index for x in fp8], dtype=np.int64)
    rows, labels = [], []
    for j, x in enumerate(fp8):
        for r, role in enumerate(ROLES):
            if (x.attrs or {}).get(f"fp8_{role}_format"):
                rows.append((r, j))
                labels.append(f"{x.name} · {role}")
    row_role = np.array([r for r, _ in rows], dtype=np.int64)
    row_layer = np.array([j for _, j in rows], dtype=np.int64)
    bounds = [Fp8Sample.run_id == run_id, Fp8Sample.rank == rank]
    if start is not None:
        bounds.append(Fp8Sample.step >= start)
    if end is not None:
        bounds.append(Fp8Sample.step <= end)
    count, first, last = session.execute(select(
        func.count(), func.min(Fp8Sample.step), func.max(Fp8Sample.step)).where(*bounds)).one()
    shares = {name: _ShareBuckets(len(rows), count, first, last, buckets)
              for name in ("underflow", "saturated")}
    latest_step = np.full((len(ROLES), wanted.size), -1, dtype=np.int64)
    latest = np.full((len(ROLES), len(STATS), wanted.size), np.nan, dtype=np.float32)
    # read up to the step counted: a sample stored meanwhile cannot outgrow the buckets
    for row in _samples(session, run_id, rank, start, last if count else end):
        values, seen = _gather(row, wanted)
        latest_step[seen] = row.step
        latest = np.where(seen[:, None, :], values, latest)
        for name, folded in shares.items():
            folded.add(row.step, values[row_role, STATS.index(name), row_layer])
    found = {}
    for name, folded in shares.items():
        steps, found[name] = folded.result()
    return {
        "layers": [{"index": x.index, "name": x.name, "recipe": x.attrs["fp8_recipe"],
                    "formats": {role: cast_formats(x.attrs).get(role) for role in ROLES},
                    "latest": {role: {"step": int(latest_step[r, j]),
                                      **{k: float(v) for k, v in zip(STATS, latest[r, :, j],
                                                                     strict=True)}}
                               for r, role in enumerate(ROLES) if latest_step[r, j] >= 0}}
                   for j, x in enumerate(fp8)],
        "rows": labels,
        "steps": steps,
        "underflow": found["underflow"],
        "saturated": found["saturated"],
        "samples": int(count),
    }


def has_fp8_layers(session: Session, run_id: str) -> bool:
    """Whether the run's layer table holds an FP8 layer (one with an `fp8_recipe`): kept
    when the run is archived, unlike its samples. Reads the run's layer rows' attrs."""
    return session.scalar(select(Layer.index).where(
        Layer.run_id == run_id, Layer.attrs["fp8_recipe"].as_string().is_not(None)).limit(1)
    ) is not None
