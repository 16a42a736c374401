"""Engine clients: what the app talks to, with the engine core in this process or in a child process.

:class:`EngineClient` is the interface (what the app uses of an engine); it has two
implementations:

- :class:`InProcessClient` wraps an :class:`~engine.engine.Engine` of this process (library users
  keep using ``Engine`` itself; the client only adds the interface's few extra names).
- :class:`ProcessClient` runs ``Engine.from_pretrained(...)`` in a child process (multiprocessing
  ``spawn``) and talks to it over one :func:`multiprocessing.Pipe` with pickle: the engine loop,
  its tensor-parallel workers and the model's Python work no longer share this process's GIL with
  the web server. docs/ARCHITECTURE.md ("The core in its own process") has the protocol and the
  measurement behind the choice of transport.

The child runs a loop that receives commands (submit, cancel, calls, close) and forwards each
request's outputs, tagged by request id, in batches (one forwarder thread); in this process a
reader thread (:class:`ConnectionClient`, which the replicas' connections share) puts them
into the request's :class:`~engine.serving.handle.OutputChannel`, so the app holds ordinary
:class:`~engine.serving.handle.RequestHandle`\\ s whose ``cancel`` sends a cancel to the child.

Image and clip bytes (the base64 uploads of ``/v1``) go to the child once per session and content
(:func:`blob_key`: the SHA-256 of the cache salt and the bytes) and are referenced by key
afterwards: both sides keep the same bounded LRU of keys (the same operations in the same order,
so they agree without asking), the child with the bytes. A path (the session store's files) is
passed as a path: the child opens it on the same host.

If the child dies (a crash, ``kill -9``), every waiting request fails with
:class:`~engine.errors.EngineAbortedError`, later calls raise it at once, and ``on_crash`` is
called so the owner (the app's :class:`~app.model_loader.ModelLoader`) can start a new one.
"""

from __future__ import annotations

import abc
import atexit
import hashlib
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial

from .errors import EngineAbortedError, InvalidRequestError, PrismError
from .inputs.prompts import prefix_messages
from .serving.handle import OutputChannel, RequestHandle, WarmHandle, is_final
from .serving.outputs import Completion
from .serving.sampling import SamplingParams

__all__ = ["EngineClient", "InProcessClient", "ProcessClient", "ConnectionClient", "DEFAULT_BLOB_CACHE_BYTES",
           "ENGINE_CALLS", "KeyLRU", "MissingBlob", "blob_key", "engine_info", "picklable", "send_blobs",
           "serve_connection", "take_blobs"]

log = logging.getLogger(__name__)

#: Bytes of uploaded images and clips the child keeps by content key (LRU): a repeated ``/v1``
#: request about the same images sends only their keys.
DEFAULT_BLOB_CACHE_BYTES = 512 << 20

#: Engine methods a client may call in the child (or a replica) by name (anything else is refused there).
ENGINE_CALLS = ("stats", "prefix_info", "forget", "clear_prefix_cache", "count_prompt_tokens")


