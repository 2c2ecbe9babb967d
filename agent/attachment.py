"""`attach()` and the `Attachment` handle it returns."""

from __future__ import annotations

import atexit
import math
import os
import threading
import time
import weakref
from typing import Any

from torch import nn

from ampwatch.agent import errors
from ampwatch.agent.collectors import default_collectors
from ampwatch.agent.collectors.fp8 import Fp8Collector
from ampwatch.agent.collectors.spikes import SpikeCollector
from ampwatch.agent.collectors.weights import WeightNormCollector
from ampwatch.agent.distributed import shared_run_id
from ampwatch.agent.environment import describe_run, distributed_rank, environment, run_body
from ampwatch.agent.fp8 import find_fp8_layers
from ampwatch.agent.layers import discover_layers
from ampwatch.agent.loop_watch import CLOSE_FAILED, LoopWatch, StepItem
from ampwatch.agent.mirror import Mirror, resolve_trackers
from ampwatch.agent.mirror.incidents import IncidentWatch
from ampwatch.agent.record_triggers import RecordSettings
from ampwatch.agent.recorder import Recorder, make_recorder
from ampwatch.agent.run_identity import check_labels, refuse_reused_run, resolve_run
from ampwatch.agent.settings import CHECK_OUTPUTS, AgentSettings, check_hold_mb, make_run_id
from ampwatch.agent.step_guard import GuardSettings, StepGuard, weights_finite
from ampwatch.agent.transport.sender import Sender
from ampwatch.agent.transport.worker import EventMessage, RunMessage, Worker
from ampwatch.wire import (
    FINISHED_EVENT,
    RESTART_EVENT,
    SPEED_CHECK_EVENT,
    encode_float,
    encode_tree,
)

_live: weakref.WeakSet[Attachment] = weakref.WeakSet()


