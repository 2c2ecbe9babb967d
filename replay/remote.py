"""`ampwatch replay` and the server: pull a bundle by run, rank and step, and record the
bisect verdict with the bundle (PUT .../bundles/{rank}/{step}/bisect), so the run's
incident gives the fix the replay found. Through the client; imports no torch.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from ampwatch.client import AmpwatchError, Client

# the keys of a report's "bisect" that the server keeps (BisectVerdictCreate)
VERDICT_KEYS = ("verdict", "modules", "fp8_modules", "fix", "reason", "trials", "device",
                "ran_at")


@dataclass(frozen=True)
class BundleOrigin:
    """The server a bundle belongs to and its place there."""

    server: str | None  # None: $AMPWATCH_SERVER, else the default address
    token: str | None
    run_id: str
    rank: int
    step: int


def pull(origin: BundleOrigin, folder: Path, timeout: float) -> Path:
    """Download the bundle into `folder`; may block `timeout` seconds per request."""
    with Client(origin.server, token=origin.token, timeout=timeout) as client:
        return client.download_bundle(origin.run_id, origin.step, folder, rank=origin.rank)


def origin_of(report: dict[str, Any], server: str | None,
              token: str | None) -> BundleOrigin | None:
    """Where a replayed bundle file came from (its run, rank and step, as a replay report
    gives them from bundle.json), when a server is named (`server`, else
    $AMPWATCH_SERVER) and the bundle names its run (every bundle of format 1 does)."""
    server = server or os.environ.get("AMPWATCH_SERVER")
    if not server or report.get("run_id") is None:
        return None
    return BundleOrigin(server, token, str(report["run_id"]), report["rank"], report["step"])


def replay_source() -> str:
    """Who ran the bisect, as the server shows it with the verdict ("reported by ..."):
    the sender's own word, which only the server's token vouches for."""
    return f"ampwatch replay {metadata.version('ampwatch')} on {socket.gethostname()}"[:256]


def record_verdict(origin: BundleOrigin, bisect: dict[str, Any], timeout: float) -> str | None:
    """Send a report's bisect verdict to the bundle's server; returns why it was not
    recorded (also said on stderr), None when it was. A replay's own result never
    depends on it. May block `timeout` seconds."""
    body = {key: bisect[key] for key in VERDICT_KEYS} | {"source": replay_source()}
    with Client(origin.server, token=origin.token, timeout=timeout) as client:
        try:
            client.record_bisect(origin.run_id, origin.step, body, rank=origin.rank)
            return None
        except AmpwatchError as exc:
            why = f"{client.base_url}: {exc.message}"
    print(f"ampwatch replay: the verdict was not recorded on {why}", file=sys.stderr)
    return why
