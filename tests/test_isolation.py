"""Issue 16 in the engine: what one session (cache salt) sends never changes what another gets,
neither its tokens nor its timing; PIL images are keyed on the pixels the model sees; an unset
``max_tokens`` generates up to the room the prompt leaves.

The attacker of these tests is another session of the same engine (in the app: another browser,
or an API client) that sends the victim's image X and watches its own prompt and telemetry: a
cache hit across salts shows as a faster ``preprocess_ms`` / time to first token, a vision
encoder that did not run, or cached tokens. No test times anything: they assert the counters of
each cache (``Engine.stats()``) and which path the vision encoder took.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from conftest import noise_png
from PIL import Image

from engine import InvalidRequestError, SamplingParams, media_first_messages
from engine.graphs.vision import VisionGraphs

GREEDY = SamplingParams(max_tokens=2, ignore_eos=True)


def counters(engine) -> dict:
    s = engine.stats()
    return {k: s[k] for k in ("image_cache_hits", "vision_cache_hits", "cache_hits")}


@pytest.fixture(scope="module")
def builder_engine(tiny_engine_factory):
    """An engine used for its PromptBuilder only (nothing is generated)."""
    return tiny_engine_factory(prefix_cache=False)


def fresh_builder(engine):
    from engine.inputs.prompts import PromptBuilder

    cfg = engine.config
    return PromptBuilder(engine.processor, image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
                         merge_size=cfg.vision.spatial_merge_size)


# ---------------------------------------------------------------------------------- item 1
def test_the_processed_image_cache_is_the_sessions_own(tiny_engine_factory):
    """Before the fix, an image another session had sent came out of the processed-image cache:
    the attacker's ``preprocess_ms`` (and TTFT) dropped from a fresh image's to ~2 ms. Now the
    attacker's request processes it again (no hit in any cache), while the victim's own next
    question still reuses its processed pixels, vision features and prefix."""
    engine = tiny_engine_factory()
    x = noise_png(1)
    engine.generate(media_first_messages([x], "What is this?"), GREEDY, cache_salt="victim")
    before = counters(engine)
    stolen = engine.generate(media_first_messages([x], "What is this?"), GREEDY, cache_salt="attacker")
    assert counters(engine) == before, "the attacker's request hit a cache filled by the victim"
    assert stolen.telemetry.cached_tokens == 0 and stolen.telemetry.vision_encoder_ran
    again = engine.generate(media_first_messages([x], "And now?"), GREEDY, cache_salt="victim")
    after = counters(engine)
    assert after["image_cache_hits"] == before["image_cache_hits"] + 1  # the counters do see hits
    assert after["cache_hits"] == before["cache_hits"] + 1 and again.telemetry.cached_tokens > 0
    # cache_scope="global" (single-user setups) ignores salts: there every cache is shared, by design
    shared_engine = tiny_engine_factory(cache_scope="global")
    shared_engine.generate(media_first_messages([x], "What is this?"), GREEDY, cache_salt="victim")
    before = counters(shared_engine)
    shared = shared_engine.generate(media_first_messages([x], "What is this?"), GREEDY, cache_salt="attacker")
    after = counters(shared_engine)
    assert after["image_cache_hits"] == before["image_cache_hits"] + 1
    assert after["cache_hits"] == before["cache_hits"] + 1 and shared.telemetry.cached_tokens > 0


def test_a_known_digest_is_trusted_only_in_the_session_that_processed_it(tiny_engine_factory, tmp_path):
    """A sha256 claim skips reading an image processed before, but only the same salt's. Before
    the fix an attacker who learned the digest of a victim's image could send it with a path to
    any other file and be answered about the victim's image; now the attacker's bytes are read
    and checked against the claim."""
    import hashlib

    engine = tiny_engine_factory(prefix_cache=False)
    victim, decoy = tmp_path / "victim.png", tmp_path / "decoy.png"
    victim.write_bytes(noise_png(3))
    decoy.write_bytes(noise_png(4))
    digest = hashlib.sha256(victim.read_bytes()).hexdigest()
    engine.generate(media_first_messages([{"image": victim, "sha256": digest}], "?"), GREEDY, cache_salt="victim")
    with pytest.raises(InvalidRequestError, match="sha256 does not match"):
        engine.generate(media_first_messages([{"image": decoy, "sha256": digest}], "?"), GREEDY,
                        cache_salt="attacker")
    hits = engine.stats()["image_cache_hits"]
    engine.generate(media_first_messages([{"image": decoy, "sha256": digest}], "?"), GREEDY, cache_salt="victim")
    assert engine.stats()["image_cache_hits"] == hits + 1  # taken on trust within the victim's session


class EagerStandIn(VisionGraphs):
    """The CPU stand-in for the CUDA parts: a "graph" is the grids it was made for, and "replay"
    runs the eager encoder. Everything else (which path a call takes) is the real VisionGraphs."""

    def _capture(self, grids, pixels):
        return grids, self.model.encode_vision(pixels, list(grids))

    def _replay(self, entry, pixels):
        return self.model.encode_vision(pixels, list(entry))


def test_vision_graphs_earned_by_one_session_do_not_speed_up_another(tiny_engine_factory):
    """A replayed vision graph runs several times faster than the eager encoder (host launch
    overhead), and graphs were keyed by image grids alone: an attacker whose first image of some
    size replayed learned that others had sent images of that size. Now each session goes
    eager -> capture -> replay on its own sightings, whatever other sessions did. The images are
    all different (the vision-feature cache never answers) and of one size (one grid)."""
    engine = tiny_engine_factory(prefix_cache=False)
    engine.vision.encoder = graphs = EagerStandIn(engine.model)
    images = [noise_png(10 + i) for i in range(6)]

    def paths(salt, batch):
        seen = []
        for image in batch:
            engine.generate(media_first_messages([image], "?"), GREEDY, cache_salt=salt)
            seen.append((graphs.captures, graphs.replays))
        return seen

    assert paths("victim", images[:3]) == [(0, 0), (1, 0), (1, 1)]  # eager, captured, replayed
    # the attacker's first image of that size runs eagerly (before the fix: replayed, (1, 2))
    assert paths("attacker", images[3:]) == [(1, 1), (2, 1), (2, 2)]
    assert engine.stats()["vision_cache_hits"] == 0


def test_vision_graph_scopes_without_an_engine(builder_engine):
    """The same property on VisionGraphs itself: calls of scope "b" take the paths a fresh
    VisionGraphs would give them (eager, capture, replay), after scope "a" earned a graph for the
    same grids; scope "a" still replays."""
    model = builder_engine.model
    prompt = builder_engine.prompts.build(media_first_messages([noise_png(20)], "?"))
    pixels, grids = prompt.pixel_values, prompt.image_grids
    graphs = EagerStandIn(model)
    for _ in range(3):
        graphs(pixels, grids, "a")
    assert (graphs.eager_runs, graphs.captures, graphs.replays) == (1, 1, 1)
    steps = []
    for _ in range(3):
        graphs(pixels, grids, "b")
        steps.append((graphs.eager_runs, graphs.captures, graphs.replays))
    assert steps == [(2, 1, 1), (2, 2, 1), (2, 2, 2)]
    graphs(pixels, grids, "a")
    assert graphs.replays == 3
    torch.testing.assert_close(graphs(pixels, grids, "b").embeds, model.encode_vision(pixels, grids).embeds)


# ---------------------------------------------------------------------------------- item 2
def palette_image(colour) -> Image.Image:
    """A 48x40 mode-P image whose indices draw stripes; index 1 has ``colour``."""
    im = Image.new("P", (48, 40), 0)
    im.putpalette([0, 0, 0, *colour] + [0, 0, 0] * 254)
    for x in range(0, 48, 4):
        for y in range(40):
            im.putpixel((x, y), 1)
    return im


def test_palette_images_are_keyed_on_their_colours(builder_engine):
    """Before the fix the ``pil:`` key hashed the palette indices, not the palette: a blue image
    with the red one's indices got the red one's pixels (in the attacker's session: the victim's
    image, answered as if it were the attacker's). The cold processing of the blue image is the
    oracle."""
    builder = fresh_builder(builder_engine)
    red, blue = palette_image((255, 0, 0)), palette_image((0, 0, 255))
    red_prompt = builder.build(media_first_messages([red], "?"))
    blue_prompt = builder.build(media_first_messages([blue], "?"))
    cold_blue = fresh_builder(builder_engine).build(media_first_messages([blue], "?"))
    assert blue_prompt.image_hashes == cold_blue.image_hashes != red_prompt.image_hashes
    torch.testing.assert_close(blue_prompt.image_pixels[0], cold_blue.image_pixels[0], rtol=0, atol=0)
    assert builder.cache_hits == 0


def oriented_jpeg(orientation: int) -> bytes:
    im = Image.new("RGB", (96, 48), (200, 30, 30))
    im.paste((20, 20, 220), (0, 0, 32, 48))
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    im.save(buf, format="JPEG", exif=exif.tobytes())
    return buf.getvalue()


def test_a_pil_image_with_an_exif_orientation_is_rotated_as_its_bytes_are(builder_engine):
    """A PIL JPEG with orientation 6 (stored sideways) must be rotated, as the same bytes are,
    even after an unrotated image with the very same stored pixels was processed: the old key
    (mode, size, raw pixels) gave it the unrotated one's grid and pixels."""
    builder = fresh_builder(builder_engine)
    data = oriented_jpeg(6)
    sideways = Image.open(io.BytesIO(data))
    sideways.load()
    upright = Image.frombytes(sideways.mode, sideways.size, sideways.tobytes())  # same pixels, no EXIF
    plain = builder.build(media_first_messages([upright], "?"))
    rotated = builder.build(media_first_messages([sideways], "?"))
    from_bytes = fresh_builder(builder_engine).build(media_first_messages([data], "?"))
    t, h, w = plain.image_grids[0]
    assert rotated.image_grids == from_bytes.image_grids == [(t, w, h)] and h != w
    assert rotated.image_hashes == from_bytes.image_hashes
    torch.testing.assert_close(rotated.image_pixels[0], from_bytes.image_pixels[0], rtol=0, atol=0)


def test_a_cached_entry_that_does_not_fit_the_image_is_processed_again(builder_engine):
    """On a hit the cached grid and size are checked against the image given: an entry that
    does not match (here planted with a wrong grid) is dropped and the image processed again."""
    builder = fresh_builder(builder_engine)
    image = Image.open(io.BytesIO(noise_png(30, (64, 96)))).convert("RGB")
    truth = builder.build(media_first_messages([image], "?"))
    ((key, entry),) = builder.images._processed.items()
    builder.images._processed[key] = dataclasses.replace(entry, grid=(1, entry.grid[2], entry.grid[1]))
    again = builder.build(media_first_messages([image], "?"))
    assert again.image_grids == truth.image_grids and again.input_ids == truth.input_ids
    assert builder.cache_mismatches == 1 and builder.cache_hits == 0
    assert builder.build(media_first_messages([image], "?")).image_grids == truth.image_grids
    assert builder.cache_hits == 1  # the re-processed entry is used from then on


def test_the_grid_check_agrees_with_the_processor(builder_engine):
    """``ProcessedImages.grid_for`` (the check above) predicts the processor's own grid for assorted sizes."""
    builder = fresh_builder(builder_engine)
    for size in ((8, 8), (640, 427), (33, 1000), (1000, 872), (300, 451)):
        image = Image.new("RGB", size, (10, 20, 30))
        assert builder.build(media_first_messages([image], "?")).image_grids == [builder.images.grid_for(size)]


# ---------------------------------------------------------------------------------- item 5
def test_an_unset_max_tokens_generates_up_to_the_room_left(tiny_engine_factory):
    """A prompt leaving less room than the default (256) failed with "max_tokens (256) ...
    exceeds" though the caller never asked for 256. Unset, it now generates up to the room left;
    an explicit value that does not fit still fails, naming the room."""
    engine = tiny_engine_factory(max_model_len=64)
    messages = [{"role": "user", "content": "Hi"}]
    room = 64 - engine.count_prompt_tokens(messages)
    done = engine.generate(messages, SamplingParams(max_tokens=None, ignore_eos=True))
    assert len(done.token_ids) == room and done.finish_reason == "length"
    assert len(engine.generate(messages, SamplingParams(ignore_eos=True)).token_ids) == room  # the default is unset
    capped = engine.generate(messages, SamplingParams(max_tokens=None, default_max_tokens=3, ignore_eos=True))
    assert len(capped.token_ids) == 3
    with pytest.raises(InvalidRequestError, match=f"at most {room} tokens"):
        engine.generate(messages, SamplingParams(max_tokens=room + 1))
    with pytest.raises(InvalidRequestError, match="leaves no room"):
        engine.generate([{"role": "user", "content": "Hi " * 80}], SamplingParams(max_tokens=None))
    # a prompt over the limit with an explicit max_tokens told the client to "ask for at most 0 tokens"
    with pytest.raises(InvalidRequestError, match="leaves no room") as refused:
        engine.generate([{"role": "user", "content": "Hi " * 80}], SamplingParams(max_tokens=2))
    assert "at most 0" not in str(refused.value) and "at most -" not in str(refused.value)
