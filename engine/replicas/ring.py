"""Which replica serves a session: consistent hashing with bounded loads (pure, no Ray).

A :class:`HashRing` places each replica at :data:`VNODES` points of a 64-bit circle (the first 8
bytes of SHA-256 of ``"<replica>#<i>"``); a key's *home* is the first replica clockwise from the
key's own point. Adding or removing a replica moves only the keys whose home it is or becomes:
about ``1/N`` of them.

:class:`SessionRouter` puts sessions (routing keys: the cache salt) on replicas with the bounded
loads of Mirrokni, Thorup and Zadimoghaddam (arXiv:1608.01350): a replica's *load* is the number of
sessions placed on it, and a new session goes to the first replica clockwise from its point whose
load stays within ``ceil((1 + epsilon) * (S + 1) / U)`` (``S`` sessions on the ``U`` replicas that
are up, the new one counted), so no replica holds more than ``(1 + epsilon)`` times the mean, and
such a replica always exists. Once placed a session stays (it never splits: its caches are on that
replica), until its replica goes down or is removed (then it is placed again, one cold miss), or a
replica is added whose points make it the session's home (consistent hashing's ``1/N`` move).

Load counts sessions, not requests in flight: what a session costs a replica is its KV cache,
held between questions; a burst of requests is the engine's own admission control
(``EngineOverloadedError``). The router remembers at most ``max_sessions`` sessions, least
recently routed forgotten first (a forgotten session is placed again, usually on the same
replica: its home).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator

__all__ = ["VNODES", "EPSILON", "HashRing", "SessionRouter", "point"]

#: Points per replica on the ring: a replica's share of the circle varies by about
#: ``1 / sqrt(VNODES)`` (3 %); at 160 one of 4 replicas was home to 14 % fewer keys than a quarter,
#: at 1024 within 10 % (tests/test_ring.py measures it). 4 replicas: 4096 points, 32 KiB.
VNODES = 1024
#: A replica may hold up to ``1 + EPSILON`` times the mean load before new sessions pass it by.
EPSILON = 0.25
#: Sessions a router remembers (LRU); about 100 bytes each.
MAX_SESSIONS = 1 << 16


def point(text: str) -> int:
    """A string's point on the ring: the first 8 bytes of its SHA-256, big-endian (0 .. 2**64-1)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "big")


class HashRing:
    """Replicas (names) on a hash circle, :data:`VNODES` points each.

    Raises:
        ValueError: a replica added twice, or a vnode count below 1.
    """

    def __init__(self, nodes: Iterable[str] = (), *, vnodes: int = VNODES):
        if vnodes < 1:
            raise ValueError(f"vnodes must be at least 1, got {vnodes}")
        self.vnodes = vnodes
        self._points: list[int] = []  # sorted
        self._owners: list[str] = []  # the replica at each point
        self._nodes: list[str] = []
        for node in nodes:
            self.add(node)

    @property
    def nodes(self) -> tuple[str, ...]:
        """The replicas, in the order they were added."""
        return tuple(self._nodes)

    def __contains__(self, node: str) -> bool:
        return node in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def add(self, node: str) -> None:
        if node in self._nodes:
            raise ValueError(f"replica {node!r} is on the ring already")
        self._nodes.append(node)
        for i in range(self.vnodes):
            p = point(f"{node}#{i}")
            at = bisect.bisect_left(self._points, p)
            # a tie of two replicas' points (2**-64 odds) is broken by name, so the order is the same
            # whatever order the replicas were added in
            while at < len(self._points) and self._points[at] == p and self._owners[at] < node:
                at += 1
            self._points.insert(at, p)
            self._owners.insert(at, node)

    def remove(self, node: str) -> None:
        """Take a replica off the ring (no-op if absent)."""
        if node not in self._nodes:
            return
        self._nodes.remove(node)
        kept = [(p, o) for p, o in zip(self._points, self._owners, strict=True) if o != node]
        self._points = [p for p, _ in kept]
        self._owners = [o for _, o in kept]

    def walk(self, key: str) -> Iterator[str]:
        """Each replica once, clockwise from ``key``'s point: its home first."""
        if not self._points:
            return
        start = bisect.bisect_right(self._points, point(key))
        seen: set[str] = set()
        n = len(self._points)
        for i in range(n):
            owner = self._owners[(start + i) % n]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self._nodes):
                    return

    def home(self, key: str) -> str | None:
        """The first replica clockwise from ``key``'s point, None on an empty ring."""
        return next(self.walk(key), None)


