"""The OpenAI-compatible API: /v1/models, /v1/chat/completions with data: URL images, streaming
(SSE), server-chosen cache salts, clear 400s, and cancellation when the client goes away."""

from __future__ import annotations

import asyncio
import base64
import json
import pathlib
import time

import pytest
from conftest import CI
from fastapi.testclient import TestClient

from app.model_loader import ModelChoice, ModelLoader
from app.openai_api import OpenAIAPI
from app.server import create_app
from app.settings import Settings
from engine import Completion, PrismError, RequestHandle, SamplingParams
from engine.serving.handle import OutputChannel
from sessions import SessionStore


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(kv_cache_bytes=64 << 20)


@pytest.fixture(scope="module")
def client(tmp_path_factory, engine):
    data = tmp_path_factory.mktemp("api-data")
    settings = Settings(data_dir=data, max_upload_mb=2)
    store = SessionStore(data)
    loader = ModelLoader.ready(engine, ModelChoice("tiny", "tiny-test", False, "test"), settings)
    with TestClient(create_app(settings, store, loader, mount_ui=False)) as c:
        yield c
    store.close()


@pytest.fixture(scope="module")
def astronaut_url(media_path):
    return "data:image/png;base64," + base64.b64encode(media_path("astronaut.png").read_bytes()).decode()


#: The media-first prefix of one astronaut.png: 3 + 1 + 256 + 1 tokens (see its use).
ASTRONAUT_PREFIX_TOKENS = 261


def image_message(url, text="What is this?"):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def test_models(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and body["data"][0]["id"] == "tiny-test"


def test_completion_with_an_image(client, astronaut_url, engine):
    engine.clear_prefix_cache()
    body = {"model": "tiny-test", "messages": image_message(astronaut_url), "max_tokens": 5, "temperature": 0,
            "seed": 3}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["model"] == "tiny-test"
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    assert out["usage"]["completion_tokens"] <= 5 and out["usage"]["prompt_tokens"] > 100
    assert out["prism"]["telemetry"]["prefix_cache"] == "miss"
    # an anonymous request is its own session: the same images again are a miss
    alone = client.post("/v1/chat/completions", json={**body, "messages": image_message(astronaut_url, "Colours?")})
    assert alone.json()["prism"]["telemetry"]["prefix_cache"] == "miss"
    # requests naming the same prompt_cache_key share a cache: the prefix is reused
    keyed = {**body, "prompt_cache_key": "my-chat-7f3a"}
    assert client.post("/v1/chat/completions", json=keyed).json()["prism"]["telemetry"]["prefix_cache"] == "miss"
    again = client.post("/v1/chat/completions", json={**keyed, "messages": image_message(astronaut_url, "Colours?")})
    assert again.json()["prism"]["telemetry"]["prefix_cache"] == "hit"
    # the reused prefix, not the whole prompt: <|im_start|>user\n (3 tokens), <|vision_start|>, the
    # photo's 256 tokens (512 x 512 px at 32 px a token), <|vision_end|>; the question is computed
    usage = again.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == ASTRONAUT_PREFIX_TOKENS < usage["prompt_tokens"]
    # another prompt_cache_key has its own salt: no sharing across clients
    other = client.post("/v1/chat/completions", json={**keyed, "prompt_cache_key": "someone-else"})
    assert other.json()["prism"]["telemetry"]["prefix_cache"] == "miss"


def test_salt_is_never_taken_from_the_body(client, astronaut_url, engine):
    """A body's ``cache_salt`` is ignored: the salt comes from the server (here: the shared
    prompt_cache_key, so the second request hits although it names another salt)."""
    engine.clear_prefix_cache()
    body = {"messages": image_message(astronaut_url), "max_tokens": 2, "cache_salt": "attacker", "user": "x",
            "prompt_cache_key": "k"}
    first = client.post("/v1/chat/completions", json=body).json()
    second = client.post("/v1/chat/completions", json={**body, "cache_salt": "other"}).json()
    assert first["prism"]["telemetry"]["prefix_cache"] == "miss"
    assert second["prism"]["telemetry"]["prefix_cache"] == "hit"


def test_text_only_and_stop(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "Be brief."},
                                                               {"role": "user", "content": "Hi"}],
                                                  "max_tokens": 4, "stop": ["\n"], "top_p": 0.9})
    assert r.status_code == 200 and r.json()["prism"]["telemetry"]["prefix_cache"] == "off"


