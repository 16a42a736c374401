"""Backend choice for the KV-cache ops: Triton kernels for CUDA tensors, the PyTorch references
otherwise. ``PRISM_OPS=reference`` forces the references everywhere (the oracle on the GPU too);
``PRISM_OPS=triton`` forces the kernels (with ``TRITON_INTERPRET=1`` on CPU, for tests).

Decode attention over FP8 pages has two kernels: the current one, which widens every stored K/V
element to 16 bits (``"widen"``, :func:`ops.triton_kernels.paged_decode_attention`), and the FP8-MMA
one in its variants (``"mma_p8"``, ``"mma_p16"``, ``"mma_p8_q2"``, ``"mma_p16_q2"``,
:mod:`ops.triton_kernels.fp8_decode`). :data:`DECODE_KERNEL_TABLE` chooses per shape;
``PRISM_FP8_DECODE`` overrides it for benchmarking. This choice is made for the eager decode steps
that come through here; the captured decode graphs (``engine/graphs/decode.py``) call the current
kernel directly."""

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


#: Decode attention kernels by name: the current one and the FP8-MMA variants (``(p_fp8, q_terms)``).
DECODE_KERNELS = ("widen", "mma_p8", "mma_p16", "mma_p8_q2", "mma_p16_q2")

#: Batch and context (longest ``seq_len`` of the step) buckets of :data:`DECODE_KERNEL_TABLE`: a shape
#: belongs to the smallest bucket at least as large (the last bucket takes everything beyond).
DECODE_BATCH_BUCKETS = (1, 4, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXT_BUCKETS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

#: Which decode kernel runs per shape: ``(page format, batch bucket, context bucket) -> name`` (page
#: format as :data:`ops.triton_kernels.DECODE_CONFIG` keys it: ``"fp8"`` or ``"bf16"``). A shape not
#: in the table takes ``"widen"``. Empty until the H200 measures the FP8-MMA kernel
#: (``benchmarks/bench_fp8_decode.py``, issue 36): the current kernel runs everywhere.
DECODE_KERNEL_TABLE: dict[tuple[str, int, int], str] = {}


def _bucket(value: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if value <= b), buckets[-1])


def decode_kernel(fp8: bool, batch: int, max_seq_len: int, head_dim: int, device) -> str:
    """The decode attention kernel for a step: one of :data:`DECODE_KERNELS`.

    ``PRISM_FP8_DECODE`` (a name of :data:`DECODE_KERNELS`, or ``auto``, the default: the table)
    chooses for FP8 pages; 16/32-bit pages always take ``"widen"``. An FP8-MMA choice falls back to
    ``"widen"`` where the kernel cannot run: no FP8 matrix units on ``device``
    (:func:`ops.triton_kernels.fp8_mma_supported`) or a head_dim that is not a multiple of 32.

    Args:
        fp8: the pages are FP8.
        batch: sequences in the step.
        max_seq_len: the longest ``seq_len`` of the step (a graph's: the longest it allows).
        head_dim: the attention head size.
        device: where the step runs.

    Raises:
        ValueError: ``PRISM_FP8_DECODE`` names no kernel.
    """
    if not fp8:
        return "widen"
    env = os.environ.get("PRISM_FP8_DECODE", "auto")
    if env == "auto":
        key = ("fp8", _bucket(batch, DECODE_BATCH_BUCKETS), _bucket(max_seq_len, DECODE_CONTEXT_BUCKETS))
        name = DECODE_KERNEL_TABLE.get(key, "widen")
    elif env in DECODE_KERNELS:
        name = env
    else:
        raise ValueError(f"PRISM_FP8_DECODE must be auto or one of {DECODE_KERNELS}, not {env!r}")
    if name != "widen" and (triton_kernels is None or head_dim % 32
                            or not triton_kernels.fp8_mma_supported(device)):
        return "widen"
    return name


def paged_decode_attention(q, cache, meta):
    """See :func:`ops.reference.paged_decode_attention`; on FP8 pages the kernel
    :func:`decode_kernel` chooses (the same output up to its quantisation of Q and P)."""
    group = q.shape[1] // cache.num_kv_heads
    if use_triton(q) and group & (group - 1) == 0:
        name = decode_kernel(cache.is_fp8, q.shape[0], meta.max_seq_len, cache.head_dim, q.device)
        if name == "widen":
            return triton_kernels.paged_decode_attention(q, cache, meta)
        p_fp8, q_terms = triton_kernels.MMA_VARIANTS[name]
        return triton_kernels.paged_decode_attention_fp8_mma(q, cache, meta, p_fp8=p_fp8, q_terms=q_terms)
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
