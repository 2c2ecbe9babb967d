"""Elements the agent reads on a healthy, unsampled step, counted with torch.profiler over
all threads, against the plain step's (the nanoGPT-style model of agent_overhead.py,
4 blocks, bf16 autocast, GradScaler, clip_grad_norm_).

An op's elements read are the elements of its tensor inputs; only outermost ATen ops count
(an op called inside another is part of it) and views and allocations read nothing.
Prints the plain step's count and, for each `check_outputs` mode, the watched step's and
the extra as a share of the plain one.

    .venv/bin/python bench/elements_read.py
"""

from __future__ import annotations

import math
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.agent_overhead import Trainer  # noqa: E402

# views, allocations and metadata ops: no element is read
NO_READ = frozenset("aten::" + name for name in (
    "detach", "view", "_unsafe_view", "as_strided", "reshape", "t", "transpose", "permute",
    "expand", "split", "split_with_sizes", "slice", "select", "unsqueeze", "squeeze", "alias",
    "empty", "empty_like", "empty_strided", "resolve_conj", "resolve_neg", "lift_fresh",
    "zeros", "ones", "full", "arange", "set_", "narrow", "unbind", "chunk", "_reshape_alias",
    "view_as", "contiguous"))


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
        total += sum(math.prod(shape) for shape in event.input_shapes or []
                     if shape and all(isinstance(d, int) for d in shape))
    return total


def measure(check_outputs: str, warmup: int = 2) -> tuple[int, int]:
    """(plain step's elements, watched unsampled step's), the same model and shapes;
    offline, the spool in a temporary folder."""
    from ampwatch import agent

    trainer = Trainer()
    for _ in range(warmup):
        trainer.step()
    plain = elements_read(trainer.step)
    attachment = agent.attach(trainer.model, trainer.scaler, sample_every=100,
                              sample_after_anomaly=0, check_outputs=check_outputs,
                              offline=True, spool_dir=tempfile.mkdtemp(prefix="ampwatch-"))
    try:
        for _ in range(warmup):  # step 0 is sampled: the measured step is not
            trainer.step()
        watched = elements_read(trainer.step)
    finally:
        attachment.detach(timeout=10)
    return plain, watched


def main() -> None:
    print("| check_outputs | plain step | watched step | extra |")
    print("|---|---:|---:|---:|")
    for mode in ("every_step", "flagged"):
        plain, watched = measure(mode)
        print(f"| {mode} | {plain:,} | {watched:,} | {(watched - plain) / plain:.4%} |")


if __name__ == "__main__":
    main()
