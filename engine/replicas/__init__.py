"""Engine replicas on Ray Serve behind one app (docs/SCALING.md, "Replicas on Ray Serve").

- :mod:`engine.replicas.ring`: consistent hashing with bounded loads (pure, no Ray).
- :mod:`engine.replicas.client`: :class:`ReplicaClient`, the app's
  :class:`~engine.client.EngineClient` over N replicas, each session routed by its cache salt.
- :mod:`engine.replicas.deployment`: the Serve deployment around one engine (imports Ray).
- :mod:`engine.replicas.cluster`: a local Ray instance or an existing cluster, the replicas'
  applications.

Importing this package imports neither Ray nor torch: ``ReplicaClient`` and ``aggregate_stats``
(the public names, what the app imports) are loaded on first use.
"""

from __future__ import annotations

__all__ = ["ReplicaClient", "aggregate_stats"]


def __getattr__(name: str):
    if name in __all__:
        from . import client

        return getattr(client, name)
    raise AttributeError(name)
