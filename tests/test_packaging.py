"""The install is one import package, `ampwatch`, built from the repo's top-level folders."""

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_source_package_is_installed_under_ampwatch():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {top: f"ampwatch.{top}" for top in config["package-dir"].values()}
    on_disk = {
        ".".join([folders[init.parent.relative_to(ROOT).parts[0]],
                  *init.parent.relative_to(ROOT).parts[1:]])
        for top in folders for init in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert on_disk == set(config["packages"])


def test_users_own_agent_client_server_modules_break_nothing(tmp_path):
    for name in ("agent", "client", "server"):
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py')\n")
    (tmp_path / "migrations").mkdir()
    (tmp_path / "migrations" / "__init__.py").write_text("raise ImportError('user migrations')\n")
    script = textwrap.dedent("""
        from ampwatch import agent
        import ampwatch.client
        import ampwatch.server.app
        import ampwatch.migrations
        print(agent.attach.__module__, ampwatch.client.Client.__module__)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ampwatch.agent.attachment", "ampwatch.client.api"]
