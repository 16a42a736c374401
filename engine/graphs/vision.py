"""CUDA graphs of the vision encoder, one per combination of image sizes.

The encoder of eight 448×448 photos launches about 600 kernels (27 blocks of norms, matrix
products, rotary, attention, MLP). On the H200 host launching them took ~31 ms of CPU time
against ~16 ms of GPU work, so the GPU sat idle for half the encoder (``docs/PERFORMANCE.md``,
v6). A graph replay launches them all at once.

A graph is specific to its input shapes: the ordered ``(t, h, w)`` patch grids of the images
encoded together. Photos of one camera or one aspect ratio map to the same grid, so combinations
repeat. A combination seen for the first time runs eagerly (no capture cost for a one-off); the
second time it runs eagerly on the capture stream (which also warms that stream's library state),
is captured, and later calls replay the graph. Graphs share one memory pool (they never run
concurrently); the least recently used is dropped beyond ``max_graphs``.

Sightings and graphs belong to a *scope*, the session's cache salt: a replay is several times
faster than an eager run, so a graph another session earned would tell this one which image sizes
others sent. Each scope sees its own combinations eager, then captured, then replayed, whatever
other scopes did; other scopes can only make it slower (by pushing its graphs or sightings out of
the LRU), never faster. The engine passes "" for every request under ``cache_scope="global"``.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..model.qwen3_vl import Qwen3VL
from ..model.vision import VisionFeatures

Grids = tuple[tuple[int, int, int], ...]
#: A scope (cache salt) and the ordered grids of the images encoded together.
Key = tuple[str, Grids]
log = logging.getLogger(__name__)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor  # the graph's input buffer, [num_patches, C*T*P*P] in the model dtype
    out: VisionFeatures  # the graph's output buffers, overwritten by each replay


class VisionGraphs:
    """Vision encoding through CUDA graphs keyed by scope and the images' grids; a drop-in for
    :meth:`engine.model.qwen3_vl.Qwen3VL.encode_vision` with a ``scope`` argument.

    Args:
        model: the model, on CUDA.
        max_graphs: most graphs kept, over all scopes (least recently used dropped).
        max_patches: combinations with more patches always run eagerly (bounds the graphs'
            activation memory, roughly 25 KB per patch at the 8B shape in bfloat16).

    A combination whose capture fails is logged and encoded eagerly from then on in that scope
    (after running out of memory: captured again once it has been seen twice more).

    Counters: ``eager_runs``, ``captures``, ``replays`` (calls by the path they took).
    :meth:`_capture` and :meth:`_replay` are the only parts that touch CUDA graphs (tests on the
    CPU replace them).
    """

    def __init__(self, model: Qwen3VL, max_graphs: int = 8, max_patches: int = 16384):
        self.model = model
        self.max_graphs, self.max_patches = max_graphs, max_patches
        self._graphs: OrderedDict[Key, _Captured] = OrderedDict()
        self._seen: OrderedDict[Key, None] = OrderedDict()
        self._eager_only: set[Key] = set()
        self._lock = threading.Lock()
        self._stream: torch.cuda.Stream | None = None  # one capture stream: its freed blocks are reused
        self._mempool = None
        self.eager_runs = self.captures = self.replays = 0

    def __call__(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]], scope: str = "") -> VisionFeatures:
        """Vision features of ``pixels [num_patches, C*T*P*P]`` (any device and float dtype) with
        patch grids ``grids``, for a request of ``scope`` (its cache salt); the same as
        ``model.encode_vision``, in fresh tensors. Safe to call from several threads (calls run
        one at a time: a graph has one set of buffers)."""
        with self._lock:
            return self._encode(pixels, (scope, tuple(tuple(int(x) for x in g) for g in grids)))

    def forget(self, scope: str) -> int:
        """Drop the scope's graphs, sightings and eager-only marks (its next call of a combination
        runs eagerly again, as a first sighting); returns how many graphs went."""
        with self._lock:
            graphs = [k for k in self._graphs if k[0] == scope]
            for key in graphs:
                del self._graphs[key]
            for key in [k for k in self._seen if k[0] == scope]:
                del self._seen[key]
            self._eager_only = {k for k in self._eager_only if k[0] != scope}
            return len(graphs)

    def _encode(self, pixels: torch.Tensor, key: Key) -> VisionFeatures:
        grids = key[1]
        entry = self._graphs.get(key)
        if entry is not None:
            self._graphs.move_to_end(key)
            self.replays += 1
            return self._replay(entry, pixels)
        if key not in self._seen or key in self._eager_only or pixels.shape[0] > self.max_patches:
            self._remember(key)
            return self._eager(pixels, grids)
        try:
            entry, result = self._capture(grids, pixels)
        except torch.OutOfMemoryError:  # perhaps only for now: captured again when next seen twice
            log.warning("vision encoder: out of memory capturing a CUDA graph for grids %s; encoding eagerly", grids)
            self._seen.pop(key, None)
            torch.cuda.empty_cache()
            return self._eager(pixels, grids)
        except Exception:  # a speed-up only: answer eagerly, and do not try this combination again
            log.warning("vision encoder: CUDA-graph capture failed for grids %s; encoding them eagerly", grids,
                        exc_info=True)
            self._eager_only.add(key)
            return self._eager(pixels, grids)
        self._graphs[key] = entry
        self.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return result

    def _eager(self, pixels: torch.Tensor, grids: Grids) -> VisionFeatures:
        self.eager_runs += 1
        return self.model.encode_vision(pixels, list(grids))

    def _remember(self, key: Key) -> None:
        self._seen[key] = None
        self._seen.move_to_end(key)
        while len(self._seen) > 4 * self.max_graphs:
            self._seen.popitem(last=False)

    @torch.inference_mode()
    def _replay(self, entry: _Captured, pixels: torch.Tensor) -> VisionFeatures:
        entry.pixels.copy_(pixels)
        entry.graph.replay()
        return VisionFeatures(entry.out.embeds.clone(), [d.clone() for d in entry.out.deepstack])

    @torch.inference_mode()
    def _capture(self, grids: Grids, pixels: torch.Tensor) -> tuple[_Captured, VisionFeatures]:
        """Run the encoder once on the capture stream (this call's answer, and the warm-up), then
        capture it into a graph; returns the graph with its buffers and the answer."""
        dev = self.model.device
        static = pixels.to(dev, self.model.dtype).clone()
        if self._stream is None:
            self._stream = torch.cuda.Stream(dev)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            result = self.model.visual(static, list(grids))
            graph = torch.cuda.CUDAGraph()
            # thread_local: request threads may touch CUDA (their own tensors) while this captures
            with torch.cuda.graph(graph, pool=self._mempool, stream=stream, capture_error_mode="thread_local"):
                out = self.model.visual(static, list(grids))
        main = torch.cuda.current_stream(dev)
        main.wait_stream(stream)
        for t in (result.embeds, *result.deepstack):
            t.record_stream(main)  # made on the capture stream, read on the main one
        self._mempool = graph.pool()
        return _Captured(graph, static, out), result
