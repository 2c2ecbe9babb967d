"""`ampwatch sync`: a spool written by the real agent in offline mode reaches the server
once, however often it is synced; files go only after the server has them."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ampwatch.agent.transport.spool import Spool, read_entry
from ampwatch.client import Client, NotFound
from tests.conftest import LiveServer

STEPS = 30
TRAIN = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    from ampwatch import agent

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    with agent.attach(model, scaler, run=sys.argv[1], project="offline",
                      flush_interval=0.05, max_batch_steps=7):
        for _ in range(int(sys.argv[2])):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 16)).float().pow(2).mean()
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
""")


@pytest.fixture(scope="module")
def offline_spool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The spool of a real fp16 training run (CPU) under AMPWATCH_MODE=offline."""
    root = tmp_path_factory.mktemp("offline") / "spool"
    env = {**os.environ, "AMPWATCH_MODE": "offline", "AMPWATCH_SPOOL_DIR": str(root),
           "AMPWATCH_SERVER": "http://127.0.0.1:9"}  # offline: never contacted
    subprocess.run([sys.executable, "-c", TRAIN, "offline-run", str(STEPS)], env=env,
                   check=True, timeout=300)
    return root


@pytest.fixture
def spool(offline_spool: Path, tmp_path: Path) -> Path:
    """A fresh copy of the offline spool for one test."""
    copy = tmp_path / "spool"
    shutil.copytree(offline_spool, copy)
    return copy


def batch_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.json.gz") if "rejected" not in p.parts)


def spooled_steps(root: Path) -> dict[int, dict]:
    return {s["step"]: s for p in batch_files(root) for s in read_entry(p)["batch"]["steps"]}


@pytest.fixture
def fresh_server(tmp_path: Path):
    live = LiveServer(f"sqlite:///{tmp_path / 'sync.db'}", tmp_path / "server.log")
    live.start()
    yield live
    live.stop()


def test_offline_spool_is_uploaded_once(ampwatch, fresh_server, spool: Path) -> None:
    files = batch_files(spool)
    expected = spooled_steps(spool)
    assert len(expected) == STEPS and len(files) > 1
    with Client(fresh_server.url) as client:
        with pytest.raises(NotFound):
            client.run("offline-run")  # offline: the agent never talked to the server

        result = ampwatch("sync", spool, server_url=fresh_server.url)
        assert result.code == 0, result.err
        assert result.out == (f"uploaded {len(files)} batches ({STEPS} steps) and skipped 0 "
                              "the server already had; runs: offline-run\n")
        assert result.err == ""  # no progress bar when stderr is not a terminal
        assert batch_files(spool) == []
        assert (spool / "offline-run" / "rank-0" / "state.json").exists()  # the agent's

        run = client.run("offline-run")
        assert (run.project, run.steps, run.last_step, run.n_layers) == (
            "offline", STEPS, STEPS - 1, 3)
        assert run.environment["autocast_dtype"] == "float16"
        stored = client.steps("offline-run")
        assert [s.step for s in stored] == sorted(expected)
        for step in stored:
            assert step.loss_scale == expected[step.step]["loss_scale"]
            assert step.skipped == expected[step.step]["skipped"]


def test_sync_is_idempotent(ampwatch, fresh_server, spool: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    shutil.copytree(spool, again)
    count = len(batch_files(again))
    assert ampwatch("sync", spool, server_url=fresh_server.url).code == 0
    result = ampwatch("sync", again, "--json", "--no-progress", server_url=fresh_server.url)
    report = json.loads(result.out)
    assert result.code == 0 and result.err == ""
    assert (report["ok"], report["uploaded"], report["steps"]) == (True, 0, 0)
    assert (report["duplicates"], report["runs"]) == (count, ["offline-run"])
    assert batch_files(again) == []
    with Client(fresh_server.url) as client:
        assert client.run("offline-run").steps == STEPS
    assert ampwatch("sync", again, server_url=fresh_server.url).out.startswith(
        "nothing to upload")


def test_default_spool_dir_comes_from_the_environment(ampwatch, fresh_server, spool: Path,
                                                      monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_SPOOL_DIR", str(spool))
    result = ampwatch("sync", "--no-progress", server_url=fresh_server.url)
    assert result.code == 0 and "runs: offline-run" in result.out


def test_refused_batches_are_set_aside(ampwatch, fresh_server, spool: Path) -> None:
    files = batch_files(spool)
    entry = read_entry(files[1])
    lost = len(entry["batch"]["steps"]) + len(read_entry(files[2])["batch"]["steps"])
    entry["batch"]["steps"][0]["layer_grad_norm"] = [1.0]  # the run has 3 layers
    files[1].write_bytes(gzip.compress(json.dumps(entry).encode()))
    files[2].write_bytes(b"not gzip")

    result = ampwatch("sync", spool, "--no-progress", server_url=fresh_server.url)
    assert result.code == 1
    lines = result.err.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"ampwatch sync: rejected {files[1]} (moved to rejected/): "
                               "422 Unprocessable")
    assert lines[1].startswith(f"ampwatch sync: failed {files[2]}: unreadable spool file")
    assert batch_files(spool) == [files[2]]  # kept for a look, not lost
    assert (files[1].parent / "rejected" / files[1].name).exists()
    with Client(fresh_server.url) as client:
        assert client.run("offline-run").steps == STEPS - lost


def test_a_directory_a_running_agent_holds_is_skipped(ampwatch, fresh_server,
                                                      spool: Path) -> None:
    held = Spool(spool / "offline-run" / "rank-0", max_bytes=1 << 30)
    assert held.locked
    try:
        result = ampwatch("sync", spool, server_url=fresh_server.url)
    finally:
        held.close()
    assert result.code == 1
    assert result.err.endswith("a running agent holds it\n")
    assert len(batch_files(spool)) > 0
    assert ampwatch("sync", spool, server_url=fresh_server.url).code == 0


def test_files_stay_when_the_server_refuses_the_token(ampwatch, tmp_path: Path,
                                                      spool: Path) -> None:
    guarded = LiveServer(f"sqlite:///{tmp_path / 'token.db'}", tmp_path / "token.log",
                         env={"AMPWATCH_TOKEN": "s3cret"})
    guarded.start()
    try:
        before = batch_files(spool)
        result = ampwatch("sync", spool, "--token", "wrong", "--no-progress",
                          server_url=guarded.url)
        assert result.code == 1
        assert result.err.startswith("ampwatch sync: stopped: 401 Unauthorized")
        assert "run sync again" in result.err
        assert batch_files(spool) == before
        result = ampwatch("sync", spool, "--token", "s3cret", server_url=guarded.url)
        assert result.code == 0 and batch_files(spool) == []
    finally:
        guarded.stop()


def test_progress_bar_counts_batches(capsys) -> None:
    from ampwatch.client.commands.sync import progress_bar

    progress_bar(3, 4, Path("/spool/run-a/rank-0/000000000002.json.gz"))
    assert "[" + "#" * 22 + "-" * 8 + "] 3/4 batches  run-a" in capsys.readouterr().err
