"""Prism ops package: paged, Scaled-FP8 KV-cache operations (PyTorch reference implementations)."""

from .metadata import (
    FP8_DTYPE,
    SCALE_DTYPE,
    AttentionMetadata,
    KVLayerCache,
    kv_bytes_per_token,
    resolve_kv_dtype,
)
from .reference import (
    AMAX_FLOOR,
    FP8_MAX,
    copy_pages,
    dequantize_fp8,
    move_slots,
    paged_attention,
    paged_decode_attention,
    quantize_fp8,
    store_kv,
)

__all__ = [
    "AMAX_FLOOR",
    "FP8_DTYPE",
    "FP8_MAX",
    "SCALE_DTYPE",
    "AttentionMetadata",
    "KVLayerCache",
    "copy_pages",
    "dequantize_fp8",
    "kv_bytes_per_token",
    "move_slots",
    "paged_attention",
    "paged_decode_attention",
    "quantize_fp8",
    "resolve_kv_dtype",
    "store_kv",
]
