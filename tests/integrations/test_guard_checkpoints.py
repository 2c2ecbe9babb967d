"""The Trainer callbacks never save non-finite weights (`attachment.healthy`), and the step
guard keeps a real Trainer run's weights finite. The faults are the test's own: a callback
that writes NaN into a weight, a gradient hook that turns one step's gradient inf."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.agent.factories import spooled_steps


# ----------------------------------------------------------------------------- Transformers
def hf_train(tmp_path: Path, *callbacks, model=None):
    transformers = pytest.importorskip("transformers")
    from tests.integrations.test_transformers import tiny_gpt2, token_data

    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), run_name="tiny-gpt2", use_cpu=True, bf16=True,
        per_device_train_batch_size=4, max_steps=6, learning_rate=1e-3, logging_steps=1,
        report_to="none", save_strategy="steps", save_steps=2, save_only_model=True,
        max_grad_norm=1.0, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model or tiny_gpt2(), args=arguments,
                                   train_dataset=token_data(48), callbacks=list(callbacks))
    trainer.train()
    return trainer


def saved(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*"))


def test_hf_callback_calls_off_the_save_of_non_finite_weights(tmp_path: Path,
                                                              offline: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from ampwatch.integrations.transformers import AmpwatchCallback

    class Poison(transformers.TrainerCallback):
        """After step 3, a NaN in one weight: what a NaN update leaves behind."""

        def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
            if state.global_step == 3:
                with torch.no_grad():
                    model.lm_head.weight[0, 0] = math.nan

    trainer = hf_train(tmp_path, Poison(), AmpwatchCallback())
    assert not torch.isfinite(trainer.model.lm_head.weight).all()  # the fault stayed
    assert saved(tmp_path) == ["checkpoint-2"]  # 4 and 6 held NaN weights


def test_hf_trainer_under_the_guard_leaves_the_bad_step_out(tmp_path: Path,
                                                            offline: Path) -> None:
    pytest.importorskip("transformers")
    from ampwatch.integrations.transformers import AmpwatchCallback
    from tests.integrations.test_transformers import tiny_gpt2

    model = tiny_gpt2()
    calls = {"n": 0}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1  # one backward per optimizer step here (no accumulation)
        return grad * math.inf if calls["n"] == 4 else grad

    model.transformer.h[0].mlp.c_fc.weight.register_hook(poison)
    hf_train(tmp_path, AmpwatchCallback(guard=True), model=model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert saved(tmp_path) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    run_id = next(p.name for p in offline.iterdir())
    steps = spooled_steps(offline, run_id)
    assert [(s["step"], s["guarded"]) for s in steps if s["skipped"]] == [
        (4, "nonfinite_grads")]  # the Trainer's global_step after its 4th step


# ----------------------------------------------------------------------------- Lightning
@pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")
def test_lightning_callback_refuses_to_save_non_finite_weights(tmp_path: Path,
                                                               offline: Path) -> None:
    L = pytest.importorskip("lightning.pytorch")
    from ampwatch.integrations.lightning import AmpwatchCallback, NonFiniteWeights
    from tests.integrations.test_lightning import TinyRegressor

    class Poison(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == 3:
                with torch.no_grad():
                    pl_module.net[0].weight[0, 0] = math.nan

    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=gen),
                                          torch.randn(64, 4, generator=gen))
    checkpoints = L.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2,
                                              save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, precision="bf16-mixed",
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Poison(), AmpwatchCallback(), checkpoints])
    with pytest.raises(NonFiniteWeights, match="step 4"):
        trainer.fit(TinyRegressor(), torch.utils.data.DataLoader(data, batch_size=8))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=2.ckpt"]


@pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")
def test_lightning_bf16_under_the_guard_leaves_the_bad_step_out(offline: Path) -> None:
    """bf16-mixed runs each step inside optimizer.step(closure): guarded there too."""
    L = pytest.importorskip("lightning.pytorch")
    from ampwatch.integrations.lightning import AmpwatchCallback
    from tests.integrations.test_lightning import TinyRegressor

    module = TinyRegressor()
    calls = {"n": 0}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return grad * math.inf if calls["n"] == 3 else grad

    module.net[2].weight.register_hook(poison)
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(48, 16, generator=gen),
                                          torch.randn(48, 4, generator=gen))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, precision="bf16-mixed",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[AmpwatchCallback(guard=True)])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    assert all(torch.isfinite(p).all() for p in module.parameters())
    run_id = next(p.name for p in offline.iterdir())
    steps = spooled_steps(offline, run_id)
    assert [(s["step"], s["guarded"]) for s in steps if s["skipped"]] == [
        (2, "nonfinite_grads")]  # the third step, numbered by Lightning's global_step
