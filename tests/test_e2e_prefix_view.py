"""Issue 23 in a real browser: the image viewer shows what the compact prefix kept.

The whole app (Gradio page mounted) runs in this process on the tiny test model, so the test can
ask the engine itself (``Engine.prefix_info``) what it kept and compare the page with it. The
photo is a 3:2 one (``coffee.png``, 600×400) stored sideways with EXIF orientation 6: the browser
shows it 400×600, and the model sees it so too (a 19 × 12 merged-token grid).

Checked in headless Chromium, on the owner's page and on a read-only share page: the viewer's
"what the model keeps" grid has exactly the engine's rows × cols cells, its dimmed cells are
exactly the dropped tokens, and it covers the image's box within 1 px; before the first question,
and after the cache is cleared (the grid is fetched afresh, not kept by the page), it says "not
cached" and draws nothing. Screenshots go to ``artifacts/e2e/`` (look at them).
"""

from __future__ import annotations

import io

import pytest
from conftest import media_file
from PIL import Image
from test_e2e_browser import (  # noqa: F401 (sync_playwright: the fixture)
    ARTIFACTS,
    CHROMIUM,
    CHROMIUM_ARGS,
    IMAGES_LOADED,
    _short_answers,
    sync_playwright,
)

from app.chat import ChatService
from app.model_loader import ModelChoice, ModelLoader
from app.server import create_app
from app.settings import Settings
from sessions import SessionStore

pytestmark = pytest.mark.slow

#: The viewer's grid as the page draws it: the cells' boxes (row-major) and which are dimmed, the
#: grid's and the image's boxes, the image's natural size and the status line.
OVERLAY = """() => {
  const v = document.querySelector('.prism-viewer');
  const grid = v.querySelector('.prism-kept-grid'), img = v.querySelector('.prism-viewer-img');
  const box = (el) => { const r = el.getBoundingClientRect();
    return {left: r.left, top: r.top, right: r.right, bottom: r.bottom, width: r.width, height: r.height}; };
  const cells = Array.from(grid.children).map((c) => ({...box(c), dimmed: c.classList.contains('prism-dropped-cell'),
    shade: getComputedStyle(c).backgroundColor}));
  const badge = v.querySelector('.prism-preview-badge');
  return {shown: !v.hidden && !grid.hidden && grid.offsetParent !== null, cells, grid: box(grid), img: box(img),
          preview: grid.classList.contains('prism-kept-preview') && !badge.hidden && badge.offsetParent !== null,
          natural: [img.naturalWidth, img.naturalHeight], status: v.querySelector('.prism-viewer-status').innerText};
}"""


def sideways_photo() -> bytes:
    """``coffee.png`` (600×400, 3:2) as a JPEG whose pixels lie as stored and whose EXIF
    orientation (6: turn 90° clockwise to show) makes it a 400×600 portrait."""
    image = Image.open(media_file("coffee.png")).convert("RGB")
    assert image.size == (600, 400)
    exif = Image.Exif()
    exif[0x0112] = 6
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90, exif=exif)
    return out.getvalue()


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_engine_factory, live_server):
    data = tmp_path_factory.mktemp("prefix-view-data")
    engine = tiny_engine_factory(kv_cache_bytes=64 << 20, compaction_mode="on_pressure")  # the app's default
    settings = Settings(data_dir=data, max_upload_mb=2, warm="off")  # "not cached" until the first question
    store = SessionStore(data, image_options=settings.image_options())
    loader = ModelLoader.ready(engine, ModelChoice("tiny", "tiny-test", False, "test"), settings)
    chat = ChatService(store, loader, max_upload_bytes=settings.max_upload_bytes)
    server = live_server(create_app(settings, store, loader, chat))
    yield server.url, engine, store, chat
    store.close()


def _open_viewer(page) -> None:
    page.click(".prism-images .prism-image .prism-open")
    page.wait_for_selector(".prism-viewer:not([hidden]) .prism-viewer-img", state="visible")
    page.wait_for_function("() => document.querySelector('.prism-viewer-img').naturalWidth > 0")


def _toggle_on(page) -> None:
    page.check(".prism-viewer-toggle input")
    page.wait_for_function("() => !document.querySelector('.prism-viewer-status').innerText.startsWith('Asking')")


def _check_overlay(overlay: dict, item: dict) -> None:
    """The page's grid against the engine's report for the image (``item``)."""
    rows, cols = item["rows"], item["cols"]
    cells = overlay["cells"]
    assert overlay["shown"] and len(cells) == rows * cols, (len(cells), rows, cols)
    # laid out as rows × cols: every row of cells shares its top, every column its left
    tops = sorted({round(c["top"], 1) for c in cells})
    lefts = sorted({round(c["left"], 1) for c in cells})
    assert (len(tops), len(lefts)) == (rows, cols), (len(tops), len(lefts))
    assert [c["dimmed"] for c in cells] == [not k for row in item["kept"] for k in row]
    assert sum(not c["dimmed"] for c in cells) == item["kept_count"] < rows * cols
    assert len({c["shade"] for c in cells if c["dimmed"]}) == 1 and all(
        c["shade"] == "rgba(0, 0, 0, 0)" for c in cells if not c["dimmed"])  # dropped dimmed, kept clear
    for side in ("left", "top", "right", "bottom"):
        assert abs(overlay["grid"][side] - overlay["img"][side]) <= 1, (side, overlay["grid"], overlay["img"])
    # the browser shows the photo upright (EXIF applied), as the model sees it: portrait, with
    # the grid's shape (smart_resize rounds each side to a multiple of 32 px: 400×600 -> 384×608)
    assert overlay["natural"] == [400, 600], overlay["natural"]
    assert abs(overlay["img"]["width"] / overlay["img"]["height"] - cols / rows) < 0.1 * cols / rows
    # a dense prefix (on_pressure, memory to spare) shows the first compaction step's choice, marked
    verb = "would keep" if item["preview"] else "kept"
    assert overlay["preview"] == item["preview"] and overlay["status"].startswith("Preview") == item["preview"]
    assert f"{verb} {item['kept_count']} of {rows * cols} visual tokens" in overlay["status"], overlay["status"]
    assert "selector: uniform" in overlay["status"], overlay["status"]


