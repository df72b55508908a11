"""Redraw docs/demo.png: the demo on the shipped toy models, four methods side by side, captured
by headless Debian Chromium (Playwright with the system browser; never `playwright install`).

    python -m vlm_prune.demo.screenshot docs/demo.png
"""
from __future__ import annotations

import socket
import sys

from playwright.sync_api import sync_playwright

from vlm_prune.demo.app import EXAMPLES_DIR, build_app, launch, make_sessions

METHODS = ["fastv", "pact", "divprune", "tome"]
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]


def main(out: str = "docs/demo.png") -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = build_app(make_sessions([]))
    launch(app, port=port, block=False)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
            page = browser.new_page(viewport={"width": 1700, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}/", timeout=300_000)  # a busy machine serves the page slowly
            page.locator("#media input[type=file]").set_input_files(str(EXAMPLES_DIR / "synthetic_colour_0.png"))
            page.locator("#preview_image img").wait_for(timeout=90_000)
            page.locator("#question textarea").fill("what colour is the shape ?")
            page.locator("#methods .remove-all").click()
            for name in METHODS:
                page.locator("#methods input[role=combobox]").fill(name)
                page.locator(f"li[role=option][aria-label^='{name} - ']").first.click()
            page.locator("#question textarea").click()
            page.locator("#run").click()
            page.locator("#status").get_by_text("Done on").wait_for(timeout=300_000)
            page.wait_for_function("() => [...document.querySelectorAll('.method-column img')]"
                                   ".every(img => img.complete && img.naturalWidth > 0)", timeout=60_000)
            page.wait_for_timeout(1000)
            page.screenshot(path=out, full_page=True)
            browser.close()
    finally:
        app.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
