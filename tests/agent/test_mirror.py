"""The mirror on real training against a real server, into the real trackers: TensorBoard
event files read back with TensorBoard's EventAccumulator, MLflow on a SQLite store read
through MlflowClient, W&B offline read back from its own run file. Every mirrored value
equals the server's for every step; the incident the test injected (a layer's fp16
output poisoned for six steps) reaches each tracker with its headline, layer, first step,
fix, link and bundle; a tracker that raises, hangs or is missing stops nothing."""

from __future__ import annotations

import json
import logging
import math
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ampwatch import agent
from ampwatch.client import Client
from ampwatch.wire.bundles import bundle_name
from tests.agent.factories import TinyGPT
from tests.conftest import LiveServer, module_server

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
pytest.importorskip("wandb")

from mlflow.tracking import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

from tests.agent import wandb_reader  # noqa: E402

STEPS, POISONED, SAMPLE_EVERY = 30, range(12, 18), 5
SCALARS = ("loss_scale", "skipped", "grad_norm", "nonfinite")
SAMPLED = ("overflow_headroom_min", "attn_max_logit_max", "logit_lse_max")


@dataclass
class Truth:
    """What the test itself saw: the steps its scaler skipped, and the run."""

    run_id: str = ""
    skipped: set[int] = field(default_factory=set)
    folder: Path = Path()
    wandb_file: Path = Path()
    mlflow_run: str = ""
    mlflow_uri: str = ""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from module_server(tmp_path_factory, "mirror")


def train(server_url: str, mirror: Any, steps: int = STEPS, poisoned: range = POISONED,
          **attach: Any) -> tuple[agent.Attachment, set[int]]:
    """TinyGPT under CPU fp16 autocast with a GradScaler; `ln2`'s output is made infinite
    on the `poisoned` steps (a hook that runs before the agent's). Returns the detached
    attachment and the steps the test's scaler skipped (its scale went down)."""
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu")
    step = 0

    def poison(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out * math.inf if step in poisoned else out

    model.ln2.register_forward_hook(poison, prepend=True)
    attachment = agent.attach(model, scaler, server=server_url, sample_every=SAMPLE_EVERY,
                              mirror=mirror, **attach)
    tokens = torch.Generator().manual_seed(1)
    skipped = set()
    for step in range(steps):
        idx = torch.randint(0, 64, (4, 8), generator=tokens)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(idx).float()
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), idx.reshape(-1))
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if scaler.get_scale() < before:
            skipped.add(step)
        optimizer.zero_grad(set_to_none=True)
    assert attachment.flush(30)
    return attachment, skipped


@pytest.fixture(scope="module")
def mirrored(server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Truth]:
    """One run mirrored into all three trackers at once (their imports are slow)."""
    import mlflow
    import wandb
    from torch.utils.tensorboard import SummaryWriter

    folder = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        patch.setenv("WANDB_DIR", str(folder))
        patch.setenv("AMPWATCH_SPOOL_DIR", str(folder / "spool"))
        uri = f"sqlite:///{folder / 'mlflow.db'}"
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        patch.chdir(folder)  # MLflow's SQLite store keeps artifacts in ./mlruns
        mlflow_run = mlflow.start_run()
        wandb_run = wandb.init(project="ampwatch-mirror", dir=str(folder))
        writer = SummaryWriter(str(folder / "tb"))
        try:
            attachment, skipped = train(server.url, [writer, "mlflow", wandb_run])
            assert attachment.detach(timeout=30)
        finally:
            writer.close()
            wandb_run.finish()
            mlflow.end_run()
    (wandb_file,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    yield Truth(attachment.run_id, skipped, folder, wandb_file, mlflow_run.info.run_id, uri)


def read_tensorboard(folder: Path) -> tuple[dict[str, dict[int, float]], dict[int, str]]:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)}
               for tag in events.Tags()["scalars"]}
    texts = {e.step: e.tensor_proto.string_val[0].decode()
             for tag in events.Tags()["tensors"] if tag.startswith("ampwatch/incidents")
             for e in events.Tensors(tag)}
    return scalars, texts


