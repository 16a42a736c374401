"""Issue 23, the app's part: ``GET /sessions/<id>/prefix`` (the owner's cookie) and
``GET /s/<token>/prefix`` (a live share) tell the image viewer what the session's compact prefix
kept of each image, as the engine reports it; everyone else gets the 404 of a missing session,
the salt never leaves the server, a restart or changed images show "not cached".

Each test says what another client (the attacker) sees; all fail on the code before issue 23
(the routes did not exist: 404 for everyone, or a 500 on a missing ``prefix_info``).
"""

from __future__ import annotations

import io
import types

import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from app.chat import NOT_CACHED, NOT_LOADED, ChatOptions, ChatService
from app.model_loader import ModelChoice, ModelLoader
from app.server import create_app
from app.settings import Settings
from sessions import SessionStore

TINY = ModelChoice("tiny", "tiny-test", False, "test")
ONE_TOKEN = ChatOptions(max_tokens=1)


def png(seed: int, size=(384, 256)) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(size[1], size[0], 3, generator=gen) * 255).to(torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def make_app(data, engine):
    """The app without prefix warming: these tests pin what the viewer says before and after a
    first question (tests/test_app_warm.py: after an upload's warm)."""
    settings = Settings(data_dir=data, max_upload_mb=2, warm="off")
    store = SessionStore(data, image_options=settings.image_options())
    loader = ModelLoader.ready(engine, TINY, settings)
    chat = ChatService(store, loader, max_upload_bytes=settings.max_upload_bytes)
    return types.SimpleNamespace(app=create_app(settings, store, loader, chat, mount_ui=False), store=store,
                                 chat=chat, engine=engine)


def browser(env) -> tuple[TestClient, str]:
    """A client with its own owner cookie, as a browser gets on its first request."""
    client = TestClient(env.app)
    client.get("/healthz")
    return client, client.cookies.get("prism_owner")


def answer(env, session_id: str, owner: str, question: str = "What is this?") -> None:
    final = list(env.chat.ask(session_id, owner, question, ONE_TOKEN))[-1]
    assert final.status == "done", final


@pytest.fixture
def env(tmp_path, tiny_engine_factory):
    made = make_app(tmp_path / "data", tiny_engine_factory(kv_cache_bytes=32 << 20))
    yield made
    made.store.close()


def test_the_owner_sees_what_the_engine_kept(env):
    """Before the first question every image says "not cached"; after it, each image's grid is
    the engine's own report for the session's salt, with its summary line, never stored by the
    browser, and the salt is nowhere in the response."""
    client, owner = browser(env)
    session, _ = env.chat.add_images(None, owner, [("a.png", png(1)), ("b.png", png(2, (256, 384)))])
    url = f"/sessions/{session.id}/prefix"
    before = client.get(url)
    assert before.status_code == 200 and before.headers["cache-control"] == "no-store"
    assert [(i["number"], i["cached"], i["summary"]) for i in before.json()["images"]] == [
        (1, False, NOT_CACHED), (2, False, NOT_CACHED)]
    answer(env, session.id, owner)
    got = client.get(url)
    salt = env.store.get_session(session.id).cache_salt
    report = env.engine.prefix_info(salt)
    assert len(report) == 2
    for item, engine_item, sha in zip(got.json()["images"], report, session.image_shas, strict=True):
        assert item["cached"] and item["sha256"] == sha
        for field in ("rows", "cols", "kept", "kept_count", "selector", "keep_ratio"):
            assert item[field] == engine_item[field], field
        total = item["rows"] * item["cols"]
        assert item["kept_count"] < total
        assert item["summary"] == (f"kept {item['kept_count']} of {total} visual tokens · "
                                   "selector: uniform (keep ratio 0.6)")
    assert salt not in got.text and "salt" not in got.text


def test_other_owners_and_strangers_get_the_404_of_a_missing_session(env):
    """Another owner, a browser without a cookie, an unknown or malformed id, a revoked or unknown
    share token: all the same 404 body, whether or not the session exists, so the route tells
    them nothing (not even that the id is real). A live share token sees the same report as the
    owner, read-only."""
    client, owner = browser(env)
    session, _ = env.chat.add_images(None, owner, [("a.png", png(3))])
    answer(env, session.id, owner)
    stranger, _ = browser(env)
    missing = stranger.get("/sessions/AAAAAAAAAAAAAAAA/prefix")
    assert missing.status_code == 404
    for path in (f"/sessions/{session.id}/prefix", "/sessions/" + "x" * 300 + "/prefix", "/sessions/%00/prefix",
                 "/sessions/ü/prefix", "/sessions/a'%20OR%201=1/prefix"):
        r = stranger.get(path)
        assert (r.status_code, r.content) == (404, missing.content), path
    assert stranger.get("/sessions/..%2f/prefix").status_code == 404  # no route: FastAPI's own 404
    no_cookie = TestClient(env.app, cookies=None).get(f"/sessions/{session.id}/prefix")
    assert (no_cookie.status_code, no_cookie.content) == (404, missing.content)

    token, share = env.store.create_share(session.id, owner, "read")
    shared = TestClient(env.app).get(f"/s/{token}/prefix")
    assert shared.status_code == 200 and shared.json() == client.get(f"/sessions/{session.id}/prefix").json()
    assert shared.json()["images"][0]["cached"]
    env.store.revoke_share(share.id, owner)
    for path in (f"/s/{token}/prefix", "/s/not-a-token/prefix"):
        r = TestClient(env.app).get(path)
        assert (r.status_code, r.content) == (404, missing.content), path


def test_a_restart_shows_not_cached(tmp_path, tiny_engine_factory):
    """The store survives a restart, the engine's cache does not: the same session on a new
    server (new engine, same data dir) says "not cached" for each image rather than show a
    grid it no longer holds."""
    data = tmp_path / "data"
    first = make_app(data, tiny_engine_factory(kv_cache_bytes=32 << 20))
    client, owner = browser(first)
    session, _ = first.chat.add_images(None, owner, [("a.png", png(4))])
    answer(first, session.id, owner)
    assert client.get(f"/sessions/{session.id}/prefix").json()["images"][0]["cached"]
    first.engine.close()
    first.store.close()
    second = make_app(data, tiny_engine_factory(kv_cache_bytes=32 << 20))
    try:
        again = TestClient(second.app, cookies={"prism_owner": owner}).get(f"/sessions/{session.id}/prefix")
        assert again.status_code == 200
        assert [(i["cached"], i["summary"]) for i in again.json()["images"]] == [(False, NOT_CACHED)]
    finally:
        second.store.close()


def test_changed_images_show_the_prefix_the_next_question_would_attach(env):
    """After an image is added the next question computes a new prefix: every image says "not
    cached" (not the old prefix's grid under shifted cards). Removing it again brings back the
    prefix of the images that are left, which is still cached and which the next question hits."""
    client, owner = browser(env)
    session, _ = env.chat.add_images(None, owner, [("a.png", png(5))])
    answer(env, session.id, owner)
    url = f"/sessions/{session.id}/prefix"
    alone = client.get(url).json()["images"]
    assert alone[0]["cached"]
    session, _ = env.chat.add_images(session.id, owner, [("b.png", png(6))])
    assert [i["cached"] for i in client.get(url).json()["images"]] == [False, False]
    env.chat.remove_image(session.id, owner, session.image_shas[1])
    assert client.get(url).json()["images"] == alone


def test_a_loading_model_says_so(tmp_path):
    """While the model loads there is no cache: every image says so."""
    store = SessionStore(tmp_path / "data")
    try:
        chat = ChatService(store, types.SimpleNamespace(engine=None, state="loading"))
        session = store.create_session(SessionStore.new_owner_key(), "t")
        session = types.SimpleNamespace(id=session.id, image_shas=["0" * 64], cache_salt=session.cache_salt)
        assert chat.prefix_view(session) == {"images": [
            {"number": 1, "sha256": "0" * 64, "cached": False, "summary": NOT_LOADED}]}
    finally:
        store.close()


def test_the_chat_asks_for_its_own_salt_and_images_and_a_dense_prefix_reads_all_kept(tmp_path):
    """The chat hands the engine the session's own salt and its images in prompt order (the
    engine then reports only a prefix of exactly those), passes the grid on untouched, and a
    prefix that kept every token reads "all kept"."""
    calls = []
    dense = {"image": 0, "rows": 2, "cols": 3, "kept": [[True] * 3] * 2, "kept_count": 6, "selector": None,
             "keep_ratio": 1.0}

    class Engine:
        def prefix_info(self, salt, images, preview=False):
            calls.append((salt, images, preview))
            return [dense]

    store = SessionStore(tmp_path / "data")
    try:
        chat = ChatService(store, types.SimpleNamespace(engine=Engine()))
        owner = SessionStore.new_owner_key()
        session, _ = chat.add_images(None, owner, [("a.png", png(7))])
        [item] = chat.prefix_view(session)["images"]
        assert calls == [(session.cache_salt, session.image_shas, True)]
        assert item["kept"] == dense["kept"] and item["cached"] and item["selector"] is None
        assert item["summary"] == "all kept: 6 of 6 visual tokens · dense prefix (no compaction)"
    finally:
        store.close()


def test_a_dense_prefix_shows_what_a_compaction_on_pressure_would_keep(tmp_path, tiny_engine_factory):
    """Under the default ``on_pressure`` a cached prefix is dense, and the viewer said "all kept"
    (nothing to see). The owner's JSON now carries, marked as a preview, the engine's report of
    what the first compaction step would keep, with its step and keep ratio in the summary; once
    memory ran short and the prefix was compacted, the real kept set is shown, not a preview."""
    env = make_app(tmp_path / "data", tiny_engine_factory(kv_cache_bytes=32 << 20, compaction_mode="on_pressure"))
    try:
        client, owner = browser(env)
        session, _ = env.chat.add_images(None, owner, [("a.png", png(1)), ("b.png", png(2, (256, 384)))])
        answer(env, session.id, owner)
        salt = env.store.get_session(session.id).cache_salt
        assert all(i["kept_count"] == i["rows"] * i["cols"] for i in env.engine.prefix_info(salt))  # dense
        got = client.get(f"/sessions/{session.id}/prefix").json()["images"]
        for item, engine_item in zip(got, env.engine.prefix_info(salt, preview=True), strict=True):
            total = item["rows"] * item["cols"]
            assert item["cached"] and item["preview"] and item["step"] == 0 and item["steps"] == 1
            assert item["kept"] == engine_item["kept"] and item["kept_count"] == engine_item["kept_count"] < total
            assert item["summary"] == (f"Preview (all {total} are kept now, the prefix is dense): when KV memory "
                                       f"runs short, compaction step 1 of 1 would keep {item['kept_count']} of "
                                       f"{total} visual tokens · selector: uniform (keep ratio 0.6)")
        cache = env.engine.prefix_cache
        with env.engine.loop.paused():
            while not cache.stats.pressure_compactions:  # memory runs short
                assert cache.make_room(env.engine.pool.num_free + 1)
        after = client.get(f"/sessions/{session.id}/prefix").json()["images"]
        assert [(i["kept"], i["preview"]) for i in after] == [(i["kept"], False) for i in got]
        assert after[0]["summary"].startswith(f"kept {got[0]['kept_count']} of ")
    finally:
        env.store.close()


def test_the_pages_panel_says_a_dense_prefix_was_not_compacted():
    """A dense prefix (the default while KV memory lasts) was drawn as "compact 9" beside "dense 9"
    with "0% fewer pages", as if a compaction had run and saved nothing. It now says the prefix is
    dense; a compacted one still shows its saving."""
    from app import render

    dense = render.pages_panel({"compact": 9, "dense": 9, "visual_tokens": 126, "visual_tokens_kept": 126})
    assert "Not compacted" in dense and "all 126 visual tokens kept" in dense
    assert "fewer pages" not in dense and "<span>compact</span>" not in dense and "<span>cached</span>" in dense
    compact = render.pages_panel({"compact": 6, "dense": 9, "visual_tokens": 126, "visual_tokens_kept": 76})
    assert "33% fewer pages: keeps 76 of 126 visual tokens" in compact and "<span>compact</span>" in compact
    assert "Not compacted" not in compact
    # the panel is the prefix at the last answer: a later compaction on pressure does not redraw it
    assert all("Image prefix KV pages (at the last answer)" in html for html in (dense, compact))
