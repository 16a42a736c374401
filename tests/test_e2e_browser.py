"""End to end in a real browser: ``python launch.py`` on a tiny checkpoint, driven by Playwright
through Debian's Chromium.

Uploads two sample photos, waits for the upload's prefix warm (issue 34), asks two questions, and
checks that the first answer's telemetry says ``prefix HIT (warmed at upload)`` and the second a
plain HIT (no encoder, the cached prefix reused, only the question computed; the TTFT chart marks
the warmed one), that Send turns into Stop while an answer streams, that the image cards keep
their open and remove buttons off the photo and their labels on one line, that the conversation
has the window's height at three sizes (one scroll container, the question and the last answer in
view), that "+ New chat" gets darker
(not lighter, which looked disabled) under the mouse, that the page shows no error and loads
nothing from outside, then opens a read-only share link in a second browser context, continues a
"continue" link there (its first question hits the warm prefix, the copy is titled as a copy),
pastes a small image in the first (a notice says it was upscaled) and removes it, regenerates an
older answer (the later turns go, the prefix still hits) and edits a past question. Screenshots
and the server log go to ``artifacts/e2e/`` (``PRISM_UPDATE_SCREENSHOTS=1`` also copies the main
one to ``docs/screenshot.png``, and the clip's to ``docs/screenshot-video.png``). A first test
uploads a video clip and asks two questions about it (warmed HIT, then HIT). Finally Ctrl-C (SIGINT)
must stop the server cleanly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import CI, media_file, missing_fixture

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "artifacts" / "e2e"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
# every image thumbnail has loaded
IMAGES_LOADED = """() => Array.from(document.querySelectorAll('.prism-image img'))
  .every((i) => i.complete && i.naturalWidth > 0)"""
# the last telemetry chip is final (not "generating ...") and there are at least n of them
ANSWERED = """(n) => { const c = document.querySelectorAll('#prism-chat .prism-tel');
  return c.length >= n && !c[c.length - 1].classList.contains('prism-tel-streaming'); }"""
# exactly n answers, none still streaming (after a regenerate or an edit replaced later turns)
ANSWERED_EXACTLY = """(n) => { const c = document.querySelectorAll('#prism-chat .prism-tel');
  return c.length === n && !document.querySelector('#prism-chat .prism-tel-streaming'); }"""
# remember whether Stop ever showed in Send's place (an answer of the tiny model streams for well
# under a second: a one-off check could miss it)
WATCH_STOP = """() => { window.prismSawStop = false;
  const shown = (sel) => { const el = document.querySelector(sel); return !!el && el.offsetParent !== null; };
  new MutationObserver(() => { if (shown('#prism-stop') && !shown('#prism-send')) window.prismSawStop = true; })
    .observe(document.body, {subtree: true, childList: true, attributes: true}); }"""
# per image card: does the remove button overlap the photo, and does the "Image N · WxH" label wrap?
CARD_LAYOUT = """() => Array.from(document.querySelectorAll('#prism-images .prism-image')).map((card) => {
  const img = card.querySelector('img').getBoundingClientRect();
  const on = (sel) => { const x = card.querySelector(sel).getBoundingClientRect();
    return x.left < img.right && x.right > img.left && x.top < img.bottom && x.bottom > img.top; };
  const label = card.querySelector('.prism-image-label');
  const lines = label.getBoundingClientRect().height / parseFloat(getComputedStyle(label).lineHeight);
  return {overlap: on('.prism-remove') || on('.prism-open'), lines, text: label.innerText}; })"""
# The page's layout: the chat's box, the question row's, the last telemetry chip's, and every element
# that scrolls vertically (content taller than its box, with overflow auto or scroll, or the page).
LAYOUT = """() => {
  const box = (el) => { const r = el.getBoundingClientRect();
    return {top: r.top, bottom: r.bottom, height: r.height}; };
  const chips = document.querySelectorAll('#prism-chat .prism-tel');
  const scrollers = [document.scrollingElement, ...document.querySelectorAll('body *')].filter((el) => {
    const y = getComputedStyle(el).overflowY;
    return el.scrollHeight > el.clientHeight + 1 && (el === document.scrollingElement ? y !== 'hidden'
      && getComputedStyle(document.body).overflowY !== 'hidden' : /auto|scroll/.test(y));
  });
  return {vh: innerHeight, chat: box(document.querySelector('#prism-chat')),
          input: box(document.querySelector('#prism-inputrow')), last: box(chips[chips.length - 1]),
          titlebar: box(document.querySelector('#prism-titlebar')),
          scrollers: scrollers.map((el) => el === document.scrollingElement ? 'the page'
            : el.closest('#prism-chat') ? 'the chat' : (el.id || el.className || el.tagName).toString())};
}"""
# the chat's own scroller has reached its end (Gradio scrolls it to the newest message)
CHAT_AT_END = """() => { const el = Array.from(document.querySelectorAll('#prism-chat *'))
  .find((e) => /auto|scroll/.test(getComputedStyle(e).overflowY) && e.scrollHeight > e.clientHeight);
  return !el || el.scrollTop + el.clientHeight >= el.scrollHeight - 2; }"""
LUMINANCE = """(sel) => { const [r, g, b] = getComputedStyle(document.querySelector(sel)).backgroundColor
  .match(/[\\d.]+/g).map(Number); return 0.2126 * r + 0.7152 * g + 0.0722 * b; }"""

pytestmark = pytest.mark.slow


def _playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing_fixture("Playwright for Python is not installed (pip install playwright; CI installs it)")
    if not os.path.exists(CHROMIUM):
        missing_fixture(f"Debian's Chromium is not installed at {CHROMIUM} (apt-get install chromium; CI installs it)")
    return sync_playwright


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"launch.py exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "healthz", timeout=2) as r:
                return json.loads(r.read())
        except Exception:
            time.sleep(0.3)
    pytest.fail(f"the app did not become healthy in {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _warms_built(url: str) -> int:
    """How many prefix warms the server's engine has finished, built or found cached (``/healthz``)."""
    with urllib.request.urlopen(url + "healthz", timeout=5) as r:
        stats = json.loads(r.read())["engine"]
    return stats["warms_computed"] + stats["warms_cached"]


