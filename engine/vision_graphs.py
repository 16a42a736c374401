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
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .model import Qwen3VL
from .vision import VisionFeatures

Grids = tuple[tuple[int, int, int], ...]
log = logging.getLogger(__name__)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor  # the graph's input buffer, [num_patches, C*T*P*P] in the model dtype
    out: VisionFeatures  # the graph's output buffers, overwritten by each replay


class VisionGraphs:
    """Vision encoding through CUDA graphs keyed by the images' grids; a drop-in for
    :meth:`engine.model.Qwen3VL.encode_vision`.

    Args:
        model: the model, on CUDA.
        max_graphs: most graphs kept (least recently used dropped).
        max_patches: combinations with more patches always run eagerly (bounds the graphs'
            activation memory, roughly 25 KB per patch at the 8B shape in bfloat16).

    A combination whose capture fails is logged and encoded eagerly from then on (after running
    out of memory: captured again once it has been seen twice more).
    """

    def __init__(self, model: Qwen3VL, max_graphs: int = 8, max_patches: int = 16384):
        self.model = model
        self.max_graphs, self.max_patches = max_graphs, max_patches
        self._graphs: OrderedDict[Grids, _Captured] = OrderedDict()
        self._seen: OrderedDict[Grids, None] = OrderedDict()
        self._eager_only: set[Grids] = set()
        self._lock = threading.Lock()
        self._stream: torch.cuda.Stream | None = None  # one capture stream: its freed blocks are reused
        self._mempool = None
        self.captures = self.replays = 0

    def __call__(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> VisionFeatures:
        """Vision features of ``pixels [num_patches, C*T*P*P]`` (any device and float dtype) with
        patch grids ``grids``; the same as ``model.encode_vision``, in fresh tensors. Safe to call
        from several threads (calls run one at a time: a graph has one set of buffers)."""
        with self._lock:
            return self._encode(pixels, tuple(tuple(int(x) for x in g) for g in grids))

    def _encode(self, pixels: torch.Tensor, key: Grids) -> VisionFeatures:
        entry = self._graphs.get(key)
        if entry is not None:
            self._graphs.move_to_end(key)
            return self._replay(entry, pixels)
        if key not in self._seen or key in self._eager_only or pixels.shape[0] > self.max_patches:
            self._remember(key)
            return self.model.encode_vision(pixels, list(key))
        try:
            return self._capture(key, pixels)
        except torch.OutOfMemoryError:  # perhaps only for now: captured again when next seen twice
            log.warning("vision encoder: out of memory capturing a CUDA graph for grids %s; encoding eagerly", key)
            self._seen.pop(key, None)
            torch.cuda.empty_cache()
            return self.model.encode_vision(pixels, list(key))
        except Exception:  # a speed-up only: answer eagerly, and do not try this combination again
            log.warning("vision encoder: CUDA-graph capture failed for grids %s; encoding them eagerly", key,
                        exc_info=True)
            self._eager_only.add(key)
            return self.model.encode_vision(pixels, list(key))

    def _remember(self, key: Grids) -> None:
        self._seen[key] = None
        self._seen.move_to_end(key)
        while len(self._seen) > 4 * self.max_graphs:
            self._seen.popitem(last=False)

    @torch.inference_mode()
    def _replay(self, entry: _Captured, pixels: torch.Tensor) -> VisionFeatures:
        entry.pixels.copy_(pixels)
        entry.graph.replay()
        self.replays += 1
        return VisionFeatures(entry.out.embeds.clone(), [d.clone() for d in entry.out.deepstack])

    @torch.inference_mode()
    def _capture(self, key: Grids, pixels: torch.Tensor) -> VisionFeatures:
        dev = self.model.device
        static = pixels.to(dev, self.model.dtype).clone()
        if self._stream is None:
            self._stream = torch.cuda.Stream(dev)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            result = self.model.visual(static, list(key))  # this call's answer, and the warm-up
            graph = torch.cuda.CUDAGraph()
            # thread_local: request threads may touch CUDA (their own tensors) while this captures
            with torch.cuda.graph(graph, pool=self._mempool, stream=stream, capture_error_mode="thread_local"):
                out = self.model.visual(static, list(key))
        main = torch.cuda.current_stream(dev)
        main.wait_stream(stream)
        for t in (result.embeds, *result.deepstack):
            t.record_stream(main)  # made on the capture stream, read on the main one
        self._mempool = graph.pool()
        self._graphs[key] = _Captured(graph, static, out)
        self.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return result
