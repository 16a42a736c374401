"""The start-up compile: before the first request, launch once every kernel an eager step uses,
so no user waits for Triton to compile one (called through :func:`ops.dispatch.warm_up`)."""

from __future__ import annotations

import torch

from ..metadata import AttentionMetadata, KVLayerCache
from .attention import paged_attention, paged_decode_attention
from .kv_store import store_kv


def warm_up(cache: KVLayerCache, num_heads: int, dtype: torch.dtype) -> None:
    """Compile the kernels that eager steps launch: the store that hands back the stored K/V (a
    fresh step's), prefill attention in its short and long settings and split-context decode (a
    Triton compile takes ~1-2 s on the H200; without this the first cold, chunked or mixed step
    would wait for it). Reads page 0 of ``cache``, stores nothing; the outputs are dropped.

    Args:
        cache: a layer of the pool the engine attends over.
        num_heads: query heads (a power-of-two multiple of the KV heads).
        dtype: the model dtype (the queries').
    """
    dev = cache.k_cache.device
    n_long = 32  # more than "short"'s 16 new tokens
    table = [0] * -(-n_long // cache.page_size)  # one page read over and over: any content will do
    q = torch.zeros(n_long, num_heads, cache.head_dim, dtype=dtype, device=dev)
    kv = torch.zeros(2, cache.num_kv_heads, cache.head_dim, dtype=dtype, device=dev)
    unused = torch.full((2,), -1, dtype=torch.long, device=dev)
    store_kv(kv, kv, cache, unused, out=(torch.empty_like(kv), torch.empty_like(kv)))  # a fresh step's store
    for n in (8, n_long):
        paged_attention(q[:n], cache, AttentionMetadata.build([n], [n], [table], [-1] * n, dev))
    paged_decode_attention(q[:2], cache, AttentionMetadata.build([1, 1], [5, n_long], [table] * 2, [-1, -1], dev))
