"""Paged decode attention over Scaled-FP8 pages on the FP8 matrix units (issue 36).

Same inputs, partial-result layout, merge (:func:`~ops.triton_kernels.attention._decode_merge_kernel`)
and output as :func:`ops.triton_kernels.attention.paged_decode_attention`, which widens every stored
K and V element to 16 bits. Here the products run on E4M3 operands (``tl.dot`` on ``float8e4nv``:
``mma.sync`` e4m3 on sm_89 / sm_90, Hopper's ``wgmma`` where the tile allows it, 64 rows and four
warps), the math of :func:`ops.reference.paged_decode_attention_fp8_mma` (its oracle):

- Q is quantised in the kernel, per (token, head), in one or two E4M3 terms (``Q_TERMS``; two:
  the second quantises the first's residual, a second product on the same K tile);
- logits ``(q_fp8 . k_fp8) * q_scale * k_scale * softmax_scale``: K enters the product as stored,
  its per-token scales multiply the logit columns;
- online softmax in float32 (base 2, ``log2(e)`` folded into the Q scale);
- PV with ``P_FP8``: ``P * v_scale`` quantised to E4M3 with one scale per query row, against V's
  payload; without it, ``P * v_scale / max(v_scale)`` in float16 against V widened to float16 (as
  the current kernel);
- split-K over the context (flash-decoding), merged by log-sum-exp.

One program per (sequence, KV head, context chunk); the GQA group of query heads of the KV head is
the M dimension of both products, padded to ``rows`` (16: ``mma.sync``; 64 with four warps: the
shape Hopper's warpgroup MMA takes). FP8 ``tl.dot`` needs a K dimension of at least 32: head_dim
and ``block_n`` are multiples of 32 here.

Capture: the launch reads no device value on the host and allocates only what the current kernel
allocates (partials and the output), so it can be captured in a CUDA graph where the current one is.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..metadata import AttentionMetadata, KVLayerCache
from ..pdl import _interpreting, launch_args, pdl_sync
from ..reference import AMAX_FLOOR, FP8_MAX
from . import attention
from .attention import MAX_DECODE_SPLITS, _widen_fp8, decode_splits

_LOG2E = 1.4426950408889634

#: Launch settings of the FP8-MMA decode kernel. Not yet measured (issue 36): the current FP8
#: kernel's (one-warp programs, 16 waves); ``benchmarks/bench_fp8_decode.py`` sweeps a few.
MMA_DECODE_CONFIG = {"block_n": 64, "num_warps": 1, "num_stages": 1, "waves": 16, "rows": 16}

#: The kernel's variants by name (what :mod:`ops.dispatch`'s table and ``PRISM_FP8_DECODE`` say):
#: ``(p_fp8, q_terms)``.
MMA_VARIANTS = {"mma_p8": (True, 1), "mma_p16": (False, 1), "mma_p8_q2": (True, 2), "mma_p16_q2": (False, 2)}


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fp8_mma_supported(device: torch.device | str) -> bool:
    """Whether the FP8-MMA decode kernel runs on ``device``: CUDA (not ROCm) of compute capability
    8.9 or newer (FP8 ``mma`` on sm_89, ``mma`` / ``wgmma`` on sm_90), or a CPU under
    ``TRITON_INTERPRET=1``. Below sm_89 there is no FP8 matrix unit."""
    device = torch.device(device)
    if device.type == "cpu":
        return _interpreting()
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index) >= (8, 9)


@triton.jit
def _round_e4m3(x):
    """float32 -> the nearest E4M3 value (ties to even), still float32; ``|x| <= 448``.

    Only under the interpreter (``EXACT``): its float32 -> E4M3 cast slips where rounding carries into
    the exponent (see tests/test_triton_kernels.py, ``assert_same_fp8_pages``), up to 8% of random
    values; casting a value already on the E4M3 grid is exact. Compiled kernels cast directly."""
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1  # normal range: keep 3 of float32's 23 mantissa bits
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
    y = x * 512.0  # subnormal range (|x| < 2^-6): multiples of 2^-9
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where(((r - y) == 0.5) & odd, r - 1.0, r)
    return tl.where(tl.abs(x) < 0.015625, r * 0.001953125, normal)


@triton.jit
def _to_e4m3(x, EXACT: tl.constexpr):
    """float32 (within +-448) -> E4M3, round to nearest even."""
    if EXACT:
        x = _round_e4m3(x)
    return x.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _quantize_rows(x, amax_floor, fp8_max, EXACT: tl.constexpr):
    """float32 ``[R, C]`` -> (E4M3 ``[R, C]``, float32 ``[R]`` scales), as :func:`ops.reference.quantize_fp8`
    (correctly rounded divisions)."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), amax_floor), fp8_max)
    return _to_e4m3(tl.clamp(tl.math.div_rn(x, scale[:, None]), -fp8_max, fp8_max), EXACT), scale


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])  # eager steps vary both: one compile
def _fp8_mma_decode_kernel(
    q_ptr,
    part_o_ptr,
    part_lse_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    seq_lens_ptr,
    bt_ptr,
    stride_qb,
    stride_qh,
    stride_bt,
    num_kv_heads,
    qk_scale,
    num_splits,
    amax_floor,
    fp8_max,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    P_FP8: tl.constexpr,
    Q_TERMS: tl.constexpr,
    ASM: tl.constexpr,
    EXACT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_sync(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # chunk length from this sequence's own length (no host value: the launch can be graph-captured)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    g = tl.arange(0, GP)
    gok = g < G
    head = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    qf = tl.load(
        q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :], mask=gok[:, None] & dm[None, :], other=0.0
    ).to(tl.float32)
    # Q in E4M3 per (token, head); qk_scale (softmax scale * log2(e)) rides on its row scale
    q1, s1 = _quantize_rows(qf, amax_floor, fp8_max, EXACT)
    c1 = s1 * qk_scale
    if Q_TERMS == 2:
        q2, s2 = _quantize_rows(qf - q1.to(tl.float32) * s1[:, None], amax_floor, fp8_max, EXACT)
        c2 = s2 * qk_scale
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BLOCK_D], tl.float32)
    table = bt_ptr + b * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        kok = kpos < hi
        page = tl.load(table + kpos // PAGE, mask=kok, other=0).to(tl.int64)
        row = (page * num_kv_heads + kvh) * PAGE + kpos % PAGE  # head-major pages: runs of PAGE rows
        off = row[:, None] * D + d[None, :]
        kvm = kok[:, None] & dm[None, :]
        k = tl.load(kc_ptr + off, mask=kvm, other=0.0)  # E4M3 as stored: the product's B operand
        s = tl.dot(q1, tl.trans(k)) * c1[:, None]
        if Q_TERMS == 2:
            s += tl.dot(q2, tl.trans(k)) * c2[:, None]
        s = s * tl.load(ks_ptr + row, mask=kok, other=0.0)[None, :]
        s = tl.where(kok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vs = tl.load(vs_ptr + row, mask=kok, other=0.0)
        if P_FP8:
            # V's scales on P's columns, then P in E4M3 with one scale per query row
            v = tl.load(vc_ptr + off, mask=kvm, other=0.0)
            x = p * vs[None, :]
            amax = tl.maximum(tl.max(x, axis=1), amax_floor)
            p8 = _to_e4m3(tl.minimum(x * (fp8_max / amax)[:, None], fp8_max), EXACT)
            pv = tl.dot(p8, v) * (amax / fp8_max)[:, None]
        else:
            # as the current kernel: P relative to the block's largest V scale, float16 against widened V
            if ASM:
                v = _widen_fp8(tl.load(vc_ptr + off, mask=kvm, other=0.0))
            else:
                v = tl.load(vc_ptr + off, mask=kvm, other=0.0).to(tl.float16)
            v_max = tl.maximum(tl.max(vs, axis=0), 1e-30)
            pv = tl.dot((p * (vs / v_max)[None, :]).to(tl.float16), v) * v_max
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    # natural-log LSE (times ln 2) for the shared merge kernel
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))) * 0.6931471805599453)
    orow = (b * num_kv_heads * G + head) * num_splits + sp
    tl.store(part_o_ptr + orow[:, None] * D + d[None, :], out, mask=gok[:, None] & dm[None, :])
    tl.store(part_lse_ptr + orow, lse, mask=gok)


