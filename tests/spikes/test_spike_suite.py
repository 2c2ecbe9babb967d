"""The spike suite (tests/spikes/scenarios.py): for each scenario, the spike-family
findings are exactly what the truth calls for (kind, cause, layer), each spike starts
within STEP_TOLERANCE steps of the truth's, and healthy runs raise no warning or critical
finding of any kind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.conftest import LiveServer, agent_errors_fail, module_server
from tests.spikes.scenarios import (
    SCENARIOS,
    STEP_TOLERANCE,
    Scenario,
    expected,
    observed,
    train_pinned,
)

SPIKE_KINDS = ("loss_spike", "spike_precursor", "optimizer_state")
HEALTHY = ("healthy_bf16", "attention_qk_norm", "output_z_loss")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from module_server(tmp_path_factory, "spikes")


@pytest.fixture(autouse=True)
def _agent_errors_fail_the_test() -> Iterator[None]:
    torch.set_num_threads(1)
    with agent_errors_fail():
        yield


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_spike_findings_are_what_the_truth_calls_for(server: LiveServer,
                                                     scenario: Scenario) -> None:
    run_id, truth = train_pinned(scenario, server.url)
    want, spikes = expected(truth)
    got, items = observed(server.url, run_id)
    if scenario.name in HEALTHY:
        assert not want, f"the push was meant to be harmless here: {want}"
        assert not got, f"a healthy run raised {got}"
        return
    assert want, "the scenario's push did not show in the truth"
    assert {f for f in got if f[0] in SPIKE_KINDS} == want
    found = sorted(f["step"] for f in items if f["kind"] == "loss_spike")
    assert len(found) == len(spikes)
    for step, (start, _) in zip(found, spikes, strict=True):
        assert abs(step - start) <= STEP_TOLERANCE, (step, start)
    if scenario.bad_step is not None:  # the truth's own grad norm jumped with the loss
        norms = truth.grad_norm
        assert norms[scenario.bad_step] >= 2 * sorted(norms[50:scenario.bad_step])[25]
    # the findings of one spike (the spike, what it is labelled with) are one incident
    for spike in (f for f in items if f["kind"] == "loss_spike"):
        own = [f for f in items if (f["evidence"] or {}).get("spike_step") == spike["step"]]
        assert {f["incident"] for f in own} == {spike["incident"]}
        if spike["evidence"]["precursor_step"] is not None:
            assert len(own) > 1
            assert spike["evidence"]["lead_steps"] > 0
