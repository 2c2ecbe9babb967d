"""What each page shows: its JSON twin, built from the API's query functions, and the
figures drawn from that twin. Routes (server/pages/routes.py) only pick the format."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import quote

from sqlalchemy import Row, select
from sqlalchemy.orm import Session

from ampwatch.server.analysis.causes import Cause
from ampwatch.server.analysis.draft import SEVERITY_RANK
from ampwatch.server.analysis.kinds import FindingKind, Section, kinds_in
from ampwatch.server.analysis.localize import DTYPE_MAX, dtype_word
from ampwatch.server.findings.queries import list_findings, list_incidents
from ampwatch.server.models import Run, RunRank
from ampwatch.server.pages import figures, heatmaps, scale_chart, spikes, time_axis
from ampwatch.server.pages.columns import LayerMatrix, StepColumns, by_rank
from ampwatch.server.pages.heatmaps import layer_title
from ampwatch.server.pages.plot import Figure
from ampwatch.server.services.bundles import list_bundles, public_bundle
from ampwatch.server.services.notes import run_notes
from ampwatch.server.services.ranks import overlaid_ranks, panel_rank_rows, ranks_panel
from ampwatch.server.services.runs import get_run, list_runs, public_run
from ampwatch.server.services.series import (
    layers_query,
    matrix_query,
    steps_query,
    with_elapsed,
)
from ampwatch.server.settings import Settings
from ampwatch.server.store.fp8_samples import cast_formats, has_fp8_layers
from ampwatch.server.store.storage import layer_rows

MAX_POINTS = 2000  # per chart line set: what a laptop-wide chart can show
BUCKETS = 1000  # heatmap columns
RUNS_PER_PAGE = 25
MAX_FINDINGS = 200
LAYER_FINDING_KINDS = kinds_in(Section.LAYERS)
LAYERS_PER_PAGE = 200  # rows of the layers page's heatmaps and table
# non-finite causes that name the offending layer, the forward pass's first
FORWARD_CAUSES = (Cause.FORWARD_OVERFLOW, Cause.ABSORBED_OVERFLOW)
GRAD_CAUSES = (Cause.GRAD_OVERFLOW,)


@dataclass(frozen=True)
class StepRange:
    start: int | None = None
    end: int | None = None

    def query(self) -> dict:
        return {"start": self.start, "end": self.end}


def runs_twin(session: Session, settings: Settings, *, project: str | None, name: str | None,
              status: str | None, offset: int, tag: str | None = None,
              sort: str = "-created") -> dict:
    """/ : the runs list, newest first (or by `sort`), and the projects and tags to filter
    by."""
    runs = list_runs(session, settings, project=project, name=name, status=status, tag=tag,
                     sort=sort, limit=RUNS_PER_PAGE, offset=offset)
    return {**runs.model_dump(mode="json"), "projects": projects(session),
            "tags": tags(session)}


def projects(session: Session) -> list[str]:
    return list(session.scalars(select(Run.project).distinct().order_by(Run.project)))


def tags(session: Session) -> list[str]:
    """Every tag of every run, sorted (read whole: a server holds thousands of runs, not
    millions)."""
    return sorted({str(t) for run_tags in session.scalars(select(Run.tags))
                   for t in run_tags or []})


def page_run(session: Session, run_id: str, settings: Settings,
             ranks: list[RunRank] | None = None) -> dict:
    """The run as every page of it shows it: its public fields (`ranks`: the ranks panel's,
    at most PANEL_ROWS; `n_ranks` counts them all) and whether it has FP8 layers (the FP8
    tab). `ranks`: those rank rows, when already read."""
    ranks = panel_rank_rows(session, run_id) if ranks is None else ranks
    run = public_run(session, get_run(session, run_id), settings,
                     ranks).model_dump(mode="json")
    run["has_fp8"] = has_fp8_layers(session, run_id)  # the FP8 tab is shown for these
    return run


def findings_of(session: Session, run_id: str, kind: str | None = None) -> dict:
    """A run's findings: open ones first (most severe first), then resolved ones."""
    found = {status: list_findings(session, run_id=run_id, kind=kind, status=status,
                                   limit=MAX_FINDINGS).model_dump(mode="json")["items"]
             for status in ("open", "resolved")}
    return {"open": found["open"], "resolved": found["resolved"]}


