"""Attaching the real agent to a recipe's model, sending to the suite's real server."""

from __future__ import annotations

import uuid
from typing import Any

from torch import nn

from ampwatch import agent


def watch(model: nn.Module, scaler: Any, server: str, name: str, **kwargs: Any
          ) -> agent.Attachment:
    """`agent.attach` as a user writes it, with a fresh run id on `server`."""
    attachment = agent.attach(model, scaler, run=f"recipe-{name}-{uuid.uuid4().hex[:6]}",
                              server=server, flush_interval=0.2, **kwargs)
    assert attachment.enabled
    return attachment
