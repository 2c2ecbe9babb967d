"""A multi-rank run read as one: grad norms combined over the ranks, and each rank's
totals side by side (the ranks panel).

How each rank's grad norms combine depends on the run's `grad_layout` (the agent sends
it in the environment; docs/ranks.md):
- "sharded" (FSDP, DTensor): each rank sent the norms of its own parts, so the norm is
  the square root of the sum of the ranks' squares; a step is combined only once every
  rank of the run sent it (before that its values are null: never a partial sum).
- "replicated" (DDP): every rank holds the same grads and rank 0 alone sends the
  per-layer norms; rank 0's values are the run's.
- "local" or unknown: one rank, its own values.
"""

from __future__ import annotations

import numpy as np
from sqlalchemy import case, func, or_, select
from sqlalchemy.orm import Session

from ampwatch.server.models import Batch, Finding, Run, RunRank
from ampwatch.server.services.runs import lead_rank, run_ranks
from ampwatch.server.store import combined
from ampwatch.server.store.rollups import step_ms_median
from ampwatch.server.store.series import MISSING, StepSeries
from ampwatch.server.store.storage import load_ranks_series, load_series
from ampwatch.wire import encode_float_array

SHARDED, REPLICATED = "sharded", "replicated"
MAX_COMBINED_STEPS = 10_000
# values a sharded combined read unpacks at once (a chunk of ranks' steps, x layers with
# layers=true): 8M float32 values, and their float64 copy, are about 100 MB
COMBINED_VALUES = 8_000_000


def grad_layout(run: Run) -> str:
    layout = (run.environment or {}).get("grad_layout")
    return layout if layout in (SHARDED, REPLICATED) else "local"


def expected_ranks(run: Run, reporting: int) -> int:
    """How many ranks a combined step needs: the run's world size when the agent sent
    one, else the `reporting` ranks that sent anything."""
    world = (run.environment or {}).get("world_size")
    return world if isinstance(world, int) and world >= 1 else max(reporting, 1)


