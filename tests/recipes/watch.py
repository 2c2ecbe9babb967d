"""A recipe's parts as a user sets them up (SGD, `GradScaler("cpu")`, the real agent
sending to the suite's real server, the test's own truth), and the typical fp16 step."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ampwatch import agent
from tests.recipes.truth import Truth


def watch(model: nn.Module, scaler: Any, server: str, name: str, **kwargs: Any
          ) -> agent.Attachment:
    """`agent.attach` as a user writes it, with a fresh run id on `server`."""
    attachment = agent.attach(model, scaler, run=f"recipe-{name}-{uuid.uuid4().hex[:6]}",
                              server=server, flush_interval=0.2, **kwargs)
    assert attachment.enabled
    return attachment


@dataclass
class Recipe:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    truth: Truth
    run: agent.Attachment

    def fp16_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The AMP page's typical step: zero_grad, autocast forward, scaled backward,
        step, update."""
        self.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(self.model(x), y)
        self.scaler.scale(loss).backward()
        self.truth.backprop(loss)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.truth.end_step()


def recipe(model: nn.Module, server: str, name: str) -> Recipe:
    """SGD over the model, a fresh `GradScaler("cpu")`, the truth, the attached agent."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    return Recipe(model, optimizer, scaler, Truth(model, optimizer, scaler),
                  watch(model, scaler, server, name))
