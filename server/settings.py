"""Server settings: one validated object, read from AMPWATCH_* environment variables
and command-line flags, and passed to `create_app`. Nothing reads them at import time."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ampwatch.server.alerts.settings import AlertSettings
from ampwatch.server.analysis.settings import AnalysisSettings


def default_database_url() -> str:
    """SQLite file under $XDG_DATA_HOME/ampwatch (~/.local/share/ampwatch by default)."""
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return f"sqlite:///{base / 'ampwatch' / 'ampwatch.db'}"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="AMPWATCH_", env_nested_delimiter="__", extra="ignore"
    )

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    database_url: str = Field(default_factory=default_database_url)
    token: SecretStr | None = None
    # largest request body accepted, after gzip decompression
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    # bodies of all requests in flight together (a request costs several times its body
    # while it is parsed); beyond, 503 + Retry-After. At least twice max_body_bytes: one
    # request holds its gzip body and the inflated one
    max_inflight_body_bytes: int = Field(128 * 1024 * 1024, ge=1024)
    # estimated bytes of read answers (heatmap matrices, layer tables, step series) being
    # built at once; beyond, 503 + Retry-After (docs/security.md)
    max_inflight_read_bytes: int = Field(1024 * 1024 * 1024, ge=1024 * 1024)
    # requests running at once (/api/v1/health never counts); more wait their turn. Below
    # the database pool size, so requests never queue for a connection
    max_concurrent_requests: int = Field(16, ge=1, le=10_000)
    # how long a request waits for one of those; beyond, the server is behind: 503 +
    # Retry-After (the agent keeps the batch in its spool and waits that long)
    slot_wait_s: float = Field(5.0, gt=0, le=300)
    # batches stored and not yet analysed, all runs together; beyond, new batches get
    # 503 + Retry-After until the analysis workers catch up (docs/architecture.md)
    max_pending_batches: int = Field(100_000, ge=1)
    # a request body (after its headers) must arrive within this (408)
    body_timeout_s: float = Field(60.0, gt=0)
    # a connection must send its request headers within this, or it is closed
    header_timeout_s: float = Field(15.0, gt=0)
    # a response whose client takes less than 64 KiB of it in this long, while the server
    # waits to write, is abandoned: the connection is reset and its unsent bytes freed
    send_timeout_s: float = Field(30.0, gt=0)
    # requests without the token (static files, the login page; every request when no
    # token is set counts as having it) in flight from one client address; 503 beyond
    max_requests_per_client: int = Field(8, ge=1, le=10_000)
    # Host names a server without a token answers to besides loopback names, its bind
    # address and the public URL's host (DNS rebinding); comma-separated, "*" for any
    allowed_hosts: str = ""
    # a run is live when a batch arrived within this many seconds
    live_seconds: float = Field(60.0, gt=0)
    # a run that stopped reporting (quiet past live_seconds, not finished) stays on
    # /metrics, reading stopped, until its data is this old; 0 drops it at once
    metrics_stopped_seconds: float = Field(3600.0, ge=0)
    migrate_on_start: bool = True
    # detector thresholds; env vars like AMPWATCH_ANALYSIS__SKIP_STREAK_WARNING
    analysis: AnalysisSettings = Field(default_factory=AnalysisSettings)
    # the detectors run off the request path (server/worker/analysis_worker.py): a worker
    # thread in this server drains the analysis queue unless this is off (then `ampwatch worker`
    # processes must run); safe beside other servers' threads and worker processes
    embedded_worker: bool = True
    # memory a worker keeps recent rank windows in (past it, windows are read again)
    worker_window_bytes: int = Field(512 << 20, ge=0)
    # every GET first waits up to this long for queued batches to be analysed, for readers
    # that cannot pass `?wait=` (docs/worker.md); 0 answers at once
    analysis_wait_s: float = Field(0.0, ge=0, le=300)
    # alert rules and targets (docs/alerts.md); AMPWATCH_ALERTS__FILE=alerts.toml
    alerts: AlertSettings = Field(default_factory=AlertSettings)
    # GET /metrics accepts this bearer token (for scrapers) or `token`; open without both
    metrics_token: SecretStr | None = None
    # flight-recorder bundles (docs/replay.md): their folder (default: `bundles/` next to
    # a SQLite database, else $XDG_DATA_HOME/ampwatch/bundles), the largest one accepted
    # and the most all of them may take (beyond, 507); they go with their run
    bundle_dir: Path | None = None
    bundle_max_bytes: int = Field(4 << 30, ge=1024)
    bundle_total_bytes: int = Field(100 << 30, ge=1024)
    # a bundle's whole upload must arrive within this (408), however it trickles; it
    # takes no request slot while it arrives
    bundle_timeout_s: float = Field(600.0, gt=0)

    @field_validator("database_url")
    @classmethod
    def _known_backend(cls, url: str) -> str:
        if not url.startswith(("sqlite", "postgresql")):
            raise ValueError("database_url must be a sqlite:/// or postgresql+psycopg:// URL")
        if url.startswith("postgresql://"):
            url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
        return url

    @field_validator("token", "metrics_token")
    @classmethod
    def _empty_token_is_none(cls, token: SecretStr | None) -> SecretStr | None:
        return token if token and token.get_secret_value() else None

    @model_validator(mode="after")
    def _two_bodies_in_flight(self) -> Settings:
        if self.max_inflight_body_bytes < 2 * self.max_body_bytes:
            raise ValueError(
                f"max_inflight_body_bytes ({self.max_inflight_body_bytes}) must be at least "
                f"twice max_body_bytes ({self.max_body_bytes}): one request holds its gzip "
                "body and the inflated one")
        return self

    @property
    def bundle_folder(self) -> Path:
        """Where bundle files are kept (see `bundle_dir`)."""
        if self.bundle_dir is not None:
            return Path(self.bundle_dir)
        if self.database_url.startswith("sqlite:///") and ":memory:" not in self.database_url:
            return Path(self.database_url.removeprefix("sqlite:///")).parent / "bundles"
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
        return base / "ampwatch" / "bundles"

    @property
    def public_url(self) -> str:
        """Base of the links in notifications: `alerts.public_url`, else this server."""
        if self.alerts.public_url:
            return self.alerts.public_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"
