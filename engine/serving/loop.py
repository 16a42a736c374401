"""The serving loop: one background thread that takes requests in, runs steps and hands results out.

One iteration is :meth:`EngineLoop.step`: it takes the new requests from the inbox (their prefix
lookup happens here) and the cancellations, the scheduler plans a step (a
:class:`~engine.serving.plan.StepPlan`, data), the runner executes it (data moves, encoder,
forward, sampling) and returns a :class:`~engine.serving.plan.StepOutput`, the scheduler updates
the requests from the two (and compacts and caches a prefix the step completed), and every
sampled token is delivered (streamed, or the request finished). A finished request releases its
pages and, after a normal end, keeps its conversation as a prefix-cache extension. The thread only
drives :meth:`~EngineLoop.step`.

One lock (a condition variable) guards the inbox, the scheduler's queues and the prefix cache; the
model and the detokeniser run outside it. :meth:`EngineLoop.paused` holds it from outside. The
loop is given everything it uses at construction and never calls back into the
:class:`~engine.Engine` that owns it. Per-step telemetry is written here alone (the runner reports
timings in its output; what a prefix hit reused is reported by the prefix cache, which decides it).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from ..cache.prefix_reuse import PrefixReuse
from ..errors import EngineOverloadedError, PrismError, TensorParallelError
from .outputs import Completion
from .plan import Offload, Restore, StepOutput, StepPlan
from .request import Request, Status
from .runner import ModelRunner
from .scheduler import Scheduler
from .trace import StepTrace

log = logging.getLogger(__name__)

#: While a step runs, the loop watches its inbox for host hits (:meth:`EngineLoop._meanwhile`)
#: until this share of the shortest recent step of its kind has passed: the restores it starts then
#: still overlap the step, and the watch ends before the step does (the final wait is the runner's
#: blocking sync, so the watch adds nothing to a step's time). Not the last step's time: a decode
#: step after a longer prefill step of the same forward path waited for the GPU that long (H200:
#: decode steps' p99 5.4 -> 18 ms).
WATCH_SHARE = 0.8


def watch_deadline(started: float, recent: Iterable[float]) -> float:
    """When the watch of a step that began at ``started`` (seconds) ends: :data:`WATCH_SHARE` of the
    shortest of ``recent`` (the execution seconds of the last steps of its kind); ``started``
    (no watch) without any."""
    return started + WATCH_SHARE * min(recent, default=0.0)


def _step_error(exc: Exception) -> PrismError:
    """What a request whose step failed is told: a failed tensor-parallel rank as it is (its own
    copy: the step's requests are answered from several threads), anything else as an internal
    error."""
    if isinstance(exc, TensorParallelError):
        return TensorParallelError(str(exc))
    return PrismError(f"internal error while running the request: {exc}")


class EngineLoop:
    """The engine's loop thread and its inbox (started at construction).

    Args:
        scheduler: decides each step's work; owns the waiting and running requests.
        runner: executes steps on the model.
        reuse: the prefix cache's bookkeeping, or None when prefix caching is off.
        eos_token_ids: tokens that end generation (unless a request ignores them).
        debug_checks: check the pool's page accounting after every step (slow; for tests).
        start: start the loop thread (default); with False the caller drives :meth:`step`.

    Attributes:
        scheduler, runner: as given (dropped by :meth:`close`); tests may replace their methods.
        steps: steps run. tokens_generated: tokens sampled.
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, reuse: PrefixReuse | None, *,
                 eos_token_ids: set[int], debug_checks: bool = False, start: bool = True):
        self.scheduler, self.runner, self.reuse = scheduler, runner, reuse
        self.eos_token_ids = eos_token_ids
        self.debug_checks = debug_checks
        self._cv = threading.Condition()
        self._inbox: list[Request] = []
        self._cancels: list[Request] = []
        self._stopping = False
        self._closed = False
        self.steps = 0
        self.tokens_generated = 0
        self.trace = StepTrace.from_env()  # PRISM_STEP_TRACE: one line per step, for profiling
        # the last steps' execution seconds by kind: (forward path, whether a run prefills)
        self._exec_s: dict[tuple[str, bool], deque[float]] = {}
        self._step_started = 0.0
        self._step_prefills = False
        self.early_restores = 0  # restores started while a step ran (:meth:`_meanwhile`)
        if reuse is not None and getattr(runner, "orders_between_steps", False):  # test fakes lack it
            runner.meanwhile = self._meanwhile
        self._thread = threading.Thread(target=self._run, name="prism-engine", daemon=True)
        if start:
            self._thread.start()

    # ------------------------------------------------------------------ from callers' threads
    @property
    def closed(self) -> bool:
        """Whether the loop was closed, or stopped after an internal error."""
        return self._closed

    def is_alive(self) -> bool:
        """Whether the loop thread runs."""
        return self._thread.is_alive()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the loop between steps: requests submitted meanwhile are looked up and admitted in
        one iteration, and the scheduler's queues and the prefix cache can be read or changed
        consistently (``Engine.stats``, ``clear_prefix_cache``). Re-entrant; keep it short."""
        with self._cv:
            yield

    def submit(self, req: Request) -> None:
        """Queue a request; its outputs arrive on ``req.outbox`` (read through the
        :class:`~engine.serving.handle.RequestHandle` that ``Engine.submit`` makes of it).

        Raises:
            PrismError: the loop is closed.
            EngineOverloadedError: ``max_waiting`` requests are already waiting.
        """
        with self._cv:
            if self._stopping:
                raise PrismError("engine is closed")
            limit = self.scheduler.config.max_waiting
            # questions and warms are bounded apart: queued warms never turn a question away
            queued = self.scheduler.warming if req.warm else self.scheduler.waiting
            if sum(r.warm == req.warm for r in self._inbox) + len(queued) >= limit:
                raise EngineOverloadedError(f"Prism is busy: {limit} requests are already waiting. Try again shortly.")
            self._inbox.append(req)
            self._cv.notify_all()  # the loop may wait in a step's watch, beside callers' waits

    def cancel(self, req: Request, wait: bool = True) -> None:
        """Stop ``req``; its KV pages are freed before the next step. With ``wait`` the call
        returns once they are (or the loop has stopped; at most 60 s)."""
        with self._cv:
            if req.status is Status.FINISHED or req.cancelled:
                return
            req.cancelled = True
            self._cancels.append(req)
            self._cv.notify()
            if wait:
                self._cv.wait_for(lambda: req.status is Status.FINISHED or not self._thread.is_alive(), timeout=60)

    def wait_for_salt(self, salt: str) -> None:
        """Return once every request of ``salt`` that is queued or running now has finished
        (requests submitted later are not waited for), or the loop has stopped. The salt's warms
        are cancelled instead: they only build what is about to be forgotten. Holds the lock
        while it checks, so it returns between steps: no step of those requests is in flight."""
        with self._cv:
            s = self.scheduler
            pending = [r for r in (*self._inbox, *s.waiting, *s.warming, *s.running) if r.salt == salt]
            for req in pending:
                if req.warm and not req.cancelled:
                    req.cancelled = True
                    self._cancels.append(req)
            self._cv.notify()
            self._cv.wait_for(lambda: all(r.status is Status.FINISHED for r in pending) or not self._thread.is_alive())

    def counters(self) -> dict:
        """The loop's part of :meth:`Engine.stats() <engine.Engine.stats>`: running and waiting
        requests (the inbox counts as waiting; warms are counted apart: ``warms_waiting``), steps
        run, tokens generated, and the warms' counters
        (:class:`~engine.serving.scheduler.WarmStats`)."""
        with self._cv:
            s = self.scheduler
            return {"running": len(s.running), "waiting": len(s.waiting) + sum(not r.warm for r in self._inbox),
                    "warms_waiting": len(s.warming) + sum(r.warm for r in self._inbox),
                    "steps": self.steps, "tokens_generated": self.tokens_generated, **dataclasses.asdict(s.warm_stats)}

    def close(self) -> bool:
        """Stop the loop (running requests fail with PrismError), wait for its thread and drop the
        scheduler and runner. Returns False when it was already closed or had stopped itself."""
        with self._cv:
            if self._closed:
                return False
            self._closed = self._stopping = True
            self._cv.notify_all()
        if self._thread.ident is not None:
            self._thread.join()
        else:  # never started: fail what is queued here
            self._fail_all("the engine was closed before the request finished")
        if self.trace is not None:
            self.trace.close()
        self.scheduler = self.runner = self.reuse = None
        return True

    # ------------------------------------------------------------------ one iteration
    def step(self) -> bool:
        """One iteration: intake (prefix lookups) and cancellations, then one step planned,
        executed, applied to the requests, and its tokens and completions delivered. Returns
        whether a step computed anything (False: no work, or nothing fits now: pages are held by
        requests about to finish). Call it from one thread only: the loop thread, or the caller
        of a loop built with ``start=False``.

        Raises:
            Exception: a failure outside the model step (scheduling, bookkeeping, a failed debug
                check); a failing step itself fails its requests only.
        """
        started = time.perf_counter()
        with self._cv:
            self._intake()
            if not (self.scheduler.has_work() or self.scheduler.has_news()):
                return False
            # scheduling evicts and attaches cache entries: never beside stats() or a clear
            plan = self.scheduler.schedule()
            self._note_scheduled(plan)
            self._settle()  # warms found cached or dropped while scheduling end now, steps or not
            counts = self._trace_counts(plan) if self.trace is not None else None
        if plan.is_empty():
            return False
        planned = self._step_started = time.perf_counter()
        self._step_prefills = any(run.num_tokens > 1 for run in plan.runs)
        early = self.early_restores
        try:
            output = self.runner.execute(plan)
        except Exception as exc:  # one bad step fails its requests only; the loop goes on
            log.exception("engine step failed")
            with self._cv:
                for run in plan.runs:
                    req = self.scheduler.request(run.req_id)
                    if req is not None:
                        self._finish(req, _step_error(exc))
                self._cv.notify_all()
            return bool(plan.runs)
        executed = time.perf_counter()
        self._exec_s.setdefault((output.path, self._step_prefills), deque(maxlen=8)).append(executed - planned)
        with self._cv:
            self.scheduler.step_done(plan, executed - planned)  # what the warms' time budget spends
            sampled = self._apply(plan, output)
        # Detokenisation runs outside the lock; the stream of a request is only ever touched by
        # this thread. A stop string still ends its request in this step (below).
        ends = [(req, reason) for req, token in sampled if (reason := self._deliver(req, token))]
        with self._cv:
            for req, reason in ends:
                self._finish(req, None, reason)
            if self.debug_checks:
                self._check_pages()
            self._cv.notify_all()
        if counts is not None:
            counts.update(path=output.path, vision_ms=round(sum(output.vision_ms.values()), 3),
                          early_restores=self.early_restores - early)
            self.trace.record(started, planned, executed, time.perf_counter(), counts)
        return bool(plan.runs)

    def _trace_counts(self, plan: StepPlan) -> dict:
        """What the step trace says of ``plan`` (no ids: see :mod:`engine.serving.trace`). Holds the lock."""
        decode = prefill = warm = 0
        for run in plan.runs:
            req = self.scheduler.request(run.req_id)
            if run.num_tokens == 1 and req is not None and run.start >= req.num_prompt:
                decode += 1
            else:
                prefill += run.num_tokens
                warm += run.num_tokens if req is not None and req.warm else 0
        return {"runs": len(plan.runs), "tokens": sum(r.num_tokens for r in plan.runs), "decode_rows": decode,
                "prefill_tokens": prefill, "warm_tokens": warm,
                "restores": sum(isinstance(o, Restore) for o in plan.kv_orders),
                "offloads": sum(isinstance(o, Offload) for o in plan.kv_orders),
                "awaited": len(plan.transfers_awaited)}

    def _intake(self) -> None:
        """Take the inbox and the cancellations. Holds the lock."""
        self._take_inbox()
        for req in self._cancels:
            self._finish(req, None)
        self._cancels.clear()
        self._cv.notify_all()

    def _take_inbox(self) -> None:
        """Hand the inbox's requests to the scheduler (each question's prefix is looked up
        here). Holds the lock."""
        for req in self._inbox:
            if self.reuse is not None and not req.warm:  # a warm asks nothing of the cache yet
                self.reuse.look_up(req)
            self.scheduler.add(req)
        self._inbox.clear()
        self._cv.notify_all()

    def _meanwhile(self, path: str) -> None:
        """The runner's call while a step's GPU work runs (its plan taken, its forward queued):
        with a host tier that holds anything, the questions that arrived since the step was
        planned are taken in and a host hit among them is admitted with its restore started at
        once (:meth:`Scheduler.restore_early`), so its copy overlaps this step instead of holding
        up the next one. On CUDA the inbox is watched until shortly before the step is expected
        to end (:func:`watch_deadline`, from the last steps of its kind); the wait for the
        step's end stays the runner's own blocking sync. Cancellations wait for the next
        iteration: a cancelled request's pages may still be written by this step."""
        if not self.reuse.has_host_tier:
            return
        watch = self.runner.transfers is not None and self.runner.transfers.cuda
        deadline = watch_deadline(self._step_started, self._exec_s.get((path, self._step_prefills), ()))
        with self._cv:
            while not self._stopping:
                if self._inbox:
                    self._take_inbox()
                    orders = self.scheduler.restore_early()
                    if orders:
                        self.runner.start_transfers(orders)
                        self.early_restores += len(orders)
                left = deadline - time.perf_counter()
                if not watch or left <= 0:
                    return
                self._cv.wait(left)  # submit() notifies

    def _apply(self, plan: StepPlan, output: StepOutput) -> list[tuple[Request, int]]:
        """The scheduler's update from the step, its telemetry, and the requests whose encoding
        failed finished. Holds the lock. Returns the sampled tokens to deliver."""
        for req_id, exc in output.failed.items():
            log.error("vision encoder failed for request %s: %r", req_id, exc)
        if any(run.req_id not in output.failed for run in plan.runs):
            self.steps += 1
        self._note_step(plan, output)
        sampled = self.scheduler.update(plan, output)
        self._settle()
        for req_id, exc in output.failed.items():
            req = self.scheduler.request(req_id)
            if req is not None:
                self._finish(req, PrismError(f"internal error while running the request: {exc}"))
        now = time.perf_counter()
        for req, _ in sampled:
            self.tokens_generated += 1
            if req.first_token_at is None:
                req.first_token_at = now
                req.telemetry.ttft_ms = (now - req.submitted) * 1e3
        return sampled

    def _settle(self) -> None:
        """Finish what the scheduler set aside: requests that failed outside a step, and warms
        that are done (cached by them, found cached, or dropped). Holds the lock."""
        for req, exc in self.scheduler.take_failures():
            self._finish(req, exc)
        for req, reason in self.scheduler.take_warmed():
            self._finish(req, None, reason)

    def _deliver(self, req: Request, token: int) -> str | None:
        """Stream ``token`` of ``req`` (already appended to its tokens); the finish reason when it
        ends the request (EOS, a stop string, ``max_tokens``), else None. Outside the lock."""
        if token in self.eos_token_ids and not req.sampling.ignore_eos:
            return "stop"
        delta = req.stream.push(token)
        if delta:
            req.outbox.put(delta)
        if req.stream.stopped:
            return "stop"
        if len(req.generated) >= req.sampling.max_tokens:
            return "length"
        return None

    # ------------------------------------------------------------------ telemetry
    def _note_scheduled(self, plan: StepPlan) -> None:
        now = time.perf_counter()
        for run in plan.runs:
            req = self.scheduler.request(run.req_id)
            if req.first_scheduled is None:
                req.first_scheduled = now
                req.telemetry.queue_ms = (now - req.submitted) * 1e3

    def _note_step(self, plan: StepPlan, output: StepOutput) -> None:
        for run in plan.runs:
            req = self.scheduler.request(run.req_id)
            if req is None:
                continue
            tel = req.telemetry
            if run.req_id in output.vision_ms:
                tel.vision_ms += output.vision_ms[run.req_id]
                tel.vision_encoder_ran = True
            if run.req_id in output.failed:
                continue
            if run.num_tokens > 1 or run.end - 1 < req.num_prompt:  # prefill (or recompute), not a decode step
                tel.computed_tokens += run.num_tokens

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        reason = "the engine was closed before the request finished"
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(
                        lambda: self._stopping or self._inbox or self._cancels or self.scheduler.has_work()
                        or self.scheduler.has_news()
                    )
                    if self._stopping:
                        break
                if not self.step() and (self.scheduler.has_work() or self.scheduler.has_news()):
                    # nothing fits right now: pages are held by requests about to finish, or by
                    # copies between the KV tiers about to land
                    time.sleep(0.001)
        except Exception as exc:
            # A bug outside the model step (scheduling, bookkeeping, a failed debug check) used to
            # end this thread silently, leaving every caller blocked forever on its outbox. Stop
            # the engine instead and fail all its requests below.
            log.exception("engine loop crashed")
            reason = f"internal engine error, the engine stopped: {exc!r}"
            with self._cv:
                self._stopping = self._closed = True
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        with self._cv:
            for req in [*self.scheduler.running, *self.scheduler.waiting, *self._inbox]:
                try:
                    self._finish(req, PrismError(reason))
                except Exception:  # state too broken to free pages: still answer the caller
                    req.status = Status.FINISHED
                    req.outbox.put(PrismError(reason))
            self._inbox.clear()
            self._cv.notify_all()

    def _check_pages(self) -> None:
        holders = [r.block_table for r in self.scheduler.running]
        if self.reuse is not None:
            holders += self.reuse.cache.holders()
            self.reuse.cache.check_host()
        self.scheduler.pool.check(holders)

    def _finish(self, req: Request, error: BaseException | None, reason: str | None = None) -> None:
        """Free the request's pages and deliver its completion (or error). Holds the lock."""
        if req.status is Status.FINISHED:
            return
        if req in self._inbox:
            self._inbox.remove(req)
            req.status = Status.FINISHED
        else:
            if reason in ("stop", "length") and self.reuse is not None:
                self.reuse.keep_conversation(req)
            self.scheduler.finish(req)
        if error is not None:
            req.outbox.put(error)
            return
        if req.cancelled and reason is None:
            reason = "cancelled"  # a partial answer, for a reader other than the canceller
            if req.warm:
                self.scheduler.warm_stats.warms_cancelled += 1
        tail = req.stream.finish()
        if tail:
            req.outbox.put(tail)
        tel = req.telemetry
        done = time.perf_counter()
        tel.generated_tokens = len(req.generated)
        tel.e2e_ms = (done - req.submitted) * 1e3
        tel.kv_pages = req.max_pages_held
        if tel.generated_tokens > 1 and req.first_token_at is not None:
            decode_s = done - req.first_token_at
            tel.decode_tokens_per_s = (tel.generated_tokens - 1) / decode_s if decode_s > 0 else 0.0
            tel.tpot_ms = decode_s * 1e3 / (tel.generated_tokens - 1)
        if req.first_scheduled is not None and req.first_token_at is not None:
            tel.prefill_ms = (req.first_token_at - req.first_scheduled) * 1e3 - tel.vision_ms
        req.outbox.put(Completion(req.stream.text, req.generated, list(req.prompt.input_ids), reason, tel))
