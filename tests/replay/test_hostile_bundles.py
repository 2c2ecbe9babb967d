"""A bundle from elsewhere is data, never code: `ampwatch replay --bisect` of a hostile
bundle prints no code of its own and no terminal escape, refuses an autocast dtype outside
the closed set, and never unpickles a tensor file (docs/security.md, issue 61)."""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from ampwatch.agent.bundle import UNSUPPORTED, encode
from ampwatch.client.cli import main
from ampwatch.replay import load
from ampwatch.replay.bundle import BundleError
from ampwatch.wire.bundles import META_NAME, STATE_NAME

CODE = "float16\nimport os; os.system('touch /tmp/ampwatch-pwned')  #"
ESCAPES = "\x1b]8;;https://evil.example\x07click\x1b]8;;\x07\x1b[2J\x1b]0;title\x07\x9b31m\r"


class Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x  # 300**2 overflows float16


class HalfNet(nn.Module):
    """Runs natively in float16 (no autocast): `square` overflows, float32 fixes it."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4, dtype=torch.float16))
        self.square = Square()

    def forward(self, x: torch.Tensor, note: object = None) -> torch.Tensor:
        return self.square(x * self.gain).float().mean()


def build() -> nn.Module:
    return HalfNet()


def _meta(**changes: object) -> dict:
    meta = {"format": 1, "run_id": f"run{ESCAPES}{CODE}", "rank": 0, "step": 7,
            "trigger": f"nonfinite{ESCAPES}{CODE}",
            "first_nonfinite_layer": f"square{ESCAPES}{CODE}", "loss": None,
            "autocast": {"device_type": "cpu", "dtype": None},
            "scaler": None, "params": {"exact": True},
            "optimizer": {"class": CODE + ESCAPES, "param_groups": []},
            "environment": {"torch_version": CODE, "device": ESCAPES}}
    meta.update(changes)
    return meta


def _state() -> dict:
    return {"batches": [((torch.full((4,), 300.0, dtype=torch.float16),),
                         {"note": {UNSUPPORTED: f"<object{ESCAPES}{CODE}>"}})],
            "model": HalfNet().state_dict(), "rng": {"cpu": torch.get_rng_state()}}


def _write(path: Path, meta: dict, state: dict | None = None) -> Path:
    path.write_bytes(encode(meta, state or _state()))
    return path


def _replay(path: Path, *extra: str) -> int:
    return main(["replay", str(path), "--model", f"{__name__}:build", "--bisect",
                 "--no-record", *extra])


def test_strings_are_printed_as_text_and_the_fix_holds_none_of_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path / "hostile.ampbundle", _meta())
    assert _replay(path) == 0
    out = capsys.readouterr().out
    assert "keeping square in float32 makes the step finite" in out
    for control in ("\x1b", "\x07", "\x9b", "\r"):
        assert control not in out
    assert "\\x1b]8;;https://evil.example" in out  # shown, inert
    fix = out.split("Fix:\n", 1)[1]
    assert "os.system" not in fix and "\\x" not in fix
    assert "overflow in float16; run them in float32" in fix
    namespace: dict = {}
    exec(fix, namespace)  # what a user pastes runs, and defines only the fix
    assert namespace["KEEP_FP32"] == ["square"]
    assert not os.path.exists("/tmp/ampwatch-pwned")


@pytest.mark.parametrize("autocast", [
    {"device_type": "cpu", "dtype": CODE},
    {"device_type": "cpu", "dtype": "float64"},
    {"device_type": "cpu", "dtype": ["float16"]},
    {"device_type": f"cpu'); {CODE}", "dtype": "float16"},
    "float16",
])
def test_an_unknown_autocast_is_refused_on_load(tmp_path: Path, autocast: object) -> None:
    path = _write(tmp_path / "dtype.ampbundle", _meta(autocast=autocast))
    with pytest.raises(BundleError, match="autocast"):
        load(path)
    with pytest.raises(SystemExit, match="autocast") as exited:
        _replay(path)
    assert "\n" not in str(exited.value) and "\x1b" not in str(exited.value)


@pytest.mark.parametrize("field,value", [
    ("step", "7; import os"), ("trigger", 5), ("first_nonfinite_layer", ["x"]),
    ("loss", "nan"), ("run_id", {"a": 1}), ("scaler", {"scale": "65536"}),
])
def test_fields_of_the_wrong_type_are_refused_on_load(tmp_path: Path, field: str,
                                                      value: object) -> None:
    path = _write(tmp_path / "types.ampbundle", _meta(**{field: value}))
    with pytest.raises(BundleError, match=field):
        load(path)


class Payload:
    def __reduce__(self) -> tuple:
        return (os.system, ("touch /tmp/ampwatch-pwned",))


@pytest.mark.parametrize("key", ["batches", "model", "rng"])
def test_a_pickle_in_a_tensor_file_is_refused_unread(tmp_path: Path, key: str) -> None:
    """state.pt is the bundle's one tensor file: a pickled object anywhere in it (the
    batches, the weights, the RNG states) is refused by weights_only, and never runs."""
    state = _state()
    state[key] = Payload() if key != "model" else {"gain": Payload()}
    tensors = io.BytesIO()
    torch.save(state, tensors)  # the pickle as an attacker writes it
    path = tmp_path / f"pickle-{key}.ampbundle"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(META_NAME, json.dumps(_meta()))
        archive.writestr(STATE_NAME, tensors.getvalue())
    with pytest.raises(pickle.UnpicklingError):
        load(path)
    with pytest.raises(SystemExit, match="holds more than tensors"):
        _replay(path)
    assert not os.path.exists("/tmp/ampwatch-pwned")
