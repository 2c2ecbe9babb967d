"""Regenerate docs/img/trackers-*.png and the W&B reader output in docs/trackers.md: one
real CPU run (TinyGPT in fp16 with a GradScaler, a layer's output poisoned for six steps)
against a fresh server, mirrored into TensorBoard, MLflow (SQLite) and W&B (offline),
then TensorBoard's and MLflow's own UIs on 127.0.0.1, shot with headless Chromium.

    python docs/trackers_screenshots.py [--mlflow PATH]   # about a minute

`--mlflow`: the `mlflow` command of an environment with the full `mlflow` package (the
`trackers` extra installs `mlflow-skinny`, which has no UI); without it no MLflow picture.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.agent import wandb_reader  # noqa: E402
from tests.conftest import LiveServer, free_port  # noqa: E402
from tests.server.pages.conftest import CHROMIUM, CHROMIUM_ARGS  # noqa: E402

IMG = ROOT / "docs" / "img"


def mirrored_run(folder: Path, server: LiveServer) -> tuple[str, str]:
    """Train and mirror; (the ampwatch run id, the MLflow run id)."""
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(folder),
                      AMPWATCH_SPOOL_DIR=str(folder / "spool"),
                      MLFLOW_TRACKING_URI=f"sqlite:///{folder / 'mlflow.db'}")
    os.chdir(folder)  # MLflow's SQLite store keeps artifacts in ./mlruns
    import mlflow
    import wandb
    from torch.utils.tensorboard import SummaryWriter

    from tests.agent.test_mirror import train

    mlflow.set_experiment("ampwatch-demo")
    mlflow_run = mlflow.start_run(run_name="tiny-gpt-fp16")
    wandb_run = wandb.init(project="ampwatch-demo", dir=str(folder))
    writer = SummaryWriter(str(folder / "tb" / "tiny-gpt-fp16"))
    attachment, _ = train(server.url, [writer, "mlflow", wandb_run], steps=60)
    attachment.detach(timeout=30)
    writer.close()
    wandb_run.finish()
    mlflow.end_run()
    return attachment.run_id, mlflow_run.info.run_id


def serve(command: list[str], url: str, log: Path) -> subprocess.Popen:
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return process
        except httpx.TransportError:
            time.sleep(0.5)
    process.terminate()
    raise RuntimeError(f"{command[0]} did not start: {log.read_text()[-2000:]}")


def shoot(page, url: str, name: str, wait_for: str, settle: float = 3.0) -> None:
    page.goto(url)
    page.get_by_text(wait_for).first.wait_for(timeout=60_000)
    time.sleep(settle)  # charts draw after their data arrives
    page.screenshot(path=str(IMG / f"{name}.png"))
    print("wrote", IMG / f"{name}.png")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mlflow", help="the full mlflow package's `mlflow` command")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.environ["AMPWATCH_ANALYSIS_WAIT_S"] = "30"
        server = LiveServer(f"sqlite:///{folder / 'ampwatch.db'}", folder / "server.log")
        server.start(timeout=120)
        processes = []
        try:
            _, mlflow_run = mirrored_run(folder, server)
            (wandb_file,) = folder.glob("wandb/offline-run-*/run-*.wandb")
            alerts = [{"title": a.title, "level": a.level, "text": a.text}
                      for a in wandb_reader.alerts(wandb_file)]
            summary = {k: json.loads(v) for k, v in wandb_reader.summary(wandb_file).items()
                       if k.startswith("ampwatch/")}
            print(json.dumps({"alerts": alerts, "summary": summary}, indent=2))
            tb_port = free_port()
            processes.append(serve(
                [str(Path(sys.executable).parent / "tensorboard"), "--logdir",
                 str(folder / "tb"), "--host", "127.0.0.1", "--port", str(tb_port)],
                f"http://127.0.0.1:{tb_port}", folder / "tb.log"))
            if args.mlflow:
                ml_port = free_port()
                processes.append(serve(
                    [args.mlflow, "ui", "--backend-store-uri",
                     f"sqlite:///{folder / 'mlflow.db'}", "--host", "127.0.0.1",
                     "--port", str(ml_port)], f"http://127.0.0.1:{ml_port}",
                    folder / "mlflow.log"))
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1366, "height": 1000})
                tb = f"http://127.0.0.1:{tb_port}"
                shoot(page, f"{tb}/?darkMode=false#timeseries&tagFilter=ampwatch",
                      "trackers-tensorboard-scalars", "ampwatch/loss_scale")
                shoot(page, f"{tb}/#text", "trackers-tensorboard-text", "overflows fp16")
                if args.mlflow:
                    ml = f"http://127.0.0.1:{ml_port}"
                    experiment = "1"
                    shoot(page, f"{ml}/#/experiments/{experiment}/runs/{mlflow_run}",
                          "trackers-mlflow-run", "ampwatch.open_incidents", settle=4)
                    shoot(page, f"{ml}/#/experiments/{experiment}/runs/{mlflow_run}/"
                                "model-metrics", "trackers-mlflow-metrics", "ampwatch/loss_scale",
                          settle=6)
                browser.close()
        finally:
            for process in processes:
                process.terminate()
                process.wait(timeout=15)
            server.stop()


if __name__ == "__main__":
    main()
