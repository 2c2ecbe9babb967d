"""`Client`: the REST API (/api/v1) as Python methods returning typed results."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

import httpx

from ampwatch.client.errors import (
    AnalysisPending,
    ConnectionFailed,
    NotFound,
    ServerError,
    error_for_response,
)
from ampwatch.client.models import (
    Alerts,
    BatchAck,
    BundleInfo,
    Delivery,
    Finding,
    Health,
    Incident,
    Layer,
    LayerMatrix,
    LayerSeries,
    ProjectHealth,
    Records,
    Run,
    Spike,
    Step,
)
from ampwatch.wire import DEFAULT_SERVER
from ampwatch.wire.bundles import bundle_name

MatrixMetric = Literal["grad_norm", "act_absmax", "act_time_ms", "update_ratio",
                       "update_lost", "adam_eps_share", "adam_v_zero_share",
                       "attn_max_logit", "logit_absmax", "logit_lse"]


def _segment(run_id: str) -> str:
    """A run id as one URL path segment: '/' or '..' in it cannot reach another route."""
    segment = quote(str(run_id), safe="")
    return segment.replace(".", "%2E") if segment in (".", "..") else segment


class Client:
    """A client of one ampwatch server.

    base_url: the server's address; default $AMPWATCH_SERVER, else http://127.0.0.1:8000.
    token: sent as `Authorization: Bearer <token>`; default $AMPWATCH_TOKEN (pass "" to
        send none).
    timeout: seconds per request (connect, read, write); every method may block that long
        per request it makes.
    http_client: an `httpx.Client` to send the requests through (for example FastAPI's
        TestClient), with its own timeout; the caller keeps owning it and closes it.

    Every method raises an `AmpwatchError` subclass on failure. Use it as a context
    manager, or call `close()`, to release its connections.
    """

    RUNS_PAGE = 500
    STEPS_PAGE = 10_000
    FINDINGS_PAGE = 500

    def __init__(self, base_url: str | None = None, *, token: str | None = None,
                 timeout: float = 10.0, http_client: httpx.Client | None = None) -> None:
        if base_url is None:
            base_url = (os.environ.get("AMPWATCH_SERVER") if http_client is None
                        else str(http_client.base_url)) or DEFAULT_SERVER
        self.base_url = base_url.rstrip("/")
        token = os.environ.get("AMPWATCH_TOKEN") if token is None else token
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = timeout
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(timeout=timeout)

    def close(self) -> None:
        """Release the connections (not those of an injected `http_client`)."""
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.base_url!r})"

    # health and runs

    def health(self) -> Health:
        """The server's version and database kind; needs no token."""
        return Health.from_json(self._request("GET", "/health"))

    def runs(self, *, project: str | None = None, name: str | None = None,
             status: str | None = None, limit: int | None = None,
             wait: float | None = None) -> Records[Run]:
        """Runs, newest first, fetching page after page; filtered by project, a name
        substring, and health status (healthy, warning, critical, no_data); at most `limit`.
        `wait`: seconds (at most 60) the server may first wait for the analysis of every
        run's stored batches."""
        return Records(self._pages("/runs", Run, self.RUNS_PAGE, limit, project=project,
                                   name=name, status=status, **self._waiting(wait)), of=Run)

    def run(self, run_id: str, *, wait: float | None = None) -> Run:
        """One run with its totals per rank; NotFound when there is none. `wait`: seconds
        (at most 60) the server may first wait for the analysis of its stored batches."""
        return Run.from_json(self._request("GET", f"/runs/{_segment(run_id)}",
                                           **self._waiting(wait)))

    def delete_run(self, run_id: str) -> None:
        """Delete the run and all its data on the server."""
        self._request("DELETE", f"/runs/{_segment(run_id)}")

    def archive_run(self, run_id: str) -> Run:
        """Drop the run's full-resolution steps on the server; its step summaries,
        findings and totals stay (docs/long-runs.md)."""
        return Run.from_json(self._request("POST", f"/runs/{_segment(run_id)}/archive"))

    COMPACT_TIMEOUT = 600.0  # a SQLite VACUUM rewrites the whole file

    def compact(self, *, timeout: float = COMPACT_TIMEOUT) -> dict[str, Any]:
        """Hand the space of deleted and archived runs back to the file system (SQLite
        VACUUM, which stalls the server's ingest while it runs): dialect, bytes on disk
        before and after. Blocks up to `timeout` seconds (not the client's timeout: on a
        large database it takes minutes); a VACUUM cut off by it goes on on the server."""
        return self._request("POST", "/storage/compact", timeout=timeout)

    def bundles(self, run_id: str) -> Records[BundleInfo]:
        """The run's flight-recorder bundles (docs/replay.md), by step."""
        data = self._request("GET", f"/runs/{_segment(run_id)}/bundles")
        return Records([BundleInfo.from_json(b) for b in data["items"]], of=BundleInfo)

    def download_bundle(self, run_id: str, step: int, destination: str | Path, *,
                        rank: int = 0) -> Path:
        """Save one bundle to `destination` (a file, or a folder to put it in, under the
        server's file name); returns the file's path. Streams: a bundle holds a model."""
        url = f"{self.base_url}/api/v1/runs/{_segment(run_id)}/bundles/{rank}/{step}"
        target = Path(destination)
        if target.is_dir():
            target = target / bundle_name(step)
        try:
            with self._http.stream("GET", url, headers=self._headers) as response:
                if response.is_error:
                    response.read()
                    raise error_for_response(response)
                partial = target.with_name(target.name + ".part")
                with open(partial, "wb") as out:
                    for chunk in response.iter_bytes():
                        out.write(chunk)
                partial.replace(target)
        except httpx.TimeoutException as exc:
            raise ConnectionFailed(f"no answer from {self.base_url} ({exc})") from exc
        except httpx.TransportError as exc:
            raise ConnectionFailed(f"cannot reach {self.base_url}: {exc}") from exc
        return target

    def upload_bundle(self, run_id: str, step: int, path: str | Path, *,
                      rank: int = 0) -> BundleInfo:
        """PUT a bundle file (streamed) for `step` of `rank`; a re-sent step replaces it."""
        with open(path, "rb") as body:
            data = self._request("PUT", f"/runs/{_segment(run_id)}/bundles/{rank}/{step}",
                                 content=body, headers={"Content-Type": "application/zip"})
        return BundleInfo.from_json(data)

    def record_bisect(self, run_id: str, step: int, verdict: dict[str, Any], *,
                      rank: int = 0) -> BundleInfo:
        """Keep what `ampwatch replay --bisect` found for the bundle of `step` of `rank`
        on the server (`verdict`: the body of PUT .../bisect, docs/replay.md); a later
        verdict replaces it. NotFound when the server holds no such bundle."""
        data = self._request("PUT", f"/runs/{_segment(run_id)}/bundles/{rank}/{step}/bisect",
                             json=verdict)
        return BundleInfo.from_json(data)

    def register_run(self, run_id: str, body: dict[str, Any]) -> Run:
        """PUT the run registration `body` (wire form, docs/wire-format.md); idempotent."""
        return Run.from_json(self._request("PUT", f"/runs/{_segment(run_id)}", json=body))

    def send_batch(self, run_id: str, body: dict[str, Any] | bytes, *,
                   gzipped: bool = False, made_at: datetime | None = None) -> BatchAck:
        """POST one batch (wire form, or its JSON bytes, gzip-compressed when `gzipped`).
        A batch the server already has is acknowledged with `duplicate=True`. `made_at`:
        when its data was made, for a batch sent late (the run's last seen time becomes
        it, not the upload's)."""
        params = {} if made_at is None else {"made_at": made_at.isoformat()}
        path = f"/runs/{_segment(run_id)}/batches"
        if isinstance(body, bytes):
            headers = {"Content-Type": "application/json"}
            if gzipped:
                headers["Content-Encoding"] = "gzip"
            data = self._request("POST", path, content=body, headers=headers, params=params)
        else:
            data = self._request("POST", path, json=body, params=params)
        return BatchAck.from_json(data)

    def wait_for_step(self, run_id: str, step: int, timeout: float = 60.0, *,
                      poll_interval: float = 1.0) -> Run:
        """Poll until the run has reached `step` on some rank and return it; a run that
        is not registered yet is waited for too. Blocks up to `timeout` seconds, then
        raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                run = self.run(run_id)
                if run.last_step is not None and run.last_step >= step:
                    return run
                seen = f"its last step is {run.last_step}"
            except NotFound:
                seen = "it is not registered"
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"run {run_id!r} did not reach step {step} within {timeout:g} s ({seen})")
            time.sleep(min(poll_interval, left))

    def wait_for_analysis(self, run_id: str, timeout: float = 60.0, *,
                          poll_interval: float = 0.5) -> Run:
        """Poll until the server has judged every stored batch of the run (its
        `analysis_pending` is 0: its findings are all in) and return it. Blocks up to
        `timeout` seconds, then raises `AnalysisPending` (a TimeoutError) saying how many
        batches wait. Call it after training, before reading findings: the server judges
        stored batches a moment after it acknowledged them."""
        deadline = time.monotonic() + timeout
        while True:
            run = self.run(run_id)
            if not run.analysis_pending:
                return run
            left = deadline - time.monotonic()
            if left <= 0:
                n = run.analysis_pending
                raise AnalysisPending(
                    f"run {run_id!r}: findings are not all in yet: analysis of {n} "
                    f"batch{'es' if n != 1 else ''} still pending after {timeout:g} s", n)
            time.sleep(min(poll_interval, left))

    # a run's data

    def steps(self, run_id: str, *, start: int | None = None, end: int | None = None,
              rank: int | None = None, max_points: int | None = None) -> Records[Step]:
        """Step records in [start, end] (inclusive), all ranks unless `rank`, ordered by
        (step, rank). With `max_points`: one downsampled request, at most `max_points`
        steps that keep each bucket's extremes (the skipped and non-finite ones:
        `step_events`); without: every step, fetched page by page."""
        return Records(self.iter_steps(run_id, start=start, end=end, rank=rank,
                                       max_points=max_points), of=Step)

    def step_events(self, run_id: str, *, start: int | None = None, end: int | None = None,
                    rank: int | None = None) -> Records[Step]:
        """Every skipped or non-finite step in [start, end], all ranks unless `rank`, in
        (step, rank) order: the `events` of one downsampled request."""
        page = self._request("GET", f"/runs/{_segment(run_id)}/steps",
                             params={"start": start, "end": end, "rank": rank,
                                     "max_points": 10})
        return Records((Step.from_json(item) for item in page.get("events", ())), of=Step)

    def iter_steps(self, run_id: str, *, start: int | None = None, end: int | None = None,
                   rank: int | None = None, max_points: int | None = None) -> Iterator[Step]:
        """As `steps`, lazily: one page in memory at a time."""
        params = {"start": start, "end": end, "rank": rank, "max_points": max_points}
        while True:
            page = self._request("GET", f"/runs/{_segment(run_id)}/steps",
                                 params={**params, "limit": self.STEPS_PAGE})
            next_start = page.get("next_start")
            for item in page["items"]:
                # ranks cut at a later step re-send rows from next_start on
                if next_start is None or item["step"] < next_start:
                    yield Step.from_json(item)
            if max_points is not None or next_start is None:
                return
            params["start"] = next_start

    def layers(self, run_id: str, *, rank: int = 0) -> Records[Layer]:
        """The run's layer table, with per-layer summaries on `rank`."""
        page = self._request("GET", f"/runs/{_segment(run_id)}/layers", params={"rank": rank})
        return Records((Layer.from_json(item) for item in page["items"]), of=Layer)

    def layer_series(self, run_id: str, layer: int | str, *, rank: int = 0,
                     start: int | None = None, end: int | None = None,
                     max_points: int | None = None) -> LayerSeries:
        """One layer's grad norm per step and its sampled activation stats; `layer` is
        its index or its name (a name costs one more request)."""
        index = layer if isinstance(layer, int) else self._layer_index(run_id, layer, rank)
        return LayerSeries.from_json(self._request(
            "GET", f"/runs/{_segment(run_id)}/layers/{index}/series",
            params={"rank": rank, "start": start, "end": end, "max_points": max_points}))

    def layer_matrix(self, run_id: str, *, metric: MatrixMetric = "grad_norm", rank: int = 0,
                     start: int | None = None, end: int | None = None,
                     buckets: int = 1000, layer_offset: int = 0,
                     layer_limit: int | None = None) -> LayerMatrix:
        """Layers x step buckets of `metric` (the heatmap data): the largest finite value
        per bucket, or the non-finite one when the bucket had one; the layers with indices
        `layer_offset` to `layer_offset + layer_limit` (a wide run answers at most 10
        million cells at once)."""
        return LayerMatrix.from_json(self._request(
            "GET", f"/runs/{_segment(run_id)}/layers/matrix",
            params={"metric": metric, "rank": rank, "start": start, "end": end,
                    "buckets": buckets, "layer_offset": layer_offset,
                    "layer_limit": layer_limit}))

    def findings(self, run_id: str | None = None, *, kind: str | None = None,
                 severity: str | None = None, status: str | None = None,
                 limit: int | None = None, wait: float | None = None) -> Records[Finding]:
        """Findings of one run, or of all runs when `run_id` is None, fetching page after
        page; filtered by kind, severity (info, warning, critical) and status (open,
        resolved); at most `limit`. `wait`: seconds (at most 60) the server may first wait
        for the analysis of the stored batches, so a read right after training has them."""
        path = f"/runs/{_segment(run_id)}/findings" if run_id is not None else "/findings"
        return Records(self._pages(path, Finding, self.FINDINGS_PAGE, limit,
                                   kind=kind, severity=severity, status=status,
                                   **self._waiting(wait)), of=Finding)

    def spikes(self, run_id: str, *, rank: int | None = None,
               wait: float | None = None) -> Records[Spike]:
        """A run's loss spikes in step order (its `loss_spike` findings, open and
        resolved, read as spikes), each with its likely cause; of one rank when given.
        `wait` as in `findings`."""
        waiting = self._waiting(wait)
        body = self._request("GET", f"/runs/{_segment(run_id)}/spikes",
                             params={"rank": rank, **waiting.pop("params", {})}, **waiting)
        return Records((Spike.from_json(item) for item in body["items"]), of=Spike)

    def incidents(self, run_id: str, *, status: str | None = None,
                  severity: str | None = None, wait: float | None = None) -> Records[Incident]:
        """A run's findings grouped by root cause, open first, most severe first;
        filtered by status (open, resolved) and severity. `wait` as in `findings`."""
        waiting = self._waiting(wait)
        body = self._request("GET", f"/runs/{_segment(run_id)}/incidents",
                             params={"status": status, "severity": severity,
                                     **waiting.pop("params", {})}, **waiting)
        return Records((Incident.from_json(item) for item in body["items"]), of=Incident)

    def project_health(self, project: str, *, tag: str | None = None,
                       wait: float | None = None) -> ProjectHealth:
        """Every run of `project` (tagged `tag`) with its outcome, and each config and
        environment key ranked by how well it alone separates the unhealthy runs
        (docs/projects.md); NotFound for a project without runs. `wait` as in
        `findings` (every run's analysis)."""
        waiting = self._waiting(wait)
        return ProjectHealth.from_json(self._request(
            "GET", f"/projects/{_segment(project)}/health",
            params={"tag": tag, **waiting.pop("params", {})}, **waiting))

    # alerts

    def alerts(self) -> Alerts:
        """The server's alert rules and targets (target URLs redacted)."""
        return Alerts.from_json(self._request("GET", "/alerts"))

    def deliveries(self, *, status: str | None = None, run_id: str | None = None,
                   event: str | None = None, limit: int | None = None) -> Records[Delivery]:
        """Alert notifications, newest first, with their attempts; filtered by status
        (pending, delivered, failed), run and event (opened, escalated, resolved,
        reopened, test)."""
        return Records(self._pages("/alerts/deliveries", Delivery, self.FINDINGS_PAGE, limit,
                                   status=status, run_id=run_id, event=event), of=Delivery)

    def delivery(self, notification_id: int) -> Delivery:
        """One notification by id; NotFound when there is none."""
        return Delivery.from_json(self._request("GET", f"/alerts/deliveries/{notification_id}"))

    def send_test_alert(self, target: str | None = None) -> list[int]:
        """Queue a test notification to every alert target (or `target`); returns their
        ids, to follow with `delivery(id)`."""
        return self._request("POST", "/alerts/test", params={"target": target})["ids"]

    # plumbing

    def _layer_index(self, run_id: str, name: str, rank: int) -> int:
        for layer in self.layers(run_id, rank=rank):
            if layer.name == name:
                return layer.index
        raise NotFound(f"run {run_id!r} has no layer named {name!r}", 404)

    def _waiting(self, wait: float | None) -> dict[str, Any]:
        """The `?wait=` of a read, and a request timeout that outlasts it (a caller's
        `http_client` keeps its own)."""
        if not wait:
            return {}
        timeout = self._timeout + wait if self._owns_http else None
        return {"params": {"wait": wait}, "timeout": timeout}

    def _pages(self, path: str, model: type, page_size: int, limit: int | None, *,
               params: dict[str, Any] | None = None, timeout: float | None = None,
               **filters: Any) -> Iterator[Any]:
        """Items of a limit/offset list route, page by page, until `limit` or the end;
        `params` go with the first page only (a wait)."""
        offset = 0
        first = params or {}
        while limit is None or offset < limit:
            size = page_size if limit is None else min(page_size, limit - offset)
            page = self._request("GET", path, params={**filters, **first, "limit": size,
                                                      "offset": offset}, timeout=timeout)
            first = {}
            items = page.get("items", [])
            yield from (model.from_json(item) for item in items)
            offset += len(items)
            total = page.get("total")
            if len(items) < size or (total is not None and offset >= total):
                return

    def _request(self, method: str, path: str, *, params: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None, timeout: float | None = None,
                 **kwargs: Any) -> Any:
        """Send one request and return its decoded JSON body (None when empty); `timeout`
        replaces the client's for this request."""
        url = f"{self.base_url}/api/v1{path}"
        if params is not None:
            params = {k: v for k, v in params.items() if v is not None}
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            response = self._http.request(method, url, params=params,
                                          headers={**self._headers, **(headers or {})},
                                          **kwargs)
        except httpx.TimeoutException as exc:
            waited = self._timeout if timeout is None else timeout
            raise ConnectionFailed(
                f"no answer from {self.base_url} within {waited:g} s ({exc})") from exc
        except httpx.TransportError as exc:
            raise ConnectionFailed(f"cannot reach {self.base_url}: {exc}") from exc
        if response.is_error:
            raise error_for_response(response)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise ServerError(f"{method} {path}: the server did not answer JSON",
                              response.status_code) from exc
