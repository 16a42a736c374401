"""Triton kernels over the paged Scaled-FP8 KV pool, each matching a function of
:mod:`ops.reference` (the oracle in tests), one module per concern:

- :mod:`~ops.triton_kernels.kv_store`: :func:`store_kv`, quantise and scatter a step's K/V;
- :mod:`~ops.triton_kernels.attention`: :func:`paged_attention` (prefill, chunked prefill, mixed
  batches) and :func:`paged_decode_attention` (split-context decode), with their launch settings;
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
from .kv_store import store_kv
from .slot_moves import copy_pages, move_slots
from .startup import warm_up

__all__ = [
    "DECODE_CONFIG",
    "MAX_DECODE_SPLITS",
    "PREFILL_CONFIG",
    "copy_pages",
    "decode_config",
    "decode_splits",
    "default_decode_splits",
    "move_slots",
    "paged_attention",
    "paged_decode_attention",
    "store_kv",
    "warm_up",
]
