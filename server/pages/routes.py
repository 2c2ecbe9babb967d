"""HTML routes of the dashboard. Each page answers in three forms from one twin:
HTML (default), `?format=json` (the JSON twin) and `?format=update` (new figures and
panels that a live page swaps in without reloading)."""

from __future__ import annotations

import re
from functools import partial
from typing import Annotated, Literal
from urllib.parse import parse_qs, quote, urlencode

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from plotly.io.json import to_json_plotly
from pydantic import ValidationError

from ampwatch.server.deps import NoteId, ProjectPath, RunIdPath, SessionDep, SettingsDep
from ampwatch.server.errors import InvalidInput, NotFound
from ampwatch.server.fields import NO_NUL
from ampwatch.server.pages import (
    api_docs,
    assets,
    auth,
    cards,
    compare,
    config,
    fp8,
    layer,
    projects,
    views,
)
from ampwatch.server.pages.figures import (
    CHART_HEIGHT,
    DASHES,
    base_figure,
    colour,
    mark_step,
    note,
)
from ampwatch.server.pages.rendering import render_fragment, render_page
from ampwatch.server.pages.time_axis import XAxis
from ampwatch.server.responses import WireJSONResponse
from ampwatch.server.schemas.common import MAX_STEP, Health
from ampwatch.server.schemas.notes import NoteCreate
from ampwatch.server.services.notes import add_note, delete_note
from ampwatch.server.services.runs import RUN_SORTS

LIVE_POLL_MS = 3000
# a run gone quiet (an eval, a checkpoint, a killed process) is asked less often: it may resume
QUIET_POLL_MS = 10_000

router = APIRouter(include_in_schema=False)
router.include_router(auth.router)
router.include_router(assets.router)
pages = APIRouter(include_in_schema=False, dependencies=[Depends(auth.require_login)])

Format = Annotated[Literal["html", "json", "update"],
                   Query(alias="format", description="json: the page's JSON twin")]
Start = Annotated[int | None, Query(ge=0, le=MAX_STEP)]
End = Annotated[int | None, Query(ge=0, le=MAX_STEP)]
RUN_SORT = "^-?(" + "|".join(RUN_SORTS) + ")$"  # a column of the runs list, "-": descending
XAxisQuery = Annotated[XAxis, Query(alias="x", description="the step charts' x axis: step, "
                                   "relative (time since the first step) or wall time")]
Mark = Annotated[int | None, Query(ge=0, le=MAX_STEP,
                                   description="a step to draw a line at on every chart")]


def step_range(start: Start = None, end: End = None) -> views.StepRange:
    """?start= and ?end=, the second not before the first (a reversed range is a typo,
    not an empty page)."""
    if start is not None and end is not None and end < start:
        raise RequestValidationError([{
            "type": "value_error", "loc": ("query", "end"), "input": end,
            "msg": f"the range ends ({end}) before it starts ({start})"}])
    return views.StepRange(start, end)


StepsQuery = Annotated[views.StepRange, Depends(step_range)]


def _not_found(request: Request, exc: NotFound) -> HTMLResponse:
    return render_page(request, "error.html", status_code=404, message=exc.message)


def wants_page(request: Request) -> bool:
    """A browser asking for a page (not the API, not a page's JSON or update twin)."""
    return (not request.url.path.startswith(("/api/", "/metrics", "/static/"))
            and request.query_params.get("format", "html") == "html"
            and "text/html" in request.headers.get("accept", ""))


def invalid_page(request: Request, errors: list | str, status_code: int = 400) -> HTMLResponse:
    """A page's query a person mistyped (?start=abc, ?page=0): said in words, with a way
    back, rather than the API's JSON 422 (a form's fields: `status_code` 422)."""
    problems = errors if isinstance(errors, list) else [errors]
    return render_page(request, "error.html", status_code=status_code, title="Not a valid address",
                       message="This address asks for something the page cannot show: "
                       + "; ".join(_error_words(p) for p in problems) + ".",
                       back=request.url.path)


def _error_words(problem: object) -> str:
    if isinstance(problem, dict):
        where = ".".join(str(p) for p in problem.get("loc", [])[1:]) or "the address"
        return f"{where}: {problem.get('msg', 'not valid')}"
    return str(problem)


def poll_ms(run: dict) -> int | None:
    """How often a page of `run` asks for news: often while it reports, has not sent its
    first batch yet or has findings being judged; less often once it went quiet (it may
    resume); never once it finished (detached) and its analysis is done."""
    waiting = run["last_seen_at"] is None and not run["finished"]
    if run["live"] or waiting or run.get("analysis_pending"):
        return LIVE_POLL_MS
    return None if run["finished"] else QUIET_POLL_MS


