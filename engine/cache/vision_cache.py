"""A bounded LRU cache of per-image vision features (embeddings and DeepStack features).

Keyed by the session salt, the model namespace and the image's content hash, so that after a
prefix is evicted the same session's next question need not rerun the encoder, while one
session's uploads never change what another session sees (not even its timing).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..model.vision import VisionFeatures

#: A cache key: the session's salt, and what else names the features (namespace, image, grid).
Key = tuple[str, str]


class VisionCache:
    """LRU of :class:`VisionFeatures` by key (``(salt, rest)``), bounded by ``max_bytes`` (tensor
    payload bytes). Safe to use from several threads."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self._items: OrderedDict[Key, tuple[VisionFeatures, int]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _size(f: VisionFeatures) -> int:
        extra = () if f.attention is None else (f.attention,)
        return sum(t.numel() * t.element_size() for t in (f.embeds, *f.deepstack, *extra))

    def get(self, key: Key) -> VisionFeatures | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def put(self, key: Key, features: VisionFeatures) -> None:
        size = self._size(features)
        with self._lock:
            if size > self.max_bytes or key in self._items:
                return
            self._items[key] = (features, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, old) = self._items.popitem(last=False)
                self.bytes -= old

    def forget(self, salt: str) -> int:
        """Drop every entry of ``salt``; returns how many went."""
        with self._lock:
            gone = [k for k in self._items if k[0] == salt]
            for key in gone:
                self.bytes -= self._items.pop(key)[1]
            return len(gone)

    def __len__(self) -> int:
        return len(self._items)
