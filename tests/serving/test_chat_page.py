"""The chat page at GET / in headless Chromium (Debian's `chromium`, driven by Playwright)
against the real `xlaserve serve` process: it lists the model once given the API key, streams a
reply into the transcript in several updates with a positive tokens-per-second rate, stops on
Stop (and the server drops the request), and shows a rejected request as an error.

The screenshot lands in artifacts/chat_page.png.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import ConsoleMessage, Page, expect, sync_playwright

from tests.serving.openai_server import API_KEY, Server

CHROMIUM = Path("/usr/bin/chromium")  # Debian's package; `make test` installs it
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = Path(__file__).resolve().parents[2] / "artifacts" / "chat_page.png"
# The tiny model's context is 256 tokens; a short chat's prompt leaves room for this many.
MAX_TOKENS = "160"


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, openai_server: Server) -> Iterator[Page]:
    """The page, loaded and given the server's API key (the model list needs it)."""
    context = browser.new_context(viewport={"width": 1100, "height": 720})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if script_error(m) else None)
    page.goto(openai_server.url)
    expect(page.locator("#model-status")).to_contain_text("API key")  # 401 without it
    page.fill("#api-key", API_KEY)
    page.press("#api-key", "Tab")  # the key takes effect on change
    expect(page.locator("#model")).to_have_value(openai_server.model)
    expect(page.locator("#model-status")).to_be_empty()
    yield page
    context.close()
    assert not errors, f"the page logged errors: {errors}"


def script_error(message: ConsoleMessage) -> bool:
    # A request the server refuses logs "Failed to load resource"; the tests check those.
    return message.type == "error" and not message.text.startswith("Failed to load resource")


def test_reply_streams_into_the_transcript(page: Page) -> None:
    page.fill("#temperature", "1")
    page.fill("#seed", "0")
    page.fill("#max_tokens", MAX_TOKENS)
    page.fill("#system", "You are a tiny random model.")
    page.fill("#message", "Hello! Who are you?")
    page.evaluate(RECORD_LENGTHS)
    page.click("#send")

    lengths = watch_reply(page)
    assert len(set(lengths) - {0}) > 1, f"the reply arrived in one piece: {lengths}"
    assert page.locator("#transcript li.user").text_content() == "Hello! Who are you?"
    assert page.locator("#transcript li.error").count() == 0
    assert float(page.locator("#rate").text_content() or "0") > 0
    assert int(page.locator("#tokens").text_content() or "0") > 1
    SCREENSHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=SCREENSHOT)


def test_stop_ends_the_stream_and_the_request(page: Page, openai_server: Server) -> None:
    page.fill("#temperature", "1")
    page.fill("#seed", "0")
    page.fill("#max_tokens", MAX_TOKENS)
    # Press Stop at the first streamed text, from inside the page, so no race decides the test.
    page.evaluate(
        """() => new MutationObserver((_, observer) => {
            observer.disconnect();
            document.querySelector("#stop").click();
        }).observe(document.querySelector("#transcript"), {subtree: true, characterData: true})"""
    )
    page.fill("#message", "Count to a hundred.")
    page.click("#send")

    reply = page.locator("#transcript li.assistant")
    expect(reply.locator(".note")).to_have_text("stopped")
    expect(page.locator("#send")).to_be_enabled()
    assert 0 < int(page.locator("#tokens").text_content() or "0") < int(MAX_TOKENS)
    deadline = time.monotonic() + 10  # the server aborts the request when the page hangs up
    while requests_in_flight(openai_server) > 0:
        assert time.monotonic() < deadline, "the stopped request is still running"
        time.sleep(0.1)


def test_a_rejected_request_shows_as_an_error(page: Page) -> None:
    page.fill("#temperature", "-1")
    page.fill("#message", "<b>Hi</b>")
    page.press("#message", "Enter")  # Enter sends too

    expect(page.locator("#transcript li.user")).to_contain_text("<b>Hi</b>")  # text, not HTML
    expect(page.locator("#transcript li.assistant.error")).to_contain_text("temperature")
    expect(page.locator("#transcript li.user .note")).to_have_text("not answered")
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()


RECORD_LENGTHS = """() => {
    // Every DOM update of the reply, recorded in the page: polling from the test could miss
    // all but the last when a tiny model streams its whole reply within a few milliseconds.
    window.replyLengths = [];
    new MutationObserver(() => {
        const bubble = document.querySelector("#transcript li.assistant");
        if (bubble) window.replyLengths.push(bubble.textContent.length);
    }).observe(document.querySelector("#transcript"),
               {subtree: true, childList: true, characterData: true});
}"""


def watch_reply(page: Page, timeout: float = 30.0) -> list[int]:
    """The assistant bubble's successive text lengths, once the stream ends (Stop disabled).
    Call `page.evaluate(RECORD_LENGTHS)` before sending."""
    page.wait_for_selector("#transcript li.assistant")
    expect(page.locator("#stop")).to_be_disabled(timeout=timeout * 1000)
    lengths: list[int] = page.evaluate("() => window.replyLengths")
    return [n for i, n in enumerate(lengths) if i == 0 or n != lengths[i - 1]]


def requests_in_flight(server: Server) -> float:
    metrics = httpx.get(f"{server.url}/metrics").text
    total = 0.0
    for name in ("num_requests_running", "num_requests_waiting"):
        match = re.search(rf"^xlaserve:{name}\{{[^}}]*\}} (\S+)$", metrics, re.MULTILINE)
        assert match, f"/metrics has no xlaserve:{name}"
        total += float(match.group(1))
    return total
