"""Issue #59 point 1: every step chart's x tick labels are readable in every x-axis mode
(steps, relative, wall) at 1366 and 800 px, on the run page and on compare: no raw epoch
milliseconds ("1.79659944T") and no two labels drawn over each other."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.server.pages.conftest import open_browser

pytestmark = pytest.mark.browser
PAGES = ("/runs/growing-fp16", "/compare?run=growing-fp16&run=sgd-bf16")
RAW_EPOCH = re.compile(r"^\d(\.\d+)?[TGB]$|^\d{10,}")
# each chart's x tick labels and their boxes, as drawn
TICKS = """() => Array.from(document.querySelectorAll('.plot')).filter(p => p._fullLayout)
    .map(p => ({id: p.id, type: p._fullLayout.xaxis.type,
                ticks: Array.from(p.querySelectorAll('.xtick text')).map(t => {
                    const r = t.getBoundingClientRect();
                    return {text: t.textContent, left: r.left, right: r.right,
                            top: r.top, bottom: r.bottom}; })}))"""


def overlapping(ticks: list[dict]) -> list[tuple[str, str]]:
    boxes = sorted((t for t in ticks if t["text"]), key=lambda t: t["left"])
    return [(a["text"], b["text"]) for a, b in zip(boxes, boxes[1:], strict=False)
            if b["left"] < a["right"] - 1 and b["top"] < a["bottom"] - 1
            and a["top"] < b["bottom"] - 1]


@pytest.mark.parametrize("width", [1366, 800])
@pytest.mark.parametrize("axis", ["step", "relative", "wall"])
def test_every_x_tick_label_is_readable(chromium, field_runs, tmp_path: Path, axis: str,
                                        width: int) -> None:
    browser = open_browser(chromium, field_runs.server.url, tmp_path, width=width)
    try:
        for path in PAGES:
            browser.goto(f"{path}{'&' if '?' in path else '?'}x={axis}")
            browser.wait_for_plots("loss")
            charts = browser.page.evaluate(TICKS)
            step_charts = [c for c in charts if c["id"] in {
                "fig-loss", "fig-lr", "fig-grad_norm", "fig-phases", "fig-loss_scale",
                "fig-skips", "fig-step_time"}]
            assert step_charts, [c["id"] for c in charts]
            for chart in step_charts:
                texts = [t["text"] for t in chart["ticks"]]
                assert texts, chart["id"]
                raw = [t for t in texts if RAW_EPOCH.search(t.replace(",", ""))]
                assert not raw, (path, axis, chart["id"], texts)
                if axis == "wall":
                    assert chart["type"] == "date", (path, chart["id"], chart["type"])
                assert not overlapping(chart["ticks"]), (path, axis, width, chart["id"],
                                                         overlapping(chart["ticks"]))
            browser.shoot(f"ticks-{axis}-{width}-{path.strip('/').split('?')[0].replace('/', '-')}")
        browser.assert_clean()
    finally:
        browser.page.context.close()
