"""Paged attention kernels over the Scaled-FP8 KV pool, each matching a function of
:mod:`ops.reference` (the oracle in tests).

- :func:`paged_attention`: varlen causal attention of new tokens over their sequence's pages (prefill
  on top of cached / compacted pages, chunked prefill, conversation reuse, mixed batches).
  Flash-attention style (Dao et al. 2022, arXiv:2205.14135): online softmax in float32 over blocks of
  keys; the query heads that share one KV head are processed together, so each K/V tile is read once
  per group (grouped-query attention, Ainslie et al. 2023, arXiv:2305.13245).
- :func:`paged_decode_attention`: one new token per sequence, the context split into chunks that run
  in parallel and are merged by their log-sum-exp (flash-decoding), so even a batch of one fills the GPU.

FP8 math: a key's scale multiplies its score column (``q · k_fp8 * s_k``) and a value's scale
multiplies its probability (``(p * s_v) · v_fp8``), so the FP8 payload enters the matrix units
exactly; softmax and accumulation are float32.

The kernels run on CUDA, and under ``TRITON_INTERPRET=1`` on CPU tensors (for small tests).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..metadata import AttentionMetadata, KVLayerCache
from ..pdl import launch_args, pdl_sync

# --------------------------------------------------------------------------------------------------
# Varlen paged attention (prefill, chunked prefill, mixed batches)
# --------------------------------------------------------------------------------------------------


#: E4M3 -> float16 through the hardware converter, two values per instruction.
_E4M3_TO_F16_ASM = tl.constexpr("""{
    .reg .b16 lo, hi;
    mov.b32 {lo, hi}, $2;
    cvt.rn.f16x2.e4m3x2 $0, lo;
    cvt.rn.f16x2.e4m3x2 $1, hi;
}""")

#: How the attention kernels widen FP8 pages to float16 on CUDA: ``"asm"`` (``_E4M3_TO_F16_ASM``) or
#: ``"triton"`` (Triton's own cast). The assembly is the same instruction Triton emits, but Triton may
#: not move it: its own cast gets sunk past the tile's trip through shared memory, which then reads the
#: 8-bit tile byte by byte. Measured on the H200 (docs/PERFORMANCE.md): asm 3-4 % faster. Under the
#: interpreter (CPU tensors) and for float32 queries it is always Triton's cast.
FP8_DEQUANT = "asm"
_DEQUANT_MODES = ("triton", "asm")


def _dequant_mode(q: torch.Tensor, cache: KVLayerCache, how: str) -> bool:
    """The kernels' ``ASM`` constant: widen ``cache``'s FP8 pages next to float16 ``q`` by assembly.

    Raises:
        ValueError: ``how`` is not one of ``"asm"``, ``"triton"``.
    """
    if how not in _DEQUANT_MODES:
        raise ValueError(f"FP8 dequant must be one of {_DEQUANT_MODES}, not {how!r}")
    nvidia = q.is_cuda and torch.version.hip is None  # PTX; FP8 pages already need sm_89 or newer
    return how == "asm" and cache.is_fp8 and nvidia and q.dtype != torch.float32


@triton.jit
def _widen_fp8(x):
    """E4M3 tile -> float16 tile. Not pure for Triton, so that the widening stays where it is written,
    before the shared-memory staging."""
    return tl.inline_asm_elementwise(_E4M3_TO_F16_ASM, "=r,=r,r", [x], dtype=tl.float16, is_pure=False,
                                     pack=4)


@triton.jit
def _attend_block(
    q, m_i, l_i, acc, limit, n0, hi, table_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
    num_kv_heads, kvh, sm_scale, d, dm,
    D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr,
    ASM: tl.constexpr,
):
    """One online-softmax step over keys ``n0 .. n0 + BLOCK_N - 1`` (below ``hi``) of one sequence's
    pages: row ``r`` of ``q`` sees keys up to ``limit[r]``. Returns the updated (max, sum, acc).
    ``ASM``: FP8 pages are widened by :func:`_widen_fp8` (else by Triton's cast to ``q``'s dtype)."""
    kpos = n0 + tl.arange(0, BLOCK_N)
    kok = kpos < hi
    page = tl.load(table_ptr + kpos // PAGE, mask=kok, other=0).to(tl.int64)
    row = (page * num_kv_heads + kvh) * PAGE + kpos % PAGE  # head-major pages: runs of PAGE rows
    off = row[:, None] * D + d[None, :]
    if ASM:
        k = _widen_fp8(tl.load(kc_ptr + off, mask=kok[:, None] & dm[None, :], other=0.0))
        v = _widen_fp8(tl.load(vc_ptr + off, mask=kok[:, None] & dm[None, :], other=0.0))
    else:
        k = tl.load(kc_ptr + off, mask=kok[:, None] & dm[None, :], other=0.0).to(q.dtype)
        v = tl.load(vc_ptr + off, mask=kok[:, None] & dm[None, :], other=0.0).to(q.dtype)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if FP8:
        s = s * tl.load(ks_ptr + row, mask=kok, other=0.0)[None, :]
    visible = (kpos[None, :] <= limit[:, None]) & kok[None, :]
    s = tl.where(visible, s * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if FP8:
        # V's scales go on P's columns ([rows, BLOCK_N] multiplies instead of [BLOCK_N, D]),
        # divided by the block's largest scale so that P stays in [0, 1] for the 16-bit product
        vs = tl.load(vs_ptr + row, mask=kok, other=0.0)
        v_max = tl.maximum(tl.max(vs, axis=0), 1e-30)
        p = p * (vs / v_max)[None, :]
    if IEEE:
        pv = tl.dot(p.to(q.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v)
    if FP8:
        pv = pv * v_max
    return m_new, l_i, acc + pv


@triton.jit(do_not_specialize=["stride_bt"])  # the table width changes every few steps: one compile
def _paged_attention_kernel(
    q_ptr,
    o_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    block_seq_ptr,
    block_start_ptr,
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    num_kv_heads,
    sm_scale,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    IEEE: tl.constexpr,
    F16: tl.constexpr,
    ASM: tl.constexpr,
):
    blk = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(block_seq_ptr + blk)
    m0 = tl.load(block_start_ptr + blk)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # keys before the first new token

    # rows = BLOCK_M tokens x G query heads of this KV head
    r = tl.arange(0, BLOCK_M * G)
    tok = m0 + r // G
    head = kvh * G + r % G
    row_ok = tok < q_len
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & dm[None, :],
        other=0.0,
    )
    if F16:  # FP8 pages: E4M3 converts to float16 in one instruction (to bfloat16 it takes three)
        q = q.to(tl.float16)
    limit = ctx + tok  # last key each row may see (inclusive)
    hi = tl.minimum(ctx + m0 + BLOCK_M, seq_len)

    m_i = tl.full([BLOCK_M * G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * G], tl.float32)
    acc = tl.zeros([BLOCK_M * G, BLOCK_D], tl.float32)
    for n0 in range(0, hi, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, limit, n0, hi, bt_ptr + seq * stride_bt, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
            num_kv_heads, kvh, sm_scale, d, dm, D, PAGE, BLOCK_N, FP8, IEEE, ASM,
        )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        o_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dm[None, :],
    )


def _query_blocks(meta: AttentionMetadata, block_m: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, first query token) of every BLOCK_M query block; cached on ``meta`` so the host
    reads ``query_start_loc`` once per step, not once per layer."""
    cached = getattr(meta, "_triton_blocks", None)
    if cached is not None and cached[0] == block_m:
        return cached[1], cached[2]
    qsl = meta.query_start_loc.tolist()
    seqs, starts = [], []
    for b in range(len(qsl) - 1):
        for m0 in range(0, qsl[b + 1] - qsl[b], block_m):
            seqs.append(b)
            starts.append(m0)
    out = (torch.tensor(seqs, dtype=torch.int32, device=device), torch.tensor(starts, dtype=torch.int32, device=device))
    meta._triton_blocks = (block_m, *out)
    return out


