"""Every command README.md shows runs as shown (against a live server), and every
`ampwatch ... --help` works, describes its command and reads as help, not as source."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from ampwatch import agent
from ampwatch.client import Client
from ampwatch.client.cli import build_parser, main
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RUN_ID = "readme-run"
POSTGRES_PLACEHOLDER = "postgresql+psycopg://user:pw@db/ampwatch"

# README commands a test here does not run, and where they are covered instead
NOT_RUN = {
    "python3 -m venv .venv": "the install: .ci/run does it on a bare machine",
    ". .venv/bin/activate": "the install: .ci/run",
    'pip install torch==2.13.0 -c .ci/constraints.txt -e ".[agent,server]"':
        "the install: .ci/run installs [dev], a superset",
    'pip install -q torch==2.13.0 -c .ci/constraints.txt -e ".[dev]"': "the install: .ci/run",
    "python -m pytest": "this suite itself",
    "AMPWATCH_SERVER=http://ampwatch.internal:8000 python train.py":
        "tests/test_packaging.py runs a train.py with AMPWATCH_SERVER set",
}
SERVES = {"ampwatch serve", f"ampwatch serve --port 9000 --database-url {POSTGRES_PLACEHOLDER}"}


def readme_commands() -> list[str]:
    """The commands of README.md's ```sh blocks, one per `&&` part, comments dropped."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            commands += [part.strip() for part in line.split("&&") if part.strip()]
    return commands


def test_every_readme_command_is_run_here_or_said_where() -> None:
    commands = readme_commands()
    assert len(commands) >= 12
    for command in commands:
        assert command.startswith("ampwatch ") or command in NOT_RUN, command


def _train(url: str, run_id: str, **kwargs) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with agent.attach(model, run=run_id, project="gpt", server=url, **kwargs) as run:
        for _ in range(3):
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        run.flush(10)


@pytest.fixture
def readme_env(live_server, tmp_path: Path) -> dict[str, str]:
    """A home with a spool to sync, a run to show, and AMPWATCH_SERVER at a live server."""
    home = tmp_path / "home"
    _train(live_server.url, RUN_ID)
    _train(live_server.url, "spooled-run", offline=True,
           spool_dir=home / ".cache" / "ampwatch" / "spool")
    env = {**os.environ, "HOME": str(home), "AMPWATCH_SERVER": live_server.url}
    for key in ("XDG_CACHE_HOME", "XDG_DATA_HOME", "AMPWATCH_SPOOL_DIR"):
        env.pop(key, None)
    return env


def _as_test_runs_it(command: str, tmp_path: Path) -> tuple[str, int | None]:
    """The README command with its placeholders filled; the port it serves on, if any."""
    port = None
    command = command.replace(" RUN", f" {RUN_ID}")
    command = command.replace(POSTGRES_PLACEHOLDER, f"sqlite:///{tmp_path / 'team.db'}")
    if "--port 9000" in command:
        port = free_port()
        command = command.replace("--port 9000", f"--port {port}")
    elif command.startswith("ampwatch demo"):
        port = free_port()  # and the least work the demo accepts
        command += f" --port {port} --database-url sqlite:///{tmp_path / 'demo.db'} --steps 60"
    elif command == "ampwatch serve":
        port = free_port()  # through the environment: the README's command has no flag
    return command, port


def _serve_until_healthy(command: str, port: int, env: dict, cwd: Path) -> str:
    """Start a serving command, wait for the health check, stop it with SIGTERM; returns
    its output and checks it shut down cleanly."""
    env = {**env, "AMPWATCH_PORT": str(port), "XDG_DATA_HOME": str(cwd / "data")}
    process = subprocess.Popen(shlex.split(command), cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and process.poll() is None:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/api/v1/health",
                             timeout=1).status_code == 200:
                    break
            time.sleep(0.3)
        assert process.poll() is None, "it exited early"
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    # uvicorn shuts down cleanly, then re-raises the signal it caught (status -SIGTERM)
    assert process.returncode in (0, -signal.SIGTERM), out
    assert "Application shutdown complete" in out, out
    return out


