"""Delivery under faults, against real server processes: a token the agent lacks, a server
hung by SIGSTOP, a proxy answering 503 for a while, a config JSON cannot hold. Each test
counts the steps the server stored against the steps the loop ran."""

from __future__ import annotations

import enum
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from ampwatch import agent
from tests.agent.conftest import SERVER_TOKEN
from tests.agent.factories import batches, bf16_loop, mlp, spooled_steps
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
TOKEN = SERVER_TOKEN


def stored_steps(url: str, run_id: str, token: str = "") -> list[int]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    reply = httpx.get(f"{url}/api/v1/runs/{run_id}/steps", params={"limit": 100_000},
                      headers=headers, timeout=30)
    reply.raise_for_status()
    return [item["step"] for item in reply.json()["items"]]


def run_totals(url: str, run_id: str, token: str = "") -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    reply = httpx.get(f"{url}/api/v1/runs/{run_id}", headers=headers, timeout=30)
    reply.raise_for_status()
    return reply.json()


def sync(spool: Path, url: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ampwatch.client.cli", "sync", str(spool),
                           "--server", url, "--no-progress", *extra],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


# ---------------------------------------------------------------------- token
def test_without_the_token_the_run_is_kept_and_said_once_then_sync_delivers_it(
        token_server, spool_dir, agent_errors, monkeypatch, caplog) -> None:
    monkeypatch.delenv("AMPWATCH_TOKEN", raising=False)
    caplog.set_level(logging.WARNING, logger="ampwatch")
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    attachment = agent.attach(model, server=token_server.url, flush_interval=0.1,
                              max_batch_steps=10)
    try:
        bf16_loop(model, optimizer, batches(40))
        assert not attachment.flush(3)  # refused: nothing can be delivered
        bf16_loop(model, optimizer, batches(5))
        attachment.flush(1)
    finally:
        attachment.detach(timeout=1)
    # said once, as the user's setting rather than an error of the agent's
    # (tests/agent/test_outage.py checks the message's text)
    refused = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
               and "AMPWATCH_TOKEN" in r.getMessage()]
    assert len(refused) == 1 and not agent_errors
    assert token_server.url in refused[0] and "401" in refused[0]
    assert [s["step"] for s in spooled_steps(spool_dir, attachment.run_id)] == list(range(45))

    assert sync(spool_dir, token_server.url).returncode == 1  # still no token: kept
    done = sync(spool_dir, token_server.url, "--token", TOKEN)
    assert done.returncode == 0, done.stdout + done.stderr
    assert stored_steps(token_server.url, attachment.run_id, TOKEN) == list(range(45))
    assert not spooled_steps(spool_dir, attachment.run_id)


@pytest.mark.parametrize("how", ["environment", "argument"])
def test_the_token_is_sent_and_every_step_arrives(token_server, spool_dir, monkeypatch,
                                                  how) -> None:
    if how == "environment":
        monkeypatch.setenv("AMPWATCH_TOKEN", TOKEN)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with agent.attach(model, server=token_server.url, flush_interval=0.1,
                      token=TOKEN if how == "argument" else None) as attachment:
        bf16_loop(model, optimizer, batches(30))
        assert attachment.flush(15)
    assert stored_steps(token_server.url, attachment.run_id, TOKEN) == list(range(30))


