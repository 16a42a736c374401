"""Persistent chat sessions, their images, turns and share links, in one data directory.

Layout of ``data_dir``::

    prism.db                      SQLite database (WAL mode), see ``_MIGRATIONS`` for the schema
    images/<sha[:2]>/<sha256>     uploaded image files, content-addressed by the SHA-256 of their bytes

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
upgrades version ``i`` to ``i + 1``; opening a store applies the missing ones in one transaction.
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

import hashlib
import hmac
import json
import os
import re
import secrets
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlite_utils

from engine.errors import InvalidImageError
from engine.images import ImageOptions, open_image, sniff_format

__all__ = [
    "DB_FILENAME",
    "IMAGES_DIRNAME",
    "MAX_FILENAME_LENGTH",
    "MAX_TITLE_LENGTH",
    "SCHEMA_VERSION",
    "SHARE_MODES",
    "ImageRecord",
    "InvalidImageError",
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
DEFAULT_TITLE = "New chat"
MAX_TITLE_LENGTH = 200
MAX_FILENAME_LENGTH = 255
#: Share modes: ``"read"`` shows the conversation; ``"continue"`` also lets the visitor fork it.
SHARE_MODES = ("read", "continue")
# Anything longer cannot be a token from create_share; refused before hashing.
_MAX_TOKEN_LENGTH = 256
_BUSY_TIMEOUT_S = 30.0

_SHA256_RE = re.compile(r"[0-9a-f]{64}")
# control characters, line/paragraph separators and lone surrogates (UTF-8 cannot store them)
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]+")


# --------------------------------------------------------------------------------------------
# Errors


class StoreError(Exception):
    """Base class of the errors :class:`SessionStore` raises on purpose."""


class NotFound(StoreError, LookupError):
    """The session, turn or share does not exist (or no longer exists)."""


class PermissionDenied(StoreError, PermissionError):
    """The caller's owner key does not own the session, or a read-only share was used to fork."""


class LimitExceeded(StoreError):
    """A per-session limit (such as the number of images) would be exceeded."""


# --------------------------------------------------------------------------------------------
# Records


@dataclass
class Session:
    """A chat session.

    ``image_shas`` lists the session's images in the order they were added (the order the model
    sees them). ``cache_salt`` is a server-chosen secret that namespaces the engine's prefix cache
    for this conversation; never show it to anyone, never accept one from a client.
    ``forked_from`` is the id of the session this one was forked from, if any. ``owner_hash`` is
    the SHA-256 (hex) of the owner key, never the key itself.
    """

    id: str
    owner_hash: str
    title: str
    cache_salt: str
    created_at: float
    updated_at: float
    image_shas: list[str]
    forked_from: str | None

    def to_public_dict(self) -> dict[str, Any]:
        """The fields safe to send to a browser, even a share visitor's: everything except
        ``owner_hash`` and ``cache_salt``."""
        return {
            "id": self.id,
            "title": self.title,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "image_shas": list(self.image_shas),
            "forked_from": self.forked_from,
        }


@dataclass
class ImageRecord:
    """An image attached to a session.

    ``width`` and ``height`` are the decoded size after EXIF orientation (what the model sees);
    ``bytes`` is the file size; ``mime`` its type (``image/png``, ``image/jpeg``, ...).
    ``filename`` is the display name the uploader gave in this session (``None`` if none); it is
    untrusted text, escape it before showing it.
    """

    sha256: str
    filename: str | None
    width: int
    height: int
    bytes: int
    mime: str


@dataclass
class Turn:
    """One question and its answer.

    While the answer is being generated ``answer`` is ``""`` and ``finished_at`` is ``None``.
    ``telemetry`` is the engine's telemetry dict (JSON round-tripped); ``error`` a message when
    generation failed.
    """

    id: int
    session_id: str
    question: str
    answer: str
    telemetry: dict
    finish_reason: str | None
    error: str | None
    created_at: float
    finished_at: float | None


@dataclass
class Share:
    """A share link of a session. ``mode`` is ``"read"`` or ``"continue"``.

    ``id`` identifies the share to its owner (for revoking); it is not a credential. The token that
    grants access is not stored, only its SHA-256.
    """

    id: str
    session_id: str
    mode: str
    created_at: float
    revoked_at: float | None


