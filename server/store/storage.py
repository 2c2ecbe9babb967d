"""Packing batches into rows and reading step ranges back as `StepSeries`.

A batch row holds its steps as raw numpy bytes (little-endian), so reading a long
run is a handful of large reads and one `np.frombuffer` per row.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Sequence
from types import SimpleNamespace

import numpy as np
from psycopg.rows import namedtuple_row
from sqlalchemy import Integer, Row, Select, any_, bindparam, select
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from ampwatch.server.fields import MISSING_ENTRY
from ampwatch.server.models import Batch, Layer
from ampwatch.server.schemas.batches import StepIn
from ampwatch.server.store.codec import ITEMSIZE, decode_column
from ampwatch.server.store.per_layer import per_layer_block
from ampwatch.server.store.series import (
    COMPRESSED_FORMAT,
    DTYPE_CODE,
    MISSING,
    RAW_FORMAT,
    SCALAR_FIELDS,
    StepSeries,
    concat,
    guard_code,
)

_MISSING_F = float(MISSING)
_CORE_COLUMNS = (Batch.n_steps, Batch.n_layers, Batch.format, Batch.scalars, Batch.present,
                 Batch.events, Batch.superseded_from)
_LAYER_COLUMNS = (Batch.layer_grad,)
_ACT_COLUMNS = (Batch.act_step, Batch.act_absmax, Batch.act_dtype, Batch.act_time,
                Batch.act_grad_zero)

def pack_steps(steps: list[StepIn], n_layers: int,
               events: list[dict] | None = None) -> dict[str, bytes | None]:
    """Batch columns for `steps`; assumes per-layer vectors were checked against n_layers.
    Appends to `events` a `FLOAT32_CLAMPED` event per step with values float32 could not
    keep; raises InvalidInput for negative per-layer values (`per_layer.per_layer_block`)."""
    events = [] if events is None else events
    n = len(steps)
    k = len(SCALAR_FIELDS)
    scalars = np.zeros((n, k), dtype=np.float64)
    present = np.zeros((n, k), dtype=bool)
    for i, s in enumerate(steps):
        for j, name in enumerate(SCALAR_FIELDS):
            v = getattr(s, name)
            if v is None:
                continue
            if name == "autocast_dtype":
                v = DTYPE_CODE[v]
            elif name == "guarded":
                v = guard_code(v)
            scalars[i, j] = float(v)
            present[i, j] = True

    out: dict[str, bytes | None] = {
        "scalars": scalars.tobytes(),
        "present": present.tobytes(),
        "layer_grad": None,
        "act_step": None,
        "act_absmax": None,
        "act_dtype": None,
        "act_time": None,
        "act_grad_zero": None,
    }
    if any(s.layer_grad_norm is not None for s in steps):
        none_row = [MISSING_ENTRY] * n_layers
        out["layer_grad"] = per_layer_block(
            [none_row if s.layer_grad_norm is None else s.layer_grad_norm for s in steps],
            [s.step for s in steps], "layer_grad_norm", events).tobytes()
    # sampled steps: activations and/or zero-grad shares, one row each
    sampled = [s for s in steps
               if s.activations is not None or s.layer_grad_zero_share is not None]
    if sampled:
        none_row, no_dtypes = [MISSING_ENTRY] * n_layers, [None] * n_layers
        acts = [s.activations for s in sampled]
        sampled_steps = [s.step for s in sampled]
        out["act_step"] = np.array(sampled_steps, dtype=np.int64).tobytes()
        out["act_absmax"] = per_layer_block(
            [none_row if a is None else a.absmax for a in acts], sampled_steps,
            "activations.absmax", events).tobytes()
        out["act_dtype"] = np.array(
            [[DTYPE_CODE[d] if d else 0 for d in (a is not None and a.dtype or no_dtypes)]
             for a in acts],
            dtype=np.uint8,
        ).tobytes()
        out["act_time"] = per_layer_block(
            [a is not None and a.time_ms or none_row for a in acts], sampled_steps,
            "activations.time_ms", events).tobytes()
        if any(s.layer_grad_zero_share is not None for s in sampled):
            out["act_grad_zero"] = per_layer_block(
                [none_row if s.layer_grad_zero_share is None else s.layer_grad_zero_share
                 for s in sampled], sampled_steps,
                "layer_grad_zero_share", events).tobytes()
    return out


def vector_length_errors(steps: list[StepIn], n_layers: int) -> list[str]:
    """Human-readable complaints about per-layer vectors of the wrong length."""
    errors = []
    for s in steps:
        if s.first_nonfinite_layer is not None and s.first_nonfinite_layer >= n_layers:
            errors.append(f"step {s.step}: first_nonfinite_layer {s.first_nonfinite_layer} "
                          f"is not in the run's layer table of {n_layers}")
        vectors = {"layer_grad_norm": s.layer_grad_norm,
                   "layer_grad_zero_share": s.layer_grad_zero_share}
        if s.activations is not None:
            vectors |= {
                "activations.absmax": s.activations.absmax,
                "activations.dtype": s.activations.dtype,
                "activations.time_ms": s.activations.time_ms,
            }
        for name, vec in vectors.items():
            if vec is not None and len(vec) != n_layers:
                errors.append(
                    f"step {s.step}: {name} has {len(vec)} entries, the run's layer table "
                    f"has {n_layers}"
                )
        if len(errors) >= 5:
            break
    return errors


def unpack_row(row, n_layers: int, with_layers: bool, with_acts: bool,
               layers: np.ndarray | None = None) -> StepSeries:
    """One stored batch as a StepSeries; with `layers` (indices), per-layer blocks keep
    only those layers' columns, in that order (so reading one layer of a long run copies
    n values, not n x L).
    Rows of storage format 2 have their columns compressed (server/store/codec.py). Steps a
    restart sent again (`superseded_from` on) are left out."""
    if getattr(row, "format", RAW_FORMAT) == COMPRESSED_FORMAT:
        row = _decoded(row, with_layers, with_acts)
    n = row.n_steps
    k = len(SCALAR_FIELDS)
    scalars = np.frombuffer(row.scalars, dtype=np.float64)
    # a batch packed with fewer scalar fields (older format) gets missing columns
    k_row = scalars.size // n if n else k
    scalars = scalars.reshape(n, k_row)
    present = np.frombuffer(row.present, dtype=bool).reshape(n, k_row)
    if k_row < k:
        scalars = np.pad(scalars, ((0, 0), (0, k - k_row)))
        present = np.pad(present, ((0, 0), (0, k - k_row)))
    width = row.n_layers

    def block(data: bytes, dtype, rows: int, fill) -> np.ndarray:
        full = np.frombuffer(data, dtype=dtype).reshape(rows, width)
        if layers is None:
            return _fit(full, n_layers, fill)
        picked = np.full((rows, len(layers)), fill, dtype=dtype)
        stored = layers < width  # a batch sent before the layer table grew lacks the rest
        picked[:, stored] = full[:, layers[stored]]
        return picked

    layer_grad = None
    if with_layers and row.layer_grad is not None:
        layer_grad = block(row.layer_grad, np.float32, n, MISSING)
    act_step = np.zeros(0, dtype=np.int64)
    act_absmax = act_dtype = act_time = act_grad_zero = None
    if with_acts and row.act_step is not None:
        act_step = np.frombuffer(row.act_step, dtype=np.int64)
        m = act_step.size
        act_absmax = block(row.act_absmax, np.float32, m, MISSING)
        act_dtype = block(row.act_dtype, np.uint8, m, 0)
        act_time = block(row.act_time, np.float32, m, MISSING)
        if row.act_grad_zero is not None:
            act_grad_zero = block(row.act_grad_zero, np.float32, m, MISSING)
    series = StepSeries(
        scalars=scalars,
        present=present,
        layer_grad=layer_grad,
        act_step=act_step,
        act_absmax=act_absmax,
        act_dtype=act_dtype,
        act_time=act_time,
        act_grad_zero=act_grad_zero,
        n_layers=n_layers if layers is None else len(layers),
        events=list(row.events or []),
    )
    cut = getattr(row, "superseded_from", None)
    return series if cut is None else steps_before(series, cut)


def steps_before(series: StepSeries, cut: int) -> StepSeries:
    """`series` without its steps (and their events) from `cut` on."""
    events = [e for e in series.events if e.get("step") is None or e["step"] < cut]
    kept = series.take(np.flatnonzero(series.steps < cut))
    kept.events = events
    return kept


def _decoded(row, with_layers: bool, with_acts: bool) -> SimpleNamespace:
    """The row with the columns that will be read decompressed."""
    wanted = ["scalars", "present"]
    if with_layers:
        wanted.append("layer_grad")
    if with_acts:
        wanted += ["act_step", "act_absmax", "act_dtype", "act_time", "act_grad_zero"]
    fields = {name: getattr(row, name, None) for name in
              ("n_steps", "n_layers", "events", "superseded_from", *ITEMSIZE)}
    for name in wanted:
        if fields[name] is not None:
            fields[name] = decode_column(fields[name], ITEMSIZE[name])
    return SimpleNamespace(**fields)


def _fit(block: np.ndarray, n_layers: int, fill) -> np.ndarray:
    """Batches sent before the layer table grew or shrank: pad or cut to n_layers."""
    width = block.shape[1]
    if width == n_layers:
        return block
    if width > n_layers:
        return block[:, :n_layers]
    return np.pad(block, ((0, 0), (0, n_layers - width)), constant_values=fill)


ONE_RANK, SOME_RANKS, EVERY_RANK = "one", "some", "every"


@functools.cache
def _batch_query(with_layers: bool, with_acts: bool, bounded_start: bool, bounded_end: bool,
                 newest_first: bool, ranks: str = ONE_RANK, postgres: bool = False) -> Select:
    """The batch read behind `load_batches`, with bind parameters run_id, rank, start and
    end; built once per shape (building a select costs about as much as running it on a
    500-step window). `ranks`: ONE_RANK (`rank`), SOME_RANKS (the list `ranks`; the rows
    come with their rank, in rank order) or EVERY_RANK of the run (likewise)."""
    columns = list(_CORE_COLUMNS)
    if with_layers:
        columns += _LAYER_COLUMNS
    if with_acts:
        columns += _ACT_COLUMNS
    query = select(*columns).where(Batch.run_id == bindparam("run_id"))
    if ranks == ONE_RANK:
        query = query.where(Batch.rank == bindparam("rank"))
    else:
        query = query.add_columns(Batch.rank).order_by(Batch.rank)
    if ranks == SOME_RANKS:  # psycopg's binary cursor takes a list as one array, not IN
        query = query.where(Batch.rank == any_(bindparam("ranks", type_=ARRAY(Integer)))
                            if postgres else Batch.rank.in_(bindparam("ranks", expanding=True)))
    if bounded_start:
        query = query.where(Batch.last_step >= bindparam("start"))
    if bounded_end:
        query = query.where(Batch.first_step <= bindparam("end"))
    # seq breaks ties so that a step sent twice reads back the same copy every time
    if newest_first:
        return query.order_by(Batch.last_step.desc(), Batch.seq.desc())
    return query.order_by(Batch.first_step, Batch.seq)


def load_batches(
    session: Session,
    run_id: str,
    rank: int,
    start: int | None = None,
    end: int | None = None,
    last_n: int | None = None,
    *,
    n_layers: int,
    with_layers: bool = True,
    with_acts: bool = True,
    layers: np.ndarray | None = None,
) -> list[StepSeries]:
    """The stored batches of one rank that overlap [start, end] (or the newest ones that
    hold its last `last_n` steps), whole and in step order; `load_series` joins and cuts
    them. Reads only the columns asked for: one row per stored batch in range."""
    query = _batch_query(with_layers, with_acts, start is not None, end is not None,
                         last_n is not None)
    params = {"run_id": run_id, "rank": rank}
    if start is not None:
        params["start"] = start
    if end is not None:
        params["end"] = end
    with _batch_rows(session, query, params) as result:
        if last_n is not None:
            rows, total = [], 0
            for row in result:
                rows.append(row)
                total += row.n_steps
                if total >= last_n:
                    break
            rows.reverse()
        else:
            rows = list(result)
    return [unpack_row(r, n_layers, with_layers, with_acts, layers) for r in rows]


def load_ranks_series(session: Session, run_id: str, ranks: Sequence[int] | None,
                      start: int | None = None, end: int | None = None, *, n_layers: int,
                      with_layers: bool = True, with_acts: bool = True
                      ) -> dict[int, StepSeries]:
    """`load_series` of several ranks (every rank of the run when `ranks` is None) in one
    statement: {rank: its steps in [start, end]}, every asked rank present. Cost: one row
    per stored batch in range of those ranks."""
    postgres = session.connection().dialect.name == "postgresql"
    query = _batch_query(with_layers, with_acts, start is not None, end is not None, False,
                         EVERY_RANK if ranks is None else SOME_RANKS, postgres)
    params: dict = {"run_id": run_id}
    if ranks is not None:
        params["ranks"] = list(ranks)
    if start is not None:
        params["start"] = start
    if end is not None:
        params["end"] = end
    parts: dict[int, list[StepSeries]] = {rank: [] for rank in ranks or ()}
    with _batch_rows(session, query, params) as result:
        for row in result:
            parts.setdefault(row.rank, []).append(
                unpack_row(row, n_layers, with_layers, with_acts))
    return {rank: clip_steps(concat(batches, n_layers), start, end)
            for rank, batches in parts.items()}


@contextlib.contextmanager
def _batch_rows(session: Session, query: Select, params: dict) -> Iterator[Iterable]:
    """Rows of a batch read, in the session's transaction. On Postgres they come in
    psycopg's binary format: in text format every bytea is hex-decoded, which made a
    100,000-step heatmap read take 2 to 3 times as long."""
    connection = session.connection()
    if connection.dialect.name != "postgresql":
        yield session.execute(query, params)
        return
    driver = connection.connection.driver_connection
    with driver.cursor(binary=True, row_factory=namedtuple_row) as cursor:
        cursor.execute(_postgres_sql(query), params)
        yield cursor


@functools.cache
def _postgres_sql(query: Select) -> str:
    return str(query.compile(dialect=postgresql.dialect()))


def load_series(
    session: Session,
    run_id: str,
    rank: int,
    start: int | None = None,
    end: int | None = None,
    last_n: int | None = None,
    *,
    n_layers: int | None = None,
    with_layers: bool = True,
    with_acts: bool = True,
    layers: np.ndarray | None = None,
) -> StepSeries:
    """Steps of one rank in [start, end] (inclusive), or its last `last_n` steps.

    Reads only the batch columns asked for; cost is one row per stored batch in range.
    With `layers` (indices), the per-layer blocks hold only those layers' columns.
    """
    if n_layers is None:
        n_layers = len(load_layers(session, run_id))
    parts = load_batches(session, run_id, rank, start, end, last_n, n_layers=n_layers,
                         with_layers=with_layers, with_acts=with_acts, layers=layers)
    width = n_layers if layers is None else len(layers)
    return clip_steps(concat(parts, width), start, end, last_n)


def clip_steps(series: StepSeries, start: int | None = None, end: int | None = None,
               last_n: int | None = None) -> StepSeries:
    """`series` cut to its steps in [start, end], then to its last `last_n` of them."""
    steps = series.steps
    keep = np.ones(len(series), dtype=bool)
    if start is not None:
        keep &= steps >= start
    if end is not None:
        keep &= steps <= end
    if last_n is not None and len(series) > last_n:
        keep[: len(series) - last_n] = False
    if not keep.all():
        series = series.take(np.flatnonzero(keep))
    return series


def load_layers(session: Session, run_id: str,
                indices: Sequence[int] | None = None) -> list[Layer]:
    """The run's layer table in index order; with `indices`, those layers in that order."""
    query = select(Layer).where(Layer.run_id == run_id)
    if indices is None:
        return list(session.scalars(query.order_by(Layer.index)))
    found = {layer.index: layer for layer in
             session.scalars(query.where(Layer.index.in_(list(indices))))}
    return [found[i] for i in indices]


