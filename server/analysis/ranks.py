"""Findings that only show when ranks are compared on the same steps.

- scaler disagreement: every rank's GradScaler should hold the same scale and skip the
  same steps (the grads they check are all-reduced); a rank that differs from rank 0
  has a loop bug (its own init scale, an extra `update()`, a scaler not stepped).
- first non-finite rank: a rank whose forward pass (input, a layer's output or the loss)
  went inf/NaN on a step where other ranks stayed finite: a bad data shard on that rank.
  Under DDP the all-reduce then spreads the inf to every rank's grads, so the per-rank
  findings blame every rank; this one names where it began.
- straggler: a rank consistently slower in the work that is its own (outside the phases
  where ranks wait for each other), which holds every other rank back.

Pure functions of each rank's steps over a common window; the service feeds them.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ampwatch.server.analysis.causes import Cause
from ampwatch.server.analysis.draft import Detection, FindingDraft, recent_steps
from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.analysis.localize import NO_LAYER
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.analysis.window import Window
from ampwatch.server.store.series import StepSeries

KIND = FindingKind.RANKS
COVERS = (f"{KIND}:",)


def _on(series: StepSeries, steps: np.ndarray) -> np.ndarray:
    return np.searchsorted(series.steps, steps)


def common_steps(parts: dict[int, StepSeries]) -> np.ndarray:
    steps = None
    for series in parts.values():
        steps = series.steps if steps is None else np.intersect1d(steps, series.steps)
    return np.zeros(0, dtype=np.int64) if steps is None else steps


def _scaler_disagreement(parts: dict[int, StepSeries], steps: np.ndarray
                               ) -> dict[int, list[FindingDraft]]:
    """Per rank other than the reference (the lowest), the steps where its loss scale or
    skip flag differs from the reference's."""
    drafts: dict[int, list[FindingDraft]] = {}
    if len(parts) < 2 or not steps.size:
        return drafts
    reference = min(parts)
    ref = parts[reference]
    ref_rows = _on(ref, steps)
    ref_scale, ref_skip = ref.column("loss_scale")[ref_rows], ref.skipped[ref_rows]
    for rank, series in parts.items():
        if rank == reference:
            continue
        rows = _on(series, steps)
        scale, skip = series.column("loss_scale")[rows], series.skipped[rows]
        both = ~np.isnan(scale) & ~np.isnan(ref_scale)
        scale_differs = both & (scale != ref_scale)
        skip_differs = skip != ref_skip
        bad = np.flatnonzero(scale_differs | skip_differs)
        if not bad.size:
            continue
        first = int(bad[0])
        step = int(steps[first])
        what = []
        if scale_differs[first]:
            what.append(f"loss scale {scale[first]:g} against {ref_scale[first]:g}")
        if skip_differs[first]:
            what.append(f"{'skipped' if skip[first] else 'stepped'} where rank {reference} "
                        f"{'skipped' if ref_skip[first] else 'stepped'}")
        drafts[rank] = [FindingDraft(
            kind=KIND, code="scaler_disagreement", key=f"{KIND}:scaler_disagreement",
            severity="warning",
            message=(f"Step {step}: rank {rank}'s GradScaler disagrees with rank "
                     f"{reference}'s ({'; '.join(what)}), on {bad.size} of {steps.size} "
                     f"steps compared. Every rank should share one scale: give each rank's "
                     f"scaler the same settings and call scaler.step/update exactly once per "
                     f"optimizer step on every rank."),
            step=step, last_step=int(steps[bad[-1]]),
            evidence={"check": "scaler_disagreement", "reference_rank": reference,
                      "loss_scale": float(scale[first]),
                      "reference_loss_scale": float(ref_scale[first]),
                      "skipped": bool(skip[first]), "reference_skipped": bool(ref_skip[first]),
                      "steps": recent_steps(steps[bad], 20)},
            occurrences=steps[bad])]
    return drafts


