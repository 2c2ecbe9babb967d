"""What the agent costs an FP8 training step: torchao Float8Linear (emulate=True on the CPU)
in the GPT-style model of bench/agent_overhead.py, same-process A/B against no agent.

Every Linear whose dimensions are multiples of 16 is converted with
`convert_to_float8_training` (tensorwise dynamic scaling, torchao's default recipe; the
LM head too). The agent runs with its defaults: FP8 cast statistics and activations on
every 10th step and every step of an anomaly window.

    python bench/fp8_overhead.py --steps 60 --warmup 6
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from agent_overhead import (  # noqa: E402
    Trainer,
    alternate,
    local_server,
    print_table,
    summarize,
)


def fp8_trainer(recipe: str) -> Trainer:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    trainer = Trainer()
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(
        trainer.model, config=config,
        module_filter_fn=lambda module, name: (module.in_features % 16 == 0
                                               and module.out_features % 16 == 0))
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    parser.add_argument("--server", default=None)
    args = parser.parse_args()
    from ampwatch import agent

    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, 1 torch thread, "
          f"load average {os.getloadavg()[0]:.1f}; FP8 recipe {args.recipe} (emulate=True)")
    with local_server(args.server) as server:
        plain, watched = fp8_trainer(args.recipe), fp8_trainer(args.recipe)
        attachment = agent.attach(watched.model, watched.scaler, server=server,
                                  name="bench-fp8-ab")
        for _ in range(args.warmup):
            plain.step()
            watched.step()
        a, b = alternate(watched, plain, args.steps)
        attachment.detach()
        print_table(summarize({"no agent": b, "agent defaults (FP8)": a}, "no agent"),
                    f"same-process A/B, {args.steps} alternating pairs")
        paired = statistics.median(x / y for x, y in zip(a, b, strict=True))
        print(f"median of per-pair ratios: {paired:.3f}")


if __name__ == "__main__":
    main()
