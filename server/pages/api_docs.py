"""/docs (Swagger UI) and /redoc: pages like the others, so with a token set they need it
(the login cookie; without it a browser is sent to /login), as /openapi.json does. Their
assets come from fastapi-offline's static files, served by this server (no CDN)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse

ASSETS = "/static-offline-docs"  # FastAPIOffline's mount (app.py)

router = APIRouter(include_in_schema=False)


@router.get("/docs", response_class=HTMLResponse)
def swagger_ui(request: Request) -> HTMLResponse:
    root, app = request.scope.get("root_path", ""), request.app
    return get_swagger_ui_html(
        openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - Swagger UI",
        swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
        swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
        swagger_ui_parameters=app.swagger_ui_parameters)


@router.get("/redoc", response_class=HTMLResponse)
def redoc(request: Request) -> HTMLResponse:
    root, app = request.scope.get("root_path", ""), request.app
    return get_redoc_html(
        openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - ReDoc",
        redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js", with_google_fonts=False,
        redoc_favicon_url=f"{root}{ASSETS}/favicon.png")
