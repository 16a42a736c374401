"""The one output channel of a request (issue 32.3): :class:`~engine.serving.handle.OutputChannel`
and :class:`~engine.RequestHandle`, read from a thread and from an event loop, without polling;
leaving early cancels; ``result`` times out without cancelling; an engine error is raised. Then
the same through a real (tiny) engine: ``Engine.submit`` returns the handle."""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections import deque

import pytest

from engine import Completion, PrismError, RequestHandle, SamplingParams
from engine.serving.handle import OutputChannel

DELTAS = ["Hel", "lo", " wor", "ld"]


def completion(text: str = "Hello world", reason: str = "stop") -> Completion:
    return Completion(text, [1, 2, 3], [7, 8], reason)


class Cancels:
    """A handle's ``cancel`` callable that records each call's ``wait``."""

    def __init__(self):
        self.calls: list[bool] = []

    def __call__(self, wait: bool) -> None:
        self.calls.append(wait)


def new_handle(channel: OutputChannel | None = None) -> tuple[RequestHandle, OutputChannel, Cancels]:
    channel = channel or OutputChannel()
    cancels = Cancels()
    return RequestHandle(5, channel, cancels, prompt_tokens=2), channel, cancels


def write_later(channel: OutputChannel, items, start: threading.Event) -> threading.Thread:
    """A writer thread (the engine loop's part) that puts ``items`` once ``start`` is set."""

    def write():
        start.wait()
        for item in items:
            channel.put(item)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


# ------------------------------------------------------------------------------------------------
# readers: a thread, an event loop
# ------------------------------------------------------------------------------------------------


def test_a_listener_hears_each_put_and_take_ready_returns_what_waits_without_raising():
    """What the engine core's one forwarder thread uses: a listener called after every put (and
    at once for items already there), ``take_ready`` every waiting item, an error returned, not
    raised, and the handle done once its final item was taken."""
    handle, channel, cancels = new_handle()
    channel.put(DELTAS[0])
    heard = []
    handle.listen(lambda: heard.append(len(heard)))
    assert heard == [0]  # an item was waiting already
    channel.put(DELTAS[1])
    assert heard == [0, 1]
    assert handle.take_ready() == DELTAS[:2] and handle.take_ready() == [] and not handle.done
    error = PrismError("boom")
    channel.put(error)
    assert handle.take_ready() == [error] and handle.done and handle.error is error
    handle.cancel()
    assert cancels.calls == []  # done: nothing to cancel

def test_a_thread_reads_every_delta_then_the_completion_in_order():
    handle, channel, cancels = new_handle()
    start = threading.Event()
    writer = write_later(channel, [*DELTAS, completion()], start)
    start.set()
    items = list(handle)
    writer.join(30)
    assert items[:-1] == DELTAS and items[-1] == completion()
    assert handle.done and cancels.calls == []  # read to its end: nothing to cancel
    assert handle.id == 5 and handle.prompt_tokens == 2


def test_event_loop_readers_of_many_handles_are_woken_by_another_thread():
    """Eight handles read at once by one event loop while one thread writes them all: each reader
    gets its own items in order (the wake-up lands on the reader's own loop)."""
    handles = [new_handle() for _ in range(8)]
    start = threading.Event()
    items = [[f"{n}:{d}" for d in DELTAS] + [completion(f"#{n}")] for n in range(8)]

    def write():
        start.wait()
        for step in range(len(DELTAS) + 1):  # interleaved, as the loop's steps would
            for (_, channel, _), mine in zip(handles, items, strict=True):
                channel.put(mine[step])

    writer = threading.Thread(target=write, daemon=True)
    writer.start()

    async def read(handle):
        return [item async for item in handle]

    async def main():
        readers = [asyncio.ensure_future(read(h)) for h, _, _ in handles]
        await asyncio.sleep(0)  # every reader awaits an empty channel first
        start.set()
        return await asyncio.wait_for(asyncio.gather(*readers), 60)

    got = asyncio.run(main())
    writer.join(30)
    assert got == items
    assert all(cancels.calls == [] for _, _, cancels in handles)


# ------------------------------------------------------------------------------------------------
# leaving early cancels; result times out; errors are raised
# ------------------------------------------------------------------------------------------------


def test_closing_a_threads_iteration_early_cancels_and_waits_for_the_pages():
    handle, channel, cancels = new_handle()
    for item in DELTAS:
        channel.put(item)
    reading = iter(handle)
    assert next(reading) == "Hel"
    reading.close()
    assert cancels.calls == [True]  # a thread may wait until the pages are free
    handle.cancel()
    assert cancels.calls == [True]  # at most once


def test_closing_an_event_loops_iteration_early_cancels_without_blocking():
    handle, channel, cancels = new_handle()
    for item in DELTAS:
        channel.put(item)

    async def main():
        reading = aiter(handle)
        first = await anext(reading)
        await reading.aclose()
        return first

    assert asyncio.run(main()) == "Hel"
    assert cancels.calls == [False]  # an event loop must not block on the engine


def test_a_cancelled_reader_task_cancels_its_request():
    """The task reading a handle is cancelled while it awaits (what Starlette does to a stream
    whose client went away): the request is cancelled and the channel keeps no waiter."""
    handle, channel, cancels = new_handle()

    async def main():
        task = asyncio.ensure_future(anext(aiter(handle)))
        await asyncio.sleep(0)  # it awaits the empty channel
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert cancels.calls == [False]
    channel.put("late")  # nobody to wake: must not fail
    assert channel.get_nowait() == "late"


