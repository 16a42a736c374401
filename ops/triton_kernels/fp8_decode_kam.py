"""Paged decode attention over Scaled-FP8 pages on the FP8 matrix units, keys as the M dimension
(issue 36).

The same math, inputs, partial-result layout, merge and output as
:func:`ops.triton_kernels.fp8_decode.paged_decode_attention_fp8_mma` (its oracle is the same
:func:`ops.reference.paged_decode_attention_fp8_mma`), with both products transposed so that the
tile of keys, not the GQA group, fills the rows of the matrix instruction. A decode step has one
query token per sequence, so a KV head's group is 4 query rows (8B shape): as the M dimension it
fills 4 of the 64 rows Hopper's warpgroup MMA (``wgmma``) takes; measured on the H200, every 64-row
setting of that kernel was 2-3x slower than its 16-row ``mma.sync`` ones (docs/PERFORMANCE.md). Here:

- logits ``S^T = K Q^T``: the ``[BLOCK_N keys, head_dim]`` E4M3 K tile as stored is the A operand
  (M = BLOCK_N: 64 or 128 rows, full ``wgmma`` tiles), ``Q^T`` ``[head_dim, GP]`` the B operand
  (the group padded to ``GP`` >= 16 columns, the N dimension), Q quantised per (token, head), i.e.
  per column, in one or two E4M3 terms; the per-key K scales multiply S^T's rows, the Q scales
  (times softmax scale and ``log2(e)``) its columns;
- online softmax in float32 along the key axis (axis 0), per query column;
- ``O^T = V^T P^T`` (``[head_dim, BLOCK_N] x [BLOCK_N, GP]``: M = head_dim, again a full tile) with
  ``P_FP8``: ``P^T * v_scale`` (per key: per row) quantised to E4M3 with one scale per query column,
  against V's payload; without it ``P^T * v_scale / max(v_scale)`` in float16 against V widened to
  float16. ``PV_T=False`` computes ``O = P V`` instead (M = the group again, for measurement);
- split-K over the context, partials transposed back at the store into the rows
  :func:`~ops.triton_kernels.attention._decode_merge_kernel` reads.

One program per (sequence, KV head, context chunk), as the other decode kernels. FP8 ``tl.dot``
needs K >= 32: head_dim and ``block_n`` are multiples of 32.

Capture: the launch reads no device value on the host and allocates only the partials and the
output, so it can be captured in a CUDA graph; it waits on the previous kernel by PDL
(:func:`ops.pdl.pdl_sync`) as the current kernel does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..metadata import AttentionMetadata, KVLayerCache
from ..pdl import launch_args, pdl_sync
from ..reference import AMAX_FLOOR, FP8_MAX
from .attention import _widen_fp8, merge_decode_partials
from .fp8_decode import _LOG2E, _check_fp8_product, _to_e4m3, mma_decode_splits

#: Launch settings of the keys-as-M kernel: not yet measured (issue 36; ``benchmarks/bench_fp8_decode.py``
#: sweeps ``block_n`` 64/128, 4/8 warps, 1-3 stages, waves). ``wgmma`` takes four warps at least.
KAM_DECODE_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 2, "waves": 4, "pv_t": True}

#: The kernel's variants by name (as :mod:`ops.dispatch` and ``PRISM_FP8_DECODE`` say them):
#: ``(p_fp8, q_terms)``, as :data:`ops.triton_kernels.fp8_decode.MMA_VARIANTS`.
KAM_VARIANTS = {"kam_p8": (True, 1), "kam_p16": (False, 1), "kam_p8_q2": (True, 2), "kam_p16_q2": (False, 2)}


@triton.jit
def _quantize_cols(x, amax_floor, fp8_max, EXACT: tl.constexpr):
    """float32 ``[R, C]`` -> (E4M3 ``[R, C]``, float32 ``[C]`` scales): :func:`ops.reference.quantize_fp8`
    of each column (correctly rounded divisions)."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), amax_floor), fp8_max)
    return _to_e4m3(tl.clamp(tl.math.div_rn(x, scale[None, :]), -fp8_max, fp8_max), EXACT), scale