# --------------------------------------------------------------------------------------------
# Schema


def _migration_1(db: sqlite_utils.Database) -> None:
    statements = [
        """
        CREATE TABLE sessions (
            id          TEXT PRIMARY KEY,
            owner       TEXT NOT NULL,
            title       TEXT NOT NULL,
            cache_salt  TEXT NOT NULL,
            created_at  REAL NOT NULL,
            updated_at  REAL NOT NULL,
            forked_from TEXT
        )
        """,
        "CREATE INDEX sessions_owner_updated ON sessions (owner, updated_at DESC)",
        """
        CREATE TABLE images (
            sha256     TEXT PRIMARY KEY CHECK (length(sha256) = 64),
            width      INTEGER NOT NULL,
            height     INTEGER NOT NULL,
            bytes      INTEGER NOT NULL,
            mime       TEXT NOT NULL,
            created_at REAL NOT NULL
        )
        """,
        """
        CREATE TABLE session_images (
            session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
            sha256     TEXT NOT NULL REFERENCES images (sha256),
            position   INTEGER NOT NULL,
            filename   TEXT,
            added_at   REAL NOT NULL,
            PRIMARY KEY (session_id, sha256)
        )
        """,
        "CREATE INDEX session_images_sha ON session_images (sha256)",
        "CREATE INDEX session_images_order ON session_images (session_id, position)",
        """
        CREATE TABLE turns (
            id            INTEGER PRIMARY KEY AUTOINCREMENT,
            session_id    TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
            question      TEXT NOT NULL,
            answer        TEXT NOT NULL DEFAULT '',
            telemetry     TEXT NOT NULL DEFAULT '{}',
            finish_reason TEXT,
            error         TEXT,
            created_at    REAL NOT NULL,
            finished_at   REAL
        )
        """,
        "CREATE INDEX turns_session ON turns (session_id, id)",
        """
        CREATE TABLE shares (
            id         TEXT PRIMARY KEY,
            session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
            token_hash TEXT NOT NULL UNIQUE,
            mode       TEXT NOT NULL CHECK (mode IN ('read', 'continue')),
            created_at REAL NOT NULL,
            revoked_at REAL
        )
        """,
        "CREATE INDEX shares_session ON shares (session_id, created_at)",
    ]
    for sql in statements:
        db.execute(sql)


def _migration_2(db: sqlite_utils.Database) -> None:
    """Owner keys stored as their SHA-256, like share tokens (``owner`` becomes ``owner_hash``)."""
    db.execute("ALTER TABLE sessions RENAME COLUMN owner TO owner_hash")
    for session_id, owner in db.execute("SELECT id, owner_hash FROM sessions").fetchall():
        db.execute("UPDATE sessions SET owner_hash = ? WHERE id = ?", [_owner_hash(owner), session_id])


#: ``_MIGRATIONS[i]`` takes the schema from version ``i`` to ``i + 1``. Append, never edit.
_MIGRATIONS = [_migration_1, _migration_2]
SCHEMA_VERSION = len(_MIGRATIONS)


# --------------------------------------------------------------------------------------------
# Helpers


def _is_sha256(value: object) -> bool:
    return isinstance(value, str) and _SHA256_RE.fullmatch(value) is not None


def _same_key(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def _owner_hash(owner: str) -> str:
    """What the database holds of an owner key (keys are 256 random bits: a plain SHA-256 is enough)."""
    return _token_hash(owner)


def _owns(owner: object, owner_hash: str) -> bool:
    """Whether the owner key ``owner`` hashes to ``owner_hash`` (constant-time comparison)."""
    return isinstance(owner, str) and bool(owner) and _same_key(_owner_hash(owner), owner_hash)


def _clean_title(title: str) -> str:
    if not isinstance(title, str):
        raise TypeError(f"title must be a str, not {type(title).__name__}")
    text = " ".join(_CONTROL_RE.sub(" ", title).split())[:MAX_TITLE_LENGTH].rstrip()
    return text or DEFAULT_TITLE


def _clean_filename(filename: str | None) -> str | None:
    if filename is None:
        return None
    if not isinstance(filename, str):
        raise TypeError(f"filename must be a str or None, not {type(filename).__name__}")
    name = re.split(r"[\\/]", filename)[-1]  # browsers may send "C:\fakepath\x.png"
    name = _CONTROL_RE.sub(" ", name).strip()
    if name in ("", ".", ".."):
        return None
    return name[:MAX_FILENAME_LENGTH]


def _check_owner(owner: str) -> str:
    if not isinstance(owner, str) or not owner:
        raise ValueError("owner must be a non-empty string")
    return owner


_MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WebP": "image/webp",
         "TIFF": "image/tiff", "BMP": "image/bmp"}


