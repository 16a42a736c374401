"""The store's secrets and hashes: owner keys (stored only as their SHA-256), share tokens (the
same), their constant-time comparison, and the content hashes that name image files."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def new_owner_key() -> str:
    """A fresh random owner key (``secrets.token_urlsafe(32)``, 256 bits)."""
    return secrets.token_urlsafe(32)


def is_sha256(value: object) -> bool:
    """Whether ``value`` is 64 lowercase hex digits (the only names image files may have)."""
    return isinstance(value, str) and _SHA256_RE.fullmatch(value) is not None


def same_key(a: str, b: str) -> bool:
    """``a == b`` in constant time."""
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))


def token_hash(token: str) -> str:
    """What the database holds of a share token: its SHA-256 (hex)."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def owner_hash(owner: str) -> str:
    """What the database holds of an owner key (keys are 256 random bits: a plain SHA-256 is enough)."""
    return token_hash(owner)


def owns(owner: object, owner_hash_: str) -> bool:
    """Whether the owner key ``owner`` hashes to ``owner_hash_`` (constant-time comparison)."""
    return isinstance(owner, str) and bool(owner) and same_key(owner_hash(owner), owner_hash_)


def check_owner(owner: str) -> str:
    """``owner``, or ValueError when it is not a non-empty string."""
    if not isinstance(owner, str) or not owner:
        raise ValueError("owner must be a non-empty string")
    return owner
