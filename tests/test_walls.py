"""The walls between the rooms (docs/architecture.md, "The walls"): each package imports
whole in a fresh process where what it must not use cannot be imported at all."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

IMPORT_ALL = textwrap.dedent("""
    import importlib, pkgutil, sys

    BLOCKED = {blocked!r}

    class Wall:
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                raise ImportError(f"{{name}} is behind a wall of {package!r}")
            return None

    sys.meta_path.insert(0, Wall())
    package = importlib.import_module("ampwatch.{package}")
    names = [info.name for info in pkgutil.walk_packages(package.__path__,
                                                         package.__name__ + ".")]
    for name in names:
        importlib.import_module(name)
    print(len(names) + 1, "modules")
""")

# package -> what it must never import (directly or through anything it imports)
WALLS = {
    "wire": ("torch", "ampwatch.agent", "ampwatch.server", "ampwatch.client",
             "ampwatch.demo", "ampwatch.trackers"),
    # the tracker adapters: wire and the standard library; their libraries only when used
    "trackers": ("torch", "ampwatch.agent", "ampwatch.server", "ampwatch.client",
                 "ampwatch.demo", "tensorboard", "mlflow", "wandb"),
    "server": ("torch", "ampwatch.agent", "ampwatch.client", "ampwatch.demo",
               "ampwatch.trackers"),
    "client": ("torch", "ampwatch.agent", "ampwatch.server", "ampwatch.demo"),
    "agent": ("ampwatch.server", "ampwatch.client", "ampwatch.demo"),
    # replay pulls bundles and records its verdicts through the client, never the server
    "replay": ("ampwatch.server", "ampwatch.demo"),
}


@pytest.mark.parametrize("package", list(WALLS))
def test_package_imports_behind_its_walls(package):
    code = IMPORT_ALL.format(package=package, blocked=WALLS[package])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[0]) > 3, done.stdout


def test_a_wall_stops_an_import():
    """The wall itself works: the agent cannot import with torch blocked."""
    code = IMPORT_ALL.format(package="agent", blocked=("torch",))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and "behind a wall" in done.stderr


def test_the_replay_command_registers_without_torch():
    """`ampwatch` loads ampwatch.replay.cli on every call: it must not need torch."""
    code = IMPORT_ALL.split("package = ")[0] + textwrap.dedent("""
        import argparse
        import ampwatch.replay.cli as cli
        cli.register(argparse.ArgumentParser().add_subparsers())
        print("2 modules")
    """)
    code = code.format(package="replay", blocked=("torch",))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