def _check_fp8_product(q: torch.Tensor, cache: KVLayerCache, block_n: int, q_terms: int,
                       dequant: str | None) -> bool:
    """What both FP8-MMA decode kernels need of their inputs; returns their ``ASM`` constant (V widened
    by :func:`~ops.triton_kernels.attention._widen_fp8` on NVIDIA CUDA under ``dequant="asm"``).

    Raises:
        ValueError: pages not FP8, head_dim not a multiple of 32 or ``block_n`` not a power of two
            >= 32 (FP8 products take K >= 32), ``q_terms`` not 1 or 2, an unknown ``dequant``.
        RuntimeError: ``q``'s device has no FP8 matrix units (:func:`fp8_mma_supported`).
    """
    if not cache.is_fp8:
        raise ValueError("the FP8-MMA decode kernel reads FP8 pages only")
    d = q.shape[-1]
    if d % 32 or block_n < 32 or block_n & (block_n - 1):
        raise ValueError(f"FP8 products need head_dim a multiple of 32 ({d}) and block_n a power of two >= 32 "
                         f"({block_n})")
    if q_terms not in (1, 2):
        raise ValueError(f"Q is quantised in 1 or 2 terms, not {q_terms}")
    how = dequant or attention.FP8_DEQUANT
    if how not in attention._DEQUANT_MODES:
        raise ValueError(f"FP8 dequant must be one of {attention._DEQUANT_MODES}, not {how!r}")
    if not fp8_mma_supported(q.device):
        raise RuntimeError(f"no FP8 matrix units on {q.device} (needs compute capability 8.9 or newer)")
    return q.is_cuda and torch.version.hip is None and how == "asm"


