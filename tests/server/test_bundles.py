"""Bundles on the server: upload (streamed, past the JSON body limit), list, download,
limits, and gone with their run. The bundle is a real one, from real CPU training."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from pydantic import SecretStr

from ampwatch import agent
from ampwatch.client import Client
from ampwatch.server.app import close_app, create_app
from ampwatch.server.schemas.bundles import BundlePublic
from tests.conftest import judged_client
from tests.replay.faults import FAULTS, train
from tests.utils import meta_only_bundle, register_run


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A bundle the recorder wrote for a NaN input at step 8 (offline, kept locally)."""
    folder = tmp_path_factory.mktemp("kept")
    torch.set_num_threads(1)
    _, attachment = train(FAULTS[2], lambda m, s, record: agent.attach(
        m, s, run="made-1", offline=True, spool_dir=folder / "spool", record=record),
        record={"mode": "local", "folder": str(folder / "bundles")})
    attachment.detach()
    (path,) = (folder / "bundles").glob("*.ampbundle")
    return path.read_bytes()


def _upload(api, run_id: str, step: int, body: bytes, rank: int = 0,
            media: str = "application/zip"):
    return api.put(f"/api/v1/runs/{run_id}/bundles/{rank}/{step}", content=body,
                   headers={"Content-Type": media})


def test_upload_list_download_delete(api, app, bundle: bytes) -> None:
    register_run(api, "run-b")
    stored = _upload(api, "run-b", 8, bundle)
    assert stored.status_code == 200
    assert set(stored.json()) == set(BundlePublic.model_fields)  # its declared model
    listed = api.get("/api/v1/runs/run-b/bundles").json()["items"]
    assert [(b["step"], b["trigger"], b["first_nonfinite_layer"], b["exact"], b["bytes"])
            for b in listed] == [(8, "forward_nonfinite", "inp", True, len(bundle))]
    download = api.get(listed[0]["url"])
    assert download.status_code == 200 and download.content == bundle
    head = api.head(listed[0]["url"])  # what a download would be, without the body
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) == len(bundle)
    assert head.headers["content-type"] == "application/zip"
    page = api.get("/runs/run-b").text  # the run page lists it with the commands
    assert "ampwatch bundles pull run-b 8</code>" in page
    assert "ampwatch replay --run run-b --step 8 --model MODULE:FACTORY --bisect" in page
    assert "not run</span>" in page  # no bisect verdict yet
    folder = app.state.settings.bundle_folder / "run-b"
    assert folder.is_dir()
    assert api.delete("/api/v1/runs/run-b").status_code == 204
    assert not folder.exists()
    assert api.get("/api/v1/runs/run-b/bundles").status_code == 404


def test_upload_past_the_json_body_limit(api, app, bundle: bytes) -> None:
    """A bundle holds a model: far past the 64 MiB of a batch; it streams to disk."""
    app.state.settings.max_body_bytes = 1024
    register_run(api, "run-big")
    assert _upload(api, "run-big", 8, bundle).status_code == 200


def test_refused_uploads(api, app, bundle: bytes) -> None:
    register_run(api, "run-r")
    assert _upload(api, "run-r", 9, bundle).status_code == 422  # bundle.json says step 8
    assert _upload(api, "run-r", 8, b"not a zip").status_code == 422
    empty = io.BytesIO()
    with zipfile.ZipFile(empty, "w") as archive:
        archive.writestr("bundle.json", json.dumps([1]))
    assert _upload(api, "run-r", 8, empty.getvalue()).status_code == 422
    assert _upload(api, "run-r", 8, bundle, media="application/json").status_code == 422
    assert _upload(api, "no-such-run", 8, bundle).status_code == 404
    app.state.settings.bundle_max_bytes = len(bundle) - 1
    assert _upload(api, "run-r", 8, bundle).status_code == 413
    app.state.settings.bundle_max_bytes = 10 * len(bundle)
    app.state.settings.bundle_total_bytes = len(bundle) - 1
    assert _upload(api, "run-r", 8, bundle).status_code == 507
    assert api.get("/api/v1/runs/run-r/bundles").json()["items"] == []
    assert not any(Path(app.state.settings.bundle_folder).rglob("*.part"))


NOT_PRECISION = {"verdict": "not_precision", "trials": 2, "device": "cpu",
                 "reason": "no upcast fixes this step: the cause is not the precision",
                 "ran_at": "2026-11-29T10:00:00+00:00"}


