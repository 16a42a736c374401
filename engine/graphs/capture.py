"""Capturing CUDA graphs: one graph per input size (the decode step per batch bucket, a cold
prompt's prefill per token bucket), and which of the step graphs an engine captures at start."""

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
            # thread_local: only this thread's calls may break the capture. Under the default
            # (global) mode another thread's unsafe call (the host tier pinning its first chunk,
            # cudaHostRegister, on its background thread; request threads' own CUDA work; another
            # engine's loop) invalidated it: cudaErrorStreamCaptureInvalidated at capture_end.
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                out = forward(size)
            pool = graph.pool()
            graphs[size] = (graph, out)
    torch.cuda.current_stream(device).wait_stream(stream)
    return graphs


def graphs_supported(device: torch.device) -> bool:
    """Whether steps on ``device`` can be captured as CUDA graphs: on CUDA, with the Triton kernels
    (the references read values back to the host, which a capture cannot hold): not under
    ``PRISM_OPS=reference``, which ``benchmarks/gpu_smoke.py`` sets to run the oracle on the GPU."""
    if device.type != "cuda":
        return False
    from ops.dispatch import kernels_on

    return kernels_on(device)


def capture_step_graphs(model, pool, *, decode_rows: int, max_model_len: int, prefill: bool, gates=None):
    """Capture the decode graphs (``decode_rows`` rows at most, block tables for ``max_model_len``
    tokens, waiting on the host tier's layer ``gates`` if any) and, with ``prefill``, the prefill
    graphs of ``model`` over ``pool`` (cold prompts: they read no restored page), now (seconds).

    Returns:
        ``(DecodeGraphs, PrefillGraphs or None)``.
    """
    from .decode import DecodeGraphs  # needs Triton: imported only where graphs run
    from .prefill import PrefillGraphs

    decode = DecodeGraphs(model, pool, decode_rows, max_pages_per_seq=pool.pages_for(max_model_len),
                          max_seq_len=max_model_len, gates=gates)
    decode.capture()
    prefill_graphs = None
    if prefill:
        prefill_graphs = PrefillGraphs(model, pool)
        prefill_graphs.capture()
    return decode, prefill_graphs
