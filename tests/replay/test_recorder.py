"""The recorder's limits: one bundle per incident and a cap per run, a disk budget, a
disk that cannot be written (training goes on), and weights marked approximate where the
step had already been applied when the verdict came."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from ampwatch.replay import load
from ampwatch.replay.cli import replay_report
from tests.agent.factories import spooled_steps
from tests.replay.faults import FAULTS, build, train


def _nan_at(*steps: int):
    def data(step: int, x: torch.Tensor) -> torch.Tensor:
        if step in steps:
            x = x.clone()
            x[0, 3] = float("nan")
        return x
    return data


def _bundle_events(spool: Path) -> list[dict]:
    return [e["detail"] for e in spooled_events(spool) if e["kind"] == "bundle"]


def spooled_events(spool: Path) -> list[dict]:
    import gzip
    import json

    events = []
    for path in sorted(spool.rglob("*.json.gz")):
        entry = json.loads(gzip.decompress(path.read_bytes()))
        events += entry.get("batch", entry).get("events") or []
    return events


def test_one_bundle_per_incident_and_a_cap_per_run(attach, offline: Path) -> None:
    fault = dataclasses.replace(FAULTS[2], data=_nan_at(8, 9, 20, 32), steps=40)
    truths, attachment = train(fault, attach, record={"quiet_steps": 5, "max_bundles": 2})
    assert attachment.detach(timeout=10)
    assert [s for s, t in enumerate(truths) if not math.isfinite(t.loss)] == [8, 9, 20, 32]
    kept = sorted(load(p).step for p in offline.rglob("*.ampbundle"))
    assert kept == [8, 20]  # 9 is step 8's incident; 32 is past the cap


def test_a_spent_budget_and_an_unwritable_disk_drop_the_bundle_not_the_run(
        attach, offline: Path, tmp_path: Path) -> None:
    fault = FAULTS[2]
    truths, attachment = train(fault, attach, record={"max_bytes": 2048})
    assert attachment.detach(timeout=10)
    assert len(truths) == fault.steps and not list(offline.rglob("*.ampbundle"))
    (event,) = _bundle_events(offline)
    assert event["step"] == 8 and "budget" in event["dropped"] and event["file"] is None

    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the bundle folder should be")
    truths, attachment = train(fault, attach, record={"mode": "local",
                                                      "folder": str(blocked / "bundles")})
    assert attachment.detach(timeout=10)
    assert len(truths) == fault.steps
    dropped = [e for e in _bundle_events(offline) if e["delivery"] == "local"]
    assert dropped and "could not" in dropped[0]["dropped"]
    # the steps after the dropped bundle were recorded as usual
    steps = spooled_steps(offline, attachment.run_id)
    assert max(s["step"] for s in steps) == fault.steps - 1


def test_an_applied_step_judged_late_is_marked_approximate(
        attach, offline: Path, monkeypatch) -> None:
    """As on an accelerator: no value is read on the training thread, so a bf16 step
    (no scaler) has updated the weights before the worker's verdict arrives."""
    monkeypatch.setenv("AMPWATCH_DEVICE_PATH", "1")
    fault = FAULTS[8]
    _, attachment = train(fault, attach)
    assert attachment.detach(timeout=10)
    (path,) = offline.rglob("*.ampbundle")
    bundle = load(path)
    assert not bundle.exact and bundle.meta["params"]["steps_applied_since"] >= 1
    report = replay_report(str(path), lambda: build(fault), "cpu", bisect=False)
    assert report["exact"] is False
