"""Tests for sessions.store: sessions, content-addressed images, turns, share links, persistence."""

from __future__ import annotations

import hashlib
import re
import sqlite3
import struct
import threading
import zlib
from pathlib import Path

import pytest
from conftest import media_file

from engine.errors import InvalidImageError
from engine.inputs.images import ImageOptions
from sessions import (
    SCHEMA_VERSION,
    ImageRecord,
    LimitExceeded,
    NotFound,
    PermissionDenied,
    Session,
    SessionStore,
    StoreError,
)

pytestmark = pytest.mark.usefixtures("media_dir")  # a missing media folder fails, it does not skip


# ---------------------------------------------------------------------------------------------
# helpers


def media_bytes(name: str) -> bytes:
    return media_file(name).read_bytes()


@pytest.fixture(scope="module")
def photos() -> dict[str, bytes]:
    return {name: media_bytes(name) for name in ("astronaut.png", "coffee.png", "chelsea.png")}


@pytest.fixture
def store(tmp_path):
    s = SessionStore(tmp_path / "data")
    yield s
    s.close()


@pytest.fixture
def alice() -> str:
    return SessionStore.new_owner_key()


@pytest.fixture
def bob() -> str:
    return SessionStore.new_owner_key()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stored_files(store: SessionStore) -> list[Path]:
    return sorted(p for p in store.images_dir.rglob("*") if p.is_file())


