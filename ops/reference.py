"""PyTorch reference implementations of the paged, Scaled-FP8 KV-cache operations.

These are the engine's CPU path and the oracle the Triton kernels are tested against, so they take the
same kernel-shaped inputs: a flat batch of new tokens, a flat slot mapping, block tables, sequence
lengths and per-token scales, with the step's attention metadata in one :class:`AttentionMetadata`.

Scaled-FP8 (E4M3) format, per token and KV head::

    amax  = max(|x| over head_dim, AMAX_FLOOR)          # float32
    scale = amax / 448                                  # float32, never zero
    q     = clamp(x.float() / scale, -448, 448).to(torch.float8_e4m3fn)   # round to nearest even
    x'    = q.float() * scale

A zero vector gets ``scale = AMAX_FLOOR / 448`` and round-trips to exact zeros. Attention dequantises
and accumulates in float32; outputs are cast back to the query dtype.

These functions validate their inputs and read a few values back to the host (``.tolist()``), which is
fine for a reference and for the CPU path; the GPU kernels must not.
"""

from __future__ import annotations

import torch

from .metadata import FP8_DTYPE, AttentionMetadata, KVLayerCache

#: Largest finite float8_e4m3fn magnitude.
FP8_MAX = 448.0

#: Floor on the per-(token, head) amax, so the scale is never zero (a zero vector stores zeros with
#: scale ``AMAX_FLOOR / 448`` ~ 2.2e-15, a normal float32).
AMAX_FLOOR = 1e-12


# --------------------------------------------------------------------------------------------------
# Quantisation
# --------------------------------------------------------------------------------------------------


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled-FP8 quantisation with one scale per row of the last dimension.

    Args:
        x: ``[T, H, D]`` (any leading shape works) floating point tensor.

    Returns:
        ``(x_fp8, scale)``: ``torch.float8_e4m3fn`` ``[T, H, D]`` and float32 ``[T, H]`` with
        ``scale = max(amax(|x|), AMAX_FLOOR) / 448``, a correctly rounded float32 division (a kernel
        must divide with round-to-nearest, e.g. Triton ``tl.math.div_rn``, to match bit for bit).

    Raises:
        TypeError: ``x`` is not a floating point tensor.
    """
    if not x.is_floating_point():
        raise TypeError(f"quantize_fp8 needs a floating point tensor, got {x.dtype}")
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    # Elementwise tensor / tensor division, correctly rounded on every device: dividing by the Python
    # scalar would let CUDA multiply by a rounded reciprocal instead (1-ulp different scales).
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(x_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``(x_fp8.float() * scale[..., None]).to(dtype)``.

    Args:
        x_fp8: ``[..., D]`` ``torch.float8_e4m3fn``.
        scale: float32 ``[...]`` (the leading shape of ``x_fp8``).
        dtype: result dtype.

    Raises:
        ValueError: the shapes disagree.
    """
    if scale.shape != x_fp8.shape[:-1]:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match {tuple(x_fp8.shape[:-1])}")
    return (x_fp8.float() * scale.float().unsqueeze(-1)).to(dtype)


# --------------------------------------------------------------------------------------------------
# Cache writes and page maintenance
# --------------------------------------------------------------------------------------------------


def _check_slots(cache: KVLayerCache, slots: torch.Tensor, what: str, allow_padding: bool) -> torch.Tensor:
    """Validate a 1-D int slot tensor; return a boolean mask of the non-padding entries."""
    if slots.dim() != 1 or slots.is_floating_point() or slots.dtype == torch.bool:
        raise ValueError(f"{what} must be a 1-D integer tensor, got {slots.dtype} {tuple(slots.shape)}")
    valid = slots >= 0 if allow_padding else torch.ones_like(slots, dtype=torch.bool)
    chosen = slots[valid]
    if chosen.numel():
        lo, hi = int(chosen.min()), int(chosen.max())
        if lo < 0 or hi >= cache.num_slots:
            raise ValueError(f"{what} out of range [0, {cache.num_slots}): min {lo}, max {hi}")
        if torch.unique(chosen).numel() != chosen.numel():
            raise ValueError(f"{what} has duplicate slots")
    return valid