def test_bisect_verdict_is_checked_then_kept_with_its_bundle(api, bundle: bytes) -> None:
    """PUT .../bisect: a bundle the server lacks is 404, a verdict that contradicts
    itself or lacks a field is 422, and neither stores anything; a good one is kept with
    the bundle (the client reads it back) until the bundle is re-sent."""
    register_run(api, "run-v")
    assert _upload(api, "run-v", 8, bundle).status_code == 200

    def put(body: dict, run_id: str = "run-v", rank: int = 0, step: int = 8):
        return api.put(f"/api/v1/runs/{run_id}/bundles/{rank}/{step}/bisect", json=body)

    def stored() -> dict | None:
        (listed,) = api.get("/api/v1/runs/run-v/bundles").json()["items"]
        return listed["bisect"]

    assert put(NOT_PRECISION, run_id="no-such-run").status_code == 404
    assert put(NOT_PRECISION, step=9).status_code == 404
    assert put(NOT_PRECISION, rank=1).status_code == 404
    fixed = {**NOT_PRECISION, "verdict": "fixed", "modules": ["mid.proj"], "reason": None,
             "fix": "KEEP_FP32 = ['mid.proj']"}
    for bad in ({**NOT_PRECISION, "verdict": "fixed"},  # fixed by no module
                {**NOT_PRECISION, "modules": ["mid"]},  # modules that fixed nothing
                {**fixed, "fp8_modules": ["inp"]},  # an FP8 module it did not keep
                {**NOT_PRECISION, "verdict": "maybe"},
                {**NOT_PRECISION, "trials": 0},
                {**NOT_PRECISION, "ran_at": "2026-11-29T10:00:00"},  # no time zone
                {**NOT_PRECISION, "modules": [""]},
                {**NOT_PRECISION, "layer": "fc2"},  # a field the API does not know
                {k: v for k, v in NOT_PRECISION.items() if k != "verdict"},
                {**NOT_PRECISION, "fix": "x" * 64_001}):
        answer = put(bad)
        assert answer.status_code == 422, (bad, answer.text)
        assert answer.json()["detail"]
    assert api.put("/api/v1/runs/run-v/bundles/0/8/bisect", content=b"[1",
                   headers={"Content-Type": "application/json"}).status_code == 422
    assert stored() is None

    answer = put(fixed)
    assert answer.status_code == 200
    assert set(answer.json()) == set(BundlePublic.model_fields)
    with Client(http_client=api) as client:
        info = client.record_bisect("run-v", 8, NOT_PRECISION)  # a later verdict replaces
        (listed,) = client.bundles("run-v")
    assert listed == info
    assert (info.bisect.verdict, info.bisect.modules, info.bisect.trials) == (
        "not_precision", [], 2)
    assert info.bisect.ran_at == datetime(2026, 11, 29, 10, tzinfo=UTC)
    assert info.bisect.recorded_at >= info.created_at
    assert stored()["verdict"] == "not_precision"
    assert _upload(api, "run-v", 8, bundle).status_code == 200  # a re-sent file: unjudged
    assert stored() is None


def test_the_page_prints_the_factory_the_run_recorded(api) -> None:
    register_run(api, "run-f")
    assert _upload(api, "run-f", 1, meta_only_bundle(1, model_factory="train:build_model")
                   ).status_code == 200
    assert _upload(api, "run-f", 2, meta_only_bundle(2, model_factory="jobs/a_1/train.py:make")
                   ).status_code == 200
    assert _upload(api, "run-f", 3, meta_only_bundle(3)).status_code == 200
    listed = api.get("/api/v1/runs/run-f/bundles").json()["items"]
    assert [b["model_factory"] for b in listed] == ["train:build_model",
                                                    "jobs/a_1/train.py:make", None]
    page = api.get("/runs/run-f").text
    assert "ampwatch replay --run run-f --step 1 --model train:build_model --bisect" in page
    assert "ampwatch replay --run run-f --step 2 --model jobs/a_1/train.py:make --bisect" \
        in page
    # the one without a factory: the placeholder, and one line on what to put there
    assert "ampwatch replay --run run-f --step 3 --model MODULE:FACTORY --bisect" in page
    assert page.count("the run recorded none") == 1