#: Prefill launch settings: ``rows`` query rows a program (tokens x the GQA group), keys a block
#: (by head_dim), warps, pipeline stages. Steps with more than 16 new tokens of a sequence use their
#: page format's, from ``benchmarks/sweep_prefill.py`` on the H200 (1,662 new tokens, 8B shape:
#: FP8 302 -> 282 us, bf16 149 -> 144 us; docs/PERFORMANCE.md, v6); shorter steps keep "short".
PREFILL_CONFIG = {
    "fp8": {"rows": 64, "block_n": {64: 64, 128: 64}, "num_warps": 4, "num_stages": 2},
    "bf16": {"rows": 64, "block_n": {64: 64, 128: 32}, "num_warps": 4, "num_stages": 2},
    "short": {"rows": 16, "block_n": {64: 64, 128: 32}, "num_warps": 4, "num_stages": 3},
}


def paged_attention(q: torch.Tensor, cache: KVLayerCache, meta: AttentionMetadata, *, rows: int | None = None,
                    block_n: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None) -> torch.Tensor:
    """Triton version of :func:`ops.reference.paged_attention`.

    Args:
        q: ``[T, Hq, D]`` queries (model dtype).
        cache: the layer's pool.
        meta: the step's metadata.
        rows, block_n, num_warps, num_stages: launch settings; None takes :data:`PREFILL_CONFIG`'s
            for the step (for sweeps; every setting gives the same result up to summation order).

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype; rows of padding tokens are left zero.
    """
    t, hq, d = q.shape
    hkv = cache.num_kv_heads
    g = hq // hkv
    out = torch.zeros_like(q)
    if t == 0:
        return out
    cfg = PREFILL_CONFIG["short" if meta.max_query_len <= 16 else "fp8" if cache.is_fp8 else "bf16"]
    rows = rows or cfg["rows"]
    block_m = max(1, rows // g)
    block_n = block_n or cfg["block_n"].get(d, 64 if d <= 64 else 32)
    seqs, starts = _query_blocks(meta, block_m, q.device)
    if seqs.numel() == 0:
        return out
    ks = cache.k_scale if cache.is_fp8 else cache.k_cache
    vs = cache.v_scale if cache.is_fp8 else cache.v_cache
    _paged_attention_kernel[(seqs.numel(), hkv)](
        q,
        out,
        cache.k_cache,
        cache.v_cache,
        ks,
        vs,
        seqs,
        starts,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        meta.block_tables.stride(0),
        hkv,
        meta.softmax_scale(d),
        G=g,
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
        PAGE=cache.page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        FP8=cache.is_fp8,
        IEEE=q.dtype == torch.float32,
        F16=cache.is_fp8 and q.dtype != torch.float32,
        ASM=_dequant_mode(q, cache, FP8_DEQUANT),
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
    )
    return out


# --------------------------------------------------------------------------------------------------
# Decode: split-context attention + log-sum-exp merge
# --------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])  # eager steps vary both: one compile
def _decode_split_kernel(
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
    sm_scale,
    num_splits,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    IEEE: tl.constexpr,
    F16: tl.constexpr,
    ASM: tl.constexpr,
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
    q = tl.load(
        q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :], mask=gok[:, None] & dm[None, :], other=0.0
    )
    if F16:  # FP8 pages: E4M3 converts to float16 in one instruction (to bfloat16 it takes three)
        q = q.to(tl.float16)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BLOCK_D], tl.float32)
    limit = tl.full([GP], hi - 1, tl.int32)  # every stored key of the chunk is visible
    for n0 in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, limit, n0, hi, bt_ptr + b * stride_bt, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
            num_kv_heads, kvh, sm_scale, d, dm, D, PAGE, BLOCK_N, FP8, IEEE, ASM,
        )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
    row = (b * num_kv_heads * G + head) * num_splits + sp
    tl.store(part_o_ptr + row[:, None] * D + d[None, :], out, mask=gok[:, None] & dm[None, :])
    tl.store(part_lse_ptr + row, lse, mask=gok)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    part_o_ptr,
    part_lse_ptr,
    o_ptr,
    stride_ob,
    stride_oh,
    num_heads,
    num_splits,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_sync(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    sok = s < num_splits
    row = (b * num_heads + h) * num_splits + s
    lse = tl.load(part_lse_ptr + row, mask=sok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(sok, tl.exp(lse - m), 0.0)
    w = w / tl.maximum(tl.sum(w, axis=0), 1e-30)
    d = tl.arange(0, BLOCK_D)
    parts = tl.load(part_o_ptr + row[:, None] * D + d[None, :], mask=sok[:, None] & (d < D)[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], axis=0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < D)


#: Launch settings of the decode kernel per page format (chosen by benchmarks/sweep_decode.py on the
#: H200, batch 8 x 16k context; see docs/PERFORMANCE.md). ``waves`` sets the context split; ``rows``
#: pads the GQA group's query rows of a program (16: register-operand MMA; 64: Hopper's warpgroup MMA,
#: which takes at least 4 warps: a smaller ``num_warps`` is raised to 4 with it).
#: FP8 runs best as many one-warp programs: no cross-warp softmax reductions per key block.
DECODE_CONFIG = {
    "fp8": {"block_n": 64, "num_warps": 1, "num_stages": 1, "waves": 16, "rows": 16},
    "bf16": {"block_n": 64, "num_warps": 4, "num_stages": 2, "waves": 4, "rows": 16},
}


def decode_config(fp8: bool) -> dict:
    """:data:`DECODE_CONFIG`'s settings for FP8 pages or 16/32-bit pages."""
    return DECODE_CONFIG["fp8" if fp8 else "bf16"]


def decode_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int, sm_count: int = 132,
                  waves: float = 2) -> int:
    """How many context chunks per (sequence, KV head): enough programs for about ``waves`` waves
    of the GPU's multiprocessors, never chunks shorter than one key block."""
    want = max(1, math.ceil(waves * sm_count / max(1, batch * num_kv_heads)))
    return max(1, min(want, math.ceil(max(1, max_seq_len) / block_n)))


#: Most context chunks per (sequence, KV head). CUDA graphs size their split for the longest context
#: they allow; at batch 1 FP8's 16 waves would be 264 chunks, nearly all empty at a usual context,
#: each still writing a partial result that the merge reads: on the H200 that cost 38 us per layer
#: (TPOT 5.39 -> 6.77 ms at 1.7k tokens). 32 is what batch 8 x 16k uses anyway.
MAX_DECODE_SPLITS = 32


def default_decode_splits(batch: int, num_kv_heads: int, max_seq_len: int, fp8: bool) -> int:
    """:func:`decode_splits` under :func:`decode_config`, at most :data:`MAX_DECODE_SPLITS` (what
    :func:`paged_decode_attention` uses when ``num_splits`` is not given; CUDA graphs fix it at
    capture for their largest ``max_seq_len``)."""
    cfg = decode_config(fp8)
    return min(MAX_DECODE_SPLITS, decode_splits(batch, num_kv_heads, max_seq_len, cfg["block_n"], waves=cfg["waves"]))


def paged_decode_attention(
    q: torch.Tensor,
    cache: KVLayerCache,
    meta: AttentionMetadata,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    rows: int | None = None,
    dequant: str | None = None,
) -> torch.Tensor:
    """Triton flash-decoding version of :func:`ops.reference.paged_decode_attention`.

    Args:
        q: ``[B, Hq, D]``, one new token per sequence (already stored in the pages).
        cache, meta: as :func:`paged_attention`; only ``seq_lens`` and ``block_tables`` are read on
            the device (``max_seq_len`` only to choose ``num_splits``). A sequence of length 0
            (a padding row) gives zeros.
        num_splits: context chunks per sequence (fixed for CUDA-graph capture); None chooses by
            :func:`default_decode_splits`.
        block_n, num_warps, num_stages, rows: launch settings; None takes :func:`decode_config`'s.
        dequant: how FP8 pages are widened (see :data:`FP8_DEQUANT`, the default).

    Raises:
        ValueError: an unknown ``dequant``.

    Returns:
        ``[B, Hq, D]`` in ``q``'s dtype.
    """
    b, hq, d = q.shape
    hkv = cache.num_kv_heads
    g = hq // hkv
    cfg = decode_config(cache.is_fp8)
    block_n = block_n or cfg["block_n"]
    gp = max(rows or cfg["rows"], triton.next_power_of_2(g))
    warps = num_warps or cfg["num_warps"]
    if gp >= 64:
        warps = max(warps, 4)
    splits = num_splits or default_decode_splits(b, hkv, meta.max_seq_len, cache.is_fp8)
    part_o = torch.empty((b * hq * splits, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((b * hq * splits,), dtype=torch.float32, device=q.device)
    ks = cache.k_scale if cache.is_fp8 else cache.k_cache
    vs = cache.v_scale if cache.is_fp8 else cache.v_cache
    bd = triton.next_power_of_2(d)
    _decode_split_kernel[(b, hkv, splits)](
        q,
        part_o,
        part_lse,
        cache.k_cache,
        cache.v_cache,
        ks,
        vs,
        meta.seq_lens,
        meta.block_tables,
        q.stride(0),
        q.stride(1),
        meta.block_tables.stride(0),
        hkv,
        meta.softmax_scale(d),
        splits,
        G=g,
        GP=gp,
        D=d,
        BLOCK_D=bd,
        PAGE=cache.page_size,
        BLOCK_N=block_n,
        FP8=cache.is_fp8,
        IEEE=q.dtype == torch.float32,
        F16=cache.is_fp8 and q.dtype != torch.float32,
        ASM=_dequant_mode(q, cache, dequant or FP8_DEQUANT),
        num_warps=warps,
        num_stages=num_stages or cfg["num_stages"],
        **launch_args(q),
    )
    return merge_decode_partials(part_o, part_lse, q, splits)


def merge_decode_partials(part_o: torch.Tensor, part_lse: torch.Tensor, q: torch.Tensor, splits: int) -> torch.Tensor:
    """The split-K merge of the decode kernels (:func:`_decode_merge_kernel`, PDL as they launch) over
    partials ``[B * Hq * splits, D]`` / ``[B * Hq * splits]`` float32, by log-sum-exp; returns
    ``[B, Hq, D]`` in ``q``'s dtype."""
    b, hq, d = q.shape
    out = torch.empty_like(q)
    _decode_merge_kernel[(b, hq)](
        part_o,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        hq,
        splits,
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_S=triton.next_power_of_2(max(splits, MAX_DECODE_SPLITS)),  # one compile for every usual split
        **launch_args(q),
    )
    return out
