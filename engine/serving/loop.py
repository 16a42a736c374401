"""The serving loop: one background thread that takes requests in, runs steps and hands results out.

Each iteration takes the new requests from the inbox (their prefix lookup happens here) and the
cancellations, then runs one step: the scheduler plans it (a :class:`~engine.serving.batch.Batch`),
the runner encodes the images the step reaches and executes it, the prefix cache compacts and
caches prefixes computed by it, and every sampled token is accepted (streamed, or the request
finished). A finished request releases its pages and, after a normal end, keeps its conversation
as a prefix-cache extension.

One lock (a condition variable) guards the inbox, the scheduler's queues and the prefix cache; the
model runs outside it. :meth:`EngineLoop.paused` holds it from outside. The loop is given
everything it uses at construction and never calls back into the :class:`~engine.Engine` that owns
it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ..cache.prefix_reuse import PrefixReuse
from ..errors import EngineOverloadedError, PrismError, TensorParallelError
from .batch import Batch
from .outputs import Completion
from .request import Request, Status
from .runner import ModelRunner
from .scheduler import Scheduler

log = logging.getLogger(__name__)


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

    Attributes:
        scheduler, runner: as given (dropped by :meth:`close`); tests may replace their methods.
        steps: steps run. tokens_generated: tokens sampled.
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, reuse: PrefixReuse | None, *,
                 eos_token_ids: set[int], debug_checks: bool = False):
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
        self._thread = threading.Thread(target=self._run, name="prism-engine", daemon=True)
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
            if len(self._inbox) + len(self.scheduler.waiting) >= limit:
                raise EngineOverloadedError(f"Prism is busy: {limit} requests are already waiting. Try again shortly.")
            self._inbox.append(req)
            self._cv.notify()

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
        (requests submitted later are not waited for), or the loop has stopped. Holds the lock
        while it checks, so it returns between steps: no step of those requests is in flight."""
        with self._cv:
            pending = [r for r in (*self._inbox, *self.scheduler.waiting, *self.scheduler.running) if r.salt == salt]
            self._cv.wait_for(lambda: all(r.status is Status.FINISHED for r in pending) or not self._thread.is_alive())

    def counters(self) -> dict:
        """The loop's part of :meth:`Engine.stats() <engine.Engine.stats>`: running and waiting
        requests (the inbox counts as waiting), steps run, tokens generated."""
        with self._cv:
            return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting) + len(self._inbox),
                    "steps": self.steps, "tokens_generated": self.tokens_generated}

    def close(self) -> bool:
        """Stop the loop (running requests fail with PrismError), wait for its thread and drop the
        scheduler and runner. Returns False when it was already closed or had stopped itself."""
        with self._cv:
            if self._closed:
                return False
            self._closed = self._stopping = True
            self._cv.notify_all()
        self._thread.join()
        self.scheduler = self.runner = self.reuse = None
        return True

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        reason = "the engine was closed before the request finished"
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(
                        lambda: self._stopping or self._inbox or self._cancels or self.scheduler.has_work()
                    )
                    if self._stopping:
                        break
                    for req in self._inbox:
                        if self.reuse is not None:
                            self.reuse.look_up(req)
                        self.scheduler.add(req)
                    self._inbox.clear()
                    for req in self._cancels:
                        self._finish(req, None)
                    self._cancels.clear()
                    self._cv.notify_all()
                if self.scheduler.has_work():
                    self._step()
        except Exception as exc:
            # A bug outside the model step (scheduling, bookkeeping, a failed debug check) used to
            # end this thread silently, leaving every caller blocked forever on its outbox. Stop
            # the engine instead and fail all its requests below.
            log.exception("engine loop crashed")
            reason = f"internal engine error, the engine stopped: {exc!r}"
            with self._cv:
                self._stopping = self._closed = True
        with self._cv:
            for req in [*self.scheduler.running, *self.scheduler.waiting, *self._inbox]:
                try:
                    self._finish(req, PrismError(reason))
                except Exception:  # state too broken to free pages: still answer the caller
                    req.status = Status.FINISHED
                    req.outbox.put(PrismError(reason))
            self._inbox.clear()
            self._cv.notify_all()

    def _step(self) -> None:
        with self._cv:  # scheduling evicts and attaches cache entries: never beside stats() or a clear
            batch = self.scheduler.schedule()
        if not batch.items:
            time.sleep(0.001)  # nothing fits right now: pages are held by requests about to finish
            return
        now = time.perf_counter()
        for req, _ in batch.items:
            if req.first_scheduled is None:
                req.first_scheduled = now
                req.telemetry.queue_ms = (now - req.submitted) * 1e3
        # Vision first, request by request: a failing encode fails its own request only, not
        # every request sharing the step (which the error handler below would fail).
        for req, exc in self.runner.encode_pending(batch):
            log.error("vision encoder failed for request %s: %r", req.id, exc)
            with self._cv:
                self._finish(req, PrismError(f"internal error while running the request: {exc}"))
                self._cv.notify_all()
            batch.items = [(r, n) for r, n in batch.items if r is not req]
        if not batch.items:
            return
        try:
            sampled = self.runner.execute(batch)
        except Exception as exc:  # one bad step fails its requests only; the loop goes on
            log.exception("engine step failed")
            with self._cv:
                for req, _ in batch.items:
                    self._finish(req, _step_error(exc))
                self._cv.notify_all()
            return
        self._after_step(batch, sampled)

    def _after_step(self, batch: Batch, sampled: list[tuple[Request, int]]) -> None:
        for req, n in batch.items:
            if n > 1 or req.num_computed - 1 < req.num_prompt:  # prefill (or recompute), not a decode step
                req.telemetry.computed_tokens += n
        with self._cv:
            self.steps += 1
            if self.reuse is not None:
                self.reuse.after_step(batch.items)
            for req, token in sampled:
                self._accept(req, token)
            if self.debug_checks:
                self._check_pages()
            self._cv.notify_all()

    def _check_pages(self) -> None:
        holders = [r.block_table for r in self.scheduler.running]
        if self.reuse is not None:
            holders += self.reuse.cache.holders()
        self.scheduler.pool.check(holders)

    def _accept(self, req: Request, token: int) -> None:
        now = time.perf_counter()
        req.tokens.append(token)
        self.tokens_generated += 1
        if req.first_token_at is None:
            req.first_token_at = now
            req.telemetry.ttft_ms = (now - req.submitted) * 1e3
        if token in self.eos_token_ids and not req.sampling.ignore_eos:
            return self._finish(req, None, "stop")
        delta = req.stream.push(token)
        if delta:
            req.outbox.put(delta)
        if req.stream.stopped:
            return self._finish(req, None, "stop")
        if len(req.generated) >= req.sampling.max_tokens:
            return self._finish(req, None, "length")

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