def all_rows(db_path: Path) -> dict[str, list[tuple]]:
    with sqlite3.connect(db_path) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: conn.execute(f'SELECT * FROM "{t}"').fetchall() for t in tables}


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def bomb_png(width: int = 20000, height: int = 20000) -> bytes:
    """A tiny, well-formed PNG whose header claims ``width x height`` RGB pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


# ---------------------------------------------------------------------------------------------
# sessions


def test_create_list_get_rename_delete(store, alice):
    assert len(alice) >= 43  # token_urlsafe(32)
    first = store.create_session(alice)
    assert isinstance(first, Session)
    assert first.title == "New chat"
    assert first.owner_hash == hashlib.sha256(alice.encode()).hexdigest()  # the key itself is never stored
    assert first.image_shas == [] and first.forked_from is None
    assert re.fullmatch(r"[0-9a-f]{32}", first.cache_salt)  # 128 random bits, hex
    assert first.created_at == first.updated_at
    second = store.create_session(alice, "Holiday photos")
    assert second.id != first.id and second.cache_salt != first.cache_salt

    assert [s.id for s in store.list_sessions(alice)] == [second.id, first.id]
    renamed = store.rename_session(first.id, alice, "  Renamed\nchat\x00 ")
    assert renamed.title == "Renamed chat"
    assert renamed.updated_at > first.updated_at
    # Updating moves the session to the top.
    assert [s.id for s in store.list_sessions(alice)] == [first.id, second.id]
    assert store.rename_session(first.id, alice, "   ").title == "New chat"
    assert len(store.rename_session(first.id, alice, "x" * 1000).title) == 200

    got = store.get_session(second.id)
    assert got == second
    assert store.get_session(second.id, alice) == second
    assert store.get_session("no-such-id") is None

    store.delete_session(second.id, alice)
    assert store.get_session(second.id) is None
    assert [s.id for s in store.list_sessions(alice)] == [first.id]
    with pytest.raises(NotFound):
        store.delete_session(second.id, alice)
    with pytest.raises(NotFound):
        store.rename_session(second.id, alice, "gone")


def test_other_owner_cannot_touch(store, alice, bob, photos):
    session = store.create_session(alice, "Private")
    store.add_image(session.id, alice, photos["coffee.png"])
    assert store.list_sessions(bob) == []
    assert store.list_sessions("") == []
    assert store.get_session(session.id, bob) is None
    assert store.get_session(session.id, "") is None
    with pytest.raises(PermissionDenied):
        store.rename_session(session.id, bob, "mine now")
    with pytest.raises(PermissionDenied):
        store.delete_session(session.id, bob)
    with pytest.raises(PermissionDenied):
        store.add_image(session.id, bob, photos["astronaut.png"])
    with pytest.raises(PermissionDenied):
        store.remove_image(session.id, bob, sha(photos["coffee.png"]))
    with pytest.raises(PermissionDenied):
        store.create_share(session.id, bob, "read")
    with pytest.raises(PermissionDenied):
        store.list_shares(session.id, bob)
    with pytest.raises(PermissionDenied):
        store.delete_last_turn(session.id, bob)
    token, share = store.create_share(session.id, alice, "read")
    with pytest.raises(PermissionDenied):
        store.revoke_share(share.id, bob)
    assert store.resolve_share(token) == share  # still active
    assert [s.id for s in store.list_shares(session.id, alice)] == [share.id]
    # Nothing changed.
    unchanged = store.get_session(session.id, alice)
    assert unchanged.title == "Private" and unchanged.image_shas == [sha(photos["coffee.png"])]
    assert issubclass(PermissionDenied, StoreError) and issubclass(NotFound, StoreError)
    with pytest.raises(ValueError):
        store.create_session("")


# ---------------------------------------------------------------------------------------------
# images


def test_images_dedup_by_hash(store, alice, bob, photos):
    data = photos["astronaut.png"]
    digest = sha(data)
    one = store.create_session(alice)
    two = store.create_session(bob)
    record = store.add_image(one.id, alice, data, filename="astronaut.png")
    assert record == ImageRecord(digest, "astronaut.png", 512, 512, len(data), "image/png")
    again = store.add_image(two.id, bob, data, filename="C:\\fakepath\\../copy.png")
    assert again.sha256 == digest and again.filename == "copy.png"

    path = store.images_dir / digest[:2] / digest
    assert stored_files(store) == [path]
    assert path.read_bytes() == data
    assert store.image_path(digest) == path
    assert store.image_bytes(digest) == data
    info = store.image_info(digest)
    assert info is not None and (info.width, info.height, info.mime) == (512, 512, "image/png")

    store.delete_session(one.id, alice)
    assert path.is_file() and store.image_path(digest) == path
    store.delete_session(two.id, bob)
    assert not path.exists()
    assert stored_files(store) == []
    assert store.image_path(digest) is None and store.image_bytes(digest) is None
    rows = all_rows(store.db_path)
    assert rows["images"] == [] and rows["session_images"] == []


def test_ordered_images_remove_and_limits(tmp_path, alice, photos):
    store = SessionStore(tmp_path / "d", max_images_per_session=2)
    try:
        session = store.create_session(alice)
        a, c = photos["astronaut.png"], photos["coffee.png"]
        store.add_image(session.id, alice, c, "coffee.png")
        store.add_image(session.id, alice, a, "astronaut.png")
        # Adding the same image twice is a no-op returning the record (even at the limit).
        assert store.add_image(session.id, alice, c, "other-name.png").filename == "coffee.png"
        assert store.get_session(session.id).image_shas == [sha(c), sha(a)]
        assert [(r.filename, r.width, r.height) for r in store.list_images(session.id)] == [
            ("coffee.png", 600, 400),
            ("astronaut.png", 512, 512),
        ]
        assert store.has_image(session.id, sha(c)) and not store.has_image(session.id, sha(photos["chelsea.png"]))
        with pytest.raises(LimitExceeded):
            store.add_image(session.id, alice, photos["chelsea.png"])
        assert len(stored_files(store)) == 2  # the refused image was not stored

        store.remove_image(session.id, alice, sha(c))
        assert store.get_session(session.id).image_shas == [sha(a)]
        assert store.image_path(sha(c)) is None
        store.remove_image(session.id, alice, sha(c))  # no-op
        store.remove_image(session.id, alice, "../../etc/passwd")  # no-op
        store.add_image(session.id, alice, photos["chelsea.png"], "chelsea.png")
        assert [r.filename for r in store.list_images(session.id)] == ["astronaut.png", "chelsea.png"]
        assert store.list_images("no-such-session") == []
        with pytest.raises(NotFound):
            store.add_image("no-such-session", alice, a)
    finally:
        store.close()


@pytest.mark.parametrize("case", ["not_an_image", "truncated", "bomb", "too_many_bytes", "empty"])
def test_invalid_uploads_store_nothing(tmp_path, alice, photos, case):
    store = SessionStore(tmp_path / "d", image_options=ImageOptions(max_bytes=600_000))
    try:
        session = store.create_session(alice)
        data = {
            "not_an_image": b"%PDF-1.7\n" + b"hello world " * 100,
            "truncated": photos["coffee.png"][: len(photos["coffee.png"]) // 2],
            "bomb": bomb_png(20000, 20000),
            "too_many_bytes": photos["astronaut.png"],  # 791 KB > 600 KB
            "empty": b"",
        }[case]
        with pytest.raises(InvalidImageError) as info:
            store.add_image(session.id, alice, data, "upload.png")
        assert str(info.value)  # a message for the uploader
        rows = all_rows(store.db_path)
        assert rows["images"] == [] and rows["session_images"] == []
        assert stored_files(store) == []
        assert store.get_session(session.id).image_shas == []
        assert store.image_path(sha(data)) is None
    finally:
        store.close()


def test_image_path_refuses_anything_but_known_hashes(store, alice, photos):
    session = store.create_session(alice)
    record = store.add_image(session.id, alice, photos["chelsea.png"])
    assert store.image_path(record.sha256) is not None
    for bad in [
        "../../etc/passwd",
        "abc",
        "",
        record.sha256.upper(),
        record.sha256[:-1] + "g",
        record.sha256 + "\n",
        record.sha256[:2] + "/../" + record.sha256[6:],
        "/" + record.sha256[1:],
        "0" * 64,  # well-formed but unknown
        sha(b"unknown"),
        None,
        123,
    ]:
        assert store.image_path(bad) is None, bad
        assert store.image_bytes(bad) is None, bad
        assert store.image_info(bad) is None, bad


# ---------------------------------------------------------------------------------------------
# turns


def test_turns_add_finish_list_delete_last(store, alice, bob):
    session = store.create_session(alice)
    first = store.add_turn(session.id, "What is in the picture?")
    assert first.answer == "" and first.finished_at is None and first.telemetry == {}
    assert first.finish_reason is None and first.error is None
    telemetry = {"ttft_ms": 12.5, "vision_ms": 3, "tokens": [1, 2, 3], "nested": {"hit": True}, "none": None}
    done = store.finish_turn(first.id, "An astronaut.", telemetry, "stop")
    assert done.answer == "An astronaut." and done.telemetry == telemetry
    assert done.finish_reason == "stop" and done.finished_at >= done.created_at
    second = store.add_turn(session.id, "And the colours?")
    failed = store.finish_turn(second.id, "partial", {}, None, error="engine overloaded")
    assert failed.error == "engine overloaded"
    turns = store.list_turns(session.id)
    assert [t.id for t in turns] == [first.id, second.id]
    assert turns[0].telemetry == telemetry
    assert store.get_turn(first.id) == turns[0]
    assert store.list_turns("missing") == []
    with pytest.raises(NotFound):
        store.add_turn("missing", "hi")
    with pytest.raises(NotFound):
        store.finish_turn(10**9, "x", {}, "stop")
    with pytest.raises(TypeError):
        store.finish_turn(first.id, "x", ["not", "a", "dict"], "stop")

    with pytest.raises(PermissionDenied):
        store.delete_last_turn(session.id, bob)
    deleted = store.delete_last_turn(session.id, alice)
    assert deleted.id == second.id and deleted.answer == "partial"
    assert [t.id for t in store.list_turns(session.id)] == [first.id]
    assert store.delete_last_turn(session.id, alice).id == first.id
    assert store.delete_last_turn(session.id, alice) is None


def test_delete_turns_from_drops_that_turn_and_later_ones_only(store, alice, bob):
    """Editing (or asking again) from turn N deletes turn N and every later turn of that session,
    and nothing else. Turn ids come from the browser, so a turn of another session (even the
    caller's own), another owner's session, and ids that are negative, zero, huge, not an int or
    simply unknown are refused with NotFound / PermissionDenied, and nothing is deleted."""
    chat = store.create_session(alice, "chat")
    other = store.create_session(alice, "other chat")
    turns = [store.add_turn(chat.id, f"q{i}") for i in range(2)]
    elsewhere = store.add_turn(other.id, "other q")  # an id between this chat's turns
    turns += [store.add_turn(chat.id, f"q{i}") for i in range(2, 4)]
    ids = [t.id for t in turns]
    assert ids[1] < elsewhere.id < ids[2]
    for bad in (elsewhere.id, -1, 0, 2**63, 10**30, ids[-1] + 100, "3", 2.0, True, None):
        with pytest.raises(NotFound):
            store.delete_turns_from(chat.id, alice, bad)
    with pytest.raises(PermissionDenied):
        store.delete_turns_from(chat.id, bob, ids[1])
    with pytest.raises(NotFound):
        store.delete_turns_from("no-such-session", alice, ids[1])
    assert [t.id for t in store.list_turns(chat.id)] == ids and len(store.list_turns(other.id)) == 1
    dropped = store.delete_turns_from(chat.id, alice, ids[1])
    assert [t.question for t in dropped] == ["q1", "q2", "q3"]
    assert [t.id for t in store.list_turns(chat.id)] == [ids[0]]
    assert [t.id for t in store.list_turns(other.id)] == [elsewhere.id]
    with pytest.raises(NotFound):  # already gone
        store.delete_turns_from(chat.id, alice, ids[2])


def test_turns_bump_updated_at(store, alice):
    old = store.create_session(alice, "old")
    new = store.create_session(alice, "new")
    assert [s.title for s in store.list_sessions(alice)] == ["new", "old"]
    turn = store.add_turn(old.id, "q")
    assert [s.title for s in store.list_sessions(alice)] == ["old", "new"]
    store.rename_session(new.id, alice, "new")
    store.finish_turn(turn.id, "a", {}, "stop")
    assert [s.title for s in store.list_sessions(alice)] == ["old", "new"]
    assert store.get_session(new.id).updated_at > new.updated_at


# ---------------------------------------------------------------------------------------------
# shares and forks


def test_share_tokens(store, alice):
    session = store.create_session(alice)
    token, share = store.create_share(session.id, alice, "read")
    assert len(token) >= 32  # token_urlsafe(24): 192 bits
    assert share.mode == "read" and share.session_id == session.id and share.revoked_at is None
    token2, share2 = store.create_share(session.id, alice, "continue")
    assert token2 != token and share2.id != share.id

    # Only the hash is stored: neither the rows nor the database files contain the plain token.
    rows = repr(all_rows(store.db_path))
    assert token not in rows and token2 not in rows
    assert hashlib.sha256(token.encode()).hexdigest() in rows
    for path in store.data_dir.glob("prism.db*"):
        raw = path.read_bytes()
        assert token.encode() not in raw and token2.encode() not in raw

    assert store.resolve_share(token) == share
    assert store.resolve_share(token2) == share2
    assert store.resolve_share("x" * 32) is None
    assert store.resolve_share("") is None
    assert store.resolve_share(token + "x") is None
    assert store.resolve_share("y" * 10_000) is None
    assert store.resolve_share(None) is None
    assert [s.id for s in store.list_shares(session.id, alice)] == [share.id, share2.id]

    store.revoke_share(share.id, alice)
    assert store.resolve_share(token) is None
    assert store.resolve_share(token2) == share2
    store.revoke_share(share.id, alice)  # idempotent
    assert [s.id for s in store.list_shares(session.id, alice)] == [share2.id]
    listed = store.list_shares(session.id, alice, include_revoked=True)
    assert [s.id for s in listed] == [share.id, share2.id] and listed[0].revoked_at is not None
    with pytest.raises(NotFound):
        store.revoke_share("no-such-share", alice)
    with pytest.raises(ValueError):
        store.create_share(session.id, alice, "write")

    store.delete_session(session.id, alice)
    assert store.resolve_share(token2) is None


def test_fork_session(store, alice, bob, photos):
    session = store.create_session(alice, "Cats and coffee")
    store.add_image(session.id, alice, photos["chelsea.png"], "cat.png")
    store.add_image(session.id, alice, photos["coffee.png"], "coffee.png")
    t1 = store.add_turn(session.id, "Describe image 1")
    store.finish_turn(t1.id, "A cat.", {"ttft_ms": 5.0}, "stop")
    store.add_turn(session.id, "in progress")  # unfinished: not copied

    token, share = store.create_share(session.id, alice, "continue")
    resolved = store.resolve_share(token)
    fork = store.fork_session(resolved, bob)
    assert fork.id != session.id and fork.forked_from == session.id
    assert fork.owner_hash == hashlib.sha256(bob.encode()).hexdigest()
    assert fork.cache_salt == session.cache_salt
    assert fork.title == "Cats and coffee"
    assert fork.image_shas == [sha(photos["chelsea.png"]), sha(photos["coffee.png"])]
    assert [r.filename for r in store.list_images(fork.id)] == ["cat.png", "coffee.png"]
    copied = store.list_turns(fork.id)
    assert [(t.question, t.answer, t.telemetry, t.finish_reason) for t in copied] == [
        ("Describe image 1", "A cat.", {"ttft_ms": 5.0}, "stop")
    ]
    assert copied[0].id != t1.id
    assert [s.id for s in store.list_sessions(bob)] == [fork.id]
    assert len(stored_files(store)) == 2  # images shared, not copied

    # The fork is independent of the original.
    store.add_turn(fork.id, "Bob's question")
    assert len(store.list_turns(session.id)) == 2
    store.delete_session(session.id, alice)
    assert len(stored_files(store)) == 2
    assert all(store.image_path(s) is not None for s in fork.image_shas)
    with pytest.raises(NotFound):
        store.fork_session(resolved, bob)  # the share went with the original

    other = store.create_session(alice)
    read_token, read_share = store.create_share(other.id, alice, "read")
    with pytest.raises(PermissionDenied):
        store.fork_session(store.resolve_share(read_token), bob)
    _, cont = store.create_share(other.id, alice, "continue")
    store.revoke_share(cont.id, alice)
    with pytest.raises(NotFound):
        store.fork_session(cont, bob)  # a stale Share object of a revoked link
    with pytest.raises(NotFound):
        store.fork_session(store.resolve_share("unknown-token"), bob)


def test_an_image_file_goes_with_the_last_session_holding_it(store, alice, bob, photos):
    """Images are content-addressed and shared by forks and by other owners' uploads of the same
    bytes (issue 30.1): deleting or removing it from one holder keeps the file for the others;
    it goes when no session holds it."""
    cat = sha(photos["chelsea.png"])
    session = store.create_session(alice)
    store.add_image(session.id, alice, photos["chelsea.png"])
    token, _ = store.create_share(session.id, alice, "continue")
    fork = store.fork_session(store.resolve_share(token), bob)
    stranger = store.create_session(bob)
    store.add_image(stranger.id, bob, photos["chelsea.png"])  # the same bytes, uploaded on their own
    path = store.image_path(cat)

    store.delete_session(session.id, alice)
    assert path.is_file() and store.has_image(fork.id, cat)
    store.remove_image(fork.id, bob, cat)
    assert path.is_file() and store.image_path(cat) == path  # the stranger's session still holds it
    store.delete_session(stranger.id, bob)
    assert not path.exists() and store.image_path(cat) is None and stored_files(store) == []


def test_public_dict_hides_secrets(store, alice):
    session = store.create_session(alice, "Public view")
    public = session.to_public_dict()
    assert public["id"] == session.id and public["title"] == "Public view"
    assert "owner" not in public and "cache_salt" not in public
    assert alice not in repr(public) and session.cache_salt not in repr(public)


# ---------------------------------------------------------------------------------------------
# persistence, WAL, threads


def test_restart_persistence(tmp_path, alice, photos):
    data_dir = tmp_path / "data"
    store = SessionStore(data_dir)
    session = store.create_session(alice, "Persistent")
    store.add_image(session.id, alice, photos["astronaut.png"], "a.png")
    store.add_image(session.id, alice, photos["coffee.png"], "c.png")
    turn = store.add_turn(session.id, "q?")
    store.finish_turn(turn.id, "a!", {"decode_tokens_per_s": 41.5}, "stop")
    token, share = store.create_share(session.id, alice, "continue")
    before = (store.get_session(session.id), store.list_images(session.id), store.list_turns(session.id))
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreError):
        store.list_sessions(alice)

    with SessionStore(str(data_dir)) as reopened:
        assert reopened.schema_version == SCHEMA_VERSION
        assert reopened.list_sessions(alice) == [before[0]]
        assert reopened.list_images(session.id) == before[1]
        assert reopened.list_turns(session.id) == before[2]
        assert reopened.resolve_share(token) == share
        assert reopened.image_bytes(sha(photos["coffee.png"])) == photos["coffee.png"]
        later = reopened.create_session(alice)
        assert reopened.list_sessions(alice)[0].id == later.id


def test_wal_mode_and_schema_version(store):
    assert store.journal_mode == "wal"
    with sqlite3.connect(store.db_path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_newer_schema_is_refused(tmp_path):
    SessionStore(tmp_path / "d").close()
    with sqlite3.connect(tmp_path / "d" / "prism.db") as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match="newer"):
        SessionStore(tmp_path / "d")


def test_concurrent_threads(store, alice, photos):
    session = store.create_session(alice)
    errors: list[BaseException] = []
    per_thread = 25
    start = threading.Barrier(8)

    def worker(index: int) -> None:
        try:
            start.wait()
            for i in range(per_thread):
                turn = store.add_turn(session.id, f"t{index}-{i}")
                store.finish_turn(turn.id, f"a{index}-{i}", {"thread": index, "i": i}, "stop")
                store.list_turns(session.id)
                store.list_sessions(alice)
                if i == 0:
                    store.add_image(session.id, alice, photos["chelsea.png"])  # same image from every thread
        except BaseException as e:  # noqa: BLE001 - collected and re-raised below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    turns = store.list_turns(session.id)
    assert len(turns) == 8 * per_thread
    assert all(t.finished_at is not None and t.answer == "a" + t.question[1:] for t in turns)
    assert store.get_session(session.id).image_shas == [sha(photos["chelsea.png"])]
    assert len(stored_files(store)) == 1


def test_two_stores_on_one_directory(tmp_path, alice, photos):
    """Two stores (as two processes would) share the database and the image files safely."""
    one = SessionStore(tmp_path / "d")
    two = SessionStore(tmp_path / "d")
    try:
        a = one.create_session(alice)
        b = two.create_session(alice)
        one.add_image(a.id, alice, photos["coffee.png"])
        two.add_image(b.id, alice, photos["coffee.png"])
        assert {s.id for s in one.list_sessions(alice)} == {a.id, b.id}
        one.delete_session(a.id, alice)
        assert two.image_bytes(sha(photos["coffee.png"])) == photos["coffee.png"]
        errors: list[BaseException] = []

        def worker(s: SessionStore) -> None:
            try:
                for i in range(30):
                    t = s.add_turn(b.id, f"q{i}")
                    s.finish_turn(t.id, "a", {}, "stop")
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(s,)) for s in (one, two, one, two)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert len(two.list_turns(b.id)) == 120
    finally:
        one.close()
        two.close()


def test_collect_garbage(store, alice, photos):
    session = store.create_session(alice)
    record = store.add_image(session.id, alice, photos["coffee.png"])
    stray_dir = store.images_dir / "ab"
    stray_dir.mkdir()
    (stray_dir / ("ab" + "0" * 62)).write_bytes(b"orphan")
    (stray_dir / ".upload-x.tmp").write_bytes(b"partial")
    assert store.collect_garbage() == 2
    assert not stray_dir.exists()
    assert stored_files(store) == [store.image_path(record.sha256)]


def test_share_links_carry_the_owners_name_and_old_links_migrate_unnamed(tmp_path, alice):
    """Issue 31.6: a link can be named when created (whitespace runs made one space); bad names are
    refused before anything is stored; a schema-3 database's links come through migration 4 with
    no name and their tokens still resolve (tokens stay stored only as their SHA-256)."""
    import sqlite_utils

    from sessions import MAX_SHARE_NAME_LENGTH
    from sessions.keys import owner_hash, token_hash
    from sessions.migrations import _migration_1, _migration_2, _migration_3

    data_dir = tmp_path / "old"
    data_dir.mkdir()
    db = sqlite_utils.Database(str(data_dir / "prism.db"))
    for migration in (_migration_1, _migration_2, _migration_3):
        migration(db)
    db.execute("PRAGMA user_version = 3")
    db.execute("INSERT INTO sessions (id, owner_hash, title, cache_salt, created_at, updated_at) "
               "VALUES ('s1', ?, 'Old', 'salt', 1.0, 1.0)", [owner_hash(alice)])
    db.execute("INSERT INTO shares (id, session_id, token_hash, mode, created_at) VALUES "
               "('old-share', 's1', ?, 'read', 2.0)", [token_hash("old-token")])
    db.conn.commit()
    db.close()

    with SessionStore(str(data_dir)) as store:
        assert store.schema_version == SCHEMA_VERSION
        old = store.resolve_share("old-token")
        assert old is not None and (old.id, old.name, old.created_at) == ("old-share", "", 2.0)
        _, named = store.create_share("s1", alice, "read", "  for\n Alice\t ")
        _, plain = store.create_share("s1", alice, "read")
        assert named.name == "for Alice" and plain.name == ""
        assert [(s.id, s.name) for s in store.list_shares("s1", alice)] == [
            ("old-share", ""), (named.id, "for Alice"), (plain.id, "")]
        for bad in ("x" * (MAX_SHARE_NAME_LENGTH + 1), "bell\x07", None, 7, ["a"]):
            with pytest.raises(ValueError):
                store.create_share("s1", alice, "read", bad)
        assert len(store.list_shares("s1", alice)) == 3
        longest = "é" * MAX_SHARE_NAME_LENGTH
        assert store.create_share("s1", alice, "read", longest)[1].name == longest
        with sqlite3.connect(store.db_path) as conn:
            assert "for Alice" in [r[0] for r in conn.execute("SELECT name FROM shares")]
            assert all(len(r[0]) == 64 for r in conn.execute("SELECT token_hash FROM shares"))