def _wait_for_warm(url: str, before: int, timeout: float = 120.0) -> None:
    """Wait until the upload's warm (issue 34) has cached its prefix: the first question then
    attaches it, deterministically (sent during the warm it would join it; sent before the warm
    reached the engine, it would be the one to compute the prefix)."""
    deadline = time.monotonic() + timeout
    while _warms_built(url) <= before:
        if time.monotonic() > deadline:
            pytest.fail(f"the upload's prefix warm did not finish in {timeout:.0f} s")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def sync_playwright():
    """Playwright's entry point. When Playwright or Chromium is missing: skips (with the reason) on a
    developer's machine, fails under ``.ci/run`` (``PRISM_CI=1``), which installs both."""
    return _playwright()


@pytest.fixture(scope="module")
def server(sync_playwright, tiny_ckpt, tmp_path_factory):
    """``python launch.py --model <tiny ckpt> --port N --data-dir tmp --device cpu``; yields (url, proc, log)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    data = tmp_path_factory.mktemp("e2e-data")
    log = ARTIFACTS / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "launch.py", "--model", str(tiny_ckpt), "--port", str(port), "--data-dir", str(data),
             "--device", "cpu"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        health = _wait_healthy(url, proc, log)
        assert health["status"] == "ok" and health["device"] == "cpu"
        yield url, proc, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _tokens(chip_text: str, label: str) -> int:
    """The token count after ``label`` in a telemetry chip (``computed 19 tok``, ``reused 1,568 tok``)."""
    match = re.search(label + r" ([\d,]+) tok", chip_text)
    assert match, chip_text
    return int(match.group(1).replace(",", ""))


def _short_answers(page, tokens: int = 16) -> None:
    """Set "Max tokens per answer" in the settings panel (short answers keep the test quick)."""
    page.get_by_role("tab", name="Settings").click()
    page.fill("#prism-max-tokens input[type=number]", str(tokens))
    page.press("#prism-max-tokens input[type=number]", "Enter")
    page.get_by_role("tab", name="Session").click()


def local_only(outside: list[str]):
    """A playwright route handler that lets the page reach only this machine (and data:/blob:
    URLs), aborting and recording in ``outside`` every other URL it asks for."""

    def route(route):
        if route.request.url.startswith(("http://127.0.0.1", "http://localhost", "data:", "blob:")):
            return route.continue_()
        outside.append(route.request.url)
        return route.abort()

    return route


def _check_layout(page, ctx, url: str) -> None:
    """Issue 31.4 and 31.7 at 1440x1000, 1280x800 and 390x844, on the chat of two answers: the
    conversation has the room (at least 450 px of chat on a laptop's 1280x800), the question row
    and the last answer's telemetry are in the window without scrolling, the chat is the one
    element that scrolls (the page did too), the banner sits in the title bar without growing it;
    the edit pencil is a dark, 32 px button; the ⤢ and remove buttons are reached by the keyboard
    and ⤢ opens the viewer from it."""
    for width, height in ((1440, 1000), (1280, 800), (390, 844)):
        fresh = ctx.new_page()  # the same browser (cookie): the same chat, opened at this size
        try:
            fresh.set_viewport_size({"width": width, "height": height})
            fresh.goto(url)
            fresh.wait_for_function(ANSWERED, arg=2)
            fresh.wait_for_function(IMAGES_LOADED)
            fresh.wait_for_function(CHAT_AT_END)
            layout = fresh.evaluate(LAYOUT)
            fresh.screenshot(path=str(ARTIFACTS / f"layout-{width}x{height}.png"))
        finally:
            fresh.close()
        chat, vh, last = layout["chat"], layout["vh"], layout["last"]
        assert 0 <= layout["input"]["top"] and layout["input"]["bottom"] <= vh, layout
        assert chat["top"] <= last["top"] and last["bottom"] <= min(chat["bottom"], layout["input"]["top"]), layout
        if width < 768:
            continue  # a phone: the panels follow below the first screen, the page scrolls to them
        assert min(chat["bottom"], vh) - max(chat["top"], 0) >= 450, layout
        # nothing but the chat scrolls (the page did, beside the chat); the chat does once it is full
        assert set(layout["scrollers"]) <= {"the chat"} and len(layout["scrollers"]) <= 1, layout
        assert layout["titlebar"]["height"] < 60, layout  # the demo banner did not add a row
    assert page.locator("#prism-titlebar .prism-banner-warn").is_visible()

    pencil = page.locator("#prism-chat button[aria-label=Edit] >> nth=0")
    box = pencil.bounding_box()
    assert box["width"] >= 32 and box["height"] >= 32, box
    rgb = [float(v) for v in re.findall(r"[\d.]+", pencil.evaluate("(b) => getComputedStyle(b).color"))[:3]]
    assert 0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2] < 90, rgb  # dark on white, not light grey

    page.focus("#prism-images .prism-image >> nth=0 >> .prism-open")
    page.keyboard.press("Tab")  # on to the card's remove button
    assert page.evaluate("document.activeElement.getAttribute('aria-label')") == "Remove image 1"
    page.keyboard.press("Shift+Tab")
    page.keyboard.press("Enter")
    page.wait_for_selector(".prism-viewer:not([hidden])")
    assert page.evaluate("document.activeElement.classList.contains('prism-viewer-close')")
    page.keyboard.press("Escape")
    page.wait_for_selector(".prism-viewer", state="hidden")


# each answer's text as the chat shows it, without its telemetry chip and action buttons
ANSWER_TEXTS = """() => Array.from(document.querySelectorAll('#prism-chat .message.bot')).map((m) => {
  const c = m.cloneNode(true); c.querySelectorAll('.prism-tel, button').forEach((e) => e.remove());
  return c.textContent.trim(); })"""
QUESTION_TEXTS = """() => Array.from(document.querySelectorAll('#prism-chat .message.user'))
  .map((m) => m.textContent.trim())"""


def _lookups(page) -> tuple[int, int]:
    """The engine panel's prefix-cache (hits, misses) so far."""
    text = page.evaluate("() => document.querySelector('#prism-engine').textContent")
    found = re.search(r"(\d+) hit / (\d+) miss", text)
    assert found, text
    return int(found.group(1)), int(found.group(2))


def _cancelled_delete_and_guarded_stream(page) -> None:
    """Issue 31.1 and 31.2 in the clip test's browser (one browser session for both): Delete then
    Cancel keeps the chat; while an answer streams, Regenerate and Enter do nothing, and after it
    ends and a reload the chat shows exactly the answers that streamed."""
    questions, answers = page.evaluate(QUESTION_TEXTS), page.evaluate(ANSWER_TEXTS)
    assert len(questions) == 2 and len(answers) == 2 and all(answers), answers
    page.once("dialog", lambda dialog: dialog.dismiss())
    page.click("#prism-delete")
    page.reload()
    page.wait_for_function(ANSWERED_EXACTLY, arg=2, timeout=120_000)
    assert page.evaluate(QUESTION_TEXTS) == questions and page.evaluate(ANSWER_TEXTS) == answers
    assert page.locator("#prism-sessions [data-session]").count() == 1

    # the longest answer the slider allows: it is still streaming when the clicks below come
    _short_answers(page, 2048)
    page.fill("#prism-question textarea", "Tell me a long story.")
    page.press("#prism-question textarea", "Enter")
    page.wait_for_selector("#prism-stop", state="visible")
    page.wait_for_selector("#prism-chat .prism-tel-streaming")
    page.click("#prism-regenerate")
    page.fill("#prism-question textarea", "A question typed while it streams")
    page.press("#prism-question textarea", "Enter")
    assert page.is_visible("#prism-stop") and page.evaluate("document.body.classList.contains('prism-busy')")
    assert page.input_value("#prism-question textarea") == "A question typed while it streams"
    page.click("#prism-stop")
    page.wait_for_selector("#prism-send", state="visible")
    # the controls come back without another click (they stayed dimmed until one)
    page.wait_for_function("() => !document.body.classList.contains('prism-busy')", timeout=5_000)
    page.wait_for_function(ANSWERED_EXACTLY, arg=3, timeout=120_000)
    streamed = page.evaluate(ANSWER_TEXTS)
    assert page.evaluate(QUESTION_TEXTS) == [*questions, "Tell me a long story."]
    assert streamed[:2] == answers and streamed[2], streamed
    page.reload()
    page.wait_for_function(ANSWERED_EXACTLY, arg=3, timeout=120_000)
    assert page.evaluate(QUESTION_TEXTS) == [*questions, "Tell me a long story."]
    assert page.evaluate(ANSWER_TEXTS) == streamed
    assert page.query_selector("#prism-chat .prism-tel-streaming") is None



def test_browser_video_clip_miss_then_hit(sync_playwright, server):
    """A clip uploaded beside nothing else: a video card with its duration and poster frame, then
    two questions about it, both prefix hits: the upload warmed the prefix (the vision encoder ran
    over the sampled frames then, issue 34), so the first says ``prefix HIT (warmed at upload)``.
    Runs before the test below, which stops the server."""
    if not CI:  # the server decodes the clip with PyAV: under PRISM_CI=1 it must be there
        pytest.importorskip("av")
    url, _, _ = server
    clip = ROOT / "tests" / "media" / "pan.mp4"
    outside: list[str] = []
    only_local = local_only(outside)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
            ctx.route("**/*", only_local)
            page = ctx.new_page()
            page.set_default_timeout(60_000)
            page.goto(url)
            page.wait_for_selector("#prism-upload input[type=file]", state="attached")
            _short_answers(page)
            warms = _warms_built(url)
            page.set_input_files("#prism-upload input[type=file]", [str(clip)])
            page.wait_for_selector("#prism-images .prism-video", timeout=120_000)
            label = page.inner_text("#prism-images .prism-video .prism-image-label")
            assert label == "Video 1 · 0:08", label
            assert page.inner_text("#prism-images .prism-video .prism-duration") == "▶ 0:08"
            # the poster frame (a JPEG the store made at upload) decodes in the browser
            poster_size = page.evaluate("""() => new Promise((done) => {
                const im = new Image(); im.onload = () => done([im.naturalWidth, im.naturalHeight]);
                im.onerror = () => done(null); im.src = document.querySelector('.prism-video video').poster; })""")
            assert poster_size == [96, 64], poster_size
            # the card holds no squeezed native controls: its play button (or the picture) plays the
            # clip large in the viewer, with the browser's controls
            assert not page.eval_on_selector("#prism-images .prism-video video", "(v) => v.controls")
            assert page.get_attribute("#prism-images .prism-play", "aria-label") == "Play video 1, 0:08"
            for opener in ("#prism-images .prism-play", "#prism-images .prism-video video"):
                page.click(opener)
                page.wait_for_selector(".prism-viewer:not([hidden]) .prism-viewer-video", state="visible")
                played = page.eval_on_selector(".prism-viewer-video", """(v) => ({controls: v.controls,
                    src: v.src, width: v.getBoundingClientRect().width})""")
                assert played["controls"] and played["src"].endswith(
                    page.get_attribute("#prism-images .prism-video video", "src")) and played["width"] >= 400, played
                page.screenshot(path=str(ARTIFACTS / "video-playing.png"))
                page.keyboard.press("Escape")
                page.wait_for_selector(".prism-viewer", state="hidden")
            assert page.query_selector(".prism-notice-error") is None, page.inner_text("#prism-notice")

            _wait_for_warm(url, warms)
            for n, question in enumerate(("What moves in this clip?", "Which way does it pan?"), 1):
                page.fill("#prism-question textarea", question)
                page.press("#prism-question textarea", "Enter")
                page.wait_for_function(ANSWERED, arg=n, timeout=120_000)
            chips = [c.inner_text() for c in page.query_selector_all("#prism-chat .prism-tel")]
            assert chips[0].startswith("prefix HIT (warmed at upload) · TTFT"), chips
            assert "vision encoder" not in chips[0], chips
            assert chips[1].startswith("prefix HIT · TTFT") and "vision encoder ran" not in chips[1], chips
            assert _tokens(chips[1], "computed") < _tokens(chips[1], "reused"), chips
            assert page.query_selector(".prism-tel-error") is None
            page.evaluate("window.scrollTo(0, 0)")
            page.screenshot(path=str(ARTIFACTS / "video.png"))
            _cancelled_delete_and_guarded_stream(page)
            assert not outside, f"the page asked for outside resources: {outside}"
        finally:
            browser.close()
    if os.environ.get("PRISM_UPDATE_SCREENSHOTS"):
        shutil.copyfile(ARTIFACTS / "video.png", ROOT / "docs" / "screenshot-video.png")


def test_browser_chat_share_and_shutdown(sync_playwright, server):
    url, proc, log = server
    pictures = [media_file("astronaut.png"), media_file("coffee.png")]
    outside: list[str] = []
    only_local = local_only(outside)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            ctx = browser.new_context(viewport={"width": 1440, "height": 1000},
                                      permissions=["clipboard-read", "clipboard-write"])
            ctx.route("**/*", only_local)
            page = ctx.new_page()
            page.set_default_timeout(60_000)
            page.goto(url)
            page.wait_for_selector("#prism-upload input[type=file]", state="attached")
            page.wait_for_selector(".prism-banner-warn")  # the tiny model is flagged as random text
            page.get_by_role("tab", name="Engine").click()
            page.wait_for_function("() => /\\d+ hit \\/ \\d+ miss/.test("
                                   "document.querySelector('#prism-engine').textContent)")
            # the server is shared with the test above: count this chat's lookups from here
            lookups_before = _lookups(page)

            _short_answers(page)

            # Regenerate on a new, empty chat: nothing to regenerate, said as such (issue 31.3)
            page.click("#prism-regenerate")
            page.wait_for_function("() => /nothing to regenerate/i.test("
                                   "document.querySelector('#prism-notice').textContent)")
            assert "no longer exists" not in page.inner_text("#prism-notice")

            # "+ New chat" right after a click (the pointer still on it) must not look disabled
            page.mouse.move(0, 0)
            page.wait_for_timeout(400)
            at_rest = page.evaluate(LUMINANCE, "#prism-new")
            page.click("#prism-new")
            page.wait_for_timeout(400)  # past the colour transition
            assert page.evaluate(LUMINANCE, "#prism-new") <= at_rest, "the hovered button is lighter (looks disabled)"
            page.locator("#prism-sidebar").screenshot(path=str(ARTIFACTS / "new-chat-hover.png"))
            page.mouse.move(0, 0)

            warms = _warms_built(url)
            page.set_input_files("#prism-upload input[type=file]", [str(p) for p in pictures])
            page.wait_for_function("() => document.querySelectorAll('#prism-images .prism-image').length === 2")
            page.wait_for_function(IMAGES_LOADED)
            cards = page.evaluate(CARD_LAYOUT)
            assert [c["text"] for c in cards] == ["Image 1 · 512×512", "Image 2 · 600×400"], cards
            assert not any(c["overlap"] for c in cards) and all(c["lines"] < 1.5 for c in cards), cards
            page.locator("#prism-images").screenshot(path=str(ARTIFACTS / "image-cards.png"))

            _wait_for_warm(url, warms)  # the upload built the prefix: the first question is a hit too
            page.evaluate(WATCH_STOP)
            page.fill("#prism-question textarea", "What is in the first picture?")
            page.click("#prism-send")
            page.wait_for_function(ANSWERED, arg=1, timeout=120_000)
            page.wait_for_selector("#prism-send", state="visible")
            assert page.evaluate("window.prismSawStop"), "Stop never showed in Send's place while the answer streamed"
            assert not page.is_visible("#prism-stop")
            page.fill("#prism-question textarea", "And what is in the second one?")
            page.press("#prism-question textarea", "Enter")
            page.wait_for_function(ANSWERED, arg=2, timeout=120_000)
            page.wait_for_function("() => document.querySelectorAll('#prism-ttft-plot rect').length === 2")

            chips = [c.inner_text() for c in page.query_selector_all("#prism-chat .prism-tel")]
            assert len(chips) == 2, chips
            assert chips[0].startswith("prefix HIT (warmed at upload) · TTFT"), chips
            assert "vision encoder" not in chips[0], chips
            assert chips[1].startswith("prefix HIT · TTFT") and "vision encoder ran" not in chips[1], chips
            # both reused the warmed prefix and computed only their question (not a timing: the counts)
            for chip in chips:
                assert _tokens(chip, "computed") < _tokens(chip, "reused"), chips
            # the TTFT chart marks the warmed question
            assert page.locator("#prism-ttft-plot .prism-chart-warmed").count() == 1
            assert page.query_selector(".prism-tel-error") is None
            assert page.query_selector(".prism-notice-error") is None
            assert not page.query_selector_all(".toast-body.error, .toast-wrap .error"), "an error toast is shown"
            assert page.input_value("#prism-question textarea") == ""
            assert "What is in the first picture?" in page.inner_text("#prism-sessions")
            page.evaluate("window.scrollTo(0, 0)")
            page.wait_for_function(IMAGES_LOADED)
            page.screenshot(path=str(ARTIFACTS / "chat.png"))
            _check_layout(page, ctx, url)

            # our copy button copies an answer's text without its telemetry chip
            page.hover("#prism-chat .message.bot >> nth=1")
            page.click("#prism-chat .message.bot >> nth=1 >> .prism-copy-answer")
            copied = page.evaluate("() => navigator.clipboard.readText()")
            assert copied.strip() and "TTFT" not in copied and "prism-tel" not in copied, copied

            page.get_by_role("tab", name="Engine").click()
            page.wait_for_selector(".prism-engine")
            hits, misses = _lookups(page)
            # a warm is no lookup: both questions hit, nothing missed
            assert (hits - lookups_before[0], misses - lookups_before[1]) == (2, 0), page.inner_text("#prism-engine")
            page.screenshot(path=str(ARTIFACTS / "engine-panel.png"))

            # share read-only, open the link in a fresh browser context
            page.click("#prism-share-btn")
            page.wait_for_selector("#prism-share-dialog", state="visible")
            page.click("#prism-create-share")
            page.wait_for_selector("input.prism-link")
            link = page.input_value("input.prism-link")
            assert re.fullmatch(re.escape(url.rstrip("/")) + r"/s/[A-Za-z0-9_-]{20,}", link), link
            page.screenshot(path=str(ARTIFACTS / "share-dialog.png"))
            page.get_by_label("Can continue").check()
            page.fill("#prism-share-name input, #prism-share-name textarea", "for Alice")
            page.click("#prism-create-share")
            page.wait_for_function("(old) => { const i = document.querySelector('input.prism-link');"
                                   " return i && i.value !== old; }", arg=link)
            continue_link = page.input_value("input.prism-link")
            assert page.locator(".prism-shares li").count() == 2
            # each row says which link it is: its name, creation time and share id (issue 31.6)
            rows = [r.inner_text() for r in page.query_selector_all(".prism-shares li")]
            assert "for Alice" not in rows[0] and "for Alice" in rows[1], rows
            assert all(re.search(r"created \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", r) for r in rows), rows
            ids = [e.inner_text() for e in page.query_selector_all(".prism-shares li .prism-share-id")]
            assert len(ids) == 2 and len(set(ids)) == 2 and all(re.fullmatch(r"id \S{8,}", i) for i in ids), ids
            page.click("#prism-close-share")
            page.wait_for_selector("#prism-share-dialog", state="hidden")

            viewer_ctx = browser.new_context(viewport={"width": 1100, "height": 900})
            viewer_ctx.route("**/*", only_local)
            viewer = viewer_ctx.new_page()
            viewer.set_default_timeout(60_000)
            response = viewer.goto(link)
            assert response.status == 200
            text = viewer.inner_text("body")
            assert "What is in the first picture?" in text and "And what is in the second one?" in text
            assert "prefix HIT (warmed at upload)" in text and "prefix HIT · " in text
            assert viewer.locator(".prism-image img").count() == 2
            viewer.wait_for_function(IMAGES_LOADED)  # served by hash under the token: /s/<token>/images/<sha>
            assert viewer.locator("textarea, input, form, #prism-question").count() == 0
            viewer.screenshot(path=str(ARTIFACTS / "shared-read-only.png"), full_page=True)
            assert viewer.goto(url + "s/not-a-real-token").status == 404

            # a "continue" link gives the visitor their own copy, whose first question hits the warm prefix
            viewer.goto(continue_link)
            # offered at the top of the page too, not only below the end of the chat
            top = viewer.locator(".prism-fork-top button")
            assert top.is_visible() and top.bounding_box()["y"] < 200, top.bounding_box()
            assert viewer.locator(".prism-fork button").count() == 1
            top.click()
            viewer.wait_for_url(re.compile(r".*/\?session=.+"))
            viewer.wait_for_function(ANSWERED, arg=2)
            assert viewer.locator("#prism-images .prism-image").count() == 2
            _short_answers(viewer)
            viewer.fill("#prism-question textarea", "Is there anything else?")
            viewer.click("#prism-send")
            viewer.wait_for_function(ANSWERED, arg=3, timeout=120_000)
            chips = [c.inner_text() for c in viewer.query_selector_all("#prism-chat .prism-tel")]
            assert chips[2].startswith("prefix HIT"), chips
            assert viewer.input_value("#prism-title textarea").startswith("Copy of ")  # told apart from the original
            assert viewer.inner_text("#prism-sessions .prism-session-title").startswith("Copy of ")
            viewer.screenshot(path=str(ARTIFACTS / "forked.png"))
            viewer_ctx.close()

            # paste an image into the page, then remove it again
            page.evaluate("""async () => {
                const canvas = document.createElement('canvas'); canvas.width = 48; canvas.height = 32;
                const g = canvas.getContext('2d'); g.fillStyle = '#4f46e5'; g.fillRect(0, 0, 48, 32);
                const blob = await new Promise((done) => canvas.toBlob(done, 'image/png'));
                const data = new DataTransfer(); data.items.add(new File([blob], 'pasted.png', {type: 'image/png'}));
                document.dispatchEvent(new ClipboardEvent('paste', {clipboardData: data, bubbles: true}));
            }""")
            page.wait_for_function("() => document.querySelectorAll('#prism-images .prism-image').length === 3")
            assert "pasted.png" in page.inner_text("#prism-images")
            notice = page.inner_text("#prism-notice")  # 48×32 is under the model's minimum size
            assert "pasted.png" in notice and "48×32" in notice and "upscaled" in notice, notice
            page.screenshot(path=str(ARTIFACTS / "tiny-image.png"))
            page.click("#prism-images .prism-image:nth-child(3) .prism-remove")
            page.wait_for_function("() => document.querySelectorAll('#prism-images .prism-image').length === 2")

            # regenerate an older answer: the later turns go, the image prefix still hits
            page.fill("#prism-question textarea", "Anything else?")
            page.press("#prism-question textarea", "Enter")
            page.wait_for_function(ANSWERED, arg=3, timeout=120_000)
            page.hover("#prism-chat .message.bot >> nth=0")
            page.click("#prism-chat .message.bot >> nth=0 >> .prism-regenerate-answer")
            page.wait_for_function(ANSWERED_EXACTLY, arg=1, timeout=120_000)
            assert [m.inner_text() for m in page.query_selector_all("#prism-chat .message.user")] == [
                "What is in the first picture?"]
            assert page.inner_text("#prism-chat .prism-tel").startswith("prefix HIT")
            assert "the 2 questions after it and their answers were removed" in page.inner_text("#prism-notice")
            page.screenshot(path=str(ARTIFACTS / "regenerated.png"))

            # edit a past question: asked again from there
            page.fill("#prism-question textarea", "And what is in the second one?")
            page.press("#prism-question textarea", "Enter")
            page.wait_for_function(ANSWERED_EXACTLY, arg=2, timeout=120_000)
            page.click("#prism-chat button[aria-label=Edit] >> nth=0")  # the first question's
            page.fill("#prism-chat textarea", "What is in the first picture, exactly?")
            page.screenshot(path=str(ARTIFACTS / "editing.png"))
            page.click("#prism-chat button[aria-label=Submit]")
            page.wait_for_function(ANSWERED_EXACTLY, arg=1, timeout=120_000)
            page.wait_for_function("() => document.querySelector('#prism-chat .message.user').innerText"
                                   ".includes('exactly')")
            assert page.inner_text("#prism-chat .prism-tel").startswith("prefix HIT")
            assert page.query_selector(".prism-tel-error") is None
            page.screenshot(path=str(ARTIFACTS / "edited.png"))
            assert not outside, f"the page asked for outside resources: {outside}"
        finally:
            browser.close()

    if os.environ.get("PRISM_UPDATE_SCREENSHOTS"):
        shutil.copyfile(ARTIFACTS / "chat.png", ROOT / "docs" / "screenshot.png")
        shutil.copyfile(ARTIFACTS / "shared-read-only.png", ROOT / "docs" / "screenshot-shared.png")

    # Ctrl-C: a clean stop (answers cancelled, database closed), exit code 0
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    assert "database closed" in log.read_text()
