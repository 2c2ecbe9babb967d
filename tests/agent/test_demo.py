"""`ampwatch demo` end to end: the real command in a child process (it starts its own
server, trains on the CPU), then its database reopened with `ampwatch serve`."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ampwatch.client import Client, Finding
from tests.conftest import LiveServer, free_port

STEPS = 60  # the least the demo accepts: a few seconds per run


def run_demo(*args: str, data_home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_DATA_HOME": str(data_home)}
    return subprocess.run([sys.executable, "-m", "ampwatch.client.cli", "demo", *args],
                          capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, str]:
    """The finished demo and its database URL."""
    tmp = tmp_path_factory.mktemp("demo")
    database_url = f"sqlite:///{tmp / 'demo.db'}"
    result = run_demo("--port", str(free_port()), "--database-url", database_url,
                      "--steps", str(STEPS), data_home=tmp)
    assert result.returncode == 0, result.stdout + result.stderr
    return result, database_url


@pytest.fixture(scope="module")
def reopened(demo, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    """A client on `ampwatch serve` over the database the demo left behind."""
    server = LiveServer(demo[1], tmp_path_factory.mktemp("reopened") / "server.log")
    server.start()
    with Client(server.url) as client:
        yield client
    server.stop()


def open_findings(client: Client, run_id: str) -> list[Finding]:
    return list(client.findings(run_id, status="open"))


def test_prints_progress_urls_and_where_the_database_is(demo) -> None:
    result, database_url = demo
    out = result.stdout
    for run in ("1/4", "2/4", "3/4", "4/4"):
        assert f"[{run}]" in out and f"step {STEPS}/{STEPS}" in out
    assert "Dashboard: http://127.0.0.1:" in out
    assert "/runs/demo-fp16-overflow" in out
    assert f"ampwatch serve --database-url {database_url}" in out


def test_prints_what_the_alert_webhook_received(demo, reopened: Client) -> None:
    out = demo[0].stdout
    assert "Alerts: the server notified the webhook at http://127.0.0.1:" in out
    delivered = reopened.deliveries(status="delivered")
    # every incident (root cause) with a warning or critical finding was announced, once
    serious = {incident.id for run in reopened.runs(project="ampwatch-demo")
               for incident in reopened.incidents(run.id)
               if any(f.severity_rank >= 1 and f.incident == incident.id
                      for f in reopened.findings(run.id))}
    assert serious and sorted(d.finding_id for d in delivered if d.event == "opened") == \
        sorted(serious)
    for d in delivered:
        assert f"  {d.event:<9} {d.title}" in out
    # the overflowing layer is one problem: one notification when it opened
    overflow = [d for d in delivered
                if d.run_id == "demo-fp16-overflow" and d.event == "opened"]
    assert len(overflow) == 1
    assert "Layer 'fc2' overflows fp16 in the forward pass in run demo-fp16-overflow" in \
        overflow[0].title


def test_all_four_runs_are_stored(reopened: Client) -> None:
    runs = {run.id: run for run in reopened.runs(project="ampwatch-demo")}
    assert set(runs) == {"demo-fp16-healthy", "demo-fp16-overflow", "demo-fp16-misaligned",
                         "demo-bf16"}
    assert all(run.last_step == STEPS - 1 for run in runs.values())


def test_overflowing_layer_is_named_as_the_cause_of_the_divergence(reopened: Client) -> None:
    assert reopened.run("demo-fp16-overflow").status == "critical"
    divergence = [f for f in open_findings(reopened, "demo-fp16-overflow")
                  if f.kind == "scaler_divergence" and f.severity == "critical"]
    assert divergence
    assert all(f.evidence["cause"] == "forward_overflow" and f.layer == "fc2"
               for f in divergence)


def test_misaligned_run_shows_its_layers_and_the_pitfall(reopened: Client) -> None:
    findings = open_findings(reopened, "demo-fp16-misaligned")
    misaligned = {(f.layer, f.evidence["dimension"]) for f in findings
                  if f.kind == "misaligned_layer"}
    assert misaligned == {("hidden", "out_features"), ("head", "in_features")}
    assert any(f.kind == "pitfall" and f.code == "clip_before_unscale" for f in findings)


@pytest.mark.parametrize("run_id", ["demo-fp16-healthy", "demo-bf16"])
def test_healthy_runs_raise_nothing_serious(reopened: Client, run_id: str) -> None:
    assert reopened.run(run_id).status == "healthy"
    assert [f for f in open_findings(reopened, run_id) if f.severity != "info"] == []


def test_busy_port_is_a_one_line_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_demo("--port", str(port), "--database-url",
                          f"sqlite:///{tmp_path / 'demo.db'}", data_home=tmp_path)
    assert result.returncode == 2
    assert f"port {port} on 127.0.0.1 is in use" in result.stderr
    assert not (tmp_path / "demo.db").exists()


def test_a_rerun_keeps_the_earlier_runs_and_adds_new_ones(demo, reopened: Client) -> None:
    """Runs last in this module: it adds runs to the database the other tests read."""
    before = {run.id: run.last_step for run in reopened.runs(project="ampwatch-demo")}
    result = run_demo("--server", reopened.base_url, "--steps", str(STEPS),
                      data_home=Path(demo[1].removeprefix("sqlite:///")).parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "keeps the 4 runs of earlier demos; this is demo 2" in result.stdout
    assert f"{reopened.base_url}/runs/demo-fp16-overflow-2" in result.stdout
    after = {run.id: run.last_step for run in reopened.runs(project="ampwatch-demo")}
    assert {k: v for k, v in after.items() if k in before} == before  # untouched
    assert set(after) - set(before) == {f"{run_id}-2" for run_id in before}
    assert all(after[f"{run_id}-2"] == STEPS - 1 for run_id in before)


def _running(pid: int) -> bool:
    """Whether `pid` is alive (a zombie nobody reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
def test_a_demo_killed_outright_leaves_no_server_behind(tmp_path: Path) -> None:
    """The process that started the demo's server is SIGKILLed (no chance to stop the
    server itself): the server notices and shuts down on its own."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from ampwatch.demo.command import ServerProcess\n"
        f"server = ServerProcess({free_port()}, 'sqlite:///{tmp_path}/demo.db', "
        f"Path('{tmp_path}/server.log'))\n"
        "server.start()\n"
        "print(server.process.pid, flush=True)\n"
        "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              text=True)
    server_pid = None
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 60)
        assert ready, "the server did not start within 60 s"
        server_pid = int(parent.stdout.readline())
        assert _running(server_pid)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 15
        while _running(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _running(server_pid)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdout.close()
        if server_pid is not None and _running(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def test_uses_the_server_ampwatch_server_names(tmp_path: Path) -> None:
    # no server answers there: the demo says so rather than starting its own
    url = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path), "AMPWATCH_SERVER": url}
    result = subprocess.run([sys.executable, "-m", "ampwatch.client.cli", "demo"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0
    assert f"no ampwatch server answers at {url}" in result.stdout + result.stderr
    assert not (tmp_path / "ampwatch" / "demo.db").exists()
