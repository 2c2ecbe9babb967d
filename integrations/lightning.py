"""`AmpwatchCallback` for Lightning (`lightning.pytorch`).

    trainer = L.Trainer(precision="bf16-mixed", callbacks=[AmpwatchCallback()])

On train start it attaches to the LightningModule, the precision plugin's GradScaler
(`"16-mixed"`; none for `"bf16-mixed"` and fp32) and the trainer's optimizer, and numbers
each step with `trainer.global_step` as the step begins (the step Lightning logs the
batch's metrics at); on train end it detaches. With `accumulate_grad_batches` each record
is one optimizer step; Lightning unscales before `gradient_clip_val` clips, so no false
`clip_before_unscale`. Without a scaler Lightning runs the last micro-batch inside
`optimizer.step(closure)`: the agent reads the grads after the closure. `mirror=True`
mirrors into the trainer's own loggers (TensorBoardLogger, WandbLogger, MLFlowLogger;
docs/trackers.md). Costs what `attach` costs.

It never saves non-finite weights: a checkpoint asked for while `attachment.healthy` is
false (a parameter or optimizer state went inf/NaN) raises `NonFiniteWeights` before
anything is written (Lightning has no way for a callback to call off one save), which
ends `fit()`; the checkpoints already saved stay the good ones. Pass `guard=True` to leave
bad steps out in the first place (docs/guard.md).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from ampwatch import agent


class NonFiniteWeights(RuntimeError):
    """A checkpoint was about to be saved with inf/NaN weights or optimizer state."""


class AmpwatchCallback(Callback):
    """Attach the ampwatch agent for the length of `trainer.fit()`.

    `server`, `run`, `project`, `name`, `tags`, `config` and any other keyword are passed
    to `agent.attach`; the run is named after the module's class unless `name` is given.
    """

    def __init__(self, *, server: str | None = None, run: str | None = None,
                 project: str | None = None, mirror: Any = None,
                 **attach_kwargs: Any) -> None:
        self.attach_kwargs = {"server": server, "run": run, "project": project,
                              **attach_kwargs}
        self.mirror = mirror
        self.attachment: agent.Attachment | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.attachment is not None:
            return
        kwargs = dict(self.attach_kwargs)
        if kwargs.get("name") is None:
            kwargs["name"] = type(pl_module).__name__
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        optimizers = trainer.optimizers
        self.attachment = agent.attach(
            pl_module, scaler, optimizer=optimizers[0] if len(optimizers) == 1 else None,
            step=trainer.global_step,
            mirror=logger_trackers(trainer) if self.mirror is True else self.mirror, **kwargs)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        if self.attachment is not None:
            self.attachment.step = trainer.global_step

    def on_save_checkpoint(self, trainer: Any, pl_module: Any,
                           checkpoint: dict[str, Any]) -> None:
        if self.attachment is not None and not self.attachment.healthy:
            raise NonFiniteWeights(
                f"ampwatch: not saving a checkpoint at step {trainer.global_step}: the "
                "weights or the optimizer state are not finite (inf/NaN reached them); the "
                "checkpoints saved before are intact. attach's guard=True leaves such "
                "steps out.")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.attachment is not None:
            self.attachment.detach()
            self.attachment = None


def logger_trackers(trainer: Any) -> list[Any]:
    """The `mirror=` entries of the trainer's loggers: a TensorBoardLogger's SummaryWriter,
    a WandbLogger's run, an MLFlowLogger's run (by id, in its tracking URI)."""
    from ampwatch.agent.mirror import MlflowTracker

    trackers: list[Any] = []
    for logger in trainer.loggers:
        if hasattr(logger, "run_id") and hasattr(logger, "_tracking_uri"):  # MLFlowLogger
            trackers.append(MlflowTracker(logger.run_id, logger._tracking_uri))
        elif type(logger).__name__ in ("TensorBoardLogger", "WandbLogger"):
            trackers.append(logger.experiment)
    return trackers
