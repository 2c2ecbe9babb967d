"""The demo's training runs: tiny CPU models, each showing one thing ampwatch is for.

Real `agent.attach`, real `torch.amp.GradScaler("cpu")`, synthetic data. fp16 autocast on
the CPU is emulated (about 14x slower than fp32), so every model stays tiny.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ampwatch import agent
from ampwatch.demo import models

PROJECT = "ampwatch-demo"


@dataclass(frozen=True)
class Scenario:
    """One demo run: its model's factory (demo/models.py, recorded with the run for
    `ampwatch replay --model`), data, autocast dtype and what its loop does."""

    run_id: str
    title: str
    factory: Callable[[], tuple[nn.Module, models.LossFn]]
    batch: Callable[[torch.Generator], torch.Tensor]
    dtype: torch.dtype
    clip_before_unscale: bool = False
    overflow_layer: str | None = None  # a ScaledLinear whose gain jumps a third of the way in

    @property
    def uses_scaler(self) -> bool:
        return self.dtype == torch.float16


SCENARIOS = (
    Scenario("demo-fp16-healthy", "healthy fp16", models.mlp, models.features, torch.float16),
    Scenario("demo-fp16-overflow", "fp16, layer fc2 overflows", models.overflow_mlp,
             models.features, torch.float16, overflow_layer="fc2"),
    Scenario("demo-fp16-misaligned", "fp16, misaligned layers, clip before unscale",
             models.bag_of_tokens, models.tokens, torch.float16, clip_before_unscale=True),
    Scenario("demo-bf16", "bf16, no scaler", models.mlp, models.features, torch.bfloat16),
)


@dataclass
class Progress:
    """What the loop reports every few steps."""

    step: int
    loss: float
    loss_scale: float | None
    skipped: int


def train(scenario: Scenario, *, steps: int, server: str, spool_dir: Path,
          report: Callable[[Progress], None], report_every: int,
          run_id: str | None = None) -> bool:
    """Train `scenario` for `steps` optimizer steps with the agent attached, as run
    `run_id` (default the scenario's), calling `report` every `report_every` steps.
    Returns whether every step reached the server (detach waits up to 30 s for it)."""
    run_id = run_id or scenario.run_id
    torch.set_num_threads(1)  # the server and the agent's worker share the cores
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model, loss_fn = scenario.factory()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if scenario.uses_scaler else None
    overflow_from = steps // 3 if scenario.overflow_layer else None
    attachment = agent.attach(
        model, scaler, optimizer=optimizer, run=run_id, project=PROJECT,
        name=run_id, tags=["demo", str(scenario.dtype).removeprefix("torch.")],
        config={"scenario": scenario.title, "steps": steps}, server=server,
        spool_dir=spool_dir, offline=False,
        record={"model_factory": models.spec(scenario.factory)})
    stepped = 0

    def count_step(*_: object) -> None:
        nonlocal stepped  # the optimizer's own step runs only when GradScaler did not skip
        stepped += 1

    hook = optimizer.register_step_post_hook(count_step)
    try:
        for step in range(steps):
            if step == overflow_from:
                model.get_submodule(scenario.overflow_layer).gain.fill_(models.OVERFLOW_GAIN)
            x = scenario.batch(gen)
            with torch.autocast("cpu", dtype=scenario.dtype):
                logits = model(x)
            loss = loss_fn(logits, x)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                if not scenario.clip_before_unscale:
                    scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if (step + 1) % report_every == 0 or step + 1 == steps:
                report(Progress(step + 1, loss.item(),
                                scaler.get_scale() if scaler else None,
                                step + 1 - stepped))
    finally:
        hook.remove()
        delivered = attachment.detach(timeout=30.0)
    return delivered
