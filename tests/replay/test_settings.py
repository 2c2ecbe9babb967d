"""`attach(record=...)` values, and a replay model without the training wrappers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampwatch.agent.record_triggers import RecordSettings
from ampwatch.replay.step import matching_keys


def test_record_values(monkeypatch: pytest.MonkeyPatch) -> None:
    assert RecordSettings.parse(True) == RecordSettings()
    assert RecordSettings.parse(False) is None
    assert RecordSettings.parse("local").mode == "local"
    assert RecordSettings.parse({"loss_spike": None}).loss_spike is None
    monkeypatch.setenv("AMPWATCH_RECORD", "off")
    assert RecordSettings.parse(True) is None
    monkeypatch.setenv("AMPWATCH_RECORD", "local")
    monkeypatch.setenv("AMPWATCH_RECORD_MAX_BYTES", "1000")
    assert RecordSettings.parse(True) == RecordSettings(mode="local", max_bytes=1000)
    for bad in ("sometimes", {"loss_spikes": 3.0}, {"mode": "cloud"}, 3):
        with pytest.raises(ValueError):
            RecordSettings.parse(bad)


def test_the_model_factory_is_one_replay_takes() -> None:
    for spec in ("train:build_model", "my_pkg.models:make", "jobs/train.py:make"):
        assert RecordSettings.parse({"model_factory": spec}).model_factory == spec
    for bad in ("train", "train.build_model", "train:build; rm -rf ~", "my train.py:make", 3):
        with pytest.raises(ValueError, match="model_factory must be MODULE:FACTORY"):
            RecordSettings.parse({"model_factory": bad})


def test_attach_refuses_a_record_value_it_cannot_understand(attach) -> None:
    with pytest.raises(ValueError, match="record"):
        attach(nn.Linear(2, 2), None, record="sometimes")


def test_state_recorded_through_wrappers_loads_into_the_plain_model() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    for prefix in ("module.", "_orig_mod."):
        recorded = {prefix + k: v for k, v in model.state_dict().items()}
        model.load_state_dict(matching_keys(recorded, model))
    plain = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    assert matching_keys(plain, model) is plain