@pytest.mark.parametrize("factory", [
    "train:build; touch /tmp/owned", "$(touch /tmp/owned):f", "`id`.py:f", "a:b\nrm -rf ~",
    "train:build &", "'x':y", "my train.py:build", "train", ":build", 42, ["train:build"],
])
def test_a_factory_that_is_not_one_is_never_printed(api, factory: object) -> None:
    """A bundle from another team names its factory in words people paste into a shell:
    anything but MODULE:FACTORY is dropped, and the page prints the placeholder."""
    register_run(api, "run-h")
    assert _upload(api, "run-h", 1, meta_only_bundle(1, model_factory=factory)).status_code == 200
    (listed,) = api.get("/api/v1/runs/run-h/bundles").json()["items"]
    assert listed["model_factory"] is None
    page = api.get("/runs/run-h").text
    assert "ampwatch replay --run run-h --step 1 --model MODULE:FACTORY --bisect" in page
    assert "owned" not in page and "rm -rf" not in page and "`id`" not in page


def test_verdicts_and_bundles_are_bounded(api, monkeypatch) -> None:
    """A verdict is at most 1,000 names and 64,000 characters in all (one was 10 MB:
    10,000 names of 512 characters twice and a 64 KB fix), a run at most
    MAX_BUNDLES_PER_RUN bundles: 422 and 413, nothing stored."""
    register_run(api, "run-cap")
    assert _upload(api, "run-cap", 1, meta_only_bundle(1)).status_code == 200
    names = [f"{i:04d}" + "m" * 508 for i in range(10_000)]
    huge = {**NOT_PRECISION, "verdict": "fixed", "modules": names, "fp8_modules": names,
            "reason": None, "fix": "x" * 64_000}
    wide = {**huge, "modules": names[:1_000], "fp8_modules": [], "fix": None}
    for bad in (huge, wide, {**wide, "modules": names[:130], "fix": "x" * 10}):
        answer = api.put("/api/v1/runs/run-cap/bundles/0/1/bisect", json=bad)
        assert answer.status_code == 422, answer.text[:200]
        assert len(answer.content) < 4096
    (listed,) = api.get("/api/v1/runs/run-cap/bundles").json()["items"]
    assert listed["bisect"] is None

    monkeypatch.setattr("ampwatch.server.services.bundles.MAX_BUNDLES_PER_RUN", 2)
    assert _upload(api, "run-cap", 2, meta_only_bundle(2)).status_code == 200
    assert _upload(api, "run-cap", 3, meta_only_bundle(3)).status_code == 413
    assert _upload(api, "run-cap", 2, meta_only_bundle(2)).status_code == 200  # a re-sent step
    assert [b["step"] for b in api.get("/api/v1/runs/run-cap/bundles").json()["items"]] == [
        1, 2]


def test_a_verdict_says_who_reported_it(api, settings, tmp_path) -> None:
    """The server runs no replay: a verdict is what a sender reported. It names the
    sender's own `source` and how it got in (which token, by a short hash, or none)."""
    register_run(api, "run-who")
    assert _upload(api, "run-who", 1, meta_only_bundle(1)).status_code == 200
    claimed = {**NOT_PRECISION, "source": "ampwatch replay 0.1.0 on gpu-box"}
    answer = api.put("/api/v1/runs/run-who/bundles/0/1/bisect", json=claimed)
    assert answer.json()["bisect"]["reported_by"] == (
        "ampwatch replay 0.1.0 on gpu-box without a token, unverified")
    answer = api.put("/api/v1/runs/run-who/bundles/0/1/bisect", json=NOT_PRECISION)
    assert answer.json()["bisect"]["reported_by"] == (
        "an unnamed sender without a token, unverified")
    assert api.put("/api/v1/runs/run-who/bundles/0/1/bisect", json={
        **NOT_PRECISION, "source": "replay\u202egpu"}).status_code == 422

    token = create_app(settings.model_copy(update={"token": SecretStr("s3cret"),
                                                   "bundle_folder": tmp_path / "b"}))
    with judged_client(token, headers={"Authorization": "Bearer s3cret"}) as holder:
        register_run(holder, "run-who")
        assert _upload(holder, "run-who", 1, meta_only_bundle(1)).status_code == 200
        answer = holder.put("/api/v1/runs/run-who/bundles/0/1/bisect", json=claimed)
        assert answer.json()["bisect"]["reported_by"] == (
            "ampwatch replay 0.1.0 on gpu-box with the server's token "
            f"{hashlib.sha256(b's3cret').hexdigest()[:8]}")
    close_app(token)