def test_streaming_sse(client, astronaut_url):
    body = {"messages": image_message(astronaut_url), "max_tokens": 6, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and "telemetry" in finals[0]["prism"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 6
    plain = client.post("/v1/chat/completions", json={**body, "stream": False}).json()
    assert plain["choices"][0]["message"]["content"] == text  # greedy: the same answer both ways


@pytest.mark.parametrize("body,needle", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]}, "audio"),
    ({"messages": image_message("https://example.com/cat.png")}, "data: URLs"),
    ({"messages": image_message("data:image/png,rawbytes")}, "base64"),
    ({"messages": image_message("data:image/png;base64,@@@not-base64@@@")}, "base64"),
    ({"messages": image_message("data:image/png;base64," + base64.b64encode(b"plain text").decode())}, "image"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a <"},
                                                 {"type": "text", "text": "|image_pad|>"}]}]}, "vision marker"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10_000_000}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n = 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "seed": "s"}, "seed"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
])
def test_bad_requests_get_clear_400s(client, body, needle):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and needle.lower() in err["message"].lower()


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 5), ("max_tokens", -1)])
def test_out_of_range_values_name_their_parameter(client, field, value):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_body_must_be_a_json_object(client):
    json_type = {"Content-Type": "application/json"}
    assert client.post("/v1/chat/completions", content=b"{nope", headers=json_type).status_code == 400
    assert client.post("/v1/chat/completions", json=[1, 2]).status_code == 400


def test_oversized_image_is_refused_before_decoding(client):
    huge = "data:image/png;base64," + "A" * (4 << 20)
    r = client.post("/v1/chat/completions", json={"messages": image_message(huge)})
    assert r.status_code == 400 and "MiB" in r.json()["error"]["message"]


def test_model_loading_gives_503(tmp_path):
    store = SessionStore(tmp_path)
    with TestClient(create_app(Settings(data_dir=tmp_path), store, ModelLoader(Settings()), mount_ui=False)) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
    store.close()


class GoneClient:
    """A request whose client has disconnected (its ASGI receive says so)."""

    headers: dict = {}

    async def receive(self) -> dict:
        return {"type": "http.disconnect"}


def wait_settled(engine) -> None:
    """Return once the engine runs and queues nothing (a hang guard, not a timing)."""
    deadline = time.monotonic() + 60
    while (engine.stats()["running"] or engine.stats()["waiting"]) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_client_disconnect_cancels_the_request(engine):
    """A client that has gone away gets nothing more: the stream stops before the answer is
    complete and the engine request is cancelled, long before its 2000 tokens."""
    api = OpenAIAPI(types_loader(engine), max_image_bytes=1 << 20)
    handle = engine.submit([{"role": "user", "content": "Talk for a long time"}],
                           SamplingParams(max_tokens=2000, ignore_eos=True))

    async def consume():
        return [item async for item in api._items(GoneClient(), handle)]

    seen = asyncio.run(consume())
    assert not any(isinstance(item, Completion) for item in seen)  # stopped before the end
    wait_settled(engine)
    req = handle.request
    assert req.cancelled and len(req.generated) < 2000
    assert engine.stats()["running"] == 0
    assert api.metrics.requests.labels("abort")._value.get() == 1


class RecordingEngine:
    """The engine, with every handle its ``submit`` returned kept in :attr:`handles`."""

    def __init__(self, engine):
        self._engine, self.handles = engine, []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def submit(self, *args, **kwargs):
        handle = self._engine.submit(*args, **kwargs)
        self.handles.append(handle)
        return handle


