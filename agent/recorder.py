"""The flight recorder: keeps the last step's batch a step longer and, when the worker
finds that step bad (record_triggers.py), captures what replaying it needs into a bundle.

Per step, on the training thread, it only keeps references: the root module's forward
arguments of each training forward, the loss tensors, and a copy of the RNG states (a few
KB, host). Nothing is copied from the device. The worker judges the step a step later;
a bundle then needs the model's parameters as the step began:

- a skipped step (a scaler found inf/NaN) left them unchanged, so they are exact as long
  as no optimizer step was applied since; the training thread copies them at its next
  hook (one device-to-host copy per incident, never per step);
- an applied step changed them. When the device is the host (CPU), the loss is a host
  value at `optimizer.step()` time, so a non-finite or spiking loss is seen before the
  update and the parameters are copied then (exact). Otherwise the bundle holds the
  parameters as they were at capture and says so (`exact: false`, `steps_applied_since`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ampwatch.agent import errors
from ampwatch.agent.bundle import BundleWriter, to_host
from ampwatch.agent.collectors.base import Collector
from ampwatch.agent.collectors.forward_search import rng_states
from ampwatch.agent.distributed import SHARDED_PARALLELISMS
from ampwatch.agent.environment import scaler_config
from ampwatch.agent.record_triggers import RecordSettings, Triggers
from ampwatch.wire import encode_tree
from ampwatch.wire.bundles import BUNDLE_FOLDER, BUNDLE_FORMAT


class HostCopy:
    """A state dict being copied to the host. A CUDA tensor goes into pinned memory with a
    non-blocking copy, ordered on its stream before any later update, so taking the copy
    never waits for the device; `wait()` (the writer thread) does, once."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        devices = set()
        for key, value in tensors.items():
            value = value.detach()
            if value.is_cuda:
                host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                host.copy_(value, non_blocking=True)
                devices.add(value.device)
            else:
                host = value.to("cpu", copy=True)
            self.tensors[key] = host
        self._ready = [torch.cuda.Event() for _ in devices]
        for event, device in zip(self._ready, devices, strict=True):
            event.record(torch.cuda.current_stream(device))

    def wait(self) -> dict[str, torch.Tensor]:
        for event in self._ready:
            event.synchronize()
        self._ready = []
        return self.tensors


@dataclass
class Held:
    """One step's inputs, kept until the worker has judged the step."""

    batches: list[tuple[tuple, dict]]
    entries: list[str]  # per batch, the module the loop called ("": the model)
    rng: dict[str, torch.Tensor]
    applied_at_begin: int  # optimizer steps applied before this step began
    pre: HostCopy | None = None  # state dict copied before any update
    skipped: bool = False  # the optimizer did not step (a scaler found inf/NaN)
    judged: bool = False  # the worker has read the step


