"""The app's engine client over replicas: :class:`ReplicaClient` routes each session to one of N
engine replicas on Ray Serve (:mod:`engine.replicas.deployment`), by its cache salt, with
consistent hashing and bounded loads (:mod:`engine.replicas.ring`).

What the app sees is an :class:`~engine.client.EngineClient` like the others: ``submit`` raises
input errors here and returns a :class:`~engine.serving.handle.RequestHandle` whose iteration
yields the text deltas then the :class:`~engine.serving.outputs.Completion`, and whose ``cancel``
cancels on the replica; ``stats`` is the sum over the replicas that are ready
(:func:`aggregate_stats`), :meth:`ReplicaClient.replica_status` each one's.

Routing keys: a request with a cache salt (a chat session, a share copy, a ``prompt_cache_key``,
an API key's salt) goes by its salt; every cache of the engine is keyed by it, so a session's
questions find their prefix on its replica. A request without one (the engine's one shared
anonymous session, a library call) goes by the content keys of its images (the same images, the
same replica, where that shared session cached them), or, text alone, by a fresh random key (not
remembered: nothing of it is cached for later).

The request path: Serve deploys and restarts the replicas and answers this client's probes
(``info()``), but requests, their outputs and the engine calls (stats, forget, ...) go over one
authenticated connection to each replica (:class:`~engine.replicas.link.ReplicaLink`; the
protocol of ``ProcessClient``'s pipe): a Serve handle's streamed call costs several times what a
prefix hit's first token does on the CPU (docs/SCALING.md, "The request path").

Images travel once per replica and session: each replica keeps the bytes it was sent by
:func:`~engine.client.blob_key` (the salt and the bytes), and this client keeps a copy of each
connection's keys (:func:`~engine.client.send_blobs`); paths (the session store's files) are read
here and sent as bytes, since a replica may be on another host. The connection is ordered, so the
two copies agree; a key the replica lacks anyway is reported and the request is sent again with
every byte.

Faults: when a replica's actor dies its connection closes and its streams end with
:class:`~engine.errors.EngineAbortedError` (retryable: 503 ``aborted`` on ``/v1``, a notice in the
chat), the replica is marked down first, and its sessions are placed on the next replica on the
ring at their next request (one cold miss each). Serve starts a new replica under the same name; a
probe (every ``probe_interval_s``) sees the new incarnation, connects to it, and new sessions go
to it again (the moved ones stay where their caches are now).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..client import DEFAULT_BLOB_CACHE_BYTES, EngineClient, KeyLRU
from ..errors import EngineAbortedError, PrismError
from ..inputs.prompts import prefix_messages
from ..serving.handle import RequestHandle, WarmHandle
from .link import ReplicaLink
from .ring import EPSILON, SessionRouter

__all__ = ["ReplicaClient", "aggregate_stats"]

log = logging.getLogger(__name__)

#: Keys of ``stats()`` the same on every replica (not summed).
_SHARED_KEYS = ("page_size", "kv_cache_dtype", "prefix_cache")
#: Seconds a call (stats, forget, a request's first reply) may wait for its answer; a first reply
#: waits for the prompt to be built (images decoded, processed).
CALL_TIMEOUT_S = 120.0
PROBE_TIMEOUT_S = 10.0


@dataclass
class _Replica:
    """The app's view of one replica."""

    name: str
    state: str = "starting"  # "ready", "down", "removing"
    info: dict = field(default_factory=dict)
    handle: object = None  # its DeploymentHandle, used on the client's event loop only
    link: ReplicaLink | None = None  # the connection to its current incarnation
    down_since: float | None = None
    restarts: int = 0


