"""Regenerate docs/img/*.png: the demo's runs (real CPU training through the agent) on a
fresh server, shot with headless Chromium (Debian's, via Playwright) at 1366 px wide.

    python docs/screenshots.py            # ~2 minutes: trains the four demo runs first

Every request but the server's own is aborted, as in the browser tests: the pictures show
what an offline cluster sees.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.conftest import free_port  # noqa: E402
from tests.server.pages.conftest import CHROMIUM, CHROMIUM_ARGS  # noqa: E402

IMG = ROOT / "docs" / "img"
DEMO = ("/compare?run=demo-fp16-healthy&run=demo-fp16-overflow&run=demo-fp16-misaligned"
        "&run=demo-bf16")
# name and path; each picture is the first 1366 x 1000 of the page. LAYER_VIEW: the
# diverging run's own view of the layer its first problem names, found when shooting
LAYER_VIEW = "layer view"
SHOTS = (
    ("overview-diverging", "/runs/demo-fp16-overflow"),
    ("layers-diverging", "/runs/demo-fp16-overflow/layers"),
    ("layer-diverging", LAYER_VIEW),
    ("overview-healthy", "/runs/demo-fp16-healthy"),
    ("layers-healthy", "/runs/demo-fp16-healthy/layers"),
    ("compare-four", DEMO),
    ("runs", "/"),
)


def shoot(base: str) -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1366, "height": 1000})
        page.route("**/*", lambda route: route.continue_()
                   if route.request.url.startswith(base) else route.abort())
        for name, path in SHOTS:
            if path == LAYER_VIEW:  # the link the first problem card gives its layer
                page.goto(base + "/runs/demo-fp16-overflow")
                path = page.locator("#problems a.layer-link").first.get_attribute("href")
            page.goto(base + path)
            page.wait_for_load_state("networkidle")
            page.wait_for_timeout(300)
            page.screenshot(path=str(IMG / f"{name}.png"))
            print(f"docs/img/{name}.png {(IMG / f'{name}.png').stat().st_size // 1024} KiB")
        browser.close()


def main() -> None:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ampwatch-shots-") as tmp:
        demo = subprocess.Popen(
            [sys.executable, "-m", "ampwatch.client.cli", "demo", "--port", str(port),
             "--database-url", f"sqlite:///{tmp}/demo.db", "--keep-serving"],
            stdout=subprocess.PIPE, text=True)
        try:
            for line in demo.stdout:
                if line.startswith("Serving on"):
                    break
            else:
                raise SystemExit("the demo stopped before serving")
            shoot(f"http://127.0.0.1:{port}")
        finally:
            demo.send_signal(signal.SIGINT)  # the demo stops its server on Ctrl-C
            demo.wait(timeout=30)


if __name__ == "__main__":
    main()
