"""The decoder's attention step behind one interface, and the plain (contiguous) KV cache.

Every decoder layer calls ``ctx.attend(layer, q, k, v)`` on the flat batch of new tokens. The
context object owns where K/V live and which earlier tokens each query sees; the model never
indexes a cache itself. This keeps the model unchanged when the storage changes (paged pools,
quantised pages, compacted prefixes).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ops import dispatch as ops
from ops.self_attention import causal_self_attention


class AttentionContext(Protocol):
    """What a decoder layer needs from the KV store for one forward step."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's K/V for ``layer`` and attend.

        Args:
            q: ``[T, num_heads, head_dim]`` queries of the step's T new tokens (after Q-norm and
                M-RoPE), model dtype.
            k, v: ``[T, num_kv_heads, head_dim]`` their keys (after K-norm and M-RoPE) and values.

        Returns:
            ``[T, num_heads, head_dim]`` attention output, model dtype.
        """
        ...


def causal_gqa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal grouped-query attention of one sequence with dense K/V, accumulated by SDPA.

    Args:
        q: ``[T, H, D]`` queries for sequence positions ``q_offset .. q_offset + T - 1``.
        k, v: ``[S, Hkv, D]`` keys / values for positions ``0 .. S - 1`` (``S >= q_offset + T``);
            ``H`` must be a multiple of ``Hkv`` (query head ``h`` reads KV head ``h // (H / Hkv)``).
        mask: optional bool ``[T, S]`` of the keys each query sees, replacing the causal mask.

    Returns:
        ``[T, H, D]``; softmax scale ``D ** -0.5``.
    """
    t, s = q.shape[0], k.shape[0]
    gqa = q.shape[1] != k.shape[1]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if mask is not None:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=gqa)
    elif q_offset == 0 and t == s:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    elif t == 1 and s == q_offset + 1:  # one decode token sees every stored key
        out = F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=gqa)
    else:
        visible = torch.arange(s, device=q.device)[None, :] <= (q_offset + torch.arange(t, device=q.device))[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, enable_gqa=gqa)
    return out.transpose(0, 1)


class DenseStep:
    """:class:`AttentionContext` over a :class:`DenseKVCache` for one sequence; ``mask`` (bool
    ``[T, S]``, None = causal) says which stored keys each new query sees."""

    mask: torch.Tensor | None = None

    def __init__(self, cache: DenseKVCache, start: int, num_new: int):
        self.cache, self.start, self.num_new = cache, start, num_new

    def attend(self, layer, q, k, v):
        end = self.start + self.num_new
        self.cache.k[layer][self.start : end] = k
        self.cache.v[layer][self.start : end] = v
        return causal_gqa_attention(q, self.cache.k[layer][:end], self.cache.v[layer][:end], self.start, self.mask)


class DenseKVCache:
    """K/V of one sequence in contiguous per-layer tensors ``[capacity, Hkv, D]`` (model dtype).

    The single-sequence reference store; the paged pool replaces it for serving.
    """

    def __init__(self, num_layers: int, capacity: int, num_kv_heads: int, head_dim: int, dtype, device):
        shape = (capacity, num_kv_heads, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0
        self.capacity = capacity

    step_class = DenseStep  # the per-step context; subclasses may give their own

    def step(self, num_new: int) -> DenseStep:
        """Context for a forward step that appends ``num_new`` tokens.

        Raises:
            ValueError: the cache would overflow its capacity.
        """
        if self.length + num_new > self.capacity:
            raise ValueError(f"KV cache capacity {self.capacity} tokens exceeded")
        ctx = self.step_class(self, self.length, num_new)
        self.length += num_new
        return ctx


class PagedStep:
    """:class:`AttentionContext` over the paged pool for one step of a flat batch.

    Stores the step's K/V through the slot mappings (quantising to Scaled-FP8 when the pool does)
    and attends each sequence's queries to its pages (see :func:`ops.reference.paged_attention`;
    decode-only steps use the split-context decode op). Triton on CUDA, references on CPU.

    Sequences with no cached context (a cold prompt's first chunk) may be given apart, as ``fresh``:
    they lead the flat batch and attend to the step's own K/V
    (:func:`ops.self_attention.causal_self_attention`), which reads each key once instead of
    widening its FP8 copy once per query block. The store hands back those K/V as the pages now
    hold them (FP8-rounded, dequantised), so a fresh sequence attends to the numbers it would read
    through its pages. Its result then does not depend on where its chunks end or on what shares its
    step, beyond the summation order of the kernels that run and, in a 16-bit model, the rounding of
    the dequantised values to the model dtype (exact on the CPU in float32).

    Args:
        pool: the :class:`~engine.cache.kv_pool.PagePool`.
        meta: metadata of the sequences attended through their pages (rows after ``fresh``'s), or None.
        fresh: metadata of the leading fresh sequences (``fresh.fresh`` True), or None.
        gates: the host tier's :class:`~engine.cache.kv_transfer.LayerGates` (each layer waits for
            its layer group of a restore landing before it touches the pool), or None.
    """

    def __init__(self, pool, meta, fresh=None, gates=None):
        self.pool, self.meta, self.fresh, self.gates = pool, meta, fresh, gates

    def attend(self, layer, q, k, v):
        if self.gates is not None:
            self.gates.wait(layer)
        cache = self.pool.layers[layer]
        f = self.fresh.num_tokens if self.fresh is not None else 0
        parts = []
        if self.fresh is not None:
            kf, vf = k[:f], v[:f]
            if cache.is_fp8:  # attend to what later chunks, decode steps and prefix hits will read
                kf, vf = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (kf, vf))
                ops.store_kv(k[:f], v[:f], cache, self.fresh.slot_mapping, out=(kf, vf))
            else:
                ops.store_kv(kf, vf, cache, self.fresh.slot_mapping)
            parts.append(causal_self_attention(q[:f], kf, vf, self.fresh))
        if self.meta is not None:
            ops.store_kv(k[f:], v[f:], cache, self.meta.slot_mapping)
            attend = ops.paged_decode_attention if self.meta.is_decode_only else ops.paged_attention
            parts.append(attend(q[f:], cache, self.meta))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
