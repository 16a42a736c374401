"""CPU profile of one host-hit admission's cache work at the 8B working-set shape (issue 33).

No model: a :class:`~engine.cache.kv_pool.PagePool` of 3,518 pages of 16 tokens over 36 layers
(one KV head of 2 dims, so the tensors are tiny and only the bookkeeping costs), a
:class:`~engine.cache.host_pool.HostPool` of as many pages, and a
:class:`~engine.cache.prefix_cache.PrefixCache` with the engine's default ``on_pressure`` step
(uniform, keep 0.6, min_keep 16) and ``reclaim_order="offload_first"``. 56 image-prefix families of
2-9 photos (30-170 dense pages each, a few with a conversation extension) are cached through the
real policy (``make_room`` before each), then a steady state of host hits runs: each iteration
takes the coldest host family, and does what the scheduler's ``_admit`` host path and the end of
``schedule()`` do, in the same order: ``restore_pages``, ``make_room`` (with the entry pinned),
``restore`` + ``acquire``, ``keep_free``; then (untimed) the copies land through
:class:`~engine.cache.kv_transfer.KVTransfers` and the request finishes.

Printed: p50 / p90 of each phase (ms), a fingerprint of every move the policy made (offloads,
restores, evictions, compactions, in order: equal before and after a speed-up means the same
decisions), the top cumulative functions of a cProfile of the timed phases, and the CPU
``KVTransfers.submit`` of a ~103-page Restore (not representative of CUDA's path, which builds
the same index rows with ``pool.rows`` and pins them, but queues copies instead of running them).

Usage: ``python benchmarks/profile_admission.py [--iters 300] [--seed 0] [--top 25] [--no-keep-free]``
(``--no-keep-free``: no offloads ahead of demand, so ``make_room``'s reclaim loop does the work).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import pstats
import random
import statistics
import time

import torch

from engine.cache.compaction import CompactionConfig
from engine.cache.host_pool import HostPool
from engine.cache.kv_pool import PagePool
from engine.cache.kv_transfer import KVTransfers, Offload, Restore
from engine.cache.prefix_cache import KeptTokens, PrefixCache
from engine.model.rope import VisualSpan

PAGE = 16
LAYERS = 36
POOL_PAGES = 3518
FAMILIES = 56


class Moves:
    """Records every move the cache makes (wrapping its methods), for a decision fingerprint."""

    def __init__(self, cache: PrefixCache):
        self.log: list[str] = []
        for name in ("offload", "restore", "evict", "evict_host", "compact"):
            orig = getattr(cache, name)

            def wrapped(entry, *a, _orig=orig, _name=name):
                self.log.append(f"{_name}:{entry.key}")
                return _orig(entry, *a)
            setattr(cache, name, wrapped)

    def digest(self) -> str:
        return hashlib.sha256("\n".join(self.log).encode()).hexdigest()[:16]


def build(seed: int):
    pool = PagePool(num_layers=LAYERS, num_kv_heads=1, head_dim=2, num_pages=POOL_PAGES, page_size=PAGE,
                    kv_cache_dtype="fp8_e4m3")
    host = HostPool(pool, POOL_PAGES, pin=False)
    steps = (CompactionConfig("uniform", 0.6, min_keep=16),)
    cache = PrefixCache(pool, steps, host=host, reclaim_order="offload_first")
    return cache, KVTransfers(pool, host)


def step(cache: PrefixCache, transfers: KVTransfers) -> None:
    """Apply the orders between two plans as the runner does, then report what landed."""
    for order in cache.pool.take_orders():
        if isinstance(order, (Offload, Restore)):
            transfers.submit(order)
        else:
            cache.pool.apply(order)
    for done in transfers.poll():
        cache.transfer_landed(done)


def add_family(cache: PrefixCache, transfers: KVTransfers, rng: random.Random, i: int) -> None:
    photos = rng.randint(2, 9)
    dense = rng.randint(30, 170)
    prefix_len = dense * PAGE - rng.randint(0, PAGE - 1)
    text = 8 + photos * 4
    per = (prefix_len - text) // photos
    spans, pos = [], 4
    for item in range(photos):
        w = max(1, int(per ** 0.5))
        h = max(1, per // w)
        spans.append(VisualSpan(start=pos, grid_h=h, grid_w=w, kind="image", item=item, frame=0))
        pos += h * w + 2
    prefix_len = max(prefix_len, pos + 2)
    n = cache.pool.pages_for(prefix_len)
    cache.make_room(n)
    step(cache, transfers)
    if not cache.make_room(n):
        return
    pages = cache.pool.allocate(n)
    tokens = [1000 * i + t for t in range(prefix_len)]
    entry = cache.add_prefix(f"fam{i:02d}", "s", tokens, pages, prefix_len, n, prefix_len - text,
                             images=tuple(f"img{i}.{k}" for k in range(photos)), spans=tuple(spans))
    cache.pool.release(pages)
    entry.record_kept(KeptTokens(torch.arange(prefix_len), None, 1.0))
    g = torch.Generator().manual_seed(i)
    entry.scores = {"uniform": torch.rand(prefix_len, generator=g)}
    entry.hits = rng.randint(0, 3)
    if rng.random() < 0.15:  # a conversation extension: the prefix plus a finished turn
        extra = rng.randint(20, 60)
        last = entry.pages[-1]
        more = cache.pool.allocate(cache.pool.pages_for(prefix_len + extra) - n + 1)
        cache.pool.incref(entry.pages[:-1])
        ext_pages = [*entry.pages[:-1], *more]
        del last
        cache.add_extension(entry, [*tokens, *range(extra)], ext_pages, prefix_len + extra)
        cache.pool.release(ext_pages)


def admit_host_hit(cache: PrefixCache, entry, first: int, timings: dict[str, list[float]], ahead: bool = True):
    """The scheduler's host-hit admission and the end of its plan, phase by phase."""
    from engine.cache.prefix_cache import Match
    pool = cache.pool
    match = Match(entry, entry.prefix_len)
    t0 = time.perf_counter()
    need = cache.restore_pages(entry) + pool.pages_for(match.kv_len + first) - pool.pages_for(match.kv_len) + 1
    t1 = time.perf_counter()
    entry.users += 1  # reuse.pinned
    room = pool.num_free >= need or cache.make_room(need)
    entry.users -= 1
    t2 = time.perf_counter()
    if room:
        cache.restore(entry)
        pages = cache.acquire(match, restoring=True)
    t3 = time.perf_counter()
    if ahead:
        cache.keep_free()
    t4 = time.perf_counter()
    for k, v in (("restore_pages", t1 - t0), ("make_room", t2 - t1), ("restore+acquire", t3 - t2),
                 ("keep_free", t4 - t3), ("total", t4 - t0)):
        timings.setdefault(k, []).append(v * 1e3)
    return pages if room else None


