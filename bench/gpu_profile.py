"""Where the agent's cost on a GPU step goes: GPT-2 small, a plain and a watched copy, each
profiled with torch.profiler over the same steps; every collector's event handler and the
watch's step work is labelled with `record_function`, so the table says which handler
launched which device time.

    python bench/gpu_profile.py --out DIR [--precision bf16] [--steps 10] [--batch 32]

Prints (and writes DIR/gpu_profile.md): per step, kernels launched and kernel time of each
copy; the labelled handlers by device and host time; the kernels the watched copy runs
more of. On the CPU (no CUDA) it runs a tiny model, to keep the script working.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO)]

import torch  # noqa: E402
from gpu_overhead import TimedLoop  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from ampwatch import agent  # noqa: E402

WATCH_WORK = (("", "_step_end"), ("", "close_pending"), ("grad_snapshot", "take"))


def labelled(fn: Callable, label: str) -> Callable:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return fn(*args, **kwargs)
    return run


def label_agent(watch: Any) -> None:
    """Wrap every collector handler and the loop watch's step work in a profiler range."""
    for event, handlers in watch._listeners.items():
        watch._listeners[event] = [(labelled(handler, f"aw.{site}"), site)
                                     for handler, site in handlers]
    for part, name in WATCH_WORK:
        owner = getattr(watch, part) if part else watch
        label = ".".join(filter(None, ("aw.watch", part, name)))
        setattr(owner, name, labelled(getattr(owner, name), label))


def kernels(prof: Any) -> list[Any]:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def profiled(loop: TimedLoop, steps: int, cuda: bool) -> Any:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            loop.step()
    return prof


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_profile_out")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sample-every", type=int, default=10)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    batch = args.batch if cuda else 2
    plain, watched = (TimedLoop(device, args.precision, False, batch, not cuda, "inductor")
                      for _ in range(2))
    attachment = agent.attach(watched.loop.call, watched.loop.scaler, offline=True,
                              spool_dir=str(out / "spool"), sample_every=args.sample_every,
                              name="gpu-profile")
    label_agent(attachment._watch)
    for _ in range(5):
        plain.step()
        watched.step()
    walls = {"plain": [], "watched": []}
    for _ in range(args.steps):  # unprofiled, alternating, as bench/gpu_overhead.py times
        walls["plain"].append(plain.step())
        walls["watched"].append(watched.step())
    runs = {"plain": profiled(plain, args.steps, cuda),
            "watched": profiled(watched, args.steps, cuda)}
    attachment.detach()

    lines = [f"# gpu_profile: {torch.cuda.get_device_name() if cuda else 'CPU'}, "
             f"{args.precision}, batch {batch}, {args.steps} steps, "
             f"sample_every {args.sample_every}", "",
             "| copy | median step ms (unprofiled) | kernels/step | kernel ms/step |",
             "|---|---|---|---|"]
    counts: dict[str, collections.Counter] = {}
    times: dict[str, collections.Counter] = {}
    for name, prof in runs.items():
        ks = kernels(prof)
        counts[name] = collections.Counter(k.name for k in ks)
        times[name] = collections.Counter()
        for k in ks:
            times[name][k.name] += k.device_time / 1000.0
        lines.append(f"| {name} | {statistics.median(walls[name]):.2f} | "
                     f"{len(ks) / args.steps:.0f} | "
                     f"{sum(times[name].values()) / args.steps:.2f} |")
    lines += ["", "## The agent's handlers (watched copy), per step", "",
              "| handler | calls/step | host ms/step | device ms/step |", "|---|---|---|---|"]
    ranges = [e for e in runs["watched"].key_averages() if e.key.startswith("aw.")]
    ranges.sort(key=lambda e: -(e.device_time_total + e.cpu_time_total))
    for e in ranges:
        lines.append(f"| {e.key} | {e.count / args.steps:.1f} | "
                     f"{e.cpu_time_total / 1000 / args.steps:.3f} | "
                     f"{e.device_time_total / 1000 / args.steps:.3f} |")
    lines += ["", "## Kernels the watched copy runs more of, per step", "",
              "| kernel | extra calls/step | extra ms/step |", "|---|---|---|"]
    extra = {k: times["watched"][k] - times["plain"].get(k, 0.0) for k in times["watched"]}
    for name in sorted(extra, key=lambda k: -extra[k])[:25]:
        more = counts["watched"][name] - counts["plain"].get(name, 0)
        lines.append(f"| {name[:90]} | {more / args.steps:.1f} | "
                     f"{extra[name] / args.steps:.3f} |")
    text = "\n".join(lines) + "\n"
    (out / "gpu_profile.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
