"""A run's steps and per-layer series as one flat table, written as CSV, JSON Lines or
Parquet. One row per (rank, step); per-layer values are columns named
`grad_norm[<layer>]`, and on sampled steps `act_absmax[<layer>]`, `act_dtype[<layer>]`,
`act_time_ms[<layer>]`."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import os
import tempfile
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from ampwatch.client.api import Client
from ampwatch.client.errors import AmpwatchError
from ampwatch.client.models import Step
from ampwatch.wire import encode_float, encode_tree

Format = Literal["csv", "jsonl", "parquet"]
FORMATS: tuple[Format, ...] = ("csv", "jsonl", "parquet")
STEP_COLUMNS = [f.name for f in dataclasses.fields(Step)]
ACTIVATION_FIELDS = ("act_absmax", "act_dtype", "act_time_ms")
Progress = Callable[[str], None]


@dataclasses.dataclass
class ExportTable:
    columns: list[str]
    rows: list[dict[str, Any]]


def run_table(client: Client, run_id: str, *, rank: int | None = None,
              start: int | None = None, end: int | None = None, layers: bool = True,
              progress: Progress | None = None) -> ExportTable:
    """Every step of the run in [start, end] (all ranks unless `rank`), with each layer's
    grad norm and sampled activations when `layers`. One request per page of steps and
    one per layer and rank."""
    steps = client.steps(run_id, start=start, end=end, rank=rank)
    rows = {(s.rank, s.step): dataclasses.asdict(s) for s in steps}
    columns = list(STEP_COLUMNS)
    if layers and rows:
        table = client.layers(run_id)
        ranks = sorted({r for r, _ in rows})
        grad_columns, act_columns = [], []
        for layer in table:
            if progress:
                progress(f"layer {layer.index + 1}/{len(table)}: {layer.name}")
            grad_columns.append(f"grad_norm[{layer.name}]")
            has_acts = False
            for r in ranks:
                series = client.layer_series(run_id, layer.index, rank=r, start=start, end=end)
                for point in series.grad:
                    if (row := rows.get((r, point.step))) is not None:
                        row[f"grad_norm[{layer.name}]"] = point.grad_norm
                for point in series.activations:
                    if (row := rows.get((r, point.step))) is not None:
                        has_acts = True
                        for name in ACTIVATION_FIELDS:
                            row[f"{name}[{layer.name}]"] = getattr(point, name)
            if has_acts:
                act_columns += [f"{name}[{layer.name}]" for name in ACTIVATION_FIELDS]
        columns += grad_columns + act_columns
    ordered = [rows[key] for key in sorted(rows)]
    return ExportTable(columns, [{c: row.get(c) for c in columns} for row in ordered])


def format_for(path: Path, given: str | None) -> Format:
    """The format named, else the one the file's suffix names; ValueError if neither."""
    name = given or path.suffix.lstrip(".").lower()
    if name == "ndjson":
        name = "jsonl"
    if name not in FORMATS:
        raise ValueError(f"cannot tell the format of {str(path)!r}: pass --format "
                         f"{'|'.join(FORMATS)}")
    return name  # type: ignore[return-value]


def write(table: ExportTable, path: Path, fmt: Format) -> None:
    """Write the table; the file appears whole or not at all (written beside it, then
    renamed). Non-finite floats: "NaN"/"Infinity"/"-Infinity" in CSV and JSON Lines (the
    API's encoding), native in Parquet; missing values: empty in CSV, null elsewhere."""
    writer = {"csv": _write_csv, "jsonl": _write_jsonl, "parquet": _write_parquet}[fmt]
    path = Path(path)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(descriptor)
    try:
        writer(table, Path(temporary))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _write_csv(table: ExportTable, path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        writer.writerow([_csv_cell(c) for c in table.columns])  # layer names among them
        for row in table.rows:
            writer.writerow([_csv_cell(row[c]) for c in table.columns])


FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _csv_cell(value: Any) -> Any:
    """A value as a spreadsheet should read it: text that starts like a formula gets a
    leading ' (OWASP's CSV injection advice: a layer named =HYPERLINK(...) stays text);
    numbers as they are, negative ones included."""
    if value is None:
        return ""
    if isinstance(value, float):
        return encode_float(value)
    if isinstance(value, str) and value.startswith(FORMULA_START):
        return "'" + value
    return value


def _write_jsonl(table: ExportTable, path: Path) -> None:
    with path.open("w", encoding="utf-8") as out:
        for row in table.rows:
            out.write(json.dumps(encode_tree(row), allow_nan=False) + "\n")


PARQUET_MISSING = ("parquet export needs pyarrow, which the ampwatch[parquet] extra "
                   "installs: pip install 'ampwatch[parquet]'")


def check_format_available(fmt: Format) -> None:
    """AmpwatchError naming the extra to install when `fmt` needs a package that is
    missing; cheap, so callers check before fetching a run."""
    if fmt != "parquet":
        return
    try:
        found = importlib.util.find_spec("pyarrow") is not None
    except ValueError:  # sys.modules maps it to None: importing it fails
        found = False
    if not found:
        raise AmpwatchError(PARQUET_MISSING)


def _write_parquet(table: ExportTable, path: Path) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise AmpwatchError(PARQUET_MISSING) from None
    columns = {c: [row[c] for row in table.rows] for c in table.columns}
    pq.write_table(pa.table({c: pa.array(v, type=_arrow_type(pa, c)) for c, v in
                             columns.items()}), path)


def _arrow_type(pa: Any, column: str) -> Any:
    """The column's declared type (from `Step`'s hints), so that an all-missing column
    keeps its type."""
    name = column.split("[", 1)[0]
    if "[" in column:
        return pa.string() if name == "act_dtype" else pa.float64()
    hint = typing.get_type_hints(Step)[name]
    base = next(a for a in typing.get_args(hint) or (hint,) if a is not type(None))
    return {int: pa.int64(), bool: pa.bool_(), str: pa.string()}.get(base, pa.float64())