def coldest_host(cache: PrefixCache):
    host = [e for e in cache.prefixes.values() if e.alive and e.tier == "host"]
    return min(host, key=cache._family_order, default=None)


def run(iters: int, seed: int, profile: cProfile.Profile | None, ahead: bool = True):
    rng = random.Random(seed)
    cache, transfers = build(seed)
    moves = Moves(cache)
    for i in range(FAMILIES):
        add_family(cache, transfers, rng, i)
    step(cache, transfers)
    timings: dict[str, list[float]] = {}
    restored = []
    for _ in range(iters):
        entry = coldest_host(cache)
        if entry is None:
            break
        if profile is not None:
            profile.enable()
        pages = admit_host_hit(cache, entry, rng.randint(16, 64), timings, ahead)
        if profile is not None:
            profile.disable()
        step(cache, transfers)  # the copies land
        restored.append(cache.restore_pages(entry) if entry.tier == "host" else len(entry.pages))
        if pages is not None:  # the request finishes
            cache.pool.release(pages)
            cache.release_user(entry)
        step(cache, transfers)
        cache.pool.check([*cache.holders()])
        cache.check_host()
    return cache, transfers, moves, timings, restored


def bench_submit(reps: int) -> list[float]:
    """CPU ``KVTransfers.submit`` of a 103-page Restore (and its Offload back, untimed)."""
    cache, transfers = build(0)
    pool, host = cache.pool, cache.host
    out = []
    for _ in range(reps):
        pages = pool.allocate(103)
        hp = host.allocate(103)
        transfers.submit(Offload(1, tuple(pages), tuple(hp)))
        transfers.poll()
        t = time.perf_counter()
        transfers.submit(Restore(2, tuple(hp), tuple(pages)))
        out.append((time.perf_counter() - t) * 1e3)
        transfers.poll()
        pool.release(pages)
        host.release(hp)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-keep-free", action="store_true",
                    help="no offloads ahead of demand: make_room's reclaim loop does the work")
    args = ap.parse_args()
    ahead = not args.no_keep_free
    cache, _, moves, timings, restored = run(args.iters, args.seed, None, ahead)
    stats = cache.counters()
    print(f"pool {POOL_PAGES} pages x {LAYERS} layers, host {POOL_PAGES}; {len(cache.prefixes)} prefixes, "
          f"{len(cache.entries)} entries; {len(timings.get('total', []))} host hits, median restore "
          f"{statistics.median(restored) if restored else 0:.0f} pages")
    print(f"offloads {stats['cache_offloads']} restores {stats['cache_restores']} host evictions "
          f"{stats['cache_host_evictions']} evictions {stats['cache_evictions']} compactions "
          f"{stats['cache_pressure_compactions']}; moves {len(moves.log)}, fingerprint {moves.digest()}")
    for k, v in timings.items():
        q = statistics.quantiles(v, n=10)
        print(f"  {k:16s} p50 {statistics.median(v):7.3f} ms   p90 {q[-1]:7.3f} ms")
    sub = bench_submit(50)
    print(f"  KVTransfers.submit Restore(103 pages) on CPU: p50 {statistics.median(sub):.3f} ms "
          "(CPU path: runs the copies; CUDA's queues them, so not representative)")
    rows = [(time.perf_counter(), cache.pool.rows(list(range(103)), device="cpu"), time.perf_counter())
            for _ in range(200)]
    print(f"  pool.rows(103 pages) p50 {statistics.median((b - a) * 1e3 for a, _, b in rows):.3f} ms "
          "(the index rows CUDA's submit builds, before pinning)")
    prof = cProfile.Profile()
    run(min(args.iters, 100), args.seed, prof, ahead)
    print(f"\ncProfile of the timed phases (100 host hits), top {args.top} by cumulative time:")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