def named_layers(session: Session, run_id: str, findings: dict) -> dict[str, int]:
    """Index of each layer the findings name (their links open its own view)."""
    named = {f["layer"] for items in findings.values() for f in items if f["layer"]}
    return {row.name: row.index for row in layer_rows(session, run_id) if row.name in named}


def overview_twin(session: Session, settings: Settings, run_id: str, *, rank: int | None,
                  steps: StepRange, x_axis: time_axis.XAxis = "step") -> dict:
    """/runs/{id}: the run, its downsampled steps (the picked rank, else all ranks up to
    MAX_OVERLAID_RANKS, else the ones `overlaid_ranks` picks), the ranks panel (at most
    PANEL_ROWS ranks, `panel_rank_rows`), its findings and its incidents (the findings
    grouped by root cause). Neither its reads nor the rows they fetch grow with ranks.
    On a time `x_axis`, each step also has its `elapsed_ms` (`series.with_elapsed`)."""
    run = get_run(session, run_id)
    rank_rows = panel_rank_rows(session, run_id)  # every rank when there are few
    public = page_run(session, run_id, settings, rank_rows)
    findings = findings_of(session, run_id)
    panel = ranks_panel(session, run, rank_rows)
    overlaid = overlaid_ranks(panel, public["n_ranks"]) if rank is None else None
    drawn = steps_query(session, run, rank=rank, ranks=overlaid, rank_rows=rank_rows,
                        max_points=MAX_POINTS, **steps.query())
    return {
        "run": public,
        "rank": rank,
        "ranks": panel if public["n_ranks"] > 1 else [],
        "overlaid_ranks": overlaid,
        "steps": drawn if x_axis == "step" else with_elapsed(session, run, drawn),
        "findings": findings,
        "incidents": list_incidents(session, run_id).model_dump(mode="json")["items"],
        "layer_index": named_layers(session, run_id, findings),
        "bundles": [public_bundle(b).model_dump(mode="json")
                    for b in list_bundles(session, run_id)],
        "notes": [n.model_dump(mode="json") for n in run_notes(session, run_id)],
    }


def has_scaler(run: dict, lines: list[StepColumns]) -> bool:
    """Whether the run uses a GradScaler: it reported one or a scale. A skipped step
    alone is no sign of one: the step guard (docs/guard.md) skips bf16 steps."""
    return bool((run.get("environment") or {}).get("scaler") or run.get("loss_scale")
                or any(line.present["loss_scale"].any() for line in lines))


def skips_steps(run: dict, lines: list[StepColumns]) -> bool:
    """Whether the run can skip a step: a GradScaler, or a step the guard left out."""
    return has_scaler(run, lines) or bool(run.get("skipped")) \
        or any(line.skipped.any() for line in lines)


def precision(runs: list[dict]) -> str:
    """What the runs train in, for the line that says why a chart is left out: "bf16"
    when they share an autocast dtype, else "no GradScaler"."""
    dtypes = {(run.get("environment") or {}).get("autocast_dtype") for run in runs}
    return dtype_word(dtypes.pop()) if len(dtypes) == 1 and None not in dtypes \
        else "no GradScaler"


def left_out(charts: dict[str, Figure]) -> tuple[dict[str, Figure], dict[str, str]]:
    """The charts that draw something, and for each chart left out the line that says
    why (what its empty figure would have said): empty is said once, not drawn."""
    return ({name: fig for name, fig in charts.items() if fig.empty is None},
            {name: fig.empty for name, fig in charts.items() if fig.empty is not None})


