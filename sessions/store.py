"""Persistent chat sessions, their images, turns and share links, in one data directory.

(A long module on purpose: it is the store's whole public API, thirty methods each documented for
the app; what they delegate to lives in the modules listed below.)

Layout of ``data_dir``::

    prism.db                      SQLite database (WAL mode), see :mod:`sessions.migrations` for the schema
    images/<sha[:2]>/<sha256>     uploaded image and video files, content-addressed by the SHA-256 of their bytes

:class:`SessionStore` is the facade: it holds the connection, the lock and the transactions, checks
ownership, and keeps the sessions, images and turns; it delegates to :mod:`sessions.records` (the
dataclasses, errors and row readers), :mod:`sessions.keys` (owner keys and token hashes),
:mod:`sessions.migrations` (the schema), :mod:`sessions.blobs` (the image files, their syncing and
garbage collection) and :mod:`sessions.shares` (share links and forks).

Design notes
------------

*Threading.* One SQLite connection (opened with ``check_same_thread=False``) is shared by every
thread and guarded by one re-entrant lock; every public method holds the lock for its whole
duration, database work and image-file work together. SQLite serialises writers anyway and every
operation here takes well under a millisecond (except writing a new image file), so a pool of
per-thread connections would buy little, while the single lock makes "is this image file still
referenced? then delete it" atomic with respect to a concurrent upload of the same bytes. Image
decoding (the slow part of an upload) runs *before* the lock is taken.

*Several processes* may open the same data directory: writes run in ``BEGIN IMMEDIATE``
transactions with a busy timeout, and image files are created and deleted inside those write
transactions, so reference counting stays right across processes too.

*Migrations.* The schema version lives in SQLite's ``PRAGMA user_version``. ``_MIGRATIONS[i]``
(:mod:`sessions.migrations`) upgrades version ``i`` to ``i + 1``; opening a store applies the
missing ones in one transaction.
A database written by a newer Prism (a higher version) is refused with :class:`StoreError`.

*Secrets.* Session ids, owner keys, cache salts and share tokens come from :mod:`secrets`. Only
the SHA-256 of a share token is stored; the plain token is returned once by
:meth:`SessionStore.create_share`. Owner keys are stored the same way, as their SHA-256
(``sessions.owner_hash``; schema 2 hashed the plain keys that schema 1 stored, so a browser keeps
its sessions): a copy of the database does not hand out the keys that open its sessions. Methods
take the plain key and hash it; one key is compared against one session in constant time.

*File modes.* The data folder and ``images/`` are created ``0700`` (an existing one with group or
other access is tightened when the store opens), the database and its WAL and shared-memory files
``0600``, image files ``0600``.
"""

from __future__ import annotations

import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import sqlite_utils

from engine.errors import InvalidImageError, InvalidVideoError
from engine.media import ImageOptions, VideoOptions, validate_clip, validate_image

from . import shares
from .blobs import BlobStore, private_dir, private_files
from .keys import check_owner, is_sha256, owner_hash, owns, token_hash
from .keys import new_owner_key as _new_owner_key
from .migrations import SCHEMA_VERSION, migrate
from .records import (
    DEFAULT_TITLE,
    MAX_FILENAME_LENGTH,
    MAX_SHARE_NAME_LENGTH,
    MAX_TITLE_LENGTH,
    MEDIA_COLUMNS,
    ImageRecord,
    LimitExceeded,
    NotFound,
    PermissionDenied,
    Session,
    Share,
    StoreError,
    Turn,
    clean_filename,
    clean_title,
    dump_telemetry,
    image_record,
    load_session,
    load_turn,
    session_from_row,
    session_row,
    turn_from_row,
)
from .shares import SHARE_MODES

__all__ = [
    "DB_FILENAME",
    "IMAGES_DIRNAME",
    "MAX_FILENAME_LENGTH",
    "MAX_SHARE_NAME_LENGTH",
    "MAX_TITLE_LENGTH",
    "SCHEMA_VERSION",
    "SHARE_MODES",
    "ImageRecord",
    "InvalidImageError",
    "InvalidVideoError",
    "LimitExceeded",
    "NotFound",
    "PermissionDenied",
    "Session",
    "SessionStore",
    "Share",
    "StoreError",
    "Turn",
    "private_dir",
]

