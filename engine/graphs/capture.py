"""Capturing one CUDA graph per input size (the decode step per batch bucket, a cold prompt's
prefill per token bucket)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

Out = TypeVar("Out")


def capture_per_size(device: torch.device, sizes: Iterable[int],
                     forward: Callable[[int], Out]) -> dict[int, tuple[torch.cuda.CUDAGraph, Out]]:
    """Capture ``forward(size)`` for every size, largest first, on a side stream, all graphs sharing
    one memory pool (they never run at once; the largest sets the pool's size). Each size runs twice
    before its capture, which compiles its kernels and warms the allocator outside it.

    Args:
        device: the CUDA device.
        sizes: the sizes to capture.
        forward: runs the work for one size from fixed input buffers and returns its outputs.

    Returns:
        ``{size: (graph, outputs)}``: replaying the graph rewrites the outputs in place.
    """
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graphs, pool = {}, None
    with torch.cuda.stream(stream), torch.inference_mode():
        for size in sorted(sizes, reverse=True):
            for _ in range(2):
                forward(size)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = forward(size)
            pool = graph.pool()
            graphs[size] = (graph, out)
    torch.cuda.current_stream(device).wait_stream(stream)
    return graphs
