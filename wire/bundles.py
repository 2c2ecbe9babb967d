"""The flight recorder's bundle file (docs/replay.md), as the agent writes it, the server
indexes it and `ampwatch replay` reads it: a zip of `bundle.json` (what the server reads,
without torch) and `state.pt` (the tensors, `torch.save`)."""

from __future__ import annotations

import re
import shlex
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


# `ampwatch replay --model`: a dotted module name or a path to a .py file, then ':' and the
# function's name. Nothing else is printed in a command: a bundle from another team names
# a factory in words people copy into their shell.
MODEL_FACTORY_PATTERN = (r"^(?:[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
                         r"|[A-Za-z0-9_./-]{1,400}\.py):[A-Za-z_][A-Za-z0-9_]*$")
MODEL_FACTORY_PLACEHOLDER = "MODULE:FACTORY"
# said under a command that holds the placeholder, so a reader knows what to put there
MODEL_FACTORY_UNKNOWN = ("MODULE:FACTORY: the function that builds your model; the run "
                         "recorded none (attach(..., record={'model_factory': ...}), "
                         "docs/replay.md)")
_MODEL_FACTORY = re.compile(MODEL_FACTORY_PATTERN)


def model_factory(value: object) -> str | None:
    """`value` when it is a MODULE:FACTORY `ampwatch replay --model` takes (`pkg.mod:build`
    or `path/to/train.py:build`), else None."""
    return value if isinstance(value, str) and _MODEL_FACTORY.fullmatch(value) else None


def replay_command(factory: str | None, *, path: str | None = None, run_id: str | None = None,
                   step: int | None = None, rank: int = 0, server: str | None = None) -> str:
    """The `ampwatch replay ... --bisect` command line for a bundle file (`path`) or a
    bundle on the server (`run_id`, `step`, `rank`), each argument quoted for a POSIX
    shell. A `factory` None, or one `model_factory` refuses, is printed as the
    MODULE:FACTORY placeholder for the reader to fill in."""
    words = ["ampwatch", "replay"]
    if path is not None:
        words.append(path)
    else:
        words += ["--run", str(run_id), "--step", str(step)] + (["--rank", str(rank)] if rank
                                                                 else [])
    spec = model_factory(factory)
    line = f"{shlex.join(words)} --model {shlex.quote(spec) if spec else MODEL_FACTORY_PLACEHOLDER}"
    return line + " --bisect" + (f" --server {shlex.quote(server)}" if server else "")
