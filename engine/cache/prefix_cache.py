"""The compact prefix cache: KV pages of the question-independent part of a prompt, kept after
the request that computed them, so later questions attach them read-only.

An entry is either a *prefix* (the public prefix: every token up to and including the last
image's ``<|vision_end|>``, usually compacted) or an *extension* of one (the prefix plus a
conversation's later turns, so the next turn prefills only its new question). Entries hold one
reference on each of their pages; a request that attaches an entry takes its own references and
a private copy of a partly filled last page, so cached pages are never written.

Identity: a prefix's key is SHA-256 over the model namespace (checkpoint and every setting that
changes pixels or tokens), the cache salt (one per chat session, so sessions never share KV and
cannot probe each other by timing), the ordered image hashes, the compaction settings, the
prefix length and the SHA-256 of the exact prefix token ids. On a hit the full token ids are
compared as well.

Memory: entries may use every idle page. When pages are needed, entries that no running request
uses and that no other entry extends are evicted, lowest value first, where
value = prompt tokens saved × (1 + hits) / pages held (ties: least recently used first).

Compaction on pressure (``compaction_mode="on_pressure"``, a cache built with ``pressure_steps``):
prefixes are cached dense, and :meth:`PrefixCache.make_room` reclaims pages in this order: idle
conversation extensions (lowest value first); then it compacts a prefix entry one step further
(each entry to the first step, lowest value first, before any entry goes to the second), only an
entry no request reads (``users == 0``, no live extension: the slots are moved in place, so a
reader would see them move); then it evicts whole entries by value as above. A compaction keeps the
entry's key (a later hit on the same images finds it), moves the kept slots to the front of its
pages (:meth:`~engine.cache.kv_pool.PagePool.keep_slots`: a slot-move order the next step plan
carries to the runner), frees the pages past them, drops its
extensions (their KV attended to the tokens that are gone) and records what it kept.

The host tier (a cache built with ``host``, a :class:`~engine.cache.host_pool.HostPool`): the
unit that moves is a prefix together with its live conversation extensions (an extension's block
table starts with its parent's pages, so the two cannot be apart), one *family*; it moves only
when no request reads any of it and no request holds its pages. An offload copies the family's
distinct pages to host pages (an :class:`~engine.cache.kv_transfer.Offload` order the next step
plan carries to the runner, run on the copy stream) and gives the GPU pages back when the copy
has landed (until then they are *pending*: :attr:`PrefixCache.pending_pages`; the scheduler waits
for them instead of preempting anyone). A hit on a host family allocates GPU pages and orders a
:class:`~engine.cache.kv_transfer.Restore`; its requests are admitted once that copy landed. An
entry keeps its key, tokens, kept positions, scores, images and extensions across the round trip.
A family on the host is never compacted (compaction runs on the GPU); a compacted prefix may be
offloaded as it is. How pages are reclaimed, in one place: :func:`engine.cache.reclaim.reclaim_once`
and docs/ARCHITECTURE.md ("Reclaiming KV pages"); this module has the moves it chooses among.

What a prefix kept: each prefix entry records which logical prefix tokens its KV still holds
(:class:`KeptTokens`, set by :meth:`PrefixEntry.record_kept` whenever the entry is compacted), and
which images it was built from (their content keys and visual spans), so a caller can be shown
which visual tokens survived (:meth:`PrefixReuse.prefix_info
<engine.cache.prefix_reuse.PrefixReuse.prefix_info>`). Only indices: no KV leaves the cache.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..model.rope import VisualSpan
from .compaction import CompactionConfig, pressure_ratios, value_merge_plan
from .host_pool import HostPool
from .kv_pool import PagePool
from .kv_transfer import Offload, Restore, TransferDone
from .reclaim import RECLAIM_ORDERS, ReclaimCosts, keep_free, reclaim_once

_clock = itertools.count()


@dataclass(frozen=True)
class KeptTokens:
    """Which tokens of a public prefix its cached KV holds: the one record of it (read by
    ``prefix_info``; replaced, never edited, by :meth:`PrefixEntry.record_kept`).

    Attributes:
        positions: int64 ``[k]`` on the CPU, increasing logical prefix indices (``< prefix_len``):
            physical slot ``i`` of the entry's pages holds the KV of logical token ``positions[i]``.
            Text, ``<|vision_start|>`` and ``<|vision_end|>`` tokens are always among them.
        selector: the :data:`~engine.cache.compaction.SELECTORS` key that chose the visual tokens,
            None for a dense (uncompacted) prefix.
        keep_ratio: the share of each image's visual tokens the selector was asked to keep (1.0
            for a dense prefix).
        owner: under the merging variant (``CompactionConfig.merge_values``), int64
            ``[prefix_len]`` on the CPU: for each logical prefix token, the logical position of the
            kept token whose V holds its share (kept tokens: themselves; the V of a kept token is
            the mean of the original V of the tokens that name it, up to rounding, see
            :func:`~engine.cache.compaction.value_merge_plan`). None: drop-only (every kept V is
            the token's own).
    """

    positions: torch.Tensor
    selector: str | None
    keep_ratio: float
    owner: torch.Tensor | None = None

    def mask(self, prefix_len: int) -> torch.Tensor:
        """bool ``[prefix_len]``: whether each logical prefix token is kept."""
        keep = torch.zeros(prefix_len, dtype=torch.bool)
        keep[self.positions] = True
        return keep


@dataclass(eq=False)
class PrefixEntry:
    """One cached run of KV.

    Attributes:
        key: lookup key (prefixes) or a unique id (extensions).
        salt: the session salt it belongs to ("" under ``cache_scope="global"``).
        tokens: the logical token ids it covers, from the prompt start.
        pages: its block table; the cache holds one reference on each page.
        kv_len: tokens physically stored (fewer than ``len(tokens)`` after compaction).
        prefix_len: length of the public prefix it starts with.
        dense_pages: pages the public prefix would take without compaction.
        visual_kept: visual tokens kept in the public prefix.
        parent: the prefix an extension extends (None for prefixes).
        images: content key of each image of the prefix, in prompt order
            (:attr:`engine.inputs.prompts.Prompt.image_keys`; empty for extensions).
        spans: the prefix's visual spans (logical positions; empty for extensions).
        kept: which prefix tokens the KV holds (prefixes; None for extensions and until
            :meth:`record_kept`).
        scores: the prefix's per-token selector inputs
            (:data:`~engine.cache.compaction.TokenScores`, over logical prefix positions), kept so
            the entry can be compacted again later; None when the engine computed none.
        tier: where its KV lives: ``"gpu"`` (``pages`` in the KV pool), ``"host"`` (``host_pages``
            in the host tier; ``pages`` empty) or ``"restoring"`` (``pages`` allocated, the
            host-to-GPU copy in flight; read by no request until it lands). A prefix and its
            extensions always share one tier (they move together).
        host_pages: its block table in the host tier while it is there (one host reference each).
        restore_ms, restored_pages: the copy that last brought it back from the host tier.
        warmed: built by a warm (``Engine.warm``) and not attached by a request since: the first
            request that attaches it reports ``Telemetry.warmed`` and clears it.
    """

    key: str
    salt: str
    tokens: list[int]
    pages: list[int]
    kv_len: int
    prefix_len: int
    dense_pages: int
    visual_kept: int
    parent: PrefixEntry | None = None
    children: list[PrefixEntry] = field(default_factory=list)
    hits: int = 0
    users: int = 0
    last_used: int = field(default_factory=lambda: next(_clock))
    alive: bool = True
    images: tuple[str | None, ...] = ()
    spans: tuple[VisualSpan, ...] = ()
    kept: KeptTokens | None = None
    scores: dict[str, torch.Tensor] | None = None
    tier: str = "gpu"
    host_pages: list[int] = field(default_factory=list)
    restore_ms: float = 0.0
    restored_pages: int = 0
    warmed: bool = False

    @property
    def base(self) -> PrefixEntry:
        """The prefix this entry is or extends."""
        return self if self.parent is None else self.parent

    def record_kept(self, kept: KeptTokens) -> None:
        """Record which logical prefix tokens the entry's KV now holds, once its slots hold them
        (after compact-and-cache; a later re-compaction of the entry calls it again with what it
        left). Also sets :attr:`visual_kept` (the kept positions inside visual spans)."""
        self.kept = kept
        inside = torch.zeros(self.prefix_len, dtype=torch.bool)
        for span in self.spans:
            inside[span.start : span.end] = True
        self.visual_kept = int(inside[kept.positions].sum())

    @property
    def compact(self) -> bool:
        """Whether the prefix's KV dropped visual tokens (False for a dense prefix, and for one whose
        selector had to keep every token)."""
        base = self if self.parent is None else self.parent
        return base.kv_len < base.prefix_len

    @property
    def kv_offset(self) -> int:
        """Logical tokens removed by compaction (logical index - physical index after the prefix)."""
        return len(self.tokens) - self.kv_len

    def value(self) -> float:
        return len(self.tokens) * (1 + self.hits) / max(1, len(self.pages))


def eviction_order(entry: PrefixEntry) -> tuple[float, int]:
    """The key entries are evicted by, least first: value, then least recently used."""
    return (entry.value(), entry.last_used)


@dataclass
class Match:
    """A lookup result: reuse ``entry``'s KV for the first ``length`` logical prompt tokens."""

    entry: PrefixEntry
    length: int

    @property
    def kv_len(self) -> int:
        return self.length - self.entry.kv_offset