def _first_nonfinite_rank(peers: Mapping[int, Window], steps: np.ndarray,
                          settings: AnalysisSettings) -> dict[int, list[FindingDraft]]:
    """Per rank, the steps where its forward went inf/NaN while another rank's did not;
    the finding names the first such step and the first layer (forward order) whose
    output was inf/NaN there, when activations were recorded for that step."""
    drafts: dict[int, list[FindingDraft]] = {}
    if len(peers) < 2 or not steps.size:
        return drafts
    bad_by_rank, layer_by_rank, input_by_rank = {}, {}, {}
    for rank, peer in peers.items():
        rows = _on(peer.series, steps)
        loc = peer.loc
        forward_bad = (loc.input_nonfinite | loc.loss_nonfinite
                       | (loc.forward_layer != NO_LAYER))[rows]
        bad_by_rank[rank] = forward_bad
        layer_by_rank[rank] = loc.forward_layer[rows]
        input_by_rank[rank] = loc.input_nonfinite[rows]
    stacked = np.array([bad_by_rank[r] for r in sorted(peers)])
    some_clean = ~stacked.all(axis=0)
    last = int(steps[-1])
    for rank in sorted(peers):
        alone = np.flatnonzero(bad_by_rank[rank] & some_clean)
        if not alone.size:
            continue
        first = int(alone[0])
        step = int(steps[first])
        layer_index = int(layer_by_rank[rank][first])
        layer = None if layer_index == NO_LAYER else peers[rank].run.layer_name(layer_index)
        clean = [r for r in sorted(peers) if not bad_by_rank[r][first]]
        # the cause as the nonfinite finding names it: both group into one incident
        cause = (Cause.NONFINITE_INPUT if input_by_rank[rank][first] else
                 Cause.FORWARD_OVERFLOW if layer else Cause.NONFINITE_LOSS)
        where = (f"layer {layer!r} is the first whose output is inf/NaN" if layer else
                 "its input or loss is inf/NaN")
        drafts[rank] = [FindingDraft(
            kind=KIND, code="first_nonfinite_rank", key=f"{KIND}:first_nonfinite_rank",
            severity="warning", layer=layer,
            message=(f"Step {step}: rank {rank}'s forward went inf/NaN first ({where}) while "
                     f"rank{'s' if len(clean) > 1 else ''} {', '.join(map(str, clean))} "
                     f"stayed finite: the batch or data shard rank {rank} read is the likely "
                     f"cause; check that rank's input (torch.isfinite) before the forward."),
            step=step, last_step=int(steps[alone[-1]]),
            evidence={"check": "first_nonfinite_rank", "rank": rank, "layer": layer,
                      "cause": cause, "clean_ranks": clean,
                      "steps": recent_steps(steps[alone], settings.evidence_steps)},
            occurrences=steps[alone],
            active=last - int(steps[alone[-1]]) < settings.nonfinite_resolve_steps)]
    return drafts


def own_time_ms(series: StepSeries, rows: np.ndarray, parallelism: str | None) -> np.ndarray:
    """Per step, the time a rank spent on work of its own: the step minus the phases in
    which ranks wait for each other (backward's gradient all-reduce and the optimizer
    under DDP; also the forward's all-gathers under FSDP and tensor parallelism).
    NaN where the step time is missing."""
    def phase(name: str) -> np.ndarray:
        return np.nan_to_num(series.column(name)[rows], nan=0.0)

    own = series.column("t_step_ms")[rows] - phase("t_backward_ms") - phase("t_optimizer_ms")
    if parallelism != "ddp":
        own = own - phase("t_forward_ms")
    return own


def _straggler(parts: dict[int, StepSeries], steps: np.ndarray, parallelism: str | None,
                     settings: AnalysisSettings) -> dict[int, list[FindingDraft]]:
    """A rank whose own time is the slowest on most compared steps and whose median
    exceeds the other ranks' median by `straggler_factor` and `straggler_min_ms`."""
    drafts: dict[int, list[FindingDraft]] = {}
    if len(parts) < 2 or not steps.size:
        return drafts
    ranks = sorted(parts)
    own = np.array([own_time_ms(parts[r], _on(parts[r], steps), parallelism) for r in ranks])
    timed = ~np.isnan(own).any(axis=0)
    own, timed_steps = own[:, timed], steps[timed]
    if own.shape[1] < settings.straggler_min_steps:
        return drafts
    slowest = own.argmax(axis=0)
    for i, rank in enumerate(ranks):
        others = np.delete(own, i, axis=0)
        mine, theirs = float(np.median(own[i])), float(np.median(others))
        share = float((slowest == i).mean())
        if share < settings.straggler_share or mine - theirs < settings.straggler_min_ms or \
                mine < settings.straggler_factor * theirs:
            continue
        drafts[rank] = [FindingDraft(
            kind=KIND, code="straggler", key=f"{KIND}:straggler", severity="warning",
            message=(f"Rank {rank} is a straggler: its own work takes {mine:.1f} ms a step "
                     f"(median) against {theirs:.1f} ms on the other ranks, the slowest on "
                     f"{share:.0%} of the last {timed_steps.size} steps, and every rank waits "
                     f"for it. Look at that rank's data loading and host work, or its "
                     f"device."),
            step=int(timed_steps[0]), last_step=int(timed_steps[-1]),
            evidence={"check": "straggler", "own_ms_median": mine, "others_ms_median": theirs,
                      "slowest_share": share, "steps": int(timed_steps.size)},
            occurrences=timed_steps[slowest == i])]
    return drafts


def detect_rank_findings(window: Window, settings: AnalysisSettings) -> Detection:
    """Every cross-rank finding over the steps all of `window.peers` hold; each draft
    names the rank it lives on (the rank it is about), and every rank's findings of this
    kind are covered."""
    parts = {rank: peer.series for rank, peer in window.peers.items()}
    steps = common_steps(parts)
    drafts: list[FindingDraft] = []
    for found in (_scaler_disagreement(parts, steps),
                  _first_nonfinite_rank(window.peers, steps, settings),
                  _straggler(parts, steps, window.parallelism, settings)):
        for rank, items in found.items():
            for draft in items:
                draft.rank = rank
            drafts += items
    return Detection(drafts=drafts, covers=COVERS)
