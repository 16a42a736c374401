"""Continuous batching: which requests run in the next step, with how many tokens.

Each step first gives every running request that is decoding one token, then spends the rest of
the step's token budget on prefill: first on running requests whose prompt is only partly
computed (chunked prefill), then on waiting requests in arrival order. So a long prompt is
prefilled in chunks between decode steps and never freezes running streams.

When the pool runs out of pages for a running request, the most recently arrived running request
is preempted: its pages are freed and it goes back to the front of the waiting queue, to be
recomputed later (its prompt and the tokens it already generated are prefilled again, so its
output does not change).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_cache import PagePool
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


@dataclass
class Batch:
    """The work of one step: ``(request, number of new tokens)`` pairs, in flat-batch order."""

    items: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    """Owns the waiting queue, the running set and their pages."""

    def __init__(self, pool: PagePool, config: SchedulerConfig):
        self.pool = pool
        self.config = config
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
            n = min(req.num_pending, budget)
            if self.pages_for(req.num_computed + n) - len(req.block_table) > self.pool.num_free:
                break  # admit in arrival order only; wait for pages
            self.waiting.popleft()
            req.block_table += self.pool.allocate(self.pages_for(n))
            req.status = Status.RUNNING
            self.running.append(req)
            batch.items.append((req, n))
            budget -= n
        for req, _ in batch.items:
            req.max_pages_held = max(req.max_pages_held, len(req.block_table))
        return batch

    def _prefill_chunk(self, req: Request, budget: int, batch: Batch) -> int:
        n = min(req.num_pending, budget)
        if self._grow(req, req.num_computed + n, batch):
            return n
        return 0

    def _grow(self, req: Request, num_tokens: int, batch: Batch) -> bool:
        """Give ``req`` pages for ``num_tokens`` tokens, preempting later requests if needed.

        Returns False when ``req`` itself had to be preempted.
        """
        need = self.pages_for(num_tokens) - len(req.block_table)
        while need > self.pool.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            batch.preempted.append(victim)
            batch.items = [(r, n) for r, n in batch.items if r is not victim]
            if victim is req:
                return False
        if need > 0:
            req.block_table += self.pool.allocate(need)
        return True

    def preempt(self, req: Request) -> None:
        """Free ``req``'s pages and put it back at the front of the waiting queue."""
        self.pool.release(req.block_table)
        req.block_table = []
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
        self.pool.release(req.block_table)
        req.block_table = []
        req.status = Status.FINISHED
