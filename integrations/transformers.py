"""`AmpwatchCallback` for the Hugging Face `Trainer`.

    trainer = Trainer(..., callbacks=[AmpwatchCallback()])

On train begin it attaches to the trainer's model and the GradScaler of its Accelerator
(reached through the prepared optimizer), names the run after `args.run_name`, and numbers
each step with the Trainer's `state.global_step` after that step (the step the Trainer's
logs show); on train end it detaches. `mirror=True` mirrors into the trackers `report_to`
names (docs/trackers.md): the active W&B and MLflow runs the Trainer's own callbacks
started, and TensorBoard event files in `$TENSORBOARD_LOGGING_DIR` (the Trainer's own
TensorBoard run, when set) or else `<output_dir>/runs/ampwatch`. Works for fp16 (scaler),
bf16 and fp32, with gradient accumulation: each record is one optimizer step. Costs what
`attach` costs.

It never saves non-finite weights: when the Trainer is about to save a checkpoint and
`attachment.healthy` is false (a parameter or optimizer state went inf/NaN), the save is
called off and a warning names the step; the last checkpoint saved stays the good one.
Pass `guard=True` to leave bad steps out in the first place (docs/guard.md).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers import TrainerCallback

from ampwatch import agent

logger = logging.getLogger("ampwatch.integrations")

class AmpwatchCallback(TrainerCallback):
    """Attach the ampwatch agent for the length of `trainer.train()`.

    `server`, `run`, `project`, `name`, `tags`, `config` and any other keyword are passed
    to `agent.attach` (a `name` given here wins over `args.run_name`).
    """

    def __init__(self, *, server: str | None = None, run: str | None = None,
                 project: str | None = None, mirror: Any = None,
                 **attach_kwargs: Any) -> None:
        self.attach_kwargs = {"server": server, "run": run, "project": project,
                              **attach_kwargs}
        self.mirror = mirror
        self.attachment: agent.Attachment | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        if self.attachment is not None or model is None:
            return
        kwargs = dict(self.attach_kwargs)
        if kwargs.get("name") is None and getattr(args, "run_name", None):
            kwargs["name"] = str(args.run_name)
        # accelerate's prepared optimizer holds the scaler and the torch optimizer
        scaler = getattr(optimizer, "scaler", None)
        inner = getattr(optimizer, "optimizer", optimizer)
        mirror = report_to_trackers(args) if self.mirror is True else self.mirror
        self.attachment = agent.attach(model, scaler, optimizer=inner, mirror=mirror,
                                       step=state.global_step + 1, **kwargs)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.attachment is not None:
            self.attachment.step = state.global_step + 1  # the Trainer logs it after the step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # after the Trainer's own flow callback decided to save, before it saves
        if control.should_save and self.attachment is not None \
                and not self.attachment.healthy:
            control.should_save = False
            logger.warning("ampwatch: checkpoint at step %d not saved: the weights or the "
                           "optimizer state are not finite", state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.attachment is not None:
            self.attachment.detach()
            self.attachment = None


def report_to_trackers(args: Any) -> list[str]:
    """The `mirror=` entries of the trackers the Trainer reports to (`args.report_to`)."""
    report_to = args.report_to if isinstance(args.report_to, list) else [args.report_to]
    trackers = [name for name in ("wandb", "mlflow") if name in report_to]
    if "tensorboard" in report_to:
        folder = os.getenv("TENSORBOARD_LOGGING_DIR") or os.path.join(
            args.output_dir, "runs", "ampwatch")
        trackers.append(f"tensorboard:{folder}")
    return trackers
