"""Agent settings: keyword arguments of `attach()` over environment variables over defaults,
resolved once into one `AgentSettings` that attach() passes down."""

from __future__ import annotations

import os
import re
import secrets
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ampwatch.agent import errors
from ampwatch.agent.distributed import shared_run_id
from ampwatch.agent.environment import distributed_rank
from ampwatch.agent.record_triggers import RecordSettings
from ampwatch.agent.run_identity import check_labels, resolve_run
from ampwatch.agent.step_guard import GuardSettings
from ampwatch.wire import DEFAULT_SERVER, url_problem
from ampwatch.wire.spool import default_spool_dir

DEFAULT_SPOOL_BYTES = 1 << 30
CHECK_OUTPUTS = ("flagged", "every_step")
_RUN_ID_BAD = re.compile(r"[^A-Za-z0-9._-]+")


def make_run_id(name: str | None) -> str:
    """`<name>-<utc time>-<random>`, restricted to the characters API v1 allows."""
    base = name or Path(sys.argv[0] or "run").stem or "run"
    base = _RUN_ID_BAD.sub("-", base).strip("-._")[:64] or "run"
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"{base}-{stamp}-{secrets.token_hex(3)}"


@dataclass
class AgentSettings:
    """Everything `attach()` was told, resolved once (`from_attach`): what the transport,
    the sampling, the collectors and the run's description need. docs/agent.md's API
    section says what each option does."""

    run_id: str
    run_id_generated: bool
    enabled: bool = True  # False: attach() returns a handle that does nothing
    resume: bool = False  # continue a run id that already has steps (see run_identity)
    server: str = DEFAULT_SERVER
    token: str = field(default="", repr=False)  # never printed with the settings
    offline: bool = False  # spool only: AMPWATCH_MODE=offline, or a malformed server URL
    server_problem: str | None = None  # what makes `server` unusable (None: usable)
    spool_dir: Path = field(default_factory=default_spool_dir)
    spool_max_bytes: int = DEFAULT_SPOOL_BYTES
    flush_interval_s: float = 2.0
    max_batch_steps: int = 200
    exit_timeout_s: float = 5.0
    sample_every: int = 10
    sample_after_anomaly: int = 20
    # "flagged": layer outputs are searched only on a step whose loss is inf/NaN (by
    # replaying its forward); "every_step": every output checked on every step (the old cost)
    check_outputs: str = "flagged"
    # on an accelerator without a scaler's skip: the most memory (MiB) layer outputs held
    # for their flagged check may keep alive that autograd does not (None: 1% of the
    # device's memory); beyond it an output is checked as it is produced (AMPWATCH_HOLD_MB)
    hold_mb: float | None = None
    # the accelerator path (device reductions, no host reads) on CPU tensors too, so its
    # logic runs and is tested without a GPU (AMPWATCH_DEVICE_PATH=1)
    device_path: bool = False
    rank: int = 0
    world_size: int = 1
    # the run as the server is told it (labels checked; `config` as given)
    name: str | None = None
    project: str | None = None
    tags: list[str] | None = None
    config: Any = None
    first_step: int | None = None  # attach(step=): the loop numbers its steps from this
    record: RecordSettings | None = None  # the flight recorder (None: off)
    guard: GuardSettings | None = None  # the step guard (None: off)
    mirror: Any = None  # the trackers `mirror=` names (agent/mirror resolves them)

    @classmethod
    def from_attach(cls, *, run: str | None, resume: bool | None, step: int | None,
                    name: str | None, project: str | None, tags: list[str] | None,
                    record: Any, guard: Any, check_outputs: str | None,
                    hold_mb: float | None, enabled: bool, server: str | None,
                    **options: Any) -> AgentSettings:
        """`attach()`'s keywords (`options`: the rest, as `build` names them). A caller's
        mistake raises ValueError here, before anything is written. Then the environment
        and torch.distributed fill in the rest; when that fails (the agent's own failure:
        logged and counted, never raised), or `enabled` is False, the settings are
        disabled. Host only."""
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)
                                 or step < 0):
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        run, resume = resolve_run(run, resume)
        check_labels(name, project, tags)
        described = {"project": project, "tags": tags, "first_step": step,
                     "record": RecordSettings.parse(record),  # a caller's mistake raises
                     "guard": GuardSettings.parse(guard)}
        if check_outputs not in (None, *CHECK_OUTPUTS):
            raise ValueError(f"check_outputs must be one of {CHECK_OUTPUTS}, "
                             f"got {check_outputs!r}")
        check_hold_mb(hold_mb)
        if enabled:
            try:
                rank, world_size = distributed_rank()
                generated = run is None
                if generated and world_size > 1:  # one run, one stream per rank
                    run = shared_run_id(make_run_id(name), rank, world_size)
                return cls.build(run, name, server, rank=rank, world_size=world_size,
                                 resume=resume, run_id_generated=generated or None,
                                 check_outputs=check_outputs, hold_mb=hold_mb,
                                 **described, **options)
            except Exception as exc:  # noqa: BLE001
                errors.report("attach", exc)
        return cls(run_id=run or "", run_id_generated=run is None, enabled=False)

    @classmethod
    def build(cls, run: str | None, name: str | None, server: str | None,
              **overrides: Any) -> AgentSettings:
        env = os.environ
        values: dict[str, Any] = {
            "run_id": run or make_run_id(name),
            "run_id_generated": run is None,
            "name": name,
            "server": (server or env.get("AMPWATCH_SERVER") or DEFAULT_SERVER).rstrip("/"),
            "offline": env.get("AMPWATCH_MODE", "").lower() == "offline",
            "token": env.get("AMPWATCH_TOKEN", ""),
        }
        if env.get("AMPWATCH_SPOOL_MAX_BYTES"):
            values["spool_max_bytes"] = int(env["AMPWATCH_SPOOL_MAX_BYTES"])
        if env.get("AMPWATCH_FLUSH_INTERVAL"):
            values["flush_interval_s"] = float(env["AMPWATCH_FLUSH_INTERVAL"])
        if env.get("AMPWATCH_CHECK_OUTPUTS"):
            values["check_outputs"] = env["AMPWATCH_CHECK_OUTPUTS"]
        if env.get("AMPWATCH_HOLD_MB"):
            values["hold_mb"] = float(env["AMPWATCH_HOLD_MB"])
        if env.get("AMPWATCH_DEVICE_PATH"):
            values["device_path"] = env["AMPWATCH_DEVICE_PATH"] not in ("0", "")
        if env.get("AMPWATCH_EXIT_TIMEOUT"):
            values["exit_timeout_s"] = float(env["AMPWATCH_EXIT_TIMEOUT"])
        values.update({k: v for k, v in overrides.items() if v is not None})
        if not values["offline"]:  # nothing could be sent to a malformed URL: spool only
            values["server_problem"] = url_problem(values["server"])
            values["offline"] = values["server_problem"] is not None
        if isinstance(values.get("spool_dir"), str):
            values["spool_dir"] = Path(values["spool_dir"])
        if values.get("check_outputs", "flagged") not in CHECK_OUTPUTS:
            raise ValueError(f"check_outputs must be one of {CHECK_OUTPUTS}, "
                             f"got {values['check_outputs']!r}")
        check_hold_mb(values.get("hold_mb"))
        return cls(**values)


def check_hold_mb(value: Any) -> None:
    """A caller's `hold_mb`: None or a number of MiB >= 0 (else ValueError)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                              or not value >= 0):
        raise ValueError(f"hold_mb must be a number of MiB >= 0, got {value!r}")
