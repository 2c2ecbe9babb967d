"""Attach the agent to a model trained with Hugging Face Accelerate.

`accelerator.prepare()` may wrap the model (DDP) and enters autocast inside its forward;
the GradScaler, when fp16 needs one, lives on the accelerator. Pass the unwrapped model
and that scaler: `attach(accelerator.unwrap_model(model), accelerator.scaler)`, which is
what `attach_accelerator` does.
"""

from __future__ import annotations

from typing import Any

from ampwatch import agent


def attach_accelerator(accelerator: Any, model: Any, *, mirror: Any = None,
                       **attach_kwargs: Any) -> agent.Attachment:
    """`agent.attach` on the model `accelerator.prepare()` returned, unwrapped, with the
    accelerator's GradScaler (None for bf16 and fp32). Same keyword arguments as attach;
    `mirror=True` mirrors into the accelerator's trackers (`log_with`, after
    `init_trackers`; docs/trackers.md)."""
    if mirror is True:
        mirror = [t.tracker for t in accelerator.trackers
                  if t.name in ("tensorboard", "wandb", "mlflow")]
    return agent.attach(accelerator.unwrap_model(model), getattr(accelerator, "scaler", None),
                        mirror=mirror, **attach_kwargs)
