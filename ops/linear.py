"""Weight products at decode sizes: a Triton GEMV that streams each weight matrix once, with the
elementwise step before it (residual add + RMSNorm, or the SwiGLU gate) done in its prologue.

A decode step at batch 1-8 multiplies a few rows by each weight matrix, so its time is the time to
read the weights. On the H200, cuBLAS reads the 8B shape's matrices at 2.6-4.2 TB/s at one row;
this kernel at 3.2-4.4 TB/s, and doing the norm or the gate in its prologue also saves that
kernel's launch (``benchmarks/sweep_gemv.py``; ``docs/gpu/sweep_gemv_v8a.txt`` plain,
``docs/gpu/sweep_gemv_v8b.txt`` with the prologues). :func:`gemv_settings` holds where it pays.

- :func:`linear`: ``x @ weight.T``.
- :func:`add_rms_norm_linear`: ``rms_norm(x + residual) @ weight.T``, and ``x + residual``.
- :func:`silu_mul_linear`: ``(silu(gate) * up) @ weight.T`` from the fused ``[gate | up]`` rows.

Each rounds as the unfused ops do (:mod:`ops.fused`, then ``F.linear``): the prologue's values are
rounded to the model dtype before the product, and the product accumulates in float32 and rounds
once. Only the summation order differs. Where the GEMV does not pay (more than :data:`MAX_ROWS`
rows, see :func:`gemv_settings`), and for CPU tensors (unless ``PRISM_OPS=triton``), biases and
non-contiguous weights, the unfused PyTorch ops run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import use_triton
from .fused import add_rms_norm, silu_mul
from .pdl import launch_args

try:
    import triton
    import triton.language as tl

    from .pdl import pdl_sync
except Exception:  # pragma: no cover - Triton is optional on CPU-only installs
    triton = None

#: Most rows the GEMV takes; more go to cuBLAS, which is as fast from 16 rows on (``sweep_gemv_v8a.txt``).
MAX_ROWS = 8

_PLAIN, _SILU_MUL, _ADD_RMS_NORM = 0, 1, 2
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if triton is not None:

    @triton.jit
    def _residual_sum(x_ptr, r_ptr, x_offs, r_offs, mask, HAS_RES: tl.constexpr):
        x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(r_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        return x

    @triton.jit
    def _input_tile(x_ptr, r_ptr, nw_ptr, rm, rk, mask, inv, K, stride_xm, stride_rm,
                    PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr):
        """The ``[BLOCK_M, BLOCK_K]`` input tile in the model dtype, as the unfused op writes it."""
        x_offs = rm[:, None] * stride_xm + rk[None, :]
        if PROLOGUE == 1:  # silu(gate) * up; gate in columns [0, K), up in [K, 2K)
            g = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
            u = tl.load(x_ptr + x_offs + K, mask=mask, other=0.0)
            gf = g.to(tl.float32)
            act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
            tile = (act * u.to(tl.float32)).to(g.dtype)
        elif PROLOGUE == 2:  # rms_norm(x + residual) with the norm's weight
            s = _residual_sum(x_ptr, r_ptr, x_offs, rm[:, None] * stride_rm + rk[None, :], mask, HAS_RES)
            normed = (s.to(tl.float32) * inv[:, None]).to(s.dtype).to(tl.float32)
            nw = tl.load(nw_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
            tile = (nw[None, :] * normed).to(s.dtype)
        else:
            tile = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
        return tile

    @triton.jit
    def _gemv_kernel(x_ptr, r_ptr, nw_ptr, s_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_rm, stride_ym, eps,
                     PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, USE_DOT: tl.constexpr,
                     IEEE: tl.constexpr, PDL: tl.constexpr):
        pdl_sync(PDL)
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        row_ok = rm < M
        inv = tl.zeros((BLOCK_M,), tl.float32)
        if PROLOGUE == 2:  # first pass: each row's mean square (every program; program 0 stores the sum)
            ss = tl.zeros((BLOCK_M,), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                mask = row_ok[:, None] & (rk < K)[None, :]
                s = _residual_sum(x_ptr, r_ptr, rm[:, None] * stride_xm + rk[None, :],
                                  rm[:, None] * stride_rm + rk[None, :], mask, HAS_RES)
                if HAS_RES:
                    if pid == 0:
                        tl.store(s_ptr + rm[:, None] * K + rk[None, :], s, mask=mask)
                sf = s.to(tl.float32)
                ss += tl.sum(sf * sf, axis=1)
            inv = tl.math.rsqrt(ss / K + eps)
        w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * K + tl.arange(0, BLOCK_K)[None, :]
        if USE_DOT:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        else:  # one row: products summed along the tile, reduced once at the end
            acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            if EVEN:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs, mask=(rn < N)[:, None] & (rk < K)[None, :], other=0.0,
                            eviction_policy="evict_first")
            x = _input_tile(x_ptr, r_ptr, nw_ptr, rm, rk, row_ok[:, None] & (rk < K)[None, :], inv, K,
                            stride_xm, stride_rm, PROLOGUE, HAS_RES)
            if USE_DOT:
                if IEEE:
                    acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, tl.trans(w), acc)
            else:
                acc += w.to(tl.float32) * x.to(tl.float32)
            w_ptrs += BLOCK_K
        if USE_DOT:
            out = acc
        else:
            out = tl.sum(acc, axis=1)[None, :]
        out = out.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)  # round as F.linear, then widen
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], out, mask=row_ok[:, None] & (rn < N)[None, :])


#: Launch settings ``(BLOCK_N, BLOCK_K, warps, stages)`` at one row, measured best on the H200 for
#: the 8B and 2B shapes by (prologue, N, K) (``benchmarks/sweep_gemv.py``, ``docs/gpu/sweep_gemv_v8b.txt``).
_MEASURED = {
    (_ADD_RMS_NORM, 6144, 4096): (8, 512, 4, 4),
    (_PLAIN, 4096, 4096): (4, 512, 4, 2),
    (_PLAIN, 24576, 4096): (4, 1024, 4, 2),  # docs/gpu/sweep_gemv_v8a.txt
    (_SILU_MUL, 4096, 12288): (4, 512, 4, 4),
    (_PLAIN, 151936, 4096): (8, 256, 4, 4),
    (_ADD_RMS_NORM, 4096, 2048): (8, 1024, 4, 4),
    (_PLAIN, 2048, 2048): (4, 1024, 8, 2),
    (_ADD_RMS_NORM, 12288, 2048): (8, 1024, 4, 4),
    (_SILU_MUL, 2048, 6144): (4, 1024, 8, 2),
    (_PLAIN, 151936, 2048): (4, 512, 4, 4),
}
#: Beyond this many weight elements, the norm's first pass (every program reads the whole input
#: row again) costs more than the norm's own launch: the 8B gate/up product took 56.7 us fused
#: against 52.7 us for the norm kernel and cuBLAS (and ~51 us with the plain GEMV).
_NORM_PROLOGUE_MAX_ELEMENTS = 1 << 26
#: With several rows, the GEMV beats cuBLAS clearly only on large matrices (8B gate/up: 49.9 against
#: 54.6 us; LM heads 4-5%), and with a prologue it loses: every program re-reads all rows' inputs.
_MANY_ROWS_MIN_ELEMENTS = 1 << 26


def gemv_settings(rows: int, prologue: int, n: int, k: int) -> tuple[int, int, int, int] | None:
    """``(BLOCK_N, BLOCK_K, warps, stages)`` for ``rows x k`` times ``k x n`` with ``prologue``
    (one of ``_PLAIN``, ``_SILU_MUL``, ``_ADD_RMS_NORM``), or None where the GEMV does not pay
    (measured) and the unfused ops should run: more than :data:`MAX_ROWS` rows; several rows with a
    prologue or a small matrix; the norm prologue on a large matrix."""
    if rows > MAX_ROWS:
        return None
    if rows > 1:
        return (64, 128, 4, 4) if prologue == _PLAIN and n * k >= _MANY_ROWS_MIN_ELEMENTS else None
    if prologue == _ADD_RMS_NORM and n * k > _NORM_PROLOGUE_MAX_ELEMENTS:
        return None
    if (prologue, n, k) in _MEASURED:
        return _MEASURED[prologue, n, k]
    return (8 if prologue == _ADD_RMS_NORM else 4), min(512, triton.next_power_of_2(k)), 4, 4


def _gemv_applies(x: torch.Tensor, weight: torch.Tensor, width: int, bias: torch.Tensor | None = None) -> bool:
    """Whether the GEMV can take ``x`` (``width`` columns per input row) times ``weight``."""
    return (
        triton is not None and bias is None and use_triton(x) and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
        and x.shape[1] == width and weight.dim() == 2 and x.dtype == weight.dtype and x.dtype in _DTYPES
        and weight.is_contiguous() and x.stride(-1) == 1
    )


def _plan(prologue: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """The GEMV's settings for this call, or None for the unfused path."""
    width = weight.shape[-1] * (2 if prologue == _SILU_MUL else 1)
    if not _gemv_applies(x, weight, width, bias):
        return None
    return gemv_settings(x.shape[0], prologue, weight.shape[0], weight.shape[1])