def read_mlflow(truth: Truth) -> tuple[dict[str, dict[int, float]], dict[str, str], Any]:
    client = MlflowClient(tracking_uri=truth.mlflow_uri)
    run = client.get_run(truth.mlflow_run)
    scalars = {name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
               for name in run.data.metrics}
    return scalars, run.data.tags, client


def read_wandb(path: Path) -> dict[str, dict[int, float]]:
    scalars: dict[str, dict[int, float]] = {}
    for row in wandb_reader.history(path):
        step = int(json.loads(row["ampwatch/step"]))
        for key, value in row.items():
            if key.startswith("ampwatch/") and key != "ampwatch/step":
                scalars.setdefault(key, {})[step] = float(json.loads(value))
    return scalars


def server_truth(server: LiveServer, run_id: str, nan_logits: bool = True
                 ) -> dict[str, dict[int, float]]:
    """What the server stored, per step, as the values the trackers should hold. The
    API's logit matrix leaves NaN samples out; `nan_logits`: the poisoned steps' NaN that
    the agent saw (and the mirror wrote) is expected all the same."""
    with Client(server.url) as client:
        return _server_truth(client, run_id, nan_logits)


def _server_truth(client: Client, run_id: str, nan_logits: bool) -> dict[str, dict[int, float]]:
    expected: dict[str, dict[int, float]] = {f"ampwatch/{n}": {} for n in SCALARS + SAMPLED}
    for s in client.steps(run_id):
        expected["ampwatch/loss_scale"][s.step] = s.loss_scale
        expected["ampwatch/skipped"][s.step] = float(s.skipped)
        expected["ampwatch/grad_norm"][s.step] = s.grad_norm
        expected["ampwatch/nonfinite"][s.step] = float(bool(
            s.forward_nonfinite or s.input_nonfinite
            or not math.isfinite(s.grad_norm) or not math.isfinite(s.loss)))
    headroom = expected["ampwatch/overflow_headroom_min"]
    for layer in client.layers(run_id):
        for point in client.layer_series(run_id, layer.index).activations:
            if point.act_dtype == "float16" and point.act_absmax is not None:
                room = 65504.0 / point.act_absmax if math.isfinite(point.act_absmax) else 0.0
                headroom[point.step] = min(headroom.get(point.step, math.inf), room)
    for metric in ("attn_max_logit", "logit_lse"):
        for step in sorted(headroom):  # the sampled steps, one request each
            matrix = client.layer_matrix(run_id, metric=metric, start=step, end=step, buckets=1)
            column = [row[0] for row in matrix.values if row and row[0] is not None]
            if column:
                bad = [v for v in column if not math.isfinite(v)]
                expected[f"ampwatch/{metric}_max"][step] = bad[0] if bad else max(column)
            elif step in POISONED and nan_logits:
                expected[f"ampwatch/{metric}_max"][step] = math.nan
    return {name: values for name, values in expected.items() if values}


