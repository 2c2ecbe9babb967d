"""A bundle travels like batches: the agent's sender uploads it to a real server process
once the run's batches are in; `ampwatch bundles` lists it, `ampwatch bundles pull` brings
it back, and `ampwatch replay` runs the pulled file."""

from __future__ import annotations

import shlex
import socket
from importlib import metadata
from pathlib import Path

import httpx
import pytest

from ampwatch import agent
from ampwatch.client import Client
from ampwatch.client.cli import main
from tests.conftest import free_port
from tests.replay.faults import FAULTS, train


def test_bundle_reaches_the_server_and_comes_back(live_server, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    fault = FAULTS[2]  # NaN in the input at step 8
    factory = tmp_path / "nan_model.py"
    factory.write_text("from tests.replay.faults import FAULTS, build\n\n\n"
                       "def make():\n    return build(FAULTS[2])\n")
    _, attachment = train(fault, lambda m, s, record: agent.attach(
        m, s, run="flight-1", server=live_server.url, spool_dir=tmp_path / "spool",
        record={**record, "model_factory": f"{factory}:make"}))
    assert attachment.detach(timeout=30)
    with Client(live_server.url) as client:
        (info,) = client.bundles("flight-1")
        client.wait_for_analysis("flight-1")  # the page's card shows once it is judged
    assert (info.step, info.trigger, info.first_nonfinite_layer) == (8, "forward_nonfinite",
                                                                      "inp")
    assert not list((tmp_path / "spool").rglob("*.ampbundle"))  # delivered, so gone
    page = httpx.get(f"{live_server.url}/runs/flight-1", timeout=30).text
    assert 'class="bundle-link" href="/api/v1/runs/flight-1/bundles/0/8"' in page

    assert main(["bundles", "flight-1", "--server", live_server.url]) == 0
    assert "forward_nonfinite" in capsys.readouterr().out
    assert main(["bundles", "pull", "flight-1", "8", "--server", live_server.url,
                 "-o", str(tmp_path)]) == 0
    pulled = tmp_path / "step-000000008.ampbundle"
    assert pulled.is_file()
    # the command it prints names the factory the run recorded, and runs as printed
    printed = capsys.readouterr().out.split("replay it: ", 1)[1].strip()
    command = shlex.split(printed)
    assert command == ["ampwatch", "replay", str(pulled), "--model", f"{factory}:make",
                       "--bisect", "--server", live_server.url]
    assert main(["replay", str(pulled), "--model", f"{factory}:make"]) == 0
    out = capsys.readouterr().out
    assert "reproduced: yes" in out and "first non-finite layer inp" in out

    # a bisect records its verdict on a server it is told of, and only then
    nowhere = f"http://127.0.0.1:{free_port()}"
    for kept_local in (["--no-record", "--server", live_server.url], ["--server", nowhere]):
        assert main(["replay", str(pulled), "--model", f"{factory}:make", "--bisect",
                     *kept_local]) == 0
    assert "the verdict was not recorded on" in capsys.readouterr().err
    with Client(live_server.url) as client:
        assert client.bundles("flight-1")[0].bisect is None
    assert main(command[1:]) == 0
    assert "verdict recorded on the server with the bundle (run flight-1, rank 0, step 8)" \
        in capsys.readouterr().out
    with Client(live_server.url) as client:
        verdict = client.bundles("flight-1")[0].bisect
        assert verdict.verdict == "input_nonfinite"
        assert verdict.reported_by == (f"ampwatch replay {metadata.version('ampwatch')} on "
                                       f"{socket.gethostname()} without a token, unverified")
        (incident,) = [i for i in client.incidents("flight-1") if i.step == 8]
    assert incident.fix.startswith("Replaying step 8 fails in any precision: its input "
                                   "holds inf/NaN")


def test_offline_bundle_uploads_with_ampwatch_sync(live_server, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMPWATCH_MODE", "offline")
    spool = tmp_path / "spool"
    _, attachment = train(FAULTS[2], lambda m, s, record: agent.attach(
        m, s, run="offline-1", spool_dir=spool, record=record))
    assert attachment.detach(timeout=30)
    assert len(list(spool.rglob("*.ampbundle"))) == 1
    assert main(["sync", str(spool), "--server", live_server.url, "--no-progress"]) == 0
    with Client(live_server.url) as client:
        assert [b.step for b in client.bundles("offline-1")] == [8]
    assert not list(spool.rglob("*.ampbundle"))
