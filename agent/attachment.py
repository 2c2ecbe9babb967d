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
from ampwatch.agent.collectors import attached_collectors
from ampwatch.agent.environment import describe_run, environment, run_body
from ampwatch.agent.layers import discover_layers
from ampwatch.agent.loop_watch import CLOSE_FAILED, LoopWatch, StepItem
from ampwatch.agent.mirror import Mirror, resolve_trackers
from ampwatch.agent.mirror.incidents import IncidentWatch
from ampwatch.agent.recorder import Recorder, make_recorder
from ampwatch.agent.run_identity import refuse_reused_run
from ampwatch.agent.settings import AgentSettings
from ampwatch.agent.step_guard import StepGuard, weights_finite
from ampwatch.agent.transport.outage import say_server_problem
from ampwatch.agent.transport.sender import Sender
from ampwatch.agent.transport.worker import EventMessage, RunMessage, Worker
from ampwatch.wire import (
    FINISHED_EVENT,
    RESTART_EVENT,
    SPEED_CHECK_EVENT,
    encode_float,
    encode_tree,
)
from ampwatch.wire.bundles import BUNDLE_EVENT

_live: weakref.WeakSet[Attachment] = weakref.WeakSet()


class Attachment:
    """Handle of one attached model: every hook, wrapper and the worker it started.

    `detach()` removes them all (idempotent); usable as a context manager. A disabled
    attachment (`enabled=False`) does nothing.
    """

    def __init__(self, run_id: str | None, model: nn.Module | None = None, scaler: Any = None,
                 optimizer: Any = None, settings: AgentSettings | None = None) -> None:
        """A disabled handle without `settings`; else the worker, the collectors and the
        loop watch over `model`, built complete and not yet started (`start`)."""
        self._run_id = run_id
        self._lock = threading.Lock()
        self._detached = settings is None
        self._watch: LoopWatch | None = None
        self._worker: Worker | None = None
        self._recorder: Recorder | None = None
        self.step_guard: StepGuard | None = None
        self._describe: dict[str, Any] = {}
        if settings is None or model is None:
            return
        self._describe = describe_run(settings.name, settings.project, settings.tags,
                                      settings.config)
        self._worker = Worker(settings, mirror=make_mirror(settings.mirror, settings),
                              explicit_steps=settings.first_step is not None)
        self._recorder = make_recorder(settings.record, settings, self._run_step,
                                       self._emit_bundle)
        if settings.guard is not None:
            self.step_guard = StepGuard(settings.guard, on_stop=self._guard_stopping,
                                        step_number=self._run_step)
        layers = discover_layers(model)
        self._watch = LoopWatch(
            model, scaler, optimizer, layers,
            attached_collectors(layers, self.step_guard, self._recorder),
            sink=self._worker.submit, settings=settings, on_event=self.event,
            on_run_change=errors.guarded("attachment.run_change")(self._run_changed))

    @classmethod
    def start(cls, model: nn.Module, scaler: Any, optimizer: Any,
              settings: AgentSettings) -> Attachment:
        """Build and start watching (`attach()`'s work once its settings are resolved).
        ValueError for a reused run id without `resume`; any other failure is the
        agent's own: logged, counted, and a disabled handle returned."""
        if not settings.enabled:
            return cls(settings.run_id or None)
        try:
            say_server_problem(settings)  # a malformed URL is said here; the run only spools
        except Exception as exc:  # noqa: BLE001
            errors.report("attach", exc)
        refuse_reused_run(settings)  # the caller's mistake, not the agent's: it raises
        try:
            attachment = cls(settings.run_id, model, scaler, optimizer, settings)
            attachment._install()
        except Exception as exc:  # noqa: BLE001
            errors.report("attach", exc)
            return cls(None if settings.run_id_generated else settings.run_id)
        errors.add_listener(attachment._on_error)
        _live.add(attachment)
        if settings.first_step is not None and settings.resume:
            # a checkpoint restart: the server lets these steps supersede its stored copies
            attachment.event(RESTART_EVENT, {})
        return attachment

    def _install(self) -> None:
        """Hooks on, worker started: from here on the loop is watched."""
        watch, worker = self._watch, self._worker
        assert watch is not None and worker is not None
        body = self._body()  # the run as attach() found it, before any hook ran
        watch.install()
        worker.start(body, self._decode, lambda: watch.dropped_steps)

    def _run_step(self, step: int) -> int:
        """A process step as the run numbers it (the worker's numbering: on from a resumed
        run's last step, unless the loop numbers its steps itself)."""
        worker = self._worker
        assert worker is not None
        return step if worker.explicit_steps else step + worker.step_offset

    def _emit_bundle(self, detail: dict[str, Any]) -> bool:
        """Send a flight-recorder `bundle` event (also during detach, after `event` stopped
        taking events)."""
        assert self._worker is not None
        return self._worker.submit(EventMessage({"step": None, "kind": BUNDLE_EVENT,
                                                 "detail": detail}))

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
    """Watch the numerical health of `model`'s optimizer steps and deliver it to a server.

    Example::

        scaler = torch.amp.GradScaler("cuda")
        with agent.attach(model, scaler, project="gpt", tags=["fp16"]) as run:
            for x, y in loader:                      # the loop itself is unchanged
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = criterion(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()

    Keywords left at None take their `AMPWATCH_*` variable; docs/agent.md says more of each.

    Args:
        model (nn.Module): the model to watch; a `torch.compile` wrapper too.
        scaler (GradScaler, optional): `torch.amp.GradScaler`, or None (bf16, fp32). Default: None.
        optimizer (optional): Default: the first whose parameters include the model's, at its step.
        run (str, optional): the run id, new for this rank unless `resume`.
            Default: `AMPWATCH_RUN_ID`, else `<name or script>-<utc time>-<random>`.
        project, name (str, optional), tags (list[str], optional): the run's labels. Default: None.
        config (dict, optional): what JSON cannot hold is sent as text. Default: None.
        server (str, optional): Default: `AMPWATCH_SERVER`, else "http://127.0.0.1:8000".
        token (str, optional): sent as a bearer token. Default: `AMPWATCH_TOKEN`.
        enabled (bool): False returns a handle that does nothing. Default: True.
        sample_every (int): steps between sampled steps (0: none). Default: 10.
        sample_after_anomaly (int): every step sampled this long after a bad one. Default: 20.
        spool_dir (path, optional): Default: `AMPWATCH_SPOOL_DIR`, else ~/.cache/ampwatch/spool.
        offline (bool, optional): spool only. Default: `AMPWATCH_MODE=offline`, else False.
        flush_interval (float, optional): seconds. Default: `AMPWATCH_FLUSH_INTERVAL`, else 2.
        max_batch_steps (int, optional): steps per batch at most. Default: 200.
        resume (bool, optional): continue a run id's steps. Default: `AMPWATCH_RESUME`, else False.
        step (int, optional): the first step's number (the trainer's; `attachment.step = n`
            per step). Default: 0, or on from a resumed run's last stored step.
        record (bool, "local" or RecordSettings): the flight recorder (docs/replay.md).
            Default: True, or `AMPWATCH_RECORD`.
        guard (bool or dict): the step guard (docs/guard.md), e.g.
            `{"skip_spikes": 5, "max_skips": 20}`. Default: False.
        mirror: trackers that also get the signals and incidents (docs/trackers.md): a
            SummaryWriter, a wandb run, "wandb", "mlflow", "tensorboard:<dir>", or a list.
            Default: `AMPWATCH_MIRROR`, else none.
        check_outputs (str, optional): "flagged" (layer outputs searched only on a bad step)
            or "every_step". Default: `AMPWATCH_CHECK_OUTPUTS`, else "flagged".
        hold_mb (float, optional): the most memory outputs held for their check may keep alive.
            Default: `AMPWATCH_HOLD_MB`, else 1% of the device's memory.

    Raises ValueError for a run id, name, project, tag, `step`, `record`, `guard`,
    `check_outputs` or `hold_mb` the agent cannot take, and for a reused run id without
    `resume`; never because of the agent's own failures: they are logged and counted, and
    the handle returned is disabled.

    .. note:: No host-device sync per step: hooks only launch small device kernels into a
        preallocated buffer, read on the agent's worker thread a step later. A chosen run id
        without `resume` costs one request to the server here (up to 2 s).
    """
    settings = AgentSettings.from_attach(
        run=run, project=project, name=name, tags=tags, config=config, server=server,
        token=token, enabled=enabled, sample_every=sample_every,
        sample_after_anomaly=sample_after_anomaly, spool_dir=spool_dir, offline=offline,
        flush_interval_s=flush_interval, max_batch_steps=max_batch_steps, resume=resume,
        step=step, record=record, guard=guard, mirror=mirror, check_outputs=check_outputs,
        hold_mb=hold_mb)
    return Attachment.start(model, scaler, optimizer, settings)


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
