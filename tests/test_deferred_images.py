"""Deferred image processing: a prompt about images its session sent before is built from the index
of known images (hash, grid, size) when their patches have left the processed-image cache, and the
patches are processed only if the prompt computes its prefix after all.

What this buys: a prefix hit, on the GPU or restored from the host tier, of a session whose pixels
were pushed out of the 256 MiB processed-image cache pays no decoding and pixel processing (on the
H200 at the 8B shape ~20 ms of 8 photos' ~25 ms host work). The tests check, with counters, that a
hit processes nothing, that a miss processes the deferred images and answers token for token as a
cold engine, that another session never builds from this session's index, and that a deferred
processing that fails fails only its own request.
"""

from __future__ import annotations

import time

import pytest
import torch
from PIL import Image

from engine import SamplingParams
from engine.errors import InvalidImageError
from engine.inputs.prompts import media_first_messages

SP = SamplingParams(max_tokens=6, ignore_eos=True)
EXACT = {"max_pixels": 256 * 256, "kv_cache_dtype": "auto", "debug_checks": True}


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Two photo files on disk (paths, as the app sends them)."""
    folder = tmp_path_factory.mktemp("deferred")
    paths = []
    for i, colour in enumerate(((200, 40, 40), (30, 90, 220))):
        image = Image.new("RGB", (96 + 16 * i, 64), colour)
        for x in range(0, image.width, 8):
            image.putpixel((x, x % image.height), (255, 255, 255))
        path = folder / f"photo{i}.png"
        image.save(path)
        paths.append(str(path))
    return paths


def no_pixel_cache(engine):
    """Keep no patches in the engine's processed-image cache (its index of known images stays):
    every image a session sent before is then deferred on the next prompt."""
    engine.prompts.images.cache_bytes = 0
    return engine


def counts(engine) -> tuple[int, int, int]:
    """(images processed, taken deferred, deferred ones processed later)."""
    images = engine.prompts.images
    return images.processed, images.deferred, images.deferred_processed


def test_a_deferred_prompt_equals_a_full_build_once_processed(tiny_engine_factory, photos):
    engine = no_pixel_cache(tiny_engine_factory(**EXACT))
    messages = media_first_messages(photos, "What is shown?")
    full = engine.prompts.build(messages, "s")
    assert full.deferred is None
    deferred = engine.prompts.build(messages, "s", defer=True)
    assert deferred.deferred is not None and deferred.image_pixels == [None, None]
    assert (deferred.input_ids, deferred.image_hashes, deferred.image_grids, deferred.image_keys) == (
        full.input_ids, full.image_hashes, full.image_grids, full.image_keys)
    with pytest.raises(ValueError, match="deferred"):
        _ = deferred.pixel_values
    deadline = time.monotonic() + 60
    while not deferred.deferred.poll() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert deferred.deferred.poll()
    assert torch.equal(deferred.pixel_values, full.pixel_values)


def test_defer_needs_the_same_session_and_a_known_image(tiny_engine_factory, photos):
    """The index is keyed by salt as the pixel cache is: another session (the attacker) processes
    the images itself, so neither its prompt nor its timing shows what this session sent."""
    engine = no_pixel_cache(tiny_engine_factory(**EXACT))
    messages = media_first_messages(photos[:1], "What is shown?")
    assert engine.prompts.build(messages, "owner", defer=True).deferred is None  # never seen: processed
    processed = counts(engine)[0]
    assert engine.prompts.build(messages, "attacker", defer=True).deferred is None
    assert counts(engine)[0] == processed + 1
    assert engine.prompts.build(messages, "owner", defer=True).deferred is not None
    engine.forget("owner")
    assert engine.prompts.build(messages, "owner", defer=True).deferred is None  # forget drops the index


def test_a_hit_processes_no_pixels_and_a_miss_processes_them_once(tiny_engine_factory, photos):
    engine = no_pixel_cache(tiny_engine_factory(**EXACT))
    cold = tiny_engine_factory(**EXACT).generate(media_first_messages(photos, "Describe them."), SP,
                                                 cache_salt="s")
    first = engine.generate(media_first_messages(photos, "What is shown?"), SP, cache_salt="s")
    assert first.telemetry.prefix_cache == "miss"
    before = counts(engine)
    hit = engine.generate(media_first_messages(photos, "Describe them."), SP, cache_salt="s")
    assert hit.telemetry.prefix_cache == "hit"
    assert counts(engine) == (before[0], before[1] + 2, before[2])  # both deferred, none processed
    assert hit.token_ids == cold.token_ids
    engine.clear_prefix_cache()
    again = engine.generate(media_first_messages(photos, "Describe them."), SP, cache_salt="s")
    # the session's vision features are still cached (the encoder does not run), but the
    # scheduler cannot know that: a prompt that computes gets its patches
    assert again.telemetry.prefix_cache == "miss" and again.telemetry.vision_encoder_ran is False
    assert counts(engine)[1:] == (before[1] + 4, before[2] + 2)  # processed now, when it computes
    assert again.token_ids == cold.token_ids
    assert engine.stats()["image_cache_deferred_processed"] == before[2] + 2


def test_a_warm_after_its_pixels_left_the_cache_computes_the_prefix(tiny_engine_factory, photos):
    engine = no_pixel_cache(tiny_engine_factory(**EXACT))
    engine.generate(media_first_messages(photos, "What is shown?"), SP, cache_salt="s")
    engine.clear_prefix_cache()
    assert engine.warm(photos, cache_salt="s").result(timeout=60) > 0
    assert counts(engine)[2] == 2
    hit = engine.generate(media_first_messages(photos, "Describe them."), SP, cache_salt="s")
    assert hit.telemetry.prefix_cache == "hit" and hit.telemetry.warmed


def test_a_failed_deferred_processing_fails_only_its_request(tiny_engine_factory, photos, monkeypatch):
    """The file of a deferred image is read again when its prompt computes: when it can no longer
    be used the request ends with the image error (the user reads why); a request beside it runs."""
    engine = no_pixel_cache(tiny_engine_factory(**EXACT))
    engine.generate(media_first_messages(photos, "What is shown?"), SP, cache_salt="s")
    engine.clear_prefix_cache()

    def unreadable(sources, salt):
        raise InvalidImageError("this image can no longer be read; upload it again")

    monkeypatch.setattr(engine.prompts, "_process_deferred", unreadable)
    failing = engine.submit(media_first_messages(photos, "Describe them."), SP, cache_salt="s")
    other = engine.submit([{"role": "user", "content": "Hello there"}], SP, cache_salt="t")
    with pytest.raises(InvalidImageError, match="upload it again"):
        failing.result()
    assert len(other.result().token_ids) == SP.max_tokens
    assert engine.stats()["pages_used"] == engine.stats()["cache_pages"]  # the failed one freed its pages


def test_count_prompt_tokens_processes_no_known_image(tiny_engine_factory, photos):
    engine = no_pixel_cache(tiny_engine_factory(**EXACT))
    engine.generate(media_first_messages(photos, "What is shown?"), SP, cache_salt="s")
    processed = counts(engine)[0]
    n = engine.count_prompt_tokens(media_first_messages(photos, "Describe them."), cache_salt="s")
    assert n == len(engine.prompts.build(media_first_messages(photos, "Describe them."), "x").input_ids)
    assert counts(engine)[0] == processed + 2  # only the build for another salt above processed
