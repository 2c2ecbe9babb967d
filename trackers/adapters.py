"""One small class per tracker behind one protocol: scalars at the trainer's step
numbers, and incident notes in the form each tracker's users look for. The agent's mirror
(agent/mirror) and `ampwatch export --to` (client) both write through them.

The tracker libraries are imported when used, never here (the client runs without them).
In the agent every method runs on the tracker's own mirror lane, never on the training
thread; each may block or raise, and the lane contains it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, Protocol

from ampwatch.trackers.incident_notes import IncidentNote

Row = tuple[int, dict[str, float]]  # (step, {"ampwatch/...": value})


class Tracker(Protocol):
    name: str

    def write_scalars(self, rows: Sequence[Row]) -> None:
        """Write a batch of steps' scalars."""

    def write_incident(self, note: IncidentNote) -> None:
        """Tell the tracker an incident opened, escalated or resolved."""

    def close(self) -> None:
        """Make what was written durable (not the tracker's own run: that is the user's)."""


class TensorBoardTracker:
    """A `torch.utils.tensorboard.SummaryWriter` (or tensorboardX's): scalars, and each
    incident as markdown text under `ampwatch/incidents` at its first step."""

    name = "tensorboard"

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def write_scalars(self, rows: Sequence[Row]) -> None:
        for step, scalars in rows:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def write_incident(self, note: IncidentNote) -> None:
        self.writer.add_text("ampwatch/incidents", note.markdown(), global_step=note.step or 0)
        self.writer.flush()

    def close(self) -> None:
        self.writer.flush()


class MlflowTracker:
    """One MLflow run (the active one when the mirror began): metrics through
    `MlflowClient.log_batch` (the fluent API's active run is per thread), each incident
    as the tags `ampwatch.incident.<id>` and `ampwatch.open_incidents` and the text
    artifact `ampwatch/incident-<id>.md`."""

    name = "mlflow"
    MAX_BATCH = 1000  # metrics per log_batch call, MLflow's own limit
    INF_TAG = "ampwatch.inf"  # set with the first inf written: what MLflow made of it
    INF_NOTE = ("MLflow stores inf as +-1.797e308 (the largest float64): an ampwatch/ "
                "value of 1.797e308 or -1.797e308 was inf (docs/trackers.md)")

    def __init__(self, run_id: str, tracking_uri: str | None = None) -> None:
        from mlflow.tracking import MlflowClient

        self.run_id = run_id
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self._open: set[int] = set()
        self._told_inf = False

    @classmethod
    def active(cls) -> MlflowTracker:
        """The active MLflow run of the calling thread; ValueError when there is none."""
        import mlflow

        run = mlflow.active_run()
        if run is None:
            raise ValueError("mirror='mlflow' needs an active MLflow run (mlflow.start_run())")
        return cls(run.info.run_id, mlflow.get_tracking_uri())

    def write_scalars(self, rows: Sequence[Row]) -> None:
        from mlflow.entities import Metric

        now = _millis()
        metrics = [Metric(tag, value, now, step) for step, scalars in rows
                   for tag, value in scalars.items()]
        for start in range(0, len(metrics), self.MAX_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start: start + self.MAX_BATCH])
        if not self._told_inf and any(math.isinf(m.value) for m in metrics):
            self.client.set_tag(self.run_id, self.INF_TAG, self.INF_NOTE)
            self._told_inf = True

    def write_incident(self, note: IncidentNote) -> None:
        if note.status == "open":
            self._open.add(note.id)
        else:
            self._open.discard(note.id)
        self.client.set_tag(self.run_id, f"ampwatch.incident.{note.id}", note.one_line())
        self.client.set_tag(self.run_id, "ampwatch.open_incidents", str(len(self._open)))
        self.client.log_text(self.run_id, note.markdown(),
                             f"ampwatch/incident-{note.id}.md")

    def close(self) -> None:
        """Nothing buffered: every call above is written when it returns."""


class WandbTracker:
    """A W&B run: scalars against their own x-axis `ampwatch/step` (W&B refuses a `step=`
    below the run's current one, and the trainer logs its own steps), each incident as a
    `run.alert` (warning and critical ones) and the summary keys `ampwatch/incident/<id>` and
    `ampwatch/open_incidents`."""

    name = "wandb"

    def __init__(self, run: Any) -> None:
        self.run = run
        self._open: set[int] = set()
        run.define_metric("ampwatch/step", hidden=True)
        run.define_metric("ampwatch/*", step_metric="ampwatch/step")

    @classmethod
    def active(cls) -> WandbTracker:
        """The active W&B run (`wandb.run`); ValueError when there is none."""
        import wandb

        if wandb.run is None:
            raise ValueError("mirror='wandb' needs an active W&B run (wandb.init())")
        return cls(wandb.run)

    def write_scalars(self, rows: Sequence[Row]) -> None:
        for step, scalars in rows:
            self.run.log({"ampwatch/step": step, **scalars})

    def write_incident(self, note: IncidentNote) -> None:
        import wandb

        if note.status == "open":
            self._open.add(note.id)
        else:
            self._open.discard(note.id)
        self.run.summary[f"ampwatch/incident/{note.id}"] = note.as_dict()
        self.run.summary["ampwatch/open_incidents"] = len(self._open)
        if note.severity == "info" or note.change == "handled":
            return  # a note, or a person's own mark: the summary holds it, an alert is noise
        level = wandb.AlertLevel.INFO if note.status != "open" else (
            wandb.AlertLevel.ERROR if note.severity == "critical" else wandb.AlertLevel.WARN)
        self.run.alert(title=note.title(), text=note.markdown(), level=level, wait_duration=0)

    def close(self) -> None:
        """W&B sends in its own process; `run.finish()` is the user's."""


def _millis() -> int:
    return int(time.time() * 1000)
