"""ampwatch.replay: run a recorded bad step again, without the training script.

    from ampwatch import replay
    bundle = replay.load("step-000001234.ampbundle")
    outcome = replay.run_step(model, bundle, loss_fn=loss_fn)
    result = replay.bisect(model, bundle, lambda names: replay.run_step(
        model, bundle, loss_fn=loss_fn, upcast_names=names))
    print(replay.fix_code(result, bundle))

`ampwatch replay BUNDLE --model module:factory [--bisect]` does the same from the shell
(see docs/replay.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ampwatch.replay.bisection import BisectResult, bisect, fix_code
    from ampwatch.replay.bundle import Bundle, load, read_meta
    from ampwatch.replay.step import StepOutcome, run_step, upcast

# torch is imported on first use: the `ampwatch` CLI imports ampwatch.replay.cli (its
# `replay` command) on every call, and the client must not need torch
_WHERE = {"BisectResult": "bisection", "bisect": "bisection", "fix_code": "bisection",
          "Bundle": "bundle", "load": "bundle", "read_meta": "bundle",
          "StepOutcome": "step", "run_step": "step", "upcast": "step"}
__all__ = ["BisectResult", "Bundle", "StepOutcome", "bisect", "fix_code", "load",
           "read_meta", "run_step", "upcast"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"ampwatch.replay.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'ampwatch.replay' has no attribute {name!r}")
