"""`ampwatch bundles pull`: the replay command it prints runs as printed when the run
recorded its factory, and holds the placeholder, said so, when it did not (or when the
bundle's word for it is not one)."""

from __future__ import annotations

import shlex
from pathlib import Path

import httpx
import pytest

from ampwatch.client.cli import main
from tests.utils import meta_only_bundle, register_run


@pytest.mark.parametrize(("run_id", "factory", "shown"), [
    ("pull-named", "train:build_model", "train:build_model"),
    ("pull-unnamed", None, "MODULE:FACTORY"),
    ("pull-hostile", "train:build;touch owned", "MODULE:FACTORY"),
])
def test_pull_prints_the_replay_command_of_the_recorded_factory(
        server, tmp_path: Path, capsys: pytest.CaptureFixture, run_id: str,
        factory: str | None, shown: str) -> None:
    with httpx.Client(base_url=server.url) as api:
        register_run(api, run_id)
        body = meta_only_bundle(3, **({} if factory is None else {"model_factory": factory}))
        assert api.put(f"/api/v1/runs/{run_id}/bundles/0/3", content=body,
                       headers={"Content-Type": "application/zip"}).status_code == 200
    assert main(["bundles", "pull", run_id, "3", "--server", server.url,
                 "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    printed = out.split("replay it: ", 1)[1].splitlines()[0]
    pulled = str(tmp_path / "step-000000003.ampbundle")
    assert shlex.split(printed) == ["ampwatch", "replay", pulled, "--model", shown, "--bisect",
                                    "--server", server.url]
    assert ("the run recorded none" in out) == (shown == "MODULE:FACTORY")
    assert "owned" not in out