class ReplicaClient(EngineClient):
    """N engine replicas on Ray Serve behind the :class:`~engine.client.EngineClient` interface.

    Starting it starts (or joins) Ray and Serve, deploys the replicas (each loads the model,
    ``Engine.from_pretrained(model, device=device, dtype=dtype, **options)``, in parallel) and
    returns once all are ready.

    Args:
        model, device, dtype, **options: as :meth:`engine.Engine.from_pretrained`; ``model`` must
            name the same checkpoint on every host of the cluster (a local folder is read by the
            replicas of this host).
        replicas: how many (>= 1).
        ray_address: an existing Ray cluster's address; None starts a local instance, stopped by
            :meth:`close`.
        replica_cpus, replica_gpus: Ray resources of each replica (fractions allowed); GPUs default
            to ``tensor_parallel_size`` on CUDA (``device`` ``cuda``, or ``auto`` on a host with a
            GPU), 0 on the CPU (Ray then hides every GPU from the replica).
        epsilon: the bounded load's slack (:class:`~engine.replicas.ring.SessionRouter`).
        blob_cache_bytes: bytes of images and clips each replica keeps by content key.
        probe_interval_s: seconds between probes of every replica (a dead one is seen down within
            about this long even with no request on it; a restarted one is seen ready).

    Raises:
        InvalidRequestError: ``replicas`` below 1.
        RuntimeError, ConnectionError: Ray could not start, or a replica could not load (its
            error in the message).
    """

    def __init__(self, model, *, replicas: int = 2, ray_address: str | None = None, device=None, dtype=None,
                 replica_cpus: float = 1.0, replica_gpus: float | None = None, epsilon: float = EPSILON,
                 blob_cache_bytes: int = DEFAULT_BLOB_CACHE_BYTES, probe_interval_s: float = 1.0,
                 num_cpus: float | None = None, **options):
        from ..errors import InvalidRequestError
        from .cluster import RayCluster

        if not isinstance(replicas, int) or replicas < 1:
            raise InvalidRequestError(f"replicas must be an integer >= 1, got {replicas!r}")
        if replica_gpus is None:
            replica_gpus = float(options.get("tensor_parallel_size", 1)) if _wants_cuda(device) else 0.0
        self._id = uuid.uuid4().hex[:12]  # this app front's: its Serve applications, its request ids
        self._closing = False
        self._lock = threading.Lock()  # the router and the replicas' states
        self._replicas = {f"replica-{i}": _Replica(f"replica-{i}") for i in range(replicas)}
        self._next_index = replicas  # an added replica's name: never one used before by this front
        self._resize = threading.Lock()  # one add or remove at a time
        self._blob_cache_bytes = blob_cache_bytes
        self._deploy_args = dict(model=str(model), device=device, dtype=dtype, options=options,
                                 blob_cache_bytes=blob_cache_bytes, num_cpus=replica_cpus, num_gpus=replica_gpus)
        self.router = SessionRouter(list(self._replicas), epsilon=epsilon)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="prism-replicas", daemon=True)
        self._thread.start()
        self.cluster = RayCluster(ray_address, num_cpus=num_cpus)
        try:
            infos = self.cluster.deploy(self._id, list(self._replicas), **self._deploy_args)
            self._run(self._attach_handles(list(self._replicas.values())), CALL_TIMEOUT_S)
            for replica, info in zip(self._replicas.values(), infos, strict=True):
                replica.link = self._connect(replica, info)
                replica.info, replica.state = info, "ready"
        except BaseException:
            self._stop()
            raise
        first = infos[0]
        self.model_id, self.device, self.dtype = first["model_id"], first["device"], first["dtype"]
        self.options, self.min_image_pixels = first["options"], first["min_image_pixels"]
        self._probe_interval_s = probe_interval_s
        self._probes = asyncio.run_coroutine_threadsafe(self._probe_forever(), self._loop)

    # ------------------------------------------------------------------ the interface
    def submit(self, messages, sampling=None, *, cache_salt=None) -> RequestHandle:
        return self._open(self._route(messages, cache_salt), "submit", messages, sampling, cache_salt)

    def warm(self, images, *, system=None, cache_salt=None) -> WarmHandle:
        messages = prefix_messages(images, system=system)
        handle = self._open(self._route(messages, cache_salt), "warm", messages, None, cache_salt)
        return WarmHandle(handle, handle.prompt_tokens)

    def cancel(self, handle, wait: bool = True) -> None:
        handle.cancel(wait)

    def stats(self) -> dict:
        return aggregate_stats(self.replica_status())

    def prefix_info(self, cache_salt, images=None, *, preview=False):
        replica = self._route([], cache_salt, images=images)
        return self._call(replica, "prefix_info", cache_salt, images, preview=preview)

    def forget(self, cache_salt):
        """Forget the salt on every ready replica (a session moved by a replica added since keeps
        entries on its former one), and its placement; returns the counts dropped, summed
        (``sessions`` 1: one salt)."""
        with self._lock:
            self.router.forget(_salt_key(cache_salt))
            ready = [r for r in self._replicas.values() if r.state == "ready"]
        if not ready:
            raise self._no_replica()
        done = [self._call(r, "forget", cache_salt) for r in ready]
        total = done[0]
        for more in done[1:]:
            total = total + more
        return dataclasses.replace(total, sessions=min(total.sessions, 1))  # one salt, however many replicas

    def clear_prefix_cache(self) -> None:
        with self._lock:
            ready = [r for r in self._replicas.values() if r.state == "ready"]
        for replica in ready:
            self._call(replica, "clear_prefix_cache")

    def count_prompt_tokens(self, messages, *, cache_salt=None) -> int:
        return self._call(self._route(messages, cache_salt), "count_prompt_tokens", messages, cache_salt=cache_salt)

    @property
    def alive(self) -> bool:
        """Whether at least one replica is ready (``/healthz`` is 200 while so)."""
        return not self._closing and any(r.state == "ready" for r in self._replicas.values())

    def replica_status(self) -> list[dict]:
        """Each replica: ``id`` (its name), ``state`` (``ready``, ``down``, ``starting``: being
        added, ``removing``),
        ``sessions`` (placed on it by this client), ``restarts`` (seen by this client) and, when
        ready, ``stats`` (its :meth:`engine.Engine.stats`; None when it did not answer)."""
        out = []
        replicas = list(self._replicas.values())
        stats = self._run(self._gather_stats([r for r in replicas if r.state == "ready"]), CALL_TIMEOUT_S)
        for replica in replicas:
            with self._lock:
                sessions = self.router.load(replica.name)
            out.append({"id": replica.name, "state": replica.state, "sessions": sessions,
                        "restarts": replica.restarts, "stats": stats.get(replica.name)})
        return out

    def replica_info(self, name: str) -> dict:
        """What replica ``name`` said of itself when last seen ready: ``pid``, ``incarnation``,
        ``model_id``, ``link`` (its address), ... (not its key; tests kill a replica by its ``pid``)."""
        return {k: v for k, v in self._replicas[name].info.items() if k != "authkey"}

    @property
    def front_id(self) -> str:
        """This app front's id: its replicas' Serve applications are ``prism-<front_id>-replica-<i>``."""
        return self._id

    def replica_of(self, cache_salt: str | None) -> str | None:
        """Where session ``cache_salt`` is placed now (None: nowhere yet)."""
        with self._lock:
            return self.router.placed(_salt_key(cache_salt))

    def add_replica(self) -> str:
        """Deploy one more replica (the same model and options, its own Serve application) and put
        it on the ring once it is ready: the sessions whose home it becomes move to it at their
        next request (about ``1/N`` of them, N counting it; one cold miss each), the others stay.
        Blocks while it loads its model (one add or remove at a time).

        Returns:
            its name (``replica-<i>``, ``i`` never used before by this client).

        Raises:
            PrismError: the client is closed. RuntimeError: the replica could not start (its
                constructor's error in the message; nothing changed). OSError, PermissionError:
                it started but cannot be reached (it is deleted again).
        """
        with self._resize:
            with self._lock:
                if self._closing:
                    raise PrismError("engine is closed")
                name = f"replica-{self._next_index}"
                self._next_index += 1
                replica = self._replicas[name] = _Replica(name)  # listed as "starting" meanwhile
            try:
                info = self.cluster.deploy(self._id, [name], **self._deploy_args)[0]
                self._run(self._attach_handles([replica]), CALL_TIMEOUT_S)
                link = self._connect(replica, info)
            except BaseException:
                with self._lock:
                    self._replicas.pop(name, None)
                self.cluster.delete(self._id, name)
                raise
            with self._lock:
                if self._closing:
                    link.close()
                    raise PrismError("engine is closed")
                replica.link, replica.info, replica.state = link, info, "ready"
                moved = self.router.add(name)
        log.warning("engine replica %s added (pid %s); %d sessions move to it", name, info.get("pid"), len(moved))
        return name

    def remove_replica(self, name: str, *, wait: bool = True) -> int:
        """Take replica ``name`` off the ring and delete it: its sessions are placed on the
        others at their next request (one cold miss each; no other session moves), its requests
        in flight end with :class:`~engine.errors.EngineAbortedError` (retryable: 503
        ``aborted`` on ``/v1``, a notice in the chat) before this returns, and what the session
        store keeps is untouched. One add or remove at a time.

        Args:
            name: a replica's id (``replica_status()``).
            wait: return once Serve has stopped it (its resources free), else at once.

        Returns:
            how many sessions were placed on it (they move).

        Raises:
            InvalidRequestError: no such replica, or it is the last one. PrismError: closed.
        """
        from ..errors import InvalidRequestError

        with self._resize:
            with self._lock:
                if self._closing:
                    raise PrismError("engine is closed")
                replica = self._replicas.get(name)
                if replica is None or replica.state in ("starting", "removing"):
                    raise InvalidRequestError(f"no replica {name!r} to remove (replicas: {', '.join(self._replicas)})")
                if len(self._replicas) == 1:
                    raise InvalidRequestError(f"{name} is the last replica: add another before removing it")
                replica.state = "removing"  # new requests go elsewhere; a probe no longer looks at it
                moved = self.router.remove(name)
                link = replica.link
            if link is not None:
                link.lose()  # its requests in flight end with the aborted error, the replica cancels them
                link.join(CALL_TIMEOUT_S)
                link.close()
            self.cluster.delete(self._id, name, wait=wait)
            with self._lock:
                self._replicas.pop(name, None)
        log.warning("engine replica %s removed; %d sessions move to the others", name, len(moved))
        return len(moved)

    def close(self) -> None:
        """Cancel what runs, delete the replicas and stop a local Ray instance (harmless twice)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._stop()

    # ------------------------------------------------------------------ routing
    def _route(self, messages, salt, *, images=None) -> _Replica:
        """The replica for a request (see the module docstring for the keys).

        Raises:
            EngineAbortedError: no replica is ready.
        """
        if self._closing:
            raise PrismError("engine is closed")
        if salt is not None:
            key, remember = _salt_key(salt), True
        else:
            content = _content_key(messages) if images is None else _content_key(keys=images)
            key, remember = (f"i:{content}", True) if content else (f"r:{uuid.uuid4().hex}", False)
        with self._lock:
            name = self.router.route(key, remember=remember)
        if name is None:
            raise self._no_replica()
        return self._replicas[name]

    def _no_replica(self) -> EngineAbortedError:
        return EngineAbortedError("no engine replica is ready (they are being restarted): ask again in a moment")

    def _mark_down(self, replica: _Replica, why: str) -> None:
        with self._lock:
            if replica.state in ("down", "removing") or self._closing:
                return
            replica.state, replica.down_since = "down", time.monotonic()
            self.router.set_up(replica.name, False)
        log.error("engine replica %s is down (%s); its sessions move to the next replica", replica.name, why)

    def _mark_ready(self, replica: _Replica, info: dict, link: ReplicaLink) -> None:
        with self._lock:
            if self._closing or replica.state == "removing" or self._replicas.get(replica.name) is not replica:
                if link is not replica.link:
                    link.close()
                return
            if replica.info and replica.info.get("incarnation") != info.get("incarnation"):
                replica.restarts += 1
            old, replica.link = replica.link, link
            was = replica.state
            replica.info, replica.state, replica.down_since = info, "ready", None
            self.router.set_up(replica.name, True)
        if old is not None and old is not link:
            old.close()
        if was != "ready":
            log.warning("engine replica %s is ready again (pid %s)", replica.name, info.get("pid"))

    def _aborted(self, replica: _Replica, why: str) -> EngineAbortedError:
        if replica.state == "removing":
            return EngineAbortedError(f"engine replica {replica.name} was removed; this chat moves to another "
                                      "replica: ask again")
        return EngineAbortedError(f"engine replica {replica.name} stopped unexpectedly ({why}); "
                                  "this chat moves to another replica: ask again")

    def _connect(self, replica: _Replica, info: dict) -> ReplicaLink:
        """A connection to the incarnation ``info`` describes (its keys fresh: it holds no bytes
        from this client yet). Raises: OSError, PermissionError: it cannot be reached."""
        return ReplicaLink(info["link"], info["authkey"], keys=KeyLRU(self._blob_cache_bytes),
                           aborted=lambda: self._aborted(replica, "its connection closed"),
                           on_lost=lambda link: self._link_lost(replica, link),
                           id_prefix=f"{self._id}-{replica.name}", timeout=CALL_TIMEOUT_S)

    def _link_lost(self, replica: _Replica, link: ReplicaLink) -> None:
        if replica.link is link:
            self._mark_down(replica, "its connection closed")

    # ------------------------------------------------------------------ requests
    def _open(self, replica: _Replica, kind: str, messages, sampling, salt) -> RequestHandle:
        """Send a request or a warm to ``replica``; returns its handle once the replica accepted it.

        Raises:
            the engine's input errors (as in-process), EngineAbortedError (the replica died).
        """
        link = replica.link
        if link is None:
            raise self._no_replica()
        return link.open(kind, messages, sampling, salt)

    # ------------------------------------------------------------------ calls
    def _call(self, replica: _Replica, name: str, *args, **kwargs):
        link = replica.link
        if link is None:
            raise self._no_replica()
        return link.call(name, *args, **kwargs)

    async def _gather_stats(self, replicas: list[_Replica]) -> dict:
        async def one(replica):
            try:
                value = await asyncio.wait_for(asyncio.to_thread(self._call, replica, "stats"), PROBE_TIMEOUT_S)
            except Exception:
                return replica.name, None
            return replica.name, value

        return dict(await asyncio.gather(*(one(r) for r in replicas)))

    async def _attach_handles(self, replicas: list[_Replica]) -> None:
        for replica in replicas:  # on this loop: a handle is used on the loop that made it
            replica.handle = self.cluster.handle(self._id, replica.name)

    async def _probe_forever(self) -> None:
        """Every ``probe_interval_s``: ask each replica who it is; a replica that does not answer
        (or cannot be connected to) is down, one that answers (again, or as a new incarnation: a
        new connection) is ready."""
        while not self._closing:
            await asyncio.sleep(self._probe_interval_s)
            with self._lock:  # a snapshot: replicas are added and removed meanwhile
                probed = [r for r in self._replicas.values() if r.state in ("ready", "down")]
            await asyncio.gather(*(self._probe(r) for r in probed))

    async def _probe(self, replica: _Replica) -> None:
        try:
            info = await asyncio.wait_for(replica.handle.info.remote(), PROBE_TIMEOUT_S)
        except Exception as exc:
            self._mark_down(replica, f"no answer to a probe: {type(exc).__name__}")
            return
        link = replica.link
        if link is None or not link.alive or replica.info.get("incarnation") != info.get("incarnation"):
            try:
                link = await asyncio.to_thread(self._connect, replica, info)
            except Exception as exc:
                self._mark_down(replica, f"cannot connect to it: {type(exc).__name__}: {exc}")
                return
        self._mark_ready(replica, info, link)

    def _run(self, coroutine, timeout: float):
        """Run ``coroutine`` on the client's loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def _stop(self) -> None:
        probes = getattr(self, "_probes", None)
        if probes is not None:
            self._loop.call_soon_threadsafe(probes.cancel)

        def cancel_all():
            for task in asyncio.all_tasks(self._loop):
                task.cancel()

        self._loop.call_soon_threadsafe(cancel_all)
        for replica in self._replicas.values():
            if replica.link is not None:
                replica.link.close()
        try:
            self.cluster.shutdown()
        except Exception as exc:
            log.info("stopping Ray: %s", exc)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)


