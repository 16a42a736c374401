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

With a host tier, cached prefixes also move to host memory and back; those copies run beside the
steps and never preempt anyone: a request whose pages an offload in flight will free waits a
step. A request whose entry is on the host tier is admitted with its restore: its first prefill
chunk rides the plan that carries the copy, and the runner's forward waits for the copy on the
GPU (the step carrying it is later by what is left of the copy; the question is not later by a
step); one that arrives while a step runs may have its copy started then, to overlap that step
(:meth:`Scheduler.restore_early`). A request whose entry is being restored for another, or
whose prefix another request is computing now, waits while the requests behind it are admitted
past it (then attaches it: one computation, one copy). See docs/ARCHITECTURE.md, "Reclaiming KV pages".

Warms (``Engine.warm``: a session's public prefix built before its first question) sit below
everything else: they wait in a queue of their own, outside the arrival order of questions, and
are admitted only when no question is left waiting for pages; their prefill chunks take what the
step's budget leaves. While the engine is contended (a question runs or waits) they are bounded
twice: a step carries at most ``max_warm_tokens`` of them and reaches at most ``max_warm_images``
new images (the per-step stall; the vision encoder runs inside the step), and a step carries them
only when the warms' time budget allows (:mod:`engine.serving.warm_budget`: a token bucket that
grows by ``warm_time_share`` of the wall-clock time and is spent by the measured execution time of
the steps that carried warm chunks, reported by the loop through :meth:`Scheduler.step_done`).
A warm whose prefix a question waits for (the question joined it) is promoted: neither bound
applies to it, a person is waiting. With nothing contended a warm goes at full speed. At most
``max_warms_running`` run at once. A
warm takes only free pages, or the pages of idle entries no request ever hit (a warmed prefix is
one): it never compacts, offloads or evicts anything of more value, never preempts, and is the
first preempted when a question needs its pages (it goes back to its queue). A question whose
prefix a warm is computing waits for it and hits it, as for any computation in flight.

