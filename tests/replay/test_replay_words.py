"""What `ampwatch replay` tells its user, read as the user reads it (issue #59, item 8):
a mistyped --model is one line and exit 2, no traceback; a step flagged as a loss spike
that is finite in float32 is told so, not that float32 "does not make it finite"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ampwatch.agent.bundle import encode
from ampwatch.client.cli import main

ROOT = Path(__file__).parents[2]


class Spiky(nn.Module):
    """A float32 model whose loss is 1e4 on the bundle's batch: finite in any precision,
    a spike against a baseline of 1."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.gain).pow(2).mean()


def build() -> nn.Module:
    return Spiky()


def spike_bundle(path: Path) -> Path:
    meta = {"format": 1, "run_id": "spiky", "rank": 0, "step": 9, "trigger": "loss_spike",
            "loss": 1e4, "loss_baseline": 1.0, "loss_spike_factor": 10.0,
            "first_nonfinite_layer": None, "autocast": {"device_type": "cpu", "dtype": None},
            "scaler": None, "params": {"exact": True},
            "optimizer": {"class": "SGD", "param_groups": []}, "environment": {}}
    state = {"batches": [((torch.full((4,), 100.0),), {})], "model": Spiky().state_dict(),
             "rng": {"cpu": torch.get_rng_state()}}
    path.write_bytes(encode(meta, state))
    return path


@pytest.mark.parametrize(("model", "said"), [
    ("tests.replay.test_replay_wordz:build",
     "ampwatch replay: cannot import 'tests.replay.test_replay_wordz' (--model "
     "tests.replay.test_replay_wordz:build): ModuleNotFoundError: No module named "
     "'tests.replay.test_replay_wordz'"),
    ("tests.replay.test_replay_words:bild",
     "ampwatch replay: 'tests.replay.test_replay_words' has no function 'bild' (--model "
     "tests.replay.test_replay_words:bild)"),
    ("nothing", "ampwatch replay: --model must be MODULE:FACTORY, got 'nothing'"),
])
def test_a_mistyped_model_is_one_line_and_exit_2(tmp_path: Path, model: str, said: str):
    bundle = spike_bundle(tmp_path / "spike.ampbundle")
    done = subprocess.run([sys.executable, "-m", "ampwatch.client.cli", "replay", str(bundle),
                           "--model", model], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [said]
    assert done.stdout == ""


def test_a_spike_finite_in_float32_is_told_so(tmp_path: Path, capsys):
    bundle = spike_bundle(tmp_path / "spike.ampbundle")
    assert main(["replay", str(bundle), "--model", f"{__name__}:build", "--bisect",
                 "--no-record"]) == 0
    out = capsys.readouterr().out
    assert "does not make it finite" not in out
    assert ("with every module in float32 the step is finite (loss 10000); it was flagged "
            "as a loss spike (over 10), not an overflow") in out, out