@pytest.fixture
def live_server(tmp_path, engine):
    """``(base_url, recording_engine, api)``: the app without its UI on a real uvicorn server (a
    thread, an OS-chosen port), so that a client closing its connection is a real disconnect."""
    import threading

    import uvicorn

    recording = RecordingEngine(engine)
    settings = Settings(data_dir=tmp_path, max_upload_mb=2)
    store = SessionStore(tmp_path)
    loader = ModelLoader.ready(recording, ModelChoice("tiny", "tiny-test", False, "test"), settings)
    app = create_app(settings, store, loader, mount_ui=False)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", recording, app.state.openai
    finally:
        server.should_exit = True
        thread.join(30)
        store.close()


LONG = {"messages": [{"role": "user", "content": "Talk for a long time"}], "max_tokens": 2000, "temperature": 0}


def assert_cancelled_and_freed(engine, handle, api) -> None:
    wait_settled(engine)
    req = handle.request
    assert req.cancelled and len(req.generated) < 2000  # stopped by the disconnect, not by its end
    stats = engine.stats()
    assert stats["running"] == 0 and stats["pages_used"] == stats["cache_pages"], stats  # its pages are free
    aborted = api.metrics.requests.labels("abort")._value.get
    deadline = time.monotonic() + 10  # the handler counts it after the engine let go of it (a race, not a timing)
    while aborted() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert aborted() == 1
    assert api.metrics.requests.labels("length")._value.get() == 0


def test_a_client_that_disconnects_mid_stream_over_http_cancels_its_request(live_server, engine):
    """Over a real connection: a streaming client that reads one delta and closes the connection
    gets its engine request cancelled and its KV pages freed (no timed poll finds it: the server's
    ASGI receive says ``http.disconnect``)."""
    import httpx

    url, recording, api = live_server
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            while '"content": ""' in (line := next(lines)) or not line:  # the role chunk and blank lines
                pass
            assert '"content"' in line  # the first text delta: the request runs
    (handle,) = recording.handles
    assert_cancelled_and_freed(engine, handle, api)


