"""Backend choice for the KV-cache ops: Triton kernels for CUDA tensors, the PyTorch references
otherwise. ``PRISM_OPS=reference`` forces the references everywhere (the oracle on the GPU too);
``PRISM_OPS=triton`` forces the kernels (with ``TRITON_INTERPRET=1`` on CPU, for tests)."""

from __future__ import annotations

import os

import torch

from . import reference
from .metadata import AttentionMetadata
from .self_attention import causal_self_attention

try:  # Triton is optional on CPU-only installs
    from . import triton_kernels
except Exception:  # pragma: no cover - depends on the install
    triton_kernels = None


def use_triton(t: torch.Tensor) -> bool:
    """Whether ops on tensor ``t`` run as Triton kernels."""
    mode = os.environ.get("PRISM_OPS", "auto")
    if triton_kernels is None or mode == "reference":
        return False
    if mode == "triton":
        return True
    return t.is_cuda


def _pick(name: str, t: torch.Tensor):
    return getattr(triton_kernels if use_triton(t) else reference, name)


def store_kv(k, v, cache, slot_mapping, out=None) -> None:
    """See :func:`ops.reference.store_kv`."""
    _pick("store_kv", k)(k, v, cache, slot_mapping, out)


def paged_attention(q, cache, meta):
    """See :func:`ops.reference.paged_attention`. GQA groups that are not a power of two use the reference."""
    group = q.shape[1] // cache.num_kv_heads
    if use_triton(q) and group & (group - 1) == 0:
        return triton_kernels.paged_attention(q, cache, meta)
    return reference.paged_attention(q, cache, meta)


def paged_decode_attention(q, cache, meta):
    """See :func:`ops.reference.paged_decode_attention`."""
    group = q.shape[1] // cache.num_kv_heads
    if use_triton(q) and group & (group - 1) == 0:
        return triton_kernels.paged_decode_attention(q, cache, meta)
    return reference.paged_decode_attention(q, cache, meta)


def warm_up(cache, num_heads: int, dtype: torch.dtype) -> None:
    """Before the first request: compile the Triton kernels eager steps launch
    (:func:`ops.triton_kernels.startup.warm_up`) and load the fused attention a cold prompt uses
    (:mod:`ops.self_attention`). A no-op where the references run."""
    if not use_triton(cache.k_cache):
        return
    group = num_heads // cache.num_kv_heads
    if group & (group - 1) == 0:
        triton_kernels.warm_up(cache, num_heads, dtype)
    dev = cache.k_cache.device
    q = torch.zeros(16, num_heads, cache.head_dim, dtype=dtype, device=dev)
    kv = torch.zeros(16, cache.num_kv_heads, cache.head_dim, dtype=dtype, device=dev)
    for lens in ([16], [8, 8]):  # one prompt, and several together
        causal_self_attention(q, kv, kv, AttentionMetadata.build(lens, lens, [[0]] * len(lens), [-1] * 16, dev))


def move_slots(cache, src_slots, dst_slots) -> None:
    """See :func:`ops.reference.move_slots`."""
    _pick("move_slots", cache.k_cache)(cache, src_slots, dst_slots)


def copy_pages(cache, src_pages, dst_pages) -> None:
    """See :func:`ops.reference.copy_pages`."""
    _pick("copy_pages", cache.k_cache)(cache, src_pages, dst_pages)
