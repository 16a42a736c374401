"""Warming: a chat session's image prefix built before its first question (issue 34).

The engine's ``warm(images, system=..., cache_salt=...)`` (:class:`~engine.client.EngineClient`)
builds the question-independent prefix that :func:`engine.media_first_messages` attaches for any
question about those images (preprocessing, vision encoder, prefill up to the last image's
``<|vision_end|>``, nothing sampled), below every question in the engine's schedule; a question
sent while it runs joins it (its telemetry says ``prefix_cache == "hit"``), and the first question
that attaches a prefix a warm built says ``warmed`` (the chat's chip: ``prefix HIT (warmed at
upload)``).

The engine knows nothing of sessions. :class:`PrefixWarmer` keeps one warm per key (a chat
session's id): a newer warm of the key cancels the older one (the session's images changed
again), and :meth:`PrefixWarmer.cancel` / :meth:`PrefixWarmer.cancel_salt` cancel it when the
chat is deleted or a share revoked (the engine frees its pages).

Warming is best-effort and never holds up the request that caused it: the engine's ``warm`` call
(which validates, reads and preprocesses the images in the caller's thread, as ``submit`` does) runs
on this module's own worker threads, and a refusal (the engine loading, closed or overloaded, a
prefix longer than the context) is logged, never shown as a failure of the upload.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from engine import PrismError

log = logging.getLogger(__name__)

#: Why a warm was started, the ``source`` label of ``prism:prefix_cache_warms_total``: ``upload``
#: (a chat session's images changed: an upload, a removal, a continued copy of a share),
#: ``restart`` (the most recently used chats after a start, :meth:`app.chat.ChatService.warm_recent`),
#: ``api`` (``POST /v1/prefix_cache/warm``).
SOURCES = ("upload", "restart", "api")
#: Worker threads that start warms (each blocks while the engine preprocesses one warm's images).
WARM_THREADS = 2
#: Keys remembered at most; beyond that, the oldest whose warm has finished are forgotten (a
#: finished warm's entry only remembers its source for the first question's chip).
MAX_TRACKED = 4096


@dataclass
class _Warm:
    """One key's warm: its generation (a newer call for the key supersedes it), the salt and
    source it was started with, and once started the engine's handle and the engine client it
    came from (None before)."""

    gen: int
    salt: str
    source: str
    handle: object | None = None
    engine: object | None = None


def _cancel(warm: _Warm | None, wait: bool = False) -> None:
    """Cancel ``warm``'s engine handle, if it has one (a warm not started yet is skipped by its
    worker: its generation is no longer the key's)."""
    if warm is None or warm.handle is None:
        return
    try:
        warm.handle.cancel(wait=wait)
    except Exception as exc:  # an engine closed or restarted under it: its pages are gone anyway
        log.info("cancelling a warm failed: %s", exc)


