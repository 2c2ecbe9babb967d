"""The `ampwatch` command line against a live server: every command, --json parsed back,
and every error path in one line on stderr with a non-zero exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ampwatch.client import Client
from ampwatch.client.cli import ERROR_EXIT
from tests.client.conftest import N_LAYERS, seed_diverging, seed_healthy
from tests.conftest import LiveServer, free_port
from tests.utils import WAIT, make_steps, post_batch, register_run


def test_runs_table_is_aligned(ampwatch) -> None:
    result = ampwatch("runs")
    assert result.code == 0, result.err
    header, *rows = result.out.splitlines()
    assert header.split()[:4] == ["ID", "NAME", "PROJECT", "STATUS"]
    assert "SKIP RATE" in header and "PROBLEMS" in header
    by_id = {row.split()[0]: row for row in rows}
    assert set(by_id) >= {"healthy", "diverging"}
    assert "critical" in by_id["diverging"] and "23.1%" in by_id["diverging"]
    assert "65536 (2^16)" in by_id["healthy"] and "0.0%" in by_id["healthy"]
    # right-aligned numbers end in the same column
    ends = {row.index("%") for row in rows}
    assert len(ends) == 1


def test_runs_json_and_filters(ampwatch, server, server_api) -> None:
    seed_healthy(server_api, "other-project", project="elsewhere")
    server.wait_for_analysis("other-project")  # its status comes from its findings
    runs = json.loads(ampwatch("runs", "--json").out)
    assert {"healthy", "diverging", "other-project"} <= {r["id"] for r in runs}
    critical = json.loads(ampwatch("runs", "--status", "critical", "--json").out)
    assert [r["id"] for r in critical] == ["diverging"]
    assert critical[0]["loss_scale"] == 32768.0 and critical[0]["status"] == "critical"
    elsewhere = json.loads(ampwatch("runs", "--project", "elsewhere", "--json").out)
    assert [r["id"] for r in elsewhere] == ["other-project"]
    assert ampwatch("runs", "--project", "nowhere").out.strip() == "no runs"


def test_show_summarises_a_run_with_its_incidents(ampwatch, server) -> None:
    result = ampwatch("show", "diverging")
    assert result.code == 0, result.err
    assert "status:     critical" in result.out
    assert "260 (last step 259, 60 skipped, 23.1%)" in result.out
    assert "32768 (2^15)" in result.out
    assert "autocast float16, GradScaler (growth interval 2000)" in result.out
    with Client(server.url) as client:
        incidents = client.incidents("diverging", status="open")
        findings = client.findings("diverging", status="open")
    problems = [i for i in incidents if i.problem]
    assert len(incidents) < len(findings)  # counted by root cause, not by finding
    assert f"Open problems ({len(problems)}):" in result.out
    assert "blocks.0.fc" in result.out and "from step 200" in result.out
    assert "steps skipped in a row" in result.out  # the incident's timeline
    # the API's headline is the CLI's words, as it is the card's title (card_title)
    assert all(i.headline in result.out for i in incidents if i.headline)
    assert any(i.headline for i in incidents)


def test_show_json(ampwatch, server) -> None:
    shown = json.loads(ampwatch("show", "diverging", "--json").out)
    with Client(server.url) as client:
        expected = client.run("diverging")
    assert shown["run"] == expected.to_json()
    assert {f["kind"] for f in shown["findings"]} >= {"scaler_divergence", "nonfinite"}
    assert {f["incident"] for f in shown["findings"]} == {i["id"] for i in shown["incidents"]}


def test_findings_across_runs_and_by_severity(ampwatch, server) -> None:
    every = ampwatch("findings")
    assert every.code == 0
    assert every.out.splitlines()[0].split()[:3] == ["SEVERITY", "RUN", "KIND"]
    assert "healthy" in every.out and "diverging" in every.out
    critical = json.loads(ampwatch("findings", "--severity", "critical", "--json").out)
    assert [(f["run_id"], f["kind"]) for f in critical] == [("diverging", "scaler_divergence")]
    mine = json.loads(ampwatch("findings", "diverging", "--json").out)
    with Client(server.url) as client:
        api = client.findings("diverging", status="open")
    assert sorted(f["id"] for f in mine) == sorted(f.id for f in api)
    assert mine[0]["severity"] == "critical"  # most severe first
    assert ampwatch("findings", "healthy", "--severity", "warning").out.strip() == "no findings"


@pytest.mark.parametrize("columns", [80, 200, 30])
def test_findings_messages_are_wrapped_to_the_terminal_never_cut(
        ampwatch, server, monkeypatch, columns: int) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))
    out = ampwatch("findings", "diverging").out
    with Client(server.url) as client:
        messages = [f.message for f in client.findings("diverging", status="open")]
    assert max(len(m) for m in messages) > 100
    lines = out.splitlines()
    assert all(len(line) <= max(columns, 44) for line in lines[1:] if line.startswith(" "))
    words = " ".join(out.split())
    for message in messages:  # every word of every message, in order
        assert " ".join(message.split()) in words


def test_findings_in_a_pipe_are_whole_lines(ampwatch, server, monkeypatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    out = ampwatch("findings", "diverging").out
    with Client(server.url) as client:
        messages = [f.message for f in client.findings("diverging", status="open")]
    assert all(any(line.endswith(m) for line in out.splitlines()) for m in messages)


@pytest.mark.parametrize("run_id, fail_on, code", [
    ("healthy", "warning", 0),
    ("healthy", "critical", 0),
    ("diverging", "warning", 1),
    ("diverging", "critical", 1),
])
def test_check_exit_status(ampwatch, run_id: str, fail_on: str, code: int) -> None:
    result = ampwatch("check", run_id, "--fail-on", fail_on)
    assert result.code == code, result.out + result.err
    if code:  # the card, told as `show` tells it: headline, first step, fix
        assert result.out.startswith(
            "CRITICAL Gradients of layer 'blocks.0.fc' are inf/NaN (from step 200)")
        assert "fix: " in result.out and "scaler_divergence" not in result.out
        assert f"failed: run {run_id} has 1 open finding at or above {fail_on}" in result.err
    else:
        assert result.out.startswith(f"ok: run {run_id} has no open findings")


def test_check_json(ampwatch) -> None:
    result = ampwatch("check", "diverging", "--json")
    verdict = json.loads(result.out)
    assert result.code == 1
    assert (verdict["passed"], verdict["fail_on"], verdict["status"]) == (
        False, "critical", "critical")
    assert [f["kind"] for f in verdict["findings"]] == ["scaler_divergence"]
    assert [i["cause"] for i in verdict["incidents"]] == ["grad_overflow"]
    assert json.loads(ampwatch("check", "healthy", "--json").out)["passed"] is True


def test_check_of_a_run_without_steps_does_not_pass(ampwatch, server_api) -> None:
    assert server_api.put("/api/v1/runs/empty-run", json={"name": "empty"}).status_code == 200
    result = ampwatch("check", "empty-run")
    assert result.code == ERROR_EXIT and result.out == ""
    assert result.err == "run empty-run has no steps stored: nothing to check\n"
    assert json.loads(ampwatch("check", "empty-run", "--json").out)["passed"] is False


@pytest.fixture
def workerless_server(tmp_path: Path) -> Iterator[LiveServer]:
    """A server that judges nothing itself: its batches wait for an `ampwatch worker`,
    and its reads answer at once."""
    live = LiveServer(f"sqlite:///{tmp_path / 'live.db'}", tmp_path / "server.log",
                      env={"AMPWATCH_EMBEDDED_WORKER": "0"})
    live.start()
    yield live
    live.stop()


def test_check_waits_for_the_runs_analysis(ampwatch, workerless_server) -> None:
    from ampwatch.server.settings import Settings
    from ampwatch.server.worker.analysis_worker import run_worker

    url = workerless_server.url
    with httpx.Client(base_url=url) as api:
        seed_diverging(api)  # one batch each, not judged: no finding yet
        seed_healthy(api)
    for run_id, wait in (("diverging", "1"), ("healthy", "0")):
        result = ampwatch("check", run_id, "--wait", wait, "--json", server_url=url)
        assert result.code == ERROR_EXIT and result.out == ""
        assert result.err == (
            f"waiting for the analysis of 1 batch of run {run_id} (up to {wait} s)\n"
            f"ampwatch: error: run '{run_id}': findings are not all in yet: analysis of 1 "
            f"batch still pending after {wait} s (is an analysis worker running? wait "
            "longer with --wait)\n")

    # show and runs say that findings may still come
    shown = ampwatch("show", "diverging", server_url=url)
    assert shown.code == 0, shown.err
    assert "analysis:   1 batch still to judge: findings may still come\n" in shown.out
    assert ("\nNo open problems yet: 1 batch still to judge "
            "(`ampwatch check diverging` waits for them).\n") in shown.out
    listed = ampwatch("runs", server_url=url)
    assert listed.code == 0, listed.err
    assert "0 (1 batch still to judge)" in listed.out

    # an `ampwatch worker` starts while the check waits (default 60 s)
    stop = threading.Event()
    worker = threading.Timer(2.0, run_worker, args=(
        Settings(database_url=workerless_server.database_url), stop), kwargs={"poll_s": 0.1})
    worker.start()
    try:
        result = ampwatch("check", "diverging", server_url=url)
        assert result.code == 1, result.err
        assert result.err.startswith(
            "waiting for the analysis of 1 batch of run diverging (up to 60 s)\n")
        assert "failed: run diverging has 1 open finding at or above critical" in result.err
        result = ampwatch("check", "healthy", server_url=url)  # judged next, or already
        assert result.code == 0, result.err
        assert result.out.startswith("ok: run healthy has no open findings")
    finally:
        stop.set()
        worker.cancel()
        worker.join(30)


def test_check_refuses_a_negative_wait(ampwatch) -> None:
    result = ampwatch("check", "healthy", "--wait", "-1")
    assert (result.code, result.err) == (
        ERROR_EXIT, "ampwatch: error: --wait must be 0 or more seconds\n")


@pytest.mark.parametrize("args", [
    ["runs"], ["show", "healthy"], ["findings"], ["check", "healthy"], ["sync", "."],
])
def test_server_down_is_one_line(ampwatch, args: list[str]) -> None:
    result = ampwatch(*args, server_url=f"http://127.0.0.1:{free_port()}")
    assert result.code == ERROR_EXIT
    assert result.out == ""
    assert result.err.count("\n") == 1
    assert result.err.startswith("ampwatch: error: cannot reach")
    assert "is the server running?" in result.err


@pytest.mark.parametrize("args", [
    ["show", "ghost"], ["findings", "ghost"], ["check", "ghost"],
    ["export", "ghost", "--out", "ghost.csv"],
])
def test_unknown_run_is_one_line(ampwatch, args: list[str], tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = ampwatch(*args)
    assert result.code == ERROR_EXIT
    assert result.err == "ampwatch: error: 404 Not Found: no run with id 'ghost'\n"
    assert not (tmp_path / "ghost.csv").exists()


def test_usage_errors_are_one_line(ampwatch, tmp_path: Path) -> None:
    result = ampwatch("export", "healthy", "--out", tmp_path / "steps.txt")
    assert result.code == ERROR_EXIT
    assert result.err == ("ampwatch: error: cannot tell the format of "
                          f"'{tmp_path / 'steps.txt'}': pass --format csv|jsonl|parquet\n")
    result = ampwatch("export", "healthy", "--out", tmp_path / "missing" / "steps.csv")
    assert result.code == ERROR_EXIT and result.err.startswith("ampwatch: error: no directory")
    result = ampwatch("sync", tmp_path / "no-spool")
    assert result.err == f"ampwatch: error: no spool directory at {tmp_path / 'no-spool'}\n"


@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("token-server")
    live = LiveServer(f"sqlite:///{directory / 'live.db'}", directory / "server.log",
                      env={"AMPWATCH_TOKEN": "s3cret"})
    live.start()
    yield live
    live.stop()


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The real entry point in a child process, as a shell would run it."""
    return subprocess.run([sys.executable, "-m", "ampwatch.client.cli", *args], capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, "AMPWATCH_TOKEN": "", **env})