class EngineClient(abc.ABC):
    """What the app uses of an engine, wherever its core runs.

    Attributes (read-only): ``model_id`` (str), ``device`` (:class:`torch.device`), ``dtype``
    (:class:`torch.dtype`), ``options`` (:class:`~engine.options.EngineOptions`),
    ``min_image_pixels`` (int: the smallest image area, width x height in pixels, the checkpoint's
    processor takes without upscaling; 0 when it names none).

    Every method raises :class:`~engine.errors.PrismError` when the engine is closed, and a
    :class:`ProcessClient` :class:`~engine.errors.EngineAbortedError` once its core has died.
    """

    model_id: str
    device: object
    dtype: object
    options: object
    min_image_pixels: int

    @abc.abstractmethod
    def submit(self, messages, sampling: SamplingParams | None = None, *, cache_salt: str | None = None):
        """Validate and queue a request (as :meth:`engine.Engine.submit`): returns its handle
        (iterate it for text deltas, then the :class:`~engine.serving.outputs.Completion`).

        Raises:
            InvalidRequestError, InvalidImageError, InvalidVideoError, RequestTooLargeError,
            EngineOverloadedError, PrismError: as ``Engine.submit``, raised here as in-process.
        """

    @abc.abstractmethod
    def warm(self, images, *, system: str | None = None, cache_salt: str | None = None):
        """Build and cache the public prefix of questions about ``images`` ahead of the first (as
        :meth:`engine.Engine.warm`): returns its :class:`~engine.serving.handle.WarmHandle`.

        Raises:
            InvalidRequestError, InvalidImageError, InvalidVideoError, RequestTooLargeError,
            EngineOverloadedError, PrismError: as ``Engine.warm``, raised here as in-process.
        """

    @abc.abstractmethod
    def cancel(self, handle, wait: bool = True) -> None:
        """Stop the request of ``handle``; with ``wait``, return once its KV pages are free."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """The engine's counters (:meth:`engine.Engine.stats`)."""

    @abc.abstractmethod
    def prefix_info(self, cache_salt: str | None, images: list[str | None] | None = None, *,
                    preview: bool = False) -> list[dict] | None:
        """What a salt's next prefix keeps of each image (:meth:`engine.Engine.prefix_info`)."""

    @abc.abstractmethod
    def forget(self, cache_salt: str):
        """Drop what the engine keeps of a salt (:meth:`engine.Engine.forget`); returns the
        :class:`~engine.engine.Forgotten` counts."""

    @abc.abstractmethod
    def clear_prefix_cache(self) -> None:
        """Evict every cached prefix no running request uses."""

    @abc.abstractmethod
    def count_prompt_tokens(self, messages, *, cache_salt: str | None = None) -> int:
        """The prompt length of ``messages`` in tokens (:meth:`engine.Engine.count_prompt_tokens`)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the engine (running requests end with an error); calling it again is harmless."""

    def stream(self, messages, sampling: SamplingParams | None = None, *,
               cache_salt: str | None = None) -> Iterator[str | Completion]:
        """Text deltas, then the :class:`Completion` (as :meth:`engine.Engine.stream`)."""
        return iter(self.submit(messages, sampling, cache_salt=cache_salt))

    def generate(self, messages, sampling: SamplingParams | None = None, *,
                 cache_salt: str | None = None) -> Completion:
        """The whole :class:`Completion` (as :meth:`engine.Engine.generate`)."""
        for item in self.stream(messages, sampling, cache_salt=cache_salt):
            if isinstance(item, Completion):
                return item
        raise PrismError("the request ended without a completion")  # pragma: no cover

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def min_image_pixels(engine) -> int:
    """The smallest image area (pixels) ``engine``'s prompt builder takes without upscaling (its
    ``size``'s ``shortest_edge``, which Qwen3-VL's processor reads as a pixel count), 0 when it
    names none."""
    return int((getattr(engine.prompts, "size", None) or {}).get("shortest_edge") or 0)


def engine_info(engine) -> dict:
    """What a client built around ``engine`` in another process needs to know of it: ``model_id``,
    ``device``, ``dtype``, ``options`` and ``min_image_pixels`` (all picklable)."""
    return {"model_id": engine.model_id, "device": engine.device, "dtype": engine.dtype,
            "options": engine.options, "min_image_pixels": min_image_pixels(engine)}


class InProcessClient(EngineClient):
    """An :class:`~engine.engine.Engine` of this process behind the :class:`EngineClient`
    interface. ``submit`` returns what ``Engine.submit`` returns; ``engine`` is the engine itself.
    """

    def __init__(self, engine):
        self.engine = engine
        self.model_id = engine.model_id
        self.device, self.dtype, self.options = engine.device, engine.dtype, engine.options
        self.min_image_pixels = min_image_pixels(engine)

    @classmethod
    def from_pretrained(cls, model, **kwargs) -> InProcessClient:
        """``Engine.from_pretrained(model, **kwargs)`` behind the interface (its errors)."""
        from .engine import Engine

        return cls(Engine.from_pretrained(model, **kwargs))

    def submit(self, messages, sampling=None, *, cache_salt=None):
        return self.engine.submit(messages, sampling, cache_salt=cache_salt)

    def warm(self, images, *, system=None, cache_salt=None):
        return self.engine.warm(images, system=system, cache_salt=cache_salt)

    def cancel(self, handle, wait: bool = True) -> None:
        self.engine.cancel(handle, wait)

    def stream(self, messages, sampling=None, *, cache_salt=None):
        return self.engine.stream(messages, sampling, cache_salt=cache_salt)

    def stats(self) -> dict:
        return self.engine.stats()

    def prefix_info(self, cache_salt, images=None, *, preview=False):
        return self.engine.prefix_info(cache_salt, images, preview=preview)

    def forget(self, cache_salt):
        return self.engine.forget(cache_salt)

    def clear_prefix_cache(self) -> None:
        self.engine.clear_prefix_cache()

    def count_prompt_tokens(self, messages, *, cache_salt=None) -> int:
        return self.engine.count_prompt_tokens(messages, cache_salt=cache_salt)

    def close(self) -> None:
        self.engine.close()


