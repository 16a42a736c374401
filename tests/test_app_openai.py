"""The OpenAI-compatible API: /v1/models, /v1/chat/completions with data: URL images, streaming
(SSE), server-chosen cache salts, clear 400s, and cancellation when the client goes away."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import pytest
from fastapi.testclient import TestClient

from app.model_loader import ModelChoice, ModelLoader
from app.openai_api import OpenAIAPI
from app.server import create_app
from app.settings import Settings
from engine import Completion, SamplingParams
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
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
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
    """A request whose client has disconnected."""

    headers: dict = {}

    async def is_disconnected(self) -> bool:
        return True


def test_client_disconnect_cancels_the_request(engine):
    """A client that has gone away gets nothing more: the stream stops before the answer is
    complete and the engine request is cancelled, long before its 2000 tokens."""
    api = OpenAIAPI(types_loader(engine), max_image_bytes=1 << 20)
    req = engine.submit([{"role": "user", "content": "Talk for a long time"}],
                        SamplingParams(max_tokens=2000, ignore_eos=True))

    async def consume():
        seen = []
        async for item in api._items(GoneClient(), engine, req):
            seen.append(item)
        return seen

    seen = asyncio.run(consume())
    assert not any(isinstance(item, Completion) for item in seen)  # stopped before the end
    done = wait_for_completion(req)
    assert req.cancelled and done.finish_reason == "cancelled"
    assert len(done.token_ids) < 2000
    deadline = time.monotonic() + 30  # a hang guard, not a timing
    while engine.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats()["running"] == 0


def wait_for_completion(req) -> Completion:
    """The request's final :class:`Completion` (deltas still queued are skipped)."""
    while True:
        item = req.outbox.get(timeout=60)
        if isinstance(item, Completion):
            return item


def types_loader(engine):
    import types

    return types.SimpleNamespace(engine=engine, model_id="tiny-test")
