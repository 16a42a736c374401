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
