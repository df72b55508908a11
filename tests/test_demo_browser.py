"""The demo in a real browser: headless Debian Chromium driven by Playwright uploads an example,
submits, and waits for both answers and the kept-token overlay. Skipped when chromium or
playwright is missing (apt-get install -y chromium; pip install playwright - never
`playwright install`, the system chromium is used)."""
from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]

pytest.importorskip("gradio", reason="the demo needs gradio: pip install 'vlm-prune[demo]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no `playwright install`)")
if not CHROMIUM.is_file() and shutil.which("chromium") is None:
    pytest.skip("no chromium at /usr/bin/chromium: apt-get install -y chromium", allow_module_level=True)

from vlm_prune.demo.app import EXAMPLES_DIR, build_app, launch
from vlm_prune.demo.session import Session, load_synthetic


@pytest.fixture(scope="module")
def url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = build_app(Session(load_synthetic("image"), None, max_new_tokens=4, timing_repeats=1))
    launch(app, port=port, block=False)
    yield f"http://127.0.0.1:{port}/"
    app.close()


def test_upload_submit_shows_answers_and_overlay(url, tmp_path):
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM if CHROMIUM.is_file() else shutil.which("chromium")),
                                     args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            page.locator("#media input[type=file]").set_input_files(str(EXAMPLES_DIR / "synthetic_colour_0.png"))
            page.locator("#media").get_by_text("synthetic_colour_0.png").first.wait_for(timeout=90_000)
            page.locator("#question textarea").fill("what colour is the shape ?")
            page.locator("#run").click()
            overlay = page.locator("#kept img")
            overlay.wait_for(timeout=120_000)
            pruned = page.locator("#answer_pruned textarea")
            page.wait_for_function("el => el.value.length > 0", arg=pruned.element_handle(), timeout=60_000)
            unpruned = page.locator("#answer_unpruned textarea").input_value()
            assert unpruned and pruned.input_value()
            assert overlay.evaluate("img => img.naturalWidth") > 0
            assert "speed-up" in page.locator("#summary").inner_text()
            shot = tmp_path / "demo.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
        finally:
            browser.close()