class SessionRouter:
    """Sessions on replicas by consistent hashing with bounded loads (see the module docstring).

    Args:
        nodes: the replicas, all up.
        epsilon: the load bound's slack (a replica holds at most ``ceil((1 + epsilon) * mean)``
            sessions when a new one is placed), > 0.
        vnodes: points per replica.
        max_sessions: sessions remembered (LRU).

    Not thread-safe: the caller holds a lock around each call.

    Raises:
        ValueError: ``epsilon`` not above 0, ``max_sessions`` below 1.
    """

    def __init__(self, nodes: Iterable[str] = (), *, epsilon: float = EPSILON, vnodes: int = VNODES,
                 max_sessions: int = MAX_SESSIONS):
        if not epsilon > 0:
            raise ValueError(f"epsilon must be above 0, got {epsilon}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        self.epsilon, self.max_sessions = epsilon, max_sessions
        self.ring = HashRing(vnodes=vnodes)
        self._up: set[str] = set()
        self._placed: OrderedDict[str, str] = OrderedDict()  # session -> replica, least recent first
        self._load: dict[str, int] = {}
        for node in nodes:
            self.add(node)

    # ------------------------------------------------------------------ replicas
    @property
    def nodes(self) -> tuple[str, ...]:
        return self.ring.nodes

    def is_up(self, node: str) -> bool:
        return node in self._up

    def add(self, node: str) -> list[str]:
        """Put a new replica on the ring, up. The sessions whose home it now is move to it (their
        next :meth:`route` places them again); returns them."""
        self.ring.add(node)
        self._up.add(node)
        self._load[node] = 0
        moved = [key for key in self._placed if self._home_up(key) == node]
        for key in moved:
            self._unplace(key)
        return moved

    def remove(self, node: str) -> list[str]:
        """Take a replica off the ring; its sessions are placed again at their next request;
        returns them."""
        moved = [key for key, at in self._placed.items() if at == node]
        for key in moved:
            self._unplace(key)
        self.ring.remove(node)
        self._up.discard(node)
        self._load.pop(node, None)
        return moved

    def set_up(self, node: str, up: bool) -> None:
        """Mark a replica up or down. A down one takes no session; each of its sessions is placed
        on another at its next request (and stays there when this one comes back: its caches are
        there now). Unknown replicas are ignored."""
        if node not in self.ring:
            return
        if up:
            self._up.add(node)
        else:
            self._up.discard(node)

    # ------------------------------------------------------------------ sessions
    def route(self, key: str, *, remember: bool = True) -> str | None:
        """The replica for session ``key``: where it was placed if that replica is up, else the
        first replica clockwise within the load bound (placed there, unless not ``remember``).
        None when no replica is up."""
        at = self._placed.get(key)
        if at is not None and at in self._up:
            self._placed.move_to_end(key)
            return at
        node = self._place(key)
        if node is not None and remember:
            if at is not None:
                self._unplace(key)
            self._placed[key] = node
            self._load[node] += 1
            while len(self._placed) > self.max_sessions:
                self._unplace(next(iter(self._placed)))
        return node

    def placed(self, key: str) -> str | None:
        """Where session ``key`` is placed now (None: not remembered)."""
        return self._placed.get(key)

    def forget(self, key: str) -> None:
        """Drop session ``key`` (a deleted chat): its load goes."""
        self._unplace(key)

    def load(self, node: str) -> int:
        """Sessions placed on ``node``."""
        return self._load.get(node, 0)

    def capacity(self) -> int:
        """The most sessions a replica may hold for a new session to be placed on it:
        ``ceil((1 + epsilon) * (S + 1) / U)``; 0 when no replica is up."""
        if not self._up:
            return 0
        sessions = sum(self._load[n] for n in self._up)
        return math.ceil((1 + self.epsilon) * (sessions + 1) / len(self._up))

    # ------------------------------------------------------------------ helpers
    def _place(self, key: str) -> str | None:
        cap = self.capacity()
        first = None
        for node in self.ring.walk(key):
            if node not in self._up:
                continue
            first = first or node
            if self._load[node] + 1 <= cap:
                return node
        return first  # unreachable with epsilon > 0 (some replica is at or under the mean)

    def _home_up(self, key: str) -> str | None:
        return next((n for n in self.ring.walk(key) if n in self._up), None)

    def _unplace(self, key: str) -> None:
        node = self._placed.pop(key, None)
        if node is not None and node in self._load:
            self._load[node] -= 1
