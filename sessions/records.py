"""What the session store hands out: its records (dataclasses), its errors, the checks on the text
fields a record holds, and reading records from the database's rows."""

from __future__ import annotations

import json
import re
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import sqlite_utils

DEFAULT_TITLE = "New chat"
MAX_TITLE_LENGTH = 200
#: Longest name of a share link (characters).
MAX_SHARE_NAME_LENGTH = 80
MAX_FILENAME_LENGTH = 255
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
    ``forked_from`` is the id of the session this one was forked from, if any. ``video_shas``: which
    of ``image_shas`` are video clips (the rest are images). ``owner_hash`` is
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
    video_shas: frozenset[str] = frozenset()

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
    untrusted text, escape it before showing it. ``kind`` is ``"image"`` or ``"video"`` (a clip:
    ``width``/``height`` its frame size, ``duration_s`` its length in seconds, ``poster`` a JPEG of
    its first sampled frame; both None for images).
    """

    sha256: str
    filename: str | None
    width: int
    height: int
    bytes: int
    mime: str
    kind: str = "image"
    duration_s: float | None = None
    poster: bytes | None = field(default=None, repr=False)

    @property
    def is_video(self) -> bool:
        return self.kind == "video"


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
    #: the owner's name for the link (``""``: none), at most :data:`MAX_SHARE_NAME_LENGTH` characters
    name: str = ""


# --------------------------------------------------------------------------------------------
# Fields


def clean_title(title: str) -> str:
    if not isinstance(title, str):
        raise TypeError(f"title must be a str, not {type(title).__name__}")
    text = " ".join(_CONTROL_RE.sub(" ", title).split())[:MAX_TITLE_LENGTH].rstrip()
    return text or DEFAULT_TITLE


def clean_filename(filename: str | None) -> str | None:
    if filename is None:
        return None
    if not isinstance(filename, str):
        raise TypeError(f"filename must be a str or None, not {type(filename).__name__}")
    name = re.split(r"[\\/]", filename)[-1]  # browsers may send "C:\fakepath\x.png"
    name = _CONTROL_RE.sub(" ", name).strip()
    if name in ("", ".", ".."):
        return None
    return name[:MAX_FILENAME_LENGTH]


def _json_default(value: Any) -> Any:
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item):
        with suppress(Exception):
            return item()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def dump_telemetry(telemetry: dict | None) -> str:
    if telemetry is None:
        return "{}"
    if not isinstance(telemetry, dict):
        raise TypeError(f"telemetry must be a dict, not {type(telemetry).__name__}")
    return json.dumps(telemetry, default=_json_default, ensure_ascii=False)


# --------------------------------------------------------------------------------------------
# Reading records (inside the caller's transaction)


def session_row(db: sqlite_utils.Database, session_id: str) -> dict | None:
    if not isinstance(session_id, str):
        return None
    rows = list(db.query("SELECT * FROM sessions WHERE id = ?", [session_id]))
    return rows[0] if rows else None


def load_session(db: sqlite_utils.Database, session_id: str) -> Session | None:
    row = session_row(db, session_id)
    if row is None:
        return None
    rows = db.execute(
        "SELECT si.sha256, i.kind FROM session_images si JOIN images i ON i.sha256 = si.sha256 "
        "WHERE si.session_id = ? ORDER BY si.position", [session_id]
    ).fetchall()
    return session_from_row(row, [sha for sha, _ in rows], {sha for sha, kind in rows if kind == "video"})


def session_from_row(row: dict, shas: list[str], videos: set[str] | frozenset[str] = frozenset()) -> Session:
    return Session(
        id=row["id"],
        owner_hash=row["owner_hash"],
        title=row["title"],
        cache_salt=row["cache_salt"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        image_shas=shas,
        forked_from=row["forked_from"],
        video_shas=frozenset(videos),
    )


#: The columns of an :class:`ImageRecord`, for a query joining ``session_images si`` and ``images i``.
MEDIA_COLUMNS = "i.sha256, si.filename, i.width, i.height, i.bytes, i.mime, i.kind, i.duration_s, i.poster"


def image_record(db: sqlite_utils.Database, session_id: str, sha: str) -> ImageRecord | None:
    rows = list(
        db.query(
            f"SELECT {MEDIA_COLUMNS} FROM session_images si "
            "JOIN images i ON i.sha256 = si.sha256 WHERE si.session_id = ? AND si.sha256 = ?",
            [session_id, sha],
        )
    )
    return ImageRecord(**rows[0]) if rows else None


def load_turn(db: sqlite_utils.Database, turn_id: int) -> Turn | None:
    rows = list(db.query("SELECT * FROM turns WHERE id = ?", [turn_id]))
    return turn_from_row(rows[0]) if rows else None


def turn_from_row(row: dict) -> Turn:
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


def load_share(db: sqlite_utils.Database, share_id: str) -> Share | None:
    if not isinstance(share_id, str):
        return None
    rows = list(
        db.query("SELECT id, session_id, mode, created_at, revoked_at, name FROM shares WHERE id = ?", [share_id])
    )
    return Share(**rows[0]) if rows else None
