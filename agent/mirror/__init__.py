"""ampwatch's signals and incidents inside TensorBoard, MLflow and W&B (docs/trackers.md)."""

from ampwatch.agent.mirror.mirror import ENV, Mirror, resolve_trackers
from ampwatch.agent.mirror.trackers import tracker_for
from ampwatch.wire.incident_notes import IncidentNote
from ampwatch.wire.mirror import step_scalars
from ampwatch.wire.trackers import MlflowTracker, TensorBoardTracker, Tracker, WandbTracker

__all__ = ["ENV", "IncidentNote", "Mirror", "MlflowTracker", "TensorBoardTracker", "Tracker",
           "WandbTracker", "resolve_trackers", "step_scalars", "tracker_for"]
