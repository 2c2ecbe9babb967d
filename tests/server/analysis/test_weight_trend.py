"""Issue 58 class 3, on hand-made series: a growth starts where the norm leaves its own
trend (server/analysis/weights.py `moved`), not at the first sample training moved."""

from __future__ import annotations

import numpy as np

from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.analysis.weights import change_point, moved

STEPS = np.arange(0, 100, 10)


def _norms(start: int, per_step: float, drift: float = 0.004) -> np.ndarray:
    """A norm training moves `drift` a step, times `per_step` a step from `start`."""
    return np.array([(1 + drift) ** s * per_step ** max(s - start, 0) for s in STEPS])


def test_a_late_growth_starts_where_it_leaves_the_training_trend():
    for start, per_step in ((20, 1.06), (40, 1.06), (60, 1.1)):
        code, first, *_ = moved(STEPS, _norms(start, per_step), AnalysisSettings())
        assert (code, first) == ("weight_growth", start)


def test_a_growth_from_the_first_step_still_starts_there():
    code, first, *_ = moved(STEPS, _norms(0, 1.05, drift=0.0), AnalysisSettings())
    assert (code, first) == ("weight_growth", 0)
    # a growth compounding at one rate throughout has no later change point
    assert change_point(np.log(_norms(0, 1.05))) == 0


def test_an_early_bump_of_training_is_not_the_start():
    """Adam moves a fresh layer's norm most in its first steps; that bump is the trend's,
    and a growth from step 50 starts at 50."""
    norms = _norms(50, 1.08)
    norms[1:] *= 1.3  # the first ten steps' bump
    code, first, *_ = moved(STEPS, norms, AnalysisSettings())
    assert (code, first) == ("weight_growth", 50)


def test_a_near_zero_init_growing_at_the_optimizers_pace_is_no_jump():
    """ConvNeXt's layer scale starts at 1e-6: ten Adam steps of lr 1e-3 take its 16
    elements to ~0.01 each, a 1000x 'jump' that is training, not a rescale."""
    norms = np.array([4e-6, 0.019, 0.04, 0.06, 0.075])
    steps = STEPS[:5]
    optimizer_reach = np.full(4, 2 * 1e-3 * 10 * np.sqrt(16))
    assert moved(steps, norms, AnalysisSettings(), optimizer_reach) is None
    # the same ratio on a layer whose norm no optimizer step could move that far is a jump
    big = norms * 1e4
    assert moved(steps, big, AnalysisSettings(), optimizer_reach)[0] == "weight_jump"
