"""Elements the agent reads on a healthy, unsampled step, counted with torch.profiler over
all threads, against the plain step's (the nanoGPT-style model of agent_overhead.py,
4 blocks, bf16 autocast, GradScaler, clip_grad_norm_).

An op's elements read are the elements of its tensor inputs (a foreach op, whose tensor
lists the profiler records without shapes, by the ops it runs); only outermost ATen ops count
(an op called inside another is part of it) and views and allocations read nothing.
Prints the plain step's count and, for each path (the host's, the accelerator's forced on
the CPU), scaler, `check_outputs` and `hold_mb`, the watched step's and the extra as a
share of the plain one. On the accelerator path without a scaler the flagged kernel runs
in Triton's interpreter, whose reads are not ATen ops: on a healthy step it reads the
flag, one value per program, and nothing else (tests/agent/test_flagged_checks.py).

    .venv/bin/python bench/elements_read.py
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # the flagged kernel on the CPU: before triton
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from ampwatch.agent.collectors.flagged_checks import INTERPRETED  # noqa: E402
from bench.agent_overhead import Trainer  # noqa: E402

# views, allocations and metadata ops: no element is read
NO_READ = frozenset("aten::" + name for name in (
    "detach", "view", "_unsafe_view", "as_strided", "reshape", "t", "transpose", "permute",
    "expand", "split", "split_with_sizes", "slice", "select", "unsqueeze", "squeeze", "alias",
    "empty", "empty_like", "empty_strided", "resolve_conj", "resolve_neg", "lift_fresh",
    "zeros", "ones", "full", "arange", "set_", "narrow", "unbind", "chunk", "_reshape_alias",
    "view_as", "contiguous"))


def interpreted(event: Any) -> bool:
    """Whether `event` ran inside an interpreted launch of the flagged kernel."""
    while event is not None:
        if event.name == INTERPRETED:
            return True
        event = event.cpu_parent
    return False


def elements_read(step: Callable[[], object]) -> int:
    """Elements read by the ATen ops of every thread while `step()` runs."""
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 experimental_config=config) as prof:
        step()
    total = 0
    for event in prof.events():
        if not event.name.startswith("aten::") or event.name in NO_READ:
            continue
        parent = event.cpu_parent
        if parent is not None and parent.name.startswith("aten::"):
            continue  # part of the outer op
        total += _read(event)
    return total


def _read(event: Any) -> int:
    """An op's elements read: its tensor inputs'; an op whose inputs the profiler records
    without shapes (a foreach op's tensor lists: the optimizer's update, grad norms) is
    counted by the ops it runs."""
    if event.name in NO_READ or interpreted(event):
        return 0  # interpreted: the Triton interpreter's copies, not the kernel's reads
    own = sum(math.prod(shape) for shape in event.input_shapes or []
              if shape and all(isinstance(d, int) for d in shape))
    if own or not event.cpu_children:
        return own
    return sum(_read(child) for child in event.cpu_children if child.name.startswith("aten::"))


def measure(check_outputs: str, scaled: bool = True, hold_mb: float | None = None,
            warmup: int = 2, clip: str = "clip_grad_norm_") -> tuple[int, int]:
    """(plain step's elements, watched unsampled step's), the same model and shapes;
    offline, the spool in a temporary folder. `scaled`: under a GradScaler (else a
    disabled one: bf16 without a scaler); `clip`: how the loop clips (Trainer.CLIPS)."""
    from ampwatch import agent

    trainer = Trainer(scaled=scaled, clip=clip)
    for _ in range(warmup):
        trainer.step()
    plain = elements_read(trainer.step)
    attachment = agent.attach(trainer.model, trainer.scaler, sample_every=100,
                              sample_after_anomaly=0, check_outputs=check_outputs,
                              hold_mb=hold_mb, offline=True,
                              spool_dir=tempfile.mkdtemp(prefix="ampwatch-"))
    try:
        # step 0 is sampled, step 1 tells the agent which outputs only it would keep alive:
        # the measured step is the third
        for _ in range(warmup):
            trainer.step()
        watched = elements_read(trainer.step)
    finally:
        attachment.detach(timeout=10)
    return plain, watched


# (path, under a GradScaler, check_outputs, hold_mb, how the loop clips)
CLIP = "clip_grad_norm_"
ROWS = [("host", True, "every_step", None, CLIP), ("host", True, "flagged", None, CLIP),
        ("host", True, "flagged", None, "total_norm_pair"), ("host", True, "flagged", None, "none"),
        ("device", True, "every_step", None, CLIP), ("device", True, "flagged", None, CLIP),
        ("device", False, "every_step", None, CLIP), ("device", False, "flagged", None, CLIP),
        ("device", False, "flagged", 0, CLIP)]


def main() -> None:
    print("| path | GradScaler | check_outputs | hold_mb | clip | plain step | watched step "
          "| extra |")
    print("|---|---|---|---|---|---:|---:|---:|")
    for path, scaled, mode, hold_mb, clip in ROWS:
        os.environ["AMPWATCH_DEVICE_PATH"] = "1" if path == "device" else "0"
        plain, watched = measure(mode, scaled, hold_mb, clip=clip)
        print(f"| {path} | {'yes' if scaled else 'no'} | {mode} | "
              f"{'default' if hold_mb is None else hold_mb} | {clip} | {plain:,} | "
              f"{watched:,} | {(watched - plain) / plain:.4%} |")


if __name__ == "__main__":
    main()
