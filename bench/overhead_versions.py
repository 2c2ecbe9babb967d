"""The agent's overhead, code version against code version.

`bench/agent_overhead.py --mode ab` run alternately on each version's agent, round after
round, so the machine's drift (on this shared 2-core machine the same code reads from
1.015x to 1.03x over an hour) falls on every version alike. Each version is a git
revision (checked out into a temporary worktree) or `work` (this working tree); the
harness is always this tree's bench/agent_overhead.py, so only the agent differs.

    python bench/overhead_versions.py dc42e64 work --rounds 8
    python bench/overhead_versions.py HEAD~3 HEAD --rounds 5 --steps 300

Prints one line per run, then per version the median and range of each ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# a row of agent_overhead's table: name, steps, median, p90, ratio, mean, ratio of means
ROW = re.compile(r"^(agent defaults|agent activations every step)\s+\d+\s+([\d.]+)\s+[\d.]+"
                 r"\s+([\d.]+)\s+[\d.]+\s+([\d.]+)$")
PAIRED = re.compile(r"^median of per-pair ratios: ([\d.]+)$")
FIGURES = ("ratio of medians", "ratio of means", "per-pair")


def package_dirs() -> dict[str, str]:
    """`ampwatch.<name>` -> the folder it installs from (pyproject's package-dir)."""
    with (REPO / "pyproject.toml").open("rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name.removeprefix("ampwatch."): folder for name, folder in mapping.items()}


@contextlib.contextmanager
def versions(revisions: list[str]) -> Iterator[dict[str, Path]]:
    """Per version, a folder to put first on PYTHONPATH: an `ampwatch` package of symlinks
    into that version's tree (a temporary git worktree; `work` is this tree)."""
    with tempfile.TemporaryDirectory(prefix="ampwatch-versions-") as tmp:
        worktrees, paths = [], {}
        try:
            for revision in revisions:
                source = REPO
                if revision != "work":
                    source = Path(tmp) / f"tree-{len(worktrees)}"
                    subprocess.run(["git", "worktree", "add", "--quiet", "--detach",
                                    str(source), revision], cwd=REPO, check=True)
                    worktrees.append(source)
                package = Path(tmp) / f"path-{len(paths)}" / "ampwatch"
                package.mkdir(parents=True)
                for name, folder in package_dirs().items():
                    (package / name).symlink_to(source / folder)
                paths[revision] = package.parent
            yield paths
        finally:
            for worktree in worktrees:
                subprocess.run(["git", "worktree", "remove", "--force", str(worktree)],
                               cwd=REPO, check=False)


def run_bench(path: Path, steps: int, warmup: int) -> dict[str, tuple[float, ...]]:
    """One run of the A/B bench on the agent under `path`: per configuration, (median
    step ms, ratio of medians, ratio of means, median of per-pair ratios)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, str(REPO / "bench" / "agent_overhead.py"),
                          "--mode", "ab", "--steps", str(steps), "--warmup", str(warmup)],
                         capture_output=True, text=True, check=True, env=env, cwd=REPO)
    rows: dict[str, tuple[float, ...]] = {}
    current = None
    for line in out.stdout.splitlines():
        if match := ROW.match(line.strip()):
            current = match[1]
            rows[current] = tuple(float(match[i]) for i in (2, 3, 4))
        elif (match := PAIRED.match(line.strip())) and current:
            rows[current] += (float(match[1]),)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("revisions", nargs="+", help="git revisions, or `work`")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300, help="A/B pairs per run")
    parser.add_argument("--warmup", type=int, default=8)
    args = parser.parse_args()
    results: dict[str, list[dict[str, tuple[float, ...]]]] = {r: [] for r in args.revisions}
    with versions(args.revisions) as paths:
        for round_index in range(args.rounds):
            for revision in args.revisions:
                rows = run_bench(paths[revision], args.steps, args.warmup)
                results[revision].append(rows)
                figures = "  ".join(f"{name}: " + " ".join(f"{v:.3f}" for v in values[1:])
                                    for name, values in rows.items())
                print(f"round {round_index + 1} {revision}: load "
                      f"{os.getloadavg()[0]:.2f}, {figures}", flush=True)
    print(f"\n{args.rounds} rounds of {args.steps} pairs; median (range) per version")
    for configuration in ("agent defaults", "agent activations every step"):
        print(f"\n{configuration}: " + ", ".join(FIGURES))
        for revision, runs in results.items():
            columns = list(zip(*(run[configuration][1:] for run in runs), strict=True))
            print(f"  {revision:12} " + "   ".join(
                f"{statistics.median(c):.3f} ({min(c):.3f}-{max(c):.3f})" for c in columns))


if __name__ == "__main__":
    main()
