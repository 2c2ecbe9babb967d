"""Running the detectors: on every ingested batch (incrementally, over a recent window)
and when a run registers or changes its layer table."""

from __future__ import annotations

import threading
from collections import OrderedDict

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ampwatch.server.analysis.context import LayerTable, RunContext
from ampwatch.server.analysis.draft import Detection
from ampwatch.server.analysis.registry import Inputs, run_detectors
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.analysis.window import Window
from ampwatch.server.analysis.window_cache import RankWindows
from ampwatch.server.findings.store import apply_detections, refresh_run_health, update_run_health
from ampwatch.server.models import Batch, Run, RunRank
from ampwatch.server.store.fp8_samples import load_fp8_window
from ampwatch.server.store.series import StepSeries, concat
from ampwatch.server.store.spike_samples import load_spike_window
from ampwatch.server.store.storage import clip_steps, load_layers, load_series

# Setup findings (layer table, environment) live on rank 0.
SETUP_RANK = 0


class LayerTableCache:
    """Layer tables by (database, run, run.updated_at, n_layers): every PUT that can change
    the table bumps `updated_at`, so a stale entry is never hit, whichever replica wrote.
    Saves reading and parsing the layer rows on every ingested batch."""

    max_entries = 256

    def __init__(self) -> None:
        self._tables: OrderedDict[tuple, LayerTable] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, session: Session, run: Run) -> LayerTable:
        key = (str(session.get_bind().url), run.id, run.updated_at, run.n_layers)
        with self._lock:
            table = self._tables.get(key)
            if table is not None:
                self._tables.move_to_end(key)
                return table
        table = LayerTable.of(load_layers(session, run.id))
        with self._lock:
            self._tables[key] = table
            while len(self._tables) > self.max_entries:
                self._tables.popitem(last=False)
        return table


layer_tables = LayerTableCache()


def _rank_first_step(session: Session, run_id: str, rank: int, rank_row: RunRank | None,
                     window_start: int, settings: AnalysisSettings) -> int | None:
    """The first step the rank sent. Only calibration needs it exactly: when the rank's
    totals show it began long before the window, their estimate saves the query."""
    if rank_row is not None and rank_row.last_step is not None and rank_row.steps:
        estimate = rank_row.last_step - rank_row.steps + 1
        if estimate + settings.calibration_max_steps < window_start:
            return estimate
    return session.scalar(
        select(func.min(Batch.first_step))
        .where(Batch.run_id == run_id, Batch.rank == rank, Batch.first_step >= 0)
    )


def _window(session: Session, run: Run, rank: int, batch: StepSeries, start: int,
            rank_last_step: int | None, windows: RankWindows, keep_from: int) -> StepSeries:
    """The rank's steps from `start` through `batch`, exactly as `load_series` reads them.
    A batch past every stored step (the usual case) is joined to the history before it,
    as the request that stored it saw that history. keep_from: where the rank's next
    window will start (`windows` forgets the batches before it)."""
    first_step, last_step = _span(batch)
    follows = rank_last_step is None or rank_last_step < first_step
    if not len(batch) or not follows or batch.n_layers != run.n_layers:
        parts = windows.batches(session, run.id, rank, start, last_step,
                                n_layers=run.n_layers, keep_from=keep_from)
        return clip_steps(concat(parts, run.n_layers), start, last_step)
    history = windows.batches(session, run.id, rank, start, first_step - 1,
                              n_layers=run.n_layers, keep_from=keep_from)
    return clip_steps(concat([*history, batch], run.n_layers), start, last_step)


def _span(batch: StepSeries) -> tuple[int, int]:
    """First and last step of a batch ((-1, -1) when it holds none, as stored)."""
    steps = batch.steps
    return (int(steps[0]), int(steps[-1])) if steps.size else (-1, -1)


def on_ingest(session: Session, run: Run, rank: int, batch: StepSeries,
              settings: AnalysisSettings, *, rank_last_step: int | None, current: bool,
              fp8: bool = False, spikes: bool = False,
              windows: RankWindows | None = None) -> None:
    """Analyse `batch`, stored for `rank` and unpacked with every column (the caller
    commits). rank_last_step: the rank's last step before this batch (None when it had
    none); current: the batch held the rank's newest steps when it was stored; fp8,
    spikes: it stored FP8 or spike samples. windows: the rank windows held in memory
    (server/analysis/window_cache.py); without, the history is read from storage.

    Reads the rank's last `history_steps` before the batch, runs the step detectors (and
    the setup ones on rank 0) on them plus the batch, upserts findings and updates
    `run.status` / `run.open_findings`. A batch older than the rank's latest step adds
    history but changes no open finding. FP8 samples are judged over the same span when
    the batch is the rank's newest.
    """
    if not settings.enabled:
        return
    first_step, last_step = _span(batch)
    rank_row = session.get(RunRank, (run.id, rank))
    start = first_step - settings.history_steps
    rank_first = _rank_first_step(session, run.id, rank, rank_row, start, settings)
    if rank_first is not None:
        start = max(start, rank_first)
    series = _window(session, run, rank, batch, start, rank_last_step,
                     windows or RankWindows(), keep_from=last_step + 1 - settings.history_steps)
    if not len(series) and not series.events:
        return
    context = RunContext.build(layer_tables.get(session, run), run.environment, rank,
                               rank_first)
    inputs = [Inputs.STEPS, Inputs.SETUP] if rank == SETUP_RANK else [Inputs.STEPS]
    detections = run_detectors(Window(series, context), settings, inputs)
    since = int(series.steps[0]) if len(series) else None
    change = apply_detections(session, run.id, rank, detections, settings, since=since,
                              current=current)
    update_run_health(session, run, change)
    newest = rank_last_step is None or last_step >= rank_last_step
    if fp8 and newest:
        _judge_fp8(session, run, context, last_step, settings)
    if (spikes or batch.has("loss").any()) and newest:
        _judge_spikes(session, run, Window(series, context), settings)