def test_the_viewer_draws_the_engines_kept_tokens_over_the_whole_image(sync_playwright, env):  # noqa: F811
    url, engine, store, chat = env
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            ctx = browser.new_context(viewport={"width": 1280, "height": 900})
            page = ctx.new_page()
            page.set_default_timeout(60_000)
            page.goto(url)
            owner = next(c["value"] for c in ctx.cookies() if c["name"] == "prism_owner")
            session, problems = chat.add_images(None, owner, [("coffee-sideways.jpg", sideways_photo())])
            assert not problems and session is not None
            page.reload()
            page.wait_for_function("() => document.querySelectorAll('#prism-images .prism-image').length === 1")
            page.wait_for_function(IMAGES_LOADED)
            _short_answers(page, 16)
            page.locator("#prism-images").screenshot(path=str(ARTIFACTS / "prefix-card.png"))

            # before the first question: nothing cached, so nothing drawn, and it says so
            _open_viewer(page)
            _toggle_on(page)
            overlay = page.evaluate(OVERLAY)
            assert not overlay["shown"] and overlay["status"].startswith("Not cached"), overlay
            page.screenshot(path=str(ARTIFACTS / "prefix-not-cached.png"))
            page.keyboard.press("Escape")
            page.wait_for_selector(".prism-viewer", state="hidden")
            page.click(".prism-images .prism-image > img")  # the photo opens it too
            page.wait_for_selector(".prism-viewer:not([hidden])")
            page.click(".prism-viewer-close")
            page.wait_for_selector(".prism-viewer", state="hidden")

            page.fill("#prism-question textarea", "What is in the picture?")
            page.click("#prism-send")
            page.wait_for_function("() => { const c = document.querySelectorAll('#prism-chat .prism-tel');"
                                   " return c.length === 1 && !c[0].classList.contains('prism-tel-streaming'); }",
                                   timeout=120_000)
            salt = store.get_session(session.id).cache_salt
            info = engine.prefix_info(salt, preview=True)
            assert info is not None and len(info) == 1
            item = info[0]
            assert item["preview"] and engine.prefix_info(salt)[0]["kept_count"] == 19 * 12  # dense
            assert (item["rows"], item["cols"]) == (19, 12)  # 608 × 384 px as processed, 32 px per token

            _open_viewer(page)  # the toggle stays on: the grid is fetched as the viewer opens
            page.wait_for_selector(".prism-kept-grid .prism-kept-cell")
            overlay = page.evaluate(OVERLAY)
            _check_overlay(overlay, item)
            page.screenshot(path=str(ARTIFACTS / "prefix-viewer.png"))

            # memory runs short: the prefix is compacted as previewed, and the viewer shows it as kept
            with engine.loop.paused():
                while not engine.prefix_cache.stats.pressure_compactions:
                    assert engine.prefix_cache.make_room(engine.pool.num_free + 1)
            compacted = engine.prefix_info(salt)[0]
            assert not compacted["preview"] and compacted["kept"] == item["kept"]
            page.uncheck(".prism-viewer-toggle input")
            _toggle_on(page)
            _check_overlay(page.evaluate(OVERLAY), compacted)
            page.screenshot(path=str(ARTIFACTS / "prefix-viewer-compacted.png"))

            # fetched afresh, not remembered by the page: evicted, it says so at once
            page.uncheck(".prism-viewer-toggle input")
            engine.clear_prefix_cache()
            _toggle_on(page)
            overlay = page.evaluate(OVERLAY)
            assert not overlay["shown"] and overlay["status"].startswith("Not cached"), overlay
            page.keyboard.press("Escape")

            # cached again by the next question; then a read-only share shows the same grid
            page.fill("#prism-question textarea", "And the colours?")
            page.click("#prism-send")
            page.wait_for_function("() => { const c = document.querySelectorAll('#prism-chat .prism-tel');"
                                   " return c.length === 2 && !c[1].classList.contains('prism-tel-streaming'); }",
                                   timeout=120_000)
            token, _ = store.create_share(session.id, owner, "read")
            viewer_ctx = browser.new_context(viewport={"width": 1100, "height": 860})
            viewer = viewer_ctx.new_page()
            viewer.set_default_timeout(60_000)
            assert viewer.goto(f"{url}/s/{token}").status == 200
            viewer.wait_for_function(IMAGES_LOADED)
            _open_viewer(viewer)
            _toggle_on(viewer)
            viewer.wait_for_selector(".prism-kept-grid .prism-kept-cell")
            _check_overlay(viewer.evaluate(OVERLAY), engine.prefix_info(salt, preview=True)[0])
            viewer.screenshot(path=str(ARTIFACTS / "prefix-viewer-shared.png"))
            viewer_ctx.close()
        finally:
            browser.close()