@triton.jit
def _pv_t(v, p_t, PV_T: tl.constexpr):
    """``O^T`` of one key block, float32 ``[BLOCK_D, GP]``, from ``v`` ``[BLOCK_N, BLOCK_D]`` and ``P^T``
    ``[BLOCK_N, GP]`` of one operand type: ``V^T P^T`` (head_dim as M), or ``(P V)^T`` (the group as M)."""
    if PV_T:
        return tl.dot(tl.trans(v), p_t)
    else:
        return tl.trans(tl.dot(tl.trans(p_t), v))


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])  # eager steps vary both: one compile
def _fp8_kam_decode_kernel(
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
    PV_T: tl.constexpr,
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
    # Q^T [BLOCK_D, GP]: the group's queries as columns (padding columns zero)
    qt = tl.load(
        q_ptr + b * stride_qb + head[None, :] * stride_qh + d[:, None], mask=dm[:, None] & gok[None, :], other=0.0
    ).to(tl.float32)
    q1, s1 = _quantize_cols(qt, amax_floor, fp8_max, EXACT)
    c1 = s1 * qk_scale  # softmax scale * log2(e) rides on each column's Q scale
    if Q_TERMS == 2:
        q2, s2 = _quantize_cols(qt - q1.to(tl.float32) * s1[None, :], amax_floor, fp8_max, EXACT)
        c2 = s2 * qk_scale
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([BLOCK_D, GP], tl.float32)  # O^T
    table = bt_ptr + b * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        kok = kpos < hi
        page = tl.load(table + kpos // PAGE, mask=kok, other=0).to(tl.int64)
        row = (page * num_kv_heads + kvh) * PAGE + kpos % PAGE  # head-major pages: runs of PAGE rows
        off = row[:, None] * D + d[None, :]
        kvm = kok[:, None] & dm[None, :]
        k = tl.load(kc_ptr + off, mask=kvm, other=0.0)  # E4M3 as stored: the A operand, keys as M
        s = tl.dot(k, q1) * c1[None, :]  # S^T [BLOCK_N, GP]
        if Q_TERMS == 2:
            s += tl.dot(k, q2) * c2[None, :]
        s = s * tl.load(ks_ptr + row, mask=kok, other=0.0)[:, None]
        s = tl.where(kok[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[None, :])  # P^T
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        vs = tl.load(vs_ptr + row, mask=kok, other=0.0)
        if P_FP8:
            # V's scales on P^T's rows, then P^T in E4M3 with one scale per query column
            v = tl.load(vc_ptr + off, mask=kvm, other=0.0)
            x = p * vs[:, None]
            amax = tl.maximum(tl.max(x, axis=0), amax_floor)
            p8 = _to_e4m3(tl.minimum(x * (fp8_max / amax)[None, :], fp8_max), EXACT)
            pv = _pv_t(v, p8, PV_T) * (amax / fp8_max)[None, :]
        else:
            # as the current kernel: P relative to the block's largest V scale, float16 against widened V
            if ASM:
                v = _widen_fp8(tl.load(vc_ptr + off, mask=kvm, other=0.0))
            else:
                v = tl.load(vc_ptr + off, mask=kvm, other=0.0).to(tl.float16)
            v_max = tl.maximum(tl.max(vs, axis=0), 1e-30)
            pv = _pv_t(v, (p * (vs / v_max)[:, None]).to(tl.float16), PV_T) * v_max
        acc = acc * alpha[None, :] + pv
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[None, :]
    # natural-log LSE (times ln 2) for the shared merge kernel
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))) * 0.6931471805599453)
    orow = (b * num_kv_heads * G + head) * num_splits + sp
    # transposed store: the merge reads one [D] row per (sequence, head, split)
    tl.store(part_o_ptr + orow[None, :] * D + d[:, None], out, mask=dm[:, None] & gok[None, :])
    tl.store(part_lse_ptr + orow, lse, mask=gok)


def kam_decode_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int | None = None,
                      waves: float | None = None) -> int:
    """Context chunks per (sequence, KV head) for the keys-as-M kernel: :func:`mma_decode_splits` under
    :data:`KAM_DECODE_CONFIG` (or the given ``block_n`` / ``waves``)."""
    cfg = KAM_DECODE_CONFIG
    return mma_decode_splits(batch, num_kv_heads, max_seq_len, block_n or cfg["block_n"], waves or cfg["waves"])


