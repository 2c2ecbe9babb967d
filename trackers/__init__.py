"""What a tracker (TensorBoard, MLflow, W&B) is told of a run, and the tracker adapters
that tell it: the per-step scalars under `ampwatch/` (`scalars`), incident notes
(`incident_notes`), one small class per tracker behind one protocol (`adapters`).

The agent's mirror (agent/mirror) and `ampwatch export --to` (client) both write through
it. Imports `wire` and the standard library only; the tracker libraries are imported
when a tracker is used, never here, and the server never imports this package
(docs/architecture.md, "The walls").
"""

from ampwatch.trackers.adapters import MlflowTracker, Row, TensorBoardTracker, Tracker, WandbTracker
from ampwatch.trackers.incident_notes import IncidentNote, bundle_for
from ampwatch.trackers.scalars import step_scalars

__all__ = ["IncidentNote", "MlflowTracker", "Row", "TensorBoardTracker", "Tracker",
           "WandbTracker", "bundle_for", "step_scalars"]