def layer_rows(session: Session, run_id: str, indices: Sequence[int] | None = None
               ) -> list[Row]:
    """Index, name and forward_index of each layer (of those `indices`) in index order,
    without the JSON columns a whole `Layer` decodes (4x faster on a 10,000-layer run).
    `indices` are read as the range they span (a page of layers is one), then picked."""
    query = select(Layer.index, Layer.name, Layer.forward_index).where(Layer.run_id == run_id)
    if indices is not None:
        if not len(indices):
            return []
        wanted = set(indices)
        query = query.where(Layer.index.between(min(wanted), max(wanted)))
        return [row for row in session.execute(query.order_by(Layer.index))
                if row.index in wanted]
    return list(session.execute(query.order_by(Layer.index)))


def new_batch_row(run_id: str, rank: int, seq: int, steps: list[StepIn], n_layers: int,
                  events: list[dict]) -> dict:
    """Values for one INSERT into batches, its columns raw (`codec.encode_columns` makes
    the stored form); `events` and the server's own notes on the steps (values stored
    clamped)."""
    events = list(events or [])
    columns = pack_steps(steps, n_layers, events)  # adds a step's FLOAT32_CLAMPED event
    return {
        "run_id": run_id,
        "rank": rank,
        "seq": seq,
        "first_step": steps[0].step if steps else -1,
        "last_step": steps[-1].step if steps else -1,
        "n_steps": len(steps),
        "n_layers": n_layers,
        "format": RAW_FORMAT,
        "events": events or None,
        **columns,
    }