class PrefixWarmer:
    """One prefix warm per key (a chat session's id), started on worker threads.

    Args:
        engine_source: an object whose ``engine`` attribute is the
            :class:`~engine.client.EngineClient` (None while it loads: nothing is warmed).
        metrics: an :class:`~app.metrics.Metrics` whose ``observe_warm(source)`` counts every warm
            the engine accepted (None: not counted); may be set later.
        threads: worker threads (:data:`WARM_THREADS`).
    """

    def __init__(self, engine_source, *, metrics=None, threads: int = WARM_THREADS):
        self.engine_source = engine_source
        self.metrics = metrics
        self._lock = threading.Lock()
        self._warms: dict[str, _Warm] = {}
        self._gen = itertools.count(1)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = max(1, int(threads))
        self._workers: list[threading.Thread] = []

    # ------------------------------------------------------------------ starting
    def warm(self, key: str, images: list, salt: str, source: str = "upload", *, system: str | None = None) -> Future:
        """Warm the prefix of ``images`` (the list a question passes to
        :func:`engine.media_first_messages`, same order, same ``system``) under ``salt``, as
        ``key``'s warm; the key's previous warm is cancelled (its pages freed).

        Returns at once. The returned future resolves, once a worker has called the engine, to
        the engine's warm handle (``result(timeout)`` -> prefix tokens, ``cancel(wait)``,
        ``done``), or to None: superseded or cancelled before it started, no engine, or refused
        (logged).
        """
        future: Future = Future()
        with self._lock:
            gen = next(self._gen)
            old = self._warms.pop(key, None)
            self._warms[key] = _Warm(gen, salt, source)  # at the end: the newest
            self._prune_locked()
            if len(self._workers) < self._threads:
                worker = threading.Thread(target=self._work, name="prism-warm", daemon=True)
                self._workers.append(worker)
                worker.start()
        _cancel(old)
        self._jobs.put((key, gen, list(images), salt, source, system, future))
        return future

    def _work(self) -> None:
        while True:
            key, gen, images, salt, source, system, future = self._jobs.get()
            try:
                future.set_result(self._start(key, gen, images, salt, source, system))
            except BaseException:  # a bug must not stop the worker
                log.exception("warming %s failed", source)
                future.set_result(None)

    def _start(self, key: str, gen: int, images: list, salt: str, source: str, system: str | None):
        """The worker's part of :meth:`warm`: the engine call, unless superseded meanwhile."""
        if not self._is_current(key, gen):
            return None
        engine = getattr(self.engine_source, "engine", None)
        warm = getattr(engine, "warm", None)
        if warm is None:  # loading (or an engine without warm)
            self._drop(key, gen)
            return None
        try:
            handle = warm(images, system=system, cache_salt=salt)
        except PrismError as exc:  # loading, closed, overloaded, too long, an image gone bad: best-effort
            log.info("warming (%s) skipped: %s: %s", source, type(exc).__name__, exc)
            self._drop(key, gen)
            return None
        with self._lock:
            entry = self._warms.get(key)
            current = entry is not None and entry.gen == gen
            if current:
                entry.handle, entry.engine = handle, engine
        if not current:  # superseded or cancelled while the engine was preprocessing
            _cancel(_Warm(gen, salt, source, handle))
            return None
        if self.metrics is not None:
            self.metrics.observe_warm(source)
        return handle

    def _is_current(self, key: str, gen: int) -> bool:
        with self._lock:
            entry = self._warms.get(key)
            return entry is not None and entry.gen == gen

    def _drop(self, key: str, gen: int) -> None:
        with self._lock:
            entry = self._warms.get(key)
            if entry is not None and entry.gen == gen:
                del self._warms[key]

    def _prune_locked(self) -> None:
        """Forget the oldest finished warms beyond :data:`MAX_TRACKED` keys."""
        excess = len(self._warms) - MAX_TRACKED
        if excess <= 0:
            return
        for key in [k for k, w in self._warms.items() if w.handle is not None and w.handle.done][:excess]:
            del self._warms[key]

    # ------------------------------------------------------------------ cancelling
    def cancel(self, key: str, *, wait: bool = False) -> bool:
        """Cancel ``key``'s warm (its pages freed; with ``wait``, once they are). Returns whether
        the key had one."""
        with self._lock:
            entry = self._warms.pop(key, None)
        _cancel(entry, wait)
        return entry is not None

    def cancel_salt(self, salt: str, *, wait: bool = False) -> int:
        """Cancel every warm under ``salt`` (a session and the continued copies of its shares
        share one). Returns how many."""
        with self._lock:
            keys = [k for k, w in self._warms.items() if w.salt == salt]
            entries = [self._warms.pop(k) for k in keys]
        for entry in entries:
            _cancel(entry, wait)
        return len(entries)

    def cancel_all(self) -> int:
        """Cancel every warm (shutdown). Returns how many were tracked."""
        with self._lock:
            entries, self._warms = list(self._warms.values()), {}
        for entry in entries:
            _cancel(entry)
        return len(entries)

    # ------------------------------------------------------------------ reading
    def handle(self, key: str):
        """``key``'s engine warm handle: None when it has none (never warmed, cancelled, not
        started yet)."""
        with self._lock:
            entry = self._warms.get(key)
            return entry.handle if entry is not None else None

    def active(self, key: str) -> bool:
        """Whether ``key`` has a warm waiting to start, or one started on the current engine
        (running or finished; a warm of an engine core that has since been replaced is not: its
        prefix went with that core)."""
        with self._lock:
            entry = self._warms.get(key)
        if entry is None:
            return False
        return entry.handle is None or entry.engine is getattr(self.engine_source, "engine", None)

    def source(self, key: str) -> str | None:
        """Why ``key``'s current warm was started (one of :data:`SOURCES`), None without one."""
        with self._lock:
            entry = self._warms.get(key)
            return entry.source if entry is not None else None
