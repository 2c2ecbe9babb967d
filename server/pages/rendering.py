"""Jinja2 rendering for the pages: one autoescaping environment, the display filters,
and JSON that is safe inside a <script type="application/json"> tag."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import HTMLResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup
from plotly.io.json import to_json_plotly

from ampwatch.server.pages.assets import PLOTLY_JS_VERSION
from ampwatch.server.pages.figures import CHART_TOOLS
from ampwatch.server.pages.plot import Figure
from ampwatch.server.pages.time_axis import X_AXES
from ampwatch.wire.bundles import MODEL_FACTORY_UNKNOWN, replay_command

TEMPLATES = Path(__file__).parent / "templates"
# Pages run no inline script and load nothing from elsewhere; Plotly needs inline styles.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data: blob:; connect-src 'self'; font-src 'self' data:; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
_SCRIPT_SAFE = ((b"<", b"\\u003c"), (b">", b"\\u003e"), (b"&", b"\\u0026"),
                ("\u2028".encode(), b"\\u2028"), ("\u2029".encode(), b"\\u2029"))
# where render_page puts the figures' JSON: no escaped text can contain a "<"
_FIGURES_SLOT = Markup("<!--ampwatch:figures-->")


def script_json(value: Any) -> bytes:
    """UTF-8 JSON (numpy arrays as Plotly's base64 typed arrays) that cannot close the
    <script> tag it sits in: <, > and & are written as \\u escapes.

    Written by orjson as Plotly's own encoder does, without its escaping of every "/"
    (it made the base64 of a 1,000 x 1,000 heatmap a third longer; an escaped "<" is
    enough); one `bytes.replace` per character (`str.translate` took 0.9 s on the
    11 MB of two such heatmaps)."""
    try:
        data = orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)
    except TypeError:  # what orjson cannot write: Plotly's encoder cleans it first
        data = to_json_plotly(value).encode()
    for char, escape in _SCRIPT_SAFE:
        data = data.replace(char, escape)
    return data


def number(value: float | int | None, digits: int = 4) -> str:
    """A count with thousands separators, a float with `digits` significant digits."""
    if value is None:
        return "—"
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if value == int(value) and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:.{digits}g}"


def power_of_two(value: float | None) -> str:
    """'2^16' for 65536.0; '' when the value is not a power of two."""
    if value is None or not math.isfinite(value) or value <= 0:
        return ""
    exponent = math.log2(value)
    return f"2^{int(exponent)}" if exponent == int(exponent) else ""


def percent(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{100 * value:.2f}%" if value < 0.1 else f"{100 * value:.1f}%"


def ago(moment: datetime | str | None, now: datetime | None = None) -> str:
    """'12 s ago', '5 min ago', '3 h ago', '2 d ago'."""
    if moment is None:
        return "never"
    if isinstance(moment, str):
        moment = datetime.fromisoformat(moment)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    seconds = max(0.0, ((now or datetime.now(UTC)) - moment).total_seconds())
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{int(seconds // size)} {unit} ago"
    return f"{int(seconds)} s ago"


def iso(moment: datetime | str | None) -> str:
    if moment is None:
        return ""
    return moment if isinstance(moment, str) else moment.isoformat(timespec="seconds")


def clock_time(moment: datetime | str | None) -> str:
    """'2026-03-01 14:05 UTC': a moment that stays true on a page nobody reloads (a
    finished run's end), where an age would freeze."""
    if moment is None:
        return "never"
    if isinstance(moment, str):
        moment = datetime.fromisoformat(moment)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def make_environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(TEMPLATES),
        autoescape=select_autoescape(["html"], default_for_string=True, default=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(number=number, power_of_two=power_of_two, percent=percent, ago=ago,
                       iso=iso, clock_time=clock_time)
    env.globals["plotly_version"] = PLOTLY_JS_VERSION  # plotly.min.js?v=: cached for a year
    env.globals.update(tool_defaults=CHART_TOOLS, x_axes=X_AXES)  # _chart_tools.html
    # _bundles.html: the command quoted for the shell, and what its placeholder means
    env.globals.update(replay_command=replay_command, model_factory_unknown=MODEL_FACTORY_UNKNOWN)
    return env


_ENVIRONMENT = make_environment()


def render_fragment(template: str, **context: Any) -> Markup:
    """A template rendered to HTML (the panels a live page swaps in); already escaped."""
    return Markup(_ENVIRONMENT.get_template(template).render(**context))


def render_page(request: Request, template: str, status_code: int = 200, *,
                figures: dict[str, Figure] | None = None, **context: Any) -> HTMLResponse:
    """A full page; every page gets the request, the signed-in flag (the Log out button,
    not shown on the login form) and the CSP header. `figures` are embedded as JSON for
    app.js to draw, spliced into the page as bytes rather than rendered by Jinja: the
    heatmaps of a 1,000-layer run are 11 MB, and each copy of that as a str costs."""
    signed_in = (request.app.state.settings.token is not None
                 and "ampwatch_token" in request.cookies and template != "login.html")
    html = render_fragment(template, request=request, signed_in=signed_in,
                           figures=None if figures is None else _FIGURES_SLOT, **context)
    headers = {"Content-Security-Policy": CONTENT_SECURITY_POLICY}
    if figures is None:
        return HTMLResponse(html, status_code=status_code, headers=headers)
    head, _, tail = html.partition(_FIGURES_SLOT)
    body = b"".join((head.encode(), script_json({name: figure.to_plotly_json()
                                                  for name, figure in figures.items()}),
                     tail.encode()))
    return HTMLResponse(body, status_code=status_code, headers=headers)


def warm_up() -> None:
    """Compile every template, so that the first page a fresh server process answers
    does not pay for it (Jinja compiles a template on first use)."""
    for name in _ENVIRONMENT.list_templates(extensions=["html"]):
        _ENVIRONMENT.get_template(name)