def test_token_from_the_environment_or_the_flag(token_server) -> None:
    env = {"AMPWATCH_SERVER": token_server.url, "AMPWATCH_TOKEN": "s3cret"}
    ok = run_cli("runs", "--json", env=env)
    assert (ok.returncode, json.loads(ok.stdout), ok.stderr) == (0, [], "")
    flag = run_cli("runs", "--token", "s3cret", env={"AMPWATCH_SERVER": token_server.url})
    assert (flag.returncode, flag.stdout.strip()) == (0, "no runs")


@pytest.mark.parametrize("token, expected", [("wrong", "a wrong token"), ("", "no token")])
def test_bad_token_is_one_line_without_traceback(token_server, token: str,
                                                 expected: str) -> None:
    result = run_cli("runs", env={"AMPWATCH_SERVER": token_server.url,
                                  "AMPWATCH_TOKEN": token})
    assert result.returncode == ERROR_EXIT
    assert result.stdout == ""
    assert result.stderr == ("ampwatch: error: 401 Unauthorized: missing or wrong token: "
                             "send 'Authorization: Bearer <AMPWATCH_TOKEN>' "
                             f"({expected}: set --token or AMPWATCH_TOKEN)\n")


def test_entry_point_lists_every_command() -> None:
    result = run_cli("--help", env={})
    assert result.returncode == 0
    for command in ("runs", "show", "findings", "check", "export", "sync", "serve"):
        assert f"    {command} " in result.stdout