@dataclass
class CacheStats:
    """Counters of a :class:`PrefixCache` (lookups, and entries evicted by kind)."""

    hits: int = 0
    misses: int = 0
    stale: int = 0
    prefix_evictions: int = 0  # public prefixes (the images' KV) evicted
    extension_evictions: int = 0  # conversation extensions (finished turns kept for reuse) evicted
    tokens_saved: int = 0
    conversation_hits: int = 0
    pressure_compactions: int = 0  # prefixes compacted (one step each) to make room
    pressure_pages_freed: int = 0  # pages those compactions freed
    offloads: int = 0  # prefixes (with their extensions) moved to the host tier
    restores: int = 0  # prefixes (with their extensions) brought back from it
    host_evictions: int = 0  # entries dropped from the host tier (not counted in the evictions above)
    hits_host: int = 0  # hits on an entry found in the host tier (counted in ``hits`` too)
    transfer_failures: int = 0  # offloads and restores whose copy failed (their entries dropped)

    @property
    def evictions(self) -> int:
        """Entries evicted, of both kinds."""
        return self.prefix_evictions + self.extension_evictions


def prefix_key(namespace: str, salt: str, image_hashes: list[str], compaction: str, prefix_ids: list[int]) -> str:
    """SHA-256 hex key of a public prefix (see the module docstring)."""
    h = hashlib.sha256()
    ids = hashlib.sha256(",".join(map(str, prefix_ids)).encode()).hexdigest()
    for part in (namespace, salt, *image_hashes, compaction, str(len(prefix_ids)), ids):
        h.update(part.encode())
        h.update(b"\x00")
    return h.hexdigest()