def mma_decode_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int | None = None,
                      waves: float | None = None) -> int:
    """Context chunks per (sequence, KV head) for the FP8-MMA kernel: :func:`decode_splits` under
    :data:`MMA_DECODE_CONFIG` (or the given ``block_n`` / ``waves``), at most :data:`MAX_DECODE_SPLITS`."""
    cfg = MMA_DECODE_CONFIG
    return min(MAX_DECODE_SPLITS, decode_splits(batch, num_kv_heads, max_seq_len, block_n or cfg["block_n"],
                                                waves=waves or cfg["waves"]))


def paged_decode_attention_fp8_mma(
    q: torch.Tensor,
    cache: KVLayerCache,
    meta: AttentionMetadata,
    num_splits: int | None = None,
    *,
    p_fp8: bool = True,
    q_terms: int = 1,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    rows: int | None = None,
    dequant: str | None = None,
) -> torch.Tensor:
    """Decode attention over FP8 pages with FP8 matrix products: the kernel version of
    :func:`ops.reference.paged_decode_attention_fp8_mma`, a drop-in for
    :func:`ops.triton_kernels.paged_decode_attention` on FP8 pages.

    Args:
        q: ``[B, Hq, D]`` (any float dtype), one new token per sequence, already stored in the pages.
        cache: the layer's pool, FP8; ``head_dim`` a multiple of 32 (FP8 products take K >= 32).
        meta: as the current kernel: only ``seq_lens`` and ``block_tables`` are read on the device,
            ``max_seq_len`` only to choose ``num_splits``. A sequence of length 0 gives zeros.
        num_splits: context chunks per sequence (fixed for CUDA-graph capture); None chooses by
            :func:`mma_decode_splits`.
        p_fp8: PV with P in E4M3 against V's payload (True) or float16 against widened V (False).
        q_terms: Q in 1 or 2 E4M3 terms.
        block_n, num_warps, num_stages, rows: launch settings; None takes :data:`MMA_DECODE_CONFIG`'s.
            ``block_n`` a power of two >= 32; ``rows`` >= 16 (64 takes four warps at least).
        dequant: how the float16 variant widens V on CUDA (``"asm"`` or ``"triton"``, see
            :data:`ops.triton_kernels.attention.FP8_DEQUANT`, the default).

    Returns:
        ``[B, Hq, D]`` in ``q``'s dtype.

    Raises:
        ValueError: pages not FP8, a head_dim or ``block_n`` the FP8 product cannot take, ``q_terms``
            not 1 or 2, an unknown ``dequant``.
        RuntimeError: ``q``'s device has no FP8 matrix units (:func:`fp8_mma_supported`).
    """
    cfg = MMA_DECODE_CONFIG
    block_n = block_n or cfg["block_n"]
    asm = _check_fp8_product(q, cache, block_n, q_terms, dequant)
    b, hq, d = q.shape
    hkv = cache.num_kv_heads
    g = hq // hkv
    gp = max(rows or cfg["rows"], 16, triton.next_power_of_2(g))
    warps = num_warps or cfg["num_warps"]
    if gp >= 64:
        warps = max(warps, 4)
    splits = num_splits or mma_decode_splits(b, hkv, meta.max_seq_len, block_n)
    part_o = torch.empty((b * hq * splits, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((b * hq * splits,), dtype=torch.float32, device=q.device)
    bd = triton.next_power_of_2(d)
    _fp8_mma_decode_kernel[(b, hkv, splits)](
        q,
        part_o,
        part_lse,
        cache.k_cache,
        cache.v_cache,
        cache.k_scale,
        cache.v_scale,
        meta.seq_lens,
        meta.block_tables,
        q.stride(0),
        q.stride(1),
        meta.block_tables.stride(0),
        hkv,
        meta.softmax_scale(d) * _LOG2E,
        splits,
        AMAX_FLOOR,
        FP8_MAX,
        G=g,
        GP=gp,
        D=d,
        BLOCK_D=bd,
        PAGE=cache.page_size,
        BLOCK_N=block_n,
        P_FP8=p_fp8,
        Q_TERMS=q_terms,
        ASM=asm,
        EXACT=not q.is_cuda,  # the interpreter's FP8 cast (see _round_e4m3)
        num_warps=warps,
        num_stages=num_stages or cfg["num_stages"],
        **launch_args(q),
    )
    return attention.merge_decode_partials(part_o, part_lse, q, splits)