# ---------------------------------------------------------------------------------------- the child


class KeyLRU:
    """Content keys and their sizes in bytes, least recently used first, within ``budget`` bytes.
    The parent and the child each keep one and apply the same operations in the same order."""

    def __init__(self, budget: int):
        self.budget, self.total = budget, 0
        self.sizes: OrderedDict[str, int] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self.sizes

    def touch(self, key: str) -> None:
        self.sizes.move_to_end(key)

    def add(self, key: str, size: int) -> None:
        self.sizes[key] = size
        self.total += size

    def trim(self) -> list[str]:
        """Drop least recently used keys until within budget; returns them."""
        dropped = []
        while self.total > self.budget and self.sizes:
            key, size = self.sizes.popitem(last=False)
            self.total -= size
            dropped.append(key)
        return dropped

    def discard(self, key: str) -> None:
        size = self.sizes.pop(key, None)
        if size is not None:
            self.total -= size


class _BlobRef:
    """Stands for the bytes of an image or clip the child holds under ``key`` (hex SHA-256)."""

    __slots__ = ("key",)

    def __init__(self, key: str):
        self.key = key

    def __reduce__(self):
        return _BlobRef, (self.key,)


class MissingBlob(PrismError):
    """The child does not hold a key the parent referenced (the parent then sends the bytes)."""


_BYTES = (bytes, bytearray, memoryview)


def blob_key(salt: str, data: bytes) -> str:
    """The key the bytes ``data`` of session ``salt`` travel under: the SHA-256 of the salt and
    the bytes. Per session, as every cache of the engine: the same image sent by another session is
    sent again, so no session's request is faster because another sent that image first."""
    return hashlib.sha256(salt.encode("utf-8", "surrogatepass") + b"\0" + data).hexdigest()


def _with_refs(messages, known: Callable[[str, bytes], None], salt: str, inline_paths: bool = False):
    """``messages`` with each image or clip given as bytes replaced by a :class:`_BlobRef` of its
    :func:`blob_key` under ``salt``; ``known(key, data)`` is called for each, in order. With
    ``inline_paths``, an image or clip given as a path is read and passed as its bytes (for an engine
    on another host, where the path does not exist); one that cannot be read is passed on as the
    path, for the engine to refuse with its own message. Anything that is not a well-formed message
    is passed on as it is, for the engine to refuse."""
    if not isinstance(messages, list):
        return messages
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict):
                for field in ("image", "video"):
                    data = part.get(field)
                    if inline_paths and isinstance(data, (str, os.PathLike)):
                        data = _read_or_keep(data)
                    if isinstance(data, _BYTES):
                        key = blob_key(salt, bytes(data))
                        known(key, bytes(data))
                        part = {**part, field: _BlobRef(key)}
            parts.append(part)
        out.append({**message, "content": parts})
    return out


