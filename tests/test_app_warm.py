"""Prefixes warmed before their first question (issue 34), the app's side: the chat warms a
session's prefix on every change to its images (with exactly its questions' images and salt),
a newer change, a deletion or a revoked share cancels it, the most recently used chats are warmed
after a start within a share of the KV pool, the chip and the TTFT chart say when a question
attached a warmed prefix, and ``POST /v1/prefix_cache/warm``.

The bookkeeping is tested against a fake engine client (its warms are handles the test finishes
or watches being cancelled); what the engine does with a warm, on the tiny checkpoint."""

from __future__ import annotations

import base64
import threading
import time
import types

import pytest
from fastapi.testclient import TestClient

from app.chat import ChatOptions, ChatService, telemetry_line
from app.model_loader import ModelChoice, ModelLoader
from app.render import ttft_chart
from app.server import create_app
from app.settings import Settings, parse_settings
from app.warming import PrefixWarmer
from engine import PrismError, media_first_messages
from engine.client import EngineClient
from sessions import SessionStore

OWNER = "w" * 43
VISITOR = "v" * 43
FAST = ChatOptions(temperature=0.0, max_tokens=4)


# ---------------------------------------------------------------------------------- a fake engine
class FakeWarm:
    """A warm handle as the engine's contract has it: ``result(timeout)``, ``cancel(wait)``,
    ``done``; finished by the test (or at once with ``tokens`` given to :class:`FakeEngine`)."""

    def __init__(self, images, system, salt, tokens=None):
        self.images, self.system, self.salt = images, system, salt
        self.tokens, self.cancelled = tokens, False
        self._event = threading.Event()
        if tokens is not None:
            self._event.set()

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def finish(self, tokens: int) -> None:
        self.tokens = tokens
        self._event.set()

    def result(self, timeout=None) -> int:
        if not self._event.wait(timeout):
            raise TimeoutError("not cached yet")
        if self.cancelled:
            raise PrismError("warm cancelled")
        return self.tokens

    def cancel(self, wait: bool = True) -> None:
        if not self.done:
            self.cancelled = True
            self._event.set()


class FakeEngine(EngineClient):
    """An engine client whose warms the test controls; records every warm. ``tokens``: each
    warm is cached at once with this many tokens (None: the test finishes it); ``refuse``: an
    exception ``warm`` raises. Questions are not its business."""

    model_id, device, dtype, min_image_pixels = "fake", "cpu", "float32", 0
    options = types.SimpleNamespace(kv_cache_dtype="auto")

    def __init__(self, tokens=None, refuse: Exception | None = None, pages_total=100, page_size=16):
        self.warms: list[FakeWarm] = []
        self.tokens, self.refuse = tokens, refuse
        self.pages_total, self.page_size = pages_total, page_size
        self.prompt_tokens: dict[str, int] = {}  # salt -> what count_prompt_tokens says
        self.forgotten: list[str] = []

    def warm(self, images, *, system=None, cache_salt=None):
        if self.refuse is not None:
            raise self.refuse
        warm = FakeWarm(images, system, cache_salt, self.tokens)
        self.warms.append(warm)
        return warm

    def stats(self) -> dict:
        return {"pages_total": self.pages_total, "page_size": self.page_size, "pages_used": 0,
                "pages_free": self.pages_total, "running": 0, "waiting": 0, "prefix_cache": False}

    def count_prompt_tokens(self, messages, *, cache_salt=None) -> int:
        return self.prompt_tokens.get(cache_salt, 40)

    def forget(self, cache_salt):
        self.forgotten.append(cache_salt)

    def submit(self, messages, sampling=None, *, cache_salt=None):
        raise PrismError("the fake engine answers no questions")

    def cancel(self, handle, wait=True):
        handle.cancel(wait)

    def prefix_info(self, cache_salt, images=None, *, preview=False):
        return None

    def clear_prefix_cache(self):
        pass

    def close(self):
        pass


@pytest.fixture
def store(tmp_path):
    with SessionStore(tmp_path / "data", max_images_per_session=4) as s:
        yield s


@pytest.fixture
def fake():
    return FakeEngine()


@pytest.fixture
def chat(store, fake):
    return ChatService(store, types.SimpleNamespace(engine=fake, state="ready"))


@pytest.fixture(scope="module")
def photos(media_path):
    return [media_path("astronaut.png"), media_path("coffee.png"), media_path("chelsea.png")]


