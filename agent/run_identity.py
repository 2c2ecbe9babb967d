"""Which run `attach()` writes to: the run id and labels it checks, and whether a given id
may continue a run that already has steps (`resume`).

A run id reaches a URL path and a spool directory name, so it must match API v1's
pattern (wire/runs.py) before anything is sent or written. A reused id must be asked
for: without `resume`, a (run, rank) that already has steps in the spool or on the
server is refused with a ValueError, as W&B refuses a run id it already knows.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from ampwatch.agent.transport.spool import spooled_last_step
from ampwatch.wire import check_label, check_run_id

if TYPE_CHECKING:
    from ampwatch.agent.settings import AgentSettings

TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"", "0", "false", "no", "off"}
SERVER_CHECK_TIMEOUT_S = 2.0


def resolve_run(run: str | None, resume: bool | None) -> tuple[str | None, bool]:
    """(run id or None for a new generated one, resume), keyword arguments over
    `AMPWATCH_RUN_ID` and `AMPWATCH_RESUME`. ValueError for an id API v1 refuses, an
    unreadable `AMPWATCH_RESUME`, or `resume` without a run id."""
    if run is None:
        run = os.environ.get("AMPWATCH_RUN_ID") or None
    if run is not None:
        check_run_id(run)
    if resume is None:
        word = os.environ.get("AMPWATCH_RESUME", "").strip().lower()
        if word not in TRUE_WORDS | FALSE_WORDS:
            raise ValueError(f"AMPWATCH_RESUME={word!r}: use 1/true/yes or 0/false/no")
        resume = word in TRUE_WORDS
    if resume and run is None:
        raise ValueError("resume needs the id of the run to continue: pass run=... "
                         "(or set AMPWATCH_RUN_ID)")
    return run, bool(resume)


def check_labels(name: Any, project: Any, tags: Any) -> None:
    """ValueError unless name, project and every tag are labels API v1 accepts."""
    if name is not None:
        check_label(name, "name")
    if project is not None:
        check_label(project, "project")
    if tags is not None:
        if isinstance(tags, str) or not isinstance(tags, list | tuple):
            raise ValueError(f"tags must be a list of strings, not {type(tags).__name__}")
        for tag in tags:
            check_label(tag, "tag")


def refuse_reused_run(settings: AgentSettings) -> None:
    """ValueError when a run id the caller chose already has steps for this rank, in the
    spool or on the server, and `resume` is off. Costs one GET to the server (up to
    `SERVER_CHECK_TIMEOUT_S`; an unreachable server leaves the spool to decide), made only
    for a chosen id without `resume`."""
    if settings.run_id_generated or settings.resume:
        return
    where = []
    spooled = spooled_last_step(Path(settings.spool_dir), settings.run_id, settings.rank)
    if spooled is not None:
        where.append(f"in the spool {settings.spool_dir} (up to step {spooled})")
    if not settings.offline:
        on_server = _server_last_step(settings.server, settings.run_id, settings.rank,
                                      settings.token)
        if on_server is not None:
            where.append(f"on the server {settings.server} (up to step {on_server})")
    if where:
        raise ValueError(
            f"run {settings.run_id!r} already has steps of rank {settings.rank} "
            f"{' and '.join(where)}: pass resume=True (or set AMPWATCH_RESUME=1) to continue "
            "it, or another run id (run=None makes a new one)")


def _server_last_step(server: str, run_id: str, rank: int, token: str = "") -> int | None:
    """The rank's last step on the server; None when it has none or cannot be asked."""
    headers = {"User-Agent": "ampwatch-agent"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        reply = httpx.get(f"{server}/api/v1/runs/{run_id}", timeout=SERVER_CHECK_TIMEOUT_S,
                          headers=headers)
    except httpx.HTTPError:
        return None
    if reply.status_code != 200:
        return None
    try:
        ranks = reply.json().get("ranks") or []
    except (ValueError, AttributeError):
        return None
    for entry in ranks:
        if entry.get("rank") == rank and entry.get("last_step") is not None:
            return int(entry["last_step"])
    return None
