"""Issue 16 in the app: images, API salts and the API itself stay with their owner.

* ``/images/<sha256>`` serves an image only to an owner of a session holding it; a share page's
  images come from ``/s/<token>/images/<sha256>`` while the share is live.
* API keys (``--api-key``, ``PRISM_API_KEYS``, ``--api-key-file``): without one, or with a wrong
  one, the API answers 401 in OpenAI's shape.
* Salts: an anonymous request is its own session unless it sends ``prompt_cache_key``; with keys,
  one salt per key, and per ``prompt_cache_key`` within a key.
* Browsers on other origins cannot drive the API: non-JSON bodies are 415 and cross-origin
  preflights are answered only for ``--cors-origin`` origins.
* End to end: an image a web-page user asked about is a stranger to an anonymous API client, in
  every cache.

Each test says what the other client (the attacker) sees.
"""

from __future__ import annotations

import base64
import hashlib
import io
import time
import types

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from app.chat import ChatOptions, ChatService
from app.model_loader import ModelChoice, ModelLoader
from app.server import create_app
from app.settings import Settings, parse_settings
from sessions import SessionStore

TINY = ModelChoice("tiny", "tiny-test", False, "test")


def noise_png(seed: int, size=(72, 56)) -> bytes:
    import torch

    gen = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(size[1], size[0], 3, generator=gen) * 255).to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def ask_body(png: bytes, question: str = "What is this?", **extra) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png)}},
                                                      {"type": "text", "text": question}]}],
            "max_tokens": 2, "temperature": 0, **extra}


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(kv_cache_bytes=64 << 20)


def make_app(tmp_path, engine, *, mount_ui=False, **settings):
    data = tmp_path / "data"
    config = Settings(data_dir=data, max_upload_mb=2, **settings)
    store = SessionStore(data, image_options=config.image_options())
    loader = ModelLoader.ready(engine, TINY, config)
    chat = ChatService(store, loader, max_upload_bytes=config.max_upload_bytes)
    return create_app(config, store, loader, chat, mount_ui=mount_ui), store, chat


def browser(app) -> tuple[TestClient, str]:
    """A client with its own owner cookie (as a browser gets on its first page load)."""
    client = TestClient(app)
    client.get("/healthz")
    return client, client.cookies.get("prism_owner")


# ---------------------------------------------------------------------------------- item 3
@pytest.fixture
def images_env(tmp_path, engine):
    app, store, chat = make_app(tmp_path, engine)
    alice, alice_key = browser(app)
    x, y = noise_png(1), noise_png(2)
    shared, _ = chat.add_images(None, alice_key, [("x.png", x)])
    private, _ = chat.add_images(None, alice_key, [("y.png", y)])
    yield types.SimpleNamespace(app=app, store=store, alice=alice, alice_key=alice_key, shared=shared,
                                private=private, x=hashlib.sha256(x).hexdigest(), y=hashlib.sha256(y).hexdigest(),
                                x_bytes=x)
    store.close()


def test_images_are_served_only_to_an_owner_of_a_session_holding_them(images_env):
    """Before the fix anyone who knew (or guessed from a public copy) an image's SHA-256 got it
    from /images/<sha> with no cookie, and learned that someone on this server holds it. Now
    another browser, or a client without a cookie, gets the same 404 as for an image nobody has."""
    env = images_env
    own = env.alice.get(f"/images/{env.x}")
    assert own.status_code == 200 and own.content == env.x_bytes
    assert own.headers["cross-origin-resource-policy"] == "same-origin"
    mallory, _ = browser(env.app)
    nobody = mallory.get("/images/" + "0" * 64)
    for client in (mallory, TestClient(env.app)):
        stolen = client.get(f"/images/{env.x}")
        assert stolen.status_code == 404 and stolen.content == nobody.content and env.x_bytes not in stolen.content
    env.store.delete_session(env.shared.id, env.alice_key)
    assert env.alice.get(f"/images/{env.x}").status_code == 404  # no session of hers holds it any more


