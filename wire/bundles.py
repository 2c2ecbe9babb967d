"""The flight recorder's bundle file (docs/replay.md), as the agent writes it, the server
indexes it and `ampwatch replay` reads it: a zip of `bundle.json` (what the server reads,
without torch) and `state.pt` (the tensors, `torch.save`)."""

from __future__ import annotations

from enum import StrEnum

BUNDLE_FORMAT = 1  # bundle.json's "format": the layout of a bundle's two files
BUNDLE_EVENT = "bundle"  # a batch event: a bundle was kept or dropped (detail says which)
META_NAME = "bundle.json"
STATE_NAME = "state.pt"
SUFFIX = ".ampbundle"
BUNDLE_FOLDER = "bundles"  # in a rank's spool directory: delivered like its batches


def bundle_name(step: int) -> str:
    """The file name of step `step`'s bundle: `step-000001234.ampbundle`."""
    return f"step-{step:09d}{SUFFIX}"


def bundle_step(name: str) -> int:
    """Inverse of `bundle_name` (ValueError for another name)."""
    return int(name.removeprefix("step-").removesuffix(SUFFIX))


class BisectVerdict(StrEnum):
    """What `ampwatch replay --bisect` found for a bundle's step, as it reports it to the
    server (PUT .../bundles/{rank}/{step}/bisect) and the incident's fix reads it."""

    FIXED = "fixed"  # upcasting the modules it names makes the step finite
    NOT_PRECISION = "not_precision"  # every module in float32 still fails: not the precision
    INPUT_NONFINITE = "input_nonfinite"  # the input holds inf/NaN: no upcast can help
    NOT_REPRODUCED = "not_reproduced"  # the step is not bad when replayed: nothing to judge