def _launch(prologue, x, weight, settings, *, residual=None, norm_weight=None, eps=0.0, out_dtype=None):
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    block_n, block_k, warps, stages = settings
    block_m = 1 if m == 1 else max(16, triton.next_power_of_2(m))
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    has_res = residual is not None
    s = torch.empty((m, k), dtype=x.dtype, device=x.device) if has_res else x
    r = residual if has_res else x
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, r, norm_weight if norm_weight is not None else x, s, weight, y, m, n, k, x.stride(0), r.stride(0),
        y.stride(0), eps, PROLOGUE=prologue, HAS_RES=has_res, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN=n % block_n == 0 and k % block_k == 0, USE_DOT=m > 1,
        IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages, **launch_args(x),
    )
    return y, s


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``.

    Args:
        x: ``[M, K]``, last dim contiguous.
        weight: ``[N, K]`` (``nn.Linear`` layout), same dtype as ``x``.
        out_dtype: the result's dtype; the product is rounded to ``x.dtype`` first either way (so
            ``float32`` gives ``F.linear(x, weight).float()`` in one launch).

    Returns:
        ``[M, N]``, through the GEMV where :func:`gemv_settings` says it pays, else ``F.linear``.
    """
    settings = _plan(_PLAIN, x, weight, bias)
    if settings is None:
        y = F.linear(x, weight, bias)
        return y if out_dtype is None else y.to(out_dtype)
    return _launch(_PLAIN, x, weight, settings, out_dtype=out_dtype)[0]


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear(add_rms_norm(x, residual, norm_weight, eps)[0], weight)`` and the sum, with the
    norm in the GEMV's prologue.

    Args:
        x, residual: ``[M, K]`` model dtype, contiguous; ``residual`` None means the sum is ``x``.
        norm_weight: ``[K]``; eps: the norm's epsilon.
        weight: ``[N, K]``.

    Returns:
        ``(y [M, N], x + residual [M, K])``.
    """
    same_layout = x.is_contiguous() and norm_weight.is_contiguous() and norm_weight.shape == (x.shape[-1],) and (
        residual is None or (residual.is_contiguous() and residual.shape == x.shape and residual.dtype == x.dtype))
    settings = _plan(_ADD_RMS_NORM, x, weight) if same_layout else None
    if settings is None:
        normed, s = add_rms_norm(x, residual, norm_weight, eps)
        return linear(normed, weight), s
    return _launch(_ADD_RMS_NORM, x, weight, settings, residual=residual, norm_weight=norm_weight, eps=eps)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(silu_mul(gate, up), weight)`` for ``gate_up = [gate | up]``, with the SwiGLU gate
    (Shazeer 2020, arXiv:2002.05202) in the GEMV's prologue.

    Args:
        gate_up: ``[M, 2I]`` (the fused gate/up product), last dim contiguous.
        weight: ``[N, I]``; bias: ``[N]`` or None (with a bias the unfused ops run).

    Returns:
        ``[M, N]``.
    """
    settings = _plan(_SILU_MUL, gate_up, weight, bias)
    if settings is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return linear(silu_mul(gate, up), weight, bias)
    return _launch(_SILU_MUL, gate_up, weight, settings)[0]
