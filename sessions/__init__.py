"""Prism sessions package: persistent chat sessions, uploaded images, turns and share links.

See :mod:`sessions.store` for the storage layout, threading model and schema migrations.
"""

from engine.errors import InvalidImageError

from .store import (
    MAX_SHARE_NAME_LENGTH,
    MAX_TITLE_LENGTH,
    SCHEMA_VERSION,
    SHARE_MODES,
    ImageRecord,
    LimitExceeded,
    NotFound,
    PermissionDenied,
    Session,
    SessionStore,
    Share,
    StoreError,
    Turn,
    private_dir,
)

__all__ = [
    "MAX_SHARE_NAME_LENGTH",
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
