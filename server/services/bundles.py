"""Flight-recorder bundles on the server: files on disk in `Settings.bundle_folder`, one
row each in `bundles`. The server reads a bundle's bundle.json (a zip member) and never
its tensors (it has no torch)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ampwatch.server.db import writing
from ampwatch.server.errors import AmpwatchServerError, InvalidInput, NotFound, TooMany
from ampwatch.server.findings.bisect_verdicts import reported_by
from ampwatch.server.models import Bundle, as_utc
from ampwatch.server.schemas.bundles import BundlePublic
from ampwatch.server.services.runs import get_run
from ampwatch.server.settings import Settings
from ampwatch.wire.bundles import META_NAME, bundle_name, model_factory

MAX_META_BYTES = 1 << 20
MAX_BUNDLES_PER_RUN = 1_000  # all ranks together; the agent keeps 5 a rank by default


class BundleSpaceFull(AmpwatchServerError):
    status_code = 507


def bundle_path(settings: Settings, run_id: str, rank: int, step: int) -> Path:
    """The file of one bundle; run ids are checked by the API (no path can escape)."""
    return settings.bundle_folder / run_id / f"rank-{rank}" / bundle_name(step)


def read_meta(path: Path) -> dict[str, Any]:
    """bundle.json of an uploaded file; InvalidInput when it is not a bundle."""
    try:
        with zipfile.ZipFile(path) as archive:
            info = archive.getinfo(META_NAME)
            if info.file_size > MAX_META_BYTES:
                raise InvalidInput("bundle.json is too large")
            meta = json.loads(archive.read(info))
    except (zipfile.BadZipFile, KeyError, ValueError) as exc:
        raise InvalidInput(f"not an ampwatch bundle: {exc}") from exc
    if not isinstance(meta, dict):
        raise InvalidInput("bundle.json is not an object")
    return meta


def bundle_count(session: Session, run_id: str) -> int:
    return int(session.scalar(select(func.count()).where(Bundle.run_id == run_id)) or 0)


def total_bytes(session: Session) -> int:
    return int(session.scalar(select(func.coalesce(func.sum(Bundle.bytes), 0))) or 0)


def store_bundle(session: Session, settings: Settings, run_id: str, rank: int, step: int,
                 upload: Path) -> Bundle:
    """Keep an uploaded bundle file (moved from `upload`); a re-sent step replaces it."""
    get_run(session, run_id)
    size = upload.stat().st_size
    meta = read_meta(upload)
    if meta.get("step") != step or meta.get("rank", rank) != rank:
        raise InvalidInput(f"the bundle is of rank {meta.get('rank')} step {meta.get('step')}, "
                           f"not rank {rank} step {step}")
    with writing(session):
        old = session.get(Bundle, (run_id, rank, step))
        if old is None and bundle_count(session, run_id) >= MAX_BUNDLES_PER_RUN:
            raise TooMany(f"run {run_id!r} holds the most bundles a run may, "
                          f"{MAX_BUNDLES_PER_RUN}: delete the run or keep fewer")
        if total_bytes(session) - (old.bytes if old else 0) + size > settings.bundle_total_bytes:
            raise BundleSpaceFull(f"the bundle folder holds its limit of "
                                  f"{settings.bundle_total_bytes} bytes "
                                  "(AMPWATCH_BUNDLE_TOTAL_BYTES)")
        target = bundle_path(settings, run_id, rank, step)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(upload, target)
        params = meta.get("params") or {}
        row = old or Bundle(run_id=run_id, rank=rank, step=step)
        row.trigger = str(meta.get("trigger") or "unknown")[:32]
        layer = meta.get("first_nonfinite_layer")
        row.first_nonfinite_layer = None if layer is None else str(layer)[:512]
        row.exact = bool(params.get("exact"))
        row.bytes = size
        row.meta = meta
        row.bisect = None  # a verdict judged the file this one replaces
        session.add(row)
        session.commit()
    return row


def list_bundles(session: Session, run_id: str) -> list[Bundle]:
    get_run(session, run_id)
    return list(session.scalars(select(Bundle).where(Bundle.run_id == run_id)
                                .order_by(Bundle.step, Bundle.rank)))


def get_bundle(session: Session, settings: Settings, run_id: str, rank: int,
               step: int) -> tuple[Bundle, Path]:
    row = session.get(Bundle, (run_id, rank, step))
    path = bundle_path(settings, run_id, rank, step)
    if row is None or not path.is_file():
        raise NotFound(f"no bundle of run {run_id!r} rank {rank} step {step}")
    return row, path


def record_bisect(session: Session, settings: Settings, run_id: str, rank: int, step: int,
                  verdict: dict[str, Any]) -> Bundle:
    """Keep what `ampwatch replay --bisect` found for a bundle (JSON-ready, validated by
    the API); a later verdict replaces it. NotFound when the server has no such bundle."""
    with writing(session):
        row, _ = get_bundle(session, settings, run_id, rank, step)
        row.bisect = verdict
        session.commit()
    return row


def token_identity(token: SecretStr) -> str:
    """A token named without giving it away: the first 8 hex digits of its SHA-256."""
    return hashlib.sha256(token.get_secret_value().encode()).hexdigest()[:8]


def remove_bundle_files(settings: Settings, run_id: str) -> None:
    """A deleted run's bundle files (its rows went with the run: ON DELETE CASCADE)."""
    shutil.rmtree(settings.bundle_folder / run_id, ignore_errors=True)


def public_bundle(row: Bundle) -> BundlePublic:
    return BundlePublic(run_id=row.run_id, rank=row.rank, step=row.step, trigger=row.trigger,
                        first_nonfinite_layer=row.first_nonfinite_layer, exact=row.exact,
                        bytes=row.bytes, created_at=as_utc(row.created_at),
                        url=f"/api/v1/runs/{row.run_id}/bundles/{row.rank}/{row.step}",
                        # what the agent wrote, unchecked: only a well-formed spec is shown
                        model_factory=model_factory((row.meta or {}).get("model_factory")),
                        bisect=row.bisect and {**row.bisect,
                                               "reported_by": reported_by(row.bisect)})
