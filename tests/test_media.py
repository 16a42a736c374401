"""engine.media, the public face of upload validation (issue 32.6): the store validates an upload
with it, and the engine of the same process takes what that validation decoded instead of decoding
the same bytes again (counted: the decoders are wrapped, no timing). The hand-off is per salt,
taken once, checked against the engine's own limits, and yields the pixels decoding would.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
from conftest import CI, media_file, noise_png

from engine import media
from engine.errors import InvalidImageError
from engine.inputs import images as images_module
from engine.inputs import video as video_module
from engine.inputs.prompts import media_first_messages
from engine.inputs.uploads import UPLOADS, DecodedUploads
from sessions import SessionStore

#: The clip tests need PyAV, which the GPU machine lacks; under PRISM_CI=1 a missing PyAV fails instead.
needs_av = pytest.mark.skipif(not CI and importlib.util.find_spec("av") is None, reason="PyAV is not installed")

CLIP = media_file("pan.mp4")


@pytest.fixture
def decodes(monkeypatch):
    """Counts of pixel decodes: ``images`` (an image file's pixels, in open_image) and ``clips``
    (a clip's frames, in decode_video)."""
    counts = {"images": 0, "clips": 0}
    image_decode, clip_decode = images_module._decode, video_module._decode

    def count_image(*args, **kwargs):
        counts["images"] += 1
        return image_decode(*args, **kwargs)

    def count_clip(*args, **kwargs):
        counts["clips"] += 1
        return clip_decode(*args, **kwargs)

    monkeypatch.setattr(images_module, "_decode", count_image)
    monkeypatch.setattr(video_module, "_decode", count_clip)
    return counts


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(kv_cache_bytes=8 << 20)


@pytest.fixture
def store(tmp_path):
    s = SessionStore(tmp_path / "data")
    yield s
    s.close()


OWNER = SessionStore.new_owner_key()


def image_part(store, sha):
    return {"image": store.image_path(sha), "sha256": sha}


def test_an_uploaded_image_is_decoded_once_and_gives_the_pixels_decoding_would(engine, store, decodes):
    session = store.create_session(OWNER)
    data = noise_png(101, (96, 64))
    record = store.add_image(session.id, OWNER, data)
    assert decodes["images"] == 1 and record.sha256 == media.content_key(data)
    taken = UPLOADS.taken
    prompt = engine.prompts.build(media_first_messages([image_part(store, record.sha256)], "q"), session.cache_salt)
    assert decodes["images"] == 1, "the engine decoded the upload again"
    assert UPLOADS.taken == taken + 1
    # the oracle: the same bytes decoded by the engine under a salt that uploaded nothing
    fresh = engine.prompts.build(media_first_messages([image_part(store, record.sha256)], "q"), "another-session")
    assert decodes["images"] == 2
    assert prompt.input_ids == fresh.input_ids and prompt.image_hashes == fresh.image_hashes
    assert all((a == b).all() for a, b in zip(prompt.image_pixels, fresh.image_pixels, strict=True))


def test_another_session_never_takes_an_upload(engine, store, decodes):
    """Keyed by salt: a session that did not upload the bytes decodes them itself, and the
    uploader's question still takes its own."""
    mine, theirs = store.create_session(OWNER), store.create_session(OWNER)
    data = noise_png(102)
    sha = store.add_image(mine.id, OWNER, data).sha256
    store.add_image(theirs.id, OWNER, data)
    assert decodes["images"] == 2  # each upload validates (its time does not depend on the other)
    engine.prompts.build(media_first_messages([image_part(store, sha)], "q"), "a-third-salt")
    assert decodes["images"] == 3
    for session in (mine, theirs):
        engine.prompts.build(media_first_messages([image_part(store, sha)], "q"), session.cache_salt)
    assert decodes["images"] == 3


def test_the_engine_checks_its_own_limits_on_a_handed_over_image(tiny_engine_factory, store):
    """The store's limits were looser: the engine refuses the image it is handed, with the message
    opening it would give, rather than taking it on the store's word."""
    strict = tiny_engine_factory(kv_cache_bytes=4 << 20, max_image_pixels=2_000)
    session = store.create_session(OWNER)
    sha = store.add_image(session.id, OWNER, noise_png(103, (80, 60))).sha256  # 4,800 pixels
    with pytest.raises(InvalidImageError) as handed:
        strict.prompts.build(media_first_messages([image_part(store, sha)], "q"), session.cache_salt)
    with pytest.raises(InvalidImageError) as opened:
        strict.prompts.build(media_first_messages([image_part(store, sha)], "q"), "no-upload-here")
    assert str(handed.value) == str(opened.value) and "80 × 60" in str(handed.value)


@needs_av
def test_an_uploaded_clip_is_decoded_once(engine, store, decodes):
    assert engine.prompts.video_sampling == video_module.VideoSampling(), "the store samples as this checkpoint"
    session = store.create_session(OWNER)
    record = store.add_video(session.id, OWNER, CLIP.read_bytes())
    assert decodes["clips"] == 1
    video = {"video": store.image_path(record.sha256)}
    prompt = engine.prompts.build(media_first_messages([video], "q"), session.cache_salt)
    assert decodes["clips"] == 1, "the engine decoded the clip again"
    fresh = engine.prompts.build(media_first_messages([video], "q"), "another-session")
    assert decodes["clips"] == 2
    assert prompt.input_ids == fresh.input_ids and prompt.video_hashes == fresh.video_hashes
    assert (prompt.pixel_values_videos == fresh.pixel_values_videos).all()


def test_forget_drops_the_salts_uploads(engine, store, decodes):
    session = store.create_session(OWNER)
    sha = store.add_image(session.id, OWNER, noise_png(104)).sha256
    engine.forget(session.cache_salt)
    engine.prompts.build(media_first_messages([image_part(store, sha)], "q"), session.cache_salt)
    assert decodes["images"] == 2


def test_nothing_is_kept_without_an_engine_and_the_bound_holds():
    uploads = DecodedUploads(max_bytes=100)
    assert not uploads.keep("salt", "k", "ns", object(), 10) and len(uploads) == 0
    uploads.attach()
    assert not uploads.keep("salt", "big", "ns", object(), 101)  # larger than the bound
    assert not uploads.keep("", "k", "ns", object(), 10)  # the anonymous salt is everyone's
    for i in range(3):
        assert uploads.keep("salt", f"k{i}", "ns", i, 40)
    assert len(uploads) == 2 and uploads.take("salt", "k0", "ns") is None  # least recently kept went
    assert uploads.take("salt", "k1", "ns") == 1 and uploads.take("salt", "k1", "ns") is None  # once
    assert uploads.take("other", "k2", "ns") is None and uploads.take("salt", "k2", "other-ns") is None
    uploads.detach()
    assert len(uploads) == 0 and not uploads.keep("salt", "k", "ns", object(), 10)


@needs_av
def test_validate_reports_the_upload():
    data = noise_png(105, (40, 30))
    image = media.validate_image(data)
    assert (image.key, image.width, image.height, image.mime, image.kept) == (
        media.content_key(data), 40, 30, "image/png", False)
    clip = media.validate_clip(CLIP.read_bytes())
    assert (clip.width, clip.height, clip.mime) == (96, 64, "video/mp4") and clip.poster[:3] == b"\xff\xd8\xff"
    with pytest.raises(media.InvalidImageError):
        media.validate_image(data[:50])
    with pytest.raises(media.InvalidVideoError):
        media.validate_clip(CLIP.read_bytes()[:4000])


def test_the_unused_encoding_methods_are_deprecated(engine):
    prompt = engine.prompts.build(media_first_messages([noise_png(106)], "q"))
    with pytest.warns(DeprecationWarning, match="encode_prompt_vision"):
        features, _ = engine.encode_prompt_vision(prompt)
    with pytest.warns(DeprecationWarning, match="encode_items"):
        engine.encode_items(prompt, "", [("image", 0)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (engine.vision_features(prompt).embeds == features.embeds).all()


@needs_av
@pytest.mark.parametrize("limit", [dict(max_frames=100), dict(max_duration_s=5.0), dict(max_frame_pixels=5_000),
                                   dict(max_decode_pixels=1_000_000), dict(max_sampled_bytes=100_000)])
def test_a_clip_decoded_under_looser_limits_is_checked_as_decoding_would(limit):
    """``check_decoded`` refuses a clip the engine's limits refuse, with decode_video's message."""
    data = CLIP.read_bytes()
    decoded = video_module.decode_video(data)
    strict = video_module.VideoOptions(**limit)
    with pytest.raises(media.InvalidVideoError) as opened:
        video_module.decode_video(data, options=strict)
    with pytest.raises(media.InvalidVideoError) as checked:
        video_module.check_decoded(decoded, strict)
    assert str(checked.value) == str(opened.value)
    video_module.check_decoded(decoded, video_module.VideoOptions())  # the defaults take it


@needs_av
def test_the_chat_decodes_an_upload_once_from_upload_to_answer(engine, store, decodes):
    """Through the app: a photo and a clip uploaded with ``ChatService.add_images`` and asked about
    are decoded once each (at upload, by the store's validation), and the answer is a miss that
    ran the vision encoder on them. (Without prefix warming: the hand-off to the first question is
    what is pinned here; with warming the warm takes it, tests/test_app_warm.py.)"""
    from app.chat import ChatOptions, ChatService
    from app.model_loader import ModelChoice, ModelLoader

    chat = ChatService(store, ModelLoader.ready(engine, ModelChoice("tiny", "tiny", True, "test")),
                       max_upload_bytes=2 << 20, warming=False)
    session, problems = chat.add_images(None, OWNER, [("p.png", noise_png(107)), ("pan.mp4", CLIP.read_bytes())])
    assert problems == [] and (decodes["images"], decodes["clips"]) == (1, 1)
    *_, view = chat.ask(session.id, OWNER, "What is this?", ChatOptions(temperature=0.0, max_tokens=2))
    assert view.status == "done" and view.prefix == "miss" and view.telemetry["vision_encoder_ran"]
    assert (decodes["images"], decodes["clips"]) == (1, 1)