def test_api_client_and_cli_share_the_findings_and_limit_defaults(ampwatch, server,
                                                                   server_api) -> None:
    """docs/wire-format.md: findings are open and resolved unless `status` narrows them;
    an API answer holds 100 items unless `limit` says otherwise, and the client and the
    CLI fetch every page."""
    seed_diverging(server_api, "recovered")  # a skip streak, then clean steps resolve it
    assert post_batch(server_api, "recovered", 1,
                      make_steps(260, 200, N_LAYERS)).status_code == 200
    api = server_api.get("/api/v1/runs/recovered/findings", params=WAIT).json()
    statuses = {f["status"] for f in api["items"]}
    assert statuses == {"open", "resolved"}
    with Client(server.url) as client:
        assert {f.id for f in client.findings("recovered")} == {f["id"] for f in api["items"]}
    cli = json.loads(ampwatch("findings", "recovered", "--json").out)
    assert {f["id"] for f in cli} == {f["id"] for f in api["items"]}
    assert [f["status"] for f in cli] == sorted((f["status"] for f in cli),
                                                key=lambda s: s != "open")  # open first
    table = ampwatch("findings", "recovered").out
    assert table.splitlines()[0].split()[:2] == ["SEVERITY", "STATUS"] and "resolved" in table

    for index in range(105):
        register_run(server_api, f"many-{index:03d}", project="many")
    for path in ("/api/v1/runs", "/api/v1/findings", "/api/v1/runs/recovered/findings"):
        assert server_api.get(path).json()["limit"] == 100
        assert server_api.get(path, params={"limit": 1001}).status_code == 422
    assert len(server_api.get("/api/v1/runs", params={"project": "many"}).json()["items"]) == 100
    with Client(server.url) as client:
        assert len(client.runs(project="many")) == 105
    assert len(json.loads(ampwatch("runs", "--project", "many", "--json").out)) == 105
    assert len(json.loads(ampwatch("runs", "--project", "many", "--limit", "7",
                                   "--json").out)) == 7
