"""The request path between the app and one replica: a direct, authenticated connection.

Ray Serve places, health-checks and restarts the replicas (:mod:`engine.replicas.deployment`);
the requests themselves do not travel through Ray's RPC. Each replica listens on one TCP port of
its node (:class:`LinkServer`; the loopback address on the app's local Ray instance) and the app
holds one connection to each (:class:`ReplicaLink`), speaking the protocol of the engine core in a
child process (``ProcessClient`` / :func:`engine.client.serve_connection`: submit, warm, cancel,
calls; a request's outputs in batches). Measured on the CPU (docs/PERFORMANCE.md): a Serve
handle's streamed call costs ~6 ms to a first item and a Ray core actor's ~3-5 ms, where this
connection costs well under 1 ms, against a prefix hit's ~15 ms.

Authentication: the replica draws a 32-byte key at each start and hands it (with its address) to
the app through Serve (``info()``, over Ray's own authenticated channel). A connection is usable
only after both sides prove they hold the key: each sends a random 32-byte challenge and answers
the other's with ``HMAC-SHA256(key, role || challenge)`` (the role, ``client`` or ``server``,
keeps an answer from being reflected back). Until then nothing is unpickled, and a handshake that
does not finish within :data:`HANDSHAKE_TIMEOUT_S` is dropped. Nothing is encrypted (as Ray's own
traffic without TLS): on a cluster, keep the nodes' network private (README, Security).

The connection is ordered, so the replica's copy of the images it was sent (by content key) and
the app's copy of its keys stay in step, as with the child process's pipe. When a replica dies its
connection closes: every request waiting on it ends with the owner's
:class:`~engine.errors.EngineAbortedError`, after the owner was told (``on_lost``).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import os
import pickle
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from multiprocessing.connection import Connection

from ..client import MissingBlob, send_blobs, serve_connection
from ..errors import EngineAbortedError, InvalidRequestError, PrismError
from ..serving.handle import OutputChannel, RequestHandle, is_final

__all__ = ["LinkServer", "ReplicaLink", "HANDSHAKE_TIMEOUT_S"]

log = logging.getLogger(__name__)

#: Seconds a connection may take to authenticate (either side) before it is dropped.
HANDSHAKE_TIMEOUT_S = 10.0
#: Handshakes under way at once on one replica; more connections are closed at once.
MAX_HANDSHAKES = 8
_NONCE = 32


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection during the handshake")
        data += chunk
    return data


def _proof(key: bytes, role: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, role + challenge, hashlib.sha256).digest()


def _handshake(sock: socket.socket, key: bytes, *, server: bool) -> None:
    """Mutual challenge-response over ``sock`` (in timeout mode).

    Raises:
        PermissionError: the peer does not hold ``key``. ConnectionError, OSError: it went away
            (or timed out).
    """
    mine, theirs_role, my_role = os.urandom(_NONCE), (b"client" if server else b"server"), \
        (b"server" if server else b"client")
    sock.sendall(mine)
    theirs = _recv_exact(sock, _NONCE)
    sock.sendall(_proof(key, my_role, theirs))
    answer = _recv_exact(sock, hashlib.sha256().digest_size)
    if not hmac.compare_digest(answer, _proof(key, theirs_role, mine)):
        raise PermissionError("the peer does not hold the replica's key")


def _connection(sock: socket.socket) -> Connection:
    """A blocking, Nagle-free :class:`Connection` over an authenticated ``sock`` (which it takes)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a delta is one small message
    sock.settimeout(None)
    return Connection(sock.detach())


