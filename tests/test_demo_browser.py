"""The demo in a real browser: headless Debian Chromium driven by Playwright uploads the example
image and video, runs every method the page offers for each (four side by side per request) and
checks that every column shows an answer or a readable message, never a bare error, that the
headline table shows the FLOPs ratio and the visual tokens, that merging methods draw which tokens
merged into which (pure pruners say they only keep or drop) and that QuoTA runs on the video.
Skipped when chromium or playwright is missing (apt-get install -y chromium; pip install
playwright - never `playwright install`, the system chromium is used)."""
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

pytest.importorskip("gradio", reason="the demo needs gradio: pip install -e '.[demo]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no `playwright install`)")
if not CHROMIUM.is_file() and shutil.which("chromium") is None:
    pytest.skip("no chromium at /usr/bin/chromium: apt-get install -y chromium", allow_module_level=True)

from vlm_prune.demo.app import EXAMPLES_DIR, MAX_COLUMNS, build_app, launch
from vlm_prune.demo.session import Session, load_synthetic

REQUEST_TIMEOUT_MS = 240_000
MERGING = ("pact", "tome", "visionzip", "prumerge", "framefusion", "sparsevlm", "prunevid", "holitom")  # methods whose columns show which tokens merged into which


@pytest.fixture(scope="module")
def url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = build_app(Session(load_synthetic("image"), load_synthetic("video"), max_new_tokens=3, timing_repeats=1))
    launch(app, port=port, block=False)
    yield f"http://127.0.0.1:{port}/"
    app.close()


@pytest.fixture(scope="module")
def page(url):
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM if CHROMIUM.is_file() else shutil.which("chromium")),
                                     args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1100})
            page.goto(url)
            yield page
        finally:
            browser.close()


def offered(page) -> list[str]:
    """The method names the Methods dropdown lists (its labels are "name - description")."""
    box = page.locator("#methods input[role=combobox]")
    box.click()
    options = page.locator("li[role=option]")  # the open list is drawn outside the dropdown's element
    options.first.wait_for()
    names = [options.nth(i).get_attribute("aria-label").split(" - ")[0] for i in range(options.count())]
    box.press("Escape")
    return names


def choose(page, names: list[str]) -> None:
    page.locator("#methods .remove-all").click()
    box = page.locator("#methods input[role=combobox]")
    for name in names:
        box.fill(name)
        page.locator(f"li[role=option][aria-label^='{name} - ']").first.click()
    page.locator("#question textarea").click()  # close the list


def run_and_check(page, names: list[str]) -> list[str]:
    """Run the chosen methods; check every column and the headline table; return the cards' text."""
    page.locator("#run").click()
    page.wait_for_function(  # this request's "Done" line names every method it ran or could not run
        "names => { const t = document.querySelector('#status').innerText;"
        " return t.includes('Done on') && names.every(n => t.includes(n)); }",
        arg=names, timeout=REQUEST_TIMEOUT_MS)
    cards = [page.locator(f"#card{i}").inner_text() for i in range(len(names))]
    for name, card in zip(names, cards):
        assert name in card.splitlines()[0], (name, card)
        assert "answer:" in card or "could not run:" in card, (name, card)
    assert [page.locator(f"#column{i}").is_visible() for i in range(MAX_COLUMNS)] == [
        i < len(names) for i in range(MAX_COLUMNS)]
    summary = page.locator("#summary").inner_text()
    assert "LLM prefill FLOPs (ideal)" in summary and "visual tokens, final" in summary
    assert "visual tokens, mean over LLM layers" in summary
    assert page.get_by_text("Error", exact=True).count() == 0  # Gradio's bare error pill
    for i, (name, card) in enumerate(zip(names, cards)):
        if "answer:" in card:
            page.locator(f"#kept{i} img").wait_for(state="attached", timeout=REQUEST_TIMEOUT_MS)
            assert page.locator(f"#kept{i} img").get_attribute("src")
            if any(part in MERGING for part in name.split("+")):  # which tokens merged into which, drawn
                page.locator(f"#merge{i} img").wait_for(state="attached", timeout=REQUEST_TIMEOUT_MS)
                assert page.locator(f"#merge{i} img").get_attribute("src"), name
            else:  # pure pruners: no merge picture, and the card says why
                assert not page.locator(f"#merge{i}").is_visible() and "the method only keeps or drops tokens" in card, (name, card)
    return cards