def _common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b``, whose first ``start`` items are known equal."""
    n = min(len(a), len(b))
    for i in range(start, n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class InFlight:
    """A copy between the tiers not yet landed.

    Attributes:
        kind: ``"offload"`` or ``"restore"``.
        entry: the family's prefix.
        pages: the GPU pages the copy holds a reference on (an offload's source pages, freed when
            it lands: the *pending* pages; a restore's destination pages).
        host_pages: the host pages of the copy.
    """

    kind: str
    entry: PrefixEntry
    pages: list[int]
    host_pages: list[int]


class PrefixCache:
    """Entries by key, their pages in ``pool``, the eviction policy and counters.

    Args:
        pool: the KV pool the entries' pages live in.
        pressure_steps: compaction steps applied on pressure, in order (each keeps fewer visual
            tokens than the one before, choosing among what the earlier step kept); empty: never
            compact on pressure (prefixes were compacted when cached, or not at all). Their keep
            ratios follow :func:`~engine.cache.compaction.pressure_ratios`: a step of keep ratio
            1.0 keeps every token, so it is no step and is left out of :attr:`pressure_steps`.

        host: the host tier entries may move to (None: no host tier).
        reclaim_order: ``"offload_first"`` (lossless moves to the host tier before any compaction)
            or ``"compact_first"`` (compaction steps first, then offloads: compacted copies move);
            see :func:`~engine.cache.reclaim.reclaim_once`.
        costs: the prices the policy weighs (:class:`~engine.cache.reclaim.ReclaimCosts`).

    Raises:
        ValueError: a step without a selector, keep ratios outside (0, 1] or not decreasing, an
            unknown ``reclaim_order``.
    """

    def __init__(self, pool: PagePool, pressure_steps: tuple[CompactionConfig, ...] = (), *,
                 host: HostPool | None = None, reclaim_order: str = "offload_first",
                 costs: ReclaimCosts | None = None):
        if any(s.method is None for s in pressure_steps):
            raise ValueError(f"pressure steps need a selector, got {[s.method for s in pressure_steps]}")
        if reclaim_order not in RECLAIM_ORDERS:
            raise ValueError(f"reclaim_order must be one of {RECLAIM_ORDERS}, got {reclaim_order!r}")
        pressure_ratios([s.keep_ratio for s in pressure_steps])
        self.pool = pool
        self.host = host
        self.reclaim_order = reclaim_order
        self.costs = costs if costs is not None else ReclaimCosts()
        # copies in flight by transfer id; transfers landed since the last plan; families whose
        # restore failed since the scheduler last asked; keys a cold request is computing now
        self.in_flight: dict[int, InFlight] = {}
        self._landed: list[int] = []
        self._failed: list[PrefixEntry] = []
        self._computing: Counter[str] = Counter()
        self._host_refs: Counter[int] = Counter()
        self._xfer_ids = itertools.count(1)
        self.largest_offload = 0  # pages of the largest family offloaded so far (the watermark's size)
        self.pressure_steps = tuple(s for s in pressure_steps if s.keep_ratio < 1)
        self.prefixes: dict[str, PrefixEntry] = {}
        self.stats = CacheStats()
        # The eviction index: one min-heap per kind (0: prefixes, 1: extensions) of
        # (value, last_used, token, entry) over the entries no live entry extends. An item is
        # current while _queued[entry] is its token; older items are skipped when they surface.
        self._heaps: tuple[list, list] = ([], [])
        self._queued: dict[PrefixEntry, int] = {}
        self._tokens = itertools.count()

    # ------------------------------------------------------------------ lookup
    def lookup(self, key: str, prompt_ids: list[int], prefix_len: int) -> Match | None:
        """The longest reusable cached run for a prompt whose public prefix has ``key``.

        At least one prompt token is always left to compute (its logits start generation).
        """
        entry = self.prefixes.get(key)
        if entry is None or not entry.alive or entry.tokens != prompt_ids[:prefix_len]:
            return None
        best = Match(entry, prefix_len)
        for ext in entry.children:
            if not ext.alive:
                continue
            # an extension starts with its parent's tokens, equal to the prompt's (checked above)
            n = min(_common_prefix(ext.tokens, prompt_ids, prefix_len), len(prompt_ids) - 1)
            if n > best.length:
                best = Match(ext, n)
        if best.length >= len(prompt_ids):
            return None  # nothing left to compute: the prompt is the prefix itself
        return best

    def latest_prefix(self, salt: str, images: list[str | None] | None = None) -> PrefixEntry | None:
        """The live prefix under ``salt`` (with exactly these image keys, in order, when
        ``images`` is given) that was used last: it or one of its conversation extensions created
        or attached most recently, i.e. the one the salt's last question computed or hit. None
        when there is none."""
        wanted = None if images is None else tuple(images)
        found = [e for e in self.prefixes.values()
                 if e.alive and e.salt == salt and (wanted is None or e.images == wanted)]
        return max(found, key=lambda e: max([e.last_used, *(c.last_used for c in e.children)]), default=None)

    # ------------------------------------------------------------------ users
    def acquire(self, match: Match, *, restoring: bool = False) -> list[int]:
        """Mark the entry in use and return the pages covering the match (references taken).
        ``restoring``: the entry may still be coming back from the host tier (the caller orders
        its reads after the copy: :meth:`PrefixReuse.restore
        <engine.cache.prefix_reuse.PrefixReuse.restore>`).

        Raises:
            RuntimeError: the entry was evicted, or its KV is not on the GPU (nor, with
                ``restoring``, on its way there).
        """
        entry = match.entry
        if not entry.alive:
            raise RuntimeError("acquire of an evicted prefix entry")
        if entry.tier != "gpu" and not (restoring and entry.base.tier == "restoring"):
            raise RuntimeError(f"acquire of a prefix entry whose KV is not on the GPU ({entry.tier})")
        entry.users += 1
        entry.hits += 1
        entry.last_used = next(_clock)
        pages = entry.pages[: self.pool.pages_for(match.kv_len)]
        self.pool.incref(pages)
        return pages

    def release_user(self, entry: PrefixEntry) -> None:
        entry.users -= 1

    # ------------------------------------------------------------------ insertion
    def add_prefix(self, key: str, salt: str, tokens: list[int], pages: list[int], kv_len: int,
                   dense_pages: int, visual_kept: int, *, images=(), spans=()) -> PrefixEntry | None:
        """Cache a freshly computed (and compacted) public prefix; takes references on ``pages``.
        ``images`` and ``spans``: see :class:`PrefixEntry`.

        Returns None when an entry with this key already exists.
        """
        if key in self.prefixes and self.prefixes[key].alive:
            return None
        entry = PrefixEntry(key, salt, list(tokens), list(pages), kv_len, len(tokens), dense_pages, visual_kept,
                            images=tuple(images), spans=tuple(spans))
        self.pool.incref(entry.pages)
        self.prefixes[key] = entry
        self._index(entry)
        return entry

    def add_extension(self, parent: PrefixEntry, tokens: list[int], pages: list[int], kv_len: int) -> PrefixEntry:
        """Cache a conversation's KV that extends prefix ``parent``; takes references on ``pages``."""
        base = parent if parent.parent is None else parent.parent
        entry = PrefixEntry(
            f"{base.key}+{next(_clock)}", base.salt, list(tokens), list(pages), kv_len,
            base.prefix_len, base.dense_pages, base.visual_kept, parent=base,
        )
        self.pool.incref(entry.pages)
        base.children.append(entry)
        self._index(entry)  # the parent's item is dropped when it surfaces: it is extended now
        return entry

    # ------------------------------------------------------------------ eviction
    @property
    def entries(self) -> list[PrefixEntry]:
        out = []
        for p in self.prefixes.values():
            out.append(p)
            out.extend(c for c in p.children if c.alive)
        return out

    @property
    def pages_held(self) -> int:
        return len({p for e in self.entries for p in e.pages})

    def evictable(self) -> list[PrefixEntry]:
        """Entries that may go now, in eviction order: unused, not extended by a live entry; lowest
        :meth:`PrefixEntry.value` first, then least recently used. Sorts every entry (for
        :meth:`clear` and for callers that want the whole order); :meth:`make_room` takes its
        victims from the eviction index instead, in this same order."""
        leaves = [e for e in self.entries
                  if e.users == 0 and e.tier != "restoring" and not any(c.alive for c in e.children)]
        return sorted(leaves, key=eviction_order)

    def make_room(self, pages_needed: int) -> bool:
        """Reclaim pages (:func:`~engine.cache.reclaim.reclaim_once`, the policy, repeatedly)
        until ``pages_needed`` are free, or will be once the offloads in flight land
        (:attr:`pending_pages`). Returns whether they are free
        now; False with :meth:`room_pending` true means "wait for the copies", not "preempt".

        Eviction victims are read from the eviction index in O(log n) per eviction (plus, per
        request reading an entry that would otherwise go first, one more heap operation) instead
        of a sort of every entry."""
        while self.pool.num_free + self.pending_pages < pages_needed:
            if not reclaim_once(self):
                break
        return self.pool.num_free >= pages_needed

    def keep_free(self, *, below: float = 1.0) -> int:
        """Offload idle families ahead of demand, up to the free-page watermark
        (:func:`~engine.cache.reclaim.keep_free`, ``below`` as there); the families offloaded."""
        return keep_free(self, below=below)

    def first_evictable(self, kinds: tuple[int, ...]) -> PrefixEntry | None:
        """The first entry of :meth:`evictable` among ``kinds`` (0: prefixes, 1: extensions) on the
        GPU, from the eviction index (left queued); None when none may go."""
        return self._first_evictable(kinds)

    def evict_unhit(self, pages_needed: int) -> bool:
        """Evict idle GPU entries that no request ever hit, least value first, until
        ``pages_needed`` pages are free: the only pages a warm may take beyond free ones (a warmed
        prefix is such an entry itself). Stops at the first entry in eviction order with a hit;
        never compacts or offloads. Returns whether the pages are free."""
        while self.pool.num_free < pages_needed:
            victim = self._first_evictable((0, 1))
            if victim is None or victim.hits > 0:
                return False
            self.evict(victim)
        return True

    def room_pending(self, pages_needed: int) -> bool:
        """Whether ``pages_needed`` pages are not free now but will be once the offloads in flight
        land (the caller waits a step instead of preempting a request)."""
        return self.pool.num_free < pages_needed <= self.pool.num_free + self.pending_pages

    @property
    def pending_pages(self) -> int:
        """GPU pages held by offloads in flight: free once their copies land."""
        return sum(len(f.pages) for f in self.in_flight.values() if f.kind == "offload")

    # ------------------------------------------------------------------ the host tier
    def family(self, entry: PrefixEntry) -> list[PrefixEntry]:
        """The prefix ``entry`` is or extends, then its live extensions: the unit that moves
        between the tiers."""
        base = entry.base
        return [base, *(c for c in base.children if c.alive)]

    @staticmethod
    def distinct(members: list[PrefixEntry], attr: str) -> list[int]:
        """The distinct pages (``attr``: ``"pages"`` or ``"host_pages"``) of ``members``, in order."""
        return list(dict.fromkeys(p for m in members for p in getattr(m, attr)))

    def _idle_family(self, base: PrefixEntry) -> list[PrefixEntry] | None:
        """``base``'s family if it may move to the host tier now: on the GPU, read by no request,
        every page held by its members alone (a request that dropped its attachment may still hold
        some); else None."""
        if not base.alive or base.tier != "gpu":
            return None
        members = self.family(base)
        if any(m.users for m in members):
            return None
        refcount = self.pool.refcount
        if len(members) == 1:  # one block table: distinct pages, each held once by it
            if any(refcount[p] != 1 for p in base.pages):
                return None
            return members
        held = Counter(p for m in members for p in m.pages)
        if any(refcount[p] != n for p, n in held.items()):
            return None
        return members

    def _family_order(self, base: PrefixEntry) -> tuple[float, int]:
        """The order families move and leave the host tier in, least first: the value of their
        most valuable member, then the most recent use of any."""
        members = self.family(base)
        return (max(m.value() for m in members), max(m.last_used for m in members))

    def coldest_idle_family(self) -> PrefixEntry | None:
        """The prefix of the idle GPU family (:meth:`_idle_family`) of least value, or None. The
        GPU prefixes are sorted by :meth:`_family_order` (stable: ties keep insertion order, as a
        ``min`` over them would) and checked for idleness in that order, so only the families
        ahead of the answer are checked (the check counts every page's references: it dominated
        a host hit's plan, which calls this once per offload of :func:`~engine.cache.reclaim.keep_free`)."""
        gpu = [e for e in self.prefixes.values() if e.alive and e.tier == "gpu" and e.pages]
        gpu.sort(key=self._family_order)
        return next((e for e in gpu if self._idle_family(e) is not None), None)

    def host_victims(self, pages_needed: int) -> list[PrefixEntry] | None:
        """The host families to drop, least value first, so ``pages_needed`` host pages are free:
        [] when they are already, None when dropping every idle one would not do."""
        free = self.host.num_free
        if free >= pages_needed:
            return []
        victims = []
        idle = (e for e in self.prefixes.values()
                if e.alive and e.tier == "host" and not any(m.users for m in self.family(e)))
        for base in sorted(idle, key=self._family_order):
            victims.append(base)
            free += len(self.distinct(self.family(base), "host_pages"))
            if free >= pages_needed:
                return victims
        return None

    def offload(self, base: PrefixEntry) -> int:
        """Move prefix ``base`` and its extensions to the host tier: host pages are taken, an
        :class:`~engine.cache.kv_transfer.Offload` order is recorded, the entries' GPU references
        pass to the copy (the pages are pending until it lands). Returns the GPU pages it frees.

        Raises:
            RuntimeError: the family is not idle (:meth:`_idle_family`).
            OutOfPagesError: the host tier has too few free pages.
        """
        members = self._idle_family(base)
        if members is None:
            raise RuntimeError("offload of a prefix entry that a request reads")
        pages = self.distinct(members, "pages")
        host_pages = self.host.allocate(len(pages))
        where = dict(zip(pages, host_pages, strict=True))
        xfer = next(self._xfer_ids)
        self.pool.incref(pages)  # the copy's, until it lands
        for m in members:
            m.host_pages = [where[p] for p in m.pages]
            self._host_refs.update(m.host_pages)
            self.pool.release(m.pages)
            m.pages = []
            m.tier = "host"
            self._queued.pop(m, None)  # GPU eviction never picks a host entry
        self.in_flight[xfer] = InFlight("offload", base, pages, host_pages)
        self.pool.orders.append(Offload(xfer, tuple(pages), tuple(host_pages)))
        self.stats.offloads += 1
        self.largest_offload = max(self.largest_offload, len(pages))
        return len(pages)

    def restore_pages(self, entry: PrefixEntry) -> int:
        """GPU pages a restore of ``entry``'s family takes."""
        return len(self.distinct(self.family(entry), "host_pages"))

    def restore(self, entry: PrefixEntry) -> int:
        """Bring ``entry``'s family back from the host tier: GPU pages are taken (the caller made
        room: :meth:`restore_pages`), a :class:`~engine.cache.kv_transfer.Restore` order is
        recorded, the family is ``"restoring"`` until it lands (:meth:`transfer_landed`).
        Returns the copy's transfer id.

        Raises:
            RuntimeError: the family is not on the host tier.
            OutOfPagesError: too few free GPU pages.
        """
        base = entry.base
        if not base.alive or base.tier != "host":
            raise RuntimeError("restore of a prefix entry that is not in the host tier")
        members = self.family(base)
        host_pages = self.distinct(members, "host_pages")
        pages = self.pool.allocate(len(host_pages))  # one reference each: the copy's, until it lands
        where = dict(zip(host_pages, pages, strict=True))
        xfer = next(self._xfer_ids)
        for m in members:
            m.pages = [where[h] for h in m.host_pages]
            self.pool.incref(m.pages)
            m.tier = "restoring"
        self.in_flight[xfer] = InFlight("restore", base, pages, host_pages)
        self.pool.orders.append(Restore(xfer, tuple(host_pages), tuple(pages)))
        self.stats.restores += 1
        return xfer

    def transfer_landed(self, done: TransferDone) -> None:
        """A copy reported by the runner finished: an offload's pending pages are freed; a restored
        family is on the GPU again (its host pages freed). A failed copy drops its family (its
        data cannot be trusted): a failed restore's family is reported by :meth:`take_failed`, so
        the requests waiting for it fail; nothing else does."""
        flight = self.in_flight.pop(done.xfer, None)
        self._landed.append(done.xfer)
        if flight is None:
            return
        base = flight.entry
        self.pool.release(flight.pages)
        if done.error is not None:
            self.stats.transfer_failures += 1
            if base.alive and (flight.kind == "restore" or base.tier == "host"):
                self._drop_family(base)
            if flight.kind == "restore":
                self._failed.append(base)
            return
        if flight.kind == "restore" and base.alive:
            base.restore_ms, base.restored_pages = done.ms, len(flight.pages)
            for m in self.family(base):
                self._host_release(m.host_pages)
                m.host_pages = []
                m.tier = "gpu"
            for m in self.family(base):
                self._index(m)

    def take_landed(self) -> list[int]:
        """The transfer ids landed since the last call (the next plan tells tensor-parallel ranks,
        whose own copies their forwards then wait for)."""
        landed, self._landed = self._landed, []
        return landed

    def take_failed(self) -> list[PrefixEntry]:
        """The prefixes whose restore failed since the last call (their families are gone)."""
        failed, self._failed = self._failed, []
        return failed

    def evict_host(self, base: PrefixEntry) -> None:
        """Drop ``base``'s family from the host tier (counted in ``cache_host_evictions``)."""
        self.stats.host_evictions += len(self.family(base))
        self._drop_family(base)

    def _drop_family(self, base: PrefixEntry) -> None:
        for child in [c for c in base.children if c.alive]:
            self._remove(child)
        self._remove(base)

    def _host_release(self, host_pages: list[int]) -> None:
        """Drop one host reference from each page; pages no entry lists go back to the host tier."""
        gone = []
        for h in host_pages:
            self._host_refs[h] -= 1
            if self._host_refs[h] == 0:
                del self._host_refs[h]
                gone.append(h)
        if gone:
            self.host.release(gone)

    # ------------------------------------------------------------------ in-flight computation
    def begin_compute(self, key: str) -> None:
        """A cold request started computing prefix ``key``: requests for it wait (one in-flight
        mechanism with restores: :meth:`waits_for`)."""
        self._computing[key] += 1

    def end_compute(self, key: str) -> None:
        """That request cached the prefix, or gave up (preempted, finished, failed)."""
        self._computing[key] -= 1
        if self._computing[key] <= 0:
            del self._computing[key]

    def waits_for(self, key: str, match: Match | None) -> bool:
        """Whether a request for prefix ``key`` (its current ``match``) must wait for a copy or a
        computation in flight: its entry is being restored, or, with no match, another request is
        computing the prefix."""
        if match is not None:
            return match.entry.alive and match.entry.base.tier == "restoring"
        return key in self._computing

    # ------------------------------------------------------------------ the eviction index
    # Every live entry that no live entry extends has a current item in the heap of its kind,
    # keyed by (value, last_used) as of when it was queued. An entry's key only grows (acquire
    # adds a hit and a later last_used; a compaction leaves fewer pages, a higher value), so an
    # item is never behind where its entry belongs: one whose key is out of date is requeued
    # under its new key when it surfaces, before anything below it is looked at. Users are read
    # when an item surfaces, since requests pin entries (users += 1) without telling the cache.

    def _index(self, entry: PrefixEntry) -> None:
        """Queue ``entry`` under its current key if it is a live leaf on the GPU (its older item goes
        stale)."""
        if not entry.alive or entry.tier != "gpu" or any(c.alive for c in entry.children):
            return
        token = next(self._tokens)
        self._queued[entry] = token
        heapq.heappush(self._heaps[entry.parent is not None], (*eviction_order(entry), token, entry))
        if len(self._heaps[0]) + len(self._heaps[1]) > 2 * len(self._queued) + 64:
            self._rebuild_index()

    def _rebuild_index(self) -> None:
        """Drop the stale items (dead entries, superseded keys), so the heaps stay O(entries)."""
        for heap in self._heaps:
            heap[:] = [item for item in heap if self._queued.get(item[3]) == item[2]]
            heapq.heapify(heap)

    def _first_evictable(self, kinds: tuple[int, ...]) -> PrefixEntry | None:
        """The first entry of :meth:`evictable` among ``kinds`` (0: prefixes, 1: extensions), left
        queued; None when none may go."""
        tops = [e for e in (self._peek(self._heaps[k]) for k in kinds) if e is not None]
        return min(tops, key=eviction_order, default=None)

    def _peek(self, heap: list) -> PrefixEntry | None:
        """The heap's least entry that may go now (not popped), dropping stale items and
        requeueing out-of-date keys on the way; entries a request reads are stepped over."""
        held = []
        found = None
        while heap:
            value, used, token, entry = heap[0]
            if self._queued.get(entry) != token or any(c.alive for c in entry.children):
                heapq.heappop(heap)
                if self._queued.get(entry) == token:  # extended: requeued when its last extension goes
                    del self._queued[entry]
                continue
            if (value, used) != eviction_order(entry):
                heapq.heappop(heap)
                self._index(entry)
                continue
            if entry.users:
                held.append(heapq.heappop(heap))
                continue
            found = entry
            break
        for item in held:
            heapq.heappush(heap, item)
        return found

    # ------------------------------------------------------------------ compaction on pressure
    def next_step(self, entry: PrefixEntry) -> int | None:
        """Index in :attr:`pressure_steps` of the step that would compact ``entry`` next (the first
        keeping a smaller share than it keeps now), or None when it has had every step."""
        ratio = entry.kept.keep_ratio if entry.kept is not None else 1.0
        return next((i for i, s in enumerate(self.pressure_steps) if s.keep_ratio < ratio), None)

    def compactable(self) -> list[tuple[PrefixEntry, int]]:
        """``(entry, step index)`` of every prefix a compaction step may shrink now, in compaction
        order: earlier steps first (every entry gets the first step before any gets the second),
        then lowest value, then least recently used. Only prefixes no request reads (``users ==
        0``, no live extension, every page held by the entry alone) qualify; :meth:`plan` says
        what the step keeps."""
        plans = []
        for entry in self.prefixes.values():
            step = self.next_step(entry)
            if (step is None or not entry.alive or entry.tier != "gpu" or entry.users or entry.kept is None
                    or any(c.alive for c in entry.children) or any(self.pool.refcount[p] != 1 for p in entry.pages)):
                continue
            plans.append((entry, step))
        return sorted(plans, key=lambda p: (p[1], p[0].value(), p[0].last_used))

    def plan(self, entry: PrefixEntry, step: int) -> torch.Tensor | None:
        """The logical positions (int64, increasing) step ``step`` keeps of ``entry``, chosen among
        those it keeps now, with the entry's stored selector scores; None when the step would
        free no page."""
        kept = self.step_keeps(entry, step)
        return kept if self.pool.pages_for(len(kept)) < len(entry.pages) else None

    def step_keeps(self, entry: PrefixEntry, step: int) -> torch.Tensor:
        """The logical positions (int64 ``[k]``, increasing) step ``step`` of
        :attr:`pressure_steps` would keep of prefix ``entry``, chosen among those it keeps now
        (``entry.kept``, which must be recorded), whether or not the step frees a page. Nothing
        is changed: :meth:`plan` and the viewer's preview (``Engine.prefix_info(preview=True)``)
        both read it."""
        return self.pressure_steps[step].kept_positions(entry.prefix_len, list(entry.spans), scores=entry.scores,
                                                        within=entry.kept.positions)

    def compact(self, entry: PrefixEntry, step: int, kept: torch.Tensor) -> int:
        """Compact prefix ``entry`` in place to the logical positions ``kept`` (int64 increasing, a
        subset of ``entry.kept.positions``), step ``step`` of :attr:`pressure_steps`: its
        extensions are dropped, the kept slots moved to the front of its pages, the pages past
        them freed, the kept tokens recorded. Its key stays. Returns the pages freed.

        Raises:
            RuntimeError: the entry is read by a request, extended, or holds shared pages.
        """
        if entry.users or entry.parent is not None or not entry.alive:
            raise RuntimeError("compaction of a prefix entry that a request reads")
        if entry.tier != "gpu":
            raise RuntimeError(f"compaction of a prefix entry whose KV is not on the GPU ({entry.tier})")
        children = [c for c in entry.children if c.alive]
        if any(c.users for c in children):
            raise RuntimeError("compaction of a prefix entry whose extension a request reads")
        for child in children:
            self.evict(child)
        if any(self.pool.refcount[p] != 1 for p in entry.pages):
            raise RuntimeError("compaction of a prefix entry holding shared pages")
        # physical slot i holds logical entry.kept.positions[i]: where each kept token is now
        src = torch.searchsorted(entry.kept.positions, kept).tolist()
        cfg = self.pressure_steps[step]
        owner = None
        if cfg.merge_values:  # fold the dropped tokens' V into kept neighbours before the move
            plan = value_merge_plan(entry.prefix_len, list(entry.spans), entry.kept.positions, kept,
                                    entry.kept.owner)
            self.pool.merge_values(entry.pages, [src[j] for j in plan.into.tolist()], plan.weight.tolist())
            owner = plan.owner
        before = len(entry.pages)
        entry.pages = self.pool.keep_slots(entry.pages, src)
        freed = before - len(entry.pages)
        entry.kv_len = len(src)
        entry.record_kept(KeptTokens(kept, cfg.method, cfg.keep_ratio, owner))
        self.stats.pressure_compactions += 1
        self.stats.pressure_pages_freed += freed
        return freed

    def evict(self, entry: PrefixEntry) -> None:
        self._remove(entry)
        if entry.parent is None:
            self.stats.prefix_evictions += 1
        else:
            self.stats.extension_evictions += 1

    def forget(self, salt: str) -> int:
        """Drop every entry of ``salt``, its prefixes and their extensions, whether or not a
        request reads one: the cache's references on their pages go now, and a request that
        attached an entry keeps its own (its pages are freed when it finishes; it keeps no
        conversation extension of a dropped entry). Not counted as evictions. Returns how many
        entries went."""
        gone = 0
        for entry in [e for e in self.prefixes.values() if e.salt == salt]:
            for child in list(entry.children):
                self._remove(child)
                gone += 1
            self._remove(entry)
            gone += 1
        return gone

    def _remove(self, entry: PrefixEntry) -> None:
        entry.alive = False
        self._queued.pop(entry, None)
        self.pool.release(entry.pages)  # a copy in flight holds its own references
        entry.pages = []
        self._host_release(entry.host_pages)
        entry.host_pages = []
        if entry.parent is None:
            if self.prefixes.get(entry.key) is entry:
                del self.prefixes[entry.key]
        else:
            entry.parent.children.remove(entry)
            self._index(entry.parent)  # a leaf again once its last live extension has gone

    def clear(self, *, host: bool = True) -> None:
        """Evict every entry that no running request uses, from both tiers (``host=False``: from
        the GPU only; entries on the host tier stay). Entries being restored stay."""
        while victims := [e for e in self.evictable() if host or e.tier == "gpu"]:
            for e in victims:
                if e.tier == "host":
                    self.stats.host_evictions += 1
                    self._remove(e)
                else:
                    self.evict(e)

    def counters(self) -> dict:
        """The cache's part of :meth:`Engine.stats() <engine.Engine.stats>`: entries (prefixes and
        conversation extensions), prefixes, pages held (all entries; of them the public prefixes',
        ``cache_prefix_pages``, against the pages those prefixes would take without compaction,
        ``cache_prefix_pages_dense``), hits, misses, stale fallbacks, evictions, prompt tokens
        saved, and the compactions made on pressure with the pages they freed
        (``cache_pressure_compactions``, ``cache_pressure_pages_freed``)."""
        prefixes = list(self.prefixes.values())
        return {
            "prefix_cache": True,
            "cache_entries": len(self.entries),
            "cache_prefixes": len(prefixes),
            "cache_pages": self.pages_held,
            "cache_prefix_pages": sum(len(e.pages) for e in prefixes),
            "cache_prefix_pages_dense": sum(e.dense_pages for e in prefixes),
            "cache_hits": self.stats.hits,
            "cache_misses": self.stats.misses,
            "cache_stale": self.stats.stale,
            "cache_evictions": self.stats.evictions,
            "cache_prefix_evictions": self.stats.prefix_evictions,
            "cache_extension_evictions": self.stats.extension_evictions,
            "prompt_tokens_saved": self.stats.tokens_saved,
            "cache_pressure_compactions": self.stats.pressure_compactions,
            "cache_pressure_pages_freed": self.stats.pressure_pages_freed,
            **self.host_counters(),
        }

    def host_counters(self) -> dict:
        """The host tier's part of :meth:`counters` (zeros without a host tier): its pages total
        and used, bytes allocated, prefixes on it now, offloads, restores, host evictions (entries;
        ``cache_evictions`` does not count moves to the host), hits on a host entry, failed copies."""
        host = self.host.counters() if self.host is not None else {
            "host_pages_total": 0, "host_pages_used": 0, "host_bytes_allocated": 0}
        return {
            **host,
            "cache_host_entries": sum(e.tier != "gpu" for e in self.prefixes.values()),
            "cache_offloads": self.stats.offloads,
            "cache_restores": self.stats.restores,
            "cache_host_evictions": self.stats.host_evictions,
            "cache_hits_host": self.stats.hits_host,
            "cache_transfer_failures": self.stats.transfer_failures,
        }

    def holders(self) -> list[list[int]]:
        """Page lists of all entries and of the copies in flight (for pool accounting checks)."""
        return [e.pages for e in self.entries] + [f.pages for f in self.in_flight.values()]

    def check_host(self) -> None:
        """Debug check of the host tier: each host page's references equal the entries listing it,
        and the tier's used pages are exactly those.

        Raises:
            AssertionError: describing the first inconsistency.
        """
        if self.host is None:
            return
        counts = Counter(h for e in self.entries for h in e.host_pages)
        assert counts == self._host_refs, "host page references out of sync with the entries"
        assert self.host.num_used == len(counts), (
            f"host tier: {self.host.num_used} pages used, {len(counts)} listed by entries")
