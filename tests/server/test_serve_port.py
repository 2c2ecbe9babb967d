"""Issue #59 point 11: `ampwatch serve` on a port in use says so, exits non-zero and
makes nothing: no "serving on", no startup, no database file."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import LiveServer


def test_serve_on_a_busy_port_says_so_and_creates_nothing(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        database = tmp_path / "never.db"
        done = subprocess.run(
            [sys.executable, "-m", "ampwatch.client.cli", "serve", "--port", str(port),
             "--database-url", f"sqlite:///{database}"],
            capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"ampwatch: port {port} on 127.0.0.1 is in use (is another server running? "
        "choose one with --port)"]
    assert "serving on" not in done.stdout and "startup" not in done.stdout + done.stderr
    assert not database.exists()


def test_serve_still_serves_on_a_free_port(tmp_path: Path) -> None:
    server = LiveServer(f"sqlite:///{tmp_path / 'live.db'}", tmp_path / "server.log")
    server.start()
    try:
        assert "serving on" in (tmp_path / "server.log").read_text()
    finally:
        server.stop()