def aggregate_stats(replicas: list[dict]) -> dict:
    """The engine counters of the whole (what ``/healthz`` shows as ``engine``): each counter
    summed over the replicas that answered, the settings every replica shares
    (:data:`_SHARED_KEYS`) from the first; ``replicas_ready`` and ``replicas_total``.

    Raises:
        EngineAbortedError: no replica answered.
    """
    answered = [r["stats"] for r in replicas if r.get("stats")]
    if not answered:
        raise EngineAbortedError("no engine replica is ready (they are being restarted): ask again in a moment")
    total: dict = {}
    for stats in answered:
        for key, value in stats.items():
            if key in _SHARED_KEYS or not isinstance(value, (int, float)) or isinstance(value, bool):
                total.setdefault(key, value)
            else:
                total[key] = total.get(key, 0) + value
    total["replicas_ready"], total["replicas_total"] = len(answered), len(replicas)
    return total


def _wants_cuda(device) -> bool:
    """Whether replicas built with ``device`` need GPUs: ``cuda``, or ``auto`` / None where this
    host has one (a cluster whose app host has none: say ``--device cuda``)."""
    if device in (None, "auto"):
        import torch

        return torch.cuda.is_available()
    return str(device).startswith("cuda")


def _salt_key(salt) -> str:
    return f"s:{salt}"


def _content_key(messages=None, *, keys=None) -> str | None:
    """One digest of the content keys of the images and clips in ``messages`` (or of ``keys``,
    a list of content keys as :meth:`engine.Engine.prefix_info` takes them), in order; None
    without any. An image's key is its part's ``sha256`` (the store names files by it), else the
    SHA-256 of its bytes, else its path."""
    found = [k for k in (keys if keys is not None else _media_keys(messages)) if k]
    return hashlib.sha256("\0".join(found).encode()).hexdigest() if found else None


def _media_keys(messages) -> Iterator[str]:
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if not isinstance(part, dict):
                continue
            if isinstance(part.get("sha256"), str):
                yield part["sha256"]
                continue
            for name in ("image", "video"):
                source = part.get(name)
                if isinstance(source, (bytes, bytearray, memoryview)):
                    yield hashlib.sha256(bytes(source)).hexdigest()
                elif source is not None:
                    yield str(source)
