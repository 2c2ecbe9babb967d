"""`ampwatch export`: the files read back equal what the API serves."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ampwatch.client import Client
from ampwatch.wire import decode_float, decode_tree
from tests.client.conftest import N_LAYERS
from tests.utils import make_steps, post_batch, register_run


def expected_rows(server_url: str, run_id: str, rank: int | None = None) -> dict:
    """(rank, step) -> {column: value}, straight from the API."""
    with Client(server_url) as client:
        rows = {(s.rank, s.step): s.to_json() for s in client.steps(run_id, rank=rank)}
        rows = {key: decode_tree(row) for key, row in rows.items()}
        for layer in client.layers(run_id):
            for r in {r for r, _ in rows}:
                series = client.layer_series(run_id, layer.index, rank=r)
                for point in series.grad:
                    rows[(r, point.step)][f"grad_norm[{layer.name}]"] = point.grad_norm
                for point in series.activations:
                    row = rows[(r, point.step)]
                    row[f"act_absmax[{layer.name}]"] = point.act_absmax
                    row[f"act_dtype[{layer.name}]"] = point.act_dtype
                    row[f"act_time_ms[{layer.name}]"] = point.act_time_ms
    return rows


def read_back(path: Path, fmt: str) -> list[dict[str, Any]]:
    if fmt == "jsonl":
        return [decode_tree(json.loads(line)) for line in path.read_text().splitlines()]
    if fmt == "parquet":
        pyarrow_parquet = pytest.importorskip("pyarrow.parquet")
        return pyarrow_parquet.read_table(path).to_pylist()
    with path.open(newline="") as source:
        return list(csv.DictReader(source))


def same(expected: Any, got: Any) -> bool:
    """Equal, reading CSV's text as the expected type would be written."""
    if isinstance(got, str) and not isinstance(expected, str):
        if got == "":
            got = None
        elif isinstance(expected, bool):
            got = got == "True"
        elif isinstance(expected, int):
            got = int(got)
        else:
            got = decode_float(got) if got in ("NaN", "Infinity", "-Infinity") else float(got)
    if isinstance(expected, float) and isinstance(got, float):
        return (math.isnan(expected) and math.isnan(got)) or expected == got
    return expected == got


@pytest.fixture(scope="module")
def two_ranks(server) -> str:
    """A run with two ranks, activations every 10 steps and inf grads on rank 1."""
    import httpx

    with httpx.Client(base_url=server.url) as api:
        register_run(api, "two-ranks", N_LAYERS)
        assert post_batch(api, "two-ranks", 0, make_steps(0, 40, N_LAYERS, sample_every=10),
                          rank=0).status_code == 200
        assert post_batch(api, "two-ranks", 0, make_steps(5, 30, N_LAYERS, sample_every=10,
                                                          skipped={7, 8}),
                          rank=1).status_code == 200
    return "two-ranks"


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
@pytest.mark.parametrize("run_id", ["diverging", "two-ranks"])
def test_export_equals_the_api(ampwatch, server, two_ranks, tmp_path: Path, fmt: str,
                               run_id: str) -> None:
    out = tmp_path / f"export.{fmt}"
    result = ampwatch("export", run_id, "--format", fmt, "--out", out)
    assert result.code == 0, result.err
    expected = expected_rows(server.url, run_id)
    rows = read_back(out, fmt)
    assert result.out.startswith(f"wrote {len(expected)} rows")
    assert len(rows) == len(expected)
    columns = list(rows[0])
    assert columns[:2] == ["rank", "step"]
    assert {f"grad_norm[blocks.{i}.fc]" for i in range(N_LAYERS)} <= set(columns)
    for row in rows:
        key = (int(row["rank"]), int(row["step"]))
        want = expected[key]
        for column in columns:
            assert same(want.get(column), row[column]), (key, column, want.get(column),
                                                         row[column])


def test_export_json_summary_rank_range_and_steps_only(ampwatch, two_ranks,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "rank1.jsonl"
    result = ampwatch("export", two_ranks, "--out", out, "--rank", "1", "--start", "6",
                      "--end", "9", "--steps-only", "--json")
    summary = json.loads(result.out)
    assert (summary["rows"], summary["format"], summary["path"]) == (4, "jsonl", str(out))
    rows = read_back(out, "jsonl")
    assert [(r["rank"], r["step"]) for r in rows] == [(1, 6), (1, 7), (1, 8), (1, 9)]
    assert rows[1]["grad_norm"] == math.inf and rows[1]["skipped"] is True
    assert list(rows[0]) == summary["columns"]
    assert not any("[" in column for column in summary["columns"])


def test_export_replaces_the_file_whole(ampwatch, tmp_path: Path) -> None:
    out = tmp_path / "steps.csv"
    out.write_text("old\n")
    assert ampwatch("export", "healthy", "--out", out).code == 0
    assert out.read_text().startswith("rank,step,")
    assert [p.name for p in tmp_path.iterdir()] == ["steps.csv"]


def test_parquet_without_pyarrow_names_the_extra_before_fetching(tmp_path) -> None:
    """pyarrow made unimportable in a child process; no server runs at all, so an answer
    naming the extra proves it was checked before anything was fetched."""
    script = ("import sys; sys.modules['pyarrow'] = None\n"
              "from ampwatch.client.cli import main\n"
              "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run(
        [sys.executable, "-c", script, "export", "some-run", "--out", "run.parquet",
         "--server", "http://127.0.0.1:9"], cwd=tmp_path, capture_output=True, text=True,
        timeout=60)
    assert done.returncode == 2
    assert "pip install 'ampwatch[parquet]'" in done.stderr, done.stderr
    assert not (tmp_path / "run.parquet").exists()


@pytest.mark.parametrize("target", ["tensorboard", "mlflow"])
def test_to_a_tracker_without_its_library_names_the_extra(tmp_path, target: str) -> None:
    """As for parquet: the tracker's library made unimportable, no server at all."""
    script = (f"import sys; sys.modules[{target!r}] = None\n"
              "from ampwatch.client.cli import main\n"
              "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run(
        [sys.executable, "-c", script, "export", "some-run", "--to", target, "tb",
         "--server", "http://127.0.0.1:9"], cwd=tmp_path, capture_output=True, text=True,
        timeout=60)
    assert done.returncode == 2
    assert "pip install 'ampwatch[trackers]'" in done.stderr, done.stderr
    assert not (tmp_path / "tb").exists()


def test_csv_cells_that_start_like_a_formula_are_text(tmp_path: Path) -> None:
    """A layer or field named like a formula is written with a leading ' (OWASP); numbers,
    negative ones too, as they are."""
    from ampwatch.client.export import ExportTable, _write_csv

    table = ExportTable(columns=["step", "=HYPERLINK(\"https://evil.example\",\"x\")/grad"],
                        rows=[{"step": -1, "=HYPERLINK(\"https://evil.example\",\"x\")/grad":
                               "@SUM(A1)"},
                              {"step": 2, "=HYPERLINK(\"https://evil.example\",\"x\")/grad":
                               -1.5}])
    path = tmp_path / "out.csv"
    _write_csv(table, path)
    rows = list(csv.reader(path.read_text().splitlines()))
    assert rows == [["step", "'=HYPERLINK(\"https://evil.example\",\"x\")/grad"],
                    ["-1", "'@SUM(A1)"], ["2", "-1.5"]]
