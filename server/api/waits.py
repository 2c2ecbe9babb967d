"""`?wait=SECONDS` on the reads of findings, incidents, spikes and run status: the
request first waits, up to that long, until the server has judged every stored batch of
the run (of every run when the route names none), so a script that trains and then reads
gets the findings of what it sent. 0, the default, answers at once."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import Depends, Query, Request

from ampwatch.server.worker.analysis_worker import settle

# A waiting request holds one of the server's request slots (and a worker thread): bounded
MAX_WAIT_S = 60.0
WAIT_HELP = ("seconds to first wait, at most 60, for the analysis of the run's stored "
             "batches (every run's, without a run): a read right after ingest then holds "
             "their findings; 0 answers at once. The run's `analysis_pending` says how "
             "many were still waiting")


async def wait_for_analysis(
    request: Request,
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, description=WAIT_HELP)] = 0.0,
) -> None:
    """Hold the request until the run's analysis queue is empty or `wait` has passed."""
    if not wait:
        return
    run_id = request.path_params.get("run_id") or request.query_params.get("run_id")
    state = request.app.state
    await anyio.to_thread.run_sync(settle, state.sessionmaker, state.analysis_worker, wait,
                                   run_id)


AnalysisWait = Depends(wait_for_analysis)
