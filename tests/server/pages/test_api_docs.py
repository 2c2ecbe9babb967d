"""/docs (Swagger UI) and /redoc render in real Chromium with no request leaving the
server: their assets are served by the server itself (teams run it air-gapped)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import LiveServer
from tests.server.pages.conftest import CHROMIUM, CHROMIUM_ARGS, Browser, open_browser

HOST = "ampwatch.test"  # not localhost: Swagger UI would call its online validator for it


@pytest.fixture(scope="module")
def chromium_with_host() -> Iterator[object]:
    """Chromium that resolves HOST to 127.0.0.1 and nothing else to anywhere."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[*CHROMIUM_ARGS, f"--host-resolver-rules=MAP {HOST} 127.0.0.1"])
        yield browser
        browser.close()


@pytest.fixture
def docs_server(tmp_path: Path) -> Iterator[LiveServer]:
    """A server without a token that answers HOST (it answers only names it trusts)."""
    server = LiveServer(f"sqlite:///{tmp_path / 'docs.db'}", tmp_path / "server.log",
                        env={"AMPWATCH_ALLOWED_HOSTS": HOST})
    server.start()
    yield server
    server.stop()


@pytest.fixture
def docs_browser(chromium_with_host, docs_server, tmp_path: Path) -> Iterator[Browser]:
    opened = open_browser(chromium_with_host, f"http://{HOST}:{docs_server.port}", tmp_path)
    requested: list[str] = []
    blocked: list[str] = []  # by the page's Content-Security-Policy: never sent
    opened.page.on("request", lambda request: requested.append(request.url))
    opened.page.on("requestfailed", lambda request: blocked.append(request.url)
                   if request.failure in ("csp", "net::ERR_BLOCKED_BY_CSP") else None)
    opened.requested = requested  # type: ignore[attr-defined]
    opened.blocked = blocked  # type: ignore[attr-defined]
    yield opened
    opened.page.context.close()


@pytest.mark.browser
def test_swagger_ui_renders_every_operation_offline(docs_browser) -> None:
    docs_browser.goto("/docs")
    docs_browser.page.wait_for_selector(".swagger-ui .opblock", timeout=30_000)
    paths = docs_browser.page.locator(".opblock-summary-path").all_inner_texts()
    assert "/api/v1/runs/{run_id}/batches" in {p.replace("\u200b", "") for p in paths}
    assert "ampwatch" in docs_browser.page.locator(".swagger-ui .title").inner_text()
    docs_browser.assert_clean()  # nothing went to a CDN, no validator badge, no error
    assert any(url.endswith("/swagger-ui-bundle.js") for url in docs_browser.requested)
    assert [url for url in docs_browser.requested
            if not url.startswith((docs_browser.base_url, "blob:", "data:"))
            and url not in docs_browser.blocked] == []
    assert docs_browser.blocked == []


@pytest.mark.browser
def test_redoc_renders_offline(docs_browser) -> None:
    docs_browser.goto("/redoc")
    docs_browser.page.wait_for_selector("[data-section-id^='operation/']", state="attached",
                                        timeout=30_000)
    assert "ampwatch" in docs_browser.page.locator("h1").first.inner_text()
    # the bundled ReDoc hard-codes its logo from cdn.redoc.ly; the server serves it with
    # that address emptied: not even a request for the policy to block
    assert docs_browser.page.locator("img[alt='redocly logo']").count() == 0
    docs_browser.assert_clean()
    assert any(url.endswith("/redoc.standalone.js") for url in docs_browser.requested)
    assert [url for url in docs_browser.requested
            if not url.startswith((docs_browser.base_url, "blob:", "data:"))
            and url not in docs_browser.blocked] == []
    assert docs_browser.blocked == []
