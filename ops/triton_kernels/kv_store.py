"""The KV store kernel: quantise a step's K and V per (token, KV head) to Scaled-FP8 and scatter
them into their page slots in one pass (:func:`ops.reference.store_kv` is its oracle)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..metadata import KVLayerCache
from ..pdl import launch_args, pdl_sync
from ..reference import AMAX_FLOOR, FP8_MAX, check_store_out


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    slot_ptr,
    ko_ptr,
    vo_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    num_kv_heads,
    amax_floor,
    fp8_max,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    PAGE: tl.constexpr,
    OUT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_sync(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    out = (t * num_kv_heads + h) * D + tl.arange(0, BLOCK_D)  # contiguous [T, Hkv, D] outputs
    if OUT:
        if slot < 0:  # a padding row: zeros, so that attending to it can give no NaN
            zero = tl.zeros([BLOCK_D], tl.float32)
            tl.store(ko_ptr + out, zero.to(ko_ptr.dtype.element_ty), mask=tl.arange(0, BLOCK_D) < D)
            tl.store(vo_ptr + out, zero.to(vo_ptr.dtype.element_ty), mask=tl.arange(0, BLOCK_D) < D)
    if slot >= 0:
        row = (slot // PAGE * num_kv_heads + h) * PAGE + slot % PAGE  # head-major pages
        d = tl.arange(0, BLOCK_D)
        m = d < D
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=m, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=m, other=0.0).to(tl.float32)
        dst = row * D + d
        if FP8:
            # correctly rounded divisions, as torch's, so scales and payload match the reference bit for bit
            ks = tl.math.div_rn(tl.maximum(tl.max(tl.abs(k), axis=0), amax_floor), fp8_max)
            vs = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=0), amax_floor), fp8_max)
            f8 = kc_ptr.dtype.element_ty
            kq = tl.clamp(tl.math.div_rn(k, ks), -fp8_max, fp8_max).to(f8, fp_downcast_rounding="rtne")
            vq = tl.clamp(tl.math.div_rn(v, vs), -fp8_max, fp8_max).to(f8, fp_downcast_rounding="rtne")
            tl.store(kc_ptr + dst, kq, mask=m)
            tl.store(vc_ptr + dst, vq, mask=m)
            tl.store(ks_ptr + row, ks)
            tl.store(vs_ptr + row, vs)
            if OUT:  # what the pages now hold, dequantised
                tl.store(ko_ptr + out, (kq.to(tl.float32) * ks).to(ko_ptr.dtype.element_ty), mask=m)
                tl.store(vo_ptr + out, (vq.to(tl.float32) * vs).to(vo_ptr.dtype.element_ty), mask=m)
        else:
            tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=m)
            tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=m)
            if OUT:
                kc = k.to(kc_ptr.dtype.element_ty).to(tl.float32)
                vc = v.to(vc_ptr.dtype.element_ty).to(tl.float32)
                tl.store(ko_ptr + out, kc.to(ko_ptr.dtype.element_ty), mask=m)
                tl.store(vo_ptr + out, vc.to(vo_ptr.dtype.element_ty), mask=m)


def store_kv(k: torch.Tensor, v: torch.Tensor, cache: KVLayerCache, slot_mapping: torch.Tensor,
             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Triton version of :func:`ops.reference.store_kv` (same arguments; no host sync, and of the
    arguments only ``out`` is checked).

    Args:
        k, v: ``[T, Hkv, D]`` model dtype, last dim contiguous.
        cache: the layer's pool (contiguous pages).
        slot_mapping: int64 ``[T]``; -1 rows are skipped.
        out: optional contiguous ``[T, Hkv, D]`` tensors that receive K and V as the pages hold them.

    Raises:
        ValueError: ``out`` not two contiguous tensors of ``k``'s shape.
    """
    t, hkv, d = k.shape
    check_store_out(k, out)
    if t == 0:
        return
    fp8 = cache.is_fp8
    ks = cache.k_scale if fp8 else cache.k_cache
    vs = cache.v_scale if fp8 else cache.v_cache
    ko, vo = out if out is not None else (k, v)
    _store_kv_kernel[(t, hkv)](
        k,
        v,
        cache.k_cache,
        cache.v_cache,
        ks,
        vs,
        slot_mapping,
        ko,
        vo,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        hkv,
        AMAX_FLOOR,
        FP8_MAX,
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
        FP8=fp8,
        PAGE=cache.page_size,
        OUT=out is not None,
        **launch_args(k),
    )