def overview_figures(twin: dict, mark: int | None = None,
                     x_axis: time_axis.XAxis = "step") -> dict[str, Figure]:
    """The overview's charts, all over one step range (app.js also shares the zoom), with
    a line at step `mark` on each, drawn against `x_axis`."""
    lines = by_rank(twin["steps"])
    charts = {
        "grad_norm": figures.grad_norm_figure(lines),
        "loss": spikes.mark_spikes(figures.loss_figure(lines), twin["findings"],
                                   twin["incidents"]),
        "lr": figures.lr_figure(lines),
        "phases": figures.phase_times_figure(lines),
    }
    # what a run cannot have is left out (a bf16 run has no loss scale, a CPU run no
    # device memory); the loss scale leads where there is one: fp16's first signal
    if has_scaler(twin["run"], lines):
        charts = {"loss_scale": scale_chart.loss_scale_figure(lines, scaler=True), **charts}
    if any(line.finite("peak_mem_bytes").any() for line in lines):
        charts["memory"] = figures.peak_memory_figure(lines)
    span = figures.step_span(lines)
    started = [datetime.fromisoformat(twin["run"]["created_at"])] * len(lines)
    return {name: time_axis.retime(figures.mark_step(figures.share_x(fig, span), mark),
                                   x_axis, lines, started)
            for name, fig in charts.items()}


def overview_charts(twin: dict, mark: int | None = None, x_axis: time_axis.XAxis = "step",
                    ) -> tuple[dict[str, Figure], dict[str, str]]:
    """The overview's charts that draw something, and the line that says why each other
    is left out. While the range holds no step every chart stays (a live page fills it)."""
    charts = overview_figures(twin, mark, x_axis)
    if not twin["steps"]["items"]:
        return charts, {}
    drawn, absent = left_out(charts)
    if "loss_scale" not in charts:
        absent = {"loss_scale": f"{precision([twin['run']])}: no loss scale", **absent}
    return drawn, absent


def layer_page(layers: list[Row], page: int, named: set[str]) -> dict:
    """Page `page` (from 1; past the last is the last) of the layers in forward order:
    its layer indices in that order, and the page of each layer in `named`."""
    ordered = sorted(layers, key=lambda layer: heatmaps.forward_key(layer.index,
                                                                     layer.forward_index))
    pages = max(1, math.ceil(len(ordered) / LAYERS_PER_PAGE))
    first = (min(page, pages) - 1) * LAYERS_PER_PAGE
    return {
        "page": min(page, pages), "asked": page, "pages": pages, "per_page": LAYERS_PER_PAGE,
        "total": len(ordered),
        "first": first, "indices": [layer.index for layer in
                                    ordered[first:first + LAYERS_PER_PAGE]],
        "page_of": {layer.name: position // LAYERS_PER_PAGE + 1
                    for position, layer in enumerate(ordered) if layer.name in named},
        "index_of": {layer.name: layer.index for layer in ordered if layer.name in named},
    }


def layers_twin(session: Session, settings: Settings, run_id: str, *, rank: int,
                steps: StepRange, page: int = 1) -> dict:
    """/runs/{id}/layers: one page of the layers in forward order (LAYERS_PER_PAGE):
    their table rows with summaries and their grad-norm and activation matrices, read
    for those layers only; and the run's layer findings (misaligned layers, precision
    map, non-finite ones), with the page each named layer is on."""
    run = get_run(session, run_id)
    findings = {status: [f for f in items if f["kind"] in LAYER_FINDING_KINDS
                         or f["layer"] is not None]
                for status, items in findings_of(session, run_id).items()}
    named = {f["layer"] for items in findings.values() for f in items if f["layer"]}
    paging = layer_page(layer_rows(session, run_id), page, named)
    indices = paging["indices"]
    return {
        "run": page_run(session, run_id, settings),
        "rank": rank,
        "page": paging,
        "layers": layers_query(session, run, rank=rank, layers=indices),
        "grad_norm": matrix_query(session, run, metric="grad_norm", rank=rank,
                                  buckets=BUCKETS, layers=indices, **steps.query()),
        "act_absmax": matrix_query(session, run, metric="act_absmax", rank=rank,
                                   buckets=BUCKETS, layers=indices, **steps.query()),
        **{key: matrix_query(session, run, metric=metric, rank=rank, buckets=BUCKETS,
                             layers=indices, **steps.query())
           for key, (metric, _) in spikes.HEATMAPS.items()},
        "findings": findings,
    }


