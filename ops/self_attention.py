"""Attention of a *fresh* prefill step (no sequence has cached context) to its own K/V.

A cold prompt's first step holds all of its keys in the step itself. Reading them back from the
paged pool would widen every FP8 key and value once per query block (tens of times per key for a
1.7k-token prompt); attending to the step's tensors with PyTorch's fused attention
(FlashAttention-2 on CUDA: Dao, "FlashAttention-2", 2023) reads each once. The caller passes the
K/V as the pages hold them (``ops.store_kv(..., out=...)``: FP8-rounded and dequantised), so the
result is the paged attention's up to summation order and the rounding of those values to the
model dtype.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .metadata import AttentionMetadata

try:  # torch >= 2.10. Its ``enable_gqa`` flag arrived in 2.12; 2.11's takes fewer KV heads without one
    # (FlashAttention's own GQA; measured on the H200 equal to the per-sequence loop bit for bit).
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    _VARLEN_ARGS = set(inspect.signature(_varlen_attn).parameters)
except ImportError:  # pragma: no cover - depends on the torch version
    _varlen_attn, _VARLEN_ARGS = None, set()


#: PyTorch's fused attention backends that need no per-shape set-up, for ``sdpa_kernel``. Not cuDNN's
#: attention: it builds an execution plan for every new sequence length (43-85 ms each on the H200,
#: docs/PERFORMANCE.md v7), and nearly every prompt, and every new image size, has a new length.
SDPA_BACKENDS_WITHOUT_PLANS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _varlen_usable(q: torch.Tensor) -> bool:
    """FlashAttention's varlen kernel: 16-bit inputs, head_dim <= 256, Ampere or newer."""
    return (
        _varlen_attn is not None
        and q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] <= 256
        and torch.cuda.get_device_capability(q.device) >= (8, 0)
        and "scale" in _VARLEN_ARGS
        and ("window_size" in _VARLEN_ARGS or "is_causal" in _VARLEN_ARGS)
    )


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence: ``[S, Hq, D]`` x ``[S, Hkv, D]`` -> ``[S, Hq, D]``."""
    with sdpa_kernel(SDPA_BACKENDS_WITHOUT_PLANS):
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
        )
    return out[0].transpose(0, 1)


def causal_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Causal GQA attention of each sequence's new tokens among themselves.

    Same result as :func:`ops.reference.paged_attention` after :func:`ops.reference.store_kv` of a
    fresh step, when ``k`` / ``v`` are what the pages hold (up to summation order). Query head ``h``
    reads KV head ``h // (Hq // Hkv)``.

    Args:
        q: ``[T, Hq, D]`` queries (after Q-norm and M-RoPE), model dtype.
        k, v: ``[T, Hkv, D]`` the same tokens' keys (after K-norm and M-RoPE) and values.
        meta: the step's metadata with ``fresh`` set and no padding rows (``T`` new tokens, as
            :meth:`AttentionMetadata.build` makes it); sequence ``b`` owns rows
            ``query_start_loc[b] .. query_start_loc[b + 1] - 1``.

    Returns:
        ``[T, Hq, D]`` in ``q.dtype``.

    Raises:
        ValueError: ``meta.fresh`` is False, ``q`` has not ``meta.num_tokens`` rows, or ``q`` / ``k`` /
            ``v`` disagree in rows, heads or head_dim.
    """
    if not meta.fresh:
        raise ValueError("causal_self_attention needs a fresh step (no sequence with cached context)")
    t, hq, d = q.shape
    if t != meta.num_tokens:
        raise ValueError(f"q has {t} rows, the step {meta.num_tokens} tokens")
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d or hq % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit one another")
    scale = meta.softmax_scale(d)
    if meta.num_seqs == 1 and meta.max_query_len == t:  # the usual cold prompt: no host sync
        return _sdpa_causal(q, k, v, scale)
    if _varlen_usable(q):  # several prompts in one launch, no host sync
        cu = meta.query_start_loc.to(torch.int32)
        causal = {"window_size": (-1, 0)} if "window_size" in _VARLEN_ARGS else {"is_causal": True}
        extra = {"enable_gqa": True} if hq != k.shape[1] and "enable_gqa" in _VARLEN_ARGS else {}
        if "num_splits" in _VARLEN_ARGS:  # split-KV would depend on the batch's composition
            extra["num_splits"] = 1
        return _varlen_attn(q, k, v, cu, cu, meta.max_query_len, meta.max_query_len, scale=scale, **causal, **extra)
    out = q.new_empty(q.shape)
    starts = meta.query_start_loc.tolist()
    for q0, q1 in zip(starts[:-1], starts[1:], strict=True):
        if q1 > q0:  # build() allows empty sequences
            out[q0:q1] = _sdpa_causal(q[q0:q1], k[q0:q1], v[q0:q1], scale)
    return out