def _read_or_keep(path):
    """The bytes of the file at ``path``, or ``path`` itself when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except (OSError, ValueError):
        return path


def _ref_keys(messages) -> Iterator[str]:
    """The keys of the :class:`_BlobRef`\\ s in ``messages``, in order."""
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            for field in ("image", "video"):
                ref = part.get(field) if isinstance(part, dict) else None
                if isinstance(ref, _BlobRef):
                    yield ref.key


def _resolve_refs(messages, blobs: dict[str, bytes]):
    """``messages`` with every :class:`_BlobRef` replaced by its bytes from ``blobs``.

    Raises:
        MissingBlob: a key is not in ``blobs``.
    """
    if not isinstance(messages, list):
        return messages
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict):
                for field in ("image", "video"):
                    ref = part.get(field)
                    if isinstance(ref, _BlobRef):
                        if ref.key not in blobs:
                            raise MissingBlob(ref.key)
                        part[field] = blobs[ref.key]
    return messages


def send_blobs(messages, keys: KeyLRU, *, salt: str = "", resend: bool = False,
               inline_paths: bool = False) -> tuple[object, dict[str, bytes]]:
    """The parent's side of passing images by content key: ``messages`` with each image or clip
    given as bytes (with ``inline_paths``, as a path too: read here) replaced by its key
    (:func:`blob_key` under the request's cache ``salt``), and the bytes the child does not hold
    yet (all of them with ``resend``), by key; ``keys`` (the parent's copy of the child's LRU) is
    updated as :func:`take_blobs` updates the child's."""
    new: dict[str, bytes] = {}

    def known(key: str, data: bytes) -> None:
        if key in keys:
            keys.touch(key)
            if not resend:
                return
        else:
            keys.add(key, len(data))
        new[key] = data

    sent = _with_refs(messages, known, salt, inline_paths)
    keys.trim()
    return sent, new


def take_blobs(messages, new: dict[str, bytes], keys: KeyLRU, blobs: dict[str, bytes]):
    """The child's side of :func:`send_blobs`: store the bytes sent with a submit, resolve its
    keys, trim to the budget. The same operations as the parent's on its copy of ``keys``, in the
    same order (commands arrive in the order they were prepared), so both hold the same keys.

    Raises:
        MissingBlob: a key the child does not hold (the parent then sends every byte again).
    """
    seen = set()
    for key in _ref_keys(messages):
        if key in seen or key not in new:
            if key in keys:
                keys.touch(key)
        else:
            if key not in keys:
                keys.add(key, len(new[key]))
            else:
                keys.touch(key)
            blobs[key] = new[key]
        seen.add(key)
    try:
        return _resolve_refs(messages, blobs)
    finally:
        for key in keys.trim():
            blobs.pop(key, None)


def picklable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a :class:`PrismError` with its type and message (the
    caller sees the same text either way)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return PrismError(f"{type(exc).__name__}: {exc}")


def _picklable_output(item):
    """``item`` if it pickles, else a :class:`PrismError` saying so (the request then fails
    instead of waiting for an output that never arrives)."""
    try:
        pickle.dumps(item)
        return item
    except Exception as exc:
        return PrismError(f"an output of the engine could not be sent: {type(exc).__name__}: {exc}")


class _Core:
    """The child's side: the engine, the command loop (main thread), the calls (a thread pool) and
    the forwarding of outputs (one thread for every request: each handle's channel wakes it,
    :meth:`RequestHandle.listen`, and it sends what every woken request has, as one message).

    Why a thread and not an event loop: a loop's wake-up from the engine's thread took ~1-1.5 ms
    to a first token on the CPU (the self-pipe, the future's callback, the task's step: three
    turns of the loop, each taking the GIL back from the busy engine thread), a thread waiting on
    a condition ~0.3 ms (measured beside each other, docs/PERFORMANCE.md "The Ray hop")."""

    def __init__(self, engine, conn, blob_cache_bytes: int, *, owns_engine: bool = True):
        self.engine, self.conn = engine, conn
        self.owns_engine = owns_engine
        self.send_lock = threading.Lock()
        self.handles: dict[int, RequestHandle] = {}
        self.keys = KeyLRU(blob_cache_bytes)
        self.blobs: dict[str, bytes] = {}
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="prism-core-call")
        self.ready_cv = threading.Condition()
        self.ready: dict[int, None] = {}  # requests with outputs to send, in the order they woke
        self.stopping = False
        self.forwarder = threading.Thread(target=self.forward_forever, name="prism-core-forward", daemon=True)
        self.forwarder.start()

    def send(self, message) -> None:
        with self.send_lock:
            self.conn.send(message)

    def reply(self, cid: int, call: Callable[[], object]) -> None:
        try:
            message = ("reply", cid, True, call())
        except BaseException as exc:
            message = ("reply", cid, False, picklable(exc))
        try:
            self.send(message)
        except (OSError, ValueError):  # the parent is gone: the command loop sees EOF and stops
            pass

    def serve(self) -> None:
        """Run commands until ``close`` or the parent's end of the pipe closes."""
        close_cid = None
        while True:
            try:
                command = self.conn.recv()
            except (EOFError, OSError):
                break
            kind, cid = command[0], command[1]
            if kind in ("submit", "warm"):
                _, _, rid, messages, sampling, salt, new = command
                try:
                    messages = take_blobs(messages, new, self.keys, self.blobs)
                except MissingBlob as exc:
                    self.reply(cid, partial(_raise, exc))
                    continue
                call = partial(self.submit, rid, messages, sampling, salt) if kind == "submit" else \
                    partial(self.warm, rid, messages, salt)
                self.pool.submit(self.reply, cid, call)
            elif kind == "cancel":
                self.pool.submit(self.reply, cid, partial(self.cancel, *command[2:]))
            elif kind == "call":
                _, _, name, args, kwargs = command
                self.pool.submit(self.reply, cid, partial(self.call, name, args, kwargs))
            elif kind == "close":
                close_cid = cid
                break
        if self.owns_engine:
            self.engine.close()  # every request still running ends with its error: forward those
        else:  # one connection of several to a shared engine: only its own requests end
            for handle in list(self.handles.values()):
                handle.cancel(wait=False)
        with self.ready_cv:  # the forwarder sends their ends (a request that does not end in 5 s
            self.ready_cv.wait_for(lambda: not self.handles, timeout=5)  # is the parent's EOF to report)
            self.stopping = True
            self.ready_cv.notify_all()
        self.forwarder.join(5)
        self.pool.shutdown(wait=False, cancel_futures=True)
        if close_cid is not None:
            self.reply(close_cid, lambda: None)

    def submit(self, rid: int, messages, sampling, salt) -> int:
        handle = self.engine.submit(messages, sampling, cache_salt=salt)
        self.watch(rid, handle)
        return handle.prompt_tokens

    def warm(self, rid: int, messages, salt) -> int:
        warm = self.engine.warm_prefix(messages, cache_salt=salt)
        self.watch(rid, warm.handle)
        return warm.prefix_tokens

    def watch(self, rid: int, handle: RequestHandle) -> None:
        """Forward ``handle``'s outputs, tagged ``rid``, from now on (what came already too)."""
        with self.ready_cv:
            self.handles[rid] = handle
        handle.listen(partial(self.wake, rid))

    def wake(self, rid: int) -> None:
        """A channel's listener (the engine's thread): request ``rid`` has outputs to send."""
        with self.ready_cv:
            if rid not in self.ready:
                self.ready[rid] = None
                self.ready_cv.notify()

    def cancel(self, rid: int, wait: bool) -> None:
        handle = self.handles.get(rid)
        if handle is not None:
            handle.cancel(wait)

    def call(self, name: str, args, kwargs):
        if name not in ENGINE_CALLS:
            raise InvalidRequestError(f"not an engine call: {name!r}")
        return getattr(self.engine, name)(*args, **kwargs)

    def forward_forever(self) -> None:
        """The forwarder thread: whenever requests woke it, every output they have (a step's
        tokens for every stream that woke meanwhile) goes to the parent as one message; a
        request's error as its picklable copy (the parent's handle raises it)."""
        while True:
            with self.ready_cv:
                self.ready_cv.wait_for(lambda: self.ready or self.stopping)
                if not self.ready:
                    return
                ready, self.ready = list(self.ready), {}
                handles = [(rid, self.handles.get(rid)) for rid in ready]
            batch, ended = [], []
            for rid, handle in handles:
                if handle is None:
                    continue
                for item in handle.take_ready():
                    batch.append((rid, picklable(item) if isinstance(item, BaseException) else item))
                if handle.done:
                    ended.append(rid)
            try:
                self.flush(batch)
            except Exception:  # a bug here must not stop every later request's outputs
                log.exception("forwarding outputs failed")
            if ended:
                with self.ready_cv:
                    for rid in ended:
                        self.handles.pop(rid, None)
                    self.ready_cv.notify_all()

    def flush(self, batch: list) -> None:
        if not batch:
            return
        try:
            try:
                self.send(("out", batch))
            except (pickle.PicklingError, TypeError, AttributeError):  # one item that does not pickle
                self.send(("out", [(rid, _picklable_output(item)) for rid, item in batch]))
        except (OSError, ValueError):  # the parent is gone: the command loop sees EOF and stops
            pass


