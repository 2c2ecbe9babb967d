"""The ground-truth fault suite (tests/diagnosis/scenarios.py): for each scenario, the
exact set of warning and critical findings the truth calls for, and nothing else."""

from __future__ import annotations

import pytest

from ampwatch.client.cli import main
from tests.diagnosis.scenarios import (
    SCENARIOS,
    Scenario,
    calibration_end,
    expected,
    observed,
    train,
    weight_jump_holds,
)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_findings_are_exactly_what_the_truth_calls_for(server, scenario: Scenario) -> None:
    run_id, truth = train(scenario, server.url)
    want = expected(scenario, truth)
    got, items = observed(server.url, run_id)
    # a weight jump is checked against the test's own norms (where the loop rescaled a
    # layer's weights), the rest is the exact set the truth calls for
    jumps = [f for f in items if f["kind"] == "weight_jump" and f["code"] == "weight_jump"]
    assert all(weight_jump_holds(truth, f) for f in jumps), jumps
    got = {f for f in got if f[0] != "weight_jump"}
    assert got == want, "\n".join(f"{f['severity']} {f['kind']} {f['message']}" for f in items)
    infos = {(f["kind"] if f["kind"] != "pitfall" else f"pitfall:{f['code']}", f["layer"])
             for f in items if f["severity"] == "info"}
    assert set(scenario.infos) <= infos
    if scenario.name.startswith("healthy"):
        assert main(["check", run_id, "--fail-on", "warning", "--server", server.url]) == 0
    if scenario.name == "healthy_probing_scaler":  # it did probe: skips after calibration
        assert sum(s.skipped for s in truth.steps[calibration_end(truth):]) >= 2


def test_the_suite_covers_every_fault_the_issue_names() -> None:
    assert len(SCENARIOS) >= 15
    assert sum(s.name.startswith("healthy") for s in SCENARIOS) == 3