# ---------------------------------------------------------------------- hung server
def test_a_server_hung_for_60_s_mid_run_loses_no_step(server, spool_dir) -> None:
    """SIGSTOP: connections are accepted by the kernel and never answered, so every
    request waits its full timeout; the loop runs at full speed through it."""
    model = mlp(width=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches(3000)
    attachment = agent.attach(model, server=server.url)  # defaults: 2 s / 200 steps
    assert server.process is not None
    try:
        bf16_loop(model, optimizer, data[:1000], autocast=False)
        os.kill(server.process.pid, signal.SIGSTOP)
        hung_at = time.monotonic()
        try:
            bf16_loop(model, optimizer, data[1000:], autocast=False)
            # while the server hangs, the spooler goes on writing batches (on a loaded
            # machine it may trail a loop this fast by a few seconds)
            attachment._watch.close_pending()
            while (len(spooled_steps(spool_dir, attachment.run_id)) < 2000
                   and time.monotonic() - hung_at < 50):
                time.sleep(0.5)
            assert len(spooled_steps(spool_dir, attachment.run_id)) >= 2000
            time.sleep(max(0.0, 60 - (time.monotonic() - hung_at)))
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert attachment.flush(60)
    finally:
        attachment.detach()
    assert stored_steps(server.url, attachment.run_id) == list(range(3000))
    totals = run_totals(server.url, attachment.run_id)
    assert (totals["dropped_steps"], totals["lost_batches"], totals["missing_steps"]) == (0, 0, 0)
    assert not spooled_steps(spool_dir, attachment.run_id)


# ---------------------------------------------------------------------- 5xx
@pytest.fixture
def flaky_proxy(server) -> Iterator[str]:
    port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "tests.agent.flaky_proxy", server.url,
                              str(port)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proxy.stdout is not None and proxy.stdout.readline().strip() == "ready"
        yield f"http://127.0.0.1:{port}"
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
        if proxy.stdout is not None:
            proxy.stdout.close()


def test_a_server_answering_503_for_a_while_loses_no_step(server, flaky_proxy,
                                                          spool_dir) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    httpx.post(f"{flaky_proxy}/_proxy/fail", timeout=10)
    attachment = agent.attach(model, server=flaky_proxy, flush_interval=0.1,
                              max_batch_steps=20)
    steps, failing = 0, True
    try:
        while failing or steps < 200:  # fail until the agent has met 3 failures (backoff)
            bf16_loop(model, optimizer, batches(10, seed=steps))
            steps += 10
            time.sleep(0.1)
            if failing and httpx.get(f"{flaky_proxy}/_proxy/stats",
                                     timeout=10).json()["failed"] >= 3:
                httpx.post(f"{flaky_proxy}/_proxy/pass", timeout=10)
                failing = False
            assert steps < 5000, "the agent never reached the proxy"
        assert attachment.flush(60)
    finally:
        attachment.detach()
    stats = httpx.get(f"{flaky_proxy}/_proxy/stats", timeout=10).json()
    assert stats["failed"] >= 3 and stats["forwarded"] >= 2
    assert stored_steps(server.url, attachment.run_id) == list(range(steps))
    assert run_totals(server.url, attachment.run_id)["missing_steps"] == 0


# ---------------------------------------------------------------------- config
class Precision(enum.Enum):
    BF16 = "bf16"


class Opaque:
    def __str__(self) -> str:
        return "opaque-thing"


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text")


def test_a_config_json_cannot_hold_is_sent_as_text_and_no_step_is_lost(
        server, spool_dir, caplog) -> None:
    config = {"out_dir": Path("/data/ckpt"), "lr": np.float32(0.5), "layers": np.int64(4),
              "betas": (0.9, np.float64(0.95)), "precision": Precision.BF16,
              "dtype": torch.bfloat16, "opaque": Opaque(), "broken": Unprintable(),
              "nested": {"paths": [Path("a"), Path("b")], 3: "int key"}}
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    caplog.set_level(logging.WARNING, logger="ampwatch.agent")
    with agent.attach(model, server=server.url, config=config, flush_interval=0.1,
                      name="config-run") as attachment:
        bf16_loop(model, optimizer, batches(20))
        assert attachment.flush(15)
    assert stored_steps(server.url, attachment.run_id) == list(range(20))
    run = run_totals(server.url, attachment.run_id)
    assert run["config"] == {"out_dir": "/data/ckpt", "lr": 0.5, "layers": 4,
                             "betas": [0.9, 0.95], "precision": "bf16",
                             "dtype": "torch.bfloat16", "opaque": "opaque-thing",
                             "nested": {"paths": ["a", "b"], "3": "int key"}}
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "config.opaque" in warned and "config.broken" in warned
    assert "config.out_dir" not in warned  # a Path is plainly text: nothing to say


# ---------------------------------------------------------------------- spool bound
@pytest.mark.parametrize("room", [1.5, 1.02], ids=["half-of-the-old-run", "all-of-it"])
def test_one_bound_for_the_whole_spool_drops_older_runs_first_and_counts_agree(
        server, spool_dir, monkeypatch, room) -> None:
    monkeypatch.setenv("AMPWATCH_MODE", "offline")
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def offline_run() -> str:
        with agent.attach(model, flush_interval=60, max_batch_steps=10) as attachment:
            bf16_loop(model, optimizer, batches(60))
        return attachment.run_id

    def spool_bytes() -> int:
        return sum(p.stat().st_size for p in spool_dir.rglob("*.json.gz"))

    old = offline_run()
    bound = int(spool_bytes() * room)
    monkeypatch.setenv("AMPWATCH_SPOOL_MAX_BYTES", str(bound))
    new = offline_run()
    assert spool_bytes() <= bound
    state = json.loads((spool_dir / old / "rank-0" / "state.json").read_text())
    assert state["dropped_steps"] >= 20  # the older run paid first
    if room > 1.2:
        assert [s["step"] for s in spooled_steps(spool_dir, new)] == list(range(60))

    done = sync(spool_dir, server.url)
    assert done.returncode == 0, done.stdout + done.stderr
    for run_id in (old, new):
        stored, totals = stored_steps(server.url, run_id), run_totals(server.url, run_id)
        assert len(stored) + totals["dropped_steps"] == 60  # every step stored or counted
        assert stored == list(range(60 - len(stored), 60))  # the oldest went first
        assert totals["missing_steps"] == totals["dropped_steps"]
    assert run_totals(server.url, old)["dropped_steps"] == state["dropped_steps"]

    page = httpx.get(f"{server.url}/runs/{old}", timeout=30)
    assert 'id="missing-steps"' in page.text and f"{state['dropped_steps']} steps" in page.text
    twin = httpx.get(f"{server.url}/runs/{old}", params={"format": "json"}, timeout=30).json()
    assert twin["run"]["missing_steps"] == state["dropped_steps"]
    if room > 1.2:
        assert 'id="missing-steps"' not in httpx.get(f"{server.url}/runs/{new}", timeout=30).text