class ShardSums:
    """The ranks' squared grad norms summed step by step over [start, end], fed a few
    ranks at a time (`add`), so a read of any number of ranks holds one span's sums and
    one chunk of ranks' batches, never every rank's at once."""

    def __init__(self, start: int, end: int, n_layers: int, with_layers: bool) -> None:
        size = end - start + 1
        self.start = start
        self.ranks_sent = np.zeros(size, dtype=np.int64)  # ranks that sent each step
        self.total_known = np.ones(size, dtype=bool)
        self.total_sq = np.zeros(size)
        self.layer_sq = np.zeros((size, n_layers)) if with_layers else None
        self.seen = np.zeros((size, n_layers), dtype=bool) if with_layers else None

    def add(self, series: StepSeries) -> None:
        """One rank's steps (within the span, each once)."""
        rows = series.steps - self.start
        self.ranks_sent[rows] += 1
        has = series.has("grad_norm")
        self.total_known[rows] &= has
        self.total_sq[rows] += np.square(np.where(has, series.column("grad_norm"), 0.0))
        if self.layer_sq is not None and series.layer_grad is not None:
            block = series.layer_grad.astype(np.float64)
            present = block != MISSING
            self.seen[rows] |= present
            self.layer_sq[rows] += np.where(present, np.square(block), 0.0)

    def add_folded(self, first: int, ranks: np.ndarray, sum_sq: np.ndarray,
                   unknown: np.ndarray) -> None:
        """Steps from `first` on as the worker folded them (server/store/combined.py): the
        ranks in each, their summed squares and how many sent no total."""
        rows = slice(first - self.start, first - self.start + len(ranks))
        self.ranks_sent[rows] += ranks
        self.total_sq[rows] += sum_sq
        self.total_known[rows] &= unknown == 0

    def combined(self, n_ranks: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """Steps every one of `n_ranks` ranks sent, their total norm (sqrt of the summed
        squares, float64), whether every rank sent a total for the step, and the
        per-layer norms (with layers): a layer none of the ranks had a grad for is
        MISSING; one rank without it adds nothing."""
        keep = np.flatnonzero(self.ranks_sent >= max(n_ranks, 1))
        layers = None
        if self.layer_sq is not None:
            layers = np.where(self.seen[keep], np.sqrt(self.layer_sq[keep]), float(MISSING))
        return (keep + self.start, np.sqrt(self.total_sq[keep]), self.total_known[keep],
                layers)


def combined_grad_norms(session: Session, run: Run, *, start: int | None = None,
                        end: int | None = None, with_layers: bool = False,
                        limit: int = MAX_COMBINED_STEPS) -> dict:
    """The run's grad norms over [start, end], combined over its ranks (see the module
    docstring): the steps of a span of at most `limit` step numbers from `start` (the
    lead rank's first step when None; sharded with layers, shorter, so that the span's
    per-layer sums stay within COMBINED_VALUES / 8 values); `next_start` continues
    while the lead rank has later steps. Reads the lead rank's row, the count of ranks
    and its first step, then the batches in the span: the lead rank's when replicated;
    when sharded, every rank's, a chunk of ranks at a time (`ShardSums`), so the values
    unpacked at once stay near COMBINED_VALUES however many ranks there are, and a long
    run costs what a short one does. (Per-layer norms of thousands of ranks are then
    many chunks: a sharded step's norm needs every rank's shards.)"""
    lead = lead_rank(session, run.id)
    reporting = rank_count(session, run.id) if lead is not None else 0
    layout = grad_layout(run)
    n_ranks = expected_ranks(run, reporting)
    n_layers = run.n_layers
    first = start if start is not None else _first_step(session, run.id, lead)
    last = lead.last_step if lead is not None else None
    if end is not None:
        last = end if last is None else min(last, end)
    span = limit
    if layout == SHARDED and with_layers:  # the span's float64 per-layer sums: 8 MB at most
        span = max(1, min(limit, COMBINED_VALUES // 8 // max(n_layers, 1)))
    if first is None or last is None or first > last:
        steps = np.zeros(0, dtype=np.int64)
        total, known, layers = np.zeros(0), np.zeros(0, dtype=bool), None
        bound = last
    else:
        bound = min(last, first + span - 1)
        # sharded, a step needs every rank that reports, and at least the world size
        steps, total, known, layers = _combined_span(session, run, layout, lead,
                                                     max(n_ranks, reporting), reporting,
                                                     first, bound, with_layers)
    if with_layers and layers is None:
        layers = np.full((len(steps), n_layers), MISSING, dtype=np.float32)
    return {
        "run_id": run.id,
        "grad_layout": layout,
        "ranks": n_ranks,
        "ranks_reporting": reporting,
        "steps": steps.tolist(),
        "grad_norm": encode_float_array(total, missing=~known),
        "layer_grad_norm": None if not with_layers else encode_float_array(
            layers, missing=layers == MISSING),
        "next_start": bound + 1 if bound is not None and bound < last else None,
    }


def _first_step(session: Session, run_id: str, lead: RunRank | None) -> int | None:
    """The lead rank's first step (a combined step needs every rank, the lead too): one
    probe of the batches' (run, rank, first_step) index."""
    if lead is None:
        return None
    return session.scalar(select(func.min(Batch.first_step)).where(
        Batch.run_id == run_id, Batch.rank == lead.rank, Batch.first_step >= 0))


def _combined_span(session: Session, run: Run, layout: str, lead: RunRank, n_ranks: int,
                   reporting: int, start: int, end: int, with_layers: bool
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Steps in [start, end] combined as the layout says: (steps, total norm, whether
    the total is known, per-layer norms or None)."""
    n_layers = run.n_layers
    if layout == SHARDED:
        sums = ShardSums(start, end, n_layers, with_layers)
        if not with_layers:
            # the worker's sums through the step every rank is folded to; the batches
            # only beyond it, and only while ranks are not folded up to their last step
            through = combined.folded_through(session, run.id, reporting)
            if through is not None and through >= start:
                combined.add_folded(session, run.id, sums, start, min(end, through))
                lowest = combined.lowest_last_step(session, run.id)
                if through >= end or lowest is None or through >= lowest:
                    return sums.combined(n_ranks)
                start = through + 1
        # ranks a chunk: their batches in the span, unpacked at once, stay near
        # COMBINED_VALUES (a batch is unpacked whole, so a rank's rows reach past the
        # span by up to a batch at either end: the lead's mean batch is the estimate)
        width = n_layers if with_layers else 1
        batch_steps = lead.steps // max(lead.batches, 1)
        chunk = max(1, COMBINED_VALUES // ((end - start + 1 + 2 * batch_steps) * width))
        after = -1
        while after is not None:
            rows, after = rank_page(session, run.id, after, chunk)
            parts = load_ranks_series(session, run.id, [r.rank for r in rows], start, end,
                                      n_layers=n_layers, with_layers=with_layers,
                                      with_acts=False)
            for series in parts.values():
                sums.add(series)
        return sums.combined(n_ranks)
    series = load_series(session, run.id, lead.rank, start, end, n_layers=n_layers,
                         with_layers=with_layers, with_acts=False)
    return (series.steps, series.column("grad_norm"), series.has("grad_norm"),
            series.layer_grad if with_layers else None)


def ranks_panel(session: Session, run: Run, rank_rows: list[RunRank] | None = None
                ) -> list[dict]:
    """Per rank: steps, skipped, the latest loss scale, the median step time of its last
    PANEL_STEPS steps, dropped and lost data. One read of the ranks' rows (their rollups,
    server/store/rollups.py; none when `rank_rows` are given), whatever their number; no batch
    is read."""
    rows = []
    for rank_row in run_ranks(session, run.id) if rank_rows is None else rank_rows:
        rows.append({
            "rank": rank_row.rank,
            "steps": rank_row.steps,
            "skipped": rank_row.skipped,
            "last_step": rank_row.last_step,
            "loss_scale": rank_row.loss_scale,
            # an archived run's steps are gone: so is their step time
            "step_ms_median": None if run.archived_at is not None
            else step_ms_median(session, rank_row, run.n_layers),
            "dropped_steps": rank_row.dropped_steps,
            "lost_batches": rank_row.lost_batches,
        })
    return rows


RANKS_PAGE = 512  # ranks per answer of /api/v1/runs/{id}/ranks unless `limit` says
MAX_RANKS_PAGE = 4096


def rank_count(session: Session, run_id: str) -> int:
    """The ranks that sent the run a batch: counted on the primary key's index."""
    return session.scalar(select(func.count()).select_from(RunRank)
                          .where(RunRank.run_id == run_id))


def rank_page(session: Session, run_id: str, after: int, limit: int
              ) -> tuple[list[RunRank], int | None]:
    """The rank rows numbered above `after`, lowest first, at most `limit` (one keyset
    read on the primary key, whatever the number of ranks), and the `after` of the next
    page (None: none is left)."""
    rows = list(session.scalars(select(RunRank).where(RunRank.run_id == run_id,
                                                      RunRank.rank > after)
                                .order_by(RunRank.rank).limit(limit + 1)))
    if len(rows) > limit:
        return rows[:limit], rows[limit - 1].rank
    return rows, None


MAX_OVERLAID_RANKS = 8  # lines per chart of the run page when no rank is picked
PANEL_ROWS = 32  # rows of the run page's ranks panel: the rest are in /api/v1/runs/{id}/ranks
SLOWEST_SHOWN = 8  # of them, at most this many only for being the slowest


def panel_rank_rows(session: Session, run_id: str, limit: int = PANEL_ROWS) -> list[RunRank]:
    """The rank rows the run page shows, lowest numbered first: the lead (lowest) rank,
    then the ranks whose skipped steps or loss scale differ from the lead's or that have
    an open finding, then the SLOWEST_SHOWN slowest by `step_ms_median`, then the lowest
    numbered; `limit` in all. Two reads (the lead, then the pick by ORDER BY/LIMIT in
    SQL) fetching at most `limit` + 1 rows, whatever the number of ranks."""
    lead = lead_rank(session, run_id)
    if lead is None:
        return []
    differs = or_(RunRank.skipped != lead.skipped,
                  RunRank.loss_scale.is_distinct_from(lead.loss_scale),
                  RunRank.rank.in_(select(Finding.rank).where(Finding.run_id == run_id,
                                                              Finding.status == "open")))
    ranked = select(
        RunRank.rank,
        case((RunRank.rank == lead.rank, 0), (differs, 1), else_=2).label("kind"),
        func.row_number().over(order_by=(RunRank.step_ms_median.desc().nulls_last(),
                                         RunRank.rank)).label("slow"),
    ).where(RunRank.run_id == run_id).subquery()
    kind = case((ranked.c.kind < 2, ranked.c.kind), (ranked.c.slow <= SLOWEST_SHOWN, 2),
                else_=3)
    rows = session.scalars(
        select(RunRank).join(ranked, RunRank.rank == ranked.c.rank)
        .where(RunRank.run_id == run_id)
        .order_by(kind, case((kind < 3, ranked.c.slow), else_=0), RunRank.rank).limit(limit))
    return sorted(rows, key=lambda r: r.rank)


def overlaid_ranks(panel: list[dict], n_ranks: int, limit: int = MAX_OVERLAID_RANKS
                   ) -> list[int] | None:
    """The ranks whose lines the run page draws when no rank is picked: every rank (None)
    up to `limit` ranks; past that the lead rank, then those whose skipped steps or loss
    scale differ from the lead's (the panel's warnings), then the slowest, then the lowest
    numbered, `limit` in all, in rank order. So the page reads `limit` ranks' steps
    whatever the run's number of ranks. `panel`: `ranks_panel`'s rows (of
    `panel_rank_rows`), lowest rank first; `n_ranks`: the run's ranks."""
    if n_ranks <= limit:
        return None
    lead = panel[0]
    differ = [r for r in panel[1:] if (r["skipped"], r["loss_scale"])
              != (lead["skipped"], lead["loss_scale"])]
    slowest = sorted((r for r in panel[1:] if r["step_ms_median"] is not None),
                     key=lambda r: -r["step_ms_median"])
    picked: list[int] = []
    for row in (lead, *differ, *slowest, *panel[1:]):
        if row["rank"] not in picked:
            picked.append(row["rank"])
        if len(picked) == limit:
            break
    return sorted(picked)