def started(chat: ChatService, session_id: str, timeout: float = 10.0):
    """The session's warm handle once a worker has started it (waits for the worker)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        handle = chat.warmer.handle(session_id)
        if handle is not None:
            return handle
        time.sleep(0.005)
    raise AssertionError(f"no warm started for {session_id}")


def settle(fake: FakeEngine, n: int, timeout: float = 10.0) -> None:
    """Wait until ``fake`` has received ``n`` warms."""
    deadline = time.monotonic() + timeout
    while len(fake.warms) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(fake.warms) >= n, f"{len(fake.warms)} warms, expected {n}"


# ---------------------------------------------------------------------------------- the chat's warms
def test_an_upload_warms_exactly_the_prefix_its_questions_use(chat, fake, photos):
    session, problems = chat.add_images(None, OWNER, [("a.png", photos[0]), ("b.png", photos[1])])
    assert not problems
    warm = started(chat, session.id)
    assert warm.salt == session.cache_salt and warm.system is None
    # the very list a question hands media_first_messages: same files, same order, same digests
    assert warm.images == chat.prompt_images(session)
    assert [p["sha256"] for p in warm.images] == session.image_shas
    assert all(str(p["image"]) == str(chat.store.image_path(p["sha256"])) for p in warm.images)
    assert chat.warmer.source(session.id) == "upload"


def test_a_newer_change_cancels_the_older_warm(chat, fake, photos):
    session, _ = chat.add_images(None, OWNER, [("a.png", photos[0])])
    first = started(chat, session.id)
    session, _ = chat.add_images(session.id, OWNER, [("b.png", photos[1])])
    settle(fake, 2)
    second = started(chat, session.id)
    assert first.cancelled and not second.cancelled and second is fake.warms[-1]
    assert [p["sha256"] for p in second.images] == session.image_shas and len(session.image_shas) == 2
    # removing an image warms the smaller set and cancels the bigger one's warm
    session = chat.remove_image(session.id, OWNER, session.image_shas[0])
    settle(fake, 3)
    assert second.cancelled and [p["sha256"] for p in fake.warms[-1].images] == session.image_shas
    # removing the last one leaves nothing to warm: the warm is cancelled, none started
    third = fake.warms[-1]
    chat.remove_image(session.id, OWNER, session.image_shas[0])
    assert third.cancelled and chat.warmer.handle(session.id) is None and len(fake.warms) == 3


def test_a_finished_warm_is_not_cancelled_by_a_later_change(chat, fake, photos):
    """Cancelling a warm that has cached its prefix frees nothing (the prefix is an ordinary
    cache entry then): the fake's cancel of a done handle is a no-op, and the next warm starts."""
    session, _ = chat.add_images(None, OWNER, [("a.png", photos[0])])
    first = started(chat, session.id)
    first.finish(261)
    chat.add_images(session.id, OWNER, [("b.png", photos[1])])
    settle(fake, 2)
    assert not first.cancelled and first.result() == 261


def test_deleting_the_chat_cancels_its_warm(chat, fake, photos):
    session, _ = chat.add_images(None, OWNER, [("a.png", photos[0])])
    warm = started(chat, session.id)
    chat.delete(session.id, OWNER)
    assert warm.cancelled and chat.warmer.handle(session.id) is None
    assert fake.forgotten == [session.cache_salt]


def test_a_continued_copy_is_warmed_and_revoking_the_share_cancels_every_warm_of_the_salt(chat, fake, photos):
    session, _ = chat.add_images(None, OWNER, [("a.png", photos[0]), ("b.png", photos[1])])
    own = started(chat, session.id)
    token, share = chat.store.create_share(session.id, OWNER, "continue")
    copy = chat.fork(chat.store.resolve_share(token), VISITOR)
    theirs = started(chat, copy.id)  # "opening a shared copy" changes the copy's image set: warmed
    assert theirs.salt == session.cache_salt == copy.cache_salt and theirs.images == chat.prompt_images(copy)
    chat.revoke_share(session.id, OWNER, share.id).join(10)
    assert own.cancelled and theirs.cancelled
    assert chat.warmer.handle(session.id) is None and chat.warmer.handle(copy.id) is None


def test_refused_images_start_no_warm_and_a_refused_warm_is_no_upload_failure(store, photos, caplog):
    fake = FakeEngine(refuse=PrismError("the engine's waiting queue is full; retry later"))
    chat = ChatService(store, types.SimpleNamespace(engine=fake, state="ready"))
    session, problems = chat.add_images(None, OWNER, [("bad.png", b"not an image at all")])
    assert session is None and problems and not fake.warms  # refused at upload: nothing to warm
    with caplog.at_level("INFO", logger="app.warming"):
        session, problems = chat.add_images(None, OWNER, [("a.png", photos[0])])
        future = chat.warm_session(session)
        assert future.result(10) is None
    assert not problems and session is not None and len(session.image_shas) == 1
    assert "queue is full" in caplog.text and chat.warmer.handle(session.id) is None


