"""The hostile-client run of issue 30 (items 2, 3, 4, 5 and 7's truncated WebM and slow body):
each test sends the attack, then checks what the attacker sees (a 4xx naming the reason) and
that the server did not do the work or open the file the attack asked for."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from app.model_loader import ModelChoice, ModelLoader
from app.server import create_app
from app.settings import Settings
from sessions import SessionStore


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(kv_cache_bytes=64 << 20)


@pytest.fixture(scope="module")
def client(tmp_path_factory, engine):
    data = tmp_path_factory.mktemp("round3-data")
    settings = Settings(data_dir=data, max_upload_mb=2)
    store = SessionStore(data)
    loader = ModelLoader.ready(engine, ModelChoice("tiny", "tiny-test", False, "test"), settings)
    with TestClient(create_app(settings, store, loader, mount_ui=False), raise_server_exceptions=False) as c:
        yield c
    store.close()


def post_raw(client, body: str):
    """POST ``body`` as it is (json.dumps leaves lone surrogates as JSON escapes, as a client may)."""
    return client.post("/v1/chat/completions", content=body.encode(), headers={"Content-Type": "application/json"})


# ------------------------------------------------------------------ item 3: no 500s on /v1
def test_lone_surrogate_model_name_gets_400_not_500(client):
    """Attacker: ``{"model": "\\ud800"}``. Before, rendering the 404 that echoes the name raised
    UnicodeEncodeError (500); now a 400 naming ``model``."""
    r = post_raw(client, json.dumps({"model": "\ud800", "messages": [{"role": "user", "content": "hi"}]}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model" and "surrogate" in r.json()["error"]["message"]


def test_deeply_nested_json_gets_400_not_500(client):
    """Attacker: a 2 KB body of 1,000 nested arrays. Before, json's RecursionError escaped as a 500."""
    r = post_raw(client, "[" * 1000 + "]" * 1000)
    assert r.status_code == 400, r.text
    r = post_raw(client, "[" * 100_000 + "]" * 100_000)
    assert r.status_code == 400 and "deeply" in r.json()["error"]["message"], r.text
    r = post_raw(client, '{"messages": ' + "[" * 5000 + "]" * 5000 + "}")
    assert r.status_code == 400, r.text


def _string_slots():
    """Every string field of every ``/v1`` body: a function putting ``s`` in that field."""
    def part(p):
        return {"messages": [{"role": "user", "content": [p]}], "max_tokens": 1}

    return {
        "model": lambda s: {"model": s, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        "role": lambda s: {"messages": [{"role": s, "content": "hi"}], "max_tokens": 1},
        "content": lambda s: {"messages": [{"role": "user", "content": s}], "max_tokens": 1},
        "part.type": lambda s: part({"type": s, "text": "hi"}),
        "part.text": lambda s: part({"type": "text", "text": s}),
        "image_url.url": lambda s: part({"type": "image_url", "image_url": {"url": s}}),
        "image_url": lambda s: part({"type": "image_url", "image_url": s}),
        "video_url.url": lambda s: part({"type": "video_url", "video_url": {"url": s}}),
        "stop": lambda s: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stop": s},
        "stop[]": lambda s: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stop": [s]},
        "prompt_cache_key": lambda s: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                       "prompt_cache_key": s},
        "stream": lambda s: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": s},
        "key": lambda s: {s: s, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    }


def test_fuzz_every_v1_string_field_with_lone_surrogates(client):
    """Attacker: a lone surrogate (alone or inside other text) in each string field of each
    ``/v1`` route's body and in the ``GET /v1/models`` query. Every answer is 2xx-4xx."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    slots = _string_slots()
    surrogate = st.sampled_from(["\ud800", "\udfff", "\udc00x", "data:\ud800", "data:image/png;base64,\ud800"])
    text = st.tuples(st.text(max_size=8), surrogate, st.text(max_size=8)).map("".join)

    @settings(max_examples=60, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(slot=st.sampled_from(sorted(slots)), s=text)
    def fuzz(slot, s):
        r = post_raw(client, json.dumps(slots[slot](s)))
        assert r.status_code < 500, (slot, s, r.status_code, r.text[:300])

    fuzz()
    for slot in slots:  # each slot at least once, whatever hypothesis drew
        assert post_raw(client, json.dumps(slots[slot]("\ud800"))).status_code < 500, slot
    assert client.get("/v1/models", params={"x": "\ud800".encode("utf-8", "surrogatepass")}).status_code < 500


def test_fuzz_every_v1_body_for_depth(client):
    """Attacker: JSON nested 10 to 20,000 levels at any place of the body (the top, ``messages``,
    a part, a sampling field). Every answer is 2xx-4xx."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    hi = [{"role": "user", "content": "hi"}]
    places = {
        "top": lambda deep: deep,
        "messages": lambda deep: {"messages": deep},
        "content": lambda deep: {"messages": [{"role": "user", "content": deep}]},
        "part": lambda deep: {"messages": [{"role": "user", "content": [{"type": "text", "text": deep}]}]},
        "image_url": lambda deep: {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                               "image_url": deep}]}]},
        "stop": lambda deep: {"messages": hi, "stop": deep},
        "stream_options": lambda deep: {"messages": hi, "stream_options": deep, "max_tokens": 1},
        "model": lambda deep: {"messages": hi, "model": deep},
    }
    marker = '"__DEEP__"'

    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(place=st.sampled_from(sorted(places)), depth=st.integers(10, 20_000), brace=st.booleans())
    def fuzz(place, depth, brace):
        open_, close = ('{"a":', "}") if brace else ("[", "]")
        deep = open_ * depth + "1" + close * depth
        body = json.dumps(places[place]("__DEEP__")).replace(marker, deep)
        r = post_raw(client, body)
        assert r.status_code < 500, (place, depth, r.status_code, r.text[:300])

    fuzz()