def paged_decode_attention_fp8_kam(
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
    pv_t: bool | None = None,
    dequant: str | None = None,
) -> torch.Tensor:
    """Decode attention over FP8 pages with FP8 matrix products, keys as the M dimension: the kernel
    version of :func:`ops.reference.paged_decode_attention_fp8_mma`, a drop-in for
    :func:`ops.triton_kernels.paged_decode_attention` on FP8 pages.

    Args:
        q: ``[B, Hq, D]`` (any float dtype), one new token per sequence, already stored in the pages.
        cache: the layer's pool, FP8; ``head_dim`` a multiple of 32 (FP8 products take K >= 32).
        meta: only ``seq_lens`` and ``block_tables`` are read on the device, ``max_seq_len`` only to
            choose ``num_splits``. A sequence of length 0 gives zeros.
        num_splits: context chunks per sequence (fixed for CUDA-graph capture); None chooses by
            :func:`kam_decode_splits`.
        p_fp8: PV with P in E4M3 against V's payload (True) or float16 against widened V (False).
        q_terms: Q in 1 or 2 E4M3 terms.
        block_n, num_warps, num_stages: launch settings; None takes :data:`KAM_DECODE_CONFIG`'s
            (``block_n`` 128 for ``p_fp8`` with ``pv_t`` on CUDA: 64 is miscompiled there).
            ``block_n`` a power of two >= 32 (64 or more fills a ``wgmma`` tile).
        pv_t: PV as ``V^T P^T`` (True: head_dim as M) or ``P V`` (False: the group as M); None takes
            the config's.
        dequant: how the float16 variant widens V on CUDA (``"asm"`` or ``"triton"``, see
            :data:`ops.triton_kernels.attention.FP8_DEQUANT`, the default).

    Returns:
        ``[B, Hq, D]`` in ``q``'s dtype.

    Raises:
        ValueError: pages not FP8, a head_dim or ``block_n`` the FP8 product cannot take, ``q_terms``
            not 1 or 2, an unknown ``dequant``; ``p_fp8`` with ``pv_t`` at ``block_n`` 64 (miscompiled).
        RuntimeError: ``q``'s device has no FP8 matrix units
            (:func:`~ops.triton_kernels.fp8_decode.fp8_mma_supported`).
    """
    cfg = KAM_DECODE_CONFIG
    pv_t = cfg["pv_t"] if pv_t is None else pv_t
    broken = p_fp8 and pv_t and q.is_cuda  # at block_n 64 (the interpreter computes it right)
    block_n = block_n or (128 if broken else cfg["block_n"])
    if broken and block_n == 64:
        # V^T P^T with both operands E4M3 in 64-byte-swizzled shared memory: Triton 3.6's wgmma of it
        # returns NaN eagerly and faults (illegal address) in a CUDA graph on the H200, where block_n
        # 128 (128-byte swizzle), 32, and P V are right (benchmarks/debug_kam.py, docs/gpu/kam_debug_v1.txt)
        raise ValueError("kam_p8 with pv_t at block_n 64 is miscompiled (Triton 3.6, sm_90): use block_n 128")
    asm = _check_fp8_product(q, cache, block_n, q_terms, dequant)
    b, hq, d = q.shape
    hkv = cache.num_kv_heads
    g = hq // hkv
    splits = num_splits or kam_decode_splits(b, hkv, meta.max_seq_len, block_n)
    part_o = torch.empty((b * hq * splits, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((b * hq * splits,), dtype=torch.float32, device=q.device)
    _fp8_kam_decode_kernel[(b, hkv, splits)](
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
        GP=max(16, triton.next_power_of_2(g)),  # N of both products: tl.dot takes 16 at least
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
        PAGE=cache.page_size,
        BLOCK_N=block_n,
        P_FP8=p_fp8,
        Q_TERMS=q_terms,
        PV_T=pv_t,
        ASM=asm,
        EXACT=not q.is_cuda,  # the interpreter's FP8 cast (see fp8_decode._round_e4m3)
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
        **launch_args(q),
    )
    return merge_decode_partials(part_o, part_lse, q, splits)
