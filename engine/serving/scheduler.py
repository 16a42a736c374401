"""Continuous batching: which requests run in the next step, with how many tokens.

One rule explains it: every request's ``num_computed`` (tokens whose K/V is stored) catches up with
its ``len(tokens)``. A prompt's first chunks, chunked prefill, a prefix hit (which starts with the
attached prefix counted as computed), recomputation after preemption and decode (one new token a
step) are all that rule under the step's token budget.

Each step first gives every running request that is decoding one token, then spends the rest of
the step's token budget on prefill: first on running requests whose prompt is only partly
computed (chunked prefill), then on waiting requests in arrival order. So a long prompt is
prefilled in chunks between decode steps and never freezes running streams.

When the pool runs out of pages for a running request, the most recently arrived running request
is preempted: its pages are freed and it goes back to the front of the waiting queue, to be
recomputed later (its prompt and the tokens it already generated are prefilled again, so its
output does not change).

Cached prefixes yield to running requests: before anyone is preempted, and before a waiting
request is kept waiting for pages, unused prefix-cache entries are evicted.
A request whose public prefix was found in the cache attaches the entry's pages at admission (or
falls back to computing everything, reported as ``stale``, when the entry was evicted since): the
scheduler decides when, :class:`~engine.cache.prefix_reuse.PrefixReuse` does the attaching.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..cache.kv_pool import PagePool
from ..cache.prefix_reuse import PrefixReuse
from .batch import Batch
from .request import Request, Status


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step.

    Attributes:
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: most tokens (prefill + decode) computed in one step.
        max_waiting: most requests waiting; more are refused with EngineOverloadedError.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    max_waiting: int = 256


class Scheduler:
    """Owns the waiting queue, the running set and their pages.

    Args:
        pool: the KV pool.
        config: the step limits.
        reuse: the prefix cache's bookkeeping, or None when prefix caching is off.
    """

    def __init__(self, pool: PagePool, config: SchedulerConfig, reuse: PrefixReuse | None = None):
        self.pool = pool
        self.config = config
        self.reuse = reuse
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.pool.page_size)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.config.max_num_batched_tokens
        for req in list(self.running):
            if req.status is not Status.RUNNING or req.is_prefilling or budget <= 0:
                continue
            if self._grow(req, len(req.tokens), batch):
                batch.items.append((req, 1))
                budget -= 1
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is Status.RUNNING and req.is_prefilling:
                n = self._prefill_chunk(req, budget, batch)
                if n:
                    batch.items.append((req, n))
                    budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self._admit(req):
                break  # admit in arrival order only; wait for pages
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            n = self._chunk(req, budget)
            if self._grow(req, req.num_computed + n, batch):
                batch.items.append((req, n))
                budget -= n
        for req, _ in batch.items:
            req.max_pages_held = max(req.max_pages_held, len(req.block_table))
        return batch

    def _prefill_chunk(self, req: Request, budget: int, batch: Batch) -> int:
        n = self._chunk(req, budget)
        if self._grow(req, req.num_computed + n, batch):
            return n
        return 0

    @staticmethod
    def _chunk(req: Request, budget: int) -> int:
        n = min(req.num_pending, budget)
        if req.cold_prefix and req.num_computed < req.prompt.prefix_len:
            n = min(n, req.prompt.prefix_len - req.num_computed)  # compaction happens at the boundary
        return n

    def _admit(self, req: Request) -> bool:
        """Attach the request's cached prefix (if still there) and check its first chunk can get
        pages. Returns False (nothing changed) when it must keep waiting."""
        match = self.reuse.admission_match(req) if self.reuse is not None else None
        if match is not None:
            first = min(len(req.tokens) - match.length, self.config.max_num_batched_tokens)
            need = self.pages_for(match.kv_len + first) - self.pages_for(match.kv_len) + 1
            with self.reuse.pinned(match):  # making room must not evict the entry itself
                room = self._free_pages(need)
            if not room:
                if self.running:
                    return False  # running requests will free pages
                # Review fix: nothing runs, so no page will ever be freed; the pinned entry (and its
                # parent) hold pages this request cannot use (a partly filled last page it would
                # copy, the parent's own last page, an extension's tail), so waiting spun forever
                # on a request that fits the pool. Compute it cold instead: the entry becomes
                # evictable.
                self.reuse.drop(req)
                match = None
        if match is not None:
            self.reuse.attach(req, match)
            return True
        if req.prefix_key is not None:
            req.cold_prefix = True
        first = self._chunk(req, self.config.max_num_batched_tokens)
        return self._free_pages(self.pages_for(first))

    def _free_pages(self, n: int) -> bool:
        if self.pool.num_free >= n:
            return True
        return self.reuse is not None and self.reuse.make_room(n)

    def _grow(self, req: Request, num_tokens: int, batch: Batch) -> bool:
        """Give ``req`` pages for its first ``num_tokens`` logical tokens (and a private copy of a
        shared, partly filled last page), evicting cache entries and then preempting later
        requests if needed. Returns False when ``req`` itself had to be preempted."""
        page = self.pool.page_size
        table = req.block_table
        cow = bool(table) and req.kv_len % page != 0 and self.pool.is_shared(table[-1])
        need = self.pages_for(num_tokens - req.kv_offset) - len(table) + cow
        while not self._free_pages(need):
            victim = self.running[-1]
            if victim is req and len(self.running) == 1 and req.attached is not None:
                # Review fix: alone, ``req`` pins the entry it is attached to (and its parent),
                # whose pages it only partly uses; preempting itself re-attached the same entry on
                # re-admission, a livelock. Drop the attachment (its own page references stay),
                # evict the now unused entries (everything else was evicted already), and retry
                # with the copy-on-write need recomputed.
                self.reuse.detach(req)
                self.reuse.cache.clear()
                return self._grow(req, num_tokens, batch)
            self.preempt(victim)
            batch.preempted.append(victim)
            batch.items = [(r, n) for r, n in batch.items if r is not victim]
            if victim is req:
                return False
        if cow:
            self.pool.fork_last(table)
            need -= 1
        if need > 0:
            table += self.pool.allocate(need)
        return True

    def preempt(self, req: Request) -> None:
        """Free ``req``'s pages and put it back at the front of the waiting queue.

        On re-admission it attaches its cached prefix again if that is still there.
        """
        self._detach(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.telemetry.preempted += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Remove a finished or cancelled request and free its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._detach(req)
        req.status = Status.FINISHED

    def _detach(self, req: Request) -> None:
        self.pool.release(req.block_table)
        req.block_table = []
        req.kv_offset = 0
        req.cold_prefix = False
        req.match = None  # a preempted request looks its prefix up again when re-admitted
        if self.reuse is not None:
            self.reuse.detach(req)