# ------------------------------------------------------------------ item 4: clips open no other file
def _playlists(canary) -> dict[str, bytes]:
    """Clip bodies that ask FFmpeg to open ``canary``: a concat list, an HLS playlist, a concat
    list naming it through the ``subfile:`` protocol, and each behind an MP4 name."""
    return {
        "ffconcat": f"ffconcat version 1.0\nfile '{canary}'\n".encode(),
        "hls": f"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1.0,\n{canary}\n#EXT-X-ENDLIST\n".encode(),
        "subfile": f"ffconcat version 1.0\nfile 'subfile,,start,0,end,0,,:{canary}'\n".encode(),
    }


@pytest.fixture()
def canary(tmp_path, media_path, monkeypatch):
    """A real clip in the working directory (FFmpeg's concat demuxer opens relative names without
    complaint), whose atime is set a day before its mtime, so that any read of it (relatime
    included) moves its atime; the fixture first checks that a read does."""
    import os
    import shutil

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "canary.mp4"
    shutil.copy(media_path("pan.mp4"), path)

    def age():
        st = os.stat(path)
        os.utime(path, ns=(st.st_mtime_ns - 86_400 * 10**9, st.st_mtime_ns))
        return os.stat(path).st_atime_ns

    before = age()
    path.read_bytes()
    if os.stat(path).st_atime_ns == before:
        pytest.fail("this filesystem does not update atimes (noatime): the canary cannot tell a read")
    from types import SimpleNamespace

    return SimpleNamespace(path=path, age=age)


@pytest.mark.parametrize("kind", ["ffconcat", "hls", "subfile"])
def test_a_playlist_clip_opens_no_file(kind, canary, client):
    """Attacker: a ``video_url`` (and a direct :func:`decode_video` call, as an uploaded
    ``clip.mp4``) whose bytes are a concat list, an HLS playlist or a ``subfile:`` reference to a
    file on the server. Before, FFmpeg probed its demuxers, found the list and opened the file;
    now the demuxer is chosen from the first bytes, the list is refused with a 400 and the
    canary's atime does not move."""
    import base64
    import os

    from engine.errors import InvalidVideoError
    from engine.inputs.video import decode_video

    data = _playlists(canary.path.name)[kind]
    before = canary.age()
    with pytest.raises(InvalidVideoError, match="not a video Prism can read"):
        decode_video(data)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    r = client.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "what happens?"}]}]})
    assert r.status_code == 400, r.text
    assert os.stat(canary.path).st_atime_ns == before, "the server opened the file the playlist names"


def test_video_demuxer_is_named_from_the_first_bytes(media_path):
    """Only MP4/MOV, WebM/Matroska and GIF get a demuxer; anything else never reaches FFmpeg."""
    from engine.errors import InvalidVideoError
    from engine.inputs.video import video_demuxer

    assert video_demuxer(media_path("pan.mp4").read_bytes()) == "mov"
    assert video_demuxer(media_path("pan.gif").read_bytes()) == "gif"
    assert video_demuxer(b"\x1a\x45\xdf\xa3" + b"\0" * 40) == "matroska"
    for data in (b"ffconcat version 1.0\n", b"#EXTM3U\n", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"RIFF....AVI ",
                 b"\x00\x00\x01\xba", b"", b"GIF8"):
        with pytest.raises(InvalidVideoError):
            video_demuxer(data)


