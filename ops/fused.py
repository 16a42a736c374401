"""Fused elementwise kernels of the decoder, each beside its PyTorch reference.

A decode step is a few matrix products per layer and dozens of tiny elementwise kernels; at batch 1
the launches, not the bytes, dominate. These kernels do each group in one launch:

- :func:`add_rms_norm`: residual add + RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467);
- :func:`qk_norm_rope`: Qwen3's per-head Q/K RMSNorm followed by rotary embedding (M-RoPE tables);
- :func:`rope_float32`: the vision tower's rotary embedding, float32 math on 16-bit inputs;
- :func:`silu_mul`: the SwiGLU gate ``silu(gate) * up`` (Shazeer 2020, arXiv:2002.05202).

Each kernel follows its reference's rounding: values are computed in float32 and rounded to the
model dtype wherever the reference rounds (after the norm, after each product); only reduction
order differs. CPU tensors use the references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import use_triton
from .pdl import launch_args

try:
    import triton
    import triton.language as tl

    from .pdl import pdl_sync
except Exception:  # pragma: no cover
    triton = None


# --------------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))``; the norm in float32, cast to ``x.dtype`` before the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` by ``cos``/``sin`` ``[T, D]`` (in the model dtype)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def rope_float32_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` by float32 ``cos``/``sin`` ``[T, D]`` in float32, rounding once to
    ``x.dtype`` at the end (the vision tower's rotary embedding, as transformers applies it)."""
    xf = x.float()
    return (xf * cos[:, None] + rotate_half(xf) * sin[:, None]).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, n, eps, HAS_RES: tl.constexpr,
                             BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_sync(PDL)
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = c < n
        x = tl.load(x_ptr + row * n + c, mask=m, other=0.0)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(r_ptr + row * n + c, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(s_ptr + row * n + c, x, mask=m)
        xf = x.to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
        normed = (xf * inv).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n + c, (w * normed).to(x.dtype), mask=m)

    @triton.jit
    def _qk_norm_rope_kernel(x_ptr, w_ptr, wk_ptr, cos_ptr, sin_ptr, y_ptr, heads, q_heads, stride_t, stride_h,
                             eps, D: tl.constexpr, PDL: tl.constexpr):
        pdl_sync(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        half: tl.constexpr = D // 2
        i = tl.arange(0, half)
        base = x_ptr + t * stride_t + h * stride_h
        x1 = tl.load(base + i)
        x2 = tl.load(base + half + i)
        dt = x1.dtype
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv = tl.math.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / D + eps)
        if h < q_heads:  # query heads take the Q-norm weight, the key heads after them the K-norm's
            w1 = tl.load(w_ptr + i).to(tl.float32)
            w2 = tl.load(w_ptr + half + i).to(tl.float32)
        else:
            w1 = tl.load(wk_ptr + i).to(tl.float32)
            w2 = tl.load(wk_ptr + half + i).to(tl.float32)
        n1 = (w1 * (f1 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        n2 = (w2 * (f2 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        c1 = tl.load(cos_ptr + t * D + i).to(tl.float32)
        c2 = tl.load(cos_ptr + t * D + half + i).to(tl.float32)
        s1 = tl.load(sin_ptr + t * D + i).to(tl.float32)
        s2 = tl.load(sin_ptr + t * D + half + i).to(tl.float32)
        # x*cos + rotate_half(x)*sin, rounding each product and the sum as the reference does
        o1 = ((n1 * c1).to(dt).to(tl.float32) + (-n2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((n2 * c2).to(dt).to(tl.float32) + (n1 * s2).to(dt).to(tl.float32)).to(dt)
        out = y_ptr + (t * heads + h) * D
        tl.store(out + i, o1)
        tl.store(out + half + i, o2)

    @triton.jit
    def _rope_float32_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, heads, stride_t, stride_h, HALF: tl.constexpr,
                             BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
        # BLOCK_H heads a program: one program per (token, head) would be T x heads programs of
        # only 36 elements each (the vision tower's head_dim is 72)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        i = tl.arange(0, BLOCK)
        m = (h < heads)[:, None] & (i < HALF)[None, :]
        base = x_ptr + t * stride_t + h[:, None] * stride_h + i[None, :]
        f1 = tl.load(base, mask=m, other=0.0)
        dt = f1.dtype
        f1 = f1.to(tl.float32)
        f2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
        cm = i < HALF
        c1 = tl.load(cos_ptr + t * 2 * HALF + i, mask=cm, other=0.0)[None, :]
        c2 = tl.load(cos_ptr + t * 2 * HALF + HALF + i, mask=cm, other=0.0)[None, :]
        s1 = tl.load(sin_ptr + t * 2 * HALF + i, mask=cm, other=0.0)[None, :]
        s2 = tl.load(sin_ptr + t * 2 * HALF + HALF + i, mask=cm, other=0.0)[None, :]
        out = y_ptr + (t * heads + h[:, None]) * 2 * HALF + i[None, :]
        tl.store(out, (f1 * c1 - f2 * s1).to(dt), mask=m)
        tl.store(out + HALF, (f2 * c2 + f1 * s2).to(dt), mask=m)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, n, stride_g, stride_u, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < n
        g = tl.load(g_ptr + row * stride_g + c, mask=m, other=0.0)
        u = tl.load(u_ptr + row * stride_u + c, mask=m, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        tl.store(y_ptr + row * n + c, (act * u.to(tl.float32)).to(g.dtype), mask=m)


# --------------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------------


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``s = x + residual`` (or ``x`` when ``residual`` is None), then ``rms_norm(s)``.

    Args:
        x, residual: ``[T, H]`` model dtype, contiguous.
        weight: ``[H]``.

    Returns:
        ``(normed [T, H], s [T, H])``.
    """
    if not use_triton(x) or triton is None:
        s = x if residual is None else x + residual
        return rms_norm_reference(s, weight, eps), s
    t, n = x.shape
    y = torch.empty_like(x)
    s = x if residual is None else torch.empty_like(x)
    if t:
        _add_rms_norm_kernel[(t,)](x, residual if residual is not None else x, weight, y, s, n, eps,
                                   HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n), **launch_args(x))
    return y, s


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                 k_weight: torch.Tensor | None = None, q_heads: int | None = None):
    """Per-head RMSNorm of ``x [T, heads, D]`` (a view of the QKV projection is fine: its last dim
    must be contiguous) then rotary embedding with ``cos``/``sin`` ``[T, D]``.

    With ``k_weight`` and ``q_heads``, ``x`` holds the query heads then the key heads of one token
    (adjacent in the fused QKV output): heads ``< q_heads`` are normed with ``weight`` (Q-norm),
    the rest with ``k_weight`` (K-norm), all in one launch.

    Returns:
        a new contiguous ``[T, heads, D]`` tensor.
    """
    if k_weight is None:
        k_weight, q_heads = weight, x.shape[1]
    if not use_triton(x) or triton is None:
        q = rope_reference(rms_norm_reference(x[:, :q_heads], weight, eps), cos, sin)
        if q_heads == x.shape[1]:
            return q
        k = rope_reference(rms_norm_reference(x[:, q_heads:], k_weight, eps), cos, sin)
        return torch.cat([q, k], dim=1)
    t, heads, d = x.shape
    y = torch.empty((t, heads, d), dtype=x.dtype, device=x.device)
    if t:
        _qk_norm_rope_kernel[(t, heads)](x, weight, k_weight, cos.contiguous(), sin.contiguous(), y, heads, q_heads,
                                         x.stride(0), x.stride(1), eps, D=d, **launch_args(x))
    return y


def rope_float32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`rope_float32_reference` in one launch, without float32 copies of ``x`` in memory.

    Args:
        x: ``[T, heads, D]`` (a strided view is fine: its last dim must be contiguous), D even.
        cos, sin: float32 ``[T, D]``.

    Returns:
        a new contiguous ``[T, heads, D]`` tensor in ``x.dtype``.
    """
    if not use_triton(x) or triton is None:
        return rope_float32_reference(x, cos, sin)
    t, heads, d = x.shape
    y = torch.empty((t, heads, d), dtype=x.dtype, device=x.device)
    if t:
        block_h = min(16, triton.next_power_of_2(heads))
        _rope_float32_kernel[(t, triton.cdiv(heads, block_h))](
            x, cos.float().contiguous(), sin.float().contiguous(), y, heads, x.stride(0), x.stride(1),
            HALF=d // 2, BLOCK=triton.next_power_of_2(d // 2), BLOCK_H=block_h,
        )
    return y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, both ``[T, I]`` with contiguous rows (e.g. halves of one product),
    model dtype."""
    if not use_triton(gate) or triton is None:
        return F.silu(gate) * up
    t, n = gate.shape
    y = torch.empty((t, n), dtype=gate.dtype, device=gate.device)
    if t:
        block = 1024
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate, up, y, n, gate.stride(0), up.stride(0), BLOCK=block)
    return y
