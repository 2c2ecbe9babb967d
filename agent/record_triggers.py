"""When a step is bad enough to keep: the recorder's settings and its triggers.

`Triggers.judge` runs on the worker thread, once per decoded step record, in step order;
it keeps the state the triggers need (healthy streak, recent losses, the open incident,
bundles started) and answers which trigger, if any, asks for a bundle of that step.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ampwatch.wire.bundles import model_factory

DEFAULT_MAX_BYTES = 2 << 30  # 2 GiB of bundles per (run, rank)


@dataclass(frozen=True)
class RecordSettings:
    """`attach(record=...)`: True (the default) / "spool", "local", False / "off", or one
    of these (`RecordSettings(loss_spike=None, max_bytes=...)`).

    mode: "spool" delivers bundles to the server like batches; "local" keeps them in
    `folder`. Triggers: `forward_nonfinite` (a layer's output or the loss held inf/NaN),
    `nonfinite_grads` (inf/NaN grads reached the weights: not a step a scaler skipped),
    `skip_after_streak` (a skipped step after that many healthy steps, not right after
    the scaler grew; None: off), `scale_collapse` (a skipped step whose scale is at or
    below this: fp16 can no longer hold the gradients; None: off), `skip_streak` (that many
    skipped steps in a row, whatever came before: no scaler calibrates that long; None:
    off), `loss_spike` (a loss over that many times the median of
    the last `loss_window` healthy losses; None: off). An incident ends after
    `quiet_steps` healthy steps; at most one bundle per incident, `max_bundles` per run.
    `model_factory`: the MODULE:FACTORY (`train:build_model`) that builds the model for
    `ampwatch replay --model`, written into each bundle so the run page and
    `ampwatch bundles pull` print a command that runs as shown.
    """

    mode: str = "spool"
    max_bytes: int = DEFAULT_MAX_BYTES
    max_bundles: int = 5
    folder: Path | None = None
    forward_nonfinite: bool = True
    nonfinite_grads: bool = True
    skip_after_streak: int | None = 100
    scale_collapse: float | None = 1.0
    skip_streak: int | None = 20
    loss_spike: float | None = 10.0
    loss_window: int = 50
    quiet_steps: int = 50
    model_factory: str | None = None

    @classmethod
    def parse(cls, record: Any) -> RecordSettings | None:
        """None when recording is off. `AMPWATCH_RECORD` (on, off, local) and
        `AMPWATCH_RECORD_MAX_BYTES` apply when `record` is left at its default (True)."""
        env = os.environ
        if record is True and env.get("AMPWATCH_RECORD"):
            record = env["AMPWATCH_RECORD"].lower()
        if record in (False, None, "off", "0", "false"):
            return None
        if isinstance(record, RecordSettings):
            settings = record
        elif record in (True, "on", "1", "true", "spool"):
            settings = cls()
        elif record == "local":
            settings = cls(mode="local")
        elif isinstance(record, dict):
            known = {f.name for f in fields(cls)}
            unknown = set(record) - known
            if unknown:
                raise ValueError(f"unknown record settings {sorted(unknown)}")
            settings = cls(**record)
        else:
            raise ValueError(f"record must be True, False, 'local' or RecordSettings, "
                             f"got {record!r}")
        if env.get("AMPWATCH_RECORD_MAX_BYTES") and settings.max_bytes == DEFAULT_MAX_BYTES:
            settings = replace(settings, max_bytes=int(env["AMPWATCH_RECORD_MAX_BYTES"]))
        if settings.mode not in ("spool", "local"):
            raise ValueError(f"record mode must be 'spool' or 'local', got {settings.mode!r}")
        if settings.model_factory is not None and model_factory(settings.model_factory) is None:
            raise ValueError("record model_factory must be MODULE:FACTORY (a dotted module "
                             "or a path to a .py file, ':', a function name), got "
                             f"{settings.model_factory!r}")
        if isinstance(settings.folder, str):
            settings = replace(settings, folder=Path(settings.folder))
        return settings


def _bad(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


class Triggers:
    """The trigger state of one (run, rank) (worker thread)."""

    MIN_LOSSES = 10  # recent losses needed before a spike can be judged

    def __init__(self, settings: RecordSettings) -> None:
        self.settings = settings
        self.streak = 0  # healthy steps in a row
        self.skips = 0  # skipped steps in a row
        self.losses: deque[float] = deque(maxlen=max(1, settings.loss_window))
        self.incident = False
        self.quiet = 0
        self.started = 0  # bundles asked for
        self._last_scale: float | None = None

    def spike(self, loss: Any, losses: deque[float]) -> bool:
        """Whether `loss` is a spike over `losses` (shared with the host-side check)."""
        factor = self.settings.loss_spike
        if factor is None or not isinstance(loss, float) or not math.isfinite(loss):
            return False
        if len(losses) < min(self.MIN_LOSSES, losses.maxlen or 1):
            return False
        return abs(loss) > factor * abs(statistics.median(losses))

    def judge(self, record: dict[str, Any], kept: bool = True) -> str | None:
        """The trigger that asks for a bundle of this step; None for a healthy step, for
        one of an incident already recorded, or once the run's cap is reached. A bad step
        whose batch was not `kept` leaves the incident open for its next bad step."""
        s = self.settings
        skipped = bool(record.get("skipped"))
        loss = record.get("loss")
        scale = record.get("loss_scale")
        grew = (isinstance(scale, float) and self._last_scale is not None
                and scale > self._last_scale)
        self._last_scale = scale if isinstance(scale, float) else self._last_scale
        self.skips = self.skips + 1 if skipped else 0
        trigger = None
        if s.forward_nonfinite and (record.get("forward_nonfinite") or _bad(loss)):
            trigger = "forward_nonfinite"
        elif s.nonfinite_grads and not skipped and _bad(record.get("grad_norm")):
            trigger = "nonfinite_grads"
        elif (s.scale_collapse is not None and skipped and isinstance(scale, float)
              and scale <= s.scale_collapse):
            trigger = "scale_collapse"
        elif s.skip_streak is not None and self.skips >= s.skip_streak:
            trigger = "skip_streak"
        elif (s.skip_after_streak is not None and skipped and not grew
              and self.streak >= s.skip_after_streak):
            trigger = "skip_after_streak"
        elif self.spike(loss, self.losses):
            trigger = "loss_spike"
        if trigger is None and not skipped:
            self.streak += 1
            if isinstance(loss, float) and math.isfinite(loss):
                self.losses.append(loss)
            self.quiet += 1
            if self.quiet >= s.quiet_steps:
                self.incident = False
            return None
        self.streak = 0
        if trigger is None:
            return None  # a skip that is not an incident (the scaler calibrating, growing)
        self.quiet = 0
        if not kept:
            return None
        if self.incident or self.started >= s.max_bundles:
            self.incident = True
            return None
        self.incident = True
        self.started += 1
        return trigger
