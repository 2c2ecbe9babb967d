"""The tracker a `mirror=` entry names (the trackers themselves: trackers/adapters.py)."""

from __future__ import annotations

import os
from typing import Any

from ampwatch.trackers.adapters import (
    MlflowTracker,
    TensorBoardTracker,
    Tracker,
    WandbTracker,
)


def tracker_for(spec: Any) -> Tracker:
    """The tracker a `mirror=` entry names: "tensorboard:<dir>", "wandb", "mlflow", a
    SummaryWriter, a wandb run, an MLflow run or a Tracker. ValueError for anything else."""
    if isinstance(spec, str):
        name, _, where = spec.strip().partition(":")
        if name == "wandb":
            return WandbTracker.active()
        if name == "mlflow":
            return MlflowTracker.active()
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            return TensorBoardTracker(SummaryWriter(where or os.path.join("runs", "ampwatch")))
        raise ValueError(f"unknown tracker {spec!r}: wandb, mlflow or tensorboard:<dir>")
    if hasattr(spec, "add_scalar") and hasattr(spec, "add_text"):
        return TensorBoardTracker(spec)
    if hasattr(spec, "log") and hasattr(spec, "define_metric") and hasattr(spec, "summary"):
        return WandbTracker(spec)
    if hasattr(getattr(spec, "info", None), "run_id"):  # an mlflow.entities.Run
        import mlflow

        return MlflowTracker(spec.info.run_id, mlflow.get_tracking_uri())
    if all(hasattr(spec, m) for m in ("write_scalars", "write_incident", "close", "name")):
        return spec  # already a Tracker
    raise ValueError(f"cannot mirror into {type(spec).__name__}: pass a SummaryWriter, "
                     "a wandb run, 'wandb', 'mlflow' or 'tensorboard:<dir>'")

