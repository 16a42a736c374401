"""Warms (``Engine.warm``): a session's image prefix built before its first question, and
concurrent first questions computing their prefix once.

Every answer is compared with a cold run of the same question on an engine without a prefix
cache (fp32, ``kv_cache_dtype="auto"``, no compaction: the exact settings), or, for concurrent
questions, with the same questions asked one after another (the issue's oracle). Counts (hits,
tokens computed, images processed) are read from the telemetry and ``Engine.stats()``, never from
wall-clock time.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
from PIL import Image

from engine import SamplingParams, media_first_messages
from engine.errors import (
    EngineOverloadedError,
    InvalidImageError,
    InvalidRequestError,
    PrismError,
    RequestTooLargeError,
)
from engine.serving.request import Status

SP = SamplingParams(max_tokens=6, ignore_eos=True)
EXACT = {"kv_cache_dtype": "auto", "compaction": None, "min_pixels": 32 * 32, "max_pixels": 96 * 96,
         "debug_checks": True}
WAIT_S = 60.0


def photos(*colours: str) -> list[Image.Image]:
    return [Image.new("RGB", (96, 80 - 16 * i), colour) for i, colour in enumerate(colours)]


@pytest.fixture(scope="module")
def cold(tiny_engine_factory):
    """The oracle: the same checkpoint without a prefix cache."""
    return tiny_engine_factory(**EXACT, prefix_cache=False)


def ask(engine, pics, question: str, salt: str):
    return engine.generate(media_first_messages(pics, question), SP, cache_salt=salt)


def prefix_len(engine, pics, salt: str) -> int:
    return engine.prompts.build(media_first_messages(pics, "any question"), salt).prefix_len


#: Tokens a step: a warm of three photos takes several steps.
STEP = 8


@contextlib.contextmanager
def mid_warm(engine, warm):
    """Hold the loop at a moment the warm has computed some of its prefix and has more than one
    step of it left: whatever is done meanwhile (submitting, cancelling) is seen before the step
    that would complete it (one step may be running while the loop's lock is free)."""
    req = warm.handle.request
    while True:
        with engine.loop.paused():
            if req.status is Status.FINISHED:
                raise AssertionError("the warm ended before the test could act in the middle of it")
            if req.num_computed > 0:
                assert warm.prefix_tokens - req.num_computed > STEP, "polled too late: the warm was nearly done"
                yield
                return
        time.sleep(0.0005)


def test_a_warmed_prefix_makes_the_first_question_a_hit_equal_to_a_cold_run(tiny_engine_factory, cold):
    engine = tiny_engine_factory(**EXACT)
    pics = photos("red", "teal")
    warm = engine.warm(pics, cache_salt="s")
    assert warm.result(WAIT_S) == prefix_len(engine, pics, "s") == warm.prefix_tokens
    stats = engine.stats()
    assert (stats["warms"], stats["warms_computed"], stats["cache_prefixes"]) == (1, 1, 1)
    assert stats["cache_hits"] == stats["cache_misses"] == 0  # a warm is neither

    first = ask(engine, pics, "What colour is the first picture?", "s")
    tel = first.telemetry
    assert (tel.prefix_cache, tel.warmed, tel.vision_encoder_ran) == ("hit", True, False)
    assert tel.computed_tokens == tel.prompt_tokens - warm.prefix_tokens  # only the question
    assert first.token_ids == ask(cold, pics, "What colour is the first picture?", "s").token_ids

    second = ask(engine, pics, "And the second?", "s")
    assert (second.telemetry.prefix_cache, second.telemetry.warmed) == ("hit", False)  # the first only
    assert second.token_ids == ask(cold, pics, "And the second?", "s").token_ids


def test_a_warm_is_per_session_and_with_its_system_message(tiny_engine_factory):
    engine = tiny_engine_factory(**EXACT)
    pics = photos("olive")
    engine.warm(pics, system="Be terse.", cache_salt="alice").result(WAIT_S)
    other = ask(engine, pics, "What is this?", "bob")  # another session: its own cold prefix
    assert (other.telemetry.prefix_cache, other.telemetry.warmed) == ("miss", False)
    plain = ask(engine, pics, "What is this?", "alice")  # no system message: another prefix
    assert plain.telemetry.prefix_cache == "miss"
    messages = media_first_messages(pics, "What is this?", system="Be terse.")
    done = engine.generate(messages, SP, cache_salt="alice")
    assert (done.telemetry.prefix_cache, done.telemetry.warmed) == ("hit", True)


def test_warming_a_cached_prefix_ends_at_once_and_computes_nothing(tiny_engine_factory):
    engine = tiny_engine_factory(**EXACT)
    pics = photos("navy", "gold")
    assert ask(engine, pics, "Describe them.", "s").telemetry.prefix_cache == "miss"
    steps = engine.stats()["steps"]
    warm = engine.warm(pics, cache_salt="s")
    assert warm.result(WAIT_S) == prefix_len(engine, pics, "s")
    stats = engine.stats()
    assert (stats["warms_cached"], stats["warms_computed"], stats["steps"]) == (1, 0, steps)
    later = ask(engine, pics, "Again?", "s")
    assert (later.telemetry.prefix_cache, later.telemetry.warmed) == ("hit", False)  # a question built it


def test_input_errors_are_raised_by_warm_itself(tiny_engine_factory, tiny_ckpt):
    engine = tiny_engine_factory(**EXACT)
    with pytest.raises(InvalidRequestError, match="nothing to warm"):
        engine.warm([], cache_salt="s")
    with pytest.raises(InvalidImageError):
        engine.warm([b"not an image at all"], cache_salt="s")
    with pytest.raises(InvalidRequestError, match="prefix cache is off"):
        tiny_engine_factory(**EXACT, prefix_cache=False).warm(photos("red"), cache_salt="s")
    small = tiny_engine_factory(**EXACT, max_model_len=40)
    with pytest.raises(RequestTooLargeError):
        small.warm(photos("red", "blue", "green"), cache_salt="s")  # ~3 x 20 tokens of images
    assert engine.stats()["warms"] == 0 and small.stats()["warms"] == 0  # nothing reached the loop


def test_a_question_sent_while_its_prefix_warms_joins_that_computation(tiny_engine_factory, cold):
    engine = tiny_engine_factory(**EXACT, max_num_batched_tokens=STEP)
    pics = photos("maroon", "lime", "navy")
    warm = engine.warm(pics, cache_salt="s")
    with mid_warm(engine, warm):
        handle = engine.submit(media_first_messages(pics, "Which colours?"), SP, cache_salt="s")
    done = handle.result(WAIT_S)
    assert warm.result(WAIT_S) == warm.prefix_tokens
    tel = done.telemetry
    assert (tel.prefix_cache, tel.warmed) == ("hit", True)
    assert tel.computed_tokens == tel.prompt_tokens - warm.prefix_tokens
    stats = engine.stats()
    assert (stats["warms_computed"], stats["cache_misses"], stats["cache_hits"]) == (1, 0, 1)
    assert done.token_ids == ask(cold, pics, "Which colours?", "s").token_ids


def test_eight_concurrent_first_questions_compute_the_prefix_once(tiny_engine_factory):
    """One miss and seven hits (a question that joined the computation in progress is a hit),
    every image processed once, the prefix prefilled once, and the answers those of the same
    questions asked one after another."""
    pics = photos("red", "teal", "plum")
    questions = [f"Question number {i}: what do you see?" for i in range(8)]
    one_by_one = tiny_engine_factory(**EXACT)
    expected = [ask(one_by_one, pics, q, "s").token_ids for q in questions]

    engine = tiny_engine_factory(**EXACT)
    encoded = engine._vision_counter.images
    start, out = threading.Barrier(8), [None] * 8

    def first_question(i: int) -> None:
        start.wait()
        out[i] = ask(engine, pics, questions[i], "s")

    threads = [threading.Thread(target=first_question, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    states = [c.telemetry.prefix_cache for c in out]
    assert sorted(states) == ["hit"] * 7 + ["miss"]
    assert engine.prompts.images.processed == len(pics)  # preprocessing once
    n = prefix_len(engine, pics, "s")
    computed = sum(c.telemetry.computed_tokens for c in out)
    assert computed == n + sum(c.telemetry.prompt_tokens - n for c in out)  # the prefix prefilled once
    assert engine._vision_counter.images - encoded == len(pics)  # encoded once (the encoder's own counter)
    assert [c.token_ids for c in out] == expected


def test_cancelling_a_warm_frees_its_pages(tiny_engine_factory):
    engine = tiny_engine_factory(**EXACT, max_num_batched_tokens=STEP)
    used = engine.stats()["pages_used"]
    warm = engine.warm(photos("coral", "khaki", "navy"), cache_salt="s")
    with mid_warm(engine, warm):
        warm.cancel(wait=False)
    with pytest.raises(PrismError, match="cancelled"):
        warm.result(WAIT_S)
    stats = engine.stats()
    assert (stats["pages_used"], stats["cache_prefixes"], stats["warms_cancelled"]) == (used, 0, 1)
    assert not engine.loop.scheduler.warming and not engine.loop.scheduler.running


def test_queued_warms_never_turn_a_question_away(tiny_engine_factory):
    """Questions and warms are bounded apart (``max_waiting`` each): a burst of uploads cannot
    make the engine refuse a question as overloaded."""
    engine = tiny_engine_factory(**EXACT, max_waiting=2)
    with engine.loop.paused():  # nothing leaves the inbox meanwhile
        warms = [engine.warm(photos(c), cache_salt=c) for c in ("red", "blue")]
        with pytest.raises(EngineOverloadedError):
            engine.warm(photos("green"), cache_salt="green")
        handle = engine.submit(media_first_messages(photos("red"), "What is it?"), SP, cache_salt="q")
    assert handle.result(WAIT_S).telemetry.prefix_cache == "miss"
    assert [w.result(WAIT_S) > 0 for w in warms] == [True, True]


def test_forget_cancels_the_sessions_warms_and_nothing_of_them_stays_cached(tiny_engine_factory):
    """A revoked share or a deleted chat forgets its salt: a warm of that salt still queued must
    not build the prefix after the forget (the next question would find it)."""
    engine = tiny_engine_factory(**EXACT)
    pics = photos("navy", "gold")
    with engine.loop.paused():  # the warm is still in the inbox when forget comes
        warm = engine.warm(pics, cache_salt="gone")
        kept = engine.warm(pics, cache_salt="stays")
        engine.forget("gone")  # waits (the loop's lock is let go while it does)
    with pytest.raises(PrismError, match="cancelled"):
        warm.result(WAIT_S)
    assert kept.result(WAIT_S) > 0
    assert ask(engine, pics, "Anything?", "gone").telemetry.prefix_cache == "miss"
    assert engine.stats()["warms_cancelled"] == 1


def test_the_warms_time_share_is_passed_to_the_scheduler_and_checked(tiny_engine_factory):
    engine = tiny_engine_factory(**EXACT, warm_time_share=0.5, max_warm_tokens=64, max_warm_images=2)
    config = engine.loop.scheduler.config
    assert (config.warm_time_share, config.max_warm_tokens, config.max_warm_images) == (0.5, 64, 2)
    assert engine.loop.scheduler.warm_budget.share == 0.5
    assert engine.stats()["warms_deferred_steps"] == 0
    for share in (0, 1.5):
        with pytest.raises(InvalidRequestError, match="warm_time_share"):
            tiny_engine_factory(**EXACT, warm_time_share=share)
