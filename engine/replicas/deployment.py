"""One engine replica: the Ray Serve deployment around an :class:`~engine.engine.Engine`.

Each replica is the only replica of a deployment of its own (``replica-0``, ``replica-1``, ...,
in an application named after its app front; see docs/SCALING.md for why one deployment per
replica), so the app addresses it by name with Serve's public
:class:`~ray.serve.handle.DeploymentHandle`; Serve places it, health-checks it and restarts it
when its actor dies.

Requests do not go through Serve: the replica listens on a port of its node
(:class:`~engine.replicas.link.LinkServer`, loopback on a local Ray instance) and the app sends
requests and reads their outputs over one authenticated connection
(:class:`~engine.replicas.link.ReplicaLink`; why: docs/SCALING.md, "The request path"). Through
Serve the app only asks ``info()``: model id, device, dtype, options, the smallest image area,
this replica's process id, an incarnation id (new at each start: a restarted replica holds no
image bytes and has a new key), and where and with which key to connect (``link``, ``authkey``).

Importing this module imports Ray Serve (only :mod:`engine.replicas.client` and
:mod:`engine.replicas.cluster` do, when replicas are asked for).
"""

from __future__ import annotations

import os
import uuid

from ray import serve

from ..client import engine_info

__all__ = ["EngineReplica"]

LOOPBACK = "127.0.0.1"


def _serve_grpc_on_loopback() -> None:
    """Make this replica's Serve gRPC server (the one Serve starts in every replica, after its
    constructor, for calls between deployments; Prism makes none) listen on 127.0.0.1 instead of
    every interface: Ray Serve 2.60 binds it to ``[::]:0`` with no option (its
    ``add_port_to_grpc_server``, looked up in ``ray.serve._private.replica`` at that call, is
    wrapped here). Only on the app's local, loopback-only instance. If a Ray version no longer has
    that name nothing changes (tests/test_replicas.py checks every Ray process's listening ports)."""
    from ray.serve._private import replica as serve_replica

    add = getattr(serve_replica, "add_port_to_grpc_server", None)
    if add is None or getattr(add, "prism_loopback", False):
        return

    def on_loopback(server, address: str):
        if address.startswith("[::]:"):
            address = f"{LOOPBACK}:{address[5:]}"
        return add(server, address)

    on_loopback.prism_loopback = True
    serve_replica.add_port_to_grpc_server = on_loopback


@serve.deployment(num_replicas=1, max_ongoing_requests=64)
class EngineReplica:
    """The replica's actor: one engine and the listener its requests come in on.

    Args:
        model, device, dtype, options: as :meth:`engine.Engine.from_pretrained` (``options`` a dict).
        blob_cache_bytes: bytes of images and clips kept by content key (LRU), per app connection.
        name: the replica's name (``replica-0``, ...), reported by ``info``.
        link_host: the address to take requests on (``127.0.0.1`` on the app's local instance);
            None: the address Ray knows this replica's node by (its ``NodeManagerAddress``).

    Raises:
        CheckpointError, InvalidRequestError, PrismError: loading failed (Serve retries the
            constructor, then marks the deployment unhealthy). OSError: no port to listen on.
    """

    def __init__(self, model: str, device, dtype, options: dict, blob_cache_bytes: int, name: str,
                 link_host: str | None = None):
        import ray

        from ..engine import Engine  # the replica process only
        from .link import LinkServer

        if link_host == LOOPBACK:
            _serve_grpc_on_loopback()
        self.engine = Engine.from_pretrained(model, device=device, dtype=dtype, **options)
        self.name = name
        self.incarnation = uuid.uuid4().hex
        if link_host is None:  # not ray.util.get_node_ip_address(): that is the host's, not the node's
            node = ray.get_runtime_context().get_node_id()
            link_host = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node)
        self.server = LinkServer(self.engine, link_host, blob_cache_bytes)

    async def info(self) -> dict:  # on the replica's event loop: no thread pool hop for a probe
        return {**engine_info(self.engine), "pid": os.getpid(), "incarnation": self.incarnation, "name": self.name,
                "link": list(self.server.address), "authkey": self.server.authkey}

    def check_health(self) -> None:
        """Serve's health check: a closed engine, a failed tensor-parallel rank or a stopped
        listener is unhealthy, and Serve replaces the replica."""
        self.engine.stats()
        if self.engine.parallel is not None:
            self.engine.parallel.check()
        if not self.server.alive:
            raise RuntimeError("the replica's listener stopped")

    def __del__(self):
        server = getattr(self, "server", None)
        if server is not None:
            server.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
