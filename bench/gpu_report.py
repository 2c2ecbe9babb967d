"""bench/gpu_check.py's time budget, its report (rows printed as they come and both files,
gpu_check.json and gpu_check.md, rewritten after every row, so a run cut short, even
killed, still says what it measured) and how it installs what it lacks."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATUSES = ("pass", "fail", "skip", "info")


def pip_install(out: Path) -> list[str]:
    """The pip command the check installs with: torch pinned to the installed version, and
    `AMPWATCH_WHEELS` (a folder of wheels carried to a machine without the registry, e.g.
    made here with `pip download`) searched too."""
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--constraint",
               str(out / "constraints.txt")]
    if os.environ.get("AMPWATCH_WHEELS"):
        command += ["--find-links", os.environ["AMPWATCH_WHEELS"]]
    return command


class Budget:
    """Wall-clock seconds left of the run's budget, counted from the process start."""

    def __init__(self, total_s: float, start: float | None = None) -> None:
        self.total_s = total_s
        self.start = time.monotonic() if start is None else start

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.total_s - self.elapsed()

    def enough(self, seconds: float) -> bool:
        return self.left() >= seconds


@dataclass
class Row:
    group: str
    check: str
    status: str
    figure: str
    target: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    at_s: float = 0.0


class Report:
    """The run's rows and facts (device, versions, budget)."""

    def __init__(self, out: Path, budget: Budget, meta: dict[str, Any]) -> None:
        self.out = out
        self.budget = budget
        self.meta = meta
        self.rows: list[Row] = []
        out.mkdir(parents=True, exist_ok=True)
        print(f"{'group':10} {'check':46} {'status':6} figure", flush=True)
        self._write()

    def add(self, group: str, check: str, status: str, figure: str, target: str = "",
            **detail: Any) -> Row:
        assert status in STATUSES, status
        row = Row(group, check, status, figure, target, detail, round(self.budget.elapsed(), 1))
        self.rows.append(row)
        print(f"{group:10} {check:46} {status:6} {figure}"
              + (f"  (target {target})" if target else ""), flush=True)
        self._write()
        return row

    def note(self, key: str, value: Any) -> None:
        self.meta[key] = value
        self._write()

    @property
    def failed(self) -> bool:
        return any(row.status == "fail" for row in self.rows)

    def _write(self) -> None:
        self.meta["elapsed_s"] = round(self.budget.elapsed(), 1)
        body = {"meta": self.meta, "rows": [asdict(row) for row in self.rows]}
        _replace(self.out / "gpu_check.json", json.dumps(body, indent=1, default=str))
        _replace(self.out / "gpu_check.md", self.markdown())

    def markdown(self) -> str:
        meta = self.meta
        lines = [f"# gpu_check: {meta.get('device', '?')}", "",
                 f"{meta.get('mode', '')}; torch {meta.get('torch', '?')}; "
                 f"{meta.get('elapsed_s')} s of a {self.budget.total_s:.0f} s budget; "
                 f"started {meta.get('started', '?')}", ""]
        for key in ("installs", "flagged_checks", "interrupted"):
            if meta.get(key):
                lines += [f"{key}: {meta[key]}", ""]
        lines += ["| group | check | status | figure | target |", "|---|---|---|---|---|"]
        for row in self.rows:
            cells = (row.group, row.check, row.status, row.figure, row.target)
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        counts = {s: sum(r.status == s for r in self.rows) for s in STATUSES}
        lines += ["", ", ".join(f"{n} {s}" for s, n in counts.items() if n), ""]
        return "\n".join(lines)


def _replace(path: Path, text: str) -> None:
    """Write whole or not at all: a kill mid-write leaves the previous version."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass
class Context:
    """What every check group is given: where to train and send, how big, how long."""

    device: Any  # torch.device
    smoke: bool
    report: Report
    budget: Budget
    server: str
    batch: int  # GPT-2 batch rows for the device
    runs: dict[str, str] = field(default_factory=dict)  # check -> run id, for the pages

    @property
    def compile_backend(self) -> str:
        # the smoke run exercises the agent's compiled-model path (dynamo's wrapper, the
        # hooks around the compiled call) without inductor's C++ code generation on a CPU
        return "eager" if self.smoke else "inductor"

    def steps(self, gpu: int, smoke: int) -> int:
        return smoke if self.smoke else gpu

    def fits(self, gpu_s: float, smoke_s: float) -> bool:
        """Whether a check of about this many seconds fits, keeping the pages' reserve."""
        reserve = 10.0 if self.smoke else 30.0
        return self.budget.enough((smoke_s if self.smoke else gpu_s) + reserve)
