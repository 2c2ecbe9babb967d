"""Alert rules and targets: nested in the server settings as `alerts`, from environment
variables (AMPWATCH_ALERTS__RULES='[...]' as JSON) and/or a TOML file
(AMPWATCH_ALERTS__FILE=/etc/ampwatch/alerts.toml). docs/alerts.md shows both.

Target URLs carry secrets (webhook tokens, Slack keys, mail passwords): they are kept as
`SecretStr` and leave this module only through `redact_url`, except to the sender.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator

from ampwatch.server.analysis.draft import SEVERITY_RANK
from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.schemas.common import Severity

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
WEB_SCHEMES = ("http", "https")


def redact_url(url: str) -> str:
    """`url` without anything that can be a secret: a web URL keeps its scheme, host and
    port (credentials, path and query become "..."); any other (apprise) URL keeps only
    its scheme, since services put tokens in the host part too (slack://TOKEN/...)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower() or "?"
    if scheme not in WEB_SCHEMES:
        return f"{scheme}://..."
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        port = ""
    hidden = "/..." if (parts.path not in ("", "/") or parts.query or parts.username) else "/"
    return f"{scheme}://{host}{port}{hidden}"


class AlertTarget(BaseModel):
    """Where notifications go. type `webhook`: a JSON POST of the finding, its run and a
    link (docs/alerts.md); `apprise`: any apprise URL (slack://, msteams://, discord://,
    mailtos://, ntfy://, ...), which needs `pip install "ampwatch[alerts]"`. Left out,
    the type follows the URL: http(s) is a webhook, anything else apprise."""

    url: SecretStr
    type: Literal["webhook", "apprise"] | None = None

    @model_validator(mode="after")
    def _type_from_url(self) -> AlertTarget:
        url = self.url.get_secret_value()
        scheme = urlsplit(url).scheme.lower()
        if not scheme:
            raise ValueError(f"target url {redact_url(url)} has no scheme (e.g. https://)")
        if self.type is None:
            self.type = "webhook" if scheme in WEB_SCHEMES else "apprise"
        if self.type == "webhook" and scheme not in WEB_SCHEMES:
            raise ValueError(f"a webhook target needs an http(s) URL, not {scheme}://")
        return self

    @property
    def redacted_url(self) -> str:
        return redact_url(self.url.get_secret_value())


class AlertRule(BaseModel):
    """Notify `targets` when an incident (or, with `per = "finding"`, each finding)
    opens, or escalates, at or above `severity`; optionally only in `projects` or for
    finding `kinds`, and when it resolves."""

    name: str = Field(pattern=NAME_PATTERN)
    severity: Severity = "warning"
    projects: list[str] = Field(default_factory=list, description="empty: every project")
    kinds: list[FindingKind] = Field(default_factory=list, description="empty: every finding kind")
    on_resolve: bool = False
    targets: list[str] = Field(min_length=1)
    per: Literal["incident", "finding"] = Field(
        "incident", description="one notification per incident (one root cause), or per "
                                "finding")

    def matches(self, project: str, kind: str, severity: str) -> bool:
        return (SEVERITY_RANK[severity] >= SEVERITY_RANK[self.severity]
                and (not self.projects or project in self.projects)
                and (not self.kinds or kind in self.kinds))


class AlertSettings(BaseModel):
    """Rules, targets and delivery tuning. `file` (TOML with `[targets.NAME]` tables and
    `[[rules]]`) adds to the rules and targets given directly; names must not repeat."""

    file: Path | None = None
    targets: dict[str, AlertTarget] = Field(default_factory=dict)
    rules: list[AlertRule] = Field(default_factory=list)
    # base of the run links in notifications; default http://HOST:PORT of the server
    public_url: str | None = None
    # delivery: per-request timeout, retries with exponential backoff, then give up
    timeout_s: float = Field(10.0, gt=0)
    max_attempts: int = Field(12, ge=1)
    backoff_initial_s: float = Field(5.0, gt=0)
    backoff_max_s: float = Field(900.0, gt=0)
    # how often an idle dispatcher looks for work (it wakes at once for its own findings)
    poll_interval_s: float = Field(2.0, gt=0)

    @field_validator("targets")
    @classmethod
    def _target_names(cls, targets: dict[str, AlertTarget]) -> dict[str, AlertTarget]:
        for name in targets:
            if not _valid_name(name):
                raise ValueError(f"target name {name!r} must match {NAME_PATTERN}")
        return targets

    @model_validator(mode="after")
    def _load_file_and_check(self) -> AlertSettings:
        if self.file is not None:
            extra = AlertFile.read(self.file)
            clash = set(extra.targets) & set(self.targets)
            if clash:
                raise ValueError(f"targets defined twice: {', '.join(sorted(clash))}")
            self.targets = {**self.targets, **extra.targets}
            self.rules = [*self.rules, *extra.rules]
        names = [rule.name for rule in self.rules]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"rule names repeat: {', '.join(repeated)}")
        for rule in self.rules:
            unknown = [t for t in rule.targets if t not in self.targets]
            if unknown:
                raise ValueError(f"rule {rule.name!r} names unknown targets: "
                                 f"{', '.join(unknown)}")
        if any(t.type == "apprise" for t in self.targets.values()):
            _require_apprise()
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.rules)


class AlertFile(BaseModel):
    """The TOML file's content: `[targets.NAME] url = "..."` tables and `[[rules]]`."""

    model_config = {"extra": "forbid"}

    targets: dict[str, AlertTarget] = Field(default_factory=dict)
    rules: list[AlertRule] = Field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> AlertFile:
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"cannot read alerts file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"alerts file {path} is not valid TOML: {exc}") from None
        return cls.model_validate(data)


def _valid_name(name: str) -> bool:
    return re.fullmatch(NAME_PATTERN, name) is not None


def _require_apprise() -> None:
    try:
        import apprise  # noqa: F401
    except ImportError:
        raise ValueError('apprise targets need the apprise library: '
                         'pip install "ampwatch[alerts]"') from None