DB_FILENAME = "prism.db"
IMAGES_DIRNAME = "images"
_BUSY_TIMEOUT_S = 30.0

# --------------------------------------------------------------------------------------------
# The store


class SessionStore:
    """Sessions, images, turns and share links, persisted in ``data_dir``.

    Safe to share between the threads of a web server (see the module docstring). Usable as a
    context manager (closes on exit).
    """

    def __init__(
        self,
        data_dir: Path | str,
        *,
        image_options: ImageOptions | None = None,
        max_images_per_session: int = 16,
        video_options: VideoOptions | None = None,
    ) -> None:
        """Open (creating if needed) the store in ``data_dir``.

        Creates ``data_dir``, ``data_dir/prism.db`` (WAL mode) and ``data_dir/images/``, and
        brings the schema up to :data:`SCHEMA_VERSION`.

        Args:
            data_dir: folder holding the database and the image files.
            image_options: limits applied to uploads by :meth:`add_image` (default
                ``ImageOptions()``).
            max_images_per_session: most images and video clips one session may hold (at least 1).
            video_options: limits applied to clips by :meth:`add_video` (default ``VideoOptions()``).

        Raises:
            ValueError: ``max_images_per_session`` is below 1.
            StoreError: the database was written by a newer Prism (unknown schema version).
            sqlite3.Error / OSError: the folder or database cannot be created or opened.
        """
        if int(max_images_per_session) < 1:
            raise ValueError(f"max_images_per_session must be at least 1, got {max_images_per_session}")
        self.data_dir = Path(data_dir)
        self.image_options = image_options if image_options is not None else ImageOptions()
        self.video_options = video_options if video_options is not None else VideoOptions()
        self.max_images_per_session = int(max_images_per_session)
        self.images_dir = self.data_dir / IMAGES_DIRNAME
        self.db_path = self.data_dir / DB_FILENAME
        for folder in (self.data_dir, self.images_dir):
            private_dir(folder)
        private_files(self.db_path)
        self._blobs = BlobStore(self.images_dir)
        self._lock = threading.RLock()
        self._last_time = 0.0
        conn = sqlite3.connect(str(self.db_path), timeout=_BUSY_TIMEOUT_S, check_same_thread=False)
        try:
            self._db: sqlite_utils.Database | None = sqlite_utils.Database(conn, execute_plugins=False)
            self._db.execute("PRAGMA foreign_keys = ON")
            self._db.enable_wal()
            self._db.execute("PRAGMA synchronous = NORMAL")
            self._db.execute("PRAGMA secure_delete = ON")  # deleted and replaced rows are zeroed in the file
            self._migrate()
        except BaseException:
            conn.close()
            raise

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the database connection. Idempotent; any later call raises :class:`StoreError`."""
        with self._lock:
            if self._db is not None:
                db, self._db = self._db, None
                db.close()

    def __enter__(self) -> SessionStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def schema_version(self) -> int:
        """The database's schema version (``PRAGMA user_version``)."""
        with self._read() as db:
            return int(db.execute("PRAGMA user_version").fetchone()[0])

    @property
    def journal_mode(self) -> str:
        """The database's journal mode (``"wal"``)."""
        with self._lock:
            return self._require_db().journal_mode

    def _require_db(self) -> sqlite_utils.Database:
        if self._db is None:
            raise StoreError("the session store is closed")
        return self._db

    def _migrate(self) -> None:
        with self._write() as db:
            version = migrate(db, self.db_path)
        if 0 < version < SCHEMA_VERSION:  # the old pages (plain owner keys) leave the files now, not later
            self._require_db().execute("PRAGMA wal_checkpoint(TRUNCATE)")

    @contextmanager
    def _write(self) -> Iterator[sqlite_utils.Database]:
        """Hold the lock and a ``BEGIN IMMEDIATE`` transaction; commit on success."""
        with self._lock:
            db = self._require_db()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.rollback()
                raise
            try:
                db.execute("COMMIT")
            except BaseException:
                db.rollback()
                raise

    @contextmanager
    def _read(self) -> Iterator[sqlite_utils.Database]:
        """Hold the lock and a read transaction (one consistent snapshot for several queries)."""
        with self._lock:
            db = self._require_db()
            db.execute("BEGIN")
            try:
                yield db
            finally:
                db.rollback()

    def _now(self) -> float:
        """``time.time()``, made strictly increasing within this store (stable orderings)."""
        now = time.time()
        if now <= self._last_time:
            now = self._last_time + 1e-6
        self._last_time = now
        return now

    # -- owners -------------------------------------------------------------------------------

    @staticmethod
    def new_owner_key() -> str:
        """Return a fresh random owner key (``secrets.token_urlsafe(32)``, 256 bits).

        The app gives one to each browser (for example in an HttpOnly cookie); it is a bearer
        credential for every session created with it.
        """
        return _new_owner_key()

    # -- sessions -----------------------------------------------------------------------------

    def create_session(self, owner: str, title: str = DEFAULT_TITLE) -> Session:
        """Create an empty session.

        Args:
            owner: the owner key.
            title: display title; control characters and runs of whitespace become one space,
                it is cut to :data:`MAX_TITLE_LENGTH` characters, and an empty title becomes
                ``"New chat"``.

        Returns:
            The new :class:`Session` (id ``secrets.token_urlsafe(12)``, a fresh random
            ``cache_salt``, no images).

        Raises:
            ValueError: ``owner`` is empty. TypeError: ``title`` is not a str.
        """
        check_owner(owner)
        title = clean_title(title)
        with self._write() as db:
            now = self._now()
            session_id = secrets.token_urlsafe(12)
            db.execute(
                "INSERT INTO sessions (id, owner_hash, title, cache_salt, created_at, updated_at, forked_from) "
                "VALUES (?, ?, ?, ?, ?, ?, NULL)",
                [session_id, owner_hash(owner), title, secrets.token_hex(16), now, now],
            )
            return load_session(db, session_id)

    def list_sessions(self, owner: str) -> list[Session]:
        """Return the owner's sessions, most recently updated first (``[]`` for an unknown owner)."""
        if not isinstance(owner, str) or not owner:
            return []
        with self._read() as db:
            rows = list(
                db.query(
                    "SELECT * FROM sessions WHERE owner_hash = ? ORDER BY updated_at DESC, created_at DESC, id",
                    [owner_hash(owner)],
                )
            )
            shas: dict[str, list[str]] = {row["id"]: [] for row in rows}
            videos: dict[str, set[str]] = {row["id"]: set() for row in rows}
            if rows:
                for link in db.query(
                    "SELECT si.session_id, si.sha256, i.kind FROM session_images si "
                    "JOIN sessions s ON s.id = si.session_id JOIN images i ON i.sha256 = si.sha256 "
                    "WHERE s.owner_hash = ? ORDER BY si.session_id, si.position",
                    [owner_hash(owner)],
                ):
                    shas[link["session_id"]].append(link["sha256"])
                    if link["kind"] == "video":
                        videos[link["session_id"]].add(link["sha256"])
            return [session_from_row(row, shas[row["id"]], videos[row["id"]]) for row in rows]

    def recent_sessions(self, limit: int) -> list[Session]:
        """Up to ``limit`` sessions holding at least one image or clip, of every owner, most
        recently updated first. For the server's own use (warming prefixes after a start,
        :meth:`app.chat.ChatService.warm_recent`), never for a page: it crosses owners."""
        limit = max(0, int(limit))
        with self._read() as db:
            ids = [row["id"] for row in db.query(
                "SELECT s.id FROM sessions s WHERE EXISTS (SELECT 1 FROM session_images si WHERE si.session_id = s.id) "
                "ORDER BY s.updated_at DESC, s.created_at DESC, s.id LIMIT ?", [limit])]
            sessions = [load_session(db, session_id) for session_id in ids]
        return [s for s in sessions if s is not None]

    def get_session(self, session_id: str, owner: str | None = None) -> Session | None:
        """Return the session, or ``None``.

        Args:
            session_id: the session id.
            owner: if given, the session is returned only when this owner key owns it.

        Returns:
            The :class:`Session`; ``None`` if it does not exist, or ``owner`` is given and does
            not own it.
        """
        if not isinstance(session_id, str):
            return None
        with self._read() as db:
            session = load_session(db, session_id)
        if session is None:
            return None
        if owner is not None and not owns(owner, session.owner_hash):
            return None
        return session

    def rename_session(self, session_id: str, owner: str, title: str) -> Session:
        """Change a session's title (cleaned as in :meth:`create_session`).

        Returns:
            The updated :class:`Session`.

        Raises:
            NotFound: no such session. PermissionDenied: ``owner`` does not own it.
            TypeError: ``title`` is not a str.
        """
        title = clean_title(title)
        with self._write() as db:
            self._owned(db, session_id, owner)
            db.execute(
                "UPDATE sessions SET title = ?, updated_at = ? WHERE id = ?", [title, self._now(), session_id]
            )
            return load_session(db, session_id)

    def delete_session(self, session_id: str, owner: str) -> None:
        """Delete a session with its turns, share links and image links.

        Image files (and their rows) that no other session references are deleted too.

        Raises:
            NotFound: no such session. PermissionDenied: ``owner`` does not own it.
        """
        with self._write() as db:
            self._owned(db, session_id, owner)
            shas = [r[0] for r in db.execute("SELECT sha256 FROM session_images WHERE session_id = ?", [session_id])]
            db.execute("DELETE FROM session_images WHERE session_id = ?", [session_id])
            db.execute("DELETE FROM turns WHERE session_id = ?", [session_id])
            db.execute("DELETE FROM shares WHERE session_id = ?", [session_id])
            db.execute("DELETE FROM sessions WHERE id = ?", [session_id])
            self._blobs.drop_unreferenced(db, shas)

    # -- images -------------------------------------------------------------------------------

    def add_image(self, session_id: str, owner: str, data: bytes, filename: str | None = None) -> ImageRecord:
        """Validate an uploaded image and append it to the session's images.

        The bytes are checked with :func:`engine.media.validate_image` (and this store's
        ``image_options``) before anything is stored; the decoded image is handed to an engine
        running in this process for the session's first question about it (under its
        ``cache_salt``), so the upload is decoded once. The file is content-addressed (SHA-256 of
        the bytes) and written atomically to ``images/<sha[:2]>/<sha>``; the same bytes
        uploaded again (to any session) share that one file, written again each time so that an
        upload takes as long whether or not another session holds the image. Adding an image the
        session already has is a no-op that returns its record (with the filename given the first
        time).

        Args:
            session_id: the session. owner: its owner key.
            data: the uploaded file (``bytes``, ``bytearray`` or ``memoryview``).
            filename: the uploader's file name, for display only (path components and control
                characters are dropped, cut to :data:`MAX_FILENAME_LENGTH` characters).

        Returns:
            The session's :class:`ImageRecord` for the image.

        Raises:
            InvalidImageError: not a usable image (message for the uploader); nothing is stored.
            LimitExceeded: the session already has ``max_images_per_session`` images.
            NotFound: no such session. PermissionDenied: ``owner`` does not own it.
            TypeError: ``data`` is not bytes-like.
        """
        data, filename, salt = self._upload(session_id, owner, data, filename)
        image = validate_image(data, self.image_options, salt=salt)  # raises InvalidImageError
        return self._attach(session_id, owner, data, filename, image.key, {
            "width": image.width, "height": image.height, "mime": image.mime, "kind": "image"})

    def _upload(self, session_id: str, owner: str, data, filename: str | None) -> tuple[bytes, str, str]:
        """An upload's bytes, cleaned file name and the session's cache salt, once ``owner`` is
        known to own the session: the cheap checks first, so a stranger's upload costs no decoding.

        Raises:
            TypeError: ``data`` is not bytes-like. NotFound, PermissionDenied: as :meth:`_owned`.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, not {type(data).__name__}")
        data, filename = bytes(data), clean_filename(filename)
        with self._read() as db:
            row = self._owned(db, session_id, owner)
        return data, filename, row["cache_salt"]

    def add_video(self, session_id: str, owner: str, data: bytes, filename: str | None = None) -> ImageRecord:
        """Validate an uploaded video clip (MP4, WebM) and append it to the session's media, as
        :meth:`add_image` does for an image (the same files, the same per-session count).

        The clip is decoded and sampled (:func:`engine.media.validate_clip`, this store's
        ``video_options``, Qwen3-VL's default sampling; the decoded clip handed on as
        :meth:`add_image` hands an image) before anything is stored: a truncated or
        over-long clip is refused at upload, not at the first question. Its duration and a poster
        (a JPEG of its first sampled frame) are stored with it.

        Raises:
            InvalidVideoError: not a usable clip (message for the uploader); nothing is stored.
            LimitExceeded, NotFound, PermissionDenied, TypeError: as :meth:`add_image`.
        """
        data, filename, salt = self._upload(session_id, owner, data, filename)
        clip = validate_clip(data, self.video_options, salt=salt)  # raises InvalidVideoError
        return self._attach(session_id, owner, data, filename, clip.key, {
            "width": clip.width, "height": clip.height, "mime": clip.mime,
            "kind": "video", "duration_s": clip.duration_s, "poster": clip.poster})

    def _attach(self, session_id: str, owner: str, data: bytes, filename: str | None, sha: str,
                row: dict) -> ImageRecord:
        """Store a validated file (``sha``: the SHA-256 of ``data``; ``row``: its ``images`` columns
        but the hash, size and time) and append it to the session, as :meth:`add_image` describes."""
        created_file = False
        try:
            with self._write() as db:
                self._owned(db, session_id, owner)  # it may have changed while decoding
                existing = image_record(db, session_id, sha)
                if existing is not None:
                    self._blobs.write(sha, data)  # restores a file lost outside Prism
                    return existing
                count = db.execute(
                    "SELECT count(*) FROM session_images WHERE session_id = ?", [session_id]
                ).fetchone()[0]
                if count >= self.max_images_per_session:
                    raise LimitExceeded(
                        f"A chat can hold at most {self.max_images_per_session} images and clips. "
                        "Remove one or start a new chat."
                    )
                now = self._now()
                created_file = self._blobs.write(sha, data)
                columns = {"sha256": sha, **row, "bytes": len(data), "created_at": now}
                db.execute(
                    f"INSERT OR IGNORE INTO images ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                    list(columns.values()),
                )
                position = db.execute(
                    "SELECT coalesce(max(position), -1) + 1 FROM session_images WHERE session_id = ?", [session_id]
                ).fetchone()[0]
                db.execute(
                    "INSERT INTO session_images (session_id, sha256, position, filename, added_at) "
                    "VALUES (?, ?, ?, ?, ?)",
                    [session_id, sha, position, filename, now],
                )
                db.execute("UPDATE sessions SET updated_at = ? WHERE id = ?", [now, session_id])
                return image_record(db, session_id, sha)
        except BaseException:
            if created_file:
                self._remove_file_if_unknown(sha)
            raise

    def remove_image(self, session_id: str, owner: str, sha256: str) -> None:
        """Remove an image from the session (the others keep their order).

        The file is deleted when no session references it any more. Removing an image the session
        does not have is a no-op.

        Raises:
            NotFound: no such session. PermissionDenied: ``owner`` does not own it.
        """
        with self._write() as db:
            self._owned(db, session_id, owner)
            if not is_sha256(sha256):
                return
            cursor = db.execute("DELETE FROM session_images WHERE session_id = ? AND sha256 = ?", [session_id, sha256])
            if cursor.rowcount:
                db.execute("UPDATE sessions SET updated_at = ? WHERE id = ?", [self._now(), session_id])
                self._blobs.drop_unreferenced(db, [sha256])

    def list_images(self, session_id: str) -> list[ImageRecord]:
        """Return the session's images in order (``[]`` for an unknown session).

        No ownership check: call it after :meth:`get_session` (owner) or :meth:`resolve_share`.
        """
        with self._read() as db:
            rows = db.query(
                f"SELECT {MEDIA_COLUMNS} FROM session_images si "
                "JOIN images i ON i.sha256 = si.sha256 WHERE si.session_id = ? ORDER BY si.position",
                [session_id],
            )
            return [ImageRecord(**row) for row in rows]

    def has_image(self, session_id: str, sha256: str) -> bool:
        """Whether the session holds the image (use before serving an image to a share visitor)."""
        if not is_sha256(sha256):
            return False
        with self._read() as db:
            row = db.execute(
                "SELECT 1 FROM session_images WHERE session_id = ? AND sha256 = ?", [session_id, sha256]
            ).fetchone()
            return row is not None

    def owner_has_image(self, owner: str, sha256: str) -> bool:
        """Whether a session of ``owner`` holds the image (check it before serving the image to
        that owner); False for an empty owner or a malformed hash."""
        if not is_sha256(sha256) or not isinstance(owner, str) or not owner:
            return False
        with self._read() as db:
            row = db.execute(
                "SELECT 1 FROM session_images si JOIN sessions s ON s.id = si.session_id "
                "WHERE s.owner_hash = ? AND si.sha256 = ? LIMIT 1", [owner_hash(owner), sha256]
            ).fetchone()
            return row is not None

    def image_info(self, sha256: str) -> ImageRecord | None:
        """The stored image's record (``filename`` is ``None``), or ``None`` if unknown/invalid."""
        if not is_sha256(sha256):
            return None
        with self._read() as db:
            rows = list(
                db.query("SELECT sha256, width, height, bytes, mime, kind, duration_s, poster FROM images "
                         "WHERE sha256 = ?", [sha256])
            )
            return ImageRecord(filename=None, **rows[0]) if rows else None

    def image_path(self, sha256: str) -> Path | None:
        """Path of a stored image file.

        Returns ``None`` unless ``sha256`` is exactly 64 lowercase hex digits, the database knows
        the image and its file exists. The path is built only from such a hash (no traversal).
        """
        if not is_sha256(sha256):
            return None
        with self._read() as db:
            known = db.execute("SELECT 1 FROM images WHERE sha256 = ?", [sha256]).fetchone() is not None
            if not known:
                return None
            path = self._blobs.path(sha256)
            return path if path.is_file() else None

    def image_bytes(self, sha256: str) -> bytes | None:
        """The stored image file's bytes, or ``None`` as for :meth:`image_path`."""
        with self._lock:
            path = self.image_path(sha256)
            if path is None:
                return None
            try:
                return path.read_bytes()
            except FileNotFoundError:
                return None

    # -- turns --------------------------------------------------------------------------------

    def add_turn(self, session_id: str, question: str) -> Turn:
        """Record a question whose answer is about to be generated.

        No ownership check (the app checks the owner, or a "continue" share has been forked).

        Returns:
            The new :class:`Turn` (``answer == ""``, ``finished_at is None``).

        Raises:
            NotFound: no such session. TypeError: ``question`` is not a str.
        """
        if not isinstance(question, str):
            raise TypeError(f"question must be a str, not {type(question).__name__}")
        with self._write() as db:
            if session_row(db, session_id) is None:
                raise NotFound("This chat does not exist (it may have been deleted).")
            now = self._now()
            cursor = db.execute(
                "INSERT INTO turns (session_id, question, answer, telemetry, created_at) VALUES (?, ?, '', '{}', ?)",
                [session_id, question, now],
            )
            db.execute("UPDATE sessions SET updated_at = ? WHERE id = ?", [now, session_id])
            return load_turn(db, cursor.lastrowid)

    def finish_turn(
        self,
        turn_id: int,
        answer: str,
        telemetry: dict,
        finish_reason: str | None,
        error: str | None = None,
    ) -> Turn:
        """Store a turn's answer (also for a failed or cancelled generation, with ``error``).

        Calling it again on a finished turn overwrites the answer.

        Args:
            turn_id: id from :meth:`add_turn`. answer: the generated text (possibly partial).
            telemetry: JSON-serialisable dict (numpy/torch scalars are converted, other unknown
                values stored as strings); ``None`` is stored as ``{}``.
            finish_reason: the engine's finish reason (``"stop"``, ``"length"``, ...) or ``None``.
            error: a message if generation failed.

        Returns:
            The updated :class:`Turn`.

        Raises:
            NotFound: no such turn (for example the session was deleted meanwhile).
            TypeError: ``telemetry`` is not a dict or ``answer`` not a str.
        """
        if not isinstance(answer, str):
            raise TypeError(f"answer must be a str, not {type(answer).__name__}")
        telemetry_json = dump_telemetry(telemetry)
        with self._write() as db:
            row = db.execute("SELECT session_id FROM turns WHERE id = ?", [int(turn_id)]).fetchone()
            if row is None:
                raise NotFound("This question no longer exists (the chat or the question was deleted).")
            now = self._now()
            db.execute(
                "UPDATE turns SET answer = ?, telemetry = ?, finish_reason = ?, error = ?, finished_at = ? "
                "WHERE id = ?",
                [answer, telemetry_json, finish_reason, error, now, int(turn_id)],
            )
            db.execute("UPDATE sessions SET updated_at = ? WHERE id = ?", [now, row[0]])
            return load_turn(db, int(turn_id))

    def list_turns(self, session_id: str) -> list[Turn]:
        """Return the session's turns, oldest first (``[]`` for an unknown session). No ownership check."""
        with self._read() as db:
            rows = db.query("SELECT * FROM turns WHERE session_id = ? ORDER BY id", [session_id])
            return [turn_from_row(row) for row in rows]

    def get_turn(self, turn_id: int) -> Turn | None:
        """Return one turn by id, or ``None``. No ownership check."""
        with self._read() as db:
            return load_turn(db, int(turn_id))

    def delete_last_turn(self, session_id: str, owner: str) -> Turn | None:
        """Delete the session's newest turn (for "Regenerate") and return it.

        Returns:
            The deleted :class:`Turn`, or ``None`` if the session has no turns.

        Raises:
            NotFound: no such session. PermissionDenied: ``owner`` does not own it.
        """
        with self._write() as db:
            self._owned(db, session_id, owner)
            rows = list(db.query("SELECT * FROM turns WHERE session_id = ? ORDER BY id DESC LIMIT 1", [session_id]))
            if not rows:
                return None
            db.execute("DELETE FROM turns WHERE id = ?", [rows[0]["id"]])
            db.execute("UPDATE sessions SET updated_at = ? WHERE id = ?", [self._now(), session_id])
            return turn_from_row(rows[0])

    def delete_turns_from(self, session_id: str, owner: str, turn_id: int) -> list[Turn]:
        """Delete turn ``turn_id`` and every later turn of the session (editing or asking again
        from that turn on); return them, oldest first.

        Raises:
            NotFound: no such session, or ``turn_id`` is not one of its turns (nothing deleted).
            PermissionDenied: ``owner`` does not own the session.
        """
        with self._write() as db:
            self._owned(db, session_id, owner)
            if not isinstance(turn_id, int) or isinstance(turn_id, bool) or not 0 < turn_id < 2**63:
                raise NotFound("This question is not part of this chat.")
            rows = list(db.query("SELECT * FROM turns WHERE session_id = ? AND id >= ? ORDER BY id",
                                 [session_id, turn_id]))
            if not rows or rows[0]["id"] != turn_id:
                raise NotFound("This question is not part of this chat.")
            db.execute("DELETE FROM turns WHERE session_id = ? AND id >= ?", [session_id, turn_id])
            db.execute("UPDATE sessions SET updated_at = ? WHERE id = ?", [self._now(), session_id])
            return [turn_from_row(row) for row in rows]

    # -- shares -------------------------------------------------------------------------------

    def create_share(self, session_id: str, owner: str, mode: str, name: str = "") -> tuple[str, Share]:
        """Create a share link for the session.

        Args:
            session_id: the session. owner: its owner key.
            mode: ``"read"`` (view only) or ``"continue"`` (the visitor may fork and continue).
            name: the owner's name for the link (shown in the share dialog only; whitespace runs
                become one space), at most ``MAX_SHARE_NAME_LENGTH`` characters.

        Returns:
            ``(token, share)``: the plain token (``secrets.token_urlsafe(24)``, 192 bits; shown
            once, only its SHA-256 is stored) and the :class:`Share`.

        Raises:
            ValueError: unknown ``mode``, or a bad ``name`` (not text, too long, control
                characters). NotFound: no such session. PermissionDenied: ``owner`` does not own it.
        """
        if mode not in SHARE_MODES:
            raise ValueError(f"share mode must be one of {SHARE_MODES}, got {mode!r}")
        name = shares.clean_name(name)
        with self._write() as db:
            self._owned(db, session_id, owner)
            return shares.create(db, session_id, mode, self._now, name)

    def resolve_share(self, token: str) -> Share | None:
        """Return the active share a token grants, or ``None`` (unknown, malformed or revoked).

        The token is looked up by its SHA-256, so timing reveals nothing useful about stored
        tokens.
        """
        if not shares.well_formed(token):
            return None
        digest = token_hash(token)
        with self._read() as db:
            return shares.resolve(db, digest)

    def list_shares(self, session_id: str, owner: str, *, include_revoked: bool = False) -> list[Share]:
        """Return the session's share links, oldest first.

        Args:
            include_revoked: also return revoked shares (with ``revoked_at`` set).

        Raises:
            NotFound: no such session. PermissionDenied: ``owner`` does not own it.
        """
        with self._read() as db:
            self._owned(db, session_id, owner)
            return shares.of_session(db, session_id, include_revoked)

    def revoke_share(self, share_id: str, owner: str) -> None:
        """Revoke a share link; its token stops resolving. Revoking twice is a no-op.

        Raises:
            NotFound: no such share. PermissionDenied: ``owner`` does not own its session.
        """
        with self._write() as db:
            self._owned(db, shares.session_of(db, share_id), owner)
            shares.revoke(db, share_id, self._now)

    def fork_session(self, share: Share, new_owner: str) -> Session:
        """Copy a shared session into a new session owned by ``new_owner``.

        The share is re-checked in the database (a revoked share cannot be used). The copy has the
        same title, the same images in the same order (and file names), the same ``cache_salt``
        (so its first question reuses the original's warm prefix cache), copies of the finished
        turns (a turn still being generated is not copied) and ``forked_from`` = the original id.

        Returns:
            The new :class:`Session`.

        Raises:
            PermissionDenied: the share is read-only. NotFound: ``share`` is ``None`` (an
            unresolved token), was revoked or deleted, or its session no longer exists.
            ValueError: ``new_owner`` is empty.
        """
        check_owner(new_owner)
        if share is None:
            raise NotFound("This share link is no longer valid.")
        with self._write() as db:
            return load_session(db, shares.fork(db, share, owner_hash(new_owner), self._now))

    # -- maintenance --------------------------------------------------------------------------

    def collect_garbage(self) -> int:
        """Delete leftovers of interrupted uploads; return how many files were removed.

        Removes temporary files in ``images/``, image files the database does not know, and image
        rows (with their files) that no session references. Safe to run at any time, for example
        at startup.
        """
        with self._write() as db:
            return self._blobs.collect_garbage(db)

    # -- internals ----------------------------------------------------------------------------

    def _remove_file_if_unknown(self, sha: str) -> None:
        """After a failed add_image: delete the file written for it unless the db knows the image."""
        with self._lock:
            with suppress(Exception):
                self._blobs.remove_if_unknown(self._require_db(), sha)

    def _owned(self, db: sqlite_utils.Database, session_id: str, owner: str) -> dict:
        row = session_row(db, session_id)
        if row is None:
            raise NotFound("This chat does not exist (it may have been deleted).")
        if not owns(owner, row["owner_hash"]):
            raise PermissionDenied("This chat belongs to someone else.")
        return row