def _plain(value: Any) -> Any:
    """A hyperparameter as JSON (a tensor learning rate is read once, at capture)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


class Recorder(Collector):
    """The `recorder` collector; last in the collector list, so its `read` (worker) sees
    the step's whole record."""

    name = "recorder"
    # steps whose batch may wait for the worker at once (it reads every 50 ms: a fast
    # loop of small steps has many in flight); past it a step is not kept
    MAX_HELD = 64

    def __init__(self, settings: RecordSettings, folder: Path,
                 step_number: Callable[[int], int] = lambda step: step,
                 emit: Callable[[dict[str, Any]], Any] = lambda detail: False) -> None:
        """`step_number`: a process step as the run numbers it (as the worker does);
        `emit(detail)` sends a `bundle` event (also during detach, after the attachment
        stopped taking events)."""
        super().__init__()
        self.settings = settings
        self.folder = folder
        self.triggers = Triggers(settings)
        self.writer = BundleWriter(folder, settings.max_bytes, self._written)
        self.step_number = step_number
        self.emit = emit
        self.captured: list[dict[str, Any]] = []  # metadata of each bundle attempted
        self._requests: deque[tuple[Held, dict[str, Any]]] = deque()
        self._host_losses: deque[float] = deque(maxlen=max(1, settings.loss_window))
        self._applied = 0
        self._stepped = True
        self._last_held: Held | None = None
        self._sealed = 0  # steps held (training thread) ...
        self._read = 0  # ... and judged (worker): each counter has one writer
        self._bound = False
        self.off = False  # a sharded model (see `bind`): nothing is held or captured
        self._said_off = False
        self._reset()

    def _reset(self) -> None:
        self._batches: list[tuple[tuple, dict]] = []
        self._entries: list[str] = []
        self._rng: dict[str, torch.Tensor] | None = None
        self._applied_at_begin = self._applied
        self._losses: list[torch.Tensor] = []
        self._pre: HostCopy | None = None

    def bind(self, watch: Any) -> None:
        super().bind(watch)
        self._bound = True
        if watch.parallelism in SHARDED_PARALLELISMS:
            # a bundle needs the whole weights, which a sharded model's rank has only
            # through an all-gather: started by the one rank that saw the bad step, it
            # would leave every other rank waiting in a collective (a deadlock)
            self.off = True

    def unbind(self) -> None:
        """At detach: capture what the worker asked for; later asks capture on the worker
        (training has stopped, the parameters hold still)."""
        self._bound = False
        self._serve()

    # ------------------------------------------------------------------ training thread
    def on_forward_begin(self, training: bool, args: tuple, kwargs: dict) -> None:
        self._serve()
        if self.off and not self._said_off:
            # said at the first forward, once the run is registered (not during attach)
            self._said_off = True
            self.watch.note_unsupported("flight_recorder", [])
        if not training or self.off:
            return
        if self._rng is None:
            self._rng = rng_states(self.watch.device)
            self._applied_at_begin = self._applied
        self._batches.append((args, dict(kwargs)))
        self._entries.append(self.watch.forward_entry)

    def _take(self, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.numel() == 1 and tensor.is_floating_point():
            self._losses.append(tensor.detach())

    def on_scale(self, outputs: Any) -> None:
        if self.watch.scaler_enabled:
            self._take(outputs)

    def on_backward_begin(self, tensor: torch.Tensor) -> None:
        if not self.watch.scaler_enabled:
            self._take(tensor)

    def on_step_begin(self, step: int) -> None:
        """CPU only (no device to wait for): copy the parameters while they are still as
        the suspect step began, before an update changes them."""
        self._serve()
        watch = self.watch
        if (self.off or not watch.host_reduce
                or self.triggers.started >= self.settings.max_bundles):
            return
        last = self._last_held
        if last is not None and last.skipped and not last.judged and last.pre is None:
            # skipped and not yet judged: this step's update would end exactness
            last.pre = self._state_dict()
        if watch.scaler_enabled or not self._losses or self._rng is None:
            return
        # no scaler: this update applies whatever the step did, so judge the loss now
        loss = sum(float(t) for t in self._losses)  # host tensors: reading waits for nothing
        if not math.isfinite(loss) or self.triggers.spike(loss, self._host_losses):
            self._pre = self._state_dict()
        else:
            self._host_losses.append(loss)

    def on_step_end(self, step: int, stepped: bool) -> None:
        self._stepped = stepped
        if stepped:
            self._applied += 1

    def seal(self) -> Any:
        held = None
        if self._batches and self._sealed - self._read < self.MAX_HELD:
            held = Held(self._batches, self._entries, self._rng or {},
                        self._applied_at_begin, self._pre, skipped=not self._stepped)
            self._sealed += 1
        self._last_held = held
        self._reset()
        return held

    def _state_dict(self) -> HostCopy:
        """The model's parameters and buffers, being copied to the host (incidents only;
        does not wait for the device)."""
        return HostCopy({k: v for k, v in self.watch.inner.state_dict(keep_vars=True).items()
                         if isinstance(v, torch.Tensor)})

    def _serve(self) -> None:
        while self._requests:
            held, meta = self._requests.popleft()
            self._capture(held, meta)

    # ------------------------------------------------------------------ worker thread
    def read(self, host: Any, meta: Any, record: dict[str, Any]) -> None:
        held: Held | None = meta
        if self.off:
            return
        if held is not None:
            self._read += 1
            held.judged = True
        trigger = self.triggers.judge(record, kept=held is not None)
        if trigger is None or held is None:
            return
        description = self._describe(record, trigger)
        if held.pre is not None:  # (`judged` stops the training thread copying again)
            self._capture(held, description)
            return
        self._requests.append((held, description))
        if not self._bound:  # detached: training has stopped, the parameters hold still
            self._serve()

    def _describe(self, record: dict[str, Any], trigger: str) -> dict[str, Any]:
        watch = self.watch
        first = record.get("first_nonfinite_layer")
        optimizer = watch.optimizer
        scaler = scaler_config(watch.scaler)
        if scaler is not None:
            scaler["scale"] = record.get("loss_scale")  # host value: no get_scale() sync
        activations = record.get("activations") or {}
        dtypes = activations.get("dtype") if isinstance(activations, dict) else None
        return {
            "format": BUNDLE_FORMAT, "run_id": watch.settings.run_id, "rank": watch.rank,
            "step": self.step_number(record["step"]), "trigger": trigger,
            "model_factory": self.settings.model_factory,
            "first_nonfinite_layer": (watch.layers[first].name
                                      if isinstance(first, int) else None),
            "loss": record.get("loss"), "skipped": record.get("skipped"),
            "grad_norm": record.get("grad_norm"),
            "loss_baseline": (statistics.median(self.triggers.losses)
                              if self.triggers.losses else None),
            "loss_spike_factor": self.settings.loss_spike,
            "input_nonfinite": record.get("input_nonfinite"),
            "autocast": {"device_type": watch.device_type,
                         "dtype": record.get("autocast_dtype")},
            "scaler": scaler,
            "optimizer": None if optimizer is None else {
                "class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
                "param_groups": [{k: _plain(v) for k, v in g.items() if k != "params"}
                                 for g in optimizer.param_groups]},
            "environment": {
                "torch_version": torch.__version__, "device": str(watch.device),
                "param_dtypes": sorted({str(p.dtype).removeprefix("torch.")
                                        for p in watch.params}),
                "layer_dtypes": (None if dtypes is None else {
                    layer.name: dtypes[layer.index] for layer in watch.layers
                    if layer.index < len(dtypes) and dtypes[layer.index] is not None})},
        }

    # ------------------------------------------------------------------ either thread
    def _capture(self, held: Held, meta: dict[str, Any]) -> None:
        """Copy the parameters (unless copied before the update) and queue the bundle."""
        try:
            if held.pre is not None:
                params, exact, since = held.pre, True, 0
            else:
                since = self._applied - held.applied_at_begin
                params, exact = self._state_dict(), since == 0
            meta["params"] = {"exact": exact, "steps_applied_since": since,
                              "taken": "before any update" if held.pre is not None
                              else "at capture"}
            meta["micro_batches"] = len(held.batches)
            if any(held.entries):  # the loop called submodules itself: replay calls them
                meta["forward_entries"] = list(held.entries)
            batches, rng = held.batches, held.rng
            held.batches, held.pre = [], None  # the writer owns them now

            def state() -> dict[str, Any]:
                return {"batches": [(to_host(a), to_host(k)) for a, k in batches],
                        "rng": rng, "model": params.wait()}

            self.captured.append(meta)
            if not self.writer.submit(meta, state):
                self._written(meta, None, "too many bundles waiting to be written")
        except Exception as exc:  # noqa: BLE001
            errors.report("recorder.capture", exc)

    def _written(self, meta: dict[str, Any], path: Path | None, reason: str | None) -> None:
        """Writer thread: tell the server (an event) what was kept or why not."""
        detail = {"step": meta["step"], "trigger": meta["trigger"],
                  "bytes": meta.get("bytes"), "file": None if path is None else path.name,
                  "first_nonfinite_layer": meta.get("first_nonfinite_layer"),
                  "exact": meta.get("params", {}).get("exact"),
                  "delivery": self.settings.mode, "dropped": reason}
        meta["file"] = None if path is None else str(path)
        meta["dropped"] = reason
        self.emit(encode_tree(detail))

    def flush(self, timeout: float) -> bool:
        """Capture what the worker asked for (the caller's thread: the training thread, at
        `flush()` or `detach()`), then wait up to `timeout` for the bundles to be on disk."""
        self._serve()
        return self.writer.flush(timeout)


def make_recorder(parsed: RecordSettings | None, settings: Any,
                  step_number: Callable[[int], int],
                  emit: Callable[[dict[str, Any]], Any]) -> Recorder | None:
    """The recorder of `attach(record=...)` (None: off). Bundles go to
    `RecordSettings.folder`; by default delivered ones to `bundles/` in the run's spool
    directory (the sender uploads them from there), local ones to
    `<spool dir>/../bundles/<run>/rank-<rank>`."""
    from ampwatch.agent.transport.spool import run_dir

    if parsed is None:
        return None
    spool = Path(settings.spool_dir)
    if parsed.folder is not None:
        folder = parsed.folder
    elif parsed.mode == "local":
        folder = run_dir(spool.parent / "bundles", settings.run_id, settings.rank)
    else:
        folder = run_dir(spool, settings.run_id, settings.rank) / BUNDLE_FOLDER
    return Recorder(parsed, folder, step_number, emit)