def _soonest(polls: list[int | None]) -> int | None:
    return min((p for p in polls if p is not None), default=None)


def _update(poll: int | None, figures: dict, panels: dict[str, str]) -> Response:
    body = {"live": poll is not None, "poll_ms": poll,
            "figures": {k: f.to_plotly_json() for k, f in figures.items()}, "panels": panels}
    return Response(to_json_plotly(body), media_type="application/json")


def _query_with(request: Request, name: str, value: str) -> str:
    """This page's query string with `name` set to `value` (and no `format`)."""
    query = [(k, v) for k, v in request.query_params.multi_items() if k not in (name, "format")]
    return urlencode([*query, (name, value)])


def _page_href(request: Request, page: int) -> str:
    """This page with another `page` (the layers page's pager and links)."""
    return f"?{_query_with(request, 'page', str(page))}"


def _live_url(request: Request) -> str:
    return f"{request.url.path}?{_query_with(request, 'format', 'update')}"


def _past_end(figures: dict, run: dict, start: int | None) -> dict:
    """Charts of a range that starts after the run's last step say so, rather than that
    nothing was recorded."""
    last = run.get("last_step")
    if start is None or last is None or start <= last:
        return figures
    return {name: note(base_figure(fig.layout.get("height") or CHART_HEIGHT),
                       f"past the run's end: its last step is {last:,}")
            for name, fig in figures.items()}


def _run_tab(request: Request, output: str, template: str, tab: str, figures: dict,
             context: dict, fragments: dict[str, str]) -> Response:
    """A run page (overview or layers) whole, or as the update a live page polls for:
    its figures and its panels (the run's stats plus the tab's own `fragments`)."""
    figures = _past_end(figures, context["run"], context.get("start"))
    panels = {"run-stats": render_fragment("_run_stats.html", **context),
              "run-status": render_fragment("_run_status.html", **context)}
    panels |= {panel: render_fragment(name, **context) for panel, name in fragments.items()}
    poll = poll_ms(context["run"])
    if output == "update":
        return _update(poll, figures, panels)
    return render_page(request, template, tab=tab, panels=panels, charts=list(figures),
                       figures=figures, live_url=_live_url(request) if poll else None,
                       poll_ms=poll, **context)


@pages.get("/", response_class=HTMLResponse)
def runs_page(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    project: Annotated[str | None, Query(max_length=256, pattern=NO_NUL)] = None,
    name: Annotated[str | None, Query(max_length=256, pattern=NO_NUL)] = None,
    status: Annotated[Health | Literal[""] | None, Query()] = None,
    tag: Annotated[str | None, Query(max_length=256, pattern=NO_NUL)] = None,
    sort: Annotated[str, Query(pattern=RUN_SORT)] = "-created",
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
    output: Format = "html",
) -> Response:
    """Runs, newest first (or sorted by a column), with health badges; filter by project,
    tag, status and name."""
    twin = views.runs_twin(session, settings, project=project or None, name=name or None,
                           status=status or None, tag=tag or None, sort=sort, offset=offset)
    if output == "json":
        return WireJSONResponse(twin)
    filters = {"project": project or "", "name": name or "", "status": status or "",
               "tag": tag or ""}
    page_query = {k: v for k, v in filters.items() if v}
    context = {"twin": twin, "filters": filters, "sort": sort,
               "page_query": page_query | ({"sort": sort} if sort != "-created" else {})}
    # the list always polls: a new run may appear at any time
    poll = _soonest([QUIET_POLL_MS, *(poll_ms(run) for run in twin["items"])])
    if output == "update":
        return _update(poll, {}, {"runs-table": render_fragment("_runs_table.html",
                                                                **context)})
    return render_page(request, "runs.html", live_url=_live_url(request), poll_ms=poll,
                       **context)


def _rank(value: str | None) -> int | None:
    return None if value in (None, "", "all") else int(value)


RankChoice = Annotated[str | None, Query(pattern=r"^(all|\d{1,7})?$",
                                         description="a rank, or all ranks overlaid")]


