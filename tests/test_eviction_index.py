"""The prefix cache's eviction index (issue 32.6) picks the same victims, in the same order, as a
sort of every entry did, and reads O(log n) entries per eviction. Model-free: caches over bare
page pools.

The oracle is the rule as documented, written here: the entries no request uses and no live
entry extends, sorted by (value, last used), value = tokens x (1 + hits) / pages; under pressure
steps the idle extensions go first, then a compaction step, then eviction by that order. Random
operation sequences (prefixes, conversation extensions, hits, requests pinning entries without
telling the cache, compactions on pressure that change an entry's value, forgetting a salt) run
on two caches side by side: the engine's, and one whose ``make_room`` is the oracle.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.cache.compaction import CompactionConfig
from engine.cache.kv_pool import PagePool
from engine.cache.prefix_cache import KeptTokens, Match, PrefixCache, PrefixEntry
from engine.model.rope import VisualSpan

PAGE = 4
SPAN = VisualSpan(start=2, grid_h=4, grid_w=5, kind="image", item=0, frame=0)  # 20 visual tokens
PREFIX_LEN = 24  # 2 text + 20 visual + 2 text: 6 dense pages


def oracle_order(cache: PrefixCache) -> list[PrefixEntry]:
    """Every entry that may go now, in the documented eviction order (the test's own sort)."""
    alive = [e for p in cache.prefixes.values() for e in (p, *p.children) if e.alive]
    leaves = [e for e in alive if e.users == 0 and not any(c.alive for c in e.children)]
    return sorted(leaves, key=lambda e: (len(e.tokens) * (1 + e.hits) / max(1, len(e.pages)), e.last_used))


class Recording(PrefixCache):
    """A cache that records what it evicts, by the label the test gave each entry."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.evicted: list[int] = []
        self.labels: dict[PrefixEntry, int] = {}

    def evict(self, entry):
        self.evicted.append(self.labels[entry])
        super().evict(entry)


class Oracle(Recording):
    """``make_room`` as the documented rule: a full sort before every eviction."""

    def make_room(self, pages_needed: int) -> bool:
        while self.pool.num_free < pages_needed:
            if self.pressure_steps:
                idle = [e for e in oracle_order(self) if e.parent is not None]
                if idle:
                    self.evict(idle[0])
                    continue
                step = next(((e, i, kept) for e, i in self.compactable()
                             if (kept := self.plan(e, i)) is not None), None)
                if step is not None:
                    self.compact(*step)
                    continue
            victims = oracle_order(self)
            if not victims:
                return False
            self.evict(victims[0])
        return True


def make(kind, pressure: bool, num_pages: int = 40):
    pool = PagePool(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=num_pages, page_size=PAGE,
                    kv_cache_dtype="auto")
    steps = (CompactionConfig("uniform", 0.6, min_keep=1), CompactionConfig("uniform", 0.3, min_keep=1)) \
        if pressure else ()
    return kind(pool, steps)


class Twin:
    """The same operations on the engine's cache and the oracle's; entries by label."""

    def __init__(self, pressure: bool):
        self.caches = (make(Recording, pressure), make(Oracle, pressure))
        self.entries: list[tuple[PrefixEntry, PrefixEntry]] = []
        self.held: list[tuple[int, list[list[int]]]] = []  # (label, each cache's acquired pages)
        self.pinned: list[int] = []

    def live(self) -> list[int]:
        return [i for i, (e, _) in enumerate(self.entries) if e.alive]

    def add_prefix(self, length: int, salt: int, compactable: bool):
        if compactable:
            length = PREFIX_LEN
        need = -(-length // PAGE)
        if self.caches[0].pool.num_free < need:
            return
        label = len(self.entries)
        made = []
        for cache in self.caches:
            pages = cache.pool.allocate(need)
            entry = cache.add_prefix(f"key{label}", f"salt{salt}", list(range(length)), pages, length, need,
                                     20 if compactable else 0, spans=(SPAN,) if compactable else ())
            if compactable:
                entry.record_kept(KeptTokens(torch.arange(length), None, 1.0))
            cache.pool.release(pages)  # the request that computed it is done
            cache.labels[entry] = label
            made.append(entry)
        self.entries.append(tuple(made))

    def add_extension(self, pick: int, extra: int):
        parents = [i for i in self.live() if self.entries[i][0].parent is None]
        if not parents or self.caches[0].pool.num_free < extra:
            return
        parent_label = parents[pick % len(parents)]
        label = len(self.entries)
        made = []
        for cache, parent in zip(self.caches, self.entries[parent_label], strict=True):
            new = cache.pool.allocate(extra)
            pages = [*parent.pages, *new]
            n = parent.kv_len + extra * PAGE
            entry = cache.add_extension(parent, [*parent.tokens, *range(extra * PAGE)], pages, n)
            cache.pool.release(new)
            cache.labels[entry] = label
            made.append(entry)
        self.entries.append(tuple(made))

    def acquire(self, pick: int):
        live = self.live()
        if not live:
            return
        label = live[pick % len(live)]
        pages = []
        for cache, entry in zip(self.caches, self.entries[label], strict=True):
            pages.append(cache.acquire(Match(entry, len(entry.tokens))))
        self.held.append((label, pages))

    def release(self, pick: int):
        if not self.held:
            return
        label, pages = self.held.pop(pick % len(self.held))
        for cache, entry, own in zip(self.caches, self.entries[label], pages, strict=True):
            if entry.alive:  # forget drops entries a request reads; their users no longer matter
                cache.release_user(entry)
            cache.pool.release(own)

    def pin(self, pick: int):
        """A request pins an entry as prefix_reuse does, without telling the cache."""
        live = self.live()
        if live:
            label = live[pick % len(live)]
            for entry in self.entries[label]:
                entry.users += 1
            self.pinned.append(label)

    def unpin(self, pick: int):
        if self.pinned:
            label = self.pinned.pop(pick % len(self.pinned))
            for entry in self.entries[label]:
                entry.users -= 1

    def make_room(self, extra: int):
        need = self.caches[0].pool.num_free + extra
        results = [cache.make_room(need) for cache in self.caches]
        assert results[0] == results[1]

    def forget(self, salt: int):
        assert self.caches[0].forget(f"salt{salt}") == self.caches[1].forget(f"salt{salt}")

    def check(self):
        engine, oracle = self.caches
        assert engine.evicted == oracle.evicted
        assert [e.alive for e, _ in self.entries] == [o.alive for _, o in self.entries]
        assert engine.pool.num_free == oracle.pool.num_free
        assert engine.stats == oracle.stats
        assert [engine.labels[e] for e in engine.evictable()] == [oracle.labels[e] for e in oracle_order(oracle)]


OPS = st.one_of(
    st.tuples(st.just("add_prefix"), st.integers(1, 40), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("add_extension"), st.integers(0, 99), st.integers(1, 3)),
    st.tuples(st.just("acquire"), st.integers(0, 99)),
    st.tuples(st.just("release"), st.integers(0, 99)),
    st.tuples(st.just("pin"), st.integers(0, 99)),
    st.tuples(st.just("unpin"), st.integers(0, 99)),
    st.tuples(st.just("make_room"), st.integers(1, 12)),
    st.tuples(st.just("forget"), st.integers(0, 2)),
)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, max_size=60), pressure=st.booleans())
def test_make_room_evicts_what_the_full_sort_would_in_its_order(ops, pressure):
    twin = Twin(pressure)
    for name, *args in ops:
        getattr(twin, name)(*args)
        twin.check()
    while twin.held:
        twin.release(0)
    while twin.pinned:
        twin.unpin(0)
    twin.make_room(twin.caches[0].pool.num_pages)  # everything that may go, in order
    twin.check()


def test_the_index_stays_bounded_under_churn():
    """Each conversation turn kept and evicted requeues its prefix (the old item goes stale), and
    each hit leaves an out-of-date key: the heaps are rebuilt before they grow past a constant
    times the entries, and the order stays the sort's."""
    twin = Twin(pressure=False)
    for i in range(6):
        twin.add_prefix(4 + i, 0, False)
    cache = twin.caches[0]
    for turn in range(300):
        twin.add_extension(turn, 1)
        twin.acquire(turn)
        twin.release(0)
        extensions = [i for i in twin.live() if twin.entries[i][0].parent is not None]
        for label in extensions:
            for c, entry in zip(twin.caches, twin.entries[label], strict=True):
                c.evict(entry)
        twin.check()
        assert len(cache._heaps[0]) + len(cache._heaps[1]) <= 2 * len(cache._queued) + 64 + 1
    twin.make_room(cache.pool.num_pages)
    twin.check()
    assert set(twin.caches[1].evicted) >= set(range(6))


@pytest.mark.parametrize("n", [256, 2048])
def test_one_eviction_reads_a_logarithmic_number_of_entries(n, monkeypatch):
    """Evicting one entry out of ``n`` computes O(log n) entry values (counted), where the full
    sort computed at least ``n``."""
    cache = make(PrefixCache, pressure=False, num_pages=n + 1)
    for i in range(n):
        pages = cache.pool.allocate(1)
        cache.add_prefix(f"k{i}", "s", list(range(1 + (i * 7919) % 97)), pages, 1, 1, 0)
        cache.pool.release(pages)
    assert cache.pool.num_free == 1
    calls = 0
    value = PrefixEntry.value

    def counted(self):
        nonlocal calls
        calls += 1
        return value(self)

    monkeypatch.setattr(PrefixEntry, "value", counted)
    for _ in range(3):
        before = cache.pool.num_free
        calls = 0
        assert cache.make_room(before + 1)
        assert cache.pool.num_free == before + 1
        assert calls <= 4 * math.log2(n), calls
