"""Ten seeded faults in real CPU training: the recorder keeps the right step, `ampwatch
replay` fails the same way, `--bisect` names the injected module, and its printed fix,
applied to the same training, makes that step finite. Healthy runs keep nothing."""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

import pytest
import torch

from ampwatch.replay import load, read_meta
from ampwatch.replay.cli import replay_report
from tests.replay.faults import FAULTS, Fault, NaiveLogit, Net, build, first_bad_step, train


def _bundles(root: Path) -> list[Path]:
    return sorted(root.rglob("*.ampbundle"))


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_fault_is_kept_replayed_and_fixed(fault: Fault, attach, offline: Path) -> None:
    truths, attachment = train(fault, attach)
    assert attachment.detach(timeout=10)
    expected = first_bad_step(fault, truths)
    assert expected is not None, "the seeded fault did not act"

    paths = _bundles(offline)
    assert [read_meta(p)["step"] for p in paths] == [expected]  # one incident, one bundle
    bundle = load(paths[0])
    assert bundle.exact and bundle.meta["params"]["steps_applied_since"] == 0
    assert len(bundle.batches) == 1

    report = replay_report(str(paths[0]), lambda: build(fault), "cpu", bisect=True)
    assert report["reproduced"]
    if bundle.meta["first_nonfinite_layer"] is not None:
        assert report["replayed"]["first_nonfinite_layer"] == \
            bundle.meta["first_nonfinite_layer"]
    if math.isfinite(bundle.meta["loss"]) and report["replayed"]["loss"] is not None:
        assert report["replayed"]["loss"] == pytest.approx(bundle.meta["loss"], rel=1e-3)
    result = report["bisect"]
    if fault.injected is None:  # NaN in the data: no precision can fix it (docs/replay.md)
        assert not result["fixed"] and "input" in result["reason"]
        return
    # the injected module, or a module inside it (the Linear whose output overflows)
    assert result["fixed"] and any(m == fault.injected or m.startswith(f"{fault.injected}.")
                                   for m in result["modules"]), result

    namespace: dict = {}
    exec(result["fix"], namespace)  # the printed fix, as a user pastes it
    fixed, _ = train(fault, fix=namespace)
    step = fixed[expected]
    assert math.isfinite(step.loss) and step.grads_finite
    factor = fault.record.get("loss_spike")
    if factor is not None:
        earlier = [t.loss for t in fixed[:expected]][-50:]
        assert step.loss <= factor * statistics.median(earlier)


HEALTHY = [
    Fault("fp16", lambda: torch.nn.Linear(32, 32), None, steps=30),
    Fault("fp16_calibrating", FAULTS[4].mid, None, steps=30),  # skips while it calibrates
    Fault("bf16", NaiveLogit, None, precision="bfloat16", lr=1e-2, steps=30),
    dataclasses.replace(FAULTS[7], name="fp8", inject=lambda step, model: None),
]


@pytest.mark.parametrize("fault", HEALTHY, ids=[f.name for f in HEALTHY])
def test_healthy_run_writes_no_bundle(fault: Fault, attach, offline: Path) -> None:
    truths, attachment = train(fault, attach, record=True)  # the default triggers
    assert attachment.detach(timeout=10)
    assert all(math.isfinite(t.loss) for t in truths)
    assert _bundles(offline) == []


def test_record_off_and_local(attach, offline: Path, tmp_path: Path) -> None:
    fault = FAULTS[2]
    model = Net(fault.mid())
    off = attach(model, None, record=False)
    assert all(c.name != "recorder" for c in off._watch.collectors)
    off.detach()
    local = tmp_path / "kept"
    _, attachment = train(fault, attach, record={"mode": "local", "folder": str(local)})
    assert attachment.detach(timeout=10)
    assert [p.parent for p in _bundles(tmp_path)] == [local]
