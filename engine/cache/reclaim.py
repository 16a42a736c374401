"""How the prefix cache frees KV pages when the pool runs short: the one policy.

:func:`reclaim_once` chooses the next move among those :class:`~engine.cache.prefix_cache.PrefixCache`
can make (offload a family to the host tier, drop host families, evict an idle extension, compact a
prefix one step, evict a GPU entry), the one that loses least, priced by :class:`ReclaimCosts`;
``PrefixCache.make_room`` repeats it. :func:`keep_free` offloads ahead of demand. The same policy
is written as pseudocode in docs/ARCHITECTURE.md ("Reclaiming KV pages"). This module decides;
the cache moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .prefix_cache import PrefixCache, PrefixEntry

#: The orders in which :func:`reclaim_once` tries its moves (see there).
RECLAIM_ORDERS = ("offload_first", "compact_first")


@dataclass(frozen=True)
class ReclaimCosts:
    """What :func:`reclaim_once` weighs, in one currency: prompt tokens recomputed.

    Each candidate move's expected loss is ``(1 + hits)`` (the entry's uses so far, a proxy of
    how often it is used again) times its cost per use, divided by the GPU pages it frees; the
    move of least loss per page is made.

    Attributes:
        restore_tokens_per_page: cost of bringing one page back from the host tier, as the prompt
            tokens whose recompute takes as long. Default 0.4: at the 8B shape a page (16 tokens,
            ~1.2 MB of Scaled-FP8 K/V and scales over 36 layers) restores in ~0.022 ms at the
            measured ~54 GB/s of pinned host-to-GPU copies (issue 33), while a cold question
            costs ~94 ms for ~1,650 prompt tokens, ~0.057 ms a token (docs/PERFORMANCE.md).
        compaction_price: cost of one compaction step of a prefix, as a share of recomputing the
            whole prefix once per later use: the answers lose accuracy (probe model, uniform keep
            0.6: 90.0% dense against 71.9%, docs/QUALITY.md) on every later question, not once. 1.0
            prices a compaction like an eviction of the same tokens, so a compaction (which frees
            only the share it drops) loses to dropping a colder entry from the host tier.
    """

    restore_tokens_per_page: float = 0.4
    compaction_price: float = 1.0


def reclaim_once(cache: PrefixCache) -> bool:
    """Free GPU pages of ``cache`` by one move, the one that loses least:

    1. ``lossy`` = with pressure steps, the idle extension of least value (evicted: its tail is
       recomputed on its next use), else the next compaction step (``compactable``); None
       without pressure steps.
    2. With a host tier, ``unit`` = the idle GPU family of least value (a prefix and its
       extensions no request reads). Under ``reclaim_order="compact_first"`` a ``lossy`` move goes
       first. If the host tier has room for ``unit``, it is offloaded (lossless). If not, the host
       families of least value that would make room are the alternative: dropping them and
       offloading ``unit`` costs their recompute plus ``unit``'s restore; that is done when it
       costs less per GPU page freed than ``lossy`` (:class:`ReclaimCosts`).
    3. Else ``lossy`` is made.
    4. Else the GPU entry of least value is evicted (last).

    Returns whether a move was made (False: nothing may go)."""
    unit = cache.coldest_idle_family() if cache.host is not None else None
    # ``lossy`` is looked for when it is read: under offload_first only once an offload is priced,
    # and then only as far as the comparison needs (a compaction plan runs a selector)
    lossy = lossy_move(cache) if unit is None or cache.reclaim_order == "compact_first" else _LATER
    if unit is not None and not (cache.reclaim_order == "compact_first" and lossy is not None):
        pages = cache.distinct(cache.family(unit), "pages")
        victims = cache.host_victims(len(pages))
        if victims is not None:
            loss = sum(recompute_loss(cache, v) for v in victims) + restore_loss(cache, unit, len(pages))
            if lossy is _LATER:
                lossy = lossy_move(cache, against=loss / len(pages))
            if lossy is None or loss / len(pages) <= lossy[-1]:
                for victim in victims:
                    cache.evict_host(victim)
                cache.offload(unit)
                return True
    if lossy is _LATER:
        lossy = lossy_move(cache)
    if lossy is not None:
        kind, entry, *rest = lossy
        if kind == "evict":
            cache.evict(entry)
        else:
            step, kept, _ = rest
            cache.compact(entry, step, kept)
        return True
    victim = cache.first_evictable((0, 1))
    if victim is None:
        return False
    cache.evict(victim)
    return True


def keep_free(cache: PrefixCache, *, below: float = 1.0) -> int:
    """Offload idle families ahead of demand (lossless moves only, while the host tier has room,
    never under ``reclaim_order="compact_first"``) until the free and pending pages reach the
    watermark: the largest family offloaded so far, at most an eighth of the pool. A hit on a
    host family then finds its pages free at once and waits for one copy only, not for an
    offload first and then its restore. With ``below`` < 1 nothing is offloaded unless the free
    and pending pages are under that share of the watermark (then it is filled). Called by the
    scheduler when it plans (``Scheduler._keep_free`` says which plans). Returns the families
    offloaded."""
    if cache.host is None or cache.reclaim_order != "offload_first":
        return 0
    target = min(cache.pool.num_pages // 8, cache.largest_offload)
    if cache.pool.num_free + cache.pending_pages >= below * target:
        return 0
    moved = 0
    while cache.pool.num_free + cache.pending_pages < target:
        unit = cache.coldest_idle_family()
        if unit is None or cache.host.num_free < len(cache.distinct(cache.family(unit), "pages")):
            break
        cache.offload(unit)
        moved += 1
    return moved


#: :func:`reclaim_once`'s placeholder for a ``lossy`` move not looked for yet.
_LATER = object()


def lossy_move(cache: PrefixCache, against: float | None = None) -> tuple | None:
    """The pressure steps' next move, as before the host tier: ``("evict", extension, loss per
    page)`` for the idle extension of least value, else ``("compact", prefix, step, kept, loss per
    page)`` for the first compaction that frees a page; None without pressure steps or when
    neither exists.

    ``against``: a loss per page the caller only compares with the move's (``against <= loss``
    wins). When no compaction could lose less than it (a step frees at most the entry's pages, so
    its loss per page is at least its tokens' price over all its pages), no plan is computed and
    ``("bound", None, lower bound)`` is returned: the comparison comes out as with the real move."""
    if not cache.pressure_steps:
        return None
    idle = cache.first_evictable((1,))
    if idle is not None:
        own = [p for p in idle.pages if cache.pool.refcount[p] == 1]
        tail = len(idle.tokens) - idle.prefix_len
        return ("evict", idle, (1 + idle.hits) * tail / max(1, len(own)))
    candidates = cache.compactable()
    if against is not None and candidates:
        bound = min((1 + e.hits) * len(e.tokens) * cache.costs.compaction_price / max(1, len(e.pages))
                    for e, _ in candidates)
        if against <= bound:
            return ("bound", None, bound)
    for entry, step in candidates:
        kept = cache.plan(entry, step)
        if kept is not None:
            freed = len(entry.pages) - cache.pool.pages_for(len(kept))
            loss = (1 + entry.hits) * len(entry.tokens) * cache.costs.compaction_price / freed
            return ("compact", entry, step, kept, loss)
    return None


def recompute_loss(cache: PrefixCache, base: PrefixEntry) -> float:
    """Expected prompt tokens recomputed if ``base``'s family is dropped: each member's own tokens
    (an extension's beyond its prefix) times its uses."""
    return sum((1 + m.hits) * (len(m.tokens) - (m.prefix_len if m.parent is not None else 0))
               for m in cache.family(base))


def restore_loss(cache: PrefixCache, base: PrefixEntry, pages: int) -> float:
    """Expected cost (prompt tokens) of restoring ``base``'s family of ``pages`` pages again."""
    uses = 1 + sum(m.hits for m in cache.family(base))
    return uses * pages * cache.costs.restore_tokens_per_page