class Attachment:
    """Handle of one attached model: every hook, wrapper and the worker it started.

    `detach()` removes them all (idempotent); usable as a context manager. A disabled
    attachment (`enabled=False`) does nothing.
    """

    def __init__(self, run_id: str | None, watch: LoopWatch | None = None,
                 worker: Worker | None = None, describe: dict[str, Any] | None = None,
                 recorder: Recorder | None = None) -> None:
        self._run_id = run_id
        self._recorder = recorder
        self._watch = watch
        self._worker = worker
        self._describe = describe or {}
        self._detached = watch is None
        self._lock = threading.Lock()
        self.step_guard: StepGuard | None = None

    @property
    def healthy(self) -> bool:
        """Whether the weights and optimizer state are safe to save: every parameter of
        the model and every floating tensor of its optimizer's state is finite. Reads one
        flag from the device (a sync): ask at checkpoint time, not per step. True when
        detached or disabled (nothing watched to judge)."""
        watch = self._watch
        if self._detached or watch is None:
            return True
        try:
            return weights_finite(watch.params, watch.optimizer)
        except Exception as exc:  # noqa: BLE001
            errors.report("attachment.healthy", exc)
            return True

    def _guard_stopping(self) -> str | None:
        """The step guard is about to stop the run: deliver what it has and name the
        newest flight-recorder bundle."""
        self.flush(timeout=10.0)
        captured = self._recorder.captured if self._recorder is not None else []
        files = [m.get("file") for m in captured if m.get("file")]
        return files[-1] if files else None

    @property
    def run_id(self) -> str | None:
        return self._run_id

    @property
    def enabled(self) -> bool:
        return not self._detached

    @property
    def step(self) -> int:
        """Index of the next optimizer step the agent will record."""
        return self._watch.step if self._watch is not None else 0

    @step.setter
    def step(self, value: int) -> None:
        """Number the next optimizer step `value` (the trainer's own step, e.g. its
        global_step before the step). Steps then carry the loop's numbers as given: a
        resumed run is not offset, and steps sent again supersede the stored ones."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"step must be a non-negative int, got {value!r}")
        if self._detached or self._watch is None:
            return
        if self._worker is not None:
            self._worker.explicit_steps = True
        self._watch.set_step(value)

    def log_loss(self, loss: Any) -> None:
        """Name the loss of the next step yourself: `loss` (a one-element tensor, or a
        number) is stored as that step's loss, summed with the others logged before the
        step (micro-batches), in place of the losses the agent saw backpropagated into the
        model. Keeps a reference to the tensor; does not synchronise the device."""
        if not self._detached and self._watch is not None:
            self._watch.log_loss(loss)

    def flush(self, timeout: float = 5.0) -> bool:
        """Hand over the last step, spool everything and try to deliver it.

        Blocks the caller up to `timeout` seconds (it waits for the worker); True when
        nothing is left undelivered (offline: when everything is in the spool).
        """
        if self._detached or self._watch is None or self._worker is None:
            return True
        deadline = time.monotonic() + timeout
        try:
            self._watch.close_pending()
            bundled = self._flush_bundles(deadline)
            return self._worker.flush(_left(deadline)) and bundled
        except Exception as exc:  # noqa: BLE001
            errors.report("attachment.flush", exc)
            return False

    def detach(self, timeout: float = 5.0) -> bool:
        """Remove every hook and wrapper, flush within `timeout`, stop the worker.

        Idempotent; returns whether everything was delivered.
        """
        with self._lock:
            if self._detached:
                return True
            self._detached = True
        watch, worker = self._watch, self._worker
        assert watch is not None and worker is not None
        delivered = False
        deadline = time.monotonic() + timeout
        try:
            watch.close_pending()
            watch.uninstall()
            bundled = self._flush_bundles(deadline)
            # the server then shows the run finished at once, not after `live_seconds`
            worker.submit(EventMessage({"step": None, "kind": FINISHED_EVENT, "detail": {}}))
            delivered = worker.stop(_left(deadline)) and bundled
            # after the worker: the mirror has every record now; a hung tracker costs this
            # call its timeout, never more
            if worker.mirror is not None:
                worker.mirror.close(_left(deadline))
        except Exception as exc:  # noqa: BLE001
            errors.report("attachment.detach", exc)
        errors.remove_listener(self._on_error)
        _live.discard(self)
        return delivered

    def _flush_bundles(self, deadline: float) -> bool:
        """The recorder judges steps as the worker decodes them: decode all, then wait
        for the bundles that asked for (they then travel with the next flush). False when
        a step was lost to an agent error or a bundle is still unwritten: this flush is
        the one that sees the worker's losses, so its answer must not be dropped."""
        if self._recorder is None or self._worker is None:
            return True
        decoded = self._worker.flush(_left(deadline))
        return self._recorder.flush(_left(deadline)) and decoded

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def check_speedup(self, example_batch: Any, loss_fn: Any, steps: int = 5,
                      dtype: Any = None) -> float | None:
        """Time forward+backward of a copy of the model in fp32 and under autocast.

        Returns fp32_ms / amp_ms and sends a `speed_check` event. Runs `2 * steps` timed
        steps plus warm-up on the training thread and synchronises the device: call it
        once, outside the training loop.
        """
        if self._detached or self._watch is None:
            return None
        from ampwatch.agent.speed import measure_speedup

        watch = self._watch
        watch.suspended = True
        try:
            detail = measure_speedup(watch, example_batch, loss_fn, steps, dtype)
        except Exception as exc:  # noqa: BLE001
            errors.report("attachment.check_speedup", exc)
            return None
        finally:
            watch.suspended = False
        self.event(SPEED_CHECK_EVENT, detail)
        return detail["speedup"]

    def event(self, kind: str, detail: dict[str, Any]) -> bool:
        """Queue an event for the next batch; never blocks."""
        if self._detached or self._worker is None or self._watch is None:
            return False
        return self._worker.submit(EventMessage({"step": self._watch.step, "kind": kind,
                                                 "detail": encode_tree(detail)}))

    # ------------------------------------------------------------------ internals
    def _on_error(self, site: str, exc: BaseException) -> None:
        self.event("agent_error", {"site": site, "message": f"{type(exc).__name__}: {exc}"})

    def _run_changed(self) -> None:
        if self._worker is not None:
            self._worker.submit(RunMessage(self._body()))

    def _body(self) -> dict[str, Any]:
        watch = self._watch
        assert watch is not None
        env = environment(watch.device, watch.scaler, watch.training_autocast,
                          watch.settings.world_size)
        env["parallelism"] = watch.parallelism
        env["grad_layout"] = watch.grad_layout
        return run_body(env=env, layers=watch.layers, **self._describe)

    def _decode(self, item: StepItem) -> dict | None:
        """Worker thread: the host copy of a closed step as a wire-format record."""
        watch = self._watch
        assert watch is not None
        if item.ready is not None:
            item.ready.synchronize()
        host = item.host.numpy()
        record: dict[str, Any] = {"step": item.step}
        try:
            for collector in watch.collectors:
                meta = item.meta.get(collector.name, CLOSE_FAILED)
                if meta is CLOSE_FAILED:
                    continue
                collector.read(host[collector.offset: collector.offset + collector.slots],
                               meta, record)
        finally:
            watch.buffer.release(item.host)
        if record.get("skipped") or record.get("forward_nonfinite") or any(
                isinstance(record.get(k), float) and not math.isfinite(record[k])
                for k in ("grad_norm", "loss")):
            watch.note_anomaly(item.step)
        # collectors encode their arrays (wire.encode_float_array); the rest are scalars
        for key, value in record.items():
            if type(value) is float and not math.isfinite(value):
                record[key] = encode_float(value)
        return record