def serve_connection(engine, conn, blob_cache_bytes: int = DEFAULT_BLOB_CACHE_BYTES) -> None:
    """Serve the core protocol (``ProcessClient``'s: submit, warm, cancel, calls; outputs in
    batches) over ``conn`` for ``engine``, which this connection does not own: returns when the
    peer closes it (or sends ``close``), after cancelling the requests it opened; the engine goes on.

    Args:
        engine: an :class:`~engine.engine.Engine` of this process.
        conn: a :class:`multiprocessing.connection.Connection`, authenticated already (pickle
            runs what it is sent).
        blob_cache_bytes: bytes of images and clips kept by content key for this connection.
    """
    _Core(engine, conn, blob_cache_bytes, owns_engine=False).serve()


def _raise(exc: BaseException):
    raise exc


def _core_main(conn, model, device, dtype, options: dict, blob_cache_bytes: int) -> None:
    """The child process: load the engine, say ``ready`` (or ``failed``), serve commands."""
    # Signals sent to the server's process group (Ctrl-C in its terminal, a supervisor's SIGTERM)
    # are the parent's to act on: it closes the core. The core leaves the group, and would ignore
    # a Ctrl-C anyway; it exits by itself when the parent's end of the pipe closes.
    if hasattr(os, "setpgrp"):
        os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from .engine import Engine

    try:
        engine = Engine.from_pretrained(model, device=device, dtype=dtype, **options)
    except BaseException as exc:
        conn.send(("failed", picklable(exc)))
        return
    conn.send(("ready", engine_info(engine)))
    _Core(engine, conn, blob_cache_bytes).serve()


