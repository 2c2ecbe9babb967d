"""docker-compose.yml is valid (no Docker engine here: `docker-compose config -q`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="docker-compose is not installed (Debian package docker-compose)")
def test_compose_file_is_valid():
    done = subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config",
                           "-q"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_server_image_installs_no_torch():
    # agent/ is copied (it is part of the one `ampwatch` package and imports torch lazily),
    # but only the server extra is installed.
    installs = [line for line in (ROOT / "Dockerfile").read_text().splitlines()
                if "pip install" in line]
    assert installs == ['RUN pip install --no-cache-dir ".[server]"']
