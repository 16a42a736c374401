"""The engine core in a child process (``engine.client.ProcessClient``) against the same engine in
this process: one real child, spawned once for the module, on the tiny "test" checkpoint.

The oracle is an in-process ``Engine.from_pretrained`` with the same options: greedy streams equal
token for token and delta for delta, cancels free the same pages, the caches answer alike, bad
input raises the same error types with the same messages. The crash test (kill -9 mid-stream, the
app restarting the core) is in tests/test_app_engine_process.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import random

import pytest
from conftest import TEST_DEVICE, noise_png

from engine import (
    Engine,
    EngineAbortedError,
    InvalidImageError,
    InvalidRequestError,
    RequestTooLargeError,
    SamplingParams,
    media_first_messages,
)
from engine.client import InProcessClient, KeyLRU, ProcessClient, send_blobs, take_blobs

OPTIONS = dict(device=TEST_DEVICE, progress=False, kv_cache_bytes=32 << 20)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def local(tiny_ckpt):
    engine = Engine.from_pretrained(tiny_ckpt, **OPTIONS)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def core(tiny_ckpt):
    client = ProcessClient(tiny_ckpt, **OPTIONS)
    yield client
    client.close()


class SentBytes:
    """Wraps a client's pipe and records the pickled size of each command sent to the child."""

    def __init__(self, conn):
        self.conn, self.sizes = conn, []

    def send(self, message):
        self.sizes.append((message[0], len(pickle.dumps(message))))
        self.conn.send(message)

    def __getattr__(self, name):
        return getattr(self.conn, name)


def test_the_child_is_another_process_with_the_engines_settings(core, local):
    assert core.pid != os.getpid()
    assert (core.model_id, core.device, core.dtype) == (local.model_id, local.device, local.dtype)
    # fields, not classes: on CUDA the test suite's engines carry a subclass of EngineOptions
    assert dataclasses.asdict(core.options) == dataclasses.asdict(local.options)
    assert core.min_image_pixels == local.prompts.size["shortest_edge"] > 0


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
def test_a_greedy_stream_equals_the_in_process_one_delta_for_delta(core, local, with_image):
    if with_image:
        messages = media_first_messages([noise_png(1)], "What is in the picture?")
    else:
        messages = [{"role": "user", "content": "Tell me a story."}]
    theirs = list(local.stream(messages, GREEDY, cache_salt="parity"))
    handle = core.submit(messages, GREEDY, cache_salt="parity")
    ours = list(handle)
    assert [d for d in ours if isinstance(d, str)] == [d for d in theirs if isinstance(d, str)]
    assert ours[-1].token_ids == theirs[-1].token_ids and len(ours[-1].token_ids) == GREEDY.max_tokens
    assert ours[-1].text == theirs[-1].text and ours[-1].prompt_token_ids == theirs[-1].prompt_token_ids
    assert handle.prompt_tokens == len(theirs[-1].prompt_token_ids)
    assert ours[-1].telemetry.prefix_cache == theirs[-1].telemetry.prefix_cache


def test_an_image_is_sent_once_then_named_by_its_key_and_the_second_question_hits(core):
    image = noise_png(2, size=(320, 240))
    messages = media_first_messages([image], "Describe it.")
    recorder = SentBytes(core._conn)
    core._conn = recorder
    try:
        first = core.generate(messages, GREEDY, cache_salt="once")
        second = core.generate(messages, GREEDY, cache_salt="once")
    finally:
        core._conn = recorder.conn
    submits = [size for kind, size in recorder.sizes if kind == "submit"]
    assert len(submits) == 2
    assert submits[0] > len(image) > 20 * submits[1]  # the bytes go once; then only the key
    assert (first.telemetry.prefix_cache, second.telemetry.prefix_cache) == ("miss", "hit")
    assert second.token_ids == first.token_ids


