"""ampwatch's signals and incidents inside TensorBoard, MLflow and W&B (docs/trackers.md)."""

from ampwatch.agent.mirror.mirror import ENV, Mirror, resolve_trackers
from ampwatch.agent.mirror.trackers import tracker_for
from ampwatch.trackers.adapters import MlflowTracker, TensorBoardTracker, Tracker, WandbTracker
from ampwatch.trackers.incident_notes import IncidentNote
from ampwatch.trackers.scalars import step_scalars

__all__ = ["ENV", "IncidentNote", "Mirror", "MlflowTracker", "TensorBoardTracker", "Tracker",
           "WandbTracker", "resolve_trackers", "step_scalars", "tracker_for"]
