"""The Hugging Face Trainer with `AmpwatchCallback`, end to end on the CPU: a 2-layer GPT-2
made from a config (no download), values compared with the Trainer's own log."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ampwatch.integrations.transformers import AmpwatchCallback  # noqa: E402
from tests.agent.factories import spooled, spooled_steps  # noqa: E402


def tiny_gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=16,
                                     vocab_size=64)
    return transformers.GPT2LMHeadModel(config)


def token_data(n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 64, (16,), generator=gen)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def train(tmp_path: Path, *callbacks: transformers.TrainerCallback, **args
          ) -> transformers.Trainer:
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), run_name="tiny-gpt2",
        use_cpu=not args.get("fp16"),  # fp16=True means a GPU with a GradScaler
        per_device_train_batch_size=4, max_steps=6, learning_rate=1e-3, logging_steps=1,
        save_strategy="no", max_grad_norm=1.0, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, **{"report_to": "none", **args})
    trainer = transformers.Trainer(model=tiny_gpt2(), args=arguments,
                                   train_dataset=token_data(48), callbacks=list(callbacks))
    trainer.train()
    return trainer


def logged(trainer: transformers.Trainer) -> dict[int, dict]:
    return {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_bf16_trainer_steps_norms_loss_and_dtype(tmp_path: Path, offline: Path,
                                                 accumulate: int) -> None:
    callback = AmpwatchCallback()
    trainer = train(tmp_path, callback, bf16=True, gradient_accumulation_steps=accumulate)
    assert callback.attachment is None  # detached on train end
    run_id = next(p.name for p in offline.iterdir())
    steps = spooled_steps(offline, run_id)
    log = logged(trainer)
    assert [s["step"] for s in steps] == sorted(log) == [1, 2, 3, 4, 5, 6]
    for record in steps:
        entry = log[record["step"]]
        assert record["grad_norm"] == pytest.approx(entry["grad_norm"], rel=1e-5)
        assert record["loss"] == pytest.approx(entry["loss"], rel=1e-5)
        assert record["lr"] == pytest.approx(entry["learning_rate"], rel=1e-6)
        assert record["autocast_dtype"] == "bfloat16"
        assert record["skipped"] is False and record["loss_scale"] is None
        assert record["clip_before_unscale"] is False
    run = spooled(offline, run_id)[-1]["run"]
    assert run["name"] == "tiny-gpt2"
    assert run["environment"]["autocast_dtype"] == "bfloat16"
    assert [layer["name"] for layer in run["layers"]][:2] == ["transformer.wte",
                                                              "transformer.wpe"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="HF fp16=True needs a GPU: on the CPU the Trainer trains in plain "
                           "fp32, without autocast or a GradScaler")
def test_fp16_trainer_scale_and_skips_match_the_scaler(tmp_path: Path, offline: Path) -> None:
    truth: dict[int, tuple[float, bool]] = {}

    class ScalerLog(transformers.TrainerCallback):
        """The scale each step used and whether the scaler skipped it, from accelerate."""

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            self.scale = optimizer.scaler.get_scale()

        def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            truth[state.global_step + 1] = (self.scale, optimizer.step_was_skipped)

    trainer = train(tmp_path, AmpwatchCallback(), ScalerLog(), fp16=True,
                    gradient_accumulation_steps=2)
    run_id = next(p.name for p in offline.iterdir())
    steps = spooled_steps(offline, run_id)
    log = logged(trainer)
    assert [s["step"] for s in steps] == sorted(truth) == [1, 2, 3, 4, 5, 6]
    for record in steps:
        assert record["grad_norm"] == pytest.approx(log[record["step"]]["grad_norm"], rel=1e-4)
        assert record["loss_scale"] == truth[record["step"]][0]
        assert record["skipped"] is truth[record["step"]][1]
        assert record["autocast_dtype"] == "float16"


def test_mirror_true_writes_beside_the_trainers_own_tensorboard_scalars(
        tmp_path: Path, offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`report_to="tensorboard"` and `AmpwatchCallback(mirror=True)`: ampwatch/grad_norm in
    the Trainer's own TensorBoard run, at its steps, equal to its own train/grad_norm."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    train(tmp_path, AmpwatchCallback(mirror=True), bf16=True, report_to="tensorboard")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)}
               for tag in events.Tags()["scalars"]}
    assert set(scalars["ampwatch/grad_norm"]) == set(scalars["train/grad_norm"]) == set(
        range(1, 7))
    for step, norm in scalars["train/grad_norm"].items():
        assert scalars["ampwatch/grad_norm"][step] == pytest.approx(norm, rel=1e-5)
    assert scalars["ampwatch/skipped"] == dict.fromkeys(range(1, 7), 0.0)