def _sniff_mime(data: bytes) -> str:
    return _MIME.get(sniff_format(data), "application/octet-stream")


def _json_default(value: Any) -> Any:
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item):
        with suppress(Exception):
            return item()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def _dump_telemetry(telemetry: dict | None) -> str:
    if telemetry is None:
        return "{}"
    if not isinstance(telemetry, dict):
        raise TypeError(f"telemetry must be a dict, not {type(telemetry).__name__}")
    return json.dumps(telemetry, default=_json_default, ensure_ascii=False)


def private_dir(path: Path) -> None:
    """Create ``path`` (and its parents) with mode ``0700``, or take group and other access away
    from an existing one (a folder that is not ours is left as it is)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    with suppress(OSError):
        if path.stat().st_mode & 0o077:
            path.chmod(0o700)


def _private_files(db_path: Path) -> None:
    """Create the database file ``0600`` before SQLite does (its WAL and shared-memory files take
    the database's mode), and take group and other access from existing ones."""
    with suppress(FileExistsError):
        os.close(os.open(db_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    for path in (db_path, db_path.with_name(db_path.name + "-wal"), db_path.with_name(db_path.name + "-shm")):
        with suppress(OSError):
            if path.stat().st_mode & 0o077:
                path.chmod(0o600)


def _fsync_dir(path: Path) -> None:
    with suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
    ) -> None:
        """Open (creating if needed) the store in ``data_dir``.

        Creates ``data_dir``, ``data_dir/prism.db`` (WAL mode) and ``data_dir/images/``, and
        brings the schema up to :data:`SCHEMA_VERSION`.

        Args:
            data_dir: folder holding the database and the image files.
            image_options: limits applied to uploads by :meth:`add_image` (default
                ``ImageOptions()``).
            max_images_per_session: most images one session may hold (at least 1).

        Raises:
            ValueError: ``max_images_per_session`` is below 1.
            StoreError: the database was written by a newer Prism (unknown schema version).
            sqlite3.Error / OSError: the folder or database cannot be created or opened.
        """
        if int(max_images_per_session) < 1:
            raise ValueError(f"max_images_per_session must be at least 1, got {max_images_per_session}")
        self.data_dir = Path(data_dir)
        self.image_options = image_options if image_options is not None else ImageOptions()
        self.max_images_per_session = int(max_images_per_session)
        self.images_dir = self.data_dir / IMAGES_DIRNAME
        self.db_path = self.data_dir / DB_FILENAME
        for folder in (self.data_dir, self.images_dir):
            private_dir(folder)
        _private_files(self.db_path)
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
            version = int(db.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.db_path} has schema version {version}, newer than this Prism supports "
                    f"({SCHEMA_VERSION}); upgrade Prism or use another data directory"
                )
            for index in range(version, SCHEMA_VERSION):
                _MIGRATIONS[index](db)
                db.execute(f"PRAGMA user_version = {index + 1}")
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
        return secrets.token_urlsafe(32)

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
        _check_owner(owner)
        title = _clean_title(title)
        with self._write() as db:
            now = self._now()
            session_id = secrets.token_urlsafe(12)
            db.execute(
                "INSERT INTO sessions (id, owner_hash, title, cache_salt, created_at, updated_at, forked_from) "
                "VALUES (?, ?, ?, ?, ?, ?, NULL)",
                [session_id, _owner_hash(owner), title, secrets.token_hex(16), now, now],
            )
            return self._load_session(db, session_id)

    def list_sessions(self, owner: str) -> list[Session]:
        """Return the owner's sessions, most recently updated first (``[]`` for an unknown owner)."""
        if not isinstance(owner, str) or not owner:
            return []
        with self._read() as db:
            rows = list(
                db.query(
                    "SELECT * FROM sessions WHERE owner_hash = ? ORDER BY updated_at DESC, created_at DESC, id",
                    [_owner_hash(owner)],
                )
            )
            shas: dict[str, list[str]] = {row["id"]: [] for row in rows}
            if rows:
                for link in db.query(
                    "SELECT si.session_id, si.sha256 FROM session_images si "
                    "JOIN sessions s ON s.id = si.session_id WHERE s.owner_hash = ? "
                    "ORDER BY si.session_id, si.position",
                    [_owner_hash(owner)],
                ):
                    shas[link["session_id"]].append(link["sha256"])
            return [self._session_from_row(row, shas[row["id"]]) for row in rows]

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
            session = self._load_session(db, session_id)
        if session is None:
            return None
        if owner is not None and not _owns(owner, session.owner_hash):
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
        title = _clean_title(title)
        with self._write() as db:
            self._owned(db, session_id, owner)
            db.execute(
                "UPDATE sessions SET title = ?, updated_at = ? WHERE id = ?", [title, self._now(), session_id]
            )
            return self._load_session(db, session_id)

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
            self._drop_unreferenced(db, shas)

    # -- images -------------------------------------------------------------------------------

    def add_image(self, session_id: str, owner: str, data: bytes, filename: str | None = None) -> ImageRecord:
        """Validate an uploaded image and append it to the session's images.

        The bytes are checked with :func:`engine.images.open_image` (and this store's
        ``image_options``) before anything is stored. The file is content-addressed (SHA-256 of
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
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, not {type(data).__name__}")
        data = bytes(data)
        filename = _clean_filename(filename)
        # Cheap checks first, so a stranger's or an over-full session costs no decoding.
        with self._read() as db:
            self._owned(db, session_id, owner)
        image = open_image(data, self.image_options)  # raises InvalidImageError
        width, height = image.size
        image.close()
        sha = hashlib.sha256(data).hexdigest()
        mime = _sniff_mime(data)
        created_file = False
        try:
            with self._write() as db:
                self._owned(db, session_id, owner)  # it may have changed while decoding
                existing = self._image_record(db, session_id, sha)
                if existing is not None:
                    self._ensure_file(sha, data)  # restores a file lost outside Prism
                    return existing
                count = db.execute(
                    "SELECT count(*) FROM session_images WHERE session_id = ?", [session_id]
                ).fetchone()[0]
                if count >= self.max_images_per_session:
                    raise LimitExceeded(
                        f"A chat can hold at most {self.max_images_per_session} images. "
                        "Remove one or start a new chat."
                    )
                now = self._now()
                created_file = self._ensure_file(sha, data)
                db.execute(
                    "INSERT OR IGNORE INTO images (sha256, width, height, bytes, mime, created_at) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    [sha, width, height, len(data), mime, now],
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
                return self._image_record(db, session_id, sha)
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
            if not _is_sha256(sha256):
                return
            cursor = db.execute("DELETE FROM session_images WHERE session_id = ? AND sha256 = ?", [session_id, sha256])
            if cursor.rowcount:
                db.execute("UPDATE sessions SET updated_at = ? WHERE id = ?", [self._now(), session_id])
                self._drop_unreferenced(db, [sha256])

    def list_images(self, session_id: str) -> list[ImageRecord]:
        """Return the session's images in order (``[]`` for an unknown session).

        No ownership check: call it after :meth:`get_session` (owner) or :meth:`resolve_share`.
        """
        with self._read() as db:
            rows = db.query(
                "SELECT i.sha256, si.filename, i.width, i.height, i.bytes, i.mime FROM session_images si "
                "JOIN images i ON i.sha256 = si.sha256 WHERE si.session_id = ? ORDER BY si.position",
                [session_id],
            )
            return [ImageRecord(**row) for row in rows]

    def has_image(self, session_id: str, sha256: str) -> bool:
        """Whether the session holds the image (use before serving an image to a share visitor)."""
        if not _is_sha256(sha256):
            return False
        with self._read() as db:
            row = db.execute(
                "SELECT 1 FROM session_images WHERE session_id = ? AND sha256 = ?", [session_id, sha256]
            ).fetchone()
            return row is not None

    def owner_has_image(self, owner: str, sha256: str) -> bool:
        """Whether a session of ``owner`` holds the image (check it before serving the image to
        that owner); False for an empty owner or a malformed hash."""
        if not _is_sha256(sha256) or not isinstance(owner, str) or not owner:
            return False
        with self._read() as db:
            row = db.execute(
                "SELECT 1 FROM session_images si JOIN sessions s ON s.id = si.session_id "
                "WHERE s.owner_hash = ? AND si.sha256 = ? LIMIT 1", [_owner_hash(owner), sha256]
            ).fetchone()
            return row is not None

    def image_info(self, sha256: str) -> ImageRecord | None:
        """The stored image's record (``filename`` is ``None``), or ``None`` if unknown/invalid."""
        if not _is_sha256(sha256):
            return None
        with self._read() as db:
            rows = list(
                db.query("SELECT sha256, width, height, bytes, mime FROM images WHERE sha256 = ?", [sha256])
            )
            return ImageRecord(filename=None, **rows[0]) if rows else None

    def image_path(self, sha256: str) -> Path | None:
        """Path of a stored image file.

        Returns ``None`` unless ``sha256`` is exactly 64 lowercase hex digits, the database knows
        the image and its file exists. The path is built only from such a hash (no traversal).
        """
        if not _is_sha256(sha256):
            return None
        with self._read() as db:
            known = db.execute("SELECT 1 FROM images WHERE sha256 = ?", [sha256]).fetchone() is not None
            if not known:
                return None
            path = self._blob_path(sha256)
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
            if self._session_row(db, session_id) is None:
                raise NotFound("This chat does not exist (it may have been deleted).")
            now = self._now()
            cursor = db.execute(
                "INSERT INTO turns (session_id, question, answer, telemetry, created_at) VALUES (?, ?, '', '{}', ?)",
                [session_id, question, now],
            )
            db.execute("UPDATE sessions SET updated_at = ? WHERE id = ?", [now, session_id])
            return self._load_turn(db, cursor.lastrowid)

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
        telemetry_json = _dump_telemetry(telemetry)
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
            return self._load_turn(db, int(turn_id))

    def list_turns(self, session_id: str) -> list[Turn]:
        """Return the session's turns, oldest first (``[]`` for an unknown session). No ownership check."""
        with self._read() as db:
            rows = db.query("SELECT * FROM turns WHERE session_id = ? ORDER BY id", [session_id])
            return [self._turn_from_row(row) for row in rows]

    def get_turn(self, turn_id: int) -> Turn | None:
        """Return one turn by id, or ``None``. No ownership check."""
        with self._read() as db:
            return self._load_turn(db, int(turn_id))

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
            return self._turn_from_row(rows[0])

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
            return [self._turn_from_row(row) for row in rows]

    # -- shares -------------------------------------------------------------------------------

    def create_share(self, session_id: str, owner: str, mode: str) -> tuple[str, Share]:
        """Create a share link for the session.

        Args:
            session_id: the session. owner: its owner key.
            mode: ``"read"`` (view only) or ``"continue"`` (the visitor may fork and continue).

        Returns:
            ``(token, share)``: the plain token (``secrets.token_urlsafe(24)``, 192 bits; shown
            once, only its SHA-256 is stored) and the :class:`Share`.

        Raises:
            ValueError: unknown ``mode``. NotFound: no such session.
            PermissionDenied: ``owner`` does not own it.
        """
        if mode not in SHARE_MODES:
            raise ValueError(f"share mode must be one of {SHARE_MODES}, got {mode!r}")
        with self._write() as db:
            self._owned(db, session_id, owner)
            token = secrets.token_urlsafe(24)
            share_id = secrets.token_urlsafe(12)
            db.execute(
                "INSERT INTO shares (id, session_id, token_hash, mode, created_at, revoked_at) "
                "VALUES (?, ?, ?, ?, ?, NULL)",
                [share_id, session_id, _token_hash(token), mode, self._now()],
            )
            return token, self._load_share(db, share_id)

    def resolve_share(self, token: str) -> Share | None:
        """Return the active share a token grants, or ``None`` (unknown, malformed or revoked).

        The token is looked up by its SHA-256, so timing reveals nothing useful about stored
        tokens.
        """
        if not isinstance(token, str) or not token or len(token) > _MAX_TOKEN_LENGTH:
            return None
        digest = _token_hash(token)
        with self._read() as db:
            rows = list(
                db.query(
                    "SELECT id, session_id, mode, created_at, revoked_at FROM shares "
                    "WHERE token_hash = ? AND revoked_at IS NULL",
                    [digest],
                )
            )
            return Share(**rows[0]) if rows else None

    def list_shares(self, session_id: str, owner: str, *, include_revoked: bool = False) -> list[Share]:
        """Return the session's share links, oldest first.

        Args:
            include_revoked: also return revoked shares (with ``revoked_at`` set).

        Raises:
            NotFound: no such session. PermissionDenied: ``owner`` does not own it.
        """
        with self._read() as db:
            self._owned(db, session_id, owner)
            sql = "SELECT id, session_id, mode, created_at, revoked_at FROM shares WHERE session_id = ?"
            if not include_revoked:
                sql += " AND revoked_at IS NULL"
            return [Share(**row) for row in db.query(sql + " ORDER BY created_at, id", [session_id])]

    def revoke_share(self, share_id: str, owner: str) -> None:
        """Revoke a share link; its token stops resolving. Revoking twice is a no-op.

        Raises:
            NotFound: no such share. PermissionDenied: ``owner`` does not own its session.
        """
        with self._write() as db:
            row = db.execute("SELECT session_id FROM shares WHERE id = ?", [share_id]).fetchone()
            if row is None:
                raise NotFound("This share link does not exist.")
            self._owned(db, row[0], owner)
            db.execute(
                "UPDATE shares SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", [self._now(), share_id]
            )

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
        _check_owner(new_owner)
        if share is None:
            raise NotFound("This share link is no longer valid.")
        with self._write() as db:
            current = self._load_share(db, share.id)
            if current is None or current.revoked_at is not None:
                raise NotFound("This share link is no longer valid.")
            if current.mode != "continue":
                raise PermissionDenied("This share link is read-only; it cannot be continued.")
            source = self._session_row(db, current.session_id)
            if source is None:
                raise NotFound("The shared chat no longer exists.")
            now = self._now()
            new_id = secrets.token_urlsafe(12)
            db.execute(
                "INSERT INTO sessions (id, owner_hash, title, cache_salt, created_at, updated_at, forked_from) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                [new_id, _owner_hash(new_owner), source["title"], source["cache_salt"], now, now, source["id"]],
            )
            db.execute(
                "INSERT INTO session_images (session_id, sha256, position, filename, added_at) "
                "SELECT ?, sha256, position, filename, ? FROM session_images WHERE session_id = ?",
                [new_id, now, source["id"]],
            )
            db.execute(
                "INSERT INTO turns (session_id, question, answer, telemetry, finish_reason, error, created_at, "
                "finished_at) SELECT ?, question, answer, telemetry, finish_reason, error, created_at, finished_at "
                "FROM turns WHERE session_id = ? AND finished_at IS NOT NULL ORDER BY id",
                [new_id, source["id"]],
            )
            return self._load_session(db, new_id)

    # -- maintenance --------------------------------------------------------------------------

    def collect_garbage(self) -> int:
        """Delete leftovers of interrupted uploads; return how many files were removed.

        Removes temporary files in ``images/``, image files the database does not know, and image
        rows (with their files) that no session references. Safe to run at any time, for example
        at startup.
        """
        removed = 0
        with self._write() as db:
            orphans = [r[0] for r in db.execute(
                "SELECT sha256 FROM images WHERE sha256 NOT IN (SELECT sha256 FROM session_images)"
            )]
            removed += self._drop_unreferenced(db, orphans)
            known = {r[0] for r in db.execute("SELECT sha256 FROM images")}
            for shard in self.images_dir.iterdir():
                if not shard.is_dir() or shard.is_symlink():
                    continue
                for entry in shard.iterdir():
                    if entry.name not in known or entry.name[:2] != shard.name:
                        with suppress(OSError):
                            entry.unlink()
                            removed += 1
                with suppress(OSError):
                    shard.rmdir()  # only succeeds when empty
        return removed

    # -- internals ----------------------------------------------------------------------------

    def _blob_path(self, sha: str) -> Path:
        assert _is_sha256(sha)
        return self.images_dir / sha[:2] / sha

    def _ensure_file(self, sha: str, data: bytes) -> bool:
        """Make sure ``images/<sha[:2]>/<sha>`` holds ``data``; return True if it was not there.

        The file is written and synced every time, also when it exists: skipping that for an
        image that another session had uploaded made the upload measurably faster, which told the
        uploader that someone on this server holds the image.
        """
        path = self._blob_path(sha)
        existed = path.is_file()
        path.parent.mkdir(exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".upload-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(path.parent)
        return not existed

    def _remove_file_if_unknown(self, sha: str) -> None:
        """After a failed add_image: delete the file written for it unless the db knows the image."""
        with self._lock:
            with suppress(Exception):
                db = self._require_db()
                if db.execute("SELECT 1 FROM images WHERE sha256 = ?", [sha]).fetchone() is None:
                    self._blob_path(sha).unlink(missing_ok=True)

    def _drop_unreferenced(self, db: sqlite_utils.Database, shas: list[str]) -> int:
        """Inside a write transaction: delete image rows and files no session references."""
        removed = 0
        for sha in shas:
            referenced = db.execute("SELECT 1 FROM session_images WHERE sha256 = ? LIMIT 1", [sha]).fetchone()
            if referenced is not None:
                continue
            db.execute("DELETE FROM images WHERE sha256 = ?", [sha])
            if _is_sha256(sha):
                path = self._blob_path(sha)
                with suppress(FileNotFoundError):
                    path.unlink()
                    removed += 1
                with suppress(OSError):
                    path.parent.rmdir()  # only succeeds when empty
        return removed

    def _session_row(self, db: sqlite_utils.Database, session_id: str) -> dict | None:
        if not isinstance(session_id, str):
            return None
        rows = list(db.query("SELECT * FROM sessions WHERE id = ?", [session_id]))
        return rows[0] if rows else None

    def _owned(self, db: sqlite_utils.Database, session_id: str, owner: str) -> dict:
        row = self._session_row(db, session_id)
        if row is None:
            raise NotFound("This chat does not exist (it may have been deleted).")
        if not _owns(owner, row["owner_hash"]):
            raise PermissionDenied("This chat belongs to someone else.")
        return row

    def _load_session(self, db: sqlite_utils.Database, session_id: str) -> Session | None:
        row = self._session_row(db, session_id)
        if row is None:
            return None
        shas = [r[0] for r in db.execute(
            "SELECT sha256 FROM session_images WHERE session_id = ? ORDER BY position", [session_id]
        )]
        return self._session_from_row(row, shas)

    @staticmethod
    def _session_from_row(row: dict, shas: list[str]) -> Session:
        return Session(
            id=row["id"],
            owner_hash=row["owner_hash"],
            title=row["title"],
            cache_salt=row["cache_salt"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            image_shas=shas,
            forked_from=row["forked_from"],
        )

    def _image_record(self, db: sqlite_utils.Database, session_id: str, sha: str) -> ImageRecord | None:
        rows = list(
            db.query(
                "SELECT i.sha256, si.filename, i.width, i.height, i.bytes, i.mime FROM session_images si "
                "JOIN images i ON i.sha256 = si.sha256 WHERE si.session_id = ? AND si.sha256 = ?",
                [session_id, sha],
            )
        )
        return ImageRecord(**rows[0]) if rows else None

    def _load_turn(self, db: sqlite_utils.Database, turn_id: int) -> Turn | None:
        rows = list(db.query("SELECT * FROM turns WHERE id = ?", [turn_id]))
        return self._turn_from_row(rows[0]) if rows else None

    @staticmethod
    def _turn_from_row(row: dict) -> Turn:
        try:
            telemetry = json.loads(row["telemetry"] or "{}")
        except ValueError:
            telemetry = {}
        return Turn(
            id=row["id"],
            session_id=row["session_id"],
            question=row["question"],
            answer=row["answer"],
            telemetry=telemetry if isinstance(telemetry, dict) else {},
            finish_reason=row["finish_reason"],
            error=row["error"],
            created_at=row["created_at"],
            finished_at=row["finished_at"],
        )

    def _load_share(self, db: sqlite_utils.Database, share_id: str) -> Share | None:
        if not isinstance(share_id, str):
            return None
        rows = list(
            db.query("SELECT id, session_id, mode, created_at, revoked_at FROM shares WHERE id = ?", [share_id])
        )
        return Share(**rows[0]) if rows else None
