"""The web pages' server (the default model under two names, behind an API key, with a Host check and a
user middleware) and headless Chromium driven by Playwright; browser tests skip where Chromium is not
installed (``apt-get install -y chromium``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.utils import RemoteServer

API_KEY = "sk-web-test"
DEFAULT = "SmolLM2-135M-Instruct"
ALT = "alt"
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("PAGEDSERVE_TEST_ARTIFACTS", REPO / "test-artifacts"))


def chromium_path() -> str | None:
    """The system's Chromium ($PAGEDSERVE_CHROMIUM, else chromium / chromium-browser on PATH)."""
    configured = os.environ.get("PAGEDSERVE_CHROMIUM")
    if configured:
        return configured if os.path.exists(configured) else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="session")
def web_server():
    from pagedserve.models.default_model import default_model_path

    path = default_model_path()
    args = [
        "--model", path, "--model", f"{ALT}={path}",
        "--api-key", API_KEY,
        "--allowed-hosts", "127.0.0.1,localhost,*.example.test",
        "--middleware", "tests.web.sample_middleware.StampClassMiddleware",
        "--kv-cache-memory", "64MiB", "--max-num-seqs", "16", "--log-stats-interval", "0",
    ]  # fmt: skip
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with RemoteServer(args, env=env, api_key=API_KEY) as remote:
        yield remote


@pytest.fixture(scope="session")
def browser():
    executable = chromium_path()
    if executable is None:
        pytest.skip("no Chromium here: `apt-get install -y chromium` (or set PAGEDSERVE_CHROMIUM)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, headless=True)
        yield chromium
        chromium.close()


class PageWatch:
    """What a page did: console errors, uncaught exceptions, and every URL it requested."""

    def __init__(self, page, origin: str) -> None:
        self.page = page
        self.origin = origin
        self.errors: list[str] = []
        self.urls: list[str] = []
        page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        page.on("pageerror", lambda error: self.errors.append(f"uncaught: {error}"))
        page.on("request", lambda request: self.urls.append(request.url))

    def foreign_requests(self) -> list[str]:
        """Requests that left the server's origin (blob: and data: URLs are the page's own)."""
        own = (self.origin + "/", "blob:" + self.origin + "/", "data:")
        return [url for url in self.urls if not url.startswith(own)]

    def screenshot(self, name: str) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


@pytest.fixture
def watched_page(browser, web_server):
    """A fresh browser context (empty session storage) and page on the web server."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.set_default_timeout(60_000)
    watch = PageWatch(page, web_server.url)
    yield watch
    context.close()


def running_now(server) -> int:
    """Requests running in all engines now, from /metrics (the dashboard's samples are up to a second old)."""
    total = 0.0
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("pagedserve:num_requests_running"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)