@pytest.mark.parametrize("example, question, min_offered", [
    ("synthetic_colour_0.png", "what colour is the shape ?", 8),
    ("synthetic_clip.mp4", "what colour is the shape ?", 10),
])
def test_every_offered_method_gives_a_result_or_a_message(page, example, question, min_offered, tmp_path):
    page.reload()
    page.locator("#media input[type=file]").set_input_files(str(EXAMPLES_DIR / example))
    preview = "#preview_image img" if example.endswith(".png") else "#preview_video video"
    page.locator(preview).wait_for(timeout=90_000)  # the upload is shown (the video is playable)
    page.locator("#question textarea").fill(question)
    names = offered(page)
    assert len(names) >= min_offered
    if example.endswith(".png"):
        assert {"tome", "asvit"} <= set(names) and "keyscore" not in names
    else:  # QuoTA scores the frames in the toy model's own words (QuoTA.for_processor)
        assert {"keyscore", "keyscore+pact", "quota", "quota+pact"} <= set(names) and "tome" not in names
    answered = {}
    for start in range(0, len(names), MAX_COLUMNS):
        chunk = names[start : start + MAX_COLUMNS]
        choose(page, chunk)
        answered.update({n: "answer:" in card for n, card in zip(chunk, run_and_check(page, chunk))})
    page.screenshot(path=str(tmp_path / "demo.png"), full_page=True)
    assert all(answered[n] for n in ("pact", "visionzip", "quota", "quota+pact") if n in answered), answered


def test_a_bad_request_clears_the_previous_result(page, tmp_path):
    page.reload()
    page.locator("#media input[type=file]").set_input_files(str(EXAMPLES_DIR / "synthetic_colour_0.png"))
    page.locator("#preview_image img").wait_for(timeout=90_000)
    page.locator("#question textarea").fill("what colour is the shape ?")
    choose(page, ["pool"])
    run_and_check(page, ["pool"])
    page.locator("#question textarea").fill("")
    page.locator("#run").click()
    page.locator("#status").get_by_text("Cannot run this request").wait_for(timeout=60_000)
    assert "type a question" in page.locator("#status").inner_text()
    assert page.locator("#answer_unpruned textarea").input_value() == ""
    assert not page.locator("#column0").is_visible() and page.locator("#summary").inner_text().strip() == ""
    assert page.get_by_text("Error", exact=True).count() == 0


def test_video_at_four_columns_readable_strips_heatmaps_and_budget_note(page):
    """Four video methods side by side: each frame strip is drawn two frames per row, so its labels
    are at least 11 CSS pixels high on the page; methods that score tokens or frames show a score
    heatmap per frame; QuoTA's budget warning is in its column; FLOPs read as a share of unpruned."""
    from vlm_prune.demo import overlay

    page.reload()
    page.locator("#media input[type=file]").set_input_files(str(EXAMPLES_DIR / "synthetic_clip.mp4"))
    page.locator("#preview_video video").wait_for(timeout=90_000)
    page.locator("#question textarea").fill("what colour is the shape ?")
    names = ["quota", "pact", "keyscore", "visionzip"]
    choose(page, names)
    cards = run_and_check(page, names)
    assert "budget note:" in cards[0] and "falls short" in cards[0]
    assert all("budget note" not in card for card in cards[1:])
    summary = page.locator("#summary").inner_text()
    assert "share of unpruned" in summary and "fewer)" in summary and "x0." not in summary
    for i in range(len(names)):
        img = page.locator(f"#kept{i} img")
        img.wait_for(state="attached", timeout=REQUEST_TIMEOUT_MS)
        page.wait_for_function("el => el.complete && el.naturalWidth > 0", arg=img.element_handle(), timeout=60_000)
        shown, natural = img.evaluate("el => [el.getBoundingClientRect().width, el.naturalWidth]")
        assert natural == 2 * overlay.FRAME_SIDE and overlay.LABEL_SIZE * shown / natural >= 11, (names[i], shown, natural)
        heat = page.locator(f"#heat{i} img")
        heat.wait_for(state="attached", timeout=REQUEST_TIMEOUT_MS)  # token scores (pact, visionzip) or frame scores
        assert heat.get_attribute("src"), names[i]
