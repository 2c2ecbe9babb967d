"""A run's FP8 report: its FP8 layers, what their casts lose over step buckets, and its
FP8 findings; the API's /fp8 and the FP8 page read the same."""

from __future__ import annotations

from sqlalchemy.orm import Session

from ampwatch.server.analysis.kinds import Section, kinds_in
from ampwatch.server.findings.queries import list_findings
from ampwatch.server.services.runs import get_run
from ampwatch.server.store.fp8_samples import fp8_report
from ampwatch.server.store.storage import load_layers

MAX_FINDINGS = 500


def fp8_twin(session: Session, run_id: str, *, rank: int, start: int | None,
             end: int | None, buckets: int) -> dict:
    """The FP8 report of a run and rank, with the run's FP8 findings."""
    get_run(session, run_id)
    report = fp8_report(session, run_id, load_layers(session, run_id), rank, start=start,
                        end=end, buckets=buckets)
    findings = [f.model_dump(mode="json") for kind in kinds_in(Section.FP8)
                for f in list_findings(session, run_id=run_id, kind=kind,
                                       limit=MAX_FINDINGS).items]
    return {"rank": rank, **report, "findings": findings}