def check_store_out(k: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Check :func:`store_kv`'s ``out``: None, or two contiguous tensors of ``k``'s shape.

    Raises:
        ValueError: otherwise.
    """
    if out is not None and any(o.shape != k.shape or not o.is_contiguous() for o in out):
        raise ValueError(f"out must be two contiguous tensors of k's shape {tuple(k.shape)}")


def store_kv(k: torch.Tensor, v: torch.Tensor, cache: KVLayerCache, slot_mapping: torch.Tensor,
             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write the step's new K/V into their slots (in place), quantising in FP8 mode.

    Args:
        k, v: ``[T, Hkv, D]`` keys / values, model dtype.
        cache: the layer's pool; in FP8 mode ``k_scale`` / ``v_scale`` are written too, in auto mode the
            values are copied (cast to the cache dtype, bit-exact when the dtypes match).
        slot_mapping: int ``[T]``; slot of each token, ``-1`` = skip that row.
        out: optional ``(k_out, v_out)``, contiguous ``[T, Hkv, D]``, filled with K and V as the pages
            now hold them, in ``k_out``'s dtype: FP8 pages dequantised (:func:`dequantize_fp8`, the
            float32 product rounded once), others the stored values; zeros on rows with slot -1.
            So attending to ``out`` reads the same numbers as attending to the pages.

    Raises:
        ValueError: shape mismatch, slot out of range, a slot repeated, or ``out`` of another shape.
    """
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"k and v must both be [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[1:] != (cache.num_kv_heads, cache.head_dim):
        raise ValueError(
            f"k/v heads and head_dim {tuple(k.shape[1:])} do not match the cache "
            f"{(cache.num_kv_heads, cache.head_dim)}"
        )
    if slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}, expected ({k.shape[0]},)")
    check_store_out(k, out)
    valid = _check_slots(cache, slot_mapping, "slot_mapping", allow_padding=True)
    slots = slot_mapping[valid].long()
    page, off = slots // cache.page_size, slots % cache.page_size
    k, v = k[valid], v[valid]
    if cache.is_fp8:
        kq, ks = quantize_fp8(k)
        vq, vs = quantize_fp8(v)
        # [page, :, off] indexes [N, Hkv, ...]: the advanced indices' dim comes first
        _raw(cache.k_cache)[page, :, off] = _raw(kq)
        _raw(cache.v_cache)[page, :, off] = _raw(vq)
        cache.k_scale[page, :, off] = ks
        cache.v_scale[page, :, off] = vs
        held = (kq, ks), (vq, vs)
    else:
        cache.k_cache[page, :, off] = k.to(cache.k_cache.dtype)
        cache.v_cache[page, :, off] = v.to(cache.v_cache.dtype)
        held = k.to(cache.k_cache.dtype), v.to(cache.v_cache.dtype)
    if out is not None:
        for o, h in zip(out, held, strict=True):
            o.zero_()
            o[valid] = (dequantize_fp8(*h) if cache.is_fp8 else h.float()).to(o.dtype)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as a uint8 view (bit-identical; indexing float8 is not supported everywhere)."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _gather(t: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
    """``t[index]`` for any dtype, FP8 included."""
    return _raw(t)[index].view(t.dtype)


def _layer_tensors(cache: KVLayerCache) -> list[torch.Tensor]:
    """The pool tensors of a layer (FP8 payload as uint8 views), for bitwise page / slot copies."""
    out = [_raw(cache.k_cache), _raw(cache.v_cache)]
    if cache.is_fp8:
        out += [cache.k_scale, cache.v_scale]
    return out


