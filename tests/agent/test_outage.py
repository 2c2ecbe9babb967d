"""A server the agent cannot use is said, once, on stderr and in the `ampwatch` logger:
a malformed URL (at attach), a dead port, https against an http server, a server that
hangs or starts late, a refused token; and the recovery, once, which the run page and
`ampwatch show` then tell too. Real server processes, a real model in a real loop; the
loop's steps never wait for any of it."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from markupsafe import escape

from ampwatch import agent
from ampwatch.agent.transport.delivery import Delivery
from tests.agent.conftest import SERVER_TOKEN
from tests.agent.factories import batches, bf16_loop, mlp, spooled_steps
from tests.conftest import LiveServer

REPO = Path(__file__).resolve().parents[2]
TOKEN = SERVER_TOKEN
# far below the sender's 10 s request timeout (and its 2 s connect timeout): a step that
# waited on the network would take at least that long
STEP_BOUND_S = 1.0
REFUSED = "connection refused: nothing listens on that port"


@pytest.fixture
def notices(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING, logger="ampwatch")
    return caplog


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The agent's messages to the user, in the order logged."""
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("ampwatch") and r.levelno == logging.WARNING
            and r.getMessage().startswith("ampwatch: ")]


def dead_port() -> int:
    """A port nothing listens on: bound, then closed."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Loop:
    """A real model in a real loop, timing each step (the host's monotonic clock)."""

    def __init__(self) -> None:
        self.model = mlp()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.steps = 0
        self.times: list[float] = []

    def run(self, n: int, pause: float = 0.01) -> None:
        for x_y in batches(n, seed=self.steps + 1):
            began = time.perf_counter()
            bf16_loop(self.model, self.optimizer, [x_y])
            self.times.append(time.perf_counter() - began)
            self.steps += 1
            time.sleep(pause)

    def until(self, caplog: pytest.LogCaptureFixture, pattern: str,
              timeout: float = 30.0) -> None:
        """Train until a message matching `pattern` (a regex, whole) was said."""
        deadline = time.monotonic() + timeout
        while not any(re.fullmatch(pattern, m) for m in said(caplog)):
            assert time.monotonic() < deadline, f"never said: {pattern}\nsaid: {said(caplog)}"
            self.run(5)


def unreachable(url: str, cause: str, folder: Path) -> str:
    return (f"ampwatch: cannot reach the server {url} ({cause}). Training goes on; the run "
            f"is spooled in {folder} and sent when the server answers, or later with "
            f"`ampwatch sync {folder} --server {url}`")


def recovered(url: str, cause: str) -> str:
    return (rf"ampwatch: server {re.escape(url)} reachable again; (\d+) spooled batch(es)? "
            rf"sent \(delivery was interrupted for \d+ s: {re.escape(cause)}\)")


def said_once_each(caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str],
                   expected: list[str]) -> None:
    """Exactly these messages (regexes, whole), each once, in the log and on stderr."""
    messages = said(caplog)
    assert len(messages) == len(expected), messages
    for message, pattern in zip(messages, expected, strict=True):
        assert re.fullmatch(pattern, message), (message, pattern)
    err = capfd.readouterr().err
    for message in messages:
        assert err.count(message) == 1, err


def stored_steps(url: str, run_id: str, token: str = "") -> list[int]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    reply = httpx.get(f"{url}/api/v1/runs/{run_id}/steps", params={"limit": 100_000},
                      headers=headers, timeout=30)
    reply.raise_for_status()
    return [item["step"] for item in reply.json()["items"]]


# ---------------------------------------------------------------------- malformed URL
@pytest.mark.parametrize(("url", "problem"), [
    ("localhost:8000", "has no http:// or https://"),
    ("ftp://127.0.0.1:8000", "has the unsupported scheme 'ftp://': use http:// or https://"),
    ("http://:8000", "has no host"),
])
def test_a_malformed_url_is_said_at_attach_and_the_run_is_spooled(
        url, problem, spool_dir, notices, capfd) -> None:
    loop = Loop()
    attachment = agent.attach(loop.model, server=url, flush_interval=0.1)
    folder = spool_dir / attachment.run_id
    expected = (f"ampwatch: the server URL {url!r} {problem}. Nothing is sent: the run is "
                f"spooled in {folder}. Fix AMPWATCH_SERVER (or attach(server=...)), then "
                f"send it with `ampwatch sync {folder} --server http://HOST:PORT`")
    assert said(notices) == [expected]  # at attach, before any step
    try:
        loop.run(20, pause=0)
        assert attachment.flush(5)  # written to the spool is all there is
    finally:
        attachment.detach()
    said_once_each(notices, capfd, [re.escape(expected)])
    assert [s["step"] for s in spooled_steps(spool_dir, attachment.run_id)] == list(range(20))