The scheduler is the one writer of request state (``num_computed``, ``block_table``, ``status``,
``kv_offset``, the attached entry): :meth:`Scheduler.schedule` returns a
:class:`~engine.serving.plan.StepPlan` (data, no live requests), the runner executes it, and
:meth:`Scheduler.update` applies the plan and the runner's
:class:`~engine.serving.plan.StepOutput` to the requests (and compacts and caches a cold prefix
the step completed). The cache code it calls returns what changed; the pool's data moves it
decides travel in the next plan.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..cache.kv_pool import PagePool
from ..cache.kv_transfer import Restore, fold_page_copies
from ..cache.prefix_reuse import PrefixReuse
from ..errors import EngineOverloadedError, PrismError
from .plan import NewRequest, ScheduledRun, StepOutput, StepPlan
from .request import Request, Status
from .warm_budget import WarmBudget


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step.

    Attributes:
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: most tokens (prefill + decode) computed in one step.
        max_waiting: most questions waiting, and apart from them most warms waiting; more are
            refused with EngineOverloadedError.
        max_warm_tokens: most prefill tokens of warms in one contended step (the stall one such
            step adds to the running streams). 512: at the 8B shape on the H200 a step carrying a
            warm chunk beside decode rows runs the eager forward (~15-20 ms of launch overhead
            whatever its tokens); with 1024 tokens and 4 images such a step took 48-92 ms (the
            first of a process compiles: docs/gpu/warm_http_8b_process_budget_v1.*) and the one
            a 256-token stream met raised its TPOT 1.059x, over the 5% goal. Halved, the step
            still took 51-81 ms (2026-12-03, docs/gpu/warm_http_8b_process_budget_v2.*: the eager
            step's fixed cost dominates), so the time budget, not this bound, keeps streams whole.
        max_warm_images: most images (or videos) a contended step's warm chunks reach for the first
            time, so encode (the encoder runs inside the step). 2: 512 tokens of 512 x 512 photos
            (~306 tokens each) reach at most 2 (~5 ms an image there, encoded together). 0: no
            bound.
        max_warms_running: most warms holding pages at once.
        warm_time_share: share of the wall-clock time, in (0, 1], the steps carrying warm chunks
            may take while contended (:class:`~engine.serving.warm_budget.WarmBudget`); 1: no time
            budget (the per-step bounds alone). 0.03: a warm's own GPU work for 8 photos (~75 ms)
            is ~5.6% of a 256-token stream at the 8B shape, so an unbudgeted warm alone would
            exceed the 5% TPOT goal of a stream beside it.
        warm_burst_s: most credit (seconds) the budget banks while a warm waits, and the most a
            step carrying warm chunks waits for (a dearer step, and the first one, whose cost is
            not known yet, run once the bucket is full): about one warm step.

    Raises:
        ValueError: ``warm_time_share`` outside (0, 1] or a negative ``warm_burst_s``.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    max_waiting: int = 256
    max_warm_tokens: int = 512
    max_warm_images: int = 2
    max_warms_running: int = 2
    warm_time_share: float = 0.03
    warm_burst_s: float = 0.05

    def __post_init__(self):
        if not 0 < self.warm_time_share <= 1:
            raise ValueError(f"warm_time_share must be in (0, 1], got {self.warm_time_share!r}")
        if not self.warm_burst_s >= 0:
            raise ValueError(f"warm_burst_s must be >= 0, got {self.warm_burst_s!r}")


@dataclass
class WarmStats:
    """Counters of warms (``Engine.stats()``): ``warms`` taken, ``warms_computed`` (their prefix
    built and cached), ``warms_cached`` (cached already, or built by another request meanwhile:
    nothing computed), ``warms_cancelled``, ``warms_dropped`` (no room, and nothing running that
    could free some), ``warms_deferred_steps`` (steps in which a warm chunk waited for the warms'
    time budget while questions ran)."""

    warms: int = 0
    warms_computed: int = 0
    warms_cached: int = 0
    warms_cancelled: int = 0
    warms_dropped: int = 0
    warms_deferred_steps: int = 0


class _Admission(enum.Enum):
    """What admitting a waiting request came to."""

    ADMITTED = "admitted"
    NO_PAGES = "no_pages"  # keep it and everyone after it waiting (arrival order)
    IN_FLIGHT = "in_flight"  # it waits for a copy or a computation in flight: admit others past it


@dataclass
class _Draft:
    """The step being decided: ``(request, new tokens)`` pairs and the requests preempted for it."""

    items: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    """Owns the waiting queue, the running set, their pages and their state.

    Args:
        pool: the KV pool.
        config: the step limits.
        reuse: the prefix cache's bookkeeping, or None when prefix caching is off.
        clock: monotonic seconds, for the warms' time budget (tests pass a fake).
    """

    def __init__(self, pool: PagePool, config: SchedulerConfig, reuse: PrefixReuse | None = None, *,
                 clock: Callable[[], float] = time.monotonic):
        self.pool = pool
        self.config = config
        self.reuse = reuse
        self.waiting: deque[Request] = deque()
        self.warming: deque[Request] = deque()  # warms not admitted yet, in their own order
        self.running: list[Request] = []
        self.warm_stats = WarmStats()
        self._warmed: list[tuple[Request, str]] = []  # warms done, with their reason, for the loop to finish
        self._warms_preempted: list[int] = []  # warms that gave their pages to a question, for the plan
        self._requests: dict[int, Request] = {}  # every request added and not finished, by id
        self.warm_budget = WarmBudget(config.warm_time_share, config.warm_burst_s, clock)
        self._budgeted = 0  # warm tokens of the step being planned that the budget pays for
        self._charges: list[tuple[StepPlan, int]] = []  # plans with budgeted warm tokens, until step_done
        self._known: set[int] = set()  # ids the runner was sent (NewRequest) and still holds
        self._ended: list[int] = []  # of those, the ones finished since the last plan
        self._failures: list[tuple[Request, Exception]] = []  # to be finished with an error by the loop

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.warming)

    def has_news(self) -> bool:
        """Whether the next plan has something for the runner even without work: requests that
        finished since the last plan (their state and features to drop), data moves, or copies
        between the KV tiers in flight (the runner reports when they land)."""
        cache = self.reuse.cache if self.reuse is not None else None
        return bool(self._ended or self.pool.orders or self._failures or (cache is not None and cache.in_flight))

    def take_failures(self) -> list[tuple[Request, Exception]]:
        """Requests that failed outside a step (the host-tier restore they waited for failed),
        with their errors, for the loop to finish; the list is emptied."""
        failures, self._failures = self._failures, []
        return failures

    def add(self, request: Request) -> None:
        self._requests[request.id] = request
        if request.warm:
            self.warm_stats.warms += 1
            self.warming.append(request)
        else:
            self.waiting.append(request)

    def take_warmed(self) -> list[tuple[Request, str]]:
        """Warms that are done, each with its finish reason (``"warmed"``: this warm cached the
        prefix; ``"cached"``: it was cached already), for the loop to finish; the list is emptied."""
        warmed, self._warmed = self._warmed, []
        return warmed

    def request(self, req_id: int) -> Request | None:
        """The request of ``req_id`` while it is queued or running (None once finished)."""
        return self._requests.get(req_id)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> StepPlan:
        """Decide the next step (see the module docstring); the plan also carries the requests
        finished since the last plan and the pool's data moves decided since then."""
        draft = _Draft()
        budget = self.config.max_num_batched_tokens
        self._tick_warm_budget()
        for req in list(self.running):
            if req.status is not Status.RUNNING or req.is_prefilling or req.warm or budget <= 0:
                continue
            if self._grow(req, len(req.tokens), draft):
                draft.items.append((req, 1))
                budget -= 1
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is Status.RUNNING and req.is_prefilling and not req.warm:
                n = self._prefill_chunk(req, budget, draft)
                if n:
                    draft.items.append((req, n))
                    budget -= n
        passed: list[Request] = []  # waiting for a copy or a computation in flight: others go past
        blocked = False  # a question waits for pages (or a free slot): warms wait too
        while self.waiting and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                blocked = True
                break
            req = self.waiting[0]
            admission = self._admit(req)
            if admission is _Admission.IN_FLIGHT:
                passed.append(self.waiting.popleft())
                continue
            if admission is _Admission.NO_PAGES:
                blocked = True
                break  # admit in arrival order only; wait for pages
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            n = self._chunk(req, budget)
            if self._grow(req, req.num_computed + n, draft):
                draft.items.append((req, n))
                budget -= n
        self.waiting.extendleft(reversed(passed))
        if self.reuse is not None and not blocked and budget > 0:
            self._schedule_warms(draft, budget)
        for req, _ in draft.items:
            req.max_pages_held = max(req.max_pages_held, len(req.block_table))
        if self.reuse is not None:
            self._keep_free(draft)
        return self._charged_later(self._plan(draft))

    def _keep_free(self, draft: _Draft) -> None:
        """Offload idle families ahead of demand (:func:`~engine.cache.reclaim.keep_free`), in the
        plan where it costs least: a plan without runs (the engine is idle; such a plan follows
        every last finish) fills the watermark; a plan with runs only when the free pages fell
        below half of it (a busy engine). Never beside a host hit's first chunk: the copies share
        the bus and the step's own transfers queue behind them (on the H200 a step carrying an
        offload took ~3.9 ms longer than a decode step)."""
        if not draft.items:
            self.reuse.cache.keep_free()
        elif not any(self._answers_host_hit(req) for req, _ in draft.items):
            self.reuse.cache.keep_free(below=0.5)

    @staticmethod
    def _answers_host_hit(req: Request) -> bool:
        """Whether ``req`` is a host hit that has not answered yet (its first chunk is due)."""
        return req.telemetry.prefix_tier == "host" and req.first_token_at is None and not req.warm

    def restore_early(self) -> list[Restore]:
        """While a step runs (its plan taken, its forward queued): admit the questions at the
        front of the waiting queue whose prefix is on the host tier and whose restore and first
        chunk fit in the free pages as they are, and return their copies, for the runner to start
        at once (:meth:`ModelRunner.start_transfers
        <engine.serving.runner.ModelRunner.start_transfers>`). The copy then overlaps the step
        in progress instead of the next one; the question's first chunk comes in the next plan,
        as any running request's. Nothing is reclaimed here (no eviction, compaction or offload
        may change what the running step reads), arrival order holds (it stops at the first
        question it cannot admit so), and a request's page copies stay for the next plan. Holds
        the lock."""
        if self.reuse is None or not self.reuse.has_host_tier:
            return []
        admitted = 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self.reuse.restorable(req) or self._admit(req, reclaim=False) is not _Admission.ADMITTED:
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            admitted += 1
        return self.pool.take_orders((Restore,)) if admitted else []

    def _plan(self, draft: _Draft) -> StepPlan:
        plan = StepPlan(finished=self._ended, preempted=[r.id for r in draft.preempted] + self._warms_preempted)
        self._ended, self._warms_preempted = [], []
        needs_scores = self.reuse is not None and self.reuse.needs_scores
        for req, n in draft.items:
            start = req.num_computed
            plan.runs.append(ScheduledRun(
                req.id, start, n, tuple(req.tokens[start : start + n]), tuple(req.block_table), req.kv_offset,
                tuple(req.visual_items_in(start, start + n)), start + n == len(req.tokens)))
            if req.id not in self._known:
                self._known.add(req.id)
                prompt = req.prompt
                plan.new.append(NewRequest(req.id, tuple(prompt.input_ids), prompt.positions, prompt.rope_delta,
                                           tuple(prompt.spans), prompt, req.salt, req.sampling, req.sampler))
            if needs_scores and req.cold_prefix and start + n == req.prompt.prefix_len:
                plan.scores.append(req.id)
            if req.awaits is not None:
                plan.transfers_awaited.append(req.awaits)
        # last: admission and growth above may add some; a host hit's fork of its prefix's last page
        # rides its restore, so that the forward need not wait for the whole restore to fork it
        plan.kv_orders = fold_page_copies(self.pool.take_orders())
        if self.reuse is not None:
            plan.transfers_landed = self.reuse.cache.take_landed()
            plan.in_flight = bool(self.reuse.cache.in_flight)
        return plan

    def update(self, plan: StepPlan, output: StepOutput) -> list[tuple[Request, int]]:
        """Apply an executed plan to its requests: ``num_computed`` advances by each run (but the
        runs whose encoding failed), a cold public prefix the step completed is compacted and
        cached (with the scores the runner computed; its slot moves go in the next plan), and the
        sampled tokens are appended. Returns ``(request, token)`` of the sampled tokens, in plan
        order, for the loop to deliver."""
        done = []
        for run in plan.runs:
            req = self._requests.get(run.req_id)
            if req is None or run.req_id in output.failed:
                continue
            req.num_computed += run.num_tokens
            done.append(req)
        if self.reuse is not None:
            failed = self._landed(output)
            done = [req for req in done if req.id not in failed]
            for req in done:
                if req.cold_prefix and req.num_computed == req.prompt.prefix_len:
                    kept = self.reuse.compact_and_cache(req, output.scores.get(req.id))
                    req.block_table, req.kv_offset, req.attached = kept.block_table, kept.kv_offset, kept.entry
                    req.cold_prefix = False
                    if req.warm:
                        self.warm_stats.warms_computed += 1
                        self._warmed.append((req, "warmed"))
        sampled = []
        for req in done:
            token = output.sampled.get(req.id)
            if token is not None:
                req.tokens.append(token)
                sampled.append((req, token))
        return sampled

    # ------------------------------------------------------------------ warms
    def _schedule_warms(self, draft: _Draft, budget: int) -> None:
        """Give warms what the step left: a promoted warm (one a waiting question joined) first and
        alone, with no bounds; else running warms' next chunks, then new warms admitted from their
        queue, under the per-step bounds and the time budget while contended (see the module
        docstring). With nothing contended the bounds are off: nobody's steps get slower."""
        contended = self._contended()
        running = [r for r in self.running if r.warm and r.status is Status.RUNNING]
        joined = self._joined_keys() if contended else set()
        promoted = [r for r in running if r.prefix_key in joined]
        if promoted:  # the step is theirs: other warms would only delay the person waiting
            for req in promoted:
                if budget <= 0:
                    break
                n = self._warm_chunk(req, budget, contended=False)
                if self._grow_warm(req, req.num_computed + n):
                    draft.items.append((req, n))
                    budget -= n
                elif not self._anything_frees_pages():
                    self._drop_warm(req)
            return
        cap = min(budget, self.config.max_warm_tokens) if contended else budget
        gated = contended and not self.warm_budget.off
        taken, deferred = 0, False  # warm tokens this step; whether one waited for the budget
        for req in running:
            if cap <= 0:
                break
            n = self._warm_chunk(req, cap, contended)
            if gated and not self.warm_budget.allows(taken + n):
                deferred = True
                break
            if self._grow_warm(req, req.num_computed + n):
                draft.items.append((req, n))
                cap -= n
                taken += n
            elif not self._anything_frees_pages():
                self._drop_warm(req)  # it holds pages only it waits on: give them back
        passed: list[Request] = []
        while self.warming and cap > 0 and not deferred and len(self.running) < self.config.max_num_seqs:
            if sum(r.warm for r in self.running) >= self.config.max_warms_running:
                break
            req = self.warming.popleft()
            if self.reuse.waits(req):  # a question (or another warm) computes it right now
                passed.append(req)
                continue
            if self.reuse.cache.lookup(req.prefix_key, req.tokens, req.prompt.prefix_len) is not None:
                self.warm_stats.warms_cached += 1
                self._warmed.append((req, "cached"))
                continue
            if not self._pixels_ready(req):
                passed.append(req)
                continue
            n = self._warm_chunk(req, cap, contended)
            if gated and not self.warm_budget.allows(taken + n):
                self.warming.appendleft(req)
                deferred = True
                break
            if not self._grow_warm(req, n):
                if not self._anything_frees_pages():
                    self._drop_warm(req)
                    continue
                self.warming.appendleft(req)
                break
            req.status = Status.RUNNING
            req.cold_prefix = True
            self.reuse.begin_compute(req)
            self.running.append(req)
            draft.items.append((req, n))
            cap -= n
            taken += n
        self.warming.extendleft(reversed(passed))
        self.warm_stats.warms_deferred_steps += deferred
        self._budgeted = taken if gated else 0

    def _contended(self) -> bool:
        """Whether a question runs or waits (warms are then bounded and budgeted)."""
        return bool(self.waiting) or any(not r.warm for r in self.running)

    def _joined_keys(self) -> set[str]:
        """Prefix keys that waiting questions wait for (a computation in flight: a running warm
        computing one of them is promoted)."""
        return {q.prefix_key for q in self.waiting if self.reuse.waits(q)}

    def _tick_warm_budget(self) -> None:
        """Accrue the warms' time budget for the time since the last step's planning (it accrued
        meanwhile if the engine was then contended with a warm waiting) and start the step's count
        of budgeted warm tokens."""
        warms_wait = bool(self.warming) or any(r.warm for r in self.running)
        self.warm_budget.tick(warms_wait and self._contended())
        self._budgeted = 0

    def _charged_later(self, plan: StepPlan) -> StepPlan:
        """Remember ``plan`` if the warms' budget pays for its warm tokens (:meth:`step_done`)."""
        if self._budgeted:
            self._charges.append((plan, self._budgeted))
        return plan

    def step_done(self, plan: StepPlan, exec_s: float) -> None:
        """The runner executed ``plan`` in ``exec_s`` seconds (measured by the loop): a step whose
        warm chunks the time budget allowed spends it. Plans never reported (a failed step) are
        forgotten with the next one reported."""
        for i, (charged, tokens) in enumerate(self._charges):
            if charged is plan:
                del self._charges[: i + 1]
                self.warm_budget.spend(exec_s, tokens)
                return

    def _warm_chunk(self, req: Request, cap: int, contended: bool = True) -> int:
        """Tokens of a warm's next chunk: up to its prefix boundary, at most ``cap``, and while
        ``contended`` stopping before the image past the first ``max_warm_images`` it would reach
        for the first time."""
        start = req.num_computed
        n = min(req.prompt.prefix_len - start, cap)
        bound = self.config.max_warm_images if contended else 0
        if bound:
            firsts = {}
            for span in req.prompt.spans:  # an item's first span (a video has one per frame)
                firsts.setdefault((span.kind, span.item), span.start)
            new = sorted(s for s in firsts.values() if start <= s < start + n)
            if len(new) > bound:
                n = new[bound] - start
        return n

    def _grow_warm(self, req: Request, num_tokens: int) -> bool:
        """Pages for a warm's first ``num_tokens`` tokens: free ones, or those of idle entries
        nobody ever hit (:meth:`PrefixCache.evict_unhit`); never anything else. Whether it got them."""
        need = self.pool.pages_for(num_tokens - req.kv_offset) - len(req.block_table)
        if need <= 0:
            return True
        if self.pool.num_free < need and not self.reuse.cache.evict_unhit(need):
            return False
        req.block_table += self.pool.allocate(need)
        return True

    def _anything_frees_pages(self) -> bool:
        """Whether pages will come free without a warm's help: a question runs, or copies between
        the KV tiers are in flight. (Questions waiting on the warm's own prefix free nothing.)"""
        return any(not r.warm for r in self.running) or bool(self.reuse.cache.in_flight)

    def _drop_warm(self, req: Request) -> None:
        """Give a warm up (its pages freed): there is no room for it and nothing will make some."""
        self.warm_stats.warms_dropped += 1
        self._failures.append((req, EngineOverloadedError(
            "no KV memory is free to prepare these images ahead of a question; they are processed "
            "with the first question instead")))

    def _landed(self, output: StepOutput) -> set[int]:
        """The copies between the KV tiers the runner saw land: the cache frees and installs their
        pages; a request that read a restore reports it. The requests that read or wait for a
        restore that failed fail (only they): returns their ids (their samples are not delivered)."""
        cache = self.reuse.cache
        landed = {}
        for done in output.transfers:
            cache.transfer_landed(done)
            landed[done.xfer] = done
        failed_ids = set()
        for req in self.running:
            done = landed.get(req.awaits)
            if done is None:
                continue
            if done.error is None:
                self.reuse.restored(req)
            else:
                failed_ids.add(req.id)
        failed = cache.take_failed()
        failed_ids.update(r.id for r in self.waiting if r.match is not None and r.match.entry.base in failed)
        for req_id in failed_ids:
            error = PrismError("the cached images of this chat could not be brought back from host memory; "
                               "ask again (they will be processed anew)")
            self._failures.append((self._requests[req_id], error))
        return failed_ids

    def _prefill_chunk(self, req: Request, budget: int, draft: _Draft) -> int:
        n = self._chunk(req, budget)
        if self._grow(req, req.num_computed + n, draft):
            return n
        return 0

    @staticmethod
    def _chunk(req: Request, budget: int, *, cold: bool = False) -> int:
        """Tokens of ``req``'s next chunk under ``budget``: a cold prefix (``req.cold_prefix``, or
        ``cold`` for one about to start) stops at its boundary."""
        n = min(req.num_pending, budget)
        if (req.cold_prefix or cold) and req.num_computed < req.prompt.prefix_len:
            n = min(n, req.prompt.prefix_len - req.num_computed)  # compaction happens at the boundary
        return n

    def _admit(self, req: Request, *, reclaim: bool = True) -> _Admission:
        """Attach the request's cached prefix (if still there; restored from the host tier first)
        and check its first chunk can get pages. Anything but ADMITTED leaves it waiting. With
        ``reclaim=False`` (:meth:`restore_early`) a host hit takes free pages only, or waits."""
        reuse = self.reuse
        if reuse is not None and reuse.waits(req):
            return _Admission.IN_FLIGHT
        match = reuse.admission_match(req) if reuse is not None else None
        if match is not None and reuse.waits(req):  # the fresh lookup found an entry coming back
            return _Admission.IN_FLIGHT
        pages_for = self.pool.pages_for
        if match is not None and reuse.on_host(match):
            first = min(len(req.tokens) - match.length, self.config.max_num_batched_tokens)
            need = reuse.restore_pages(match) + pages_for(match.kv_len + first) - pages_for(match.kv_len) + 1
            if reclaim:
                with reuse.pinned(match):  # making room must not drop the entry from the host tier
                    room = self._free_pages(need)  # the family, and its question's first chunk
            else:
                room = self.pool.num_free >= need
            if room:  # its first chunk rides the plan that carries the copy (and waits for it on the GPU)
                return self._attached(req, match, reuse.restore(req, match))
            if not reclaim or self.running or self._room_pending(need):
                return _Admission.NO_PAGES
            reuse.drop(req)  # nothing runs and nothing lands: it could never come back
            match = None
        if match is not None:
            first = min(len(req.tokens) - match.length, self.config.max_num_batched_tokens)
            need = pages_for(match.kv_len + first) - pages_for(match.kv_len) + 1
            with self.reuse.pinned(match):  # making room must not evict the entry itself
                room = self._free_pages(need)
            if not room:
                if self.running or self._room_pending(need):
                    return _Admission.NO_PAGES  # running requests (or copies in flight) will free pages
                # Nothing runs, so no page will ever be freed, and the pinned entry (and its
                # parent) hold pages this request cannot use (a partly filled last page it would
                # copy, the parent's own last page, an extension's tail): waiting would spin
                # forever on a request that fits the pool. Compute it cold: the entry becomes
                # evictable.
                self.reuse.drop(req)
                match = None
        if match is not None:
            return self._attached(req, match, self.reuse.attach(req, match))
        if not self._pixels_ready(req):
            return _Admission.IN_FLIGHT
        first = self._chunk(req, self.config.max_num_batched_tokens, cold=req.prefix_key is not None)
        if not self._free_pages(pages_for(first)):
            return _Admission.NO_PAGES
        if req.prefix_key is not None:
            req.cold_prefix = True
            reuse.begin_compute(req)
        return _Admission.ADMITTED

    @staticmethod
    def _attached(req: Request, match, pages: list[int]) -> _Admission:
        """Install an attached entry's ``pages`` as the start of ``req``'s block table."""
        req.block_table = pages
        req.attached = match.entry
        req.num_computed = match.length
        req.kv_offset = match.entry.kv_offset
        return _Admission.ADMITTED

    def _pixels_ready(self, req: Request) -> bool:
        """Whether ``req``, about to compute its prompt, has its images' patches: a prompt built
        while they were out of the processed-image cache has them processed now, off this thread
        (it waits, others are admitted past it). A failure fails the request (only it)."""
        deferred = req.prompt.deferred
        if deferred is None:
            return True
        try:
            if not deferred.poll():
                return False
        except Exception as exc:  # the image as it reads now cannot be used: the user hears why
            self._failures.append((req, exc))
            return False
        req.telemetry.preprocess_ms += deferred.ms
        req.prompt.deferred = None
        return True

    def _free_pages(self, n: int) -> bool:
        """Whether ``n`` pages are free, after reclaiming cache pages and then preempting running
        warms (newest first: a warm is below every question) if needed."""
        if self.pool.num_free >= n:
            return True
        if self.reuse is not None and self.reuse.make_room(n):
            return True
        while self.pool.num_free < n:
            warm = next((r for r in reversed(self.running) if r.warm), None)
            if warm is None:
                return False
            self.preempt(warm)
            self._warms_preempted.append(warm.id)
        return True

    def _room_pending(self, n: int) -> bool:
        """Whether ``n`` pages will be free once the offloads in flight land (wait, do not preempt)."""
        return self.reuse is not None and self.reuse.cache.room_pending(n)

    def _grow(self, req: Request, num_tokens: int, draft: _Draft) -> bool:
        """Give ``req`` pages for its first ``num_tokens`` logical tokens (and a private copy of a
        shared, partly filled last page), reclaiming cache pages and then preempting later
        requests if needed. Returns False when ``req`` itself had to be preempted, or when the
        pages it needs are held by offloads in flight (it waits a step; nobody is preempted)."""
        table = req.block_table
        cow = bool(table) and req.kv_len % self.pool.page_size != 0 and self.pool.is_shared(table[-1])
        need = self.pool.pages_for(num_tokens - req.kv_offset) - len(table) + cow
        while not self._free_pages(need):
            if self._room_pending(need):
                return False  # an offload in flight frees the pages: wait a step, preempt no one
            victim = self.running[-1]
            if victim is req and len(self.running) == 1 and req.attached is not None:
                # Alone, ``req`` pins the entry it is attached to (and its parent), whose pages it
                # only partly uses; preempting itself would re-attach the same entry on
                # re-admission, a livelock. Drop the attachment (its own page references stay),
                # evict the now unused entries (everything else was evicted already), and retry
                # with the copy-on-write need recomputed.
                self._release_attachment(req)
                self.reuse.cache.clear(host=False)
                return self._grow(req, num_tokens, draft)
            self.preempt(victim)
            draft.preempted.append(victim)
            draft.items = [(r, n) for r, n in draft.items if r is not victim]
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
        (self.warming if req.warm else self.waiting).appendleft(req)

    def finish(self, req: Request) -> None:
        """Remove a finished or cancelled request and free its pages (the next plan tells the
        runner to drop its state)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.warming:
            self.warming.remove(req)
        self._detach(req)
        req.status = Status.FINISHED
        self._requests.pop(req.id, None)
        if req.id in self._known:
            self._known.discard(req.id)
            self._ended.append(req.id)

    def _detach(self, req: Request) -> None:
        self.pool.release(req.block_table)
        req.block_table = []
        req.kv_offset = 0
        if req.cold_prefix:
            self.reuse.end_compute(req)  # its prefix is not coming: requests waiting for it go on
        req.awaits = None  # re-admitted, it waits for the landing like any other request
        req.cold_prefix = False
        req.match = None  # a preempted request looks its prefix up again when re-admitted
        self._release_attachment(req)

    def _release_attachment(self, req: Request) -> None:
        """``req`` no longer reads the entry it attached (its page references are its own)."""
        if req.attached is not None:
            self.reuse.detach(req.attached)
            req.attached = None