def copy_pages(cache: KVLayerCache, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    """Copy whole pages (payload and, in FP8 mode, scales) ``src_pages[i] -> dst_pages[i]`` in place.

    Used for copy-on-write of a partly filled shared last page. All sources are read before any
    destination is written, so chains like ``[1, 2] -> [2, 3]`` copy the *old* page 2.

    Args:
        cache: the layer's pool.
        src_pages, dst_pages: int64 ``[N]`` page indices; destinations must be distinct.

    Raises:
        ValueError: lengths differ, an index is out of range, or a destination repeats.
    """
    if src_pages.shape != dst_pages.shape or src_pages.dim() != 1:
        raise ValueError(f"src_pages {tuple(src_pages.shape)} and dst_pages {tuple(dst_pages.shape)} must be equal 1-D")
    if src_pages.numel() == 0:
        return
    for what, pages in (("src_pages", src_pages), ("dst_pages", dst_pages)):
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 0 or hi >= cache.num_pages:
            raise ValueError(f"{what} out of range [0, {cache.num_pages}): min {lo}, max {hi}")
    if torch.unique(dst_pages).numel() != dst_pages.numel():
        raise ValueError("dst_pages has duplicate pages")
    src, dst = src_pages.long(), dst_pages.long()
    for t in _layer_tensors(cache):
        t[dst] = t[src]  # advanced-index read makes a copy first


def move_slots(cache: KVLayerCache, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Move individual tokens' K/V (and FP8 scales) ``src_slots[i] -> dst_slots[i]`` in place.

    Used to compact a prefix (kept tokens moved to the front). Overlap between the source and
    destination sets is allowed: every source is read before any destination is written. Source slots
    that are not overwritten keep their (now stale) contents.

    Args:
        cache: the layer's pool.
        src_slots, dst_slots: int64 ``[N]`` slots (no -1); destinations must be distinct.

    Raises:
        ValueError: lengths differ, a slot is out of range, or a destination repeats.
    """
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 1:
        raise ValueError(f"src_slots {tuple(src_slots.shape)} and dst_slots {tuple(dst_slots.shape)} must be equal 1-D")
    if src_slots.numel() == 0:
        return
    _check_slots(cache, dst_slots, "dst_slots", allow_padding=False)
    lo, hi = int(src_slots.min()), int(src_slots.max())
    if lo < 0 or hi >= cache.num_slots:
        raise ValueError(f"src_slots out of range [0, {cache.num_slots}): min {lo}, max {hi}")
    ps = cache.page_size
    src, dst = src_slots.long(), dst_slots.long()
    sp, so, dp, do = src // ps, src % ps, dst // ps, dst % ps
    for t in _layer_tensors(cache):
        t[dp, :, do] = t[sp, :, so]  # gather (a copy) before scatter


# --------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------


def _check_attention_inputs(q: torch.Tensor, cache: KVLayerCache) -> int:
    """Validate q against the cache; return the GQA group size Hq // Hkv."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {tuple(q.shape)}")
    if q.shape[2] != cache.head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {cache.head_dim}")
    if q.shape[1] % cache.num_kv_heads:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of KV heads {cache.num_kv_heads}")
    return q.shape[1] // cache.num_kv_heads


def _gather_kv(cache: KVLayerCache, pages: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float32 K, V ``[length, Hkv, D]`` of the first ``length`` positions held by ``pages``."""
    hkv, d = cache.num_kv_heads, cache.head_dim
    pages = pages.long()
    # [n, Hkv, page, D] -> token-major [n * page, Hkv, D]
    k = _gather(cache.k_cache, pages).transpose(1, 2).reshape(-1, hkv, d)[:length]
    v = _gather(cache.v_cache, pages).transpose(1, 2).reshape(-1, hkv, d)[:length]
    if cache.is_fp8:
        k = dequantize_fp8(k, cache.k_scale[pages].transpose(1, 2).reshape(-1, hkv)[:length])
        v = dequantize_fp8(v, cache.v_scale[pages].transpose(1, 2).reshape(-1, hkv)[:length])
    return k.float(), v.float()


def _pages_of(cache: KVLayerCache, table_row: torch.Tensor, seq_len: int, b: int) -> torch.Tensor:
    """The first ``ceil(seq_len / page_size)`` entries of a block-table row, validated."""
    n = -(-seq_len // cache.page_size)
    if n > table_row.shape[0]:
        raise ValueError(f"sequence {b}: seq_len {seq_len} needs {n} pages, block table has {table_row.shape[0]}")
    pages = table_row[:n]
    if n and (int(pages.min()) < 0 or int(pages.max()) >= cache.num_pages):
        raise ValueError(f"sequence {b}: block table entries {pages.tolist()} out of range [0, {cache.num_pages})")
    return pages


def paged_attention(q: torch.Tensor, cache: KVLayerCache, meta: AttentionMetadata) -> torch.Tensor:
    """Varlen causal GQA attention of a flat batch over each sequence's paged K/V.

    Serves prefill (with or without cached pages), chunked prefill and decode. The step's K/V must
    already be stored (:func:`store_kv`). Sequence ``b``'s new tokens are the last ``query_len_b`` of its
    ``seq_len_b`` tokens: new token ``j`` (0-based within the step) attends to KV positions
    ``0 .. seq_len_b - query_len_b + j`` inclusive, position ``p`` living at slot
    ``block_tables[b, p // page_size] * page_size + p % page_size``. Query head ``h`` reads KV head
    ``h // (Hq // Hkv)``. Scores, softmax and the weighted sum are float32 (K/V dequantised in FP8
    mode).

    Args:
        q: ``[T, Hq, D]`` queries, model dtype.
        cache: the layer's pool.
        meta: the step's metadata (``query_start_loc``, ``seq_lens``, ``block_tables``, ``scale``).

    Returns:
        ``[T, Hq, D]`` in ``q.dtype``; rows past ``query_start_loc[B]`` (padding) are zero.

    Raises:
        ValueError: shape mismatch, ``query_len > seq_len``, a block table too short for ``seq_len`` or
            with out-of-range pages, or ``query_start_loc[B] > T``.
    """
    group = _check_attention_inputs(q, cache)
    scale = meta.softmax_scale(q.shape[2])
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    if len(starts) != len(seq_lens) + 1 or meta.block_tables.shape[0] != len(seq_lens):
        raise ValueError("query_start_loc must have B + 1 entries and block_tables B rows, B = len(seq_lens)")
    if starts[-1] > q.shape[0]:
        raise ValueError(f"query_start_loc ends at {starts[-1]} but q has {q.shape[0]} rows")
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, seq_len in enumerate(seq_lens):
        q0, q1 = starts[b], starts[b + 1]
        qlen = q1 - q0
        if qlen < 0 or qlen > seq_len:
            raise ValueError(f"sequence {b}: need 0 <= query_len ({qlen}) <= seq_len ({seq_len})")
        if qlen == 0:
            continue
        k, v = _gather_kv(cache, _pages_of(cache, meta.block_tables[b], seq_len, b), seq_len)
        k = k.repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q[q0:q1].float(), k) * scale  # [Hq, qlen, S]
        last_visible = seq_len - qlen + torch.arange(qlen, device=q.device)  # [qlen]
        mask = torch.arange(seq_len, device=q.device)[None, :] > last_visible[:, None]  # [qlen, S]
        scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hts,shd->thd", probs, v)
    return out.to(q.dtype)


def paged_decode_attention(q: torch.Tensor, cache: KVLayerCache, meta: AttentionMetadata) -> torch.Tensor:
    """Decode step: one new token per sequence attends to all ``seq_len_b`` stored positions.

    Same math as :func:`paged_attention` (equal results up to float32 summation order), computed
    batched over sequences: the block tables gather a padded ``[B, P * page_size, Hkv, D]`` K/V and
    positions ``>= seq_len_b`` are masked.

    Args:
        q: ``[B, Hq, D]`` queries, model dtype, row ``b`` belonging to sequence ``b``.
        cache: the layer's pool (the step's K/V already stored).
        meta: decode-only metadata (``query_start_loc == arange(B + 1)``).

    Returns:
        ``[B, Hq, D]`` in ``q.dtype``.

    Raises:
        ValueError: the metadata is not decode-only, ``q`` has not B rows, a ``seq_len`` is < 1, or a
            block table is too short / out of range.
    """
    group = _check_attention_inputs(q, cache)
    bsz = meta.num_seqs
    if q.shape[0] != bsz:
        raise ValueError(f"decode q has {q.shape[0]} rows, expected one per sequence ({bsz})")
    expected = torch.arange(bsz + 1, device=meta.query_start_loc.device)
    if meta.query_start_loc.shape != expected.shape or not torch.equal(meta.query_start_loc.long(), expected):
        raise ValueError("paged_decode_attention needs exactly one new token per sequence (decode-only metadata)")
    if bsz == 0:
        return q.new_zeros(q.shape)
    seq_lens = meta.seq_lens.long().to(q.device)
    if int(seq_lens.min()) < 1:
        raise ValueError("every decoding sequence needs seq_len >= 1")
    ps, hkv, d = cache.page_size, cache.num_kv_heads, cache.head_dim
    num_pages = -(-int(seq_lens.max()) // ps)
    if num_pages > meta.block_tables.shape[1]:
        raise ValueError(
            f"seq_len {int(seq_lens.max())} needs {num_pages} pages, block tables have {meta.block_tables.shape[1]}"
        )
    table = meta.block_tables[:, :num_pages].long().to(q.device)  # [B, P]
    pos = torch.arange(num_pages * ps, device=q.device)
    valid = pos[None, :] < seq_lens[:, None]  # [B, S]
    needed = (torch.arange(num_pages, device=q.device)[None, :] * ps) < seq_lens[:, None]  # [B, P]
    used = table[needed]
    if int(used.min()) < 0 or int(used.max()) >= cache.num_pages:
        raise ValueError(f"block table entries out of range [0, {cache.num_pages})")
    table = torch.where(needed, table, torch.zeros_like(table))  # padding entries read page 0, masked
    # [B, P, Hkv, page, D] -> token-major [B, P * page, Hkv, D]
    k = _gather(cache.k_cache, table).transpose(2, 3).reshape(bsz, -1, hkv, d)
    v = _gather(cache.v_cache, table).transpose(2, 3).reshape(bsz, -1, hkv, d)
    if cache.is_fp8:
        k = dequantize_fp8(k, cache.k_scale[table].transpose(2, 3).reshape(bsz, -1, hkv))
        v = dequantize_fp8(v, cache.v_scale[table].transpose(2, 3).reshape(bsz, -1, hkv))
    # Positions past seq_len may hold garbage (even NaN/inf in never-written slots): zero them so that
    # 0-probability * garbage cannot poison the sum.
    k = torch.where(valid[:, :, None, None], k.float(), 0.0)
    v = torch.where(valid[:, :, None, None], v.float(), 0.0)
    qg = q.float().reshape(bsz, hkv, group, d)  # query head h = kv * group + g
    scores = torch.einsum("bkgd,bskd->bkgs", qg, k) * meta.softmax_scale(d)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgs,bskd->bkgd", probs, v)
    return out.reshape(q.shape).to(q.dtype)


# --------------------------------------------------------------------------------------------------
# Decode attention on the FP8 matrix units: the math of ops.triton_kernels.fp8_decode
# --------------------------------------------------------------------------------------------------
#
# The kernel keeps both products in FP8 instead of widening every stored K/V element:
#
#   1. Q is quantised per (token, query head) per step, as the pages are (:func:`quantize_fp8`):
#      ``q ~ q_fp8 * q_scale``. Optionally (``q_terms=2``, :func:`quantize_q_fp8`) in two terms,
#      ``q ~ q_hi * s_hi + q_lo * s_lo`` with the second quantising the first's residual: two FP8
#      products per key block instead of one, and Q's rounding error ~2^-4 smaller.
#   2. Logits come from the raw FP8 payloads, the scales folded in afterwards (:func:`fp8_logits`):
#      ``s[r, n] = (q_fp8[r] . k_fp8[n]) * q_scale[r] * k_scale[n] * softmax_scale``.
#   3. Online softmax over blocks of ``block_n`` keys, float32 (as the current kernel).
#   4. PV, two variants:
#      * ``p_fp8=True``: each block's ``P * v_scale`` (per key) is quantised to E4M3 with one scale per
#        query row (:func:`quantize_p_fp8`), and ``P_fp8 @ V_fp8`` runs on FP8 operands, times the row scale;
#      * ``p_fp8=False``: ``P * v_scale / max(v_scale)`` in float16 against V widened to float16
#        (:func:`widen_p16`), times ``max(v_scale)`` (what the current kernel does for PV).
#   5. Split-K (flash-decoding): the context is cut into ``num_splits`` chunks of whole key blocks,
#      each gives a partial output and its log-sum-exp, merged by :func:`lse_merge`.
#
# Error sources against float32 attention over the same pages: Q's rounding to E4M3 (3 mantissa bits,
# relative <= 2^-4 per element, averaging out over head_dim in the dot; as large as K's own storage
# rounding, so one-term Q about doubles the logit error of FP8 pages) and, with ``p_fp8``, P's
# rounding to E4M3 (relative <= 2^-4 per probability; probabilities below ~2^-9 / 448 of their
# row's largest in a block flush to zero). The measured bounds are in tests/test_fp8_mma_reference.py.


def quantize_q_fp8(q: torch.Tensor, terms: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Queries in E4M3, per (token, head), in one or two terms.

    Term 1 is :func:`quantize_fp8` of ``q``; term 2 (``terms=2``) is :func:`quantize_fp8` of the
    float32 residual ``q - dequantize_fp8(term 1)``. The logits are the sum of each term's
    :func:`fp8_logits`.

    Args:
        q: ``[..., D]`` floating point queries.
        terms: 1 or 2.

    Returns:
        ``terms`` pairs ``(q_fp8, q_scale)``: ``torch.float8_e4m3fn`` ``[..., D]``, float32 ``[...]``.

    Raises:
        ValueError: ``terms`` is not 1 or 2.
    """
    if terms not in (1, 2):
        raise ValueError(f"Q is quantised in 1 or 2 terms, not {terms}")
    out = [quantize_fp8(q)]
    if terms == 2:
        out.append(quantize_fp8(q.float() - dequantize_fp8(*out[0])))
    return out


def fp8_logits(q_fp8: torch.Tensor, q_scale: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor,
               softmax_scale: float) -> torch.Tensor:
    """Scaled attention logits from FP8 payloads, the per-row scales folded in after the product.

    The products of two E4M3 values are exact in float32 (4 significant bits each) and the sums
    nearly so (float32 accumulation), as an FP8 MMA with a float32 accumulator computes them.

    Args:
        q_fp8: ``[..., R, D]`` ``torch.float8_e4m3fn`` query payload (R query rows).
        q_scale: float32 ``[..., R]``, the rows' scales (:func:`quantize_fp8`).
        k_fp8: ``[..., N, D]`` ``torch.float8_e4m3fn`` key payload.
        k_scale: float32 ``[..., N]``, the keys' scales as stored.
        softmax_scale: the logit scale (usually ``D ** -0.5``).

    Returns:
        float32 ``[..., R, N]``: ``(q_fp8 . k_fp8) * (q_scale * softmax_scale)[:, None] * k_scale[None, :]``.
    """
    dots = torch.matmul(q_fp8.float(), k_fp8.float().transpose(-1, -2))
    return dots * (q_scale.float() * softmax_scale).unsqueeze(-1) * k_scale.float().unsqueeze(-2)


def quantize_p_fp8(p: torch.Tensor, v_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold V's per-key scales into probabilities and quantise them to E4M3, one scale per row.

    ``x = p * v_scale[None, :]``; ``amax = max(max_n x, AMAX_FLOOR)`` per row; payload
    ``min(x * (448 / amax), 448)`` rounded to nearest even; ``p_scale = amax / 448``. Then
    ``(p_fp8.float() * p_scale[:, None]) @ v_fp8.float()`` approximates ``p @ (v_fp8 * v_scale)``.
    Unlike :func:`quantize_fp8` the payload multiplies by the reciprocal (one division per row, as
    the kernel does), which differs from the correctly rounded quotient by at most one float32 ulp
    before the E4M3 rounding.

    Args:
        p: float32 ``[..., R, N]``, non-negative (unnormalised softmax numerators, at most 1).
        v_scale: float32 ``[..., N]``, the keys' V scales (0 on masked keys).

    Returns:
        ``(p_fp8, p_scale)``: ``torch.float8_e4m3fn`` ``[..., R, N]`` and float32 ``[..., R]``.
    """
    x = p.float() * v_scale.float().unsqueeze(-2)
    amax = x.amax(dim=-1).clamp(min=AMAX_FLOOR)
    inv = torch.full_like(amax, FP8_MAX) / amax
    p_fp8 = (x * inv.unsqueeze(-1)).clamp(max=FP8_MAX).to(FP8_DTYPE)
    return p_fp8, amax / torch.full_like(amax, FP8_MAX)


def widen_p16(p: torch.Tensor, v_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 16-bit PV alternative: V's scales folded into P, relative to the block's largest.

    Args:
        p: float32 ``[..., R, N]``, in ``[0, 1]``.
        v_scale: float32 ``[..., N]`` (0 on masked keys).

    Returns:
        ``(p16, v_max)``: float16 ``[..., R, N]`` ``= p * (v_scale / v_max)`` (in ``[0, 1]``) and float32
        ``[...]`` ``v_max = max(max_n v_scale, 1e-30)``; ``(p16.float() @ v_fp8.float()) * v_max``
        approximates ``p @ (v_fp8 * v_scale)``.
    """
    v_max = v_scale.float().amax(dim=-1).clamp(min=1e-30)
    return (p.float() * (v_scale.float() / v_max.unsqueeze(-1)).unsqueeze(-2)).to(torch.float16), v_max


def lse_merge(o_parts: torch.Tensor, lse_parts: torch.Tensor) -> torch.Tensor:
    """Merge split-K partial attention outputs by their log-sum-exp.

    Args:
        o_parts: float32 ``[..., S, D]``, each split's normalised output (zeros for an empty split).
        lse_parts: float32 ``[..., S]``, each split's ``log(sum(exp(logits)))`` over its keys
            (``-inf`` for an empty split).

    Returns:
        float32 ``[..., D]``: ``sum_s w_s o_s`` with ``w = softmax(lse)`` over the splits; zeros where
        every split is empty.
    """
    m = lse_parts.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse_parts - m)
    w = w / w.sum(dim=-1, keepdim=True).clamp(min=1e-30)
    return (o_parts * w.unsqueeze(-1)).sum(dim=-2)


def fp8_decode_splits(seq_len: int, num_splits: int, block_n: int) -> list[tuple[int, int]]:
    """The key ranges ``[lo, hi)`` of a sequence's ``num_splits`` context chunks, as the decode
    kernels cut them: ``ceil(ceil(seq_len / num_splits) / block_n) * block_n`` keys each (whole key
    blocks), the last ones possibly empty (``lo >= hi``)."""
    chunk = -(-seq_len // num_splits)
    split_len = -(-chunk // block_n) * block_n
    return [(sp * split_len, min(sp * split_len + split_len, seq_len)) for sp in range(num_splits)]


def paged_decode_attention_fp8_mma(q: torch.Tensor, cache: KVLayerCache, meta: AttentionMetadata, *,
                                   p_fp8: bool = True, num_splits: int = 1, block_n: int = 64,
                                   q_terms: int = 1) -> torch.Tensor:
    """Decode attention over FP8 pages as the FP8-MMA kernel computes it (the section's math above).

    Q is quantised per (token, head) (:func:`quantize_q_fp8`, ``q_terms`` terms); per sequence and KV
    head, keys are read in blocks of ``block_n`` inside each of ``num_splits`` chunks
    (:func:`fp8_decode_splits`); each block's logits come from :func:`fp8_logits`, softmax is online in
    float32 (running max ``m``, sum ``l``, rescaled accumulator), PV from :func:`quantize_p_fp8`
    (``p_fp8``) or :func:`widen_p16`; the chunks merge by :func:`lse_merge`. The sum ``l`` is of the
    unquantised probabilities. Loops over sequences, chunks and blocks in Python: a test oracle for
    small shapes, not a CPU path.

    Args:
        q: ``[B, Hq, D]`` queries, one per sequence, any float dtype.
        cache: the layer's pool, FP8 (the step's K/V already stored).
        meta: decode-only metadata (``seq_lens``, ``block_tables``, ``scale``).
        p_fp8: P in E4M3 against V's payload (True) or float16 against V widened (False).
        num_splits: context chunks per sequence (>= 1).
        block_n: keys per block (>= 1).
        q_terms: 1 or 2 (:func:`quantize_q_fp8`).

    Returns:
        ``[B, Hq, D]`` in ``q.dtype``; a sequence of length 0 gives zeros.

    Raises:
        ValueError: the cache is not FP8, ``q`` does not match it or has not one row per sequence,
            ``num_splits`` or ``block_n`` < 1, ``q_terms`` not 1 or 2, or a block table is too short /
            out of range.
    """
    if not cache.is_fp8:
        raise ValueError("paged_decode_attention_fp8_mma needs FP8 pages")
    group = _check_attention_inputs(q, cache)
    if num_splits < 1 or block_n < 1:
        raise ValueError(f"num_splits ({num_splits}) and block_n ({block_n}) must be >= 1")
    bsz = meta.num_seqs
    if q.shape[0] != bsz:
        raise ValueError(f"decode q has {q.shape[0]} rows, expected one per sequence ({bsz})")
    hkv, d = cache.num_kv_heads, cache.head_dim
    sm_scale = meta.softmax_scale(d)
    terms = [(q8.reshape(bsz, hkv, group, d), qs.reshape(bsz, hkv, group))
             for q8, qs in quantize_q_fp8(q, q_terms)]  # each [B, Hkv, G, D], [B, Hkv, G]
    out = torch.zeros(bsz, hkv, group, d, dtype=torch.float32, device=q.device)
    for b, seq_len in enumerate(meta.seq_lens.tolist()):
        if seq_len <= 0:
            continue
        pages = _pages_of(cache, meta.block_tables[b], seq_len, b).long()
        # [n, Hkv, page, D] -> head-first [Hkv, n * page, D]
        k8 = _gather(cache.k_cache, pages).transpose(0, 1).reshape(hkv, -1, d)[:, :seq_len]
        v8 = _gather(cache.v_cache, pages).transpose(0, 1).reshape(hkv, -1, d)[:, :seq_len]
        ks = cache.k_scale[pages].transpose(0, 1).reshape(hkv, -1)[:, :seq_len]
        vs = cache.v_scale[pages].transpose(0, 1).reshape(hkv, -1)[:, :seq_len]
        o_parts, lse_parts = [], []
        for lo, hi in fp8_decode_splits(seq_len, num_splits, block_n):
            m = torch.full((hkv, group), float("-inf"), device=q.device)
            l_sum = torch.zeros(hkv, group, device=q.device)
            acc = torch.zeros(hkv, group, d, device=q.device)
            for n0 in range(lo, hi, block_n):
                n1 = min(n0 + block_n, hi)
                s = sum(fp8_logits(q8[b], qs[b], k8[:, n0:n1], ks[:, n0:n1], sm_scale)
                        for q8, qs in terms)  # [Hkv, G, n]
                m_new = torch.maximum(m, s.amax(dim=-1))
                p = torch.exp(s - m_new.unsqueeze(-1))
                alpha = torch.exp(m - m_new)
                l_sum = l_sum * alpha + p.sum(dim=-1)
                if p_fp8:
                    p_q, p_scale = quantize_p_fp8(p, vs[:, n0:n1])
                    pv = torch.matmul(p_q.float(), v8[:, n0:n1].float()) * p_scale.unsqueeze(-1)
                else:
                    p_q, v_max = widen_p16(p, vs[:, n0:n1])
                    pv = torch.matmul(p_q.float(), v8[:, n0:n1].float()) * v_max[:, None, None]
                acc = acc * alpha.unsqueeze(-1) + pv
                m = m_new
            empty = l_sum == 0
            o_parts.append(acc / torch.where(empty, 1.0, l_sum).unsqueeze(-1))
            lse_parts.append(torch.where(empty, float("-inf"), m + torch.log(torch.where(empty, 1.0, l_sum))))
        out[b] = lse_merge(torch.stack(o_parts, dim=-2), torch.stack(lse_parts, dim=-1))
    return out.reshape(q.shape).to(q.dtype)