def test_warming_off_starts_nothing(store, fake, photos):
    chat = ChatService(store, types.SimpleNamespace(engine=fake, state="ready"), warming=False)
    session, _ = chat.add_images(None, OWNER, [("a.png", photos[0])])
    assert chat.warm_session(session) is None and chat.warm_recent(1.0) == []
    time.sleep(0.05)
    assert not fake.warms
    assert parse_settings(["--warm", "off", "--warm-share", "0"], {}).warm == "off"
    with pytest.raises(SystemExit):
        parse_settings(["--warm-share", "1.5"], {})
    budget = parse_settings(["--warm-time-share", "0.05"], {})
    assert budget.engine_options()["warm_time_share"] == 0.05
    assert "warm_time_share" not in parse_settings([], {}).engine_options()  # the engine's default
    assert parse_settings([], {"PRISM_WARM_TIME_SHARE": "1"}).warm_time_share == 1.0
    for bad in ("0", "1.5"):
        with pytest.raises(SystemExit):
            parse_settings(["--warm-time-share", bad], {})


def test_a_warm_superseded_while_the_engine_preprocesses_is_cancelled(store, photos):
    """The engine's warm call is slow (it reads and preprocesses the images): a change that
    comes meanwhile cancels the handle it returns, the newer warm is the one kept."""
    gate, entered = threading.Event(), threading.Event()

    class Slow(FakeEngine):
        def warm(self, images, *, system=None, cache_salt=None):
            if not self.warms:
                entered.set()
                gate.wait(10)
            return super().warm(images, system=system, cache_salt=cache_salt)

    fake = Slow()
    chat = ChatService(store, types.SimpleNamespace(engine=fake, state="ready"))
    session, _ = chat.add_images(None, OWNER, [("a.png", photos[0])])
    assert entered.wait(10)
    session, _ = chat.add_images(session.id, OWNER, [("b.png", photos[1])])
    gate.set()
    settle(fake, 2)
    older = next(w for w in fake.warms if len(w.images) == 1)  # not warms[0]: the newer call may come first
    deadline = time.monotonic() + 10
    while not older.cancelled and time.monotonic() < deadline:
        time.sleep(0.005)
    newer = next(w for w in fake.warms if len(w.images) == 2)
    assert older.cancelled and not newer.cancelled and chat.warmer.handle(session.id) is newer


# ---------------------------------------------------------------------------------- after a start
def _sessions(store, photos, n):
    """``n`` sessions of one photo each, the last one created the most recently used."""
    sessions = []
    for i in range(n):
        session = store.create_session(OWNER, f"chat {i}")
        store.add_image(session.id, OWNER, photos[i % len(photos)].read_bytes())
        sessions.append(store.get_session(session.id))
        time.sleep(0.002)  # distinct updated_at
    return sessions


def test_restart_warms_the_most_recent_chats_within_the_share(store, photos):
    """100 pages of 16 tokens, a share of 0.2: 20 pages. Each chat's prompt counts 100 tokens
    (an estimate of 7 pages), its warmed prefix 90 (6 pages, what is then counted): the newest
    fits (6), the second newest (30 pages) is skipped, the third and fourth fit (12, 18), the
    fifth would not (18 + 7 > 20), nor the sixth."""
    fake = FakeEngine(tokens=90)
    source = types.SimpleNamespace(engine=fake, state="ready")
    chat = ChatService(store, source)
    sessions = _sessions(store, photos, 6)
    fake.prompt_tokens = {s.cache_salt: 100 for s in sessions}
    fake.prompt_tokens[sessions[-2].cache_salt] = 30 * 16  # the second newest does not fit at all
    empty = store.create_session(OWNER, "no images")  # the newest, but nothing to warm
    newest_first = [s.id for s in reversed(sessions)]
    assert chat.warm_recent(0.2) == [newest_first[0], newest_first[2], newest_first[3]]
    assert empty.id not in newest_first and all(chat.warmer.source(s) == "restart" for s in newest_first[:4:2])
    assert [w.salt for w in fake.warms] == [store.get_session(i).cache_salt for i in newest_first[:4] if i !=
                                            newest_first[1]]
    # the same engine again: those are warm (left to their warms, not counted), the two older ones fit
    assert chat.warm_recent(0.2) == [newest_first[4], newest_first[5]]
    # a restarted engine core starts empty: its warms do not count the old core's
    source.engine = restarted = FakeEngine(tokens=90)
    restarted.prompt_tokens = fake.prompt_tokens
    assert chat.warm_recent(0.2) == [newest_first[0], newest_first[2], newest_first[3]]
    assert chat.warm_recent(0.0) == []


def test_restart_warming_skips_a_chat_changed_since_the_start_and_a_cancelled_warm(store, photos):
    fake = FakeEngine()  # warms never finish by themselves
    chat = ChatService(store, types.SimpleNamespace(engine=fake, state="ready"))
    sessions = _sessions(store, photos, 2)
    chat.warm_session(sessions[-1])  # uploaded to after the start: its own warm
    started(chat, sessions[-1].id)
    results = {}
    worker = threading.Thread(target=lambda: results.setdefault("ids", chat.warm_recent(1.0, timeout_s=10)))
    worker.start()
    restart = started(chat, sessions[0].id)
    chat.delete(sessions[0].id, OWNER)  # cancelled under the restart's wait
    worker.join(10)
    assert restart.cancelled and results["ids"] == []
    assert len(fake.warms) == 2  # the changed chat was not warmed again


