"""The recorder's triggers on step records (agent/record_triggers.py): a diverging scaler
keeps a bundle whatever came before it; a scaler calibrating does not."""

from __future__ import annotations

from ampwatch.agent.record_triggers import RecordSettings, Triggers


def _judge(records: list[dict], **settings: object) -> dict[int, str]:
    triggers = Triggers(RecordSettings(**settings))
    kept = {}
    for step, record in enumerate(records):
        trigger = triggers.judge({"step": step, **record})
        if trigger is not None:
            kept[step] = trigger
    return kept


def _skipping(scale: float, steps: int) -> list[dict]:
    """A scaler halving on every step from `scale`."""
    return [{"skipped": True, "loss": 1.0, "loss_scale": scale / 2 ** i} for i in range(steps)]


def _healthy(steps: int, scale: float = 1024.0) -> list[dict]:
    return [{"skipped": False, "loss": 1.0, "loss_scale": scale}] * steps


def test_a_scale_collapsing_in_a_short_run_keeps_one_bundle() -> None:
    # 40 healthy steps, then skips from 65536: the 17th runs at a scale of 1
    assert _judge(_healthy(40) + _skipping(65536.0, 30)) == {56: "scale_collapse"}


def test_a_long_skip_streak_keeps_a_bundle_from_the_first_step() -> None:
    # a scale that cannot fall below 1 within the streak: the 20th skip is kept
    assert _judge(_skipping(2.0 ** 40, 25)) == {19: "skip_streak"}
    assert _judge(_skipping(2.0 ** 40, 25), skip_streak=None) == {}


def test_a_calibrating_scaler_keeps_nothing() -> None:
    assert _judge(_skipping(65536.0, 6) + _healthy(50)) == {}