def test_result_times_out_without_cancelling_then_returns_the_completion():
    handle, channel, cancels = new_handle()
    channel.put("partial")
    with pytest.raises(TimeoutError, match="request 5"):
        handle.result(timeout=0.01)
    assert cancels.calls == [] and not handle.done  # the request goes on
    channel.put(completion())
    assert handle.result(timeout=0) == completion()
    assert handle.result() == completion()  # read again: the same completion


def test_the_error_a_request_failed_with_is_raised_to_every_kind_of_reader():
    error = PrismError("the engine stopped")
    for read in (list, lambda h: h.result(timeout=30), lambda h: asyncio.run(_drain(h))):
        handle, channel, cancels = new_handle()
        channel.put("Hel")
        channel.put(error)
        with pytest.raises(PrismError, match="the engine stopped"):
            read(handle)
        assert handle.done and cancels.calls == []  # it ended: nothing to cancel


async def _drain(handle):
    return [item async for item in handle]


# ------------------------------------------------------------------------------------------------
# no busy wait
# ------------------------------------------------------------------------------------------------


class CountingDeque(deque):
    """A deque that counts how often a reader looked whether it holds anything."""

    looks = 0

    def __len__(self):
        self.looks += 1
        return super().__len__()


class RecordingCondition(threading.Condition):
    """A condition variable that records the timeout of every wait."""

    def __init__(self):
        super().__init__()
        self.timeouts: list = []

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        return super().wait(timeout)


def test_a_blocked_thread_waits_without_a_timeout_until_it_is_woken():
    """A polling reader waits with a timeout, again and again; this one waits once, untimed,
    until the item is put."""
    channel = OutputChannel()
    channel._cv = RecordingCondition()
    handle, _, _ = new_handle(channel)
    got = []
    reader = threading.Thread(target=lambda: got.extend(handle), daemon=True)
    reader.start()
    deadline = time.monotonic() + 30  # a hang guard: wait until the reader is blocked
    while not channel._cv.timeouts and time.monotonic() < deadline:
        time.sleep(0.001)
    assert channel._cv.timeouts == [None]
    channel.put(completion())
    reader.join(30)
    assert got == [completion()]
    assert channel._cv.timeouts == [None]  # woken once: no second wait


def test_an_awaiting_reader_is_not_rescheduled_until_an_item_comes():
    """While it awaits an empty channel the event loop runs 200 other iterations: the reader does
    not look once more (a poll, even ``asyncio.sleep(0)``, would), and asks for no timer."""
    channel = OutputChannel()
    channel._items = CountingDeque()
    handle, _, _ = new_handle(channel)
    real_sleep = asyncio.sleep

    async def no_sleep(*args, **kwargs):
        raise AssertionError("the reader slept (a timed poll)")

    async def main():
        reader = asyncio.ensure_future(anext(aiter(handle)))
        await real_sleep(0)
        looks = channel._items.looks
        for _ in range(200):
            await real_sleep(0)
        assert channel._items.looks == looks
        threading.Thread(target=channel.put, args=("Hel",)).start()
        return await asyncio.wait_for(reader, 30)

    asyncio.sleep = no_sleep
    try:
        assert asyncio.run(main()) == "Hel"
    finally:
        asyncio.sleep = real_sleep


def test_a_put_for_a_reader_whose_event_loop_closed_does_not_fail_the_writer():
    """The engine loop must never fail on a reader that went away with its event loop."""
    channel = OutputChannel()
    loop = asyncio.new_event_loop()
    task = loop.create_task(channel.aget())
    loop.run_until_complete(asyncio.sleep(0))  # the reader now awaits
    loop.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        del task
    channel.put("x")  # must not raise
    assert channel.get_nowait() == "x"


# ------------------------------------------------------------------------------------------------
# through the engine
# ------------------------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory()


def wait_idle(engine) -> dict:
    deadline = time.monotonic() + 60  # a hang guard, not a timing
    while (stats := engine.stats())["running"] or stats["waiting"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.005)
    return stats


def test_engine_submit_returns_a_handle_read_by_an_event_loop(engine):
    want = engine.generate(MESSAGES, GREEDY)
    handle = engine.submit(MESSAGES, GREEDY)
    assert isinstance(handle, RequestHandle)
    assert handle.prompt_tokens == engine.count_prompt_tokens(MESSAGES) == len(want.prompt_token_ids)
    items = asyncio.run(_drain(handle))
    done = items[-1]
    assert isinstance(done, Completion) and all(isinstance(d, str) for d in items[:-1])
    assert done.token_ids == want.token_ids and "".join(items[:-1]) == done.text == want.text


def test_an_event_loop_leaving_an_engine_stream_early_frees_its_pages(engine):
    free = wait_idle(engine)["pages_free"]
    handle = engine.submit(MESSAGES, SamplingParams(max_tokens=2000, ignore_eos=True))

    async def first_delta():
        async for item in handle:
            return item  # leaves the iteration: cancels the request

    assert isinstance(asyncio.run(first_delta()), str)
    stats = wait_idle(engine)
    assert handle.request.cancelled and len(handle.request.generated) < 2000
    assert stats["pages_free"] == free


def test_the_former_api_still_works_with_a_deprecation_warning(engine):
    """``submit(...).outbox`` and ``Engine.cancel(request)`` keep working for one release."""
    handle = engine.submit(MESSAGES, SamplingParams(max_tokens=2000, ignore_eos=True))
    with pytest.warns(DeprecationWarning, match="outbox"):
        outbox = handle.outbox
    assert isinstance(outbox.get(timeout=30), str)
    with pytest.warns(DeprecationWarning, match="RequestHandle"):
        engine.cancel(handle.request)
    assert handle.result(timeout=30).finish_reason == "cancelled"
    wait_idle(engine)
