"""Real CPU training runs for the page tests: torch models, fp16 autocast with a real
GradScaler("cpu") (or bf16 without one), watched by the real agent that sends to a
live server."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import torch
from torch import nn

from ampwatch import agent


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class Net(nn.Module):
    """An MLP of `depth` blocks. `norm`: a LayerNorm before the head, which CPU autocast
    runs in fp16 (the precision map flags it). `boom`: the last block's weights are
    scaled so that its fp16 output overflows, which no loss scale can fix."""

    def __init__(self, width: int = 64, depth: int = 4, out: int = 8, *, seed: int = 0,
                 norm: bool = True, boom: float | None = None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width) if norm else nn.Identity()
        self.head = nn.Linear(width, out)
        if boom is not None:
            with torch.no_grad():
                self.blocks[-1].fc.weight.mul_(boom)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def mlp(width: int = 64, depth: int = 6, features: int = 16, *, seed: int = 0) -> nn.Sequential:
    """A plain `nn.Sequential` MLP of `depth` Linear layers with ReLUs between them, as
    people write it: its layers are named "0", "2", ..., "10" (the Linears)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(features, width)]
    for _ in range(depth - 2):
        layers += [nn.ReLU(), nn.Linear(width, width)]
    layers += [nn.ReLU(), nn.Linear(width, features)]
    return nn.Sequential(*layers)


class GrowingGain:
    """A gain on one layer's output that grows by `rate` (2.5% by default) after every
    optimizer step, from `start`, until the output overflows the autocast dtype. A
    forward hook applies it (in the layer's output dtype, as a scale inside the layer
    would) and records, as the test's ground truth, the output's abs-max at each step
    and the first step whose output held inf/NaN. Attach it before the agent, whose own
    hook then sees the grown output."""

    def __init__(self, model: nn.Module, layer: str, rate: float = 1.025,
                 start: float = 1.0) -> None:
        self.rate, self.gain, self.step = rate, start, 0
        self.first_nonfinite: int | None = None
        self.absmax: list[float] = []
        dict(model.named_modules())[layer].register_forward_hook(self._grow)

    def _grow(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        output = output * self.gain
        self.absmax.append(float(output.detach().abs().float().max()))
        if self.first_nonfinite is None and not torch.isfinite(output).all():
            self.first_nonfinite = self.step
        return output

    def __call__(self) -> None:
        self.gain *= self.rate
        self.step += 1


class Trainer:
    """`model` trained on random regression data with the agent attached: fp16 autocast
    with a GradScaler("cpu"), or bf16 without one. `sgd`: plain SGD at `lr` instead of
    AdamW; `after_step`: called after each optimizer step (a test's own intervention)."""

    def __init__(self, server: str, run: str, name: str, model: nn.Module, *,
                 dtype: torch.dtype = torch.float16, lr: float = 1e-3, sgd: bool = False,
                 project: str = "pages", tags: list[str] | None = None,
                 after_step: Callable[[], None] | None = None,
                 check_outputs: str | None = None) -> None:
        torch.set_num_threads(1)
        self.server, self.run = server, run
        self.model, self.dtype = model, dtype
        self.scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
        self.optimizer = (torch.optim.SGD(model.parameters(), lr=lr) if sgd
                          else torch.optim.AdamW(model.parameters(), lr=lr))
        self.after_step = after_step
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        self.features = (linears[0].in_features, linears[-1].out_features)
        self.generator = torch.Generator().manual_seed(1)
        self.scales: list[float] = []  # the loss scale each step ran with: ground truth
        self.attachment = agent.attach(model, self.scaler, run=run, name=name, project=project,
                                       tags=tags or [], server=server, sample_every=5,
                                       flush_interval=0.5, check_outputs=check_outputs)

    def train(self, steps: int) -> Trainer:
        """The reference AMP loop: autocast forward, scaled backward, unscale_, clip, step,
        update."""
        model, scaler, optimizer = self.model, self.scaler, self.optimizer
        for _ in range(steps):
            x = torch.randn(32, self.features[0], generator=self.generator)
            y = torch.randn(32, self.features[1], generator=self.generator)
            with torch.autocast("cpu", dtype=self.dtype):
                loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                self.scales.append(scaler.get_scale())
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), 10.0)
                scaler.step(optimizer)
                scaler.update()
            if self.after_step is not None:
                self.after_step()
        return self

    def flush(self) -> None:
        assert self.attachment.flush(timeout=30), "the agent did not deliver its steps"

    def close(self) -> None:
        assert self.attachment.detach(timeout=30), "the agent did not deliver its steps"
        run = httpx.get(f"{self.server}/api/v1/runs/{self.run}", timeout=10).json()
        assert (run["lost_batches"], run["dropped_steps"]) == (0, 0), run["ranks"]