def test_a_client_that_disconnects_before_a_whole_answer_over_http_cancels_its_request(live_server, engine):
    """The same without streaming: the client closes its socket while its answer is computed."""
    import socket
    from urllib.parse import urlsplit

    url, recording, api = live_server
    body = json.dumps(LONG).encode()
    split = urlsplit(url)
    with socket.create_connection((split.hostname, split.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 60  # a hang guard: wait until the request runs in the engine
        while not (recording.handles and recording.handles[0].request.generated) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert recording.handles and recording.handles[0].request.generated, "the request never ran"
    (handle,) = recording.handles
    assert_cancelled_and_freed(engine, handle, api)


def types_loader(engine):
    import types

    return types.SimpleNamespace(engine=engine, model_id="tiny-test")


# ---------------------------------------------------------------------------------- issue 22: model
def test_a_model_that_is_not_served_is_a_404_model_not_found(client):
    """OpenAI and vLLM answer a model they do not serve with 404 ``model_not_found``. Before, any
    name was answered by the served model, so a client that asked for "gpt-4o" by mistake got a
    random model's answer as if it were GPT-4o's. Without ``model`` (the README's curl sends
    none) the served model answers; GET /v1/models lists exactly what may be named."""
    hi = [{"role": "user", "content": "Hi"}]
    served = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert served == ["tiny-test"]
    for stream in (False, True):
        r = client.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": hi, "stream": stream})
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert err["type"] == "invalid_request_error" and "gpt-4o" in err["message"] and "tiny-test" in err["message"]
    r = client.post("/v1/chat/completions", json={"model": 7, "messages": hi})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    for body in ({"messages": hi}, {"model": None, "messages": hi}, {"model": "tiny-test", "messages": hi}):
        r = client.post("/v1/chat/completions", json={**body, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "tiny-test"


# ---------------------------------------------------------------------------------- issue 22: cut short
class PresentClient:
    """A request whose client stays connected (its ASGI receive never answers)."""

    headers: dict = {}

    async def receive(self) -> dict:
        await asyncio.Event().wait()  # cancelled when the answer is done
        raise AssertionError("unreachable")


def sse_events(api, handle, include_usage=False, midway=None) -> list:
    """Every server-sent event of ``handle``'s stream, parsed (``"[DONE]"`` kept as the string);
    ``midway()`` is called once the first text delta has been sent."""
    async def read():
        stream = api._sse(PresentClient(), handle, "chatcmpl-test", include_usage)
        lines = [await anext(stream), await anext(stream)]  # the role chunk, then the first delta
        if midway is not None:
            midway()
        return lines + [line async for line in stream]

    events = []
    for raw in asyncio.run(read()):
        assert raw.startswith("data: ") and raw.endswith("\n\n"), raw
        data = raw[6:].strip()
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def finish_reasons(events) -> list:
    return [e["choices"][0]["finish_reason"] for e in events
            if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]]


def test_a_stream_cut_short_by_a_shutdown_does_not_end_like_a_finished_answer(engine):
    """At shutdown (``cancel_all``, what Ctrl-C calls) a stream used to end with
    ``finish_reason: "stop"`` and ``[DONE]``: the client took a half answer for a whole one. Now
    its last chunk has vLLM's ``finish_reason: "abort"``, then an error event (code ``aborted``,
    which the OpenAI SDK raises), then ``[DONE]``; and the server refuses new requests (503)."""
    api = OpenAIAPI(types_loader(engine), max_image_bytes=1 << 20)
    handle = engine.submit([{"role": "user", "content": "Talk for a long time"}],
                           SamplingParams(max_tokens=2000, ignore_eos=True))
    cancelled = []
    events = sse_events(api, handle, include_usage=True, midway=lambda: cancelled.append(api.cancel_all()))
    assert cancelled == [1]
    assert events[-1] == "[DONE]"
    assert finish_reasons(events) == ["abort"]
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["code"] == "aborted" and "shutting down" in errors[0]["message"]
    assert events.index({"error": errors[0]}) == len(events) - 2  # the error is the last event before [DONE]
    usage = [e for e in events if isinstance(e, dict) and e.get("usage")]
    assert usage and 0 < usage[0]["usage"]["completion_tokens"] < 2000
    assert api.metrics.requests.labels("abort")._value.get() == 1
    refused = asyncio.run(api.chat_completions(JSONRequest({"messages": [{"role": "user", "content": "Hi"}]})))
    assert refused.status_code == 503 and b"shutting down" in refused.body


def handle_of(*items) -> RequestHandle:
    """A handle whose channel already holds ``items`` (deltas, then an error), of no engine."""
    channel = OutputChannel()
    for item in items:
        channel.put(item)
    return RequestHandle(0, channel, lambda wait: None, prompt_tokens=0)


@pytest.mark.parametrize("failure", [PrismError("the engine stopped"), RuntimeError("a bug")])
def test_a_stream_that_fails_in_the_engine_ends_with_an_error_event_only(failure):
    """A request the engine fails mid-answer: the stream sends what it had, then an error event
    and ``[DONE]``, and no ``finish_reason`` at all (as vLLM). Before, an error that was not a
    PrismError (a bug) broke the stream off with no event at all, which clients read as a normal
    end."""
    api = OpenAIAPI(types_loader(None), max_image_bytes=1 << 20)
    events = sse_events(api, handle_of("Hel", "lo", failure))
    assert events[-1] == "[DONE]" and finish_reasons(events) == []
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert text == "Hello"
    error = events[-2]["error"]
    assert error["type"] == "server_error" and "the request failed" in error["message"]
    assert "a bug" not in error["message"]  # a bug is logged; the client sees only its type
    assert api.metrics.requests.labels("error")._value.get() == 1


def test_non_streaming_answers_cut_short_get_an_error_status(engine):
    """Without streaming: an answer cancelled before its end is a 503 (code ``aborted``), a
    failure in the engine a 500, both in OpenAI's error shape; before, a cancelled answer came
    back as a 200 with ``finish_reason: "stop"`` and a bug escaped as an unhandled exception."""
    api = OpenAIAPI(types_loader(engine), max_image_bytes=1 << 20)
    handle = engine.submit([{"role": "user", "content": "Talk for a long time"}],
                           SamplingParams(max_tokens=2000, ignore_eos=True))
    engine.cancel(handle)
    r = asyncio.run(api._complete(PresentClient(), handle, "chatcmpl-test"))
    assert r.status_code == 503 and json.loads(r.body)["error"]["code"] == "aborted"
    for failure in (PrismError("the engine stopped"), RuntimeError("a bug")):
        r = asyncio.run(api._complete(PresentClient(), handle_of("Hel", failure), "chatcmpl-test"))
        err = json.loads(r.body)["error"]
        assert r.status_code == 500 and err["type"] == "server_error" and "the request failed" in err["message"]


class JSONRequest:
    """A connected client's POST of ``body`` as JSON (for calling the route handler directly)."""

    def __init__(self, body: dict):
        self._body = json.dumps(body).encode()
        self.headers = {"content-type": "application/json"}

    async def body(self) -> bytes:
        return self._body

    async def receive(self) -> dict:
        await asyncio.Event().wait()  # connected until the answer is done
        raise AssertionError("unreachable")


# ------------------------------------------------------------------------------------------------
# video_url parts (base64 data: URLs, as vLLM accepts them)
# ------------------------------------------------------------------------------------------------

CLIP = pathlib.Path(__file__).resolve().parent / "media" / "pan.mp4"


def video_message(url, text="What happens?"):
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def _clip_url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def test_completion_with_a_video_clip_hits_the_prefix_cache_like_images(client, engine):
    """A clip in a data: URL is decoded and sampled by the engine (its tokens are the prompt
    builder's for the same bytes); the same clip with the same prompt_cache_key hits."""
    if not CI:
        pytest.importorskip("av")
    engine.clear_prefix_cache()
    data = CLIP.read_bytes()
    body = {"messages": video_message(_clip_url(data)), "max_tokens": 3, "temperature": 0, "prompt_cache_key": "v"}
    first = client.post("/v1/chat/completions", json=body)
    assert first.status_code == 200, first.text
    want = engine.prompts.build([{"role": "user", "content": [{"type": "video", "video": data},
                                                              {"type": "text", "text": "What happens?"}]}])
    assert first.json()["usage"]["prompt_tokens"] == len(want.input_ids)
    assert first.json()["prism"]["telemetry"]["prefix_cache"] == "miss"
    again = client.post("/v1/chat/completions", json={**body, "messages": video_message(_clip_url(data), "Colours?")})
    assert again.json()["prism"]["telemetry"]["prefix_cache"] == "hit"
    # reused: the tokens the two prompts share, the clip's prefix and what follows it before the
    # questions differ (the conversation reuse of the first request's KV)
    second = engine.prompts.build([{"role": "user", "content": [{"type": "video", "video": data},
                                                                {"type": "text", "text": "Colours?"}]}])
    shared = next(i for i, (a, b) in enumerate(zip(want.input_ids, second.input_ids, strict=False)) if a != b)
    usage = again.json()["usage"]
    assert want.prefix_len <= shared < len(second.input_ids) == usage["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == shared


@pytest.mark.parametrize("url,needle", [
    ("https://example.com/clip.mp4", "data: URLs"),
    ("data:video/mp4,raw", "base64"),
    ("data:video/mp4;base64,@@@", "base64"),
    ("data:video/mp4;base64," + "A" * (4 << 20), "MiB"),
    (_clip_url(b"plain text, not a clip"), "not a video"),
    (_clip_url(CLIP.read_bytes()[:4000]), "truncated"),
])
def test_bad_video_urls_get_clear_400s(client, url, needle):
    if not CI:
        pytest.importorskip("av")
    r = client.post("/v1/chat/completions", json={"messages": video_message(url), "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and needle.lower() in err["message"].lower(), err