# ------------------------------------------------------------------ item 7: a truncated WebM
def _webm(frames: int = 40, rate: int = 10) -> bytes:
    """A VP8 WebM of ``frames`` 64x48 frames at ``rate`` fps (a bar moving right), written by PyAV."""
    import io

    import av
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, "w", format="webm") as out:
        stream = out.add_stream("libvpx", rate=rate)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(frames):
            rgb = np.zeros((48, 64, 3), np.uint8)
            rgb[:, (i * 3) % 64] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def test_a_webm_truncated_at_half_is_refused(client):
    """Attacker (or a broken upload): a 4 s WebM cut at 50% of its bytes. Before, it demuxed
    cleanly and was answered as a 1.4 s clip; now "ends early" (the engine's error, a 400 on /v1),
    while the whole file decodes."""
    import base64

    from engine.errors import InvalidVideoError
    from engine.inputs.video import decode_video

    whole = _webm()
    assert decode_video(whole).total_frames == 40
    half = whole[: len(whole) // 2]
    with pytest.raises(InvalidVideoError, match="ends early"):
        decode_video(half)
    url = "data:video/webm;base64," + base64.b64encode(half).decode()
    r = client.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "what happens?"}]}]})
    assert r.status_code == 400 and "ends early" in r.json()["error"]["message"], r.text


# ------------------------------------------------------------------ item 7: a slow body
@pytest.fixture(scope="module")
def slow_body_server(tmp_path_factory, engine, live_server):
    """The app (no UI) on a real uvicorn socket with a 1 s body deadline."""
    data = tmp_path_factory.mktemp("round3-slow")
    settings = Settings(data_dir=data, max_upload_mb=2, body_timeout_s=1.0)
    store = SessionStore(data)
    loader = ModelLoader.ready(engine, ModelChoice("tiny", "tiny-test", False, "test"), settings)
    yield live_server(create_app(settings, store, loader, mount_ui=False))
    store.close()


def test_a_body_that_never_finishes_gets_408_and_others_are_served(slow_body_server):
    """Attacker: 8 connections each declaring a 100 kB JSON body, sending 10 bytes of it and then
    nothing. Before, uvicorn waited for the rest forever (no read timeout), each holding a
    connection and a route. Now each gets 408 naming the deadline (the socket's own timeout only
    keeps a broken test from hanging), and while they hang a normal request is answered."""
    import socket

    import httpx

    host, port = slow_body_server.url.removeprefix("http://").split(":")
    held = []
    for _ in range(8):
        s = socket.create_connection((host, int(port)), timeout=30)
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json"
                  "\r\nContent-Length: 100000\r\n\r\n".encode() + b'{"messages"')
        held.append(s)
    assert httpx.get(slow_body_server.url + "/v1/models", timeout=30).status_code == 200
    for s in held:
        answer = b""
        while chunk := s.recv(65536):  # the 408 closes the connection
            answer += chunk
        s.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"did not arrive within 1 s" in answer


def test_the_body_deadline_leaves_finished_bodies_alone():
    """ASGI-level: a body complete in time passes through untouched, and after it the app may
    wait on ``receive`` (a stream watching for a disconnect) past the deadline without a 408."""
    import asyncio

    from app.guards import BodyDeadline

    async def run():
        sent, gone = [], asyncio.Event()
        inbox = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive():
            if inbox:
                return inbox.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        async def app(scope, receive, send):
            assert (await receive())["body"] == b"{}"
            waiting = asyncio.ensure_future(receive())
            await asyncio.sleep(0.3)  # past the 0.1 s deadline: the wait on the client must go on
            assert not waiting.done()
            gone.set()
            assert (await waiting)["type"] == "http.disconnect"
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        await BodyDeadline(app, 0.1)({"type": "http", "path": "/v1/x", "headers": []}, receive, send)
        return sent

    sent = asyncio.run(run())
    assert sent[0]["status"] == 200 and sent[1]["body"] == b"ok"


# ------------------------------------------------------------------ item 2: what one request may cost
def _peak_growth_mib(call):
    """Run ``call()``; return (its result, the peak of Python allocations during it, MiB)."""
    import tracemalloc

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return result, (peak - base) / 2**20