def offender_layer(twin: dict, grads: LayerMatrix, acts: LayerMatrix) -> str | None:
    """The run's first offender, over all its layers, not only the page's: the layer of
    the earliest open non-finite finding whose layer's output went non-finite (the
    analysis reads every step's first non-finite layer), else of the earliest whose
    grads did; without such a finding, the page's first layer in forward order whose
    output went non-finite, then whose grads did."""
    nonfinite = [f for f in twin["findings"]["open"] if f["kind"] == FindingKind.NONFINITE
                 and f["layer"] and f["step"] is not None]
    for causes in (FORWARD_CAUSES, GRAD_CAUSES):
        found = [f for f in nonfinite if f["evidence"].get("cause") in causes]
        if found:
            return min(found, key=lambda f: f["step"])["layer"]
    for matrix in (acts, grads):  # the twin's matrices are in forward order
        first = heatmaps.first_offender(matrix)
        if first is not None:
            return first.layer
    return None


def layers_figures(twin: dict, mark: int | None = None) -> dict[str, Figure]:
    grads = LayerMatrix.from_twin(twin["grad_norm"])
    acts = LayerMatrix.from_twin(twin["act_absmax"])
    offender = offender_layer(twin, grads, acts)
    span = heatmaps.matrix_span([grads, acts])
    titles = {item["name"]: layer_title(item) for item in twin["layers"]["items"]}
    maps = {}
    for name, matrix, quantity in (("grad_heatmap", grads, "grad norm"),
                                   ("act_heatmap", acts, "abs-max")):
        fig = heatmaps.layer_heatmap_figure(
            matrix, quantity=quantity, offender=offender, titles=titles,
            limit=dtype_limit(twin) if name == "act_heatmap" else None)
        maps[name] = figures.mark_step(figures.share_x(fig, span), mark)
        layer_links(maps[name], twin, matrix, titles)
    return {
        **maps,
        "fwd_time": heatmaps.forward_time_figure(twin["layers"], twin["page"]["indices"]),
        **spikes.spike_heatmaps(twin, span),
    }


def dtype_limit(twin: dict) -> tuple[str, float] | None:
    """The short name and largest value of the dtype the page's layers computed in, when
    one 16-bit or 8-bit dtype (the only ones whose maximum a layer's output can reach)."""
    dtypes = {item["summary"]["act_dtype"] for item in twin["layers"]["items"]} - {None}
    dtypes &= DTYPE_MAX.keys() - {"bfloat16", "float32"}
    if len(dtypes) != 1:
        return None
    dtype = dtypes.pop()
    return dtype_word(dtype), DTYPE_MAX[dtype]


def layer_links(fig: Figure, twin: dict, matrix: LayerMatrix, titles: dict[str, str]) -> None:
    """The layer view each heatmap row opens (app.js follows a click on a row): row
    labels and their links in the figure's `meta`."""
    index = {item["name"]: item["index"] for item in twin["layers"]["items"]}
    path = f"/runs/{quote(twin['run']['id'])}/layers"
    rows = [name for name in matrix.layers if name in index]
    fig.update_layout(meta={
        "layer_rows": [figures.label(titles.get(name, name)) for name in rows],
        "layer_links": [f"{path}/{index[name]}?rank={twin['rank']}" for name in rows]})


@dataclass(frozen=True)
class MisalignedRow:
    layer: str
    type: str
    dimension: str
    value: int
    padded: int
    optimal: int | None
    flops_share: float | None
    severity: str
    message: str
    page: int  # the layers page whose precision map holds the layer
    index: int | None  # the layer's index: its own view