def attach(model: nn.Module, scaler: Any = None, *, optimizer: Any = None,
           run: str | None = None, project: str | None = None, name: str | None = None,
           tags: list[str] | None = None, config: dict[str, Any] | None = None,
           server: str | None = None, token: str | None = None, enabled: bool = True,
           sample_every: int = 10,
           sample_after_anomaly: int = 20, spool_dir: str | os.PathLike | None = None,
           offline: bool | None = None, flush_interval: float | None = None,
           max_batch_steps: int | None = None, resume: bool | None = None,
           step: int | None = None, record: Any = True, guard: Any = False,
           mirror: Any = None, check_outputs: str | None = None,
           hold_mb: float | None = None) -> Attachment:
    """Start watching `model` (and `scaler`, a `torch.amp.GradScaler` or None).

    The optimizer is found at its first step when not given (the first whose parameters
    include the model's). `run` (default `AMPWATCH_RUN_ID`, else a new id) must be new for
    this rank unless `resume` (default `AMPWATCH_RESUME`) is true. Costs a few host-side
    hooks per step and a handful of small device kernels; does not synchronise the device;
    a chosen run id without `resume` costs one request to the server here. Raises
    ValueError for a run id, name, project or tag the server would refuse, for a reused
    run id without `resume`, and for a `step` that is not a non-negative int; never raises
    because of the agent's own failures: it logs them and returns a disabled attachment.
    `token` (default `AMPWATCH_TOKEN`) is sent to the server as a bearer token.

    `step`: the number of the first step recorded (the trainer's step; set it per step with
    `attachment.step = n`). Without it steps count from 0, or, for a resumed run, on from
    the last step stored.

    `record`: the flight recorder (docs/replay.md). On by default: when a step goes bad it
    writes a bundle (the batch, RNG states, the model's state as the step began, scaler
    and autocast settings) off the training thread, within 2 GiB per run and rank, and
    delivers it like batches; "local" keeps bundles on this machine, False turns it off,
    a `RecordSettings` sets triggers and budget. Costs a reference to each step's batch
    held one step longer and a copy of the RNG state per step.

    `guard`: the step guard (docs/guard.md), off by default. True, or a dict such as
    `{"skip_spikes": 5, "max_skips": 20}`: without an enabled GradScaler, an optimizer
    step whose loss or grads are not finite (or whose loss spikes) is left out exactly,
    as GradScaler leaves one out; `max_skips` in a row raise `GuardStop`.
    `mirror` (default `AMPWATCH_MIRROR`, comma separated): trackers that also get the
    per-step signals under `ampwatch/` and the run's incidents (docs/trackers.md): a
    `SummaryWriter`, a wandb run or "wandb" (the active one), "mlflow" (the active run),
    "tensorboard:<dir>", or a list. Written from the agent's threads, never the training
    thread; a tracker that fails, hangs or is not installed is logged once and left out.
    `check_outputs` (default `AMPWATCH_CHECK_OUTPUTS`, else "flagged"): on the CPU, an
    unsampled step's layer outputs are searched for the first inf/NaN only when its loss
    is inf/NaN, by replaying its forward (docs/agent.md, "Cheap by design");
    "every_step" checks every output of every step, which also sees an overflow a later
    op absorbed, at ~13% more elements read per step. On an accelerator the flag is a
    GradScaler's skip, and without one the outputs are held until their backward begins
    and checked there only when the loss is inf/NaN (without a sync).
    `hold_mb` (default `AMPWATCH_HOLD_MB`, else 1% of the device's memory): the most
    memory those held outputs may keep alive that autograd does not keep anyway; beyond
    it an output is checked as it is produced (read every step).
    """
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    run, resume = resolve_run(run, resume)
    check_labels(name, project, tags)
    record_settings = RecordSettings.parse(record)  # a caller's mistake raises
    guard_settings = GuardSettings.parse(guard)
    if check_outputs not in (None, *CHECK_OUTPUTS):
        raise ValueError(f"check_outputs must be one of {CHECK_OUTPUTS}, got {check_outputs!r}")
    check_hold_mb(hold_mb)
    if not enabled:
        return Attachment(run)
    try:
        rank, world_size = distributed_rank()
        generated = run is None
        if generated and world_size > 1:  # one run, one stream per rank
            run = shared_run_id(make_run_id(name), rank, world_size)
        settings = AgentSettings.build(
            run, name, server, rank=rank, world_size=world_size, sample_every=sample_every,
            sample_after_anomaly=sample_after_anomaly, spool_dir=spool_dir, offline=offline,
            flush_interval_s=flush_interval, max_batch_steps=max_batch_steps, resume=resume,
            run_id_generated=generated or None, token=token, check_outputs=check_outputs,
            hold_mb=hold_mb)
    except Exception as exc:  # noqa: BLE001
        errors.report("attach", exc)
        return Attachment(run)
    refuse_reused_run(settings)  # the caller's mistake, not the agent's: it raises
    try:
        layers = discover_layers(model)
        collectors = default_collectors(len(layers))
        fp8_layers = find_fp8_layers(layers)
        if fp8_layers:
            collectors.append(Fp8Collector(fp8_layers, layers))
        collectors.append(SpikeCollector(layers))
        collectors.append(WeightNormCollector(layers))  # after it: adds to its `spikes`
        step_guard = None if guard_settings is None else StepGuard(guard_settings)
        if step_guard is not None:
            collectors.append(step_guard)  # after the others: its read marks the step skipped
        recorder = make_recorder(record_settings, settings)
        if recorder is not None:
            collectors.append(recorder)  # last: its worker-side read sees the whole record
        # in order: the worker, the loop watch that hands it steps, the handle over both
        worker = Worker(settings)
        worker.mirror = make_mirror(mirror, settings)
        watch = LoopWatch(model, scaler, optimizer, layers, collectors, sink=worker.submit,
                            settings=settings)
        attachment = Attachment(settings.run_id, watch, worker,
                                describe_run(name, project, tags, config), recorder)
        if recorder is not None:
            recorder.connect(worker)
        attachment.step_guard = step_guard
        if step_guard is not None:
            step_guard.on_stop = attachment._guard_stopping
            step_guard.step_number = lambda n: (n if worker.explicit_steps
                                                else n + worker.step_offset)
        watch.on_run_change = errors.guarded("attachment.run_change")(attachment._run_changed)
        watch.on_event = attachment.event
        if step is not None:
            worker.explicit_steps = True
            watch.step = step
        body = attachment._body()  # the run as attach() found it, before any hook ran
        watch.install()
        worker.start(body, attachment._decode, lambda: watch.dropped_steps)
    except Exception as exc:  # noqa: BLE001
        errors.report("attach", exc)
        return Attachment(run)
    errors.add_listener(attachment._on_error)
    _live.add(attachment)
    if step is not None and settings.resume:
        # a checkpoint restart: the server lets these steps supersede its stored copies
        attachment.event(RESTART_EVENT, {})
    return attachment