def _gif_clips(n: int) -> list[bytes]:
    """``n`` distinct 2-frame 32x32 GIF clips (Pillow)."""
    import io

    from PIL import Image

    clips = []
    for i in range(n):
        frames = [Image.new("RGB", (32, 32), ((i * 7) % 256, j * 90, 40)) for j in range(3)]
        out = io.BytesIO()
        frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
        clips.append(out.getvalue())
    return clips


def _counting_decoders(monkeypatch):
    """Count every image open and video decode the engine starts."""
    from engine.inputs import processed_images, prompts, video

    calls = {"image": 0, "video": 0}

    def counted(module, name, kind):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[kind] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counted(video, "decode_video", "video")
    counted(processed_images, "open_image", "image")
    counted(prompts, "open_image", "image")
    return calls


def test_many_distinct_gif_clips_are_refused_before_any_decode(client, engine, monkeypatch):
    """Attacker: 40 distinct GIF clips in one /v1 request (the issue's 8 large ones took 42 s and
    +4.8 GiB before a 400). Now a 400 naming --max-media-per-request (16, the app's --max-images)
    at once: nothing decoded, and the request's peak allocations stay far under 500 MiB."""
    import base64

    calls = _counting_decoders(monkeypatch)
    parts = [{"type": "video_url", "video_url": {"url": "data:image/gif;base64," + base64.b64encode(c).decode()}}
             for c in _gif_clips(40)]
    body = {"max_tokens": 1, "messages": [{"role": "user", "content": parts + [{"type": "text", "text": "?"}]}]}
    decodes = engine.prompts.decodes
    r, peak = _peak_growth_mib(lambda: client.post("/v1/chat/completions", json=body))
    assert r.status_code == 400 and "--max-media-per-request" in r.json()["error"]["message"], r.text
    assert calls == {"image": 0, "video": 0} and engine.prompts.decodes == decodes
    assert peak < 500, peak


def test_four_hundred_small_jpegs_are_refused_before_any_decode(client, engine, monkeypatch, media_path):
    """Attacker: 400 small JPEGs in one request (2.1 s and +1.1 GiB before). Now a 400 naming
    the limit; no image opened, peak allocations bounded."""
    import base64

    calls = _counting_decoders(monkeypatch)
    jpeg = "data:image/jpeg;base64," + base64.b64encode(media_path("china.jpg").read_bytes()[:2000]).decode()
    parts = [{"type": "image_url", "image_url": {"url": jpeg}} for _ in range(400)]
    body = {"max_tokens": 1, "messages": [{"role": "user", "content": parts}]}
    decodes = engine.prompts.decodes
    r, peak = _peak_growth_mib(lambda: client.post("/v1/chat/completions", json=body))
    assert r.status_code == 400 and "at most 16 per request" in r.json()["error"]["message"], r.text
    assert calls == {"image": 0, "video": 0} and engine.prompts.decodes == decodes
    assert peak < 500, peak