class LinkServer:
    """The replica's side: a TCP listener whose authenticated connections are served by
    :func:`engine.client.serve_connection` on the replica's engine (one thread each).

    Args:
        engine: the replica's :class:`~engine.engine.Engine`.
        host: the address to listen on (the replica's node address: loopback on a local Ray).
        blob_cache_bytes: image bytes kept by content key, per connection.

    Attributes:
        address: ``(host, port)`` it listens on. authkey: its 32-byte key (new at each start).

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, engine, host: str, blob_cache_bytes: int):
        self.engine, self.blob_cache_bytes = engine, blob_cache_bytes
        self.authkey = os.urandom(32)
        self._socket = socket.create_server((host, 0), backlog=16)
        self.address = tuple(self._socket.getsockname()[:2])
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._closed = False
        self._thread = threading.Thread(target=self._accept_forever, name="prism-link-accept", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def close(self) -> None:
        self._closed = True
        try:
            self._socket.close()
        except OSError:
            pass

    def _accept_forever(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._socket.accept()
            except OSError:
                if self._closed:
                    return
                continue
            if not self._handshakes.acquire(blocking=False):
                sock.close()
                continue
            threading.Thread(target=self._serve_one, args=(sock,), name="prism-link", daemon=True).start()

    def _serve_one(self, sock: socket.socket) -> None:
        try:
            try:
                sock.settimeout(HANDSHAKE_TIMEOUT_S)
                _handshake(sock, self.authkey, server=True)
                conn = _connection(sock)
            except (OSError, PermissionError) as exc:
                log.warning("refused a connection to the replica: %s", exc)
                sock.close()
                return
        finally:
            self._handshakes.release()
        try:
            serve_connection(self.engine, conn, self.blob_cache_bytes)
        finally:
            conn.close()


class ReplicaLink:
    """The app's side of one connection to one replica: requests, their outputs, calls.

    Args:
        address: the replica's ``(host, port)``. authkey: its key (both from its ``info()``).
        keys: the app's copy of the content keys this connection's replica holds (a
            :class:`~engine.client.KeyLRU`, fresh for each connection).
        aborted: makes the error a request on a lost connection ends with.
        on_lost: called (from the reader thread, once) when the connection closes without
            :meth:`close`, before the waiting requests are failed.
        id_prefix: the prefix of its requests' handle ids.
        timeout: seconds to wait for a reply (a prompt being built included); connecting and
            the handshake take at most :data:`HANDSHAKE_TIMEOUT_S`.

    Raises:
        OSError, ConnectionError: the replica cannot be reached. PermissionError: the key is wrong.
    """

    def __init__(self, address, authkey: bytes, *, keys, aborted: Callable[[], EngineAbortedError],
                 on_lost: Callable[[ReplicaLink], None], id_prefix: str, timeout: float):
        sock = socket.create_connection(tuple(address), timeout=HANDSHAKE_TIMEOUT_S)
        try:
            _handshake(sock, authkey, server=False)
        except BaseException:
            sock.close()
            raise
        self._conn = _connection(sock)
        self.keys, self._aborted, self._on_lost = keys, aborted, on_lost
        self._prefix, self._timeout = id_prefix, timeout
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # also orders the key LRU's operations with the sends
        self._channels: dict[int, OutputChannel] = {}
        self._calls: dict[int, Future] = {}
        self._closing = False
        self._dead: BaseException | None = None
        self._reader = threading.Thread(target=self._read, name="prism-link-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._dead is None and not self._closing

    def open(self, kind: str, messages, sampling, salt) -> RequestHandle:
        """Send a request (``kind`` ``"submit"``) or a warm (``"warm"``; its handle's
        ``prompt_tokens`` is the prefix length) and return its handle once the replica accepted it.

        Raises:
            the engine's input errors, as in-process; EngineAbortedError: the connection is lost,
            or the replica did not answer within ``timeout``.
        """
        rid, channel = next(self._ids), OutputChannel()
        with self._lock:
            self._channels[rid] = channel
        try:
            try:
                tokens = self._submit(kind, rid, messages, sampling, salt, resend=False)
            except MissingBlob:  # the replica dropped a key this side still lists: every byte again
                tokens = self._submit(kind, rid, messages, sampling, salt, resend=True)
        except BaseException:
            with self._lock:
                self._channels.pop(rid, None)
            raise
        return RequestHandle(f"{self._prefix}-{rid}", channel, partial(self._cancel, rid), prompt_tokens=tokens)

    def call(self, name: str, *args, **kwargs):
        """One of :data:`engine.client.ENGINE_CALLS` on the replica's engine; its result or error."""
        return self._wait(self._request("call", (name, args, kwargs)))

    def close(self) -> None:
        """Close the connection (the replica cancels what it still runs for it); requests still
        waiting end with ``PrismError("engine is closed")``."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        try:
            self._conn.close()
        except OSError:
            pass

    # ------------------------------------------------------------------ helpers
    def _submit(self, kind, rid, messages, sampling, salt, *, resend: bool) -> int:
        with self._send_lock:
            sent, new = send_blobs(messages, self.keys, salt=salt or "", resend=resend, inline_paths=True)
            future = self._request(kind, (rid, sent, sampling, salt, new), locked=True)
        try:
            return self._wait(future)
        except MissingBlob as exc:
            self.keys.discard(str(exc))
            raise

    def _wait(self, future: Future):
        try:
            return future.result(self._timeout)
        except FutureTimeout:
            raise EngineAbortedError(f"the engine replica did not answer within {self._timeout:.0f} s") from None

    def _cancel(self, rid: int, wait: bool) -> None:
        with self._lock:
            if rid not in self._channels:  # finished already
                return
        try:
            future = self._request("cancel", (rid, wait))
            if wait:
                self._wait(future)
        except PrismError as exc:  # the connection is lost: the stream ends with its error
            log.info("cancel on a replica: %s", exc)

    def _request(self, kind: str, payload: tuple, *, locked: bool = False) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closing:
                raise PrismError("engine is closed")
            if self._dead is not None:
                raise self._aborted()
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
            raise (PrismError("engine is closed") if self._closing else self._aborted()) from None
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            with self._lock:
                self._calls.pop(cid, None)
            raise InvalidRequestError(f"the request cannot be sent to the engine replica: {exc}") from None
        return future

    def _read(self) -> None:
        """The reader thread: outputs into their channels, replies into their futures; when the
        connection closes, everything still waiting fails."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # an output that does not unpickle here: a bug, not the replica's end
                log.exception("unreadable message from an engine replica")
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
        with self._lock:
            lost = not self._closing
            self._dead = self._aborted() if lost else PrismError("engine is closed")
            channels, self._channels = list(self._channels.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        if lost:
            try:
                self._on_lost(self)  # the owner hears first: the next request routes elsewhere
            except Exception:
                log.exception("on_lost failed")
        for channel in channels:
            channel.put(self._aborted() if lost else PrismError("engine is closed"))
        for future in calls:
            if not future.done():
                future.set_exception(self._aborted() if lost else PrismError("engine is closed"))
        try:
            self._conn.close()
        except OSError:
            pass
