"""FP8 cast statistics of sampled steps: packing them into `Fp8Sample` rows and reading a
step range back as an `Fp8Window` (one row per sampled step; the FP8 signal is sampled,
so a 1,000,000-step run holds about 100,000 rows per rank)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ampwatch.server.models import Fp8Sample, Layer
from ampwatch.server.schemas import Fp8In, StepIn

ROLES = ("input", "weight", "grad")
STATS = ("amax", "scale", "rms", "saturated", "underflow")
_INSERTS = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}


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


def _pack(fp8: Fp8In, n_layers: int) -> tuple[bytes, bytes]:
    values = np.full((len(ROLES), len(STATS), n_layers), np.nan, dtype=np.float32)
    present = np.zeros((len(ROLES), n_layers), dtype=bool)
    for r, role in enumerate(ROLES):
        tensor = getattr(fp8, role)
        if tensor is None:
            continue
        for k, name in enumerate(STATS):
            vector = getattr(tensor, name)
            values[r, k] = [np.nan if v is None else v for v in vector]
        present[r] = [v is not None for v in tensor.amax]
    return values.tobytes(), present.tobytes()


def store_fp8_samples(session: Session, run_id: str, rank: int, steps: list[StepIn],
                      n_layers: int) -> int:
    """Upsert the FP8 statistics of `steps` (inside the caller's transaction); returns how
    many steps carried some. Assumes the vectors were checked with `fp8_length_errors`."""
    rows = []
    for s in steps:
        if s.fp8 is not None:
            values, present = _pack(s.fp8, n_layers)
            rows.append({"run_id": run_id, "rank": rank, "step": s.step,
                         "n_layers": n_layers, "values": values, "present": present})
    if rows:
        insert = _INSERTS[session.get_bind().dialect.name](Fp8Sample)
        session.execute(insert.on_conflict_do_update(
            index_elements=["run_id", "rank", "step"],
            set_={c: insert.excluded[c] for c in ("n_layers", "values", "present")}), rows)
    return len(rows)


def load_fp8_window(session: Session, run_id: str, rank: int, n_layers: int, *,
                    start: int | None = None, end: int | None = None) -> Fp8Window:
    """The rank's FP8 samples with start <= step <= end, sorted by step; rows stored with
    another layer count are cut or padded (as absent) to `n_layers`."""
    query = select(Fp8Sample.step, Fp8Sample.n_layers, Fp8Sample.values,
                   Fp8Sample.present).where(Fp8Sample.run_id == run_id,
                                            Fp8Sample.rank == rank)
    if start is not None:
        query = query.where(Fp8Sample.step >= start)
    if end is not None:
        query = query.where(Fp8Sample.step <= end)
    rows = session.execute(query.order_by(Fp8Sample.step)).all()
    m, shape = len(rows), (len(ROLES), len(STATS))
    values = np.full((m, *shape, n_layers), np.nan, dtype=np.float32)
    present = np.zeros((m, len(ROLES), n_layers), dtype=bool)
    for i, row in enumerate(rows):
        width = min(row.n_layers, n_layers)
        values[i, ..., :width] = np.frombuffer(row.values, dtype=np.float32).reshape(
            *shape, row.n_layers)[..., :width]
        present[i, :, :width] = np.frombuffer(row.present, dtype=bool).reshape(
            len(ROLES), row.n_layers)[:, :width]
    steps = np.array([row.step for row in rows], dtype=np.int64)
    return Fp8Window(steps, values, present)


def bucket_max(steps: np.ndarray, values: np.ndarray, buckets: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """Columns of `values` (rows x m samples) folded into at most `buckets` step buckets,
    each holding its largest value (NaN where a bucket saw none); returns (first step of
    each bucket, folded values). Every sample is kept when m <= buckets."""
    if steps.size <= buckets:
        return steps, values
    edges = np.linspace(steps[0], steps[-1] + 1, buckets + 1)
    which = np.clip(np.searchsorted(edges, steps, side="right") - 1, 0, buckets - 1)
    out = np.full((values.shape[0], buckets), -np.inf, dtype=np.float64)
    np.maximum.at(out.T, which, np.nan_to_num(values.T, nan=-np.inf))
    out[np.isneginf(out)] = np.nan
    used = np.unique(which)
    return edges[:-1].astype(np.int64)[used], out[:, used]


def fp8_report(session: Session, run_id: str, layers: list, rank: int, *,
               start: int | None, end: int | None, buckets: int) -> dict:
    """A run's FP8 layers with their latest cast statistics, and per (layer, tensor) the
    saturated and flushed-to-zero shares over step buckets (the JSON twin of the FP8 tab).
    `layers`: the run's layer rows (index, name, attrs)."""
    fp8 = [x for x in sorted(layers, key=lambda x: x.index) if (x.attrs or {}).get("fp8_recipe")]
    n_layers = max((x.index for x in layers), default=-1) + 1
    window = load_fp8_window(session, run_id, rank, n_layers, start=start, end=end)
    rows, labels = [], []
    for x in fp8:
        for role in ROLES:
            if (x.attrs or {}).get(f"fp8_{role}_format"):
                rows.append((x.index, role))
                labels.append(f"{x.name} · {role}")
    latest: dict[str, dict] = {}
    for x in fp8:
        latest[x.name] = {}
        for r, role in enumerate(ROLES):
            seen = np.flatnonzero(window.present[:, r, x.index]) if len(window) else []
            if len(seen):
                values = window.values[seen[-1], r, :, x.index]
                latest[x.name][role] = {"step": int(window.steps[seen[-1]]),
                                        **{k: float(v) for k, v in zip(STATS, values,
                                                                       strict=True)}}
    shares = {}
    steps = window.steps
    for name in ("underflow", "saturated"):
        matrix = np.array([window.stat(role, name)[:, index] for index, role in rows]
                          ).reshape(len(rows), len(window))
        steps, shares[name] = bucket_max(window.steps, matrix, buckets)
    return {
        "layers": [{"index": x.index, "name": x.name, "recipe": x.attrs["fp8_recipe"],
                    "formats": {role: x.attrs.get(f"fp8_{role}_format") for role in ROLES},
                    "latest": latest[x.name]} for x in fp8],
        "rows": labels,
        "steps": steps.tolist(),
        "underflow": shares["underflow"].tolist(),
        "saturated": shares["saturated"].tolist(),
        "samples": len(window),
    }


def has_fp8_layers(session: Session, run_id: str) -> bool:
    """Whether the run's layer table holds an FP8 layer (one with an `fp8_recipe`): kept
    when the run is archived, unlike its samples. Reads the run's layer rows' attrs."""
    return session.scalar(select(Layer.index).where(
        Layer.run_id == run_id, Layer.attrs["fp8_recipe"].as_string().is_not(None)).limit(1)
    ) is not None