def test_a_warm_in_the_child_makes_the_first_question_a_warmed_hit(core, local):
    """``ProcessClient.warm``: the images cross once (the question then names them by key), the
    child builds the prefix, and the first question hits it, as in-process."""
    image = noise_png(5, size=(200, 160))
    recorder = SentBytes(core._conn)
    core._conn = recorder
    try:
        warm = core.warm([image], cache_salt="warm")
        assert warm.result(60) == warm.prefix_tokens > 0
        first = core.generate(media_first_messages([image], "Describe it."), GREEDY, cache_salt="warm")
    finally:
        core._conn = recorder.conn
    sizes = dict(recorder.sizes)
    assert sizes["warm"] > len(image) > 20 * sizes["submit"]
    assert (first.telemetry.prefix_cache, first.telemetry.warmed) == ("hit", True)
    assert first.token_ids == local.generate(media_first_messages([image], "Describe it."), GREEDY,
                                             cache_salt="warm-local").token_ids
    assert core.stats()["warms_computed"] >= 1
    with pytest.raises(InvalidRequestError, match="nothing to warm"):
        core.warm([], cache_salt="warm")  # the child's error, raised here as in-process


def test_another_session_sends_the_same_image_again(core):
    """Blob keys are per session (cache salt): the attacker's session asking about an image the
    victim's session sent gets no shortcut (its request carries the bytes again, so it is not
    faster for it), and the victim's next question still names its image by key."""
    image = noise_png(3, size=(320, 240))
    messages = media_first_messages([image], "Describe it.")
    recorder = SentBytes(core._conn)
    core._conn = recorder
    try:
        core.generate(messages, GREEDY, cache_salt="victim")
        core.generate(messages, GREEDY, cache_salt="attacker")
        core.generate(messages, GREEDY, cache_salt="victim")
    finally:
        core._conn = recorder.conn
    victim, attacker, again = [size for kind, size in recorder.sizes if kind == "submit"]
    assert victim > len(image) and attacker > len(image)  # both carried the bytes
    assert again * 20 < len(image)  # the victim's own second question: only the key


def test_cancel_frees_the_requests_pages(core):
    before = core.stats()["pages_used"]
    handle = core.submit([{"role": "user", "content": "Count to a thousand."}],
                         SamplingParams(max_tokens=400, temperature=0.0))
    items = iter(handle)
    assert isinstance(next(items), str)
    assert core.stats()["pages_used"] > before  # it holds pages while it runs
    core.cancel(handle, wait=True)
    assert core.stats()["pages_used"] == before
    rest = list(items)
    assert rest[-1].finish_reason == "cancelled" and len(rest[-1].token_ids) < 400


def test_stats_prefix_info_forget_and_clear_answer_as_in_process(core, local):
    image = noise_png(3)
    sha = hashlib.sha256(image).hexdigest()
    messages = media_first_messages([{"image": image, "sha256": sha}], "What is this?")
    for engine in (core, InProcessClient(local)):
        assert engine.prefix_info("salt-a", [sha]) is None
        assert engine.generate(messages, GREEDY, cache_salt="salt-a").telemetry.prefix_cache == "miss"
    assert core.prefix_info("salt-a", [sha]) == local.prefix_info("salt-a", [sha]) is not None
    assert core.prefix_info("salt-a", [sha], preview=True) == local.prefix_info("salt-a", [sha], preview=True)
    assert core.count_prompt_tokens(messages, cache_salt="salt-a") == local.count_prompt_tokens(messages,
                                                                                              cache_salt="salt-a")
    before = core.stats()
    forgotten = core.forget("salt-a")
    assert forgotten == local.forget("salt-a") and forgotten.sessions == 1 and forgotten.cache_entries >= 1
    after = core.stats()
    assert after["forgotten_sessions"] == before["forgotten_sessions"] + 1
    assert after["cache_entries"] == before["cache_entries"] - forgotten.cache_entries
    assert core.prefix_info("salt-a", [sha]) is None
    assert core.generate(messages, GREEDY, cache_salt="salt-a").telemetry.prefix_cache == "miss"
    assert core.stats()["cache_entries"] > 0
    core.clear_prefix_cache()
    assert core.stats()["cache_entries"] == 0
    assert core.generate(messages, GREEDY, cache_salt="salt-a").telemetry.prefix_cache == "miss"