def test_offline_mode_with_a_malformed_url_spools_and_says_nothing(
        spool_dir, notices, monkeypatch) -> None:
    """AMPWATCH_MODE=offline: nothing was to be sent, so the URL is not judged."""
    monkeypatch.setenv("AMPWATCH_MODE", "offline")
    loop = Loop()
    attachment = agent.attach(loop.model, server="localhost:8000", flush_interval=0.1)
    try:
        loop.run(5, pause=0)
        assert attachment.flush(5)
    finally:
        attachment.detach()
    assert said(notices) == []
    assert [s["step"] for s in spooled_steps(spool_dir, attachment.run_id)] == list(range(5))


def test_a_users_stderr_handler_shows_it_and_nothing_more_is_printed(
        spool_dir, notices, capfd) -> None:
    """With the script's own handler on stderr, the log is the one copy there."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger("ampwatch").addHandler(handler)
    try:
        attachment = agent.attach(Loop().model, server="localhost:8000")
        attachment.detach()
    finally:
        logging.getLogger("ampwatch").removeHandler(handler)
    [message] = said(notices)
    assert capfd.readouterr().err == f"WARNING ampwatch.agent: {message}\n"


# ---------------------------------------------------------------------- unreachable
def test_a_dead_port_is_said_once_and_no_step_waits(spool_dir, notices, capfd) -> None:
    url = f"http://127.0.0.1:{dead_port()}"
    loop = Loop()
    attachment = agent.attach(loop.model, server=url, flush_interval=0.1)
    folder = spool_dir / attachment.run_id
    try:
        loop.until(notices, re.escape(unreachable(url, REFUSED, folder)))
        loop.run(20)
        assert not attachment.flush(0.5)
    finally:
        attachment.detach(timeout=0.5)
    said_once_each(notices, capfd, [re.escape(unreachable(url, REFUSED, folder))])
    assert max(loop.times) < STEP_BOUND_S
    spooled = [s["step"] for s in spooled_steps(spool_dir, attachment.run_id)]
    assert spooled == list(range(loop.steps))


def test_https_against_an_http_server_is_said_once(server, spool_dir, notices,
                                                   capfd) -> None:
    url = server.url.replace("http://", "https://")
    loop = Loop()
    attachment = agent.attach(loop.model, server=url, flush_interval=0.1)
    folder = spool_dir / attachment.run_id
    cause = "the TLS handshake failed: is it a plain http:// server?"
    try:
        loop.until(notices, re.escape(unreachable(url, cause, folder)))
        loop.run(10)
    finally:
        attachment.detach(timeout=0.5)
    said_once_each(notices, capfd, [re.escape(unreachable(url, cause, folder))])
    assert max(loop.times) < STEP_BOUND_S


def test_a_hung_server_is_said_after_its_timeout_and_the_recovery_once(
        server, spool_dir, notices, capfd) -> None:
    """SIGSTOP: the kernel accepts, nobody answers; each request waits its 10 s timeout
    on the sender thread while the loop goes on at its own pace."""
    assert server.process is not None
    loop = Loop()
    attachment = agent.attach(loop.model, server=server.url, flush_interval=0.1)
    folder = spool_dir / attachment.run_id
    cause = "no answer within 10 s"
    try:
        loop.run(10)
        assert attachment.flush(15)
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            hung = len(loop.times)
            loop.until(notices, re.escape(unreachable(server.url, cause, folder)))
            hung_times = loop.times[hung:]
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        loop.until(notices, recovered(server.url, cause))
        assert attachment.flush(30)
    finally:
        attachment.detach()
    said_once_each(notices, capfd, [re.escape(unreachable(server.url, cause, folder)),
                                    recovered(server.url, cause)])
    assert len(hung_times) > 50 and max(hung_times) < STEP_BOUND_S
    assert stored_steps(server.url, attachment.run_id) == list(range(loop.steps))


# ---------------------------------------------------------------------- started late
def test_a_server_started_late_gets_every_step_and_the_outage_line(
        tmp_path, spool_dir, notices, capfd) -> None:
    late = LiveServer(f"sqlite:///{tmp_path / 'late.db'}", tmp_path / "late.log")
    loop = Loop()
    attachment = agent.attach(loop.model, server=late.url, flush_interval=0.1,
                              max_batch_steps=10)
    folder = spool_dir / attachment.run_id
    try:
        loop.until(notices, re.escape(unreachable(late.url, REFUSED, folder)))
        loop.run(20)
        down_steps = loop.steps
        late.start()
        # the sender retries with a doubling wait: by now it may wait its longest
        loop.until(notices, recovered(late.url, REFUSED), timeout=Delivery.BACKOFF_MAX_S + 30)
        assert attachment.flush(30)
        run_id = attachment.run_id
        assert stored_steps(late.url, run_id) == list(range(loop.steps))
        assert down_steps >= 25

        sent = int(re.fullmatch(recovered(late.url, REFUSED), said(notices)[1]).group(1))
        assert sent >= 3  # the down steps' batches (10 steps at most each) waited
        said_once_each(notices, capfd, [re.escape(unreachable(late.url, REFUSED, folder)),
                                        recovered(late.url, REFUSED)])
        line = (r"Delivery was interrupted from \d{4}-\d\d-\d\d \d\d:\d\d:\d\d to "
                r"\d\d:\d\d:\d\d UTC \(\d+ s\): " + re.escape(REFUSED)
                + f"; {sent} batches waited in the agent's spool and arrived.")
        api = httpx.get(f"{late.url}/api/v1/runs/{run_id}", timeout=30).json()
        assert len(api["delivery_outages"]) == 1
        assert re.fullmatch(line, api["delivery_outages"][0])
        twin = httpx.get(f"{late.url}/runs/{run_id}", params={"format": "json"},
                         timeout=30).json()
        assert twin["run"]["delivery_outages"] == api["delivery_outages"]
        page = httpx.get(f"{late.url}/runs/{run_id}", timeout=30).text
        assert escape(api["delivery_outages"][0]) in page  # as the template escapes it
        show = subprocess.run([sys.executable, "-m", "ampwatch.client.cli", "show", run_id,
                               "--server", late.url], capture_output=True, text=True,
                              cwd=REPO, timeout=120)
        assert show.returncode == 0, show.stderr
        assert api["delivery_outages"][0] in show.stdout.splitlines()
    finally:
        attachment.detach()
        late.stop()


# ---------------------------------------------------------------------- token
@pytest.mark.parametrize(("token", "cause"), [(None, "HTTP 401: no token was sent"),
                                              ("wrong", "HTTP 401: the token was refused")])
def test_a_refused_token_is_said_once_and_the_run_is_kept(
        token_server, token, cause, spool_dir, notices, capfd, monkeypatch) -> None:
    monkeypatch.delenv("AMPWATCH_TOKEN", raising=False)
    url = token_server.url
    loop = Loop()
    attachment = agent.attach(loop.model, server=url, token=token, flush_interval=0.1)
    folder = spool_dir / attachment.run_id
    expected = (f"ampwatch: the server {url} refused the run ({cause}): set AMPWATCH_TOKEN "
                f"(or attach(token=...)) to the server's token. Training goes on; the run is "
                f"spooled in {folder}; send it later with `ampwatch sync {folder} --server "
                f"{url} --token TOKEN`")
    try:
        loop.until(notices, re.escape(expected))
        loop.run(20)
        assert not attachment.flush(1)
    finally:
        attachment.detach(timeout=1)
    said_once_each(notices, capfd, [re.escape(expected)])
    assert max(loop.times) < STEP_BOUND_S
    spooled = [s["step"] for s in spooled_steps(spool_dir, attachment.run_id)]
    assert spooled == list(range(loop.steps))