def misaligned_rows(twin: dict) -> list[MisalignedRow]:
    """The misaligned-layer table, from the open `misaligned_layer` findings' evidence."""
    page_of = twin["page"]["page_of"]
    rows = []
    for finding in twin["findings"]["open"]:
        if finding["kind"] != FindingKind.MISALIGNED_LAYER:
            continue
        evidence = finding["evidence"]
        rows.append(MisalignedRow(
            layer=finding["layer"] or "", type=evidence.get("type", ""),
            dimension=evidence.get("dimension", ""), value=evidence.get("value"),
            padded=evidence.get("padded"), optimal=evidence.get("optimal"),
            flops_share=evidence.get("flops_share"), severity=finding["severity"],
            message=finding["message"],
            page=page_of.get(finding["layer"], twin["page"]["page"]),
            index=twin["page"]["index_of"].get(finding["layer"]),
        ))
    return sorted(rows, key=lambda r: (-(r.flops_share or 0), r.layer, r.dimension))


@dataclass(frozen=True)
class PrecisionRow:
    index: int
    name: str
    type: str
    param_count: int
    computed_in: str | None
    fp8: str | None  # an FP8 layer's casts: "input e4m3, weight e4m3, grad e5m2 (tensorwise)"
    grad_nonfinite_steps: int
    act_nonfinite_steps: int
    flags: list[dict]


def precision_rows(twin: dict) -> list[PrecisionRow]:
    """One row per layer in forward order: what it computed in, its non-finite counts
    and one flag per open incident that names it (precision map flags first): a layer
    that overflows is one flag, not one per finding of that overflow."""
    by_layer: dict[str, dict[int, list[dict]]] = {}
    for finding in twin["findings"]["open"]:
        if finding["layer"] is not None:
            incident = finding.get("incident") or -finding["id"]
            by_layer.setdefault(finding["layer"], {}).setdefault(incident, []).append(finding)
    items = {item["index"]: item for item in twin["layers"]["items"]}
    rows = []
    for index in heatmaps.forward_order(twin["layers"]):
        item = items[index]
        flags = sorted((_layer_flag(group) for group in by_layer.get(item["name"], {}).values()),
                       key=lambda f: (f["kind"] != FindingKind.PRECISION_MAP,
                                      -SEVERITY_RANK[f["severity"]]))
        rows.append(PrecisionRow(
            index=index, name=item["name"], type=item["type"],
            param_count=item["param_count"], computed_in=item["summary"]["act_dtype"],
            fp8=fp8_casts(item["attrs"]),
            grad_nonfinite_steps=item["summary"]["grad_nonfinite_steps"],
            act_nonfinite_steps=item["summary"]["act_nonfinite_steps"], flags=flags,
        ))
    return rows


def fp8_casts(attrs: dict) -> str | None:
    """What an FP8 layer's attrs (agent/fp8.py) say of its casts: the input, weight and
    grad formats (a role kept in high precision is absent) and the scaling recipe."""
    recipe = attrs.get("fp8_recipe")
    if not recipe:
        return None
    formats = [f"{role} {fmt}" for role, fmt in cast_formats(attrs).items()]
    return ", ".join(formats) + f" ({recipe})"


def _layer_flag(group: list[dict]) -> dict:
    """One incident's findings on one layer as one flag: the worst severity, named by
    the root cause when the findings share one, with every message in its tooltip."""
    worst = max(group, key=lambda f: SEVERITY_RANK[f["severity"]])
    causes = {f["evidence"].get("cause") for f in group} - {None}
    name = (causes.pop() if len(causes) == 1 and len(group) > 1 else
            worst["code"] or worst["kind"])
    dimensions = [f["evidence"]["dimension"] for f in group if f["evidence"].get("dimension")]
    if dimensions:
        name += ": " + ", ".join(dimensions)
    return {"kind": worst["kind"], "severity": worst["severity"],
            "label": name.replace("_", " "), "message": " ".join(f["message"] for f in group)}