def test_a_million_text_parts_and_too_much_text_are_refused(client, engine):
    """Attacker: 10^6 text parts (a 29.6 MiB body: 15 s before), and a text-only body of 2 MiB
    (the /v1 cap lets ~1 GiB through; the README promised 1 MiB of text). Both 400s naming the
    limit; the parse stops at the object limit, so the million parts are never all built."""
    decodes = engine.prompts.decodes
    many = json.dumps({"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"} for _ in range(10**6)]}]})
    r, peak = _peak_growth_mib(lambda: post_raw(client, many))
    assert r.status_code == 400 and "JSON objects" in r.json()["error"]["message"], r.text
    assert peak < 500, peak
    parts = json.dumps({"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"} for _ in range(2000)]}]})
    r = post_raw(client, parts)
    assert r.status_code == 400 and "content parts" in r.json()["error"]["message"], r.text
    long = json.dumps({"max_tokens": 1, "messages": [{"role": "user", "content": "word " * ((2 << 20) // 5)}]})
    r = post_raw(client, long)
    assert r.status_code == 400 and "characters of text" in r.json()["error"]["message"], r.text
    assert engine.prompts.decodes == decodes


def test_the_engine_refuses_more_media_than_max_media_per_prompt(engine, monkeypatch, media_path):
    """A library user's request of 17 images (over ``EngineOptions.max_media_per_prompt``, 16):
    InvalidRequestError naming the option, raised before any image is opened."""
    from engine.errors import InvalidRequestError

    calls = _counting_decoders(monkeypatch)
    assert engine.options.max_media_per_prompt == 16
    photo = media_path("astronaut.png").read_bytes()
    messages = [{"role": "user", "content": [{"type": "image", "image": photo}] * 17 + [{"type": "text", "text": "?"}]}]
    with pytest.raises(InvalidRequestError, match="max_media_per_prompt"):
        engine.submit(messages)
    assert calls == {"image": 0, "video": 0}


def test_media_limit_settings(monkeypatch):
    """``--max-media-per-request`` / ``PRISM_MAX_MEDIA_PER_REQUEST`` reach the engine's option;
    without them the app's ``--max-images`` is the limit."""
    from app.settings import parse_settings

    assert parse_settings([], {}).engine_options()["max_media_per_prompt"] == 16
    assert parse_settings(["--max-images", "5"], {}).engine_options()["max_media_per_prompt"] == 5
    assert parse_settings([], {"PRISM_MAX_MEDIA_PER_REQUEST": "3"}).engine_options()["max_media_per_prompt"] == 3
    assert parse_settings(["--max-media-per-request", "7"], {}).media_per_request == 7


@pytest.fixture(scope="module")
def short_engine(tiny_engine_factory):
    return tiny_engine_factory(kv_cache_bytes=64 << 20, max_model_len=512)


def _blank_png(width: int, height: int) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(out, "PNG")
    return out.getvalue()


def test_a_prompt_too_long_by_its_headers_is_refused_before_decoding(short_engine, monkeypatch):
    """Attacker: 4 images of 2000x2000 pixels (small PNGs) for an engine of 512 tokens. Before,
    all were decoded and resized, then "leaves no room". Now refused from their headers: a
    RequestTooLargeError naming max_model_len, and no image opened."""
    from engine.errors import RequestTooLargeError

    calls = _counting_decoders(monkeypatch)
    big = _blank_png(2000, 2000)
    messages = [{"role": "user", "content": [{"type": "image", "image": big}] * 4 + [{"type": "text", "text": "?"}]}]
    with pytest.raises(RequestTooLargeError, match="max_model_len"):
        short_engine.submit(messages)
    assert calls == {"image": 0, "video": 0}


def test_the_header_count_is_a_lower_bound_of_the_real_one(short_engine, media_path):
    """The floor counted from headers never exceeds the visual tokens the processor makes
    (the oracle: the built prompt's own count), for photos of several shapes and the test clips."""
    prompts = short_engine.prompts
    for name in ("astronaut.png", "china.jpg", "logo.png", "page.png", "text.png"):
        data = media_path(name).read_bytes()
        built = prompts.build([{"role": "user", "content": [{"type": "image", "image": data}]}])
        assert 0 < prompts.visual_tokens_floor([data], []) <= built.num_visual_tokens, name
    for name in ("pan.mp4", "pan.gif"):
        data = media_path(name).read_bytes()
        built = prompts.build([{"role": "user", "content": [{"type": "video", "video": data}]}])
        assert 0 < prompts.visual_tokens_floor([], [(data, None)]) <= built.num_visual_tokens, name


def test_concurrent_requests_share_one_decode_budget(engine, monkeypatch, media_path):
    """Attacker: 6 image requests at once. The engine decodes at most ``max_concurrent_decodes``
    (2) prompts' media at a time, so their pixels cannot add up: the most decoders seen inside
    ``open_image`` together is 2, though all 6 threads were started before any finished (each
    decode waits on a barrier of 2, which only the budget's holders can reach)."""
    import threading

    from engine.inputs import processed_images

    assert engine.options.max_concurrent_decodes == 2
    real, lock, inside = processed_images.open_image, threading.Lock(), {"now": 0, "most": 0}
    pair = threading.Barrier(2, timeout=20)

    def watched(*args, **kwargs):
        with lock:
            inside["now"] += 1
            inside["most"] = max(inside["most"], inside["now"])
        try:
            pair.wait()  # two holders meet here; a third decoder at once would also pass through
            return real(*args, **kwargs)
        finally:
            with lock:
                inside["now"] -= 1

    monkeypatch.setattr(processed_images, "open_image", watched)
    photo = media_path("astronaut.png").read_bytes()
    errors = []

    def ask(i):
        try:
            engine.prompts.build([{"role": "user", "content": [{"type": "image", "image": photo}]}],
                                 salt=f"budget-{i}")
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and inside["most"] == 2, (errors, inside)