@pytest.mark.parametrize(("messages", "sampling", "error"), [
    (media_first_messages([b"not an image at all"], "What?"), GREEDY, InvalidImageError),
    ([{"role": "robot", "content": "Hi"}], GREEDY, InvalidRequestError),
    ("just a string", GREEDY, InvalidRequestError),
    ([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=10**7), RequestTooLargeError),
], ids=["bad-image", "bad-role", "not-a-list", "too-long"])
def test_bad_input_raises_the_in_process_error_to_the_caller(core, local, messages, sampling, error):
    with pytest.raises(error) as theirs:
        local.submit(messages, sampling)
    with pytest.raises(error) as ours:
        core.submit(messages, sampling)
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)
    assert core.generate([{"role": "user", "content": "Still there?"}], GREEDY).finish_reason == "length"


def test_messages_that_cannot_be_sent_are_refused_as_invalid(core):
    with pytest.raises(InvalidRequestError, match="cannot be sent"):
        core.submit([{"role": "user", "content": [{"type": "text", "text": lambda: 0}]}], GREEDY)


def test_closing_stops_the_child_and_later_calls_refuse(tiny_ckpt):
    client = ProcessClient(tiny_ckpt, **OPTIONS)
    handle = client.submit([{"role": "user", "content": "Go on and on."}],
                           SamplingParams(max_tokens=400, temperature=0.0))
    items = iter(handle)
    assert isinstance(next(items), str)
    client.close()
    assert client._process.exitcode == 0 and not client.crashed
    with pytest.raises(ProcessLookupError):
        os.kill(client.pid, 0)
    with pytest.raises(Exception) as ended:  # the running request ends with an error, not a hang
        list(items)
    assert not isinstance(ended.value, EngineAbortedError)  # closed, not crashed
    with pytest.raises(Exception, match="closed"):
        client.stats()
    client.close()  # twice is harmless


# ------------------------------------------------------------------ images by content key, no process


def test_both_sides_keep_the_same_keys_and_every_reference_resolves():
    """Random requests over a few images through a budget of two or three images: the child never
    misses a key the parent left out, and every request gets back exactly its bytes."""
    rng = random.Random(0)
    images = [bytes([n]) * (100 + 10 * n) for n in range(6)]
    parent, child, blobs = KeyLRU(330), KeyLRU(330), {}
    for _ in range(300):
        chosen = [rng.choice(images) for _ in range(rng.randint(1, 4))]
        messages = [{"role": "user", "content": [{"type": "image", "image": b} for b in chosen]}]
        sent, new = send_blobs(messages, parent)
        resolved = take_blobs(pickle.loads(pickle.dumps(sent)), new, child, blobs)
        assert [p["image"] for p in resolved[0]["content"]] == chosen
        assert list(parent.sizes.items()) == list(child.sizes.items())
        assert set(blobs) == set(child.sizes) and child.total <= 330
    assert messages[0]["content"][0]["image"] == chosen[0]  # the caller's messages are untouched


def test_a_key_the_child_lost_is_reported_not_guessed():
    from engine.client import MissingBlob

    keys, message = KeyLRU(1000), [{"role": "user", "content": [{"type": "image", "image": b"abc"}]}]
    sent, new = send_blobs(message, keys)
    assert new == {hashlib.sha256(b"\0abc").hexdigest(): b"abc"}  # the empty salt, a NUL, the bytes
    with pytest.raises(MissingBlob):
        take_blobs(sent, {}, KeyLRU(1000), {})
    assert send_blobs(message, keys)[1] == {}  # held, as far as the parent knows
    assert send_blobs(message, keys, resend=True)[1] == new