@pages.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(
    request: Request,
    run_id: RunIdPath,
    session: SessionDep,
    settings: SettingsDep,
    steps: StepsQuery,
    rank: RankChoice = None,
    mark: Mark = None,
    x_axis: XAxisQuery = "step",
    output: Format = "html",
) -> Response:
    """A run's overview: scaler, grad norm, loss, lr, timings, memory and findings."""
    try:
        twin = views.overview_twin(session, settings, run_id, rank=_rank(rank),
                                   steps=steps, x_axis=x_axis)
    except NotFound as exc:
        return _not_found(request, exc)
    if output == "json":
        return WireJSONResponse(twin)
    figures, absent = views.overview_charts(twin, mark, x_axis)
    context = {"twin": twin, "run": twin["run"], "cards": cards.incident_panel(twin),
               "absent": absent,
               "start": steps.start, "end": steps.end, "x_axis": x_axis,
               "config": config.flat_config(twin["run"]["config"])}
    return _run_tab(request, output, "run.html", "overview", figures, context,
                    {"findings": "_findings.html", "steps-footer": "_steps_footer.html",
                     **({"ranks-panel": "_ranks_panel.html"} if twin["ranks"] else {})})


INCIDENT_ID = re.compile(r"[0-9]{1,10}")  # ASCII digits; NoteCreate bounds the value


@pages.post("/runs/{run_id}/notes")
async def note_form(request: Request, run_id: RunIdPath, session: SessionDep) -> Response:
    """The run page's note form (and each card's "handled" button): stored as the API's
    POST /api/v1/runs/{id}/notes would, then back to the run page."""
    fields = parse_qs((await request.body())[:auth.MAX_FORM_BYTES].decode("utf-8", "replace"))
    incident = fields.get("incident", [""])[0]
    if incident and not INCIDENT_ID.fullmatch(incident):  # isdigit() took "²" and 5,000 digits
        return invalid_page(request, "incident must be an incident's id", status_code=422)
    try:
        body = NoteCreate(text=fields.get("text", [""])[0],
                          incident=int(incident) if incident else None,
                          handled=fields.get("handled", [""])[0] == "1")
        add_note(session, run_id, body)
    except NotFound as exc:
        return _not_found(request, exc)
    except (ValidationError, InvalidInput) as exc:
        return invalid_page(request, str(exc).splitlines()[0], status_code=422)
    return RedirectResponse(f"/runs/{quote(run_id)}#findings", status_code=303)


@pages.post("/runs/{run_id}/notes/{note_id}/delete")
def delete_note_form(request: Request, run_id: RunIdPath, note_id: NoteId,
                     session: SessionDep) -> Response:
    """A note's "remove" button (an incident's "handled" undone)."""
    try:
        delete_note(session, run_id, note_id)
    except NotFound as exc:
        return _not_found(request, exc)
    return RedirectResponse(f"/runs/{quote(run_id)}#findings", status_code=303)


@pages.get("/runs/{run_id}/layers", response_class=HTMLResponse)
def layers_page(
    request: Request,
    run_id: RunIdPath,
    session: SessionDep,
    settings: SettingsDep,
    steps: StepsQuery,
    rank: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
    page: Annotated[int, Query(ge=1, le=1_000_000, description="a page of "
                               f"{views.LAYERS_PER_PAGE} layers in forward order")] = 1,
    mark: Mark = None,
    output: Format = "html",
) -> Response:
    """Per-layer heatmaps, the misaligned-layer table and the precision map, a page of
    layers at a time (a run may have tens of thousands)."""
    try:
        twin = views.layers_twin(session, settings, run_id, rank=rank,
                                 steps=steps, page=page)
    except NotFound as exc:
        return _not_found(request, exc)
    if output == "json":
        return WireJSONResponse(twin)
    figures = views.layers_figures(twin, mark)
    context = {"twin": twin, "run": twin["run"], "start": steps.start, "end": steps.end,
               "paging": twin["page"], "page_href": partial(_page_href, request),
               "misaligned": views.misaligned_rows(twin),
               "precision": views.precision_rows(twin)}
    return _run_tab(request, output, "layers.html", "layers", figures, context,
                    {"layer-tables": "_layer_tables.html"})


