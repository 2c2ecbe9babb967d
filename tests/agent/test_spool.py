"""The spool: replay order, persisted sequence numbers, bounded size, locking."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ampwatch.agent.transport.spool import Spool, batch_text, read_entry
from tests.agent.factories import batches, bf16_loop, mlp, spooled


def _batch(n_steps: int) -> dict:
    return {"rank": 0, "seq": None, "dropped_batches": 0, "dropped_steps": 0,
            "steps": [{"step": i, "loss": 1.0} for i in range(n_steps)], "events": []}


def test_files_sort_in_seq_order_and_seq_survives_a_restart(tmp_path: Path) -> None:
    spool = Spool.for_run(tmp_path, "r1", 0, 1 << 20)
    for _ in range(12):
        spool.append("r1", 0, {"name": "x"}, _batch(2))
    names = [p.name for p in spool.pending()]
    assert [read_entry(p)["seq"] for p in spool.pending()] == list(range(12))
    assert names == sorted(names)
    for path in spool.pending():
        spool.remove(path)
    spool.close()
    again = Spool.for_run(tmp_path, "r1", 0, 1 << 20)
    assert again.next_seq == 12 and again.locked


def test_pre_encoded_steps_make_the_same_batch_and_recent_bodies_stay_in_memory(
        tmp_path: Path) -> None:
    spool = Spool.for_run(tmp_path, "r", 0, 1 << 30)
    paths = []
    for first in range(0, 40, 4):
        batch = _batch(0)
        steps = [{"step": i, "loss": float("nan") if i == 5 else 1.0} for i in range(first,
                                                                                 first + 4)]
        wire = [dict(s, loss="NaN") if s["loss"] != s["loss"] else s for s in steps]
        paths.append(spool.append("r", 0, {"name": "x"}, batch,
                                  [json.dumps(s) for s in wire], first + 3))
        entry = read_entry(paths[-1])
        assert entry["batch"]["steps"] == wire and entry["run"] == {"name": "x"}
        assert json.loads(spool.body(paths[-1])) == entry["batch"]
    assert spool.last_step == 39
    kept = [p for p in paths if spool.body(p) is not None]
    assert kept == paths[-Spool.BODIES_KEPT:]  # bounded: older ones are read from disk
    spool.remove(paths[-1])
    assert spool.body(paths[-1]) is None
    assert json.loads(batch_text({}, ['{"step": 1}'])) == {"steps": [{"step": 1}]}


def test_full_spool_drops_the_oldest_and_counts_them(tmp_path: Path) -> None:
    probe = Spool.for_run(tmp_path / "probe", "r", 0, 1 << 30)
    size = probe.append("r", 0, {}, _batch(50)).stat().st_size
    spool = Spool.for_run(tmp_path, "r2", 0, int(size * 3.5))
    for _ in range(6):
        spool.append("r2", 0, {}, _batch(50))
    seqs = [read_entry(p)["seq"] for p in spool.pending()]
    assert seqs == [3, 4, 5]
    assert (spool.dropped_batches, spool.dropped_steps) == (3, 150)


def test_a_live_writer_holds_the_lock(tmp_path: Path) -> None:
    first = Spool.for_run(tmp_path, "r3", 0, 1 << 20)
    second = Spool.for_run(tmp_path, "r3", 0, 1 << 20)
    assert first.locked and not second.locked
    first.close()
    second.close()


def test_dropped_counts_reach_the_batches(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_MODE", "offline")
    monkeypatch.setenv("AMPWATCH_SPOOL_MAX_BYTES", "1")  # keeps only the newest batch
    from ampwatch import agent

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    attachment = agent.attach(model, spool_dir=tmp_path, max_batch_steps=1)
    bf16_loop(model, optimizer, batches(4))
    attachment.flush(5)  # before detach, whose "finished" batch would then be the newest
    (entry,) = spooled(tmp_path, attachment.run_id)
    attachment.detach()
    assert entry["batch"]["steps"][0]["step"] == 3
    # the batch counts the drops that made room for it too: the last one carries them all
    assert entry["batch"]["dropped_batches"] == 3 and entry["batch"]["dropped_steps"] == 3


def test_the_bound_decides_and_never_imports_the_spool():
    """bound.py picks what to drop; spool.py (which imports it) drops it: no cycle."""
    import ast

    import ampwatch.agent.transport.bound as bound

    tree = ast.parse(Path(bound.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
    assert not any(name and name.endswith("transport.spool") for name in imported)
