"""Delivery against a real server process: outages, restarts, SIGKILL, `ampwatch sync`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import torch

from ampwatch import agent
from tests.agent.factories import batches, bf16_loop, mlp

REPO = Path(__file__).resolve().parents[2]


def _server_steps(url: str, run_id: str) -> list[int]:
    reply = httpx.get(f"{url}/api/v1/runs/{run_id}/steps", params={"limit": 100_000},
                      timeout=10)
    reply.raise_for_status()
    return [item["step"] for item in reply.json()["items"]]


def _rank(url: str, run_id: str) -> dict:
    reply = httpx.get(f"{url}/api/v1/runs/{run_id}", timeout=10)
    reply.raise_for_status()
    return reply.json()["ranks"][0]


def _train_slowly(model, optimizer, n: int) -> None:
    for x_y in batches(n):
        bf16_loop(model, optimizer, [x_y])
        time.sleep(0.01)


def test_outage_for_the_first_half_delivers_every_step_once(live_server, spool_dir) -> None:
    live_server.stop()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    attachment = agent.attach(model, server=live_server.url, flush_interval=0.1,
                              max_batch_steps=7)
    try:
        _train_slowly(model, optimizer, 30)
        attachment.flush(0.5)  # the server is down: everything stays in the spool
        assert list((spool_dir / attachment.run_id / "rank-0").glob("*.json.gz"))
        live_server.start()
        _train_slowly(model, optimizer, 30)
        assert attachment.flush(15)
    finally:
        attachment.detach()
    assert _server_steps(live_server.url, attachment.run_id) == list(range(60))
    rank = _rank(live_server.url, attachment.run_id)
    assert rank["lost_batches"] == 0 and rank["dropped_steps"] == 0
    assert not list((spool_dir / attachment.run_id / "rank-0").glob("*.json.gz"))


def test_resumed_run_continues_the_servers_sequence(live_server, tmp_path) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for machine in ("a", "b"):  # separate spools: only the server knows the next seq
        with agent.attach(model, run="resumed-run", server=live_server.url,
                          spool_dir=tmp_path / machine, resume=machine == "b") as attachment:
            bf16_loop(model, optimizer, batches(3))
            assert attachment.flush(10)
    rank = _rank(live_server.url, "resumed-run")
    # per machine: its steps, then on detach the batch that says the run finished
    assert rank["next_seq"] == 4 and rank["batches"] == 4 and rank["lost_batches"] == 0
    # machine b continued the step numbers after the server's last step
    assert _server_steps(live_server.url, "resumed-run") == list(range(6))


def _child(run_id: str, url: str, spool: Path, steps: int | None = None) -> subprocess.Popen:
    """A trainer that prints each step it finished with its time; forever, or `steps`."""
    script = textwrap.dedent(f"""
        import sys, time, torch
        torch.set_num_threads(1)
        sys.path.insert(0, {str(REPO)!r})
        from ampwatch import agent
        from tests.agent.factories import batches, bf16_loop, mlp
        model = mlp(); opt = torch.optim.SGD(model.parameters(), lr=0.01)
        attachment = agent.attach(model, run={run_id!r}, server={url!r}, flush_interval=0.3,
                                  resume={steps is not None!r})
        step, limit = 0, {steps!r}
        while limit is None or step < limit:
            bf16_loop(model, opt, batches(1))
            print(step, time.time(), flush=True)
            step += 1
            time.sleep(0.02)
        attachment.detach(30)
    """)
    env = {**os.environ, "AMPWATCH_SPOOL_DIR": str(spool)}
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)


@pytest.mark.parametrize("after", ["sync-server-down", "sync-server-up", "restart"])
def test_sigkill_loses_at_most_the_last_flush_interval_and_counts_it(live_server, spool_dir,
                                                                     after) -> None:
    """Bound (docs/agent.md): the steps since the last batch was cut, at most one flush
    interval; they are counted as dropped by whoever opens the spool next (`ampwatch
    sync`, or the restarted trainer, which leaves their step numbers as a visible gap).
    Only the steps the spooler had not picked up yet (its 50 ms poll) go uncounted."""
    if after == "sync-server-down":
        live_server.stop()
    run_id = f"killed-{after}"
    child = _child(run_id, live_server.url, spool_dir)
    done: list[tuple[int, float]] = []
    try:
        assert child.stdout is not None
        for line in child.stdout:
            step, at = line.split()
            done.append((int(step), float(at)))
            if len(done) >= 60:
                break
        killed_at = time.time()
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        # Steps printed before the kill but not read yet: the child ran them too.
        for line in child.stdout:
            step, at = line.split()
            done.append((int(step), float(at)))
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    if after == "sync-server-down":
        live_server.start()
    if after == "restart":
        again = _child(run_id, live_server.url, spool_dir, steps=10)
        out, _ = again.communicate(timeout=120)
        assert again.returncode == 0 and len(out.splitlines()) == 10
    else:
        sync = subprocess.run([sys.executable, "-m", "ampwatch.client.cli", "sync",
                               str(spool_dir), "--server", live_server.url, "--no-progress"],
                              capture_output=True, text=True, cwd=REPO, timeout=120)
        assert sync.returncode == 0, sync.stdout + sync.stderr
    stored = _server_steps(live_server.url, run_id)
    rank = _rank(live_server.url, run_id)
    # the killed process's steps: the restart's 10, detached cleanly, are the last stored
    # (after a gap where steps were lost, right after them when none was)
    killed = stored[:-10] if after == "restart" else stored
    first = [s for i, s in enumerate(killed) if s == i]
    assert len(set(stored)) == len(stored)  # each once
    flush_interval, slack = 0.3, 0.7
    must_have = [s for s, at in done if at < killed_at - flush_interval - slack]
    assert must_have and set(must_have) <= set(stored)
    lost = rank["dropped_steps"]  # decoded but never cut into a batch: counted
    assert lost <= len(done) - len(must_have) + 1
    uncounted = len(done) - len(first) - lost
    assert -1 <= uncounted <= 5, (len(done), len(first), lost)
    assert rank["missing_steps"] == lost
    if after == "restart":  # numbered after the lost ones: the gap shows where they were
        restarted = stored[len(first):]
        assert restarted == list(range(len(first) + lost, len(first) + lost + 10))
    else:
        assert len(stored) == len(first)
    assert not list(spool_dir.rglob("*.json.gz"))


def test_resumed_run_that_numbered_from_zero_offline_is_renumbered(live_server,
                                                                     tmp_path) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with agent.attach(model, run="resumed-late", server=live_server.url,
                      spool_dir=tmp_path / "a") as first:
        bf16_loop(model, optimizer, batches(3))
        assert first.flush(10)
    live_server.stop()  # machine b starts while the server is down: its spool says seq 0
    second = agent.attach(model, run="resumed-late", server=live_server.url, resume=True,
                          spool_dir=tmp_path / "b", max_batch_steps=2, flush_interval=0.1)
    try:
        bf16_loop(model, optimizer, batches(5))
        second.flush(0.5)
        live_server.start()
        assert second.flush(15)
    finally:
        second.detach()
    rank = _rank(live_server.url, "resumed-late")
    # batches: 1 + 3 of steps, each detach's `finished` event and b's `delivery` event (its
    # outage, sent once delivery recovered); steps: b could not learn the server's last
    # step, so its steps 0..4 replace the first ones, counted once
    assert (rank["batches"], rank["steps"], rank["lost_batches"]) == (7, 5, 0)
    assert _server_steps(live_server.url, "resumed-late") == list(range(5))
    assert not list((tmp_path / "b").rglob("*.json.gz"))  # nothing left behind or rejected


def test_resumed_run_on_the_same_machine_continues_from_its_spool(live_server,
                                                                    tmp_path) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    live_server.stop()  # neither process can reach the server: only the spool knows
    for again in (False, True):
        with agent.attach(model, run="same-machine", server=live_server.url, resume=again,
                          spool_dir=tmp_path, flush_interval=0.1) as attachment:
            bf16_loop(model, optimizer, batches(3))
            attachment.flush(0.3)
    live_server.start()
    sync = subprocess.run([sys.executable, "-m", "ampwatch.client.cli", "sync", str(tmp_path),
                           "--server", live_server.url], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert sync.returncode == 0, sync.stderr
    assert _server_steps(live_server.url, "same-machine") == list(range(6))
