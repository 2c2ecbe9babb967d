"""The demo's training runs: tiny CPU models, each showing one thing ampwatch is for.

Real `agent.attach`, real `torch.amp.GradScaler("cpu")`, synthetic data. fp16 autocast on
the CPU is emulated (about 14x slower than fp32), so every model stays tiny.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ampwatch import agent

PROJECT = "ampwatch-demo"
BATCH = 32
FEATURES = 64
CLASSES = 16
VOCAB = 1001          # not a multiple of 8, but an untied lookup is no matmul: not flagged
TOKENS = 8
OVERFLOW_GAIN = 1e5   # what the overflowing layer multiplies its output by


class ScaledLinear(nn.Linear):
    """A Linear whose output is multiplied by `gain`: the demo raises it mid-run, as if
    the layer's weights had grown, so its fp16 output exceeds 65504."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain


class BagOfTokens(nn.Module):
    """Embedding, mean over the tokens, a misaligned hidden layer, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, FEATURES)
        self.hidden = nn.Linear(FEATURES, 127)
        self.head = nn.Linear(127, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.hidden(self.embed(tokens).mean(dim=1))))


def _mlp(hidden: nn.Linear | None = None) -> nn.Module:
    return nn.Sequential(OrderedDict([
        ("fc1", nn.Linear(FEATURES, 128)),
        ("act1", nn.ReLU()),
        ("fc2", hidden or nn.Linear(128, 128)),
        ("act2", nn.ReLU()),
        ("out", nn.Linear(128, CLASSES)),
    ]))


def _features(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(BATCH, FEATURES, generator=gen)
    return x, (x[:, :CLASSES] > 0.5).sum(dim=1) % CLASSES


def _tokens(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=gen)
    return tokens, tokens[:, 0] % CLASSES


@dataclass(frozen=True)
class Scenario:
    """One demo run: its model, data, autocast dtype and what its loop does."""

    run_id: str
    title: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    dtype: torch.dtype
    clip_before_unscale: bool = False
    overflow_layer: str | None = None  # a ScaledLinear whose gain jumps a third of the way in

    @property
    def uses_scaler(self) -> bool:
        return self.dtype == torch.float16


SCENARIOS = (
    Scenario("demo-fp16-healthy", "healthy fp16", _mlp, _features, torch.float16),
    Scenario("demo-fp16-overflow", "fp16, layer fc2 overflows",
             lambda: _mlp(ScaledLinear(128, 128)), _features, torch.float16,
             overflow_layer="fc2"),
    Scenario("demo-fp16-misaligned", "fp16, misaligned layers, clip before unscale",
             BagOfTokens, _tokens, torch.float16, clip_before_unscale=True),
    Scenario("demo-bf16", "bf16, no scaler", _mlp, _features, torch.bfloat16),
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
    model = scenario.build()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if scenario.uses_scaler else None
    overflow_from = steps // 3 if scenario.overflow_layer else None
    attachment = agent.attach(
        model, scaler, optimizer=optimizer, run=run_id, project=PROJECT,
        name=run_id, tags=["demo", str(scenario.dtype).removeprefix("torch.")],
        config={"scenario": scenario.title, "steps": steps}, server=server,
        spool_dir=spool_dir, offline=False)
    stepped = 0

    def count_step(*_: object) -> None:
        nonlocal stepped  # the optimizer's own step runs only when GradScaler did not skip
        stepped += 1

    hook = optimizer.register_step_post_hook(count_step)
    try:
        for step in range(steps):
            if step == overflow_from:
                model.get_submodule(scenario.overflow_layer).gain = OVERFLOW_GAIN
            x, y = scenario.batch(gen)
            with torch.autocast("cpu", dtype=scenario.dtype):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y)
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