def test_a_share_serves_its_own_images_while_it_is_live(images_env):
    """A share visitor has no owner cookie: the share page's image URLs carry the token. The token
    covers the shared session's images only, and a revoked share stops serving them."""
    env = images_env
    token, share = env.store.create_share(env.shared.id, env.alice_key, "read")
    visitor = TestClient(env.app)
    page = visitor.get(f"/s/{token}").text
    assert f"/s/{token}/images/{env.x}" in page
    assert visitor.get(f"/s/{token}/images/{env.x}").content == env.x_bytes
    assert visitor.get(f"/s/{token}/images/{env.y}").status_code == 404  # Alice's other session's image
    assert visitor.get(f"/s/not-{token}/images/{env.x}").status_code == 404
    assert visitor.get(f"/images/{env.x}").status_code == 404
    env.store.revoke_share(share.id, env.alice_key)
    assert visitor.get(f"/s/{token}/images/{env.x}").status_code == 404


def test_uploading_an_image_someone_else_holds_does_the_same_work(tmp_path):
    """The store keeps one file per distinct image. It used to skip writing (and syncing) the file
    when it already existed, so an upload of an image another session held returned measurably
    sooner: the uploader learned that someone here has it. Now the file is written again either
    way (seen here as a new file replacing the old one; no timing is measured)."""
    with SessionStore(tmp_path / "data") as store:
        x = noise_png(5)
        victim = store.create_session("v" * 43)
        store.add_image(victim.id, "v" * 43, x)
        blob = store.image_path(hashlib.sha256(x).hexdigest())
        first = blob.stat().st_ino
        attacker = store.create_session("a" * 43)
        store.add_image(attacker.id, "a" * 43, x)
        assert blob.stat().st_ino != first and blob.read_bytes() == x


# ---------------------------------------------------------------------------------- item 4
@pytest.fixture
def keyed(tmp_path, engine):
    app, store, _ = make_app(tmp_path, engine, api_keys=("key-one", "key-two"))
    yield TestClient(app)
    store.close()


