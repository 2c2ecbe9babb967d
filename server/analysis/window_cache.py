"""The detector windows an analysis worker keeps in memory: each rank's recent batches,
unpacked, so judging a batch reads that batch and not the 500 steps before it again.

What a window holds is checked against storage on every use: one query of the batch
index (seq and step span of the batches in range, no per-layer data) says which batches
`load_batches` would return; those held are reused, the others read. So a window is never
stale, whoever stored, superseded or deleted batches meanwhile (another worker, a
restart, a delete), and after a restart of the worker it is rebuilt from storage by the
same path."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from ampwatch.server.models import Batch
from ampwatch.server.store.series import StepSeries
from ampwatch.server.store.storage import unpack_row

# What identifies a stored batch's content: its steps change only through a restart
# superseding them, which sets superseded_from.
BatchKey = tuple[int, int, int, int | None]  # seq, first_step, last_step, superseded_from

_INDEX = (Batch.seq, Batch.first_step, Batch.last_step, Batch.superseded_from)
_DATA = (Batch.seq, Batch.n_steps, Batch.n_layers, Batch.format, Batch.scalars,
         Batch.present, Batch.events, Batch.superseded_from, Batch.layer_grad,
         Batch.act_step, Batch.act_absmax, Batch.act_dtype, Batch.act_time,
         Batch.act_grad_zero)
# Built once: these run for every judged batch, and building a statement (and its cache
# key) cost more than running it.
_OF_RANK = (Batch.run_id == bindparam("run_id"), Batch.rank == bindparam("rank"))
_INDEX_IN_SPAN = (select(*_INDEX)
                  .where(*_OF_RANK, Batch.last_step >= bindparam("start"),
                         Batch.first_step <= bindparam("end"))
                  .order_by(Batch.first_step, Batch.seq))
_INDEX_OF_SEQ = select(*_INDEX).where(*_OF_RANK, Batch.seq == bindparam("seq"))
_DATA_OF_SEQS = select(*_DATA).where(*_OF_RANK, Batch.seq.in_(bindparam("seqs", expanding=True)))


class RankWindows:
    """Unpacked batches by (run, rank), with per-layer grads and activations, at most
    `max_bytes` of arrays in all (least recently used ranks go first; a rank that went
    is read from storage again when next judged). Thread-safe."""

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes = max_bytes
        self._ranks: OrderedDict[tuple[str, int], _Held] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.reads = 0  # batches read from storage (the rest came from memory)

    def batches(self, session: Session, run_id: str, rank: int, start: int, end: int, *,
                n_layers: int, with_layers: bool = True, keep_from: int | None = None
                ) -> list[StepSeries]:
        """What `storage.load_batches(session, run_id, rank, start, end, n_layers=...,
        with_layers=...)` returns, reading from storage only the batches not held.
        keep_from: forget the rank's batches that end before this step (the start of its
        next window); None keeps them. Costs one index query plus the batches read."""
        index = [tuple(row) for row in session.execute(
            _INDEX_IN_SPAN, {"run_id": run_id, "rank": rank, "start": start, "end": end})]
        with self._lock:
            held = self._ranks.get((run_id, rank))
            if held is None or held.n_layers != n_layers:
                held = _Held(n_layers)
            parts = dict(held.parts)
        missing = [key for key in index if key not in parts]
        if missing:
            parts.update(self._read(session, run_id, rank, missing, n_layers))
        found = [parts[key] for key in index]
        if keep_from is not None:
            parts = {k: p for k, p in parts.items() if k[2] >= keep_from}
        self._keep(run_id, rank, n_layers, parts)
        return found if with_layers else [replace(p, layer_grad=None) for p in found]

    def stored(self, session: Session, run_id: str, rank: int, seq: int, *,
               n_layers: int) -> StepSeries | None:
        """The stored batch (run, rank, seq) unpacked, as `unpack_row` gives it (None when
        it is gone: its run was deleted); held for the rank's next windows."""
        key = session.execute(_INDEX_OF_SEQ,
                              {"run_id": run_id, "rank": rank, "seq": seq}).first()
        if key is None:
            return None
        key = tuple(key)
        with self._lock:
            held = self._ranks.get((run_id, rank))
            part = None if held is None or held.n_layers != n_layers else held.parts.get(key)
            parts = {} if held is None or held.n_layers != n_layers else dict(held.parts)
        if part is None:
            part = self._read(session, run_id, rank, [key], n_layers)[key]
            parts[key] = part
            self._keep(run_id, rank, n_layers, parts)
        return part

    def offer(self, run_id: str, rank: int, key: BatchKey, part: StepSeries,
              keep_from: int) -> None:
        """Hold `part`, just stored under `key` and unpacked as `unpack_row` gives it, for
        its rank's next judgement (the ingest of a server with an embedded worker hands
        its batches over so: the worker then reads only their index row). Call after the
        commit: held parts are matched against what storage holds, never trusted.
        keep_from: forget the rank's batches that end before this step (the start of the
        part's own window), so a rank whose batches another worker judges stays bounded."""
        with self._lock:
            held = self._ranks.get((run_id, rank))
            same_width = held is not None and held.n_layers == part.n_layers
            parts = {**held.parts, key: part} if same_width else {key: part}
        self._keep(run_id, rank, part.n_layers,
                   {k: p for k, p in parts.items() if k[2] >= keep_from})

    @property
    def nbytes(self) -> int:
        return self._bytes

    def _read(self, session: Session, run_id: str, rank: int, keys: list[BatchKey],
              n_layers: int) -> dict[BatchKey, StepSeries]:
        by_seq = {key[0]: key for key in keys}
        rows = session.execute(_DATA_OF_SEQS,
                               {"run_id": run_id, "rank": rank, "seqs": list(by_seq)})
        self.reads += len(keys)
        return {by_seq[row.seq]: unpack_row(row, n_layers, True, True) for row in rows}

    def _keep(self, run_id: str, rank: int, n_layers: int,
              parts: dict[BatchKey, StepSeries]) -> None:
        held = _Held(n_layers, parts)
        with self._lock:
            old = self._ranks.pop((run_id, rank), None)
            self._bytes -= 0 if old is None else old.nbytes
            self._ranks[(run_id, rank)] = held
            self._bytes += held.nbytes
            while self._bytes > self.max_bytes and len(self._ranks) > 1:
                _, gone = self._ranks.popitem(last=False)
                self._bytes -= gone.nbytes


class _Held:
    """One rank's batches in memory, by key, and the bytes their arrays take."""

    def __init__(self, n_layers: int, parts: dict[BatchKey, StepSeries] | None = None):
        self.n_layers = n_layers
        self.parts = parts or {}
        self.nbytes = sum(_nbytes(p) for p in self.parts.values())


def _nbytes(series: StepSeries) -> int:
    arrays = (series.scalars, series.present, series.layer_grad, series.act_step,
              series.act_absmax, series.act_dtype, series.act_time, series.act_grad_zero)
    return sum(a.nbytes for a in arrays if a is not None)
