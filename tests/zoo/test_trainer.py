"""Issue 44's case 4 as a user meets it: the Hugging Face `Trainer`, bf16, GPT-2 built from a
config, `AmpwatchCallback` sending to a live server, and one batch of foreign tokens. The
Trainer's defaults stay as they are (linear learning-rate decay, clipping at 1.0), so the
learning rate changes on every step and is no cause. The truth is the test's own: a
forward pre-hook that sees which training step got the foreign tokens, and the Trainer's
own log of each step's loss and grad norm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

transformers = pytest.importorskip("transformers")

from ampwatch.integrations.transformers import AmpwatchCallback  # noqa: E402
from tests.conftest import LiveServer  # noqa: E402
from tests.utils import WAIT  # noqa: E402
from tests.zoo import models  # noqa: E402

STEPS, BAD_AT, LR = 90, 60, 1e-2
FOREIGN = torch.randint(0, models.VOCAB, (models.BATCH, models.SEQ),
                        generator=torch.Generator().manual_seed(1000))


class InOrder(transformers.Trainer):
    """Batches in the dataset's order, so the bad rows land on a known step."""

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler:
        return torch.utils.data.SequentialSampler(self.train_dataset)


def _rows() -> list[dict[str, torch.Tensor]]:
    """The zoo's learnable batches, one row each; the batch of step BAD_AT is foreign."""
    rows = []
    for step in range(STEPS):
        ids = FOREIGN if step == BAD_AT else models._tokens(step)
        rows += [{"input_ids": row, "labels": row} for row in ids]
    return rows


class Step(transformers.TrainerCallback):
    """The Trainer's step as each one begins (its global_step counts finished steps)."""

    def __init__(self) -> None:
        self.now = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.now = state.global_step


def test_hf_trainer_bf16_bad_batch_is_a_bad_batch(tmp_path: Path, server: LiveServer) -> None:
    torch.manual_seed(0)
    model = models.gpt2()
    clock, seen = Step(), []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(clock.now)
        if torch.equal(kwargs["input_ids"], FOREIGN) else None, with_kwargs=True)
    run_id = f"trainer-bad-batch-{tmp_path.name[-6:]}"
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=True,
        per_device_train_batch_size=models.BATCH, max_steps=STEPS, learning_rate=LR,
        logging_steps=1, save_strategy="no", seed=0, dataloader_num_workers=0,
        disable_tqdm=True, report_to="none")
    trainer = InOrder(model=model, args=arguments, train_dataset=_rows(),
                      callbacks=[clock, AmpwatchCallback(server=server.url, run=run_id)])
    trainer.train()
    # the truth: the foreign batch went into the Trainer's step BAD_AT + 1 (it counts
    # steps from 1, and the agent under its callback counts as it does); the loss jumped
    # there and came back
    assert seen == [BAD_AT]
    bad = BAD_AT + 1
    log = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    assert sorted(log) == list(range(1, STEPS + 1))
    losses = {step: e["loss"] for step, e in log.items()}
    norms = {step: e["grad_norm"] for step, e in log.items()}
    before = range(bad - 5, bad)
    assert losses[bad] > 20 * max(losses[i] for i in before)
    assert losses[bad + 1] < losses[bad] / 5
    assert norms[bad] > 10 * max(norms[i] for i in before)
    lrs = [log[i]["learning_rate"] for i in sorted(log)]
    assert lrs[0] > log[bad]["learning_rate"] > lrs[-1]  # the default linear decay

    answer = httpx.get(f"{server.url}/api/v1/runs/{run_id}/findings",
                       params={"limit": 1000, **WAIT}, timeout=60)
    answer.raise_for_status()
    items = answer.json()["items"]
    spikes = [(f["step"], f["code"]) for f in items if f["kind"] == "loss_spike"]
    assert spikes == [(bad, "bad_batch")], items
    # nothing else at warning or worse: one bad batch, one finding, no learning-rate cause
    serious = [(f["kind"], f["step"]) for f in items if f["severity"] != "info"]
    assert serious in ([], [("loss_spike", bad)]), serious
