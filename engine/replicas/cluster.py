"""Ray and Ray Serve for the replicas: a local instance started and stopped with the app, or an
existing cluster (``--ray-address``).

A Ray cluster runs whatever code its clients send it, without a password of its own beyond Ray's
token (docs/SCALING.md, README "Security"), so the local instance is started small: on loopback
only (:func:`_loopback_only`), no dashboard, no Serve HTTP or gRPC proxy (nothing listens for
HTTP: the app probes the replicas by handle and sends requests over each replica's own
connection, which listens on 127.0.0.1 here), workers at niceness 0 (:data:`WORKER_NICENESS`),
logs kept out of the app's terminal. Ray's token authentication, on by default, guards its ports
as well.

Loopback only: Ray 2.60 turns a node address of ``127.0.0.1`` (``_node_ip_address``) into the
host's outside address, and its processes then listen on every interface (GCS, raylet, object
manager, workers, the Serve controller: ``*:port``) or on that address (the dashboard agent, the
runtime-env agent; measured with ``ss -ltnp``). With ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
Ray's single-machine mode (its default on macOS and Windows, where a node's address is the
loopback one), every one of them listens on 127.0.0.1 (tests/test_replicas.py reads each Ray
process's listening sockets). That variable only picks the node address; it is set for the
local instance's processes and this one while it runs, and put back by :meth:`RayCluster.shutdown`.

Each replica is a Serve application of its own with one deployment of one replica
(``prism-<front>-replica-<i>`` / ``replica-<i>``), ``<front>`` the app front's own id: two app
fronts on one cluster deploy replicas of their own, side by side, and each deletes only its own.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

__all__ = ["RayCluster", "APP_PREFIX", "app_name"]

#: Serve application names: ``prism-<front>-replica-0``, ...; the deployment inside is ``replica-0``, ...
APP_PREFIX = "prism-"
#: Serve's health check of each replica (seconds): a replica whose actor died is replaced after
#: about this long, plus its model's load.
HEALTH_CHECK_PERIOD_S = 1.0
HEALTH_CHECK_TIMEOUT_S = 30.0
#: The niceness of the local instance's worker processes (the replicas' engines among them): Ray's
#: default, 15, lets any other process of the host (the app front's web server, a tokenizer, other
#: work on a shared machine) take the CPU from an engine's loop first, which slows every step.
WORKER_NICENESS = 0
#: A stopping replica's grace for its running requests (seconds); the app cancels them first.
GRACEFUL_SHUTDOWN_S = 5.0


def app_name(front: str, name: str) -> str:
    """The Serve application of replica ``name`` of app front ``front``: ``prism-<front>-<name>``."""
    return f"{APP_PREFIX}{front}-{name}"


#: The local instance's node address, and its replicas' request ports.
LOCAL_HOST = "127.0.0.1"


class RayCluster:
    """Ray and Serve, started here or joined.

    Args:
        address: an existing cluster's address (``ray://host:10001`` or ``host:6379``), or None: a
            local instance, stopped by :meth:`shutdown`.
        num_cpus: CPUs the local instance offers (None: the machine's); ignored with ``address``.

    Raises:
        ConnectionError, RuntimeError: Ray could not start or reach ``address``.
    """

    #: whether a RayCluster of this process started the Ray instance it is connected to
    _local_running = False

    def __init__(self, address: str | None = None, *, num_cpus: float | None = None):
        import ray
        from ray import serve

        self.address = address
        self.owned = address is None and not ray.is_initialized()
        self._restore = lambda: None
        if self.owned:
            RayCluster._local_running = True
            self._restore = _loopback_only()
            try:
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address=LOCAL_HOST,
                         log_to_driver=False, configure_logging=False, namespace="prism",
                         _system_config={"worker_niceness": WORKER_NICENESS})
            except BaseException:
                RayCluster._local_running = False
                self._restore()
                raise
        elif not ray.is_initialized():
            ray.init(address=address, log_to_driver=False, configure_logging=False, namespace="prism")
        serve.start(proxy_location="Disabled", http_options={"host": "127.0.0.1"})
        #: where replicas take requests: loopback on a local instance (this one's, or another
        #: front's of this process), else their node's address
        local = address is None and RayCluster._local_running
        self.link_host = LOCAL_HOST if local else None
        self.apps: list[str] = []

    def deploy(self, front: str, names: list[str], model: str, *, device, dtype, options: dict,
               blob_cache_bytes: int, num_cpus: float, num_gpus: float) -> list[dict]:
        """Deploy one replica per name for app front ``front`` (in parallel: each loads its model)
        and wait until each is ready; returns their ``info()``.

        Raises:
            RuntimeError: a replica could not start (its constructor's error in the message).
        """
        from ray import serve

        from .deployment import EngineReplica

        def one(name: str) -> dict:
            app = app_name(front, name)
            replica = EngineReplica.options(
                name=name, ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
                health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
                graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S, graceful_shutdown_wait_loop_s=0.5,
                max_constructor_retry_count=2,
            ).bind(str(model), device, dtype, dict(options), blob_cache_bytes, name, self.link_host)
            if app not in self.apps:
                self.apps.append(app)
            handle = serve.run(replica, name=app, route_prefix=None)
            return handle.info.remote().result()

        with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
            return list(pool.map(one, names))

    def delete(self, front: str, name: str, *, wait: bool = True) -> None:
        """Delete app front ``front``'s replica ``name`` (its Serve application); with ``wait``,
        return once Serve has stopped it (its resources free for another). Harmless if absent."""
        from ray import serve

        app = app_name(front, name)
        try:
            serve.delete(app, _blocking=wait)
        except Exception as exc:  # the cluster went away, or it never deployed: nothing left to delete
            log.info("could not delete %s: %s", app, exc)
        if app in self.apps:
            self.apps.remove(app)

    @staticmethod
    def handle(front: str, name: str):
        """The :class:`~ray.serve.handle.DeploymentHandle` of app front ``front``'s replica ``name``."""
        from ray import serve

        return serve.get_deployment_handle(name, app_name=app_name(front, name))

    def shutdown(self) -> None:
        """Delete the replicas' applications; stop the local instance (harmless twice)."""
        import ray
        from ray import serve

        if not ray.is_initialized():
            return
        if not self.owned:
            for app in self.apps:
                try:
                    serve.delete(app, _blocking=False)
                except Exception as exc:  # the cluster went away: nothing left to delete
                    log.info("could not delete %s: %s", app, exc)
            self.apps = []
            return
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            RayCluster._local_running = False
            self._restore()


#: Ray's switch of its single-machine mode (node address: loopback), read by ``ray._private.ray_constants``.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _loopback_only():
    """Make the Ray instance about to start here a loopback-only one: its processes (which inherit
    this environment) and this process (whose Ray constants were read at import) take 127.0.0.1 as
    the node's address, and every Ray port listens there. Returns a function that puts both back
    (a later ``--ray-address`` join from this process needs the host's address)."""
    import os

    from ray._private import ray_constants

    before_env, before_flag = os.environ.get(LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False

    def restore() -> None:
        if before_env is None:
            os.environ.pop(LOOPBACK_ENV, None)
        else:
            os.environ[LOOPBACK_ENV] = before_env
        ray_constants.ENABLE_RAY_CLUSTER = before_flag

    return restore
