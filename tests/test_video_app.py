"""Video clips in the app: the session store (schema 3, a clip's duration and poster, old databases
upgraded), uploads beside images, questions about a clip (prefix MISS then HIT), the video card,
the clip served to its owner and on a share page, and what an uploader of a bad clip sees."""

from __future__ import annotations

import io
import pathlib
import re

import pytest
from conftest import CI
from fastapi.testclient import TestClient
from PIL import Image

if not CI:  # under PRISM_CI=1 a missing PyAV is a failure, not a skip
    pytest.importorskip("av")

from app import render  # noqa: E402
from app.chat import ChatOptions, ChatService  # noqa: E402
from app.model_loader import ModelChoice, ModelLoader  # noqa: E402
from app.server import create_app  # noqa: E402
from app.settings import Settings  # noqa: E402
from sessions import SCHEMA_VERSION, LimitExceeded, SessionStore  # noqa: E402
from sessions.store import InvalidVideoError  # noqa: E402

MEDIA = pathlib.Path(__file__).resolve().parent / "media"
CLIP, GIF = MEDIA / "pan.mp4", MEDIA / "pan.gif"
FAST = ChatOptions(temperature=0.0, max_tokens=4)
OWNER = "v" * 43


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(kv_cache_bytes=64 << 20)


@pytest.fixture
def store(tmp_path):
    with SessionStore(tmp_path / "data", max_images_per_session=3) as s:
        yield s


@pytest.fixture
def chat(store, engine):
    """Without prefix warming: these tests pin the cold path (a clip's first question is a miss);
    tests/test_app_warm.py has the warmed one."""
    engine.clear_prefix_cache()
    return ChatService(store, ModelLoader.ready(engine, ModelChoice("tiny", "tiny", True, "test")),
                       max_upload_bytes=2 << 20, warming=False)


# ---------------------------------------------------------------------------------- the store
def test_a_clip_is_stored_with_its_duration_and_poster(store):
    session = store.create_session(OWNER)
    record = store.add_video(session.id, OWNER, CLIP.read_bytes(), filename="pan.mp4")
    assert (record.kind, record.mime, record.width, record.height) == ("video", "video/mp4", 96, 64)
    assert abs(record.duration_s - 8.008) < 1e-6 and record.is_video
    poster = Image.open(io.BytesIO(record.poster))
    assert poster.format == "JPEG" and poster.size == (96, 64)
    assert store.image_bytes(record.sha256) == CLIP.read_bytes()
    assert store.list_images(session.id) == [record]
    assert store.image_info(record.sha256).kind == "video"


