"""Run ids and labels are checked in `attach` with API v1's own rules; a reused run id
must be asked for with `resume`."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import torch

from ampwatch import agent
from ampwatch.agent.transport.spool import Spool, run_dir
from ampwatch.wire import RUN_ID_RULE, check_run_id
from tests.agent.factories import batches, bf16_loop, mlp

HOSTILE_RUN_IDS = ["../../escaped", "..", ".", "a/b", "my run/1", "/etc/passwd", "a\x00b",
                   "séance", "ранний", "x" * 129, "", "-flag", ".hidden", "a\\b", "a b",
                   "a\nb", "C:\\x", "~root"]


def _files_under(path: Path) -> set[Path]:
    return set(path.rglob("*"))


@pytest.mark.parametrize("run_id", HOSTILE_RUN_IDS)
def test_hostile_run_ids_are_refused_before_anything_is_written(tmp_path, run_id) -> None:
    spool = tmp_path / "deep" / "spool"
    spool.mkdir(parents=True)
    before = _files_under(tmp_path)
    with pytest.raises(ValueError, match="ASCII letters, digits") as refused:
        agent.attach(mlp(), run=run_id, spool_dir=spool, offline=True)
    assert RUN_ID_RULE in str(refused.value)
    with pytest.raises(ValueError):
        run_dir(spool, run_id, 0)  # the spool itself refuses it too
    with pytest.raises(ValueError):
        Spool.for_run(spool, run_id, 0, 1 << 20)
    assert _files_under(tmp_path) == before


def test_a_hostile_run_id_from_the_environment_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_RUN_ID", "../../escaped")
    with pytest.raises(ValueError, match="invalid run id '../../escaped'"):
        agent.attach(mlp(), spool_dir=tmp_path, offline=True)
    assert not list(tmp_path.iterdir())


def test_a_refused_id_is_refused_even_when_disabled(tmp_path) -> None:
    with pytest.raises(ValueError):
        agent.attach(mlp(), run="a/b", enabled=False)


@pytest.mark.parametrize(("labels", "message"), [
    ({"project": "gpt\x00"}, "project 'gpt\\\\x00' holds a control character"),
    ({"project": ""}, "project must have 1 to 256 characters, not 0"),
    ({"name": "n" * 257}, "name must have 1 to 256 characters, not 257"),
    ({"tags": "fp16"}, "tags must be a list of strings, not str"),
    ({"tags": ["ok", "bad\nline"]}, "tag 'bad\\\\nline' holds a control character"),
    ({"tags": [3]}, "tag must be a string, not int"),
])
def test_labels_the_server_would_refuse_are_refused(tmp_path, labels, message) -> None:
    with pytest.raises(ValueError, match=message):
        agent.attach(mlp(), spool_dir=tmp_path, offline=True, **labels)
    assert not list(tmp_path.iterdir())


def test_the_agent_and_the_server_accept_the_same_run_ids(api) -> None:
    """One pattern (wire/runs.py) decides for both: PUT every candidate to the real app."""
    candidates = [c for c in HOSTILE_RUN_IDS if c and "/" not in c and c not in (".", "..")]
    candidates += ["a", "exp1", "A.b_c-9", "9" * 128, "run..1", "x-"]
    for run_id in candidates:
        try:
            check_run_id(run_id)
            agent_accepts = True
        except ValueError:
            agent_accepts = False
        reply = api.put(f"/api/v1/runs/{quote(run_id, safe='')}", json={})
        assert (reply.status_code in (200, 201)) == agent_accepts, (run_id, reply.text)


def _train(run: str | None, url: str, spool: Path, steps: int = 3, **kwargs
           ) -> agent.Attachment:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with agent.attach(model, run=run, server=url, spool_dir=spool, **kwargs) as attachment:
        bf16_loop(model, optimizer, batches(steps))
        assert attachment.flush(10)
    return attachment


def _steps(url: str, run_id: str) -> list[int]:
    reply = httpx.get(f"{url}/api/v1/runs/{run_id}/steps", params={"limit": 1000}, timeout=10)
    reply.raise_for_status()
    return [item["step"] for item in reply.json()["items"]]


def test_a_reused_run_id_needs_resume(live_server, tmp_path, monkeypatch) -> None:
    _train("exp1", live_server.url, tmp_path / "a")
    # another machine (empty spool): the server says the id is taken
    with pytest.raises(ValueError, match=r"run 'exp1' already has steps of rank 0 on the "
                                         r"server .* \(up to step 2\): pass resume=True"):
        _train("exp1", live_server.url, tmp_path / "b")
    # the same machine: the spool says so as well
    with pytest.raises(ValueError, match=r"in the spool .* and on the server"):
        _train("exp1", live_server.url, tmp_path / "a")
    assert _steps(live_server.url, "exp1") == [0, 1, 2]  # nothing was appended
    assert not list((tmp_path / "b").rglob("*.json.gz"))
    _train("exp1", live_server.url, tmp_path / "b", resume=True)
    monkeypatch.setenv("AMPWATCH_RESUME", "1")
    _train("exp1", live_server.url, tmp_path / "a", steps=2)
    assert _steps(live_server.url, "exp1") == list(range(8))


def test_the_spool_alone_refuses_a_reused_id_when_offline(tmp_path) -> None:
    _train("offline-exp", "http://127.0.0.1:9", tmp_path, offline=True)
    with pytest.raises(ValueError, match="in the spool"):
        _train("offline-exp", "http://127.0.0.1:9", tmp_path, offline=True)
    _train("offline-exp", "http://127.0.0.1:9", tmp_path, offline=True, resume=True)


def test_no_run_id_makes_a_new_run_each_time(live_server, tmp_path) -> None:
    first = _train(None, live_server.url, tmp_path)
    second = _train(None, live_server.url, tmp_path)
    assert first.run_id != second.run_id
    assert _steps(live_server.url, first.run_id) == _steps(live_server.url, second.run_id)


def test_the_run_id_can_come_from_the_environment(live_server, tmp_path,
                                                   monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_RUN_ID", "from-env")
    assert _train(None, live_server.url, tmp_path).run_id == "from-env"
    with pytest.raises(ValueError, match="already has steps"):
        _train(None, live_server.url, tmp_path)


@pytest.mark.parametrize(("env", "kwargs", "message"), [
    ({}, {"resume": True}, "resume needs the id of the run to continue"),
    ({"AMPWATCH_RESUME": "1"}, {}, "resume needs the id of the run to continue"),
    ({"AMPWATCH_RESUME": "maybe"}, {"run": "x"}, "AMPWATCH_RESUME='maybe'"),
])
def test_resume_without_a_run_id_or_unreadable_is_refused(tmp_path, monkeypatch, env,
                                                         kwargs, message) -> None:
    monkeypatch.delenv("AMPWATCH_RUN_ID", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=message):
        agent.attach(mlp(), spool_dir=tmp_path, offline=True, **kwargs)
    assert not os.listdir(tmp_path)
