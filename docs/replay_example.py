"""Regenerate docs/replay.md's worked example: real CPU training (tests/replay/faults.py's
overflowing projection) watched by the agent on a fresh server; the run page's incident
card with its bundle link, shot with headless Chromium (docs/img/replay-incident.png);
then `ampwatch bundles`, `ampwatch bundles pull` and `ampwatch replay --bisect` as a user
types them, their output saved to docs/img/replay-terminal.txt.

    python docs/replay_example.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ampwatch import agent  # noqa: E402
from tests.conftest import LiveServer  # noqa: E402
from tests.replay.faults import FAULTS, train  # noqa: E402
from tests.server.pages.conftest import CHROMIUM, CHROMIUM_ARGS  # noqa: E402

IMG = ROOT / "docs" / "img"
RUN = "replay-example"
DEFAULT_URL = "http://127.0.0.1:8000"  # `ampwatch serve`'s
FACTORY = '''from tests.replay.faults import FAULTS, build


def build_model():
    return build(FAULTS[0])  # the model as training builds it
'''


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="ampwatch-replay-") as tmp:
        folder = Path(tmp)
        server = LiveServer(f"sqlite:///{folder / 'example.db'}", folder / "server.log")
        server.start(timeout=120)
        try:
            _, attachment = train(FAULTS[0], lambda m, s, record: agent.attach(
                m, s, run=RUN, name=RUN, server=server.url, spool_dir=folder / "spool",
                record={**record, "model_factory": "train:build_model"}))
            attachment.detach(timeout=60)
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM,
                                                     args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1366, "height": 1000})
                page.goto(f"{server.url}/runs/{RUN}")
                page.wait_for_load_state("networkidle")
                card = page.locator("li.incident", has=page.locator("a.bundle-link")).first
                card.screenshot(path=str(IMG / "replay-incident.png"))
                browser.close()
            (folder / "train.py").write_text(FACTORY)
            lines = []
            for command in (["bundles", RUN], ["bundles", "pull", RUN, "8"],
                            ["replay", "step-000000008.ampbundle", "--model",
                             "train:build_model", "--bisect"]):
                # the example's server listens on a free port; the page shows the default
                done = subprocess.run([sys.executable, "-m", "ampwatch.client.cli", *command],
                                      cwd=folder, capture_output=True, text=True,
                                      env={**_env(), "PYTHONPATH": str(ROOT),
                                           "AMPWATCH_SERVER": server.url})
                shown = done.stdout.rstrip().replace(server.url, DEFAULT_URL)
                lines += [f"$ ampwatch {' '.join(command)}", shown, ""]
            (IMG / "replay-terminal.txt").write_text("\n".join(lines))
            print("\n".join(lines))
        finally:
            server.stop()


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


if __name__ == "__main__":
    main()
