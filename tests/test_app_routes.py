"""The web app's own routes: health, the owner cookie, images by hash only, share links (read-only
view, continue/fork, revoke, 404s that reveal nothing), static files and the Gradio page."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from app.chat import ChatOptions, ChatService
from app.model_loader import ModelChoice, ModelLoader
from app.server import create_app
from app.settings import Settings, parse_settings
from sessions import SessionStore


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(kv_cache_bytes=64 << 20)


@pytest.fixture(scope="module")
def env(tmp_path_factory, engine, media_path):
    """(client, store, chat, owner, session) with one session holding two images and two answers."""
    data = tmp_path_factory.mktemp("app-data")
    settings = Settings(data_dir=data, max_upload_mb=2)
    store = SessionStore(data, image_options=settings.image_options())
    loader = ModelLoader.ready(engine, ModelChoice("tiny", "tiny-test", False, "test"), settings)
    chat = ChatService(store, loader, max_upload_bytes=settings.max_upload_bytes)
    app = create_app(settings, store, loader, chat)
    with TestClient(app) as client:
        first = client.get("/")
        owner = first.cookies.get("prism_owner")
        pictures = [media_path("astronaut.png"), media_path("coffee.png")]
        session, _ = chat.add_images(None, owner, [(p.name, p) for p in pictures])
        for q in ("What is in the first image?", "What about <b>the second</b>?"):
            list(chat.ask(session.id, owner, q, ChatOptions(max_tokens=5)))
        chat.rename(session.id, owner, "Astronaut & coffee")
        secret = store.create_session(owner, "My other secret chat")
        yield types_ns(client=client, store=store, chat=chat, owner=owner, session=session, secret=secret,
                       data=data, first=first)
    store.close()


def types_ns(**kw):
    import types

    return types.SimpleNamespace(**kw)


# ---------------------------------------------------------------------------------- basics
def test_page_sets_an_httponly_owner_cookie(env):
    header = env.first.headers["set-cookie"]
    assert "prism_owner=" in header and "HttpOnly" in header and "SameSite=Lax" in header
    assert len(env.owner) >= 32
    again = env.client.get("/")  # the client now sends it: no new one
    assert "prism_owner" not in again.headers.get("set-cookie", "")
    assert "/prism-static/prism.css" in again.text and again.status_code == 200


def test_healthz(env, tmp_path):
    r = env.client.get("/healthz")
    body = r.json()
    assert r.status_code == 200 and body["status"] == "ok"
    assert body["model"] == "tiny-test" and body["device"] == "cpu" and body["kv_cache_dtype"] == "fp8_e4m3"
    assert body["engine_status"] == "running" and "pages_free" in body["engine"]
    assert env.client.head("/healthz").status_code == 200  # load balancers probe with HEAD
    loading = ModelLoader(Settings())
    store = SessionStore(tmp_path)
    with TestClient(create_app(Settings(data_dir=tmp_path), store, loading, mount_ui=False)) as client:
        r = client.get("/healthz")
        assert r.status_code == 503 and r.json()["status"] == "loading"
    store.close()


def test_healthz_shows_the_host_tier(engine, tmp_path):
    """``/healthz`` reports the host-memory tier under the prefix cache (issue 33), read from the
    engine's stats: its budget, bytes allocated, pages total / used and entries; null when it is
    off (this engine has none) or the engine predates it."""
    from engine.client import InProcessClient

    class HostTierEngine(InProcessClient):
        def stats(self):
            return {**super().stats(), "host_cache_bytes": 64 << 20, "host_bytes_allocated": 3 << 20,
                    "host_pages_total": 1024, "host_pages_used": 48, "cache_host_entries": 2}

    choice = ModelChoice("tiny", "tiny-test", False, "test")
    store = SessionStore(tmp_path)
    for client_engine, expected in (
            (engine, None),
            (HostTierEngine(engine), {"bytes": 64 << 20, "bytes_allocated": 3 << 20, "pages_total": 1024,
                                      "pages_used": 48, "entries": 2})):
        app = create_app(Settings(data_dir=tmp_path), store, ModelLoader.ready(client_engine, choice), mount_ui=False)
        with TestClient(app) as client:
            body = client.get("/healthz").json()
        assert body["status"] == "ok" and "host_cache" in body and body["host_cache"] == expected
    store.close()


@pytest.mark.parametrize("mode", ["on_pressure", "always"])
def test_keep_ratio_one_loads_and_keeps_every_visual_token(demo_ckpt, tmp_path, media_path, mode):
    """``launch.py --keep-ratio 1.0`` (issue 29): the engine its settings ask for loads (it used to
    fail in the background, pressure steps refusing 1.0, so /healthz stayed 503), /healthz says
    ok, and a miss and a hit on one photo use all of its visual tokens."""
    from engine import SamplingParams
    from engine.inputs.prompts import media_first_messages

    settings = parse_settings(["--model", str(demo_ckpt), "--device", "cpu", "--keep-ratio", "1.0",
                               "--compaction-mode", mode, "--data-dir", str(tmp_path)], environ={})
    loader = ModelLoader(settings)
    loader.start()
    store = SessionStore(tmp_path)
    try:
        assert loader.wait(120), loader.error
        with TestClient(create_app(settings, store, loader, mount_ui=False)) as client:
            r = client.get("/healthz")
            assert r.status_code == 200 and r.json()["status"] == "ok", r.json()
        engine = loader.engine
        assert (engine.options.keep_ratio, engine.options.compaction_mode) == (1.0, mode)
        messages = media_first_messages([media_path("astronaut.png")], "What is this?")
        for state in ("miss", "hit"):
            tel = engine.generate(messages, SamplingParams(max_tokens=2), cache_salt="one").telemetry
            assert tel.prefix_cache == state and tel.visual_tokens_kept == tel.visual_tokens > 0
            assert tel.prefix_pages == tel.prefix_pages_dense
    finally:
        loader.close()
        store.close()


def test_static_files(env):
    assert env.client.get("/prism-static/prism.css").status_code == 200
    assert "paste" in env.client.get("/prism-static/prism.js").text
    assert env.client.get("/prism-static/../app/server.py").status_code == 404


# ---------------------------------------------------------------------------------- images
def test_image_route_serves_by_hash(env, media_path):
    sha = env.session.image_shas[0]
    r = env.client.get(f"/images/{sha}")
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert r.content == media_path("astronaut.png").read_bytes()
    assert r.headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize("bad", [
    "../../etc/passwd", "..%2F..%2Fetc%2Fpasswd", "%2e%2e/%2e%2e/etc/passwd", "/etc/passwd", "abc", "not-hex",
    "g" * 64, "A" * 64, "0" * 63, "0" * 65, "0" * 64, "prism.db", "../prism.db",
])
def test_image_route_refuses_anything_but_a_known_hash(env, bad):
    r = env.client.get(f"/images/{bad}")
    assert r.status_code == 404
    assert b"root:" not in r.content and b"SQLite" not in r.content


def raw_get(app, path: str, owner: str) -> tuple[int, bytes]:
    """GET ``path`` exactly as written (``..`` and all: HTTP clients normalise dot segments away, a
    hostile client need not), straight into the ASGI app, with ``owner``'s cookie. Returns (status,
    body)."""
    headers = [(b"host", b"testserver"), (b"cookie", f"prism_owner={owner}".encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("testserver", 80)}
    sent: list[dict] = []

    async def call():
        finished, asked = asyncio.Event(), []

        async def receive():
            if not asked:
                asked.append(True)
                return {"type": "http.request", "body": b"", "more_body": False}
            await finished.wait()  # then the client goes away
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                finished.set()

        await app(scope, receive, send)

    asyncio.run(call())
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_image_route_refuses_paths_of_stored_files(env):
    sha = env.session.image_shas[0]
    assert env.client.get(f"/images/{sha[:2]}/{sha}").status_code == 404
    assert env.client.get(f"/images/{sha}/%2e%2e/{sha}").status_code == 404  # sent as is
    for path in (f"/images/{sha}/../{sha}", f"/images/../images/{sha}", f"/images/{sha[:2]}/../{sha}",
                 "/images/../prism.db", f"/images/{sha}/.."):
        status, body = raw_get(env.client.app, path, env.owner)  # the image's owner asks
        assert status == 404, path
        assert not body.startswith(b"\x89PNG") and b"SQLite" not in body, path
    assert raw_get(env.client.app, f"/images/{sha}", env.owner)[0] == 200  # the helper does reach the route


# ---------------------------------------------------------------------------------- shares
def share_link(env, mode):
    token, share = env.store.create_share(env.session.id, env.owner, mode)
    return token, share


def test_read_only_share_shows_the_conversation_and_nothing_else(env):
    token, _ = share_link(env, "read")
    viewer = TestClient(env.client.app)
    r = viewer.get(f"/s/{token}")
    assert r.status_code == 200
    html = r.text
    assert "Astronaut &amp; coffee" in html
    assert "What is in the first image?" in html
    assert "What about &lt;b&gt;the second&lt;/b&gt;?" in html and "<b>the second</b>" not in html  # escaped
    for turn in env.chat.turns(env.session.id):
        assert turn.line in html.replace("&#x27;", "'")
    # the chips: the second question a hit; the first a miss, or a hit too when the upload's warm
    # (issue 34) got there first
    assert html.count('class="prism-tel ') == 2 and "prefix HIT" in html
    assert html.count("/images/") == 2
    # no way to post, and nothing private
    assert "<textarea" not in html and "<form" not in html and "<input" not in html
    assert env.owner not in html and "My other secret chat" not in html
    assert str(env.data) not in html and "prism.db" not in html and env.session.cache_salt not in html
    assert viewer.cookies.get("prism_owner") != env.owner
    assert r.headers["cache-control"] == "no-store" and r.headers["referrer-policy"] == "same-origin"


def test_continue_share_forks_into_the_visitors_own_session(env):
    token, _ = share_link(env, "continue")
    visitor = TestClient(env.client.app)
    page = visitor.get(f"/s/{token}")
    assert page.status_code == 200 and f'action="/s/{token}/fork"' in page.text
    r = visitor.post(f"/s/{token}/fork", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/?session=")
    new_id = r.headers["location"].split("=", 1)[1]
    visitor_owner = visitor.cookies.get("prism_owner")
    fork = env.store.get_session(new_id, owner=visitor_owner)
    assert fork is not None and fork.id != env.session.id
    assert fork.image_shas == env.session.image_shas and fork.cache_salt == env.session.cache_salt
    # marked as a copy in its title (it used to carry the original's title unchanged, so a visitor
    # who also owned the original could not tell them apart in the sidebar)
    original = env.store.get_session(env.session.id).title
    assert fork.title == f"Copy of {original}" and not original.startswith("Copy of")
    assert env.store.get_session(new_id, owner=env.owner) is None
    # the visitor's first question hits the warm prefix of the original
    final = list(env.chat.ask(fork.id, visitor_owner, "Another question?", ChatOptions(max_tokens=4)))[-1]
    assert final.prefix == "hit"
    # the original is unchanged
    assert len(env.chat.turns(env.session.id)) == 2


def test_read_only_share_cannot_be_forked(env):
    token, _ = share_link(env, "read")
    r = TestClient(env.client.app).post(f"/s/{token}/fork", follow_redirects=False)
    assert r.status_code == 404


def test_revoked_and_unknown_tokens_reveal_nothing(env):
    token, share = share_link(env, "read")
    assert env.client.get(f"/s/{token}").status_code == 200
    env.store.revoke_share(share.id, env.owner)
    revoked = env.client.get(f"/s/{token}")
    unknown = env.client.get("/s/" + "x" * 32)
    assert revoked.status_code == unknown.status_code == 404
    assert revoked.text == unknown.text
    assert "Astronaut" not in revoked.text and "/images/" not in revoked.text
    assert env.client.post(f"/s/{token}/fork", follow_redirects=False).status_code == 404
    bare = env.client.get("/s/")  # no token at all
    assert bare.status_code == 404 and "Astronaut" not in bare.text and "/images/" not in bare.text


def test_shared_images_are_served_by_hash_under_the_share_token(env):
    """The share page names its images by hash under its own token (the visitor has no cookie
    that owns them), and those URLs serve them while the share is live."""
    token, _ = share_link(env, "read")
    visitor = TestClient(env.client.app)
    html = visitor.get(f"/s/{token}").text
    for sha in env.session.image_shas:
        assert f'src="/s/{token}/images/{sha}"' in html and f'src="/images/{sha}"' not in html
        assert visitor.get(f"/s/{token}/images/{sha}").status_code == 200


# ---------------------------------------------------------------------------------- --ui off
_HEADLESS_SCRIPT = r'''
import json, sys
from pathlib import Path

from app.settings import parse_settings

data, model = Path(sys.argv[1]), sys.argv[2]
settings = parse_settings(["--data-dir", str(data), "--model", model, "--device", "cpu"], {"PRISM_UI": "off"})
from fastapi.testclient import TestClient

from app.model_loader import ModelLoader
from app.server import create_app
from sessions import SessionStore

store = SessionStore(data)
loader = ModelLoader(settings)
loader.start()
assert loader.wait(300), loader.status()
app = create_app(settings, store, loader)
out = {"ui": settings.ui, "gradio_after_create": "gradio" in sys.modules}
sha = "0" * 64
with TestClient(app) as client:
    out["pages"] = {path: client.get(path).status_code for path in
                    ("/", "/gradio_api/info", "/s/abc", "/s/abc/prefix", f"/images/{sha}", f"/s/abc/images/{sha}",
                     "/sessions/abc/prefix", "/prism-static/prism.css", "/config")}
    out["fork"] = client.post("/s/abc/fork").status_code
    out["healthz"] = client.get("/healthz").status_code
    out["metrics"] = client.get("/metrics").status_code
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body)
    out["completion"] = [r.status_code, r.json()["usage"]["completion_tokens"] if r.status_code == 200 else r.text]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        out["stream_last"] = [line for line in s.iter_lines() if line][-1]
    out["cookies"] = list(client.cookies.keys())
out["gradio_at_end"] = "gradio" in sys.modules
loader.close()
store.close()
print("RESULT " + json.dumps(out))
'''


def test_ui_off_serves_only_the_api_metrics_and_health_without_importing_gradio(tmp_path, demo_ckpt):
    """``--ui off`` (here through ``PRISM_UI``): in a fresh interpreter, the app built by the real
    loader on the demo model answers /v1 (whole and streamed), /metrics and /healthz; every page
    route of the web UI is a 404, no owner cookie is handed out, and ``gradio`` is never imported
    (the H200 image has no Gradio)."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", _HEADLESS_SCRIPT, str(tmp_path / "data"), str(demo_ckpt)],
                          capture_output=True, text=True, timeout=600, cwd=root, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["ui"] == "off"
    assert out["gradio_after_create"] is False and out["gradio_at_end"] is False
    assert set(out["pages"].values()) == {404}, out["pages"]
    assert out["fork"] == 404
    assert out["healthz"] == 200 and out["metrics"] == 200
    assert out["completion"][0] == 200 and out["completion"][1] >= 1, out["completion"]
    assert out["stream_last"] == "data: [DONE]"
    assert out["cookies"] == []


def test_ui_is_on_unless_turned_off(tmp_path):
    assert parse_settings([], {}).ui == "on"
    assert parse_settings(["--ui", "off"], {}).ui == "off"
    assert parse_settings(["--ui", "on"], {"PRISM_UI": "off"}).ui == "on"  # the command line wins
    with pytest.raises(SystemExit):
        parse_settings([], {"PRISM_UI": "headless"})