def test_readme_commands_run_as_shown(readme_env, live_server, tmp_path: Path) -> None:
    for readme_command in readme_commands():
        if readme_command in NOT_RUN or readme_command.startswith("ampwatch demo"):
            continue  # the demo: test_readme_demo_command
        command, port = _as_test_runs_it(readme_command, tmp_path)
        if readme_command in SERVES:
            out = _serve_until_healthy(command, port, readme_env, tmp_path)
            assert f"serving on http://127.0.0.1:{port}" in out, out
            continue
        done = subprocess.run(shlex.split(command.replace("~", readme_env["HOME"], 1)),
                              cwd=tmp_path, env=readme_env, capture_output=True, text=True,
                              timeout=120)
        gate = readme_command.startswith("ampwatch check")
        assert done.returncode in ((0, 1) if gate else (0,)), (command, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
    pyarrow_parquet = pytest.importorskip("pyarrow.parquet")
    assert pyarrow_parquet.read_table(tmp_path / "run.parquet").num_rows == 3
    with Client(live_server.url) as client:  # sync uploaded the offline run
        assert [s.step for s in client.steps("spooled-run")] == [0, 1, 2]


def test_readme_demo_command(tmp_path: Path) -> None:
    [readme_command] = [c for c in readme_commands() if c.startswith("ampwatch demo")]
    command, port = _as_test_runs_it(readme_command, tmp_path)
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")}
    # Ctrl-C reaches the demo as in a terminal even when these tests run in a background
    # job, whose children start with SIGINT ignored (Python then never raises
    # KeyboardInterrupt)
    process = subprocess.Popen(shlex.split(command), cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if line.startswith("Serving on"):
                assert httpx.get(f"http://127.0.0.1:{port}/api/v1/health").status_code == 200
                process.send_signal(signal.SIGINT)  # Ctrl-C
                break
        out, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    text = "".join(lines) + out
    assert process.returncode == 0, text
    assert "The server is stopped; the database is" in text


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, parser) for every command and sub-command of `parser`."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def test_every_help_describes_its_command_and_every_option() -> None:
    commands = list(_commands(build_parser()))
    names = {" ".join(words) for words, _ in commands}
    assert {"runs", "show", "findings", "check", "export", "sync", "serve", "db",
            "db upgrade", "demo"} <= names
    for words, parser in commands:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
            main([*words, "--help"])
        text = out.getvalue()
        assert exited.value.code == 0, words
        assert parser.description and len(parser.description) > 20, words
        assert not re.search(r"[\w/]+\.py\b", text), (words, text)  # no source paths
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                assert action.help, (words, action.dest)
            if isinstance(action, argparse._SubParsersAction):
                assert all(choice.help for choice in action._choices_actions), words


def test_the_installed_command_answers_help() -> None:
    script = Path(sys.executable).with_name("ampwatch")
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for command in ("runs", "show", "findings", "check", "export", "sync", "serve", "db",
                    "demo"):
        assert re.search(rf"^\s+{command}\s+\S", done.stdout, flags=re.M), command


def _table_folders(text: str, heading: str) -> set[str]:
    """The `folder/` names in the first column of the table under `heading`."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(\w+)/` \|", section, flags=re.M))


def test_readme_and_the_guide_map_every_package_and_link_each_other() -> None:
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {folder for package, folder in setup["package-dir"].items()
               if package.count(".") == 1}
    assert {"agent", "server", "client", "wire", "replay", "demo"} <= folders
    readme = README.read_text()
    guide = (ROOT / "docs" / "architecture.md").read_text()
    assert _table_folders(readme, "## Pieces") == folders
    assert _table_folders(guide, "## The rooms") == folders
    assert "(docs/architecture.md)" in readme and "(../README.md)" in guide
