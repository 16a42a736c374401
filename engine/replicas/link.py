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
import logging
import os
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from ..client import ConnectionClient, KeyLRU, serve_connection
from ..errors import EngineAbortedError
from ..serving.handle import RequestHandle

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


class ReplicaLink(ConnectionClient):
    """The app's side of one connection to one replica: requests, their outputs, calls
    (:class:`~engine.client.ConnectionClient` over an authenticated TCP connection).

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
        super().__init__(_connection(sock), keys, timeout=timeout, inline_paths=True, what="engine replica")
        self._aborted, self._lost_hook, self._prefix = aborted, on_lost, id_prefix
        self._start_reader("prism-link-reader")

    @property
    def keys(self) -> KeyLRU:
        """The content keys the replica holds for this connection (the app's copy)."""
        return self._keys

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
        return self._open(kind, messages, sampling, salt)

    def call(self, name: str, *args, **kwargs):
        """One of :data:`engine.client.ENGINE_CALLS` on the replica's engine; its result or error."""
        return self._call(name, *args, **kwargs)

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

    def lose(self) -> None:
        """End the connection as if the replica had gone (it is being removed): the replica
        cancels what it runs for it, and requests still waiting here end with the owner's
        ``aborted`` error (retryable), after ``on_lost`` (from the reader thread, as for a
        replica that died). Harmless on a connection lost or closed already."""
        with self._lock:
            if self._closing or self._dead is not None:
                return
        try:  # shutdown, not close: the reader thread's recv sees the end and fails what waits
            sock = socket.socket(fileno=os.dup(self._conn.fileno()))
        except (OSError, ValueError):  # closed meanwhile
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.close()

    def join(self, timeout: float | None = None) -> None:
        """Wait until the reader thread has failed what waited on a lost or closed connection."""
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout)

    # ------------------------------------------------------------------ the connection's ends
    def _lost_error(self) -> EngineAbortedError:
        return self._aborted()

    def _handle_id(self, rid: int) -> str:
        return f"{self._prefix}-{rid}"

    def _on_lost(self) -> None:
        self._lost_hook(self)

    def _reader_ended(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass
