"""The wire contract has one home (wire/, installed as ampwatch.wire): nothing in the
agent, the client or the server defines a second copy of its constants or helpers."""

from __future__ import annotations

import inspect
import re
import subprocess
from pathlib import Path
from typing import get_args

import pytest

from ampwatch import wire
from ampwatch.wire import batch, bundles, floats, runs, spool

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agent", "client", "server", "integrations", "demo")


def _contract_names() -> set[str]:
    """Every public constant and function the wire modules define."""
    names = set()
    for module in (batch, floats, runs, spool):
        for name, value in vars(module).items():
            if name.startswith("_") or inspect.ismodule(value):
                continue
            defined_here = (not callable(value) or getattr(value, "__module__", None)
                            == module.__name__)
            if defined_here and (name.isupper() or inspect.isfunction(value)):
                names.add(name)
    return names


def test_the_scan_sees_the_contract():
    names = _contract_names()
    assert {"FINISHED_EVENT", "DEFAULT_SERVER", "RUN_ID_PATTERN", "SUFFIX", "FORMAT",
            "default_spool_dir", "atomic_write", "encode_float_array"} <= names


@pytest.mark.parametrize("package", PACKAGES)
def test_no_second_copy_of_the_contract(package):
    names = _contract_names()
    definition = re.compile(r"^(?:def (\w+)\(|(\w+)(?:: [^=]+)? = )", re.M)
    copies = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for match in definition.finditer(path.read_text()):
            name = match.group(1) or match.group(2)
            if name in names or name.lstrip("_") in names:
                copies.append(f"{path.relative_to(ROOT)}: {name}")
    assert not copies, f"defined again outside wire/: {copies}"


def test_one_spool_dir_for_agent_and_sync(monkeypatch, tmp_path):
    from ampwatch.agent.settings import AgentSettings

    monkeypatch.setenv("AMPWATCH_SPOOL_DIR", str(tmp_path / "here"))
    assert spool.default_spool_dir() == tmp_path / "here"
    assert AgentSettings(run_id="r", run_id_generated=False).spool_dir == tmp_path / "here"
    monkeypatch.delenv("AMPWATCH_SPOOL_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert spool.default_spool_dir() == tmp_path / "cache" / "ampwatch" / "spool"
    assert AgentSettings(run_id="r", run_id_generated=False).spool_dir == \
        tmp_path / "cache" / "ampwatch" / "spool"


def test_fp8_layout_matches_the_server_schema():
    from ampwatch.server.schemas.batches import Fp8In, Fp8TensorIn

    assert tuple(Fp8In.model_fields) == wire.FP8_ROLES
    assert tuple(Fp8TensorIn.model_fields) == wire.FP8_STATS


# the storage order of the per-step scalars when they got one declaration: append only
STORED_SCALARS = (
    "step", "loss_scale", "scale_after", "skipped", "grad_norm", "grad_norm_clipped", "loss",
    "lr", "t_forward_ms", "t_backward_ms", "t_optimizer_ms", "t_step_ms", "peak_mem_bytes",
    "input_nonfinite", "autocast_dtype", "scheduler_steps", "scaler_updates",
    "clip_before_unscale", "eval_forwards", "eval_forwards_no_autocast", "forward_nonfinite",
    "first_nonfinite_layer")


def test_every_step_field_consumer_follows_its_one_declaration():
    """wire/steps.py declares each per-step scalar once; every consumer takes its list
    from there, and a consumer that fell out of step fails here."""
    import dataclasses

    from ampwatch.client.models import Step
    from ampwatch.server.pages.columns import StepColumns
    from ampwatch.server.pages.views import overview_figures
    from ampwatch.server.schemas.batches import StepIn
    from ampwatch.server.schemas.series import StepPublic
    from ampwatch.server.store import series
    from ampwatch.wire.steps import STEP_FIELDS, Chart, doc_row, names

    declared = names()
    assert len(set(declared)) == len(declared)
    assert declared[:len(STORED_SCALARS)] == STORED_SCALARS, "the storage order changed"
    assert declared == series.SCALAR_FIELDS
    assert {f.name for f in STEP_FIELDS if f.type == "bool"} == series.BOOL_FIELDS
    assert tuple(StepIn.model_fields)[:len(declared)] == declared
    assert tuple(StepPublic.model_fields) == ("rank", *declared)
    assert tuple(f.name for f in dataclasses.fields(Step)) == ("rank", *declared)
    assert tuple(f.name for f in STEP_FIELDS if f.chart) == StepColumns.FIELDS
    # every chart a field may name is one the run page draws
    drawn = set(re.findall(r'"(\w+)": |charts\["(\w+)"\]', inspect.getsource(overview_figures)))
    assert set(get_args(Chart)) <= {a or b for a, b in drawn}
    doc = (ROOT / "docs" / "wire-format.md").read_text()
    missing = [f.name for f in STEP_FIELDS if doc_row(f) not in doc]
    assert not missing, f"docs/wire-format.md's step table lacks doc_row() of {missing}"


def test_spike_signals_are_one_contract_for_the_agent_and_the_server():
    """The `spikes` object's signal names live in wire/: the server's schema takes them in
    that order (its storage order), and every signal the agent writes is one of them."""
    from ampwatch.server.schemas.batches import SpikesIn

    assert tuple(SpikesIn.model_fields) == wire.SPIKE_SIGNALS
    source = (ROOT / "agent" / "collectors" / "spikes.py").read_text()
    written = set(re.findall(r'out\["(\w+)"\]', source))
    written |= set(re.findall(r'for i, name in enumerate\(\(([^)]*)\)\)', source)[0]
                   .replace('"', "").replace(" ", "").split(","))
    weights = (ROOT / "agent" / "collectors" / "weights.py").read_text()
    written |= set(re.findall(r'setdefault\("spikes", \{\}\)\["(\w+)"\]', weights))
    assert written == set(wire.SPIKE_SIGNALS)


@pytest.mark.parametrize(("factory", "shown"), [
    ("train:build_model", "train:build_model"),
    ("runs/exp-1/train.py:make", "runs/exp-1/train.py:make"),
    (None, "MODULE:FACTORY"),
    ("train:build; touch owned", "MODULE:FACTORY"),
    ("$(touch owned).py:f", "MODULE:FACTORY"),
])
def test_a_replay_command_reaches_a_shell_as_its_arguments(tmp_path, factory, shown):
    """What the run page and `ampwatch bundles pull` print, parsed by a real shell: each
    argument arrives whole, and nothing in a bundle's words runs."""
    path = str(tmp_path / "it's a $(touch owned) `id`; folder" / "step-000000008.ampbundle")
    server = "http://127.0.0.1:8000/?a=1&b=$(touch owned)"
    for command, arguments in [
        (bundles.replay_command(factory, path=path, server=server),
         [path, "--model", shown, "--bisect", "--server", server]),
        (bundles.replay_command(factory, run_id="run-1", step=8, rank=2),
         ["--run", "run-1", "--step", "8", "--rank", "2", "--model", shown, "--bisect"]),
    ]:
        assert command.startswith("ampwatch replay ")
        words = command.removeprefix("ampwatch replay ")
        done = subprocess.run(["/bin/sh", "-c", f"printf '%s\\0' {words}"], cwd=tmp_path,
                              capture_output=True, text=True, check=True)
        assert done.stdout.split("\0")[:-1] == arguments
    assert not (tmp_path / "owned").exists()
