"""Heatmap hover on the growing-layer fp16 run (issue #35, point 6): a finite cell of a
run with NaN/inf cells reads its own value, as a number (0.5, not 10^-0.30), and a
non-finite cell still reads NaN or inf."""

from __future__ import annotations

import math

import httpx
import pytest

from tests.server.pages.conftest import GROWING_LAYER

pytestmark = pytest.mark.browser


def _hover(browser, figure: str, step: float, row: str) -> str:
    """Moves the mouse over the cell of `row` at `step` and returns the hover label."""
    browser.page.locator(f"#fig-{figure}").scroll_into_view_if_needed()
    point = browser.page.evaluate("""([id, step, row]) => {
        const el = document.getElementById(id), box = el.getBoundingClientRect();
        const xa = el._fullLayout.xaxis, ya = el._fullLayout.yaxis;
        return [box.left + xa._offset + xa.l2p(step), box.top + ya._offset + ya.d2p(row)];
    }""", [f"fig-{figure}", step, row])
    browser.page.mouse.move(0, 0)  # off the chart: its hover label goes
    browser.page.locator(f"#fig-{figure} .hoverlayer .hovertext").first.wait_for(
        state="detached", timeout=5_000)
    browser.page.mouse.move(*point, steps=3)
    label = browser.page.locator(f"#fig-{figure} .hoverlayer .hovertext", has_text=row)
    label.first.wait_for(state="attached", timeout=5_000)
    return label.first.evaluate("el => el.textContent")


def test_finite_cells_read_their_value_beside_non_finite_ones(field_browser, field_runs):
    browser = field_browser
    matrix = httpx.get(f"{field_runs.server.url}/api/v1/runs/growing-fp16/layers/matrix",
                       params={"metric": "act_absmax", "buckets": 1000}, timeout=10).json()
    row = matrix["layers"].index(GROWING_LAYER)
    values = matrix["values"][row]
    finite = [i for i, v in enumerate(values) if isinstance(v, float | int)
              and matrix["step_end"][i] < field_runs.first_overflow - 50]
    bad = [i for i, v in enumerate(values) if isinstance(v, str)]
    assert finite and bad, "the fixture run has finite and non-finite cells"
    browser.goto("/runs/growing-fp16/layers")
    browser.wait_for_plots("act_heatmap")
    label = "6 · Linear(64, 64)"
    cell = finite[len(finite) // 2]
    middle = (matrix["step_start"][cell] + matrix["step_end"][cell]) / 2
    text = _hover(browser, "act_heatmap", middle, label)
    assert "NaN" not in text, text
    shown = float(text.split("abs-max")[-1].strip().replace(",", ""))
    assert math.isclose(shown, values[cell], rel_tol=1e-3), (text, values[cell])
    middle = (matrix["step_start"][bad[-1]] + matrix["step_end"][bad[-1]]) / 2
    text = _hover(browser, "act_heatmap", middle, label)
    assert "NaN" in text or "inf" in text, text
    browser.assert_clean()