def test_a_bad_clip_stores_nothing_and_says_why(store):
    session = store.create_session(OWNER)
    data = CLIP.read_bytes()
    for bad, why in ((data[: len(data) // 2], "truncated"), (data[:40], "no video frames"),
                     (b"\x00\x00\x00\x18ftypisom" + bytes(64), "not a video")):
        with pytest.raises(InvalidVideoError, match=why):
            store.add_video(session.id, OWNER, bad)
    assert store.list_images(session.id) == [] and not any((store.data_dir / "images").rglob("*/*"))


def test_clips_and_images_share_the_per_chat_limit(store, media_path):
    session = store.create_session(OWNER)
    store.add_video(session.id, OWNER, CLIP.read_bytes())
    store.add_image(session.id, OWNER, media_path("chelsea.png").read_bytes())
    store.add_image(session.id, OWNER, GIF.read_bytes())  # an animated GIF uploaded stays an image
    with pytest.raises(LimitExceeded, match="images and clips"):
        store.add_image(session.id, OWNER, media_path("coffee.png").read_bytes())
    assert [r.kind for r in store.list_images(session.id)] == ["video", "image", "image"]


def test_a_schema_2_database_is_upgraded_and_its_images_kept(tmp_path, media_path):
    """A data dir from before videos (schema 2): its sessions and images work after the upgrade,
    every image row becomes kind 'image', and a clip can be added beside them."""
    import sqlite_utils

    from sessions.keys import owner_hash
    from sessions.migrations import _migration_1, _migration_2

    data = tmp_path / "data"
    data.mkdir()
    png = media_path("chelsea.png").read_bytes()
    import hashlib

    sha = hashlib.sha256(png).hexdigest()
    db = sqlite_utils.Database(data / "prism.db")
    _migration_1(db)
    _migration_2(db)
    db.execute("INSERT INTO sessions VALUES ('old', ?, 'Old chat', 'salt', 1, 1, NULL)", [owner_hash(OWNER)])
    db.execute("INSERT INTO images VALUES (?, 451, 300, ?, 'image/png', 1)", [sha, len(png)])
    db.execute("INSERT INTO session_images VALUES ('old', ?, 0, 'chelsea.png', 1)", [sha])
    db.execute("PRAGMA user_version = 2")
    db.conn.commit()
    db.close()
    (data / "images" / sha[:2]).mkdir(parents=True)
    (data / "images" / sha[:2] / sha).write_bytes(png)
    with SessionStore(data) as store:
        assert store.schema_version == SCHEMA_VERSION and SCHEMA_VERSION >= 3
        [old] = store.list_images("old")
        assert (old.kind, old.duration_s, old.poster, old.filename) == ("image", None, None, "chelsea.png")
        assert store.get_session("old", OWNER).image_shas == [sha]
        store.add_video("old", OWNER, CLIP.read_bytes())
        assert [r.kind for r in store.list_images("old")] == ["image", "video"]


# ---------------------------------------------------------------------------------- the chat
def test_questions_about_a_clip_miss_then_hit(chat, engine, media_path):
    session, problems = chat.add_images(None, OWNER, [("pan.mp4", CLIP), ("chelsea.png", media_path("chelsea.png"))])
    assert problems == [] and len(session.image_shas) == 2
    _, first = chat_turn(chat, session, "What moves in the clip?")
    assert first.status == "done" and first.prefix == "miss" and first.telemetry["vision_encoder_ran"]
    _, second = chat_turn(chat, session, "And what colour is it?")
    assert second.prefix == "hit" and not second.telemetry["vision_encoder_ran"]
    assert second.telemetry["cached_tokens"] > 0
    # the prompt the engine saw: "Video 1: <16 sampled frames as 8 temporal patches>, Image 1: <photo>"
    video = {"video": chat.store.image_path(session.image_shas[0])}
    image = {"image": chat.store.image_path(session.image_shas[1])}
    from engine import media_first_messages

    prompt = engine.prompts.build(media_first_messages([video, image], "q"))
    assert [s.kind for s in prompt.spans] == ["video"] * 8 + ["image"]
    assert "Video 1: " in engine.processor.tokenizer.decode(prompt.input_ids)


def chat_turn(chat, session, question):
    views = list(chat.ask(session.id, OWNER, question, FAST))
    return views, views[-1]


def test_a_bad_clip_upload_is_explained_and_the_rest_stored(chat, media_path):
    data = CLIP.read_bytes()
    session, problems = chat.add_images(None, OWNER, [("cut.mp4", data[: len(data) // 2]),
                                                      ("chelsea.png", media_path("chelsea.png"))])
    assert len(problems) == 1 and problems[0].startswith("cut.mp4: ") and "truncated" in problems[0]
    assert [r.kind for r in chat.store.list_images(session.id)] == ["image"]


def test_a_file_named_like_a_clip_is_judged_as_a_clip(chat, media_path):
    """A damaged ``.mp4`` (no video header) was refused as "not an image Prism can read
    (supported: PNG, JPEG, ...)", which tells its uploader nothing about videos; it is now refused
    with the video reader's reason. A QuickTime file whose first box is not ``ftyp`` (older
    cameras write ``free`` or ``wide`` first) was refused the same way; it is now a clip. A picture
    renamed ``.mp4`` is still an image, and junk named ``.png`` is still "not an image"."""
    data = CLIP.read_bytes()
    no_ftyp = data[:4] + b"free" + data[8:]  # the ftyp box turned into padding: offsets unchanged
    session, problems = chat.add_images(None, OWNER, [("holiday.mp4", b"\x00junk" * 500),
                                                      ("old.MOV", no_ftyp),
                                                      ("cat.mp4", media_path("chelsea.png")),
                                                      ("junk.png", b"\x00junk" * 500)])
    assert len(problems) == 2, problems
    assert problems[0].startswith("holiday.mp4: ") and "not a video Prism can read" in problems[0]
    assert "not an image" not in problems[0]
    assert problems[1].startswith("junk.png: ") and "not an image Prism can read" in problems[1]
    records = chat.store.list_images(session.id)
    assert [(r.filename, r.kind) for r in records] == [("old.MOV", "video"), ("cat.mp4", "image")]
    assert abs(records[0].duration_s - 8.008) < 1e-6


# ---------------------------------------------------------------------------------- the page
def test_the_video_card_shows_its_duration_and_poster(store):
    session = store.create_session(OWNER)
    store.add_video(session.id, OWNER, CLIP.read_bytes(), filename="pan & <i>.mp4")
    html = render.images_strip(store.list_images(session.id))
    assert 'class="prism-image prism-video"' in html and "<b>Video 1</b> · 0:08" in html
    assert re.search(r'poster="data:image/jpeg;base64,[A-Za-z0-9+/=]{100,}"', html)
    assert 'preload="none"' in html and "pan &amp; &lt;i&gt;.mp4" in html and "<i>" not in html
    assert [render.duration_text(s) for s in (0.4, 8.008, 61, 3725)] == ["0:00", "0:08", "1:01", "1:02:05"]
    # the sidebar: a chat of one clip shows no broken thumbnail and counts the clip as a clip
    side = render.sessions_list(store.list_sessions(OWNER), session.id)
    assert "1 clip · " in side and "<img" not in side and store.get_session(session.id).video_shas


def test_the_sidebar_counts_images_and_clips(store, media_path):
    session = store.create_session(OWNER)
    store.add_video(session.id, OWNER, CLIP.read_bytes())
    image = store.add_image(session.id, OWNER, media_path("chelsea.png").read_bytes())
    side = render.sessions_list(store.list_sessions(OWNER), None)
    assert "1 image, 1 clip · " in side and f'src="/images/{image.sha256}"' in side


def test_the_clip_is_served_to_its_owner_and_on_its_share_page(tmp_path, engine):
    settings = Settings(data_dir=tmp_path / "data", max_upload_mb=2)
    store = SessionStore(settings.data_dir)
    loader = ModelLoader.ready(engine, ModelChoice("tiny", "tiny-test", False, "test"), settings)
    chat = ChatService(store, loader, max_upload_bytes=settings.max_upload_bytes)
    try:
        with TestClient(create_app(settings, store, loader, chat, mount_ui=False)) as client:
            owner = client.get("/healthz").cookies.get("prism_owner") or _cookie(client)
            session, _ = chat.add_images(None, owner, [("pan.mp4", CLIP)])
            sha = session.image_shas[0]
            r = client.get(f"/images/{sha}")
            assert r.status_code == 200 and r.headers["content-type"] == "video/mp4" and r.content == CLIP.read_bytes()
            assert TestClient(client.app).get(f"/images/{sha}").status_code == 404  # a stranger
            token, _ = store.create_share(session.id, owner, "read")
            page = TestClient(client.app).get(f"/s/{token}")
            assert page.status_code == 200 and "<b>Video 1</b> · 0:08" in page.text
            assert f'src="/s/{token}/images/{sha}"' in page.text
            assert TestClient(client.app).get(f"/s/{token}/images/{sha}").content == CLIP.read_bytes()
    finally:
        store.close()


def _cookie(client) -> str:
    return client.get("/").cookies.get("prism_owner")