def _judge_spikes(session: Session, run: Run, window: Window,
                  settings: AnalysisSettings) -> None:
    """The spike detector on the window's steps (their loss) and the rank's spike
    samples over the same span (docs/spikes.md)."""
    steps = window.series.steps
    window.spikes = load_spike_window(session, run.id, window.run.rank, run.n_layers,
                                      start=int(steps[0]), end=int(steps[-1]))
    detections = run_detectors(window, settings, [Inputs.SPIKES])
    change = apply_detections(session, run.id, window.run.rank, detections, settings,
                              since=int(steps[0]))
    update_run_health(session, run, change)


def _judge_fp8(session: Session, run: Run, context: RunContext, last_step: int,
               settings: AnalysisSettings) -> None:
    """The FP8 detectors on the rank's samples of the last `history_steps` through
    `last_step`."""
    samples = load_fp8_window(session, run.id, context.rank, run.n_layers,
                              start=last_step - settings.history_steps, end=last_step)
    window = Window(StepSeries.empty(run.n_layers), context, fp8=samples)
    detections = run_detectors(window, settings, [Inputs.FP8])
    change = apply_detections(session, run.id, context.rank, detections, settings,
                              since=int(samples.steps[0]) if len(samples) else None)
    update_run_health(session, run, change)


def on_ranks_advanced(session: Session, run: Run, through: int,
                      settings: AnalysisSettings, windows: RankWindows | None = None) -> None:
    """Compare the ranks over their last `rank_window_steps` through `through`, a step
    every rank has now sent (the caller calls this when that step advanced, so the pass
    runs about once per round of batches, not once per batch). Reads every rank's recent
    steps with activations, without per-layer grads (from `windows` where held)."""
    if not settings.enabled:
        return
    ranks = [r.rank for r in session.scalars(
        select(RunRank).where(RunRank.run_id == run.id).order_by(RunRank.rank))]
    if len(ranks) < 2:
        return
    start = max(through - settings.rank_window_steps + 1, 0)
    table = layer_tables.get(session, run)
    windows = windows or RankWindows()
    peers = {r: Window(_rank_series(session, windows, run, r, start, through),
                       RunContext.build(table, run.environment, r)) for r in ranks}
    lead = peers[ranks[0]]
    window = Window(lead.series, lead.run, peers=peers)
    for detection in run_detectors(window, settings, [Inputs.RANKS]):
        for rank, part in _by_rank(detection, ranks).items():
            change = apply_detections(session, run.id, rank, [part], settings, since=start)
            update_run_health(session, run, change)


def _rank_series(session: Session, windows: RankWindows, run: Run, rank: int, start: int,
                 end: int) -> StepSeries:
    """`load_series(..., with_layers=False)` of the rank over [start, end], from memory
    where the rank's window holds it."""
    parts = windows.batches(session, run.id, rank, start, end, n_layers=run.n_layers,
                            with_layers=False)
    return clip_steps(concat(parts, run.n_layers), start, end)


def _by_rank(detection: Detection, ranks: list[int]) -> dict[int, Detection]:
    """A rank comparison's detection split into one per rank (each draft on the rank it
    names), each covering the same keys: a rank without a draft has recovered."""
    return {rank: Detection(drafts=[d for d in detection.drafts if d.rank == rank],
                            covers=detection.covers) for rank in ranks}


def on_register(session: Session, run: Run, settings: AnalysisSettings) -> None:
    """Judge the run's setup (misaligned layers, setup pitfalls) after it registered or
    changed its layer table or environment; the caller commits."""
    if not settings.enabled:
        return
    series = load_series(session, run.id, SETUP_RANK, last_n=settings.history_steps,
                         n_layers=run.n_layers, with_layers=False, with_acts=False)
    context = RunContext.build(layer_tables.get(session, run), run.environment, SETUP_RANK)
    detections = run_detectors(Window(series, context), settings, [Inputs.SETUP])
    apply_detections(session, run.id, SETUP_RANK, detections, settings)
    refresh_run_health(session, run)