def make_mirror(mirror: Any, settings: AgentSettings) -> Mirror | None:
    """The mirror into the trackers `mirror` names (None: none named or none available);
    online, it also reads the run's incidents from the server."""
    trackers = resolve_trackers(mirror)
    if not trackers:
        return None
    watch = None if settings.offline else IncidentWatch(
        Sender(settings.server, settings.token), settings.server, settings.run_id)
    return Mirror(trackers, watch)


def _detach_all_at_exit() -> None:
    """atexit: flush every live attachment within its exit timeout (5 s by default)."""
    deadline = None
    for attachment in list(_live):
        watch = attachment._watch
        if watch is None:
            continue
        if deadline is None:
            deadline = time.monotonic() + watch.settings.exit_timeout_s
        attachment.detach(timeout=max(0.1, deadline - time.monotonic()))


def _after_fork_in_child() -> None:
    for attachment in list(_live):
        attachment._detached = True
        if attachment._watch is not None:
            attachment._watch.active = False
        if attachment._worker is not None:
            attachment._worker.forked()
    _live.clear()


atexit.register(_detach_all_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)


def _left(deadline: float) -> float:
    """Seconds until `deadline`, at least a moment: a flush that found the worker idle
    still needs one hand-over to say so."""
    return max(0.1, deadline - time.monotonic())
