"""Share links and forks: a share's token (shown once, stored as its SHA-256), resolving and
revoking it, and copying a shared session for a visitor ("can continue" shares).

Functions run inside the caller's transaction (:class:`~sessions.store.SessionStore` holds it
and checks ownership); ``now`` is the store's clock.
"""

from __future__ import annotations

import secrets
import unicodedata
from collections.abc import Callable

import sqlite_utils

from .keys import token_hash
from .records import MAX_SHARE_NAME_LENGTH, NotFound, PermissionDenied, Share, load_share, session_row

#: Share modes: ``"read"`` shows the conversation; ``"continue"`` also lets the visitor fork it.
SHARE_MODES = ("read", "continue")
# Anything longer cannot be a token from create_share; refused before hashing.
MAX_TOKEN_LENGTH = 256


def create(db: sqlite_utils.Database, session_id: str, mode: str, now: Callable[[], float],
           name: str = "") -> tuple[str, Share]:
    """A new share of ``session_id`` named ``name`` (checked by the caller): ``(token, share)``; the
    token is ``secrets.token_urlsafe(24)`` (192 bits), of which only the SHA-256 is stored."""
    token = secrets.token_urlsafe(24)
    share_id = secrets.token_urlsafe(12)
    db.execute(
        "INSERT INTO shares (id, session_id, token_hash, mode, created_at, revoked_at, name) "
        "VALUES (?, ?, ?, ?, ?, NULL, ?)",
        [share_id, session_id, token_hash(token), mode, now(), name],
    )
    return token, load_share(db, share_id)


def clean_name(name: object) -> str:
    """A share link's name as stored: whitespace runs made one space, trimmed.

    Raises:
        ValueError: not a string, longer than :data:`MAX_SHARE_NAME_LENGTH` characters once
            cleaned, or holding control characters.
    """
    if not isinstance(name, str):
        raise ValueError("a share link's name must be text")
    cleaned = " ".join(name.split())
    if len(cleaned) > MAX_SHARE_NAME_LENGTH:
        raise ValueError(f"a share link's name is at most {MAX_SHARE_NAME_LENGTH} characters")
    if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in cleaned):
        raise ValueError("a share link's name cannot hold control characters")
    return cleaned


def well_formed(token: object) -> bool:
    """Whether ``token`` could be a token from :func:`create` (checked before hashing)."""
    return isinstance(token, str) and bool(token) and len(token) <= MAX_TOKEN_LENGTH


def resolve(db: sqlite_utils.Database, digest: str) -> Share | None:
    """The active share whose token hashes to ``digest``, or None (unknown or revoked). Tokens are
    looked up by their SHA-256, so timing reveals nothing useful about stored tokens."""
    rows = list(
        db.query(
            "SELECT id, session_id, mode, created_at, revoked_at, name FROM shares "
            "WHERE token_hash = ? AND revoked_at IS NULL",
            [digest],
        )
    )
    return Share(**rows[0]) if rows else None


def of_session(db: sqlite_utils.Database, session_id: str, include_revoked: bool) -> list[Share]:
    """The session's shares, oldest first (revoked ones too with ``include_revoked``)."""
    sql = "SELECT id, session_id, mode, created_at, revoked_at, name FROM shares WHERE session_id = ?"
    if not include_revoked:
        sql += " AND revoked_at IS NULL"
    return [Share(**row) for row in db.query(sql + " ORDER BY created_at, id", [session_id])]


def session_of(db: sqlite_utils.Database, share_id: str) -> str:
    """The id of the session share ``share_id`` belongs to.

    Raises:
        NotFound: no such share.
    """
    row = db.execute("SELECT session_id FROM shares WHERE id = ?", [share_id]).fetchone()
    if row is None:
        raise NotFound("This share link does not exist.")
    return row[0]


def revoke(db: sqlite_utils.Database, share_id: str, now: Callable[[], float]) -> None:
    """Revoke the share (a no-op when it is revoked already)."""
    db.execute("UPDATE shares SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", [now(), share_id])


def fork(db: sqlite_utils.Database, share: Share, new_owner_hash: str, now: Callable[[], float]) -> str:
    """Copy the session ``share`` grants for the owner ``new_owner_hash``; return the copy's id.

    The share is re-checked in the database (a revoked share cannot be used). The copy has the
    same title, the same images in the same order (and file names), the same ``cache_salt``, copies
    of the finished turns and ``forked_from`` = the original id.

    Raises:
        PermissionDenied: the share is read-only. NotFound: the share was revoked or deleted, or its
        session no longer exists.
    """
    current = load_share(db, share.id)
    if current is None or current.revoked_at is not None:
        raise NotFound("This share link is no longer valid.")
    if current.mode != "continue":
        raise PermissionDenied("This share link is read-only; it cannot be continued.")
    source = session_row(db, current.session_id)
    if source is None:
        raise NotFound("The shared chat no longer exists.")
    stamp = now()
    new_id = secrets.token_urlsafe(12)
    db.execute(
        "INSERT INTO sessions (id, owner_hash, title, cache_salt, created_at, updated_at, forked_from) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        [new_id, new_owner_hash, source["title"], source["cache_salt"], stamp, stamp, source["id"]],
    )
    db.execute(
        "INSERT INTO session_images (session_id, sha256, position, filename, added_at) "
        "SELECT ?, sha256, position, filename, ? FROM session_images WHERE session_id = ?",
        [new_id, stamp, source["id"]],
    )
    db.execute(
        "INSERT INTO turns (session_id, question, answer, telemetry, finish_reason, error, created_at, "
        "finished_at) SELECT ?, question, answer, telemetry, finish_reason, error, created_at, finished_at "
        "FROM turns WHERE session_id = ? AND finished_at IS NOT NULL ORDER BY id",
        [new_id, source["id"]],
    )
    return new_id
