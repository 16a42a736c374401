"""Decoded uploads handed from the validation of an upload to the engine's first question about it,
so an image or clip uploaded and then asked about is decoded once.

An upload is validated by decoding it (:func:`engine.media.validate_image`,
:func:`engine.media.validate_clip`: a truncated file is only found by decoding it). The first
question about it needs those pixels again; this keeps the result from the validation for the
engine of this process to take once, instead of decoding the same bytes a second time.

What makes taking it safe:

* the key is the cache salt, the SHA-256 of the bytes and every setting that changes the pixels
  (the images' background colour and pipeline version; the clips' sampling): the engine takes an
  item only after hashing the bytes it was given to exactly that digest, so the pixels are those
  its own decoding would give;
* limits may differ between the validator and the engine: the engine checks its own against what
  it takes (an image's size and aspect ratio; a clip's frame size, frames, duration and decode
  work) and refuses with its own message, as decoding would have;
* it is per salt, like every cache of the engine, and taken once: one session's upload never makes
  another's question faster, so neither can time the other;
* it is bounded (bytes of pixels, least recently kept dropped first) and kept only while an engine
  runs in this process (:meth:`DecodedUploads.attach`): a store with no engine beside it, or an
  app whose engine core is another process, keeps nothing, and that engine decodes again.

``Engine.forget(salt)`` drops the salt's items (not counted in ``Forgotten``: nothing was used).
"""

from __future__ import annotations

import threading

from ..cache.salted_lru import SaltedLRU

__all__ = ["UPLOADS", "DecodedUploads"]


class DecodedUploads:
    """Decoded uploads waiting for the engine, by ``(salt, content key, namespace)``.

    Args:
        max_bytes: bound of the kept pixels (bytes); an item larger than it is not kept.

    Counters: ``kept`` (items kept), ``taken`` (items an engine took instead of decoding).
    """

    def __init__(self, max_bytes: int = 256 << 20):
        self._items = SaltedLRU(max_bytes)  # by (salt, content key, namespace)
        self.max_bytes = self._items.max_bytes
        self._engines = 0
        self._lock = threading.Lock()
        self.kept = 0
        self.taken = 0

    def attach(self) -> None:
        """An engine of this process will take items (called when it starts)."""
        with self._lock:
            self._engines += 1

    def detach(self) -> None:
        """An engine of this process stopped; with none left, everything kept is dropped."""
        with self._lock:
            self._engines = max(0, self._engines - 1)
            if not self._engines:
                self._items.clear()

    @property
    def active(self) -> bool:
        """Whether an engine of this process takes items (else :meth:`keep` keeps nothing)."""
        return self._engines > 0

    def __len__(self) -> int:
        return len(self._items)

    def keep(self, salt: str, key: str, namespace: str, value: object, nbytes: int) -> bool:
        """Keep ``value`` (an ``RGB`` PIL image or a :class:`~engine.inputs.video.DecodedVideo`,
        ``nbytes`` of pixels) for the salt's first question about the bytes of SHA-256 ``key``;
        whether it was kept (not without an engine, nor larger than the bound)."""
        if not isinstance(salt, str) or not salt or nbytes > self.max_bytes:
            return False
        with self._lock:
            if not self._engines:
                return False
            self._items.put((salt, key, namespace), value, nbytes)
            self.kept += 1
            return True

    def take(self, salt: str, key: str, namespace: str) -> object | None:
        """The value kept for ``(salt, key, namespace)``, removed (each is taken once), or None."""
        with self._lock:
            found = self._items.pop((salt, key, namespace))
            if found is not None:
                self.taken += 1
            return found

    def forget(self, salt: str) -> int:
        """Drop the salt's items; returns how many went."""
        return self._items.forget(salt)


#: The one hand-off of this process: validation keeps into it, every engine of the process takes.
UPLOADS = DecodedUploads()