# ---------------------------------------------------------------------------------------- the parent


class ConnectionClient:
    """The client's side of the core protocol over one :class:`~multiprocessing.connection.Connection`
    (what :func:`serve_connection` and the child's loop serve): requests and warms, their outputs
    into :class:`~engine.serving.handle.OutputChannel`\\ s, replies into futures, cancels, calls.
    :class:`ProcessClient` (a pipe to the child) and :class:`~engine.replicas.link.ReplicaLink`
    (a TCP connection to a replica) are this class with their own ends.

    A subclass gives :meth:`_lost_error` (the :class:`~engine.errors.EngineAbortedError` a
    request ends with when the other end goes without :meth:`_close_connection`), may override
    :meth:`_on_lost` (the owner hears first, from the reader thread, once), :meth:`_reader_ended`
    and :meth:`_handle_id`, and calls :meth:`_start_reader` once the connection is ready.

    Args:
        conn: the connection, authenticated already (pickle runs what it is sent).
        keys: the client's copy of the content keys the other end holds (:class:`KeyLRU`).
        timeout: seconds to wait for a reply (None: no bound); a reply not in time raises
            EngineAbortedError.
        inline_paths: send image paths as their bytes (the other end may be on another host).
        what: the other end, in messages (``"engine process"``, ``"engine replica"``).
    """

    def __init__(self, conn, keys: KeyLRU, *, timeout: float | None = None, inline_paths: bool = False,
                 what: str = "engine"):
        self._conn, self._keys = conn, keys
        self._timeout, self._inline_paths, self._what = timeout, inline_paths, what
        self._closing = False
        self._dead: BaseException | None = None
        self._send_lock = threading.Lock()  # also orders the key LRU's operations with the sends
        self._lock = threading.Lock()
        self._channels: dict[int, OutputChannel] = {}
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count(1)
        self._reader: threading.Thread | None = None

    # ------------------------------------------------------------------ the subclass's ends
    def _lost_error(self) -> EngineAbortedError:
        """The error of a request whose connection was lost (the other end died)."""
        raise NotImplementedError

    def _on_lost(self) -> None:
        """Called once, from the reader thread, when the connection closed without being closed
        here, before the waiting requests fail."""

    def _reader_ended(self) -> None:
        """Called from the reader thread once the connection has closed, before anything fails."""

    def _handle_id(self, rid: int):
        """The id of request ``rid``'s handle."""
        return rid

    def _start_reader(self, name: str) -> None:
        self._reader = threading.Thread(target=self._read, name=name, daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ requests
    def _open(self, kind: str, messages, sampling, salt) -> RequestHandle:
        """Send a request (``kind`` ``"submit"``) or a warm (``"warm"``: the reply is the prefix
        length, which becomes the handle's ``prompt_tokens``) and return its handle once the other
        end accepted it.

        Raises:
            the engine's input errors, as in-process; EngineAbortedError: the connection is lost
            (or no reply within ``timeout``); PrismError: closed.
        """
        rid, channel = next(self._ids), OutputChannel()
        with self._lock:
            self._channels[rid] = channel
        try:
            try:
                tokens = self._submit(kind, rid, messages, sampling, salt, resend=False)
            except MissingBlob:  # the other end dropped a key this side still lists: every byte again
                tokens = self._submit(kind, rid, messages, sampling, salt, resend=True)
        except BaseException:
            with self._lock:
                self._channels.pop(rid, None)
            raise
        return RequestHandle(self._handle_id(rid), channel, partial(self._cancel, rid), prompt_tokens=tokens)

    def _call(self, name: str, *args, **kwargs):
        """One of :data:`ENGINE_CALLS` on the other end's engine; its result or error."""
        return self._wait(self._request("call", (name, args, kwargs)))

    def _submit(self, kind, rid, messages, sampling, salt, *, resend: bool) -> int:
        with self._send_lock:
            sent, new = send_blobs(messages, self._keys, salt=salt or "", resend=resend,
                                   inline_paths=self._inline_paths)
            future = self._request(kind, (rid, sent, sampling, salt, new), locked=True)
        try:
            return self._wait(future)
        except MissingBlob as exc:
            self._keys.discard(str(exc))
            raise

    def _wait(self, future: Future, timeout: float | None = None):
        timeout = self._timeout if timeout is None else timeout
        try:
            return future.result(timeout)
        except FutureTimeout:
            raise EngineAbortedError(f"the {self._what} did not answer within {timeout:.0f} s") from None

    def _cancel(self, rid: int, wait: bool) -> None:
        with self._lock:
            if rid not in self._channels:  # finished already
                return
        try:
            future = self._request("cancel", (rid, wait))
            if wait:
                self._wait(future)
        except PrismError as exc:  # the connection is lost or closed: the stream ends with its error
            log.info("cancel on the %s: %s", self._what, exc)

    def _request(self, kind: str, payload: tuple, *, locked: bool = False) -> Future:
        """Send a command with a fresh call id; its reply resolves the returned future (``close``
        may be sent while closing)."""
        future: Future = Future()
        with self._lock:
            if self._closing and kind != "close":
                raise PrismError("engine is closed")
            if self._dead is not None:
                raise self._lost_error()
            cid = next(self._ids)
            self._calls[cid] = future
        message = (kind, cid, *payload)
        try:
            if locked:
                self._conn.send(message)
            else:
                with self._send_lock:
                    self._conn.send(message)
        except (OSError, ValueError):
            with self._lock:
                self._calls.pop(cid, None)
            raise (PrismError("engine is closed") if self._closing else self._lost_error()) from None
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            with self._lock:
                self._calls.pop(cid, None)
            raise InvalidRequestError(f"the request cannot be sent to the {self._what}: {exc}") from None
        return future

    def _read(self) -> None:
        """The reader thread: outputs into their channels, replies into their futures; when the
        connection closes, everything still waiting fails (with :meth:`_lost_error` unless closed)."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # an output that does not unpickle here: a bug, not the other end's
                log.exception("unreadable message from the %s", self._what)
                continue
            if message[0] == "out":
                with self._lock:
                    for rid, item in message[1]:
                        channel = self._channels.get(rid)
                        if channel is None:
                            continue
                        channel.put(item)
                        if is_final(item):
                            del self._channels[rid]
            elif message[0] == "reply":
                _, cid, ok, value = message
                with self._lock:
                    future = self._calls.pop(cid, None)
                if future is not None:
                    future.set_result(value) if ok else future.set_exception(value)
        self._reader_ended()
        with self._lock:
            lost = not self._closing
            self._dead = self._lost_error() if lost else PrismError("engine is closed")
            channels, self._channels = list(self._channels.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        if lost:
            # the owner hears first: by the time a waiting client reads its error, /healthz says so
            # and the next request goes elsewhere
            try:
                self._on_lost()
            except Exception:
                log.exception("the %s's lost-connection hook failed", self._what)
        for channel in channels:
            channel.put(self._lost_error() if lost else PrismError("engine is closed"))
        for future in calls:
            if not future.done():
                future.set_exception(self._lost_error() if lost else PrismError("engine is closed"))


class ProcessClient(ConnectionClient, EngineClient):
    """The engine core in a child process, behind the :class:`EngineClient` interface.

    Starting it loads the model in the child (``Engine.from_pretrained(model, device=device,
    dtype=dtype, **options)``, its tensor-parallel workers and graph capture with it) and returns
    once it is ready.

    Args:
        model, device, dtype, **options: as :meth:`engine.Engine.from_pretrained`.
        on_crash: called with this client, from its reader thread, when the child dies without
            being closed (after every waiting request has been failed).
        blob_cache_bytes: bytes of images and clips the child keeps by content key.

    Attributes:
        pid: the child's process id. crashed: whether it died without being closed.

    Raises:
        CheckpointError, InvalidRequestError, TensorParallelError, PrismError: loading failed in
            the child (its error, raised here). EngineAbortedError: the child died while loading.
    """

    def __init__(self, model, *, device=None, dtype=None, on_crash: Callable[[ProcessClient], None] | None = None,
                 blob_cache_bytes: int = DEFAULT_BLOB_CACHE_BYTES, **options):
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe(duplex=True)
        self._process = context.Process(target=_core_main, name="prism-engine-core", daemon=False,
                                        args=(child, str(model), device, dtype, options, blob_cache_bytes))
        self._process.start()
        child.close()  # only the child holds its end now: its death is EOF here
        super().__init__(self._conn, KeyLRU(blob_cache_bytes), what="engine process")
        self.pid = self._process.pid
        self.on_crash = on_crash
        self.crashed = False
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(10)
            self._conn.close()
            raise EngineAbortedError(f"the engine process stopped while loading the model (exit code "
                                     f"{self._process.exitcode})") from None
        if kind == "failed":
            self._process.join(30)
            self._conn.close()
            raise value
        self.model_id, self.device, self.dtype = value["model_id"], value["device"], value["dtype"]
        self.options, self.min_image_pixels = value["options"], value["min_image_pixels"]
        self._start_reader("prism-engine-reader")
        # multiprocessing joins a non-daemonic child at exit, and this child waits for the pipe to
        # close: close it first (a daemonic child could not start tensor-parallel workers)
        atexit.register(self.close, 5.0)

    # ------------------------------------------------------------------ the interface
    def submit(self, messages, sampling=None, *, cache_salt=None) -> RequestHandle:
        return self._open("submit", messages, sampling, cache_salt)

    def warm(self, images, *, system=None, cache_salt=None) -> WarmHandle:
        handle = self._open("warm", prefix_messages(images, system=system), None, cache_salt)
        return WarmHandle(handle, handle.prompt_tokens)

    def cancel(self, handle, wait: bool = True) -> None:
        handle.cancel(wait)

    def stats(self) -> dict:
        return self._call("stats")

    def prefix_info(self, cache_salt, images=None, *, preview=False):
        return self._call("prefix_info", cache_salt, images, preview=preview)

    def forget(self, cache_salt):
        return self._call("forget", cache_salt)

    def clear_prefix_cache(self) -> None:
        self._call("clear_prefix_cache")

    def count_prompt_tokens(self, messages, *, cache_salt=None) -> int:
        return self._call("count_prompt_tokens", messages, cache_salt=cache_salt)

    @property
    def alive(self) -> bool:
        """Whether the child is running and not closed (a child just killed reads as dead at once,
        before the reader thread has seen its pipe close)."""
        return self._dead is None and not self._closing and self._process.is_alive()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child: its engine closes (running requests fail with PrismError), then it
        exits; killed if it has not within ``timeout`` seconds."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        atexit.unregister(self.close)
        if self._dead is None:
            try:
                self._request("close", ()).result(timeout)
            except Exception as exc:  # dead already, or too slow: it is killed below
                log.info("engine process did not close cleanly: %s", exc)
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(10)
        self._conn.close()
        if threading.current_thread() is not self._reader:  # on_crash may close it from the reader
            self._reader.join(10)

    # ------------------------------------------------------------------ the connection's ends
    def _lost_error(self) -> EngineAbortedError:
        code = self._process.exitcode
        how = f"exit code {code}" if code is None or code >= 0 else f"killed by signal {-code}"
        return EngineAbortedError(f"the engine process (pid {self.pid}) stopped unexpectedly ({how}); "
                                  "it is being restarted: ask again in a moment")

    def _reader_ended(self) -> None:
        self._process.join(5)  # its exit code for the error's message

    def _on_lost(self) -> None:
        self.crashed = True
        log.error("the engine process %s died (exit code %s)", self.pid, self._process.exitcode)
        if self.on_crash is not None:
            self.on_crash(self)