def same(a: float, b: float, rel: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b if math.isinf(a) or math.isinf(b) else math.isclose(a, b, rel_tol=rel)


def assert_equal(got: dict[str, dict[int, float]], expected: dict[str, dict[int, float]],
                 rel: float) -> None:
    assert set(got) == set(expected)
    for name, values in expected.items():
        assert set(got[name]) == set(values), name
        wrong = {s: (got[name][s], v) for s, v in values.items() if not same(got[name][s], v, rel)}
        assert not wrong, (name, wrong)


def test_every_mirrored_value_equals_the_servers(server: LiveServer, mirrored: Truth) -> None:
    expected = server_truth(server, mirrored.run_id)
    assert set(expected["ampwatch/loss_scale"]) == set(range(STEPS))
    assert len(expected["ampwatch/attn_max_logit_max"]) >= STEPS // SAMPLE_EVERY
    # the test's own scaler and poison: the skips and the non-finite steps it caused
    skipped = {s for s, v in expected["ampwatch/skipped"].items() if v}
    assert skipped == mirrored.skipped and set(POISONED) <= skipped
    assert {s for s, v in expected["ampwatch/nonfinite"].items() if v} == set(POISONED)
    tensorboard, _ = read_tensorboard(mirrored.folder / "tb")
    assert_equal(tensorboard, expected, rel=1e-6)  # TensorBoard keeps float32
    assert_equal(read_mlflow(mirrored)[0], expected, rel=1e-12)
    assert_equal(read_wandb(mirrored.wandb_file), expected, rel=1e-12)


@pytest.fixture(scope="module")
def incident(server: LiveServer, mirrored: Truth) -> dict[str, Any]:
    """The server's one problem of the run, and the bundle of its first step."""
    with Client(server.url) as client:
        problems = [i for i in client.incidents(mirrored.run_id, wait=30) if i.severity != "info"]
        bundles = {b.step for b in client.bundles(mirrored.run_id)}
    assert len(problems) == 1, problems
    (problem,) = problems
    assert (problem.layer, problem.step) == ("ln2", POISONED[0])  # the test's poison
    assert POISONED[0] in bundles
    return {"id": problem.id, "headline": problem.headline, "layer": "ln2",
            "step": POISONED[0], "fix": problem.fix, "bundle": bundle_name(POISONED[0]),
            "link": f"{server.url}/runs/{mirrored.run_id}"}


def assert_told(text: str, incident: dict[str, Any]) -> None:
    for part in ("headline", "layer", "fix", "bundle", "link"):
        assert incident[part] and incident[part] in text, (part, text)
    assert f"first step: {incident['step']}" in text


def test_tensorboard_gets_the_incident_as_text(mirrored: Truth, incident: dict) -> None:
    _, texts = read_tensorboard(mirrored.folder / "tb")
    assert_told(texts[incident["step"]], incident)
    assert not [t for t in texts.values() if "first step: None" in t]


def test_mlflow_gets_a_tag_and_an_artifact(mirrored: Truth, incident: dict,
                                           tmp_path: Path) -> None:
    _, tags, client = read_mlflow(mirrored)
    tag = tags[f"ampwatch.incident.{incident['id']}"]
    assert incident["headline"] in tag and "open" in tag and incident["layer"] in tag
    assert tags["ampwatch.open_incidents"] == str(
        sum(1 for k, v in tags.items() if k.startswith("ampwatch.incident.")
            and v.startswith("open")))
    path = client.download_artifacts(mirrored.mlflow_run,
                                     f"ampwatch/incident-{incident['id']}.md", str(tmp_path))
    assert_told(Path(path).read_text(), incident)
    assert not [v for v in tags.values() if "step None" in v]  # the setup note has no step


def test_mlflow_is_told_what_it_made_of_an_inf(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow stores inf as its largest float; the run's `ampwatch.inf` tag says so."""
    from ampwatch.trackers.adapters import MlflowTracker

    monkeypatch.chdir(tmp_path)  # MLflow's SQLite store keeps artifacts in ./mlruns
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("inf")).info.run_id
    tracker = MlflowTracker(run_id, uri)
    tracker.write_scalars([(0, {"ampwatch/grad_norm": 1.0})])
    assert "ampwatch.inf" not in client.get_run(run_id).data.tags
    tracker.write_scalars([(1, {"ampwatch/grad_norm": math.inf})])
    stored = [m.value for m in client.get_metric_history(run_id, "ampwatch/grad_norm")]
    assert stored[1] == pytest.approx(1.797e308, rel=1e-3)
    assert "1.797e308" in client.get_run(run_id).data.tags["ampwatch.inf"]


def test_wandb_gets_an_alert_and_the_summary(mirrored: Truth, incident: dict) -> None:
    alerts = wandb_reader.alerts(mirrored.wandb_file)
    assert len(alerts) == 1  # the problem; the info note stays in the summary
    assert alerts[0].level == "WARN" and incident["headline"] in alerts[0].title
    assert_told(alerts[0].text, incident)
    summary = wandb_reader.summary(mirrored.wandb_file)
    told = json.loads(summary[f"ampwatch/incident/{incident['id']}"])
    assert {k: told[k] for k in incident} == incident


def test_a_tracker_that_raises_or_is_missing_stops_nothing(
        server: LiveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from torch.utils.tensorboard import SummaryWriter

    from ampwatch.agent.mirror import MlflowTracker

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    monkeypatch.chdir(tmp_path)  # MLflow's SQLite store keeps artifacts in ./mlruns
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("gone"))
    client.delete_run(run.info.run_id)  # MLflow refuses every write to it
    writer = SummaryWriter(str(tmp_path / "tb"))
    broken = MlflowTracker(run.info.run_id, f"sqlite:///{tmp_path / 'mlflow.db'}")
    with caplog.at_level(logging.WARNING, logger="ampwatch.agent.mirror"):
        attachment, _ = train(server.url, ["wandb", broken, writer], steps=12, poisoned=range(0))
        assert attachment.detach(timeout=30)
    writer.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("'wandb'" in w for w in warnings) == 1, warnings
    assert sum("mlflow failed" in w for w in warnings) == 1, warnings
    with Client(server.url) as client:
        assert len(client.steps(attachment.run_id)) == 12
    scalars, _ = read_tensorboard(tmp_path / "tb")
    assert set(scalars["ampwatch/loss_scale"]) == set(range(12))


def test_a_hung_tracker_costs_detach_its_timeout_and_nothing_else(
        server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    """An MLflow tracking server that accepts the connection and never answers."""
    from ampwatch.agent.mirror import MlflowTracker

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        hung = MlflowTracker("0" * 32, f"http://127.0.0.1:{silent.getsockname()[1]}")
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="ampwatch.agent.mirror"):
            attachment, _ = train(server.url, [hung], steps=12, poisoned=range(0))
            trained = time.monotonic() - started
            assert attachment.detach(timeout=4)  # delivered to ampwatch all the same
        took = time.monotonic() - started - trained
    assert took < 6, took
    with Client(server.url) as client:
        assert len(client.steps(attachment.run_id)) == 12
    assert any("mlflow did not finish" in r.getMessage() for r in caplog.records)


def test_export_writes_a_finished_run_as_the_mirror_did(
        server: LiveServer, mirrored: Truth, incident: dict, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """`ampwatch export RUN --to tensorboard DIR` and `--to mlflow`, from the server alone
    (so without the NaN logits its API leaves out)."""
    from ampwatch.client.cli import main

    expected = server_truth(server, mirrored.run_id, nan_logits=False)
    base = ["export", mirrored.run_id, "--server", server.url, "--json"]
    assert main([*base, "--to", "tensorboard", str(tmp_path / "tb")]) == 0
    scalars, texts = read_tensorboard(tmp_path / "tb")
    assert_equal(scalars, expected, rel=1e-6)
    assert_told(texts[incident["step"]], incident)

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # and its artifacts in ./mlruns
    capsys.readouterr()
    assert main([*base, "--to", "mlflow"]) == 0
    told = json.loads(capsys.readouterr().out)
    assert told["steps"] == STEPS and told["incidents"] >= 1
    exported = Truth(mlflow_run=told["where"], mlflow_uri=uri)
    got, tags, _ = read_mlflow(exported)
    assert_equal(got, expected, rel=1e-12)
    assert incident["headline"] in tags[f"ampwatch.incident.{incident['id']}"]
    assert tags["ampwatch.run_id"] == mirrored.run_id


def test_ampwatch_mirror_names_the_trackers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    """`AMPWATCH_MIRROR=tensorboard:<dir>`, offline: the scalars of every step, no server."""
    monkeypatch.setenv("AMPWATCH_MODE", "offline")
    monkeypatch.setenv("AMPWATCH_MIRROR", f"tensorboard:{tmp_path / 'tb'}")
    attachment, skipped = train("http://127.0.0.1:9", None, steps=8, poisoned=range(3, 4))
    assert attachment.detach(timeout=10)
    scalars, _ = read_tensorboard(tmp_path / "tb")
    assert set(scalars["ampwatch/loss_scale"]) == set(range(8))
    assert {s for s, v in scalars["ampwatch/skipped"].items() if v} == skipped == {3}


def test_incidents_are_told_when_they_open_escalate_and_resolve(server: LiveServer) -> None:
    """The mirror's poll against the server's own diagnosis of posted steps: a layer's
    grads go inf at step 20 (a note), the skips go on for 40 steps (it escalates), 600
    healthy steps follow (it resolves); a poll with nothing new tells nothing."""
    import httpx

    from ampwatch.agent.mirror.incidents import IncidentWatch
    from ampwatch.agent.transport.sender import Sender
    from tests.utils import make_steps, post_batch, register_run

    run_id = "mirror-incidents"
    sender = Sender(server.url)
    watch = IncidentWatch(sender, server.url, run_id)
    with httpx.Client(base_url=server.url, timeout=30) as api:
        register_run(api, run_id)
        told = []
        for seq, (first, count, skipped) in enumerate(
                [(0, 40, range(20, 30)), (40, 40, range(40, 80)), (80, 600, range(0))]):
            assert post_batch(api, run_id, seq, make_steps(first, count, 4,
                                                           skipped=set(skipped))).is_success
            told.append([(n.change, n.severity, n.status, n.step, n.layer)
                         for n in watch.poll(wait=30) if n.layer == "blocks.0.fc"])
        assert watch.poll() == []
    sender.close()
    assert told == [[("opened", "info", "open", 20, "blocks.0.fc")],
                    [("escalated", "critical", "open", 20, "blocks.0.fc")],
                    [("resolved", "critical", "resolved", 20, "blocks.0.fc")]]


def test_an_incident_marked_handled_is_told_handled_then_reopened(server: LiveServer) -> None:
    """"Mark handled" on the server reaches the trackers as handled (open nowhere: not
    "resolved", and out of the open count), and the skips coming back after the mark as
    reopened."""
    import httpx

    from ampwatch.agent.mirror.incidents import IncidentWatch
    from ampwatch.agent.transport.sender import Sender
    from tests.utils import make_steps, post_batch, register_run

    run_id = "mirror-handled"
    sender = Sender(server.url)
    watch = IncidentWatch(sender, server.url, run_id)

    def told() -> list[tuple[str, str, str]]:
        return [(n.change, n.severity, n.status) for n in watch.poll(wait=30)
                if n.layer == "blocks.0.fc"]

    with httpx.Client(base_url=server.url, timeout=30) as api:
        register_run(api, run_id)
        assert post_batch(api, run_id, 0, make_steps(0, 80, 4,
                                                     skipped=set(range(20, 80)))).is_success
        assert told() == [("opened", "critical", "open")]
        incident = next(i["id"] for i in api.get(f"/api/v1/runs/{run_id}/incidents").json()
                        ["items"] if i["layer"] == "blocks.0.fc")
        assert api.post(f"/api/v1/runs/{run_id}/notes",
                        json={"incident": incident, "handled": True}).status_code == 201
        assert told() == [("handled", "critical", "handled")]
        # `ampwatch export --to` tells it the same
        from ampwatch.client.tracker_export import run_notes
        with Client(server.url) as client:
            exported = [(n.change, n.status) for n in run_notes(client, run_id)
                        if n.id == incident]
        assert exported == [("handled", "handled")]
        assert post_batch(api, run_id, 1, make_steps(80, 20, 4,
                                                     skipped=set(range(80, 100)))).is_success
        assert told() == [("reopened", "critical", "open")]
    sender.close()
