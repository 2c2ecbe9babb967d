"""Tiny models and data for the recipes: a few hundred parameters each, so that a
recipe trains in well under a second on one CPU thread."""

from __future__ import annotations

import torch
from torch import nn

WIDTH = 16
STEPS = 12


def mlp(seed: int, inputs: int = WIDTH, outputs: int = 8, hidden: int = 32) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(inputs, hidden), nn.GELU(), nn.Linear(hidden, outputs))


def batches(n: int = STEPS, seed: int = 1, outputs: int = 8
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, WIDTH, generator=gen), torch.randn(8, outputs, generator=gen))
            for _ in range(n)]


class TwoHeads(nn.Module):
    """A shared trunk with a regression head and a classification head (multi-task)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.trunk = nn.Sequential(nn.Linear(WIDTH, 32), nn.GELU())
        self.regress = nn.Linear(32, 8)
        self.classify = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.regress(h), self.classify(h)
