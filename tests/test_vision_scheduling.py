"""The vision encoder runs image by image as chunked prefill reaches each image, so a prompt with
many images does not stall the engine for all of its encoder work in one step."""

from __future__ import annotations

from engine import SamplingParams, media_first_messages

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def test_images_are_encoded_when_their_chunk_comes(tiny_engine_factory, media_path):
    photos = [media_path(n) for n in ("astronaut.png", "coffee.png", "page.png")]
    messages = media_first_messages(photos, "Compare them.")
    whole = tiny_engine_factory(kv_cache_dtype="auto", prefix_cache=False, max_pixels=128 * 128)
    chunked = tiny_engine_factory(kv_cache_dtype="auto", prefix_cache=False, max_pixels=128 * 128,
                                  max_num_batched_tokens=16)
    spans = chunked.prompts.build(messages).spans
    assert len(spans) == 3 and spans[0].end < spans[1].start  # each image starts in a later chunk

    calls = []
    real = chunked.loop.runner.encode_vision

    def record(prompt, salt, items):
        calls.append(list(items))
        return real(prompt, salt, items)

    chunked.loop.runner.encode_vision = record
    done = chunked.generate(messages, GREEDY)
    # one image per call, in prompt order, each encoded once (a later chunk of the same image reuses it)
    assert calls == [[("image", 0)], [("image", 1)], [("image", 2)]]
    assert done.telemetry.vision_encoder_ran and done.telemetry.vision_ms > 0
    # and the answer is the one computed with every image encoded up front
    assert done.token_ids == whole.generate(messages, GREEDY).token_ids
