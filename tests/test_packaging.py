"""The install is one import package, `ampwatch`, built from the repo's top-level folders."""

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from ampwatch.client import Client

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


def test_users_own_agent_client_server_modules_break_nothing(tmp_path, live_server):
    """A training script beside the user's own agent.py, client.py, server.py and
    migrations/ imports ours, trains on the CPU and its run reaches a live server."""
    for name in ("agent", "client", "server"):
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py')\n")
    (tmp_path / "migrations").mkdir()
    (tmp_path / "migrations" / "__init__.py").write_text("raise ImportError('user migrations')\n")
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch
        from ampwatch import agent
        import ampwatch.client
        import ampwatch.server.app
        import ampwatch.migrations

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        with agent.attach(model, scaler, project="démo ✓", tags=["fp16", "cpu"]) as run:
            for _ in range(7):
                x, y = torch.randn(8, 16), torch.randn(8, 4)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = torch.nn.functional.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
            assert run.flush(30), "not delivered"
        print(run.run_id, agent.attach.__module__, ampwatch.client.Client.__module__)
    """))
    env = {**os.environ, "AMPWATCH_SERVER": live_server.url}
    done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr
    run_id, *modules = done.stdout.split()
    assert modules == ["ampwatch.agent.attachment", "ampwatch.client.api"]
    assert run_id.startswith("train-")  # named after the script
    with Client(live_server.url) as client:
        run = client.run(run_id)
        assert (run.project, run.tags) == ("démo ✓", ["fp16", "cpu"])
        assert [step.step for step in client.steps(run_id)] == list(range(7))
