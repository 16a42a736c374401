"""A bounded LRU cache of per-image vision features (embeddings and DeepStack features).

Keyed by the session salt, the model namespace and the image's content hash, so that after a
prefix is evicted the same session's next question need not rerun the encoder, while one
session's uploads never change what another session sees (not even its timing).
"""

from __future__ import annotations

from ..model.vision import VisionFeatures
from .salted_lru import SaltedLRU

#: A cache key: the session's salt, and what else names the features (namespace, image, grid).
Key = tuple[str, str]


class VisionCache:
    """LRU of :class:`VisionFeatures` by key (``(salt, rest)``), bounded by ``max_bytes`` (tensor
    payload bytes; a :class:`~engine.cache.salted_lru.SaltedLRU`). Safe to use from several threads.

    Attributes: ``hits`` (lookups that found features).
    """

    def __init__(self, max_bytes: int):
        self._lru = SaltedLRU(max_bytes)
        self.hits = 0

    @property
    def max_bytes(self) -> int:
        return self._lru.max_bytes

    @property
    def bytes(self) -> int:
        return self._lru.bytes

    @staticmethod
    def _size(f: VisionFeatures) -> int:
        extra = () if f.attention is None else (f.attention,)
        return sum(t.numel() * t.element_size() for t in (f.embeds, *f.deepstack, *extra))

    def get(self, key: Key) -> VisionFeatures | None:
        found = self._lru.get(key)
        if found is not None:
            self.hits += 1
        return found

    def put(self, key: Key, features: VisionFeatures) -> None:
        self._lru.put(key, features, self._size(features), replace=False)

    def forget(self, salt: str) -> int:
        """Drop every entry of ``salt``; returns how many went."""
        return self._lru.forget(salt)

    def __len__(self) -> int:
        return len(self._lru)
