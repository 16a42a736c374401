"""Triton kernels over the paged Scaled-FP8 KV pool, each matching a function of
:mod:`ops.reference` (the oracle in tests), one module per concern:

- :mod:`~ops.triton_kernels.kv_store`: :func:`store_kv`, quantise and scatter a step's K/V;
- :mod:`~ops.triton_kernels.attention`: :func:`paged_attention` (prefill, chunked prefill, mixed
  batches) and :func:`paged_decode_attention` (split-context decode), with their launch settings;
- :mod:`~ops.triton_kernels.fp8_decode`: :func:`paged_decode_attention_fp8_mma`, split-context decode
  over FP8 pages on the FP8 matrix units (Q and P in E4M3), the same output as the current one;
- :mod:`~ops.triton_kernels.fp8_decode_kam`: :func:`paged_decode_attention_fp8_kam`, the same with
  keys as the matrix products' M dimension (full ``wgmma`` tiles);
- :mod:`~ops.triton_kernels.slot_moves`: :func:`move_slots` (compaction) and :func:`copy_pages`
  (copy-on-write);
- :mod:`~ops.triton_kernels.startup`: :func:`warm_up`, the start-up compile of eager steps' kernels.

Importing this package needs Triton; :mod:`ops.dispatch` falls back to the references without it.
The kernels run on CUDA, and under ``TRITON_INTERPRET=1`` on CPU tensors (for small tests).
"""

from .attention import (
    DECODE_CONFIG,
    MAX_DECODE_SPLITS,
    PREFILL_CONFIG,
    decode_config,
    decode_splits,
    default_decode_splits,
    paged_attention,
    paged_decode_attention,
)
from .fp8_decode import (
    MMA_DECODE_CONFIG,
    MMA_VARIANTS,
    fp8_mma_supported,
    mma_decode_splits,
    paged_decode_attention_fp8_mma,
)
from .fp8_decode_kam import (
    KAM_DECODE_CONFIG,
    KAM_VARIANTS,
    kam_decode_splits,
    paged_decode_attention_fp8_kam,
)
from .kv_store import store_kv
from .slot_moves import copy_pages, move_slots
from .startup import warm_up

__all__ = [
    "DECODE_CONFIG",
    "KAM_DECODE_CONFIG",
    "KAM_VARIANTS",
    "MAX_DECODE_SPLITS",
    "MMA_DECODE_CONFIG",
    "MMA_VARIANTS",
    "PREFILL_CONFIG",
    "copy_pages",
    "decode_config",
    "decode_splits",
    "default_decode_splits",
    "fp8_mma_supported",
    "kam_decode_splits",
    "mma_decode_splits",
    "move_slots",
    "paged_attention",
    "paged_decode_attention",
    "paged_decode_attention_fp8_kam",
    "paged_decode_attention_fp8_mma",
    "store_kv",
    "warm_up",
]
