"""Analysis: detectors that turn stored steps into findings (what is wrong, where, and how
to fix it), run incrementally on ingest. See docs/architecture.md,
"Finding kinds and detectors".

Detectors are pure functions `detect_*(window, settings) -> Detection` (window.py), each
registered with its inputs and finding kinds in `registry` (kinds: `kinds`); `service`
runs them on a recent window and `server/findings/store.py` upserts `Finding` rows. The
package does not import `service` itself: it sits above findings/, which imports the
detectors' modules.
"""

from ampwatch.server.analysis.context import LayerInfo, RunContext
from ampwatch.server.analysis.draft import Detection, FindingDraft
from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.analysis.registry import run_detectors
from ampwatch.server.analysis.settings import AnalysisSettings

__all__ = [
    "AnalysisSettings",
    "Detection",
    "FindingDraft",
    "FindingKind",
    "LayerInfo",
    "RunContext",
    "run_detectors",
]