def test_the_server_warms_recent_chats_when_its_engine_is_ready(tmp_path, photos):
    store = SessionStore(tmp_path / "data")
    sessions = _sessions(store, photos, 2)
    fake = FakeEngine(tokens=50)
    loader = ModelLoader(Settings(data_dir=tmp_path / "data"))
    app = create_app(Settings(data_dir=tmp_path / "data", warm_share=0.5), store, loader, mount_ui=False)
    with TestClient(app):
        assert not fake.warms  # loading: nothing yet
        loader._ready(fake)  # what the loader does once the model is loaded (and after a core restart)
        settle(fake, 2)
    assert {w.salt for w in fake.warms} == {s.cache_salt for s in sessions}
    store.close()


# ---------------------------------------------------------------------------------- chip and chart
def test_the_chip_of_a_warmed_question():
    tel = {"prefix_cache": "hit", "warmed": True, "ttft_ms": 12.2, "cached_tokens": 261, "computed_tokens": 9}
    assert telemetry_line(tel).startswith("prefix HIT (warmed at upload) · TTFT 12 ms · reused 261 tok")
    assert telemetry_line({**tel, "warmed_by": "restart"}).startswith("prefix HIT (warmed at start) · TTFT 12 ms")
    host = {**tel, "prefix_tier": "host", "restored_pages": 17, "restore_ms": 0.84}
    assert telemetry_line(host).startswith("prefix HIT (warmed at upload; host · restored 17 pages in 0.8 ms) · "
                                           "TTFT 12 ms")
    # the second question about the same prefix is a plain hit (the engine says warmed only once)
    assert telemetry_line({**tel, "warmed": False}).startswith("prefix HIT · TTFT 12 ms")


def test_the_ttft_chart_marks_warmed_questions():
    rows = [{"turn": 1, "ttft_ms": 12.0, "prefix": "hit", "warmed": True},
            {"turn": 2, "ttft_ms": 11.0, "prefix": "hit", "warmed": False},
            {"turn": 3, "ttft_ms": 900.0, "prefix": "miss"}]
    html = ttft_chart(rows)
    assert html.count('class="prism-chart-warmed"') == 1
    assert "Q1: HIT (warmed) · TTFT 12 ms" in html and "Q2: HIT · TTFT 11 ms" in html and "warmed" in html.split(
        'class="prism-legend"')[1]
    assert "prism-chart-warmed" not in ttft_chart(rows[1:]) and "warmed" not in ttft_chart(rows[1:])


# ---------------------------------------------------------------------------------- the API's warm
def data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def media_first_openai(urls, question: str | None = None, system: str | None = None) -> list[dict]:
    """A chat request's messages in the media-first layout (:func:`engine.media_first_messages`),
    in OpenAI's shape; ``question`` None: nothing after the last image."""
    messages = media_first_messages(list(range(len(urls))), question or "", system=system)
    content = []
    for part in messages[-1]["content"]:
        if part["type"] == "image":
            content.append({"type": "image_url", "image_url": {"url": urls[part["image"]]}})
        elif question is not None or not part["text"].startswith("Question: "):
            content.append({"type": "text", "text": part["text"]})
    return messages[:-1] + [{"role": "user", "content": content}]


@pytest.fixture
def fake_api(tmp_path):
    """An app over a fake engine whose warms are cached at once (261 tokens), with an API key."""
    store = SessionStore(tmp_path / "data")
    fake = FakeEngine(tokens=261)
    loader = ModelLoader.ready(fake, ModelChoice("tiny", "tiny-test", False, "test"))
    app = create_app(Settings(data_dir=tmp_path / "data", max_upload_mb=1, max_images=2, api_keys=("k1",)), store,
                     loader, mount_ui=False)
    with TestClient(app) as client:
        yield client, fake, app
    store.close()


AUTH = {"Authorization": "Bearer k1"}


