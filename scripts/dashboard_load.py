"""Keep N headless-Chromium dashboards open on a server for a while (to measure what watching costs).

    python scripts/dashboard_load.py --url http://127.0.0.1:8000 --pages 2 --seconds 90 \
        [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
import time

from playwright.sync_api import sync_playwright


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--pages", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=args.chromium, headless=True)
        pages = []
        for _ in range(args.pages):
            page = browser.new_context().new_page()
            page.goto(args.url.rstrip("/") + "/dashboard")
            pages.append(page)
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            pages[0].wait_for_timeout(1000)  # keeps the event loop turning; the pages poll by themselves
        polled = [page.evaluate("document.getElementById('running').textContent") for page in pages]
        print(f"{len(pages)} dashboards open for {args.seconds:.0f} s; running card: {polled}")
        browser.close()


if __name__ == "__main__":
    main()