def test_with_api_keys_a_missing_or_wrong_key_is_401(keyed):
    """Before, the API answered anyone. With keys configured, a client without one (or with a
    wrong one) gets OpenAI's 401 error and nothing else, also from /v1/models."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer key-three"}, {"Authorization": "Bearer "},
                    {"Authorization": "Basic a2V5LW9uZQ=="}, {"Authorization": "Bearer key-one-and-more"}):
        r = keyed.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 401, headers
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert "key-one" not in r.text and r.headers["www-authenticate"] == "Bearer"
        assert keyed.get("/v1/models", headers=headers).status_code == 401
    assert keyed.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer key-three"}
                      ).json()["error"]["code"] == "invalid_api_key"
    for key in ("key-one", "key-two"):
        assert keyed.post("/v1/chat/completions", json=body, headers={"Authorization": f"bearer {key}"}
                          ).status_code == 200
    assert keyed.get("/v1/models", headers={"Authorization": "Bearer key-one"}).status_code == 200


def test_with_api_keys_the_salt_is_per_key_and_per_prompt_cache_key(keyed):
    """One salt per key: a key's own requests share its cache; another key's client sees a cold
    cache (no cached tokens), also when it sends the same prompt_cache_key."""
    x = noise_png(10)
    one, two = {"Authorization": "Bearer key-one"}, {"Authorization": "Bearer key-two"}

    def prefix(body, headers):
        r = keyed.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()["prism"]["telemetry"]["prefix_cache"]

    assert prefix(ask_body(x), one) == "miss"
    assert prefix(ask_body(x, "And?"), one) == "hit"
    assert prefix(ask_body(x, "And?"), two) == "miss"
    assert prefix(ask_body(x, "Or?", prompt_cache_key="chat-1"), one) == "miss"  # its own session in the key
    assert prefix(ask_body(x, "Then?", prompt_cache_key="chat-1"), one) == "hit"
    assert prefix(ask_body(x, "Then?", prompt_cache_key="chat-1"), two) == "miss"


@pytest.fixture
def open_api(tmp_path, engine):
    app, store, _ = make_app(tmp_path, engine)
    yield TestClient(app)
    store.close()


def test_without_keys_each_request_is_its_own_session(open_api, engine):
    """Before, every anonymous client shared one salt: a stranger who sent the same image got the
    first client's prefix (a hit, cached tokens) and its processed pixels and vision features.
    Now an anonymous request reuses nothing another request left, whatever bearer token it
    sends; only requests sharing a prompt_cache_key share a cache."""
    x = noise_png(11)
    first = open_api.post("/v1/chat/completions", json=ask_body(x)).json()
    before = engine.stats()
    for headers in ({}, {"Authorization": "Bearer same"}, {"Authorization": "Bearer same"}):
        r = open_api.post("/v1/chat/completions", json=ask_body(x), headers=headers).json()
        assert r["prism"]["telemetry"]["prefix_cache"] == "miss"
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after = engine.stats()
    assert [after[k] - before[k] for k in ("cache_hits", "image_cache_hits", "vision_cache_hits")] == [0, 0, 0]
    assert first["prism"]["telemetry"]["prefix_cache"] == "miss"
    shared = [open_api.post("/v1/chat/completions", json=ask_body(x, q, prompt_cache_key="a-long-random-key")).json()
              for q in ("One?", "Two?")]
    assert [s["prism"]["telemetry"]["prefix_cache"] for s in shared] == ["miss", "hit"]


@pytest.mark.parametrize("value", [123, "", "k" * 1025, ["a"]])
def test_a_malformed_prompt_cache_key_is_400(open_api, value):
    r = open_api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                    "prompt_cache_key": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key"


def test_other_origins_cannot_drive_the_api_from_a_browser(open_api):
    """A page on another origin could post a "simple" request (a form, text/plain) without a
    preflight and have the visitor's browser run it here. Such bodies are now 415; a JSON
    request from another origin needs a preflight, which is not answered (no
    Access-Control-Allow-Origin) without --cors-origin."""
    raw = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}'
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Origin": "https://evil.example"} | ({"Content-Type": kind} if kind else {})
        r = open_api.post("/v1/chat/completions", content=raw, headers=headers)
        assert r.status_code == 415, kind
        assert r.json()["error"]["code"] == "unsupported_media_type"
    ok = open_api.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200
    preflight = open_api.options("/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert preflight.status_code != 200 and "access-control-allow-origin" not in preflight.headers


def test_cors_origins_are_allowed_only_when_configured(tmp_path, engine):
    """--cors-origin lets the named origin's pages call the API (preflight and response carry its
    origin); any other origin still gets no CORS answer."""
    app, store, _ = make_app(tmp_path, engine, cors_origins=("https://app.example",))
    client = TestClient(app)
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    good = client.options("/v1/chat/completions", headers={"Origin": "https://app.example", **ask})
    assert good.status_code == 200 and good.headers["access-control-allow-origin"] == "https://app.example"
    bad = client.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **ask})
    assert "access-control-allow-origin" not in bad.headers
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
                    headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-origin" not in client.get("/healthz", headers={"Origin": "https://app.example"}).headers
    store.close()


def test_api_keys_from_the_environment_and_a_key_file(tmp_path, capsys):
    """Keys come from --api-key (repeatable), PRISM_API_KEYS and --api-key-file; the command line
    replaces the variable; --help never prints a key."""
    keys = tmp_path / "keys.txt"
    keys.write_text("# Prism API keys\nfile-key-1\n\n  file-key-2  \n")
    env = {"PRISM_API_KEYS": "env-key-1, env-key-2", "PRISM_CORS_ORIGINS": "https://a.example http://b.example:8080"}
    s = parse_settings([], env)
    assert s.api_keys == ("env-key-1", "env-key-2")
    assert s.cors_origins == ("https://a.example", "http://b.example:8080")
    assert parse_settings(["--api-key", "cli-key", "--api-key", "cli-2"], env).api_keys == ("cli-key", "cli-2")
    assert parse_settings(["--api-key-file", str(keys)], env).api_keys == ("env-key-1", "env-key-2", "file-key-1",
                                                                           "file-key-2")
    assert "env-key" not in repr(s)
    with pytest.raises(SystemExit):
        parse_settings(["--help"], env)
    out = capsys.readouterr().out
    assert "--api-key" in out and "--cors-origin" in out and "2 set" in out and "env-key" not in out
    for argv, environ in ((["--api-key-file", str(tmp_path / "missing")], {}), (["--api-key", "has space"], {}),
                          ([], {"PRISM_API_KEYS": "bad\x01key"}), (["--cors-origin", "https://a.example/path"], {})):
        with pytest.raises(SystemExit):
            parse_settings(argv, environ)
        assert "bad\x01key" not in capsys.readouterr().err


# ---------------------------------------------------------------------------------- item 5
def test_the_api_without_max_tokens_generates_up_to_the_room_left(tmp_path, tiny_engine_factory):
    """Before, a request without max_tokens whose prompt left less than 512 tokens of room was a
    400 ("max_tokens (512) ... exceeds") though the client never asked for 512. Now it gets up
    to the room left; an explicit max_tokens that does not fit is still a clear 400."""
    small = tiny_engine_factory(max_model_len=96)
    app, store, _ = make_app(tmp_path, small)
    client = TestClient(app)
    messages = [{"role": "user", "content": "Hi"}]
    room = 96 - small.count_prompt_tokens(messages)
    r = client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0})
    assert r.status_code == 200, r.text
    assert 0 < r.json()["usage"]["completion_tokens"] <= room
    too_many = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": room + 1})
    assert too_many.status_code == 400 and f"at most {room} tokens" in too_many.json()["error"]["message"]
    store.close()


# ---------------------------------------------------------------------------------- end to end
def test_an_image_a_page_user_asked_about_is_a_stranger_to_an_anonymous_api_client(tmp_path, tiny_engine_factory):
    """The issue's end-to-end check. A web-page user (the real app with its Gradio page, driven
    through the page's handlers with the browser's owner cookie) uploads X and asks about it
    twice; the second answer hits its own caches. Then an anonymous API client sends X: it gets no
    cached tokens, its vision encoder runs, and no cache of the engine (processed pixels, vision
    features, prefix) counts a hit, so neither its answer nor its timing can tell that X was
    here. Before the fix the processed-pixel cache answered it (preprocess ~2 ms instead of a fresh
    image's)."""
    engine = tiny_engine_factory(kv_cache_bytes=64 << 20)
    app, store, _ = make_app(tmp_path, engine, mount_ui=True)
    client, owner = browser(app)
    ui, request = app.state.ui, types.SimpleNamespace(cookies={"prism_owner": owner}, query_params={})
    x = noise_png(42, (96, 80))
    upload = tmp_path / "x.png"
    upload.write_bytes(x)
    session_id, sessions_html, _, images_html, *_ = ui.add_images(None, [str(upload)], request)
    # the page's image URLs still work: same-origin requests carry the (HttpOnly) owner cookie
    sha = hashlib.sha256(x).hexdigest()
    assert f'src="/images/{sha}"' in images_html and f'src="/images/{sha}"' in sessions_html
    assert client.get(f"/images/{sha}").content == x
    opts = ChatOptions(max_tokens=2)
    # the upload warmed X's prefix under the session's salt (issue 34): once it is cached, the
    # first question is a hit too
    deadline = time.monotonic() + 60
    while app.state.chat.warmer.handle(session_id) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    app.state.chat.warmer.handle(session_id).result(60)
    first = list(ui.answer(session_id, "What is in the picture?", opts.temperature, opts.max_tokens, False, request))
    before_own = engine.stats()
    second = list(ui.answer(session_id, "And the colours?", opts.temperature, opts.max_tokens, False, request))
    assert "prefix HIT (warmed at upload)" in first[-1][1][-1]["content"]
    assert "prefix HIT · " in second[-1][1][-1]["content"]
    before = engine.stats()
    assert before["image_cache_hits"] == before_own["image_cache_hits"] + 1  # the page user's own hit counts
    assert before["cache_hits"] == before_own["cache_hits"] + 1
    r = client.post("/v1/chat/completions", json=ask_body(x, "What is in the picture?"))
    assert r.status_code == 200, r.text
    out = r.json()
    after = engine.stats()
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    tel = out["prism"]["telemetry"]
    assert tel["prefix_cache"] == "miss" and tel["vision_encoder_ran"] and tel["cached_tokens"] == 0
    for counter in ("image_cache_hits", "vision_cache_hits", "cache_hits", "image_cache_mismatches"):
        assert after[counter] == before[counter], f"{counter}: the API client hit the page user's cache"
    store.close()
