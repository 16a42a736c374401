"""The database schema and its migrations.

The schema version lives in SQLite's ``PRAGMA user_version``. ``_MIGRATIONS[i]`` upgrades version
``i`` to ``i + 1``; :func:`migrate` applies the missing ones inside the caller's write transaction.
A database written by a newer Prism (a higher version) is refused with
:class:`~sessions.records.StoreError`.
"""

from __future__ import annotations

from pathlib import Path

import sqlite_utils

from .keys import owner_hash
from .records import StoreError


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
        db.execute("UPDATE sessions SET owner_hash = ? WHERE id = ?", [owner_hash(owner), session_id])


def _migration_3(db: sqlite_utils.Database) -> None:
    """Video clips beside images: ``images.kind`` (``'image'`` for every existing row), the clip's
    ``duration_s`` and its ``poster`` (a JPEG of its first sampled frame); NULL for images."""
    db.execute("ALTER TABLE images ADD COLUMN kind TEXT NOT NULL DEFAULT 'image' CHECK (kind IN ('image', 'video'))")
    db.execute("ALTER TABLE images ADD COLUMN duration_s REAL")
    db.execute("ALTER TABLE images ADD COLUMN poster BLOB")


def _migration_4(db: sqlite_utils.Database) -> None:
    """A name the owner gives a share link (``shares.name``; ``''`` for every existing link), so two
    links of one mode can be told apart in the share dialog."""
    db.execute("ALTER TABLE shares ADD COLUMN name TEXT NOT NULL DEFAULT ''")


#: ``_MIGRATIONS[i]`` takes the schema from version ``i`` to ``i + 1``. Append, never edit.
_MIGRATIONS = [_migration_1, _migration_2, _migration_3, _migration_4]
SCHEMA_VERSION = len(_MIGRATIONS)


def migrate(db: sqlite_utils.Database, db_path: Path) -> int:
    """Bring the schema up to :data:`SCHEMA_VERSION` (inside a write transaction) and return the
    version found.

    Raises:
        StoreError: the database's version is newer than :data:`SCHEMA_VERSION`.
    """
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{db_path} has schema version {version}, newer than this Prism supports "
            f"({SCHEMA_VERSION}); upgrade Prism or use another data directory"
        )
    for index in range(version, SCHEMA_VERSION):
        _MIGRATIONS[index](db)
        db.execute(f"PRAGMA user_version = {index + 1}")
    return version
