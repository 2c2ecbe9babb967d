"""The dashboard's static assets: plotly.js, the offline docs' ReDoc and the pages' own
CSS and JS. Served by this server so that pages load nothing from elsewhere; no login
(a browser needs them on the login page too)."""

from __future__ import annotations

import gzip
from functools import cache
from pathlib import Path as FilePath
from typing import Annotated

import fastapi_offline
from fastapi import APIRouter, HTTPException, Path, Request
from fastapi.responses import FileResponse, Response

STATIC = FilePath(__file__).parent / "static"
# plotly.js's cartesian partial bundle, vendored (static/plotly/SOURCE.md): every trace
# type the pages draw, a third of the full bundle's bytes
PLOTLY_JS = STATIC / "plotly" / "plotly-cartesian.min.js"
PLOTLY_JS_VERSION = "4.1.1"
REDOC_JS = FilePath(fastapi_offline.__file__).parent / "static" / "redoc.standalone.js"
REDOC_LOGO = b'"https://cdn.redoc.ly/redoc/logo-mini.svg"'

router = APIRouter(include_in_schema=False)


@cache
def _plotly_gzip() -> bytes:
    """plotly.js gzipped, once per process: 1.5 MB to 0.50 MB in about 0.3 s (level 9
    saves 0.2% more and takes half as long again)."""
    return gzip.compress(PLOTLY_JS.read_bytes(), compresslevel=6, mtime=0)


@router.get("/static/plotly.min.js")
def plotly_js(request: Request) -> Response:
    """plotly.js's cartesian bundle (pages load nothing from elsewhere), gzipped for a
    browser that takes it. Pages ask for it as ?v=<its version>, so it is cached for a
    year: a new bundle is a new address."""
    headers = {"Cache-Control": "public, max-age=31536000, immutable",
               "Vary": "Accept-Encoding"}
    if "gzip" in request.headers.get("accept-encoding", ""):
        return Response(_plotly_gzip(), media_type="text/javascript",
                        headers={**headers, "Content-Encoding": "gzip"})
    return FileResponse(PLOTLY_JS, media_type="text/javascript", headers=headers)


@cache
def _redoc_without_logo() -> bytes:
    return REDOC_JS.read_bytes().replace(REDOC_LOGO, b'""')


def redoc_js(request: Request) -> Response:
    """The bundled ReDoc with its hard-coded CDN logo address emptied: the logo is not
    drawn and nothing is requested (app.py routes its address here, ahead of the
    offline docs' static files)."""
    return Response(_redoc_without_logo(), media_type="text/javascript",
                    headers={"Cache-Control": "no-cache"})


@router.get("/static/{name}")
def static_file(name: Annotated[str, Path(pattern=r"^[a-z]+\.(css|js)$")]) -> FileResponse:
    path = STATIC / name
    if path.parent != STATIC or not path.is_file():
        raise HTTPException(status_code=404, detail="no such file")
    return FileResponse(path, headers={"Cache-Control": "no-cache"})
