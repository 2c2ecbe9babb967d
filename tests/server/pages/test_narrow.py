"""The pages in an 800 px window (issue #35, point 11): run names break between words,
the columns that say what is wrong (open problems, last seen, the precision map's flag)
stay in view, lesser ones go."""

from __future__ import annotations

import pytest

from tests.server.pages.conftest import open_browser

pytestmark = pytest.mark.browser
# each word of an element's text on one line: a word broken mid-word has two boxes
WORDS_WHOLE = """(el) => {
  const node = el.firstChild, text = node.textContent, broken = [];
  let at = 0;
  for (const word of text.split(/\\s+/).filter(Boolean)) {
    const start = text.indexOf(word, at), range = document.createRange();
    range.setStart(node, start);
    range.setEnd(node, start + word.length);
    if (range.getClientRects().length > 1) broken.push(word);
    at = start + word.length;
  }
  return broken;
}"""


@pytest.fixture
def narrow(chromium, field_runs, tmp_path):
    opened = open_browser(chromium, field_runs.server.url, tmp_path, width=800)
    yield opened
    opened.page.context.close()


def _right(locator) -> float:
    box = locator.bounding_box()
    return box["x"] + box["width"]


def test_runs_list_keeps_names_whole_and_problems_in_view(narrow):
    narrow.goto("/")
    for run in ("growing-fp16", "sgd-bf16"):
        row = narrow.page.locator(f"tr[data-run-id='{run}']")
        assert row.locator(".run-name > a").evaluate(WORDS_WHOLE) == []
        problems = row.locator(".findings-count")
        seen = row.locator("td").last
        assert problems.is_visible() and seen.is_visible()
        assert _right(problems) <= 800 and _right(seen) <= 800
    narrow.shoot("runs-800")
    narrow.assert_clean()


def test_precision_map_keeps_its_flags_in_view(narrow):
    narrow.goto("/runs/growing-fp16/layers")
    flag = narrow.page.locator("#precision th", has_text="Flag")
    card = narrow.page.locator("#precision")
    assert _right(flag) <= _right(card)
    narrow.shoot("layers-800")
    narrow.assert_clean()
