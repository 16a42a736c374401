"""Triton kernels over the paged Scaled-FP8 KV pool (see :mod:`ops.triton_kernels.attention`)."""

from .attention import (  # noqa: F401
    DECODE_CONFIG,
    FP8_DEQUANT,
    MAX_DECODE_SPLITS,
    PREFILL_CONFIG,
    _decode_merge_kernel,
    _decode_split_kernel,
    _dequant_mode,
    _move_rows,
    _paged_attention_kernel,
    copy_pages,
    decode_config,
    decode_splits,
    default_decode_splits,
    move_slots,
    paged_attention,
    paged_decode_attention,
    store_kv,
    warm_up,
)
