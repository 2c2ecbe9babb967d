"""`ampwatch export RUN --to tensorboard DIR | mlflow`: a finished run's per-step signals
and incidents, written into a tracker as the agent's mirror would have written them live
(the same scalars, trackers/scalars.py; the same notes and trackers, trackers/adapters.py).

Reads the run through the API: its steps page by page, one request per layer for the
activations, and two per sampled step for the attention and output logits."""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ampwatch.client.api import Client
from ampwatch.client.errors import AmpwatchError
from ampwatch.trackers.adapters import MlflowTracker, Row, TensorBoardTracker, Tracker
from ampwatch.trackers.incident_notes import IncidentNote, bundle_for, first_change
from ampwatch.trackers.scalars import step_scalars

TARGETS = ("tensorboard", "mlflow")
NEEDS = {"tensorboard": "tensorboard", "mlflow": "mlflow"}
Progress = Callable[[str], None]


def check_target_available(target: str) -> None:
    """AmpwatchError naming the extra to install when the tracker's library is missing."""
    try:
        found = importlib.util.find_spec(NEEDS[target]) is not None
    except ValueError:  # sys.modules maps it to None: importing it fails
        found = False
    if not found:
        raise AmpwatchError(f"--to {target} needs {NEEDS[target]}, which the "
                            "ampwatch[trackers] extra installs: pip install 'ampwatch[trackers]'")


def run_rows(client: Client, run_id: str, *, rank: int = 0,
             progress: Progress | None = None) -> list[Row]:
    """The mirror's scalars of every step of one rank, rebuilt from what the server holds."""
    records: dict[int, dict[str, Any]] = {
        s.step: {"step": s.step, "loss_scale": s.loss_scale, "skipped": s.skipped,
                 "grad_norm": s.grad_norm, "loss": s.loss,
                 "forward_nonfinite": s.forward_nonfinite, "input_nonfinite": s.input_nonfinite}
        for s in client.steps(run_id, rank=rank)}
    layers = client.layers(run_id, rank=rank)
    for layer in layers:
        if progress:
            progress(f"layer {layer.index + 1}/{len(layers)}: {layer.name}")
        for point in client.layer_series(run_id, layer.index, rank=rank).activations:
            record = records.get(point.step)
            if record is not None:
                acts = record.setdefault("activations", {"absmax": [], "dtype": []})
                acts["absmax"].append(point.act_absmax)
                acts["dtype"].append(point.act_dtype)
    sampled = [step for step, record in records.items() if "activations" in record]
    for n, step in enumerate(sampled):
        if progress:
            progress(f"sampled step {n + 1}/{len(sampled)}")
        spikes = records[step].setdefault("spikes", {})
        for metric in ("attn_max_logit", "logit_lse"):
            matrix = client.layer_matrix(run_id, metric=metric, rank=rank, start=step,
                                         end=step, buckets=1)
            spikes[metric] = [row[0] for row in matrix.values if row]
    return [(step, scalars) for step, record in sorted(records.items())
            if (scalars := step_scalars(record))]


def run_notes(client: Client, run_id: str) -> list[IncidentNote]:
    """Each incident of the run as it stands (opened, handled or resolved)."""
    incidents = list(client.incidents(run_id))
    bundles = [{"rank": b.rank, "step": b.step} for b in client.bundles(run_id)]
    messages = {} if all(i.headline for i in incidents) else {
        f.id: f.message for f in client.findings(run_id)}
    link = f"{client.base_url}/runs/{run_id}"
    notes = []
    for incident in incidents:
        body = dataclasses.asdict(incident)
        first = incident.findings[0] if incident.findings else None
        notes.append(IncidentNote.from_incident(
            body, first_change(incident.status), link,
            bundle_for(body, bundles), messages.get(first)))
    return notes


def tracker(target: str, destination: str | None, run_id: str) -> Tracker:
    """The tracker to export into: TensorBoard event files in `destination`, or MLflow
    (`destination`: an existing run id, else a new run named after the ampwatch run in the
    tracking URI MLflow finds, e.g. MLFLOW_TRACKING_URI)."""
    if target == "tensorboard":
        if not destination:
            raise ValueError("--to tensorboard needs a directory: --to tensorboard DIR")
        return TensorBoardTracker(EventWriter(Path(destination)))
    import mlflow

    if destination:
        return MlflowTracker(destination, mlflow.get_tracking_uri())
    mlflow_run = mlflow.MlflowClient().create_run(
        _experiment(mlflow.MlflowClient()), run_name=run_id, tags={"ampwatch.run_id": run_id})
    return MlflowTracker(mlflow_run.info.run_id, mlflow.get_tracking_uri())


def _experiment(client: Any) -> str:
    found = client.get_experiment_by_name("ampwatch")
    return found.experiment_id if found else client.create_experiment("ampwatch")


def export(client: Client, run_id: str, out: Tracker, *, rank: int = 0,
           progress: Progress | None = None) -> tuple[int, int]:
    """Write the run's scalars and incident notes into `out`; (steps, incidents)."""
    rows = run_rows(client, run_id, rank=rank, progress=progress)
    notes = run_notes(client, run_id)
    out.write_scalars(rows)
    for note in notes:
        out.write_incident(note)
    out.close()
    return len(rows), len(notes)


class EventWriter:
    """TensorBoard event files without torch: the `add_scalar`, `add_text` and `flush` of
    torch's SummaryWriter (the same protos, through TensorBoard's own file writer)."""

    def __init__(self, folder: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        folder.mkdir(parents=True, exist_ok=True)
        self._file = EventFileWriter(str(folder))

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._add(Summary(value=[Summary.Value(tag=tag, simple_value=value)]), global_step)

    def add_text(self, tag: str, text: str, global_step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

        metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
            plugin_name="text", content=TextPluginData(version=0).SerializeToString()))
        tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode()],
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        self._add(Summary(value=[Summary.Value(tag=f"{tag}/text_summary", metadata=metadata,
                                               tensor=tensor)]), global_step)

    def _add(self, summary: Any, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self._file.add_event(Event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

