"""The same diagnosis whatever the batch boundaries. The agent cuts batches by time as well
as by count, so where they end depends on the machine's load; the server judges each
batch as it arrives. A zoo run with a seeded fault is recorded once (the agent's offline
spool: the exact batches it would send), and its steps are ingested again into fresh
servers cut into other batches: one step each, 7, 10, 30, all at once, random sizes.
Every partition must give the one-step partition's findings (kind, code, layer, step,
severity, status) and incidents (cause, layer, step, severity, headline, members), and
its top card names the truth's cause and step (the test's own: the step it raised the
learning rate or scaled the weight)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ampwatch.server.app import close_app, create_app
from ampwatch.server.settings import Settings
from ampwatch.wire.spool import batch_files, read_entry
from tests.conftest import agent_errors_fail, judged_client
from tests.utils import post_batch
from tests.zoo import faults
from tests.zoo.loop import Fault, train

RUN = "partitioned"
PROBLEMS = ("warning", "critical")


@dataclass(frozen=True)
class Recorded:
    """A run as the agent sent it: its registration, steps and events in order."""

    fault: Fault
    registration: dict[str, Any]
    steps: list[dict[str, Any]]
    events: list[dict[str, Any]]


@dataclass(frozen=True)
class Diagnosis:
    findings: list[tuple]
    incidents: list[tuple]
    top: tuple | None  # the first incident at warning or worse


def record(fault: Fault, spool: Path) -> Recorded:
    """Train `fault` under the agent in offline mode and read back what it spooled."""
    with pytest.MonkeyPatch.context() as patch, agent_errors_fail():
        patch.setenv("AMPWATCH_MODE", "offline")
        patch.setenv("AMPWATCH_SPOOL_DIR", str(spool))
        run_id, _ = train(fault, "http://127.0.0.1:9")  # offline: nothing is sent
    entries = [read_entry(path) for path in batch_files(spool / run_id / "rank-0")]
    assert {str(e["run"]) for e in entries} == {str(entries[0]["run"])}  # one layer table
    return Recorded(fault, entries[0]["run"],
                    [step for e in entries for step in e["batch"]["steps"]],
                    [event for e in entries for event in e["batch"]["events"]])


def sizes(partition: str, n: int) -> list[int]:
    """Batch sizes covering `n` steps."""
    if partition == "all":
        return [n]
    if partition == "random":
        rng, cut = random.Random(0), []
        while sum(cut) < n:
            cut.append(min(rng.randint(1, 25), n - sum(cut)))
        return cut
    size = int(partition)
    return [size] * (n // size) + ([n % size] if n % size else [])


def diagnose(recorded: Recorded, partition: str, directory: Path) -> Diagnosis:
    """Ingest the recorded steps cut by `partition` into a fresh server and read its
    findings and incidents once it judged every batch."""
    app = create_app(Settings(database_url=f"sqlite:///{directory / 'ampwatch.db'}"))
    try:
        with judged_client(app, raise_server_exceptions=True) as api:
            assert api.put(f"/api/v1/runs/{RUN}", json=recorded.registration).is_success
            at, cut = 0, sizes(partition, len(recorded.steps))
            for seq, size in enumerate(cut):
                response = post_batch(api, RUN, seq, recorded.steps[at: at + size])
                assert response.is_success, response.text
                at += size
            assert post_batch(api, RUN, len(cut), [], events=recorded.events).is_success
            findings = api.get(f"/api/v1/runs/{RUN}/findings").json()["items"]
            incidents = api.get(f"/api/v1/runs/{RUN}/incidents").json()["items"]
    finally:
        close_app(app)
    told = {f["id"]: (f["kind"], f["code"], f["layer"], f["step"], f["severity"], f["status"])
            for f in findings}
    cards = [(i["cause"], i["layer"], i["step"], i["severity"], i["headline"],
              tuple(sorted((told[m] for m in i["findings"]), key=str))) for i in incidents]
    top = next((c for c in cards if c[3] in PROBLEMS), None)
    return Diagnosis(sorted(told.values(), key=str), sorted(cards, key=str), top)


@pytest.fixture(scope="module", params=[faults.MISTRAL_LR_JUMP, faults.GEMMA_JUMP],
                ids=lambda f: f.name)
def recorded(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    return record(request.param, tmp_path_factory.mktemp("spool"))


@pytest.fixture(scope="module")
def one_step_each(recorded: Recorded, tmp_path_factory: pytest.TempPathFactory) -> Diagnosis:
    return diagnose(recorded, "1", tmp_path_factory.mktemp("one-step"))


def test_one_step_batches_name_the_truth(recorded: Recorded, one_step_each: Diagnosis) -> None:
    """The reference is right, so the comparison below is with a right diagnosis."""
    top = one_step_each.top
    assert top is not None, one_step_each.incidents
    if recorded.fault.lr_jump is not None:
        at, factor = recorded.fault.lr_jump
        assert top[0] == "loss_spike", top
        assert f"learning rate rose {factor:.3g}x" in top[4] and f"at step {at}" in top[4], top
    else:  # the weight the fault scaled, at the step it scaled it
        assert top[:3] == ("weight_jump", "model.layers.1.mlp.down_proj", faults.FORWARD_AT)
    assert [c for c in one_step_each.incidents if c[3] in PROBLEMS] == [top], (
        one_step_each.incidents)


@pytest.mark.parametrize("partition", ["7", "10", "30", "all", "random"])
def test_every_partition_gives_the_same_diagnosis(recorded: Recorded, one_step_each: Diagnosis,
                                                  partition: str, tmp_path: Path) -> None:
    assert diagnose(recorded, partition, tmp_path) == one_step_each
