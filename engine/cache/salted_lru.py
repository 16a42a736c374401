"""A byte-bounded LRU keyed per session: the shape of the engine's per-salt caches.

Every key is a tuple whose first element is the session's cache salt, so :meth:`SaltedLRU.forget`
drops one session's entries and nothing else (``Engine.forget``). The vision-feature cache
(:mod:`engine.cache.vision_cache`) and the upload hand-off (:mod:`engine.inputs.uploads`) keep
their values in one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable


class SaltedLRU:
    """Values by key, least recently used dropped first once their sizes sum past ``max_bytes``.
    Safe to use from several threads.

    Args:
        max_bytes: bound of the sizes (bytes) kept; a value larger than it is never kept.

    Attributes:
        max_bytes: as given. bytes: the sizes kept now, in bytes.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self._items: OrderedDict[tuple, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> object | None:
        """The value of ``key`` (now the most recently used), or None."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: tuple, value: object, nbytes: int, *, replace: bool = True) -> bool:
        """Keep ``value`` (``nbytes`` bytes) under ``key``, dropping the least recently used values
        past the bound; whether it was kept (not when larger than the bound, nor when ``key`` is
        there already and ``replace`` is False)."""
        if nbytes > self.max_bytes:
            return False
        with self._lock:
            if key in self._items:
                if not replace:
                    return False
                self.bytes -= self._items.pop(key)[1]
            self._items[key] = (value, nbytes)
            self.bytes += nbytes
            while self.bytes > self.max_bytes:
                _, (_, size) = self._items.popitem(last=False)
                self.bytes -= size
            return True

    def pop(self, key: tuple) -> object | None:
        """Remove ``key`` and return its value, or None when it is not kept."""
        with self._lock:
            item = self._items.pop(key, None)
            if item is None:
                return None
            self.bytes -= item[1]
            return item[0]

    def forget(self, salt: Hashable) -> int:
        """Drop every entry of ``salt`` (keys whose first element it is); returns how many went."""
        with self._lock:
            gone = [k for k in self._items if k[0] == salt]
            for key in gone:
                self.bytes -= self._items.pop(key)[1]
            return len(gone)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)
