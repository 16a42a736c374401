"""The one output channel of a request: what the engine hands a caller for each submitted request.

The loop thread (or, with the core in its own process, the thread that reads the core's outputs)
``put``\\ s a request's text deltas, then its :class:`~engine.serving.outputs.Completion`, or the
exception it failed with, into its :class:`OutputChannel`. The caller reads them through a
:class:`RequestHandle`, from a thread (``for item in handle``) or from an asyncio event loop
(``async for item in handle``) without polling: ``put`` wakes a blocked thread and schedules the
awaiting coroutine on its own event loop. A warm (``Engine.warm``) is a request too: its
:class:`WarmHandle` wraps a :class:`RequestHandle` and reads the prefix length as its result.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import warnings
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from ..errors import PrismError
from .outputs import Completion

#: What a channel carries: a text delta, the final completion, or the error the request failed with.
Output = str | Completion | BaseException


def is_final(item: Any) -> bool:
    """Whether ``item`` ends a request's outputs (its completion, or its error)."""
    return isinstance(item, (Completion, BaseException))


class OutputChannel:
    """A thread-safe FIFO of one request's outputs with one reader, blocking or asyncio.

    ``put`` never blocks. :meth:`get` and :meth:`get_nowait` keep the :class:`queue.Queue` calls
    the former ``Request.outbox`` offered (``get_nowait`` raises :class:`queue.Empty`); new code
    iterates a :class:`RequestHandle` instead.
    """

    def __init__(self):
        self._items: deque[Output] = deque()
        self._cv = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._listener: Callable[[], None] | None = None
        self.closed = False  # a final item was put: nothing follows it

    def put(self, item: Output) -> None:
        """Append ``item`` (any thread) and wake the reader."""
        with self._cv:
            self._items.append(item)
            if is_final(item):
                self.closed = True
            waiters, self._waiters = self._waiters, []
            self._cv.notify_all()
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # that event loop is closed: its reader is gone, the writer goes on
                pass
        listener = self._listener
        if listener is not None:
            listener()

    def listen(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after each :meth:`put` (in the writer's thread, outside the
        channel's lock: it must be quick and must not block), and once now if items are waiting:
        for a reader that serves many channels from one thread and takes what is ready with
        :meth:`take_ready`. One listener per channel."""
        with self._cv:
            self._listener = callback
            waiting = bool(self._items)
        if waiting:
            callback()

    def take_ready(self) -> list[Output]:
        """Every item waiting now, oldest first (none: an empty list); never blocks."""
        with self._cv:
            items = list(self._items)
            self._items.clear()
            return items

    def get(self, block: bool = True, timeout: float | None = None) -> Output:
        """The next item, waiting for it with ``block`` (at most ``timeout`` seconds).

        Raises:
            queue.Empty: nothing came in time (or nothing is there, without ``block``).
        """
        with self._cv:
            if block and not self._cv.wait_for(lambda: self._items, timeout=timeout):
                raise queue.Empty
            if not self._items:
                raise queue.Empty
            return self._items.popleft()

    def get_nowait(self) -> Output:
        """The next item if one is there. Raises: queue.Empty: none is."""
        return self.get(block=False)

    def empty(self) -> bool:
        """Whether no item is waiting to be read."""
        with self._cv:
            return not self._items

    async def aget(self) -> Output:
        """The next item, awaited on the running event loop (no polling, no thread)."""
        while True:
            with self._cv:
                if self._items:
                    return self._items.popleft()
                loop = asyncio.get_running_loop()
                future = loop.create_future()
                self._waiters.append((loop, future))
            try:
                await future
            except asyncio.CancelledError:
                with self._cv:
                    self._waiters = [(lp, f) for lp, f in self._waiters if f is not future]
                raise


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class RequestHandle:
    """A submitted request, as its caller sees it (returned by :meth:`engine.Engine.submit`).

    Iterate it once, from a thread or an event loop, for the request's text deltas (``str``) and
    then its :class:`~engine.serving.outputs.Completion`; the error the request failed with is
    raised instead (:class:`~engine.errors.PrismError` and subclasses). Leaving the iteration early
    (``break``, an exception, the iterator closed or dropped) cancels the request, so its KV pages
    are freed: a thread's loop waits until they are, an event loop's does not block.

    Args:
        request_id: the engine's id of the request (int, unique within one engine).
        channel: where its outputs arrive.
        cancel: ``cancel(wait)`` stops the request in the engine; called at most once per handle by
            :meth:`cancel` (later calls are no-ops).
        prompt_tokens: the prompt's length in tokens (visual placeholders included), known at
            submission, before anything is decoded.
        request: the engine's own :class:`~engine.serving.request.Request` behind the handle when
            the engine runs in this process, else None.

    Attributes:
        id, prompt_tokens: as given.
        request: as given: for tests and tools that inspect the loop's state (its fields belong to
            the loop thread: read them under ``engine.loop.paused()``); not a stable API.
    """

    def __init__(self, request_id: int, channel: OutputChannel, cancel: Callable[[bool], None], *,
                 prompt_tokens: int, request: Any = None):
        self.id = request_id
        self.prompt_tokens = prompt_tokens
        self.request = request
        self._channel = channel
        self._cancel = cancel
        self._cancelled = False
        self._final: Output | None = None

    @property
    def outbox(self) -> OutputChannel:
        """Deprecated (kept for one release): the request's raw channel, as ``Request.outbox`` was;
        iterate the handle, or call :meth:`result`, instead."""
        warnings.warn("RequestHandle.outbox (formerly Request.outbox) is deprecated and goes in the next "
                      "release: iterate the handle (for / async for) or call result()", DeprecationWarning,
                      stacklevel=2)
        return self._channel

    @property
    def error(self) -> BaseException | None:
        """The error the request failed with, once it has been read (raised by the iteration or
        :meth:`result`); None before, and after a completion."""
        return self._final if isinstance(self._final, BaseException) else None

    @property
    def done(self) -> bool:
        """Whether the request's completion or error has been read."""
        return self._final is not None

    def cancel(self, wait: bool = True) -> None:
        """Stop the request; it ends with the text so far (``finish_reason="cancelled"``). With
        ``wait``, returns once its KV pages are free. Calling it after the end is harmless."""
        if self._cancelled or self.done:
            return
        self._cancelled = True
        self._cancel(wait)

    def listen(self, callback: Callable[[], None]) -> None:
        """Have ``callback()`` called (from the engine's thread) whenever an output arrives, for a
        reader that forwards many requests' outputs from one thread with :meth:`take_ready`
        (:class:`~engine.client.ConnectionClient`'s other end); see :meth:`OutputChannel.listen`."""
        self._channel.listen(callback)

    def take_ready(self) -> list[Output]:
        """The outputs that arrived and were not read yet, without blocking: text deltas, then at
        the end the :class:`Completion` or the request's error (returned, not raised; the handle
        is :attr:`done` once it was taken)."""
        items = self._channel.take_ready()
        for item in items:
            if is_final(item):
                self._final = item
        return items

    def _take(self, item: Output) -> Output:
        if is_final(item):
            self._final = item
            if isinstance(item, BaseException):
                raise item
        return item

    def __iter__(self) -> Iterator[str | Completion]:
        try:
            while not self.done:
                yield self._take(self._channel.get())
        finally:
            if not self.done:
                self.cancel(wait=True)

    async def _aiter(self) -> AsyncIterator[str | Completion]:
        try:
            while not self.done:
                yield self._take(await self._channel.aget())
        finally:
            if not self.done:
                self.cancel(wait=False)

    def __aiter__(self) -> AsyncIterator[str | Completion]:
        return self._aiter()

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the request's :class:`Completion` (text deltas read on the way are dropped).

        Raises:
            TimeoutError: not finished within ``timeout`` seconds (the request goes on).
            PrismError: the error the request failed with.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self._take(self._channel.get(timeout=left))
            except queue.Empty:
                raise TimeoutError(f"request {self.id} did not finish within {timeout} s") from None
        if isinstance(self._final, BaseException):
            raise self._final
        return self._final


class WarmHandle:
    """A warm in progress (returned by :meth:`engine.Engine.warm`): a session's public prefix being
    built ahead of its first question.

    Args:
        handle: the warm request's :class:`RequestHandle` (its completion carries no text).
        prefix_tokens: the prefix's length in tokens (visual placeholders included).

    Attributes:
        id, prefix_tokens: the request's id and the prefix's length.
        handle: as given (the engine core forwards its outputs like any request's).
    """

    def __init__(self, handle: RequestHandle, prefix_tokens: int):
        self.handle = handle
        self.id = handle.id
        self.prefix_tokens = prefix_tokens

    @property
    def done(self) -> bool:
        """Whether its outcome (cached, cancelled or an error) has been read."""
        return self.handle.done

    def result(self, timeout: float | None = None) -> int:
        """Wait until the prefix is cached; returns its length in tokens (at once when it was
        cached before the warm was asked for).

        Raises:
            TimeoutError: not finished within ``timeout`` seconds (the warm goes on).
            PrismError: the warm was cancelled or dropped (``EngineOverloadedError``: no room for it),
                or failed as the question would (the images could not be encoded, the engine closed).
        """
        done = self.handle.result(timeout)
        if done.finish_reason == "cancelled":
            raise PrismError("the warm was cancelled before its prefix was cached")
        return self.prefix_tokens

    def cancel(self, wait: bool = True) -> None:
        """Stop the warm and free its pages (a prefix it cached already stays cached). With
        ``wait``, returns once they are free; harmless after the end."""
        self.handle.cancel(wait)
