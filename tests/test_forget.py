"""``Engine.forget(cache_salt)``: a deleted chat (or a revoked share) leaves nothing behind in the
engine (issue 30.1).

The attacker here is whoever could learn from what a forgotten session left: the next request
under that salt (which would still hit its prefix, vision features or processed pixels), or the
memory it keeps. Nothing is timed: the tests read ``Engine.stats()``, each request's telemetry and
which path the vision encoder took.
"""

from __future__ import annotations

import pytest
from conftest import noise_png

from engine import Forgotten, InvalidRequestError, SamplingParams, media_first_messages
from engine.serving.outputs import Completion

GREEDY = SamplingParams(max_tokens=2, ignore_eos=True)


def ask(engine, image: bytes, question: str, salt: str):
    return engine.generate(media_first_messages([image], question), GREEDY, cache_salt=salt)


def completion_of(handle) -> Completion:
    """The request's completion (its deltas are skipped); raises what it failed with."""
    return handle.result(timeout=60)


def test_a_forgotten_session_starts_from_scratch_and_another_keeps_its_caches(tiny_engine_factory):
    """Before: deleting a chat left its prefix, vision features and processed pixels in the engine
    until evicted; the same salt's next question hit them. Now the forgotten salt's next question
    is a miss that processes the image and runs the vision encoder again, while another session
    holding the same image keeps its hit."""
    engine = tiny_engine_factory()
    x = noise_png(1)
    ask(engine, x, "What is this?", "victim")
    ask(engine, x, "What is this?", "other")
    warm = ask(engine, x, "And now?", "victim")
    assert warm.telemetry.prefix_cache == "hit" and not warm.telemetry.vision_encoder_ran
    before = engine.stats()
    # two salts, one image: 2 prefixes, 2 features, 2 processed images, and the turns kept for reuse
    assert (before["cache_prefixes"], before["vision_cache_entries"], before["image_cache_entries"]) == (2, 2, 2)
    victims = sum(e.salt == "victim" for e in engine.prefix_cache.entries)
    others = sum(e.salt == "other" for e in engine.prefix_cache.entries)
    assert victims >= 2 and others >= 1 and victims + others == before["cache_entries"]

    done = engine.forget("victim")

    assert done == Forgotten(sessions=1, cache_entries=victims, vision_features=1, processed_images=1)
    after = engine.stats()
    assert (after["cache_prefixes"], after["cache_entries"]) == (1, others)
    assert [e.salt for e in engine.prefix_cache.entries] == ["other"] * others
    assert (after["vision_cache_entries"], after["image_cache_entries"]) == (1, 1)
    assert after["pages_used"] < before["pages_used"]
    assert after["cache_evictions"] == before["cache_evictions"]  # forgetting is not eviction
    assert {k: after[k] for k in after if k.startswith("forgotten_")} == {
        "forgotten_sessions": 1, "forgotten_cache_entries": victims, "forgotten_vision_features": 1,
        "forgotten_processed_images": 1, "forgotten_decoded_videos": 0, "forgotten_vision_graphs": 0}

    again = ask(engine, x, "And now?", "victim")
    tel = again.telemetry
    assert tel.prefix_cache == "miss" and tel.cached_tokens == 0 and tel.vision_encoder_ran
    assert engine.stats()["image_cache_hits"] == after["image_cache_hits"]  # processed again
    kept = ask(engine, x, "And now?", "other")
    assert kept.telemetry.prefix_cache == "hit" and kept.telemetry.cached_tokens > 0
    assert not kept.telemetry.vision_encoder_ran


def test_forget_waits_for_the_salts_queued_and_running_requests(tiny_engine_factory):
    """A request of the salt still queued or running when forget is called finishes first (it is
    not cancelled) and what it computed is dropped with the rest: forget returns only after both
    requests finished, and nothing of the salt is cached then. (Had forget returned at once, the
    two requests would have cached their prefix, features and conversation after it.)"""
    engine = tiny_engine_factory(max_num_seqs=1)
    x = noise_png(2)
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    first = engine.submit(media_first_messages([x], "One?"), sampling, cache_salt="victim")
    second = engine.submit(media_first_messages([x], "Two?"), sampling, cache_salt="victim")

    done = engine.forget("victim")

    assert first.request.status.name == second.request.status.name == "FINISHED"
    for req in (first, second):
        finished = completion_of(req)
        assert finished.finish_reason == "length" and len(finished.token_ids) == 6
    stats = engine.stats()
    assert (stats["cache_entries"], stats["vision_cache_entries"], stats["image_cache_entries"]) == (0, 0, 0)
    assert stats["pages_used"] == 0
    # what the two had left: at least the prefix they computed, its features and processed image
    assert done.cache_entries >= 1 and done.vision_features == 1 and done.processed_images == 1


def test_forget_under_a_global_cache_scope_drops_nothing(tiny_engine_factory):
    """Under cache_scope="global" every cache is shared on purpose: no entry is one session's, so
    forgetting a salt drops nothing (the other user of the warm prefix still hits it)."""
    engine = tiny_engine_factory(cache_scope="global")
    x = noise_png(3)
    ask(engine, x, "What is this?", "victim")
    before = engine.stats()
    assert engine.forget("victim") == Forgotten()
    assert engine.stats() == before
    assert ask(engine, x, "What is this?", "other").telemetry.prefix_cache == "hit"


@pytest.mark.parametrize("salt", ["", None, 7])
def test_forget_refuses_what_is_not_a_sessions_salt(tiny_engine_factory, salt):
    """The empty salt is the anonymous session all unsalted requests share: not forgettable."""
    engine = tiny_engine_factory(prefix_cache=False)
    with pytest.raises(InvalidRequestError):
        engine.forget(salt)
