"""docker-compose.yml is valid (no Docker engine here: `docker-compose config -q`), and
refuses to start the server, which listens on every interface, without a token."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


NO_COMPOSE = pytest.mark.skipif(
    shutil.which("docker-compose") is None,
    reason="docker-compose is not installed (Debian package docker-compose)")


def compose_config(token: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "AMPWATCH_TOKEN"}
    if token is not None:
        env["AMPWATCH_TOKEN"] = token
    return subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config",
                           "-q"], capture_output=True, text=True, timeout=60, env=env)


@NO_COMPOSE
def test_compose_file_is_valid():
    done = compose_config("a-long-random-token")
    assert done.returncode == 0, done.stderr


@NO_COMPOSE
@pytest.mark.parametrize("token", [None, ""], ids=["unset", "empty"])
def test_compose_refuses_to_start_without_a_token(token):
    done = compose_config(token)
    assert done.returncode != 0 and "set AMPWATCH_TOKEN" in done.stderr


def test_server_image_installs_no_torch():
    # agent/ is copied (it is part of the one `ampwatch` package and imports torch lazily),
    # but only the server extra is installed.
    installs = [line for line in (ROOT / "Dockerfile").read_text().splitlines()
                if "pip install" in line]
    assert installs == ['RUN pip install --no-cache-dir ".[server]"']
