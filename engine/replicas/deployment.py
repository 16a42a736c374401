"""One engine replica: the Ray Serve deployment around an :class:`~engine.engine.Engine`.

Each replica is the only replica of a deployment of its own (``replica-0``, ``replica-1``, ...; see
docs/SCALING.md for why one deployment per replica), so the app addresses it by name with Serve's
public :class:`~ray.serve.handle.DeploymentHandle`; Serve owns its health checks and restarts it
when its actor dies.

The replica's side of the protocol (the app's side is :class:`engine.replicas.client.ReplicaClient`):

- ``run(rid, kind, messages, sampling, salt, new)``, streamed (``handle.options(stream=True)``):
  the images and clips sent by content key are resolved (:func:`engine.client.take_blobs`, the
  bytes kept here within ``blob_cache_bytes``), the request (``kind`` ``"submit"``) or warm
  (``"warm"``) is built and queued, and the stream yields ``("accepted", prompt_tokens)`` (for a
  warm, its prefix length), then the engine's text deltas and its
  :class:`~engine.serving.outputs.Completion`, or an exception *as a value* (the request's error:
  the client raises it); or only ``("refused", exc)`` (an input error, raised by the client's
  ``submit`` as in-process) or ``("missing", key)`` (a content key this replica does not hold:
  the client sends every byte again). Errors travel as values so that Ray's own (a dead actor)
  are the only exceptions: those become :class:`~engine.errors.EngineAbortedError`.
- ``cancel(rid, wait)``: cancel one request (with ``wait``, returns once its KV pages are free).
  A stream Ray cancels (the client went away) cancels its request too.
- ``call(name, args, kwargs)``: one of :data:`engine.client.ENGINE_CALLS` (stats, prefix_info,
  forget, ...), its error as a value (``(False, exc)``; ``(True, result)`` otherwise).
- ``info()``: model id, device, dtype, options, the smallest image area, this replica's process
  id and an incarnation id (new at each start: a restarted replica holds no image bytes).

Importing this module imports Ray Serve (only :mod:`engine.replicas.client` and
:mod:`engine.replicas.cluster` do, when replicas are asked for).
"""

from __future__ import annotations

import asyncio
import os
import uuid

from ray import serve

from ..client import ENGINE_CALLS, KeyLRU, MissingBlob, engine_info, picklable, take_blobs
from ..errors import InvalidRequestError

__all__ = ["EngineReplica"]


@serve.deployment(num_replicas=1, max_ongoing_requests=1024)
class EngineReplica:
    """The replica's actor: one engine, the image bytes it was sent, the requests it runs.

    Args:
        model, device, dtype, options: as :meth:`engine.Engine.from_pretrained` (``options`` a dict).
        blob_cache_bytes: bytes of images and clips kept by content key (LRU).
        name: the replica's name (``replica-0``, ...), reported by ``info``.

    Raises:
        CheckpointError, InvalidRequestError, PrismError: loading failed (Serve retries the
            constructor, then marks the deployment unhealthy).
    """

    def __init__(self, model: str, device, dtype, options: dict, blob_cache_bytes: int, name: str):
        from ..engine import Engine  # the replica process only

        self.engine = Engine.from_pretrained(model, device=device, dtype=dtype, **options)
        self.name = name
        self.incarnation = uuid.uuid4().hex
        self.keys, self.blobs = KeyLRU(blob_cache_bytes), {}
        self.handles: dict[str, object] = {}

    def info(self) -> dict:
        return {**engine_info(self.engine), "pid": os.getpid(), "incarnation": self.incarnation, "name": self.name}

    async def run(self, rid: str, kind: str, messages, sampling, salt, new: dict):
        try:
            messages = take_blobs(messages, new, self.keys, self.blobs)
        except MissingBlob as exc:
            yield ("missing", str(exc))
            return
        try:
            # prompt building (image decoding, the processor) is slow: off the replica's event loop
            handle, tokens = await asyncio.to_thread(self._open, kind, messages, sampling, salt)
        except Exception as exc:
            yield ("refused", picklable(exc))
            return
        self.handles[rid] = handle
        try:
            yield ("accepted", tokens)
            async for item in handle:
                yield item
        except asyncio.CancelledError:  # Ray cancelled the stream: the client went away
            handle.cancel(wait=False)
            raise
        except Exception as exc:  # the request's error, as a value
            yield picklable(exc)
        finally:
            self.handles.pop(rid, None)

    async def cancel(self, rid: str, wait: bool = True) -> None:
        handle = self.handles.get(rid)
        if handle is not None:
            await asyncio.to_thread(handle.cancel, wait)

    async def call(self, name: str, args: tuple, kwargs: dict):
        if name not in ENGINE_CALLS:
            return False, InvalidRequestError(f"not an engine call: {name!r}")
        try:
            return True, await asyncio.to_thread(getattr(self.engine, name), *args, **kwargs)
        except Exception as exc:
            return False, picklable(exc)

    def check_health(self) -> None:
        """Serve's health check: a closed engine (or a failed tensor-parallel rank) is unhealthy,
        and Serve replaces the replica."""
        self.engine.stats()
        if self.engine.parallel is not None:
            self.engine.parallel.check()

    def _open(self, kind: str, messages, sampling, salt):
        if kind == "warm":
            warm = self.engine.warm_prefix(messages, cache_salt=salt)
            return warm.handle, warm.prefix_tokens
        handle = self.engine.submit(messages, sampling, cache_salt=salt)
        return handle, handle.prompt_tokens

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()

