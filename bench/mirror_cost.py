"""What mirroring into trackers costs the training thread: two attached copies of
bench/agent_overhead.py's GPT (~4M parameters, bf16 autocast, GradScaler, AdamW, one torch
thread), one with `mirror=[SummaryWriter, "mlflow"]` (MLflow on a SQLite store), one
without, alternating steps (same weights, same batches); the median of per-pair step-time
ratios, and what reached the trackers. Offline: no server, so no incident polls.

    python bench/mirror_cost.py --steps 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.agent_overhead import Trainer, alternate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(AMPWATCH_MODE="offline", AMPWATCH_SPOOL_DIR=f"{tmp}/spool",
                          MLFLOW_TRACKING_URI=f"sqlite:///{tmp}/mlflow.db")
        os.chdir(tmp)  # MLflow's SQLite store keeps artifacts in ./mlruns
        import mlflow
        from mlflow.tracking import MlflowClient
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        from torch.utils.tensorboard import SummaryWriter

        from ampwatch import agent

        run = mlflow.start_run()
        writer = SummaryWriter(f"{tmp}/tb")
        mirrored, plain = Trainer(), Trainer()
        on = agent.attach(mirrored.model, mirrored.scaler, name="bench-mirror-on",
                          mirror=[writer, "mlflow"])
        off = agent.attach(plain.model, plain.scaler, name="bench-mirror-off")
        for _ in range(args.warmup):
            mirrored.step()
            plain.step()
        a, b = alternate(mirrored, plain, args.steps)
        started = time.perf_counter()
        on.detach(timeout=60)
        closed = time.perf_counter() - started
        off.detach()
        writer.close()
        mlflow.end_run()
        events = EventAccumulator(f"{tmp}/tb")
        events.Reload()
        tb_steps = len(events.Scalars("ampwatch/grad_norm"))
        ml_steps = len(MlflowClient().get_metric_history(run.info.run_id,
                                                         "ampwatch/grad_norm"))
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    print(f"steps {args.steps}: mirrored {statistics.median(a):.2f} ms, plain "
          f"{statistics.median(b):.2f} ms, median per-pair ratio "
          f"{statistics.median(ratios):.3f}")
    print(f"mirrored steps: TensorBoard {tb_steps}, MLflow {ml_steps} of "
          f"{args.steps + args.warmup}; detach (last batch, closing) {closed:.2f} s")


if __name__ == "__main__":
    main()