@pages.get("/runs/{run_id}/layers/{index}", response_class=HTMLResponse)
def layer_page(
    request: Request,
    run_id: RunIdPath,
    index: Annotated[int, Path(ge=0, le=1_000_000)],
    session: SessionDep,
    settings: SettingsDep,
    steps: StepsQuery,
    rank: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
    mark: Mark = None,
    output: Format = "html",
) -> Response:
    """One layer: its grad norm, output abs-max against its dtype's maximum, share of
    zero grad elements, and the findings that name it."""
    try:
        twin = layer.layer_twin(session, settings, run_id, index, rank=rank,
                                steps=steps)
    except NotFound as exc:
        return _not_found(request, exc)
    if output == "json":
        return WireJSONResponse(twin)
    figures = {name: mark_step(fig, mark) for name, fig in layer.layer_figures(twin).items()}
    context = {"twin": twin, "run": twin["run"], "start": steps.start, "end": steps.end}
    return _run_tab(request, output, "layer.html", "layers", figures, context,
                    {"layer-findings": "_layer_findings.html"})


@pages.get("/runs/{run_id}/fp8", response_class=HTMLResponse)
def fp8_page(
    request: Request,
    run_id: RunIdPath,
    session: SessionDep,
    settings: SettingsDep,
    steps: StepsQuery,
    rank: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
    output: Format = "html",
) -> Response:
    """FP8 layers: shares of elements saturated and flushed to zero, recipes and scales."""
    try:
        twin = fp8.fp8_page_twin(session, settings, run_id, rank=rank,
                                 steps=steps)
    except NotFound as exc:
        return _not_found(request, exc)
    if output == "json":
        return WireJSONResponse(twin)
    context = {"twin": twin, "run": twin["run"], "start": steps.start, "end": steps.end}
    return _run_tab(request, output, "fp8.html", "fp8", fp8.fp8_figures(twin), context,
                    {"fp8-layers": "_fp8_layers.html"})


@pages.get("/compare", response_class=HTMLResponse)
def compare_page(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    run: Annotated[list[str], Query(max_length=compare.MAX_COMPARED,
                                    description="run ids, one per parameter")] = [],  # noqa: B006
    runs: Annotated[str | None, Query(max_length=4096, include_in_schema=False,
                                      description="old form: ids, comma-separated")] = None,
    x_axis: XAxisQuery = "step",
    output: Format = "html",
) -> Response:
    """Loss, learning rate, loss scale, grad norm, skip rate and step time of several
    runs overlaid.
    `?run=a&run=b` is the one form; the old `?runs=a,b` redirects to it."""
    if runs is not None:
        ids = [*run, *(r.strip() for r in runs.split(",") if r.strip())]
        query = [("run", r) for r in dict.fromkeys(ids)]
        query += [(k, v) for k, v in request.query_params.multi_items()
                  if k not in ("run", "runs")]
        return RedirectResponse(f"/compare?{urlencode(query)}", status_code=308)
    run_ids = list(dict.fromkeys(r.strip() for r in run if r.strip()))
    twin = compare.compare_twin(session, settings, run_ids, x_axis)
    if output == "json":
        return WireJSONResponse(twin)
    lines = compare.compare_lines(twin)
    figures, absent = compare.compare_charts(twin, lines, x_axis) if twin["runs"] else ({}, {})
    poll = _soonest([poll_ms(r) for r in twin["runs"]])
    if output == "update":
        return _update(poll, figures, {})
    recent = views.runs_twin(session, settings, project=None, name=None, status=None,
                             offset=0)["items"]
    n = len(twin["runs"])
    return render_page(request, "compare.html", twin=twin, run_ids=run_ids, recent=recent,
                       notes=compare.coinciding(lines), loss_log=compare.wide_losses(lines),
                       config_diff=config.config_diff(twin["runs"]),
                       dashes=[DASHES[i % len(DASHES)] for i in range(n)],
                       colours=[colour(i) for i in range(n)], x_axis=x_axis,
                       figures=figures, charts=list(figures), absent=absent,
                       live_url=_live_url(request) if poll else None,
                       poll_ms=poll)


@pages.get("/projects/{project:path}", response_class=HTMLResponse)
def project_page(
    request: Request,
    project: ProjectPath,
    session: SessionDep,
    tag: Annotated[str | None, Query(max_length=256, pattern=NO_NUL)] = None,
    output: Format = "html",
) -> Response:
    """Every run of a project with its outcome, the settings that separate the runs that
    went bad, and each top setting charted against the outcomes."""
    try:
        twin = projects.project_twin(session, project, tag=tag or None)
    except NotFound as exc:
        return _not_found(request, exc)
    if output == "json":
        return WireJSONResponse(twin)
    figures = projects.project_figures(twin)
    if output == "update":
        return _update(None, figures, {})
    return render_page(request, "project.html", twin=twin, figures=figures,
                       tag=tag or "")


pages.include_router(api_docs.router)
router.include_router(pages)
