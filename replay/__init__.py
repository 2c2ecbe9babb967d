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

from ampwatch.replay.bisect import BisectResult, bisect, fix_code
from ampwatch.replay.bundle import Bundle, load, read_meta
from ampwatch.replay.step import StepOutcome, run_step, upcast

__all__ = ["BisectResult", "Bundle", "StepOutcome", "bisect", "fix_code", "load",
           "read_meta", "run_step", "upcast"]
