"""Slot and page moves over the KV pool: compaction (:func:`move_slots`) and copy-on-write
(:func:`copy_pages`), matching :mod:`ops.reference`. Rows are gathered first, then scattered, so
overlapping source and destination slots are safe."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..metadata import KVLayerCache


@triton.jit
def _gather_rows_kernel(src_ptr, idx_ptr, dst_ptr, n, row_elems, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(idx_ptr + i, mask=i < n, other=0).to(tl.int64)
    m = (i < n)[:, None] & (c < row_elems)[None, :]
    val = tl.load(src_ptr + row[:, None] * row_elems + c[None, :], mask=m)
    tl.store(dst_ptr + i[:, None] * row_elems + c[None, :], val, mask=m)


@triton.jit
def _scatter_rows_kernel(src_ptr, idx_ptr, dst_ptr, n, row_elems, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(idx_ptr + i, mask=i < n, other=0).to(tl.int64)
    m = (i < n)[:, None] & (c < row_elems)[None, :]
    val = tl.load(src_ptr + i[:, None] * row_elems + c[None, :], mask=m)
    tl.store(dst_ptr + row[:, None] * row_elems + c[None, :], val, mask=m)


def _move_rows(table: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``table[dst] = table[src]`` over its first dim, via a gathered copy (overlap-safe). A program
    moves a tile of ~2k elements: many short rows (one head's 128 FP8 bytes, or one 4-byte scale, in
    head-major pages) or part of a long one."""
    n = src.numel()
    if n == 0:
        return
    flat = table.view(table.shape[0], -1)
    if flat.dtype == torch.float8_e4m3fn:
        flat = flat.view(torch.uint8)
    elems = flat.shape[1]
    block = min(2048, triton.next_power_of_2(elems))
    rows = min(2048 // block, triton.next_power_of_2(n))
    tmp = torch.empty((n, elems), dtype=flat.dtype, device=flat.device)
    grid = (triton.cdiv(n, rows), triton.cdiv(elems, block))
    _gather_rows_kernel[grid](flat, src, tmp, n, elems, ROWS=rows, BLOCK=block)
    _scatter_rows_kernel[grid](tmp, dst, flat, n, elems, ROWS=rows, BLOCK=block)


def move_slots(cache: KVLayerCache, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Triton version of :func:`ops.reference.move_slots`: K/V and scales of ``src_slots`` move to
    ``dst_slots`` (int64 ``[N]``), correct when the two overlap."""
    # head-major pages: a slot is one row per KV head, page_size rows apart
    ps, hkv = cache.page_size, cache.num_kv_heads
    heads = torch.arange(hkv, device=src_slots.device) * ps

    def rows(slots: torch.Tensor) -> torch.Tensor:
        return ((slots // ps * hkv * ps + slots % ps)[:, None] + heads[None, :]).flatten()

    src, dst = rows(src_slots.long()), rows(dst_slots.long())
    for t in (cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale):
        if t is not None:
            _move_rows(t.view(cache.num_pages * hkv * ps, -1), src, dst)


def copy_pages(cache: KVLayerCache, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    """Triton version of :func:`ops.reference.copy_pages` (payload and scales of whole pages)."""
    for t in (cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale):
        if t is not None:
            _move_rows(t, src_pages, dst_pages)
