"""`create_app(settings)`: the FastAPI application. No module-level state."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import sessionmaker
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.routing import Match, Route
from starlette.types import Scope

from ampwatch.server import __version__, metrics, pages
from ampwatch.server.alerts import AlertService
from ampwatch.server.api import (
    alerts,
    batches,
    bundles,
    findings,
    fp8,
    health,
    notes,
    projects,
    retention,
    runs,
    series,
    spikes,
)
from ampwatch.server.api.error_responses import PROTECTED
from ampwatch.server.budget import ReadBudget
from ampwatch.server.db import health_on_commit, make_engine, session_info, upgrade
from ampwatch.server.deps import token_dependencies
from ampwatch.server.errors import AmpwatchServerError, short_errors
from ampwatch.server.faults import DatabaseHealth, database_error
from ampwatch.server.http.analysis_wait import AnalysisWaitMiddleware
from ampwatch.server.http.backpressure import BacklogMiddleware
from ampwatch.server.http.bundle_upload import BundleUploadMiddleware
from ampwatch.server.http.guards import (
    AdmissionMiddleware,
    RequestSlotMiddleware,
    SiteGuardMiddleware,
    trusted_hosts,
)
from ampwatch.server.http.metrics import MetricsMiddleware
from ampwatch.server.http.middleware import (
    QueryTextMiddleware,
    RequestBodyMiddleware,
    SameOriginPolicyMiddleware,
    SecurityHeadersMiddleware,
)
from ampwatch.server.responses import WireJSONResponse
from ampwatch.server.schemas.batches import BatchIn
from ampwatch.server.schemas.runs import RunUpsert
from ampwatch.server.services.runs import run_exists
from ampwatch.server.settings import Settings
from ampwatch.server.worker.analysis_worker import (
    AnalysisWorker,
    embedded_worker,
)

PARSER_THREADS = 2


def create_app(settings: Settings | None = None) -> FastAPI:
    """The ampwatch server. Connects to `settings.database_url` and, unless
    `migrate_on_start` is off, applies pending migrations before serving."""
    settings = settings or Settings()
    engine = make_engine(settings.database_url)
    db_health = DatabaseHealth()
    maker = sessionmaker(engine, expire_on_commit=False, info=session_info(engine, db_health))
    health_on_commit(maker, db_health)
    alert_service = AlertService(maker, settings.alerts, settings.public_url)
    server_metrics = metrics.ServerMetrics(maker, settings)
    worker = (embedded_worker(maker, settings, server_metrics.analysis_seconds.observe)
              if settings.embedded_worker else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pages.warm_up()
        # What exists now (modules, compiled templates, this app) lives as long as the
        # server: kept out of the collector's sight, a full collection walks only what
        # requests made, instead of pausing one request for 0.1 s now and then.
        gc.freeze()
        alert_service.start()
        if worker is not None:
            worker.start()
        yield
        gc.unfreeze()
        close_app(app)

    if settings.migrate_on_start:
        upgrade(engine)

    # the assets of /docs and /redoc installed with fastapi-offline, not a CDN: teams run
    # the server air-gapped; the pages themselves are behind the login (pages/api_docs.py);
    # no validator badge (it would call validator.swagger.io)
    app = FastAPIOffline(
        docs_url=None,
        redoc_url=None,
        swagger_ui_parameters={"validatorUrl": None},
        title="ampwatch",
        version=__version__,
        summary="Numerical health of PyTorch mixed-precision training runs.",
        description="Non-finite floats travel as the strings \"NaN\", \"Infinity\" and "
        "\"-Infinity\"; null means missing. See docs/wire-format.md. "
        "The dashboard: [all runs](/).",
        default_response_class=WireJSONResponse,
        lifespan=lifespan,
        middleware=middlewares(settings, maker, worker, server_metrics),
        # a route without its own operation_id is named after its function, not its path:
        # generated clients get methods like get_run, not get_one_run_api_v1_runs__run_id__get
        generate_unique_id_function=lambda route: route.name,
    )
    # ahead of FastAPIOffline's static mount: its ReDoc without the CDN logo
    app.router.routes.insert(0, Route("/static-offline-docs/redoc.standalone.js",
                                      pages.redoc_js, include_in_schema=False))
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessionmaker = maker
    app.state.db_health = db_health
    app.state.alerts = alert_service
    app.state.metrics = server_metrics
    app.state.analysis_worker = worker
    app.state.read_budget = ReadBudget(settings.max_inflight_read_bytes)
    # Request bodies are parsed here, off the event loop. Two threads: the body budget
    # admits at least two bodies at once, and every extra thread would keep a malloc
    # arena of its own (the server's resident memory grew with them). Not shut down with
    # the lifespan, which a test may run more than once: idle, its threads end with it.
    app.state.parser = ThreadPoolExecutor(PARSER_THREADS, thread_name_prefix="ampwatch-parse")
    _add_error_handlers(app)
    _add_routes(app, settings)
    return app


def middlewares(settings: Settings, maker: sessionmaker, worker: AnalysisWorker | None,
                server_metrics: metrics.ServerMetrics) -> list[Middleware]:
    """Every middleware of the app (all in server/http/), outermost first: headers on
    every answer; Host and Origin; metrics; the token, before anything is held; the
    query's text; reads waiting for analysis; the docs' same-origin policy; batches
    refused while analysis is behind; bodies, under their budget; a bundle's upload, to
    a file under its deadline; then a request slot."""
    return [
        Middleware(SecurityHeadersMiddleware),
        Middleware(SiteGuardMiddleware, hosts=trusted_hosts(settings)),
        Middleware(MetricsMiddleware, metrics=server_metrics),
        Middleware(AdmissionMiddleware, token=settings.token,
                   per_client=settings.max_requests_per_client),
        Middleware(QueryTextMiddleware),
        *([Middleware(AnalysisWaitMiddleware, maker=maker, worker=worker,
                      wait_s=settings.analysis_wait_s)] if settings.analysis_wait_s else []),
        Middleware(SameOriginPolicyMiddleware, paths=("/docs", "/redoc")),
        Middleware(BacklogMiddleware, maker=maker, limit=settings.max_pending_batches),
        Middleware(RequestBodyMiddleware, max_bytes=settings.max_body_bytes,
                   max_inflight_bytes=settings.max_inflight_body_bytes,
                   body_timeout_s=settings.body_timeout_s),
        Middleware(BundleUploadMiddleware, settings=settings,
                   known_run=partial(run_exists, maker)),
        Middleware(RequestSlotMiddleware, max_requests=settings.max_concurrent_requests,
                   wait_s=settings.slot_wait_s),
    ]


def _add_error_handlers(app: FastAPI) -> None:
    """Domain errors, database faults, 405 and validation errors as the API answers them
    (a person's browser gets a page for an invalid request)."""

    @app.exception_handler(AmpwatchServerError)
    async def _domain_error(_request: Request, exc: AmpwatchServerError) -> WireJSONResponse:
        retry = getattr(exc, "retry_after", None)
        return WireJSONResponse({"detail": exc.message}, status_code=exc.status_code,
                                headers={"Retry-After": str(retry)} if retry else None)

    @app.exception_handler(OperationalError)
    @app.exception_handler(PoolTimeout)
    async def _database_fault(_request: Request, exc: Exception) -> WireJSONResponse:
        return await _domain_error(_request, database_error(exc))

    @app.exception_handler(405)
    async def _wrong_method(request: Request, exc: StarletteHTTPException) -> WireJSONResponse:
        # Starlette's Allow names the methods of the first route matching the path only
        allow = ", ".join(sorted(allowed_methods(app, request.scope)))
        return WireJSONResponse({"detail": exc.detail}, status_code=405,
                                headers={"Allow": allow})

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        if pages.wants_page(request):  # a person's browser: a page that says what is wrong
            return pages.invalid_page(request, short_errors(exc.errors()))
        return WireJSONResponse({"detail": short_errors(exc.errors())}, status_code=422)


def _add_routes(app: FastAPI, settings: Settings) -> None:
    """/api/v1 (every route but /health behind the token), /metrics and the pages."""
    api = APIRouter(prefix="/api/v1")
    api.include_router(health.router)
    protected = APIRouter(dependencies=token_dependencies(settings),
                          responses=PROTECTED if settings.token is not None else {})
    for module in (runs, batches, series, findings, fp8, spikes, retention, alerts,
                   bundles, notes, projects):
        protected.include_router(module.router)
    api.include_router(protected)
    app.include_router(api)
    app.include_router(metrics.router)
    app.include_router(pages.router)
    _document_parsed_bodies(app, (BatchIn, RunUpsert))


def close_app(app: FastAPI) -> None:
    """What the end of `app`'s lifespan does, and what the owner of an app whose lifespan
    never ran calls instead of disposing its engine: stop the analysis worker (a commit
    that enqueued starts its thread, lifespan or not) and the alert dispatcher, then close
    the engine's connections. A thread still using the engine would check a connection
    into the pool that `dispose()` replaced, open until the garbage collector finds it.
    Blocks for the worker's claim in progress. The app stays usable (a new pool)."""
    if app.state.analysis_worker is not None:
        app.state.analysis_worker.stop()
    app.state.alerts.stop()
    app.state.engine.dispose()


HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def allowed_methods(app: FastAPI, scope: Scope) -> set[str]:
    """The methods some route answers at the request's path (a 405's Allow). Each method
    is tried as a full match: FastAPI's included routers do not show their routes'
    methods on a partial one (Allow was empty)."""
    return {method for method in HTTP_METHODS
            if any(route.matches({**scope, "method": method})[0] is Match.FULL
                   for route in app.router.routes)}


def _document_parsed_bodies(app: FastAPI, models: tuple[type[BaseModel], ...]) -> None:
    """Put the bodies that routes parse themselves (server/api/bodies.py) in the OpenAPI
    components: FastAPI does not see those models."""
    default_openapi = app.openapi

    def openapi() -> dict:
        schema = default_openapi()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            if model.__name__ not in components:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
        return schema

    app.openapi = openapi