def test_api_warm_requires_a_key_and_prompt_cache_key(fake_api, photos):
    client, fake, _ = fake_api
    body = {"messages": media_first_openai([data_url(photos[0])])}
    assert client.post("/v1/prefix_cache/warm", json={**body, "prompt_cache_key": "k"}).status_code == 401
    r = client.post("/v1/prefix_cache/warm", json=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key"
    assert "prompt_cache_key is required" in r.json()["error"]["message"]
    assert "own cache session" in r.json()["error"]["message"]
    assert not fake.warms


def test_api_warm_uses_the_chat_requests_salt_and_layout(fake_api, photos):
    client, fake, app = fake_api
    urls = [data_url(photos[0]), data_url(photos[1])]
    r = client.post("/v1/prefix_cache/warm", headers=AUTH,
                    json={"prompt_cache_key": "chat-1", "messages": media_first_openai(urls, system="Be brief.")})
    assert r.status_code == 200, r.text
    assert r.json() == {"object": "prefix_cache.warm", "status": "cached", "prefix_tokens": 261}
    warm = fake.warms[-1]
    api = app.state.openai
    # the salt a chat request with this key and API key gets, the images in order as bytes
    assert warm.salt == api.salt_for(api.authorize(types.SimpleNamespace(headers={"authorization": "Bearer k1"})),
                                     "chat-1")
    assert warm.images == [photos[0].read_bytes(), photos[1].read_bytes()] and warm.system == "Be brief."
    # the same messages with a question after the images: the same warm
    r = client.post("/v1/prefix_cache/warm", headers=AUTH,
                    json={"prompt_cache_key": "chat-1", "messages": media_first_openai(urls, "What is it?")})
    assert r.status_code == 200 and fake.warms[-1].images == warm.images and fake.warms[-1].system is None


def test_api_warm_without_waiting(tmp_path, photos):
    store = SessionStore(tmp_path / "data")
    fake = FakeEngine()  # never finishes by itself
    loader = ModelLoader.ready(fake, ModelChoice("tiny", "tiny-test", False, "test"))
    app = create_app(Settings(data_dir=tmp_path / "data"), store, loader, mount_ui=False)
    with TestClient(app) as client:
        body = {"prompt_cache_key": "k", "messages": media_first_openai([data_url(photos[0])]), "wait": False}
        r = client.post("/v1/prefix_cache/warm", json=body)
        assert r.status_code == 202 and r.json() == {"object": "prefix_cache.warm", "status": "warming",
                                                     "prefix_tokens": None}
        assert not fake.warms[-1].cancelled
        assert client.post("/v1/prefix_cache/warm", json={**body, "wait": "no"}).status_code == 400
        assert app.state.openai.cancel_all() == 0 and fake.warms[-1].cancelled  # shutdown cancels it
    store.close()


@pytest.mark.parametrize("content, message", [
    ([{"type": "text", "text": "Question: what?"}], "holds no image"),
    ([{"type": "image_url", "image_url": {"url": "IMAGE"}}], "must be exactly 'Image 1: '"),
    ([{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": "IMAGE"}}],
     "must be exactly 'Image 1: ', got 'Look: '"),
    ([{"type": "text", "text": "Image 1: "}, {"type": "image_url", "image_url": {"url": "IMAGE"}},
      {"type": "text", "text": "Image 2: "}, {"type": "image_url", "image_url": {"url": "IMAGE"}}],
     "image 2 must be exactly '\\nImage 2: '"),
    ([{"type": "text", "text": "Image 1: "}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}],
     "does not fetch remote URLs"),
    ([{"type": "text", "text": "Image 1: "}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%"}}],
     "not valid base64"),
])
def test_api_warm_bad_input_is_a_400_with_a_message(fake_api, photos, content, message):
    client, fake, _ = fake_api
    url = data_url(photos[0])
    content = [{**p, "image_url": {"url": url}} if p.get("image_url", {}).get("url") == "IMAGE" else p for p in content]
    r = client.post("/v1/prefix_cache/warm", headers=AUTH,
                    json={"prompt_cache_key": "k", "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert not fake.warms


def test_api_warm_obeys_the_media_limits(fake_api, photos, tmp_path):
    client, fake, _ = fake_api
    urls = [data_url(p) for p in photos]  # 3 images; the server takes 2 per request
    r = client.post("/v1/prefix_cache/warm", headers=AUTH,
                    json={"prompt_cache_key": "k", "messages": media_first_openai(urls)})
    assert r.status_code == 400 and "at most 2 per request" in r.json()["error"]["message"]
    big = "data:image/png;base64," + base64.b64encode(b"\x89PNG" + b"\0" * (2 << 20)).decode()
    r = client.post("/v1/prefix_cache/warm", headers=AUTH,
                    json={"prompt_cache_key": "k", "messages": media_first_openai([big])})
    assert r.status_code in (400, 413) and "limit" in r.text
    # images outside the first user message
    later = media_first_openai([urls[0]], "What?") + [
        {"role": "assistant", "content": "A photo."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": urls[1]}}]}]
    r = client.post("/v1/prefix_cache/warm", headers=AUTH, json={"prompt_cache_key": "k", "messages": later})
    assert r.status_code == 400 and "first user message" in r.json()["error"]["message"]
    r = client.post("/v1/prefix_cache/warm", headers={**AUTH, "Content-Type": "text/plain"}, content=b"{}")
    assert r.status_code == 415
    assert not fake.warms


def test_api_warm_refusals_of_the_engine(tmp_path, photos):
    from engine import EngineOverloadedError, RequestTooLargeError

    store = SessionStore(tmp_path / "data")
    body = {"prompt_cache_key": "k", "messages": media_first_openai([data_url(photos[0])])}
    for refusal, status in ((EngineOverloadedError("the engine is busy"), 429),
                            (RequestTooLargeError("the prefix is longer than the context"), 400)):
        fake = FakeEngine(refuse=refusal)
        loader = ModelLoader.ready(fake, ModelChoice("tiny", "tiny-test", False, "test"))
        with TestClient(create_app(Settings(data_dir=tmp_path / "data"), store, loader, mount_ui=False)) as client:
            r = client.post("/v1/prefix_cache/warm", json=body)
            assert r.status_code == status and str(refusal) in r.json()["error"]["message"]
    loading = ModelLoader(Settings(data_dir=tmp_path / "data"))
    with TestClient(create_app(Settings(data_dir=tmp_path / "data"), store, loading, mount_ui=False)) as client:
        assert client.post("/v1/prefix_cache/warm", json=body).status_code == 503
    store.close()


def test_api_and_upload_warms_are_counted_in_metrics(fake_api, photos):
    from prometheus_client.parser import text_string_to_metric_families

    client, fake, app = fake_api
    body = {"prompt_cache_key": "k", "messages": media_first_openai([data_url(photos[0])])}
    assert client.post("/v1/prefix_cache/warm", headers=AUTH, json=body).status_code == 200
    chat = app.state.chat
    session, _ = chat.add_images(None, OWNER, [("a.png", photos[0])])
    started(chat, session.id)
    r = client.get("/metrics", headers=AUTH)
    warms = {s.labels["source"]: s.value for f in text_string_to_metric_families(r.text)
             for s in f.samples if s.name == "prism:prefix_cache_warms_total"}
    assert warms == {"api": 1.0, "upload": 1.0, "restart": 0.0}


def test_a_warmer_alone_cancels_by_key_and_salt():
    fake = FakeEngine()
    warmer = PrefixWarmer(types.SimpleNamespace(engine=fake))
    for key, salt in (("a", "s1"), ("b", "s1"), ("c", "s2")):
        assert warmer.warm(key, ["x.png"], salt).result(10) is not None
    assert warmer.cancel_salt("s1") == 2 and [w.cancelled for w in fake.warms] == [True, True, False]
    assert warmer.cancel("c") and not warmer.cancel("c") and fake.warms[2].cancelled
    # no engine yet (loading): nothing started, nothing kept
    idle = PrefixWarmer(types.SimpleNamespace(engine=None))
    assert idle.warm("a", ["x.png"], "s").result(10) is None and idle.handle("a") is None


# ---------------------------------------------------------------------------------- on the tiny checkpoint
@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(kv_cache_bytes=64 << 20)


@pytest.fixture
def real_chat(store, engine):
    engine.clear_prefix_cache()
    return ChatService(store, ModelLoader.ready(engine, ModelChoice("tiny", "tiny", True, "test")))


def answer(active):
    return list(active)[-1]


def test_upload_then_the_first_question_is_a_warmed_hit(real_chat, engine, photos):
    session, _ = real_chat.add_images(None, OWNER, [("a.png", photos[0]), ("b.png", photos[1])])
    tokens = started(real_chat, session.id).result(120)
    assert tokens > 256 + 2 * 8  # both photos (astronaut.png alone has 256 visual tokens) and their labels
    first = answer(real_chat.ask(session.id, OWNER, "What is in the pictures?", FAST))
    assert first.telemetry["prefix_cache"] == "hit" and first.telemetry["warmed"] is True
    assert first.telemetry["cached_tokens"] == tokens and not first.telemetry.get("vision_encoder_ran")
    assert first.line.startswith("prefix HIT (warmed at upload) · TTFT ")
    second = answer(real_chat.ask(session.id, OWNER, "And the colours?", FAST))
    assert second.telemetry["prefix_cache"] == "hit" and not second.telemetry["warmed"]
    assert second.line.startswith("prefix HIT · TTFT ")
    rows = real_chat.session_stats(session.id)["turns"]
    assert [r["warmed"] for r in rows] == [True, False]
    assert ttft_chart(rows).count('class="prism-chart-warmed"') == 1
    # the stored turn keeps it: the chip reads the same after a reload
    assert real_chat.turns(session.id)[0].line.startswith("prefix HIT (warmed at upload) · TTFT ")


def test_a_question_sent_while_its_prefix_warms_is_a_hit(real_chat, engine, photos):
    session, _ = real_chat.add_images(None, OWNER, [("a.png", photos[2])])
    started(real_chat, session.id)  # in the engine: the question joins it, or finds it cached
    first = answer(real_chat.ask(session.id, OWNER, "What is it?", FAST))
    assert first.telemetry["prefix_cache"] == "hit"


def test_deleting_a_chat_during_its_warm_frees_its_pages(real_chat, engine, photos):
    engine.clear_prefix_cache()
    before = engine.stats()["pages_used"]
    session, _ = real_chat.add_images(None, OWNER, [("a.png", photos[0]), ("b.png", photos[1])])
    warm = started(real_chat, session.id)
    real_chat.delete(session.id, OWNER)
    try:
        warm.result(60)
    except PrismError:
        pass  # cancelled before it was cached
    deadline = time.monotonic() + 30
    while engine.stats()["pages_used"] != before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats()["pages_used"] == before  # cancelled, or cached and then forgotten


def test_restart_warming_on_the_engine_is_bounded_and_says_so(real_chat, engine, store, photos):
    sessions = _sessions(store, photos, 3)  # one photo each: the newest is the last
    stats = engine.stats()
    prompt = engine.count_prompt_tokens(media_first_messages(real_chat.prompt_images(sessions[-1]), ""),
                                        cache_salt=sessions[-1].cache_salt)
    pages = -(-prompt // stats["page_size"])
    share = (pages * 1.5) / stats["pages_total"]  # room for one session, not two
    assert real_chat.warm_recent(share) == [sessions[-1].id]
    assert real_chat.warmer.handle(sessions[-1].id).done
    first = answer(real_chat.ask(sessions[-1].id, OWNER, "What is it?", FAST))
    assert first.telemetry["prefix_cache"] == "hit" and first.telemetry["warmed"] is True
    assert first.line.startswith("prefix HIT (warmed at start) · TTFT ")
    other = answer(real_chat.ask(sessions[0].id, OWNER, "What is it?", FAST))
    assert other.telemetry["prefix_cache"] == "miss"  # not warmed: outside the share


@pytest.fixture
def real_api(tmp_path, engine):
    engine.clear_prefix_cache()
    store = SessionStore(tmp_path / "data")
    loader = ModelLoader.ready(engine, ModelChoice("tiny", "tiny-test", False, "test"))
    app = create_app(Settings(data_dir=tmp_path / "data", max_upload_mb=2, api_keys=("k1",)), store, loader,
                     mount_ui=False)
    with TestClient(app) as client:
        yield client
    store.close()


def test_a_warmed_key_then_a_chat_request_with_it_is_a_warmed_hit(real_api, photos):
    urls = [data_url(photos[0]), data_url(photos[1])]
    r = real_api.post("/v1/prefix_cache/warm", headers=AUTH,
                      json={"prompt_cache_key": "chat-9", "messages": media_first_openai(urls)})
    assert r.status_code == 200, r.text
    tokens = r.json()["prefix_tokens"]
    assert r.json()["status"] == "cached" and tokens > 256 + 2 * 8
    body = {"messages": media_first_openai(urls, "What is in them?"), "max_tokens": 3, "temperature": 0,
            "prompt_cache_key": "chat-9"}
    assert real_api.post("/v1/chat/completions", json=body).status_code == 401
    out = real_api.post("/v1/chat/completions", json=body, headers=AUTH).json()
    tel = out["prism"]["telemetry"]
    assert tel["prefix_cache"] == "hit" and tel["warmed"] is True
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == tokens
    again = real_api.post("/v1/chat/completions", json={**body, "messages": media_first_openai(urls, "Colours?")},
                          headers=AUTH).json()["prism"]["telemetry"]
    assert again["prefix_cache"] == "hit" and not again["warmed"]
    # another key has its own salt: a miss, warm or not
    other = real_api.post("/v1/chat/completions", json={**body, "prompt_cache_key": "chat-10"},
                          headers=AUTH).json()["prism"]["telemetry"]
    assert other["prefix_cache"] == "miss"
    # warming it again: cached already, at once
    r = real_api.post("/v1/prefix_cache/warm", headers=AUTH,
                      json={"prompt_cache_key": "chat-9", "messages": media_first_openai(urls, "anything")})
    assert r.json() == {"object": "prefix_cache.warm", "status": "cached", "prefix_tokens": tokens}


def test_an_api_warm_of_a_prefix_longer_than_the_context_is_a_400(tmp_path, tiny_engine_factory, photos):
    small = tiny_engine_factory(kv_cache_bytes=64 << 20, max_model_len=200)
    store = SessionStore(tmp_path / "data")
    loader = ModelLoader.ready(small, ModelChoice("tiny", "tiny-test", False, "test"))
    with TestClient(create_app(Settings(data_dir=tmp_path / "data"), store, loader, mount_ui=False)) as client:
        r = client.post("/v1/prefix_cache/warm",
                        json={"prompt_cache_key": "k", "messages": media_first_openai([data_url(photos[0])])})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"]
    store.close()


def test_warms_of_one_photo_in_three_sessions_are_computed_three_times(real_chat, engine, store, photos):
    """Each session warms under its own salt: the same photo in two chats of one owner and a
    stranger's is computed three times (no warm finds another session's prefix cached), and each
    first question is a warmed hit of its own."""
    before = engine.stats()
    sessions = [real_chat.add_images(None, owner, [("a.png", photos[1])])[0] for owner in (OWNER, OWNER, VISITOR)]
    for session in sessions:
        started(real_chat, session.id).result(120)
    after = engine.stats()
    assert after["warms_computed"] - before["warms_computed"] == 3
    assert after["warms_cached"] == before["warms_cached"]
    for session, owner in zip(sessions, (OWNER, OWNER, VISITOR), strict=True):
        first = answer(real_chat.ask(session.id, owner, "What is it?", FAST))
        assert first.telemetry["prefix_cache"] == "hit" and first.telemetry["warmed"] is True


def test_upload_warms_show_in_metrics_on_the_engine(tmp_path, engine, photos):
    from prometheus_client.parser import text_string_to_metric_families

    engine.clear_prefix_cache()
    store = SessionStore(tmp_path / "data")
    loader = ModelLoader.ready(engine, ModelChoice("tiny", "tiny-test", False, "test"))
    app = create_app(Settings(data_dir=tmp_path / "data"), store, loader, mount_ui=False)
    before = engine.stats()
    with TestClient(app) as client:
        chat = app.state.chat
        session, _ = chat.add_images(None, OWNER, [("a.png", photos[0])])
        started(chat, session.id).result(120)
        chat.warm_session(store.get_session(session.id)).result(10).result(60)  # again: cached already
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples}
    store.close()
    assert samples[("prism:prefix_cache_warms_total", (("source", "upload"),))] == 2
    results = {r: samples[("prism:prefix_cache_warm_results_total", (("result", r),))]
               for r in ("computed", "cached", "cancelled", "dropped")}
    assert results["computed"] == 1 + before["warms_computed"] and results["cached"] == 1 + before["warms_cached"]
    assert samples[("prism:prefix_cache_warm_deferred_steps_total", ())] == engine.stats()["warms_deferred_steps"]


def test_an_uploaded_photo_is_decoded_once_from_upload_to_warm_to_answer(real_chat, monkeypatch):
    """The upload's decoded pixels are handed to the engine once (engine/inputs/uploads.py): the
    warm takes them, and the question finds the photo processed under its salt. One decode in
    all, at upload."""
    import io

    from PIL import Image

    from engine.inputs import images as images_module

    count, decode = [0], images_module._decode

    def counted(*args, **kwargs):
        count[0] += 1
        return decode(*args, **kwargs)

    monkeypatch.setattr(images_module, "_decode", counted)
    out = io.BytesIO()
    Image.effect_noise((96, 80), 60).convert("RGB").save(out, "PNG")
    session, _ = real_chat.add_images(None, OWNER, [("n.png", out.getvalue())])
    started(real_chat, session.id).result(120)
    first = answer(real_chat.ask(session.id, OWNER, "What is it?", FAST))
    assert first.telemetry["warmed"] is True and count[0] == 1


def test_the_image_viewer_shows_the_warmed_prefix_before_any_question(real_chat, photos):
    """Once the upload's warm has cached the prefix, the viewer draws what it keeps of each image
    (before, it says "not cached", as after a restart)."""
    session, _ = real_chat.add_images(None, OWNER, [("a.png", photos[0]), ("b.png", photos[1])])
    started(real_chat, session.id).result(120)
    view = real_chat.prefix_view(real_chat.session(session.id, OWNER))
    assert [i["cached"] for i in view["images"]] == [True, True]
    assert all(i["summary"].startswith(("all kept", "kept", "Preview")) for i in view["images"]), view
    assert not real_chat.store.list_turns(session.id)  # no question was asked


def test_a_clip_and_a_photo_are_warmed_like_photos(real_chat, photos, media_path):
    """A clip's prefix is warmed as an image's is ({"video": path} in the same list): the first
    question about a clip and a photo is a warmed hit, the vision encoder not run for it."""
    pytest.importorskip("av")
    session, problems = real_chat.add_images(None, OWNER, [("pan.mp4", media_path("pan.mp4")), ("a.png", photos[2])])
    assert not problems
    assert [next(iter(p)) for p in real_chat.prompt_images(session)] == ["video", "image"]
    started(real_chat, session.id).result(120)
    first = answer(real_chat.ask(session.id, OWNER, "What moves?", FAST))
    assert first.telemetry["prefix_cache"] == "hit" and first.telemetry["warmed"] is True
    assert not first.telemetry.get("vision_encoder_ran") and first.line.startswith("prefix HIT (warmed at upload)")
