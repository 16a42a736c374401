"""Tests of the PyTorch reference paged / Scaled-FP8 KV-cache ops (CPU, fast)."""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass

import pytest
import torch

from ops import (
    AMAX_FLOOR,
    FP8_DTYPE,
    AttentionMetadata,
    KVLayerCache,
    copy_pages,
    dequantize_fp8,
    kv_bytes_per_token,
    move_slots,
    paged_attention,
    paged_decode_attention,
    quantize_fp8,
    store_kv,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tests run hundreds of tiny ops; intra-op threads only add overhead (and contention)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------------------------------
# Helpers: a random paged batch and a plain float64 oracle
# --------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    cache: KVLayerCache
    meta: AttentionMetadata
    q: torch.Tensor  # [T, Hq, D]
    k_full: list[torch.Tensor]  # per sequence [seq_len, Hkv, D] (the unquantised K actually stored)
    v_full: list[torch.Tensor]
    tables: list[list[int]]
    seqs: list[tuple[int, int]]  # (cached, new)


def make_batch(
    seqs: list[tuple[int, int]],
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    group: int,
    kv_dtype: str,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_pages: int = 5,
    pad_rows: int = 0,
    kv_fn=None,
) -> Batch:
    """Sequences ``(cached, new)`` on shuffled pages; the cached part is stored first, then the step's.

    The pool is filled with NaN before use in auto mode (and garbage FP8 in fp8 mode) so that reading an
    unwritten slot shows up in the result.
    """
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil((c + n) / page_size) for c, n in seqs]
    num_pages = sum(need) + spare_pages
    cache = KVLayerCache.allocate(num_pages, page_size, num_kv_heads, head_dim, kv_dtype, dtype)
    if cache.is_fp8:
        cache.k_cache.view(torch.uint8).fill_(0x7F)  # NaN bit pattern in E4M3FN
        cache.v_cache.view(torch.uint8).fill_(0x7F)
        cache.k_scale.fill_(float("nan"))
        cache.v_scale.fill_(float("nan"))
    else:
        cache.k_cache.fill_(float("nan"))
        cache.v_cache.fill_(float("nan"))
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables, k_full, v_full, slots_new, q_rows = [], [], [], [], []
    for (cached, new), n in zip(seqs, need, strict=True):
        pages, perm = perm[:n], perm[n:]
        tables.append(pages)
        s = cached + new
        if kv_fn is None:
            k = torch.randn(s, num_kv_heads, head_dim, generator=g)
            v = torch.randn(s, num_kv_heads, head_dim, generator=g)
        else:
            k, v = kv_fn(s, num_kv_heads, head_dim, g)
        k, v = k.to(dtype), v.to(dtype)
        k_full.append(k)
        v_full.append(v)
        slots = [pages[p // page_size] * page_size + p % page_size for p in range(s)]
        if cached:
            store_kv(k[:cached], v[:cached], cache, torch.tensor(slots[:cached]))
        slots_new += slots[cached:]
        q_rows.append(torch.randn(new, num_kv_heads * group, head_dim, generator=g))
    meta = AttentionMetadata.build([n for _, n in seqs], [c + n for c, n in seqs], tables, slots_new, device="cpu")
    k_new = torch.cat([k[c:] for k, (c, _) in zip(k_full, seqs, strict=True)])
    v_new = torch.cat([v[c:] for v, (c, _) in zip(v_full, seqs, strict=True)])
    q = torch.cat(q_rows).to(dtype)
    if pad_rows:  # padding rows of the flat batch: slot -1, output must be zero
        hkv, hq = num_kv_heads, num_kv_heads * group
        k_new = torch.cat([k_new, torch.randn(pad_rows, hkv, head_dim, generator=g).to(dtype)])
        v_new = torch.cat([v_new, torch.randn(pad_rows, hkv, head_dim, generator=g).to(dtype)])
        q = torch.cat([q, torch.randn(pad_rows, hq, head_dim, generator=g).to(dtype)])
        meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((pad_rows,), -1, dtype=torch.int64)])
    store_kv(k_new, v_new, cache, meta.slot_mapping)
    return Batch(cache, meta, q, k_full, v_full, tables, seqs)


def tok(t: torch.Tensor) -> torch.Tensor:
    """A pool tensor ``[pages, Hkv, page_size, ...]`` (head-major pages) seen token-major:
    ``[pages, page_size, Hkv, ...]``, so ``tok(t)[page, offset]`` is one slot's heads."""
    return t.transpose(1, 2)


def dense_from_cache(cache: KVLayerCache, table: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 dequantised K, V ``[seq_len, Hkv, D]`` read position by position (independent of the ops)."""
    ps = cache.page_size
    ks, vs = [], []
    for p in range(seq_len):
        page, off = table[p // ps], p % ps
        k, v = tok(cache.k_cache)[page, off].double(), tok(cache.v_cache)[page, off].double()
        if cache.is_fp8:
            k = k * tok(cache.k_scale)[page, off].double()[:, None]
            v = v * tok(cache.v_scale)[page, off].double()[:, None]
        ks.append(k)
        vs.append(v)
    return torch.stack(ks), torch.stack(vs)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Plain float64 causal GQA attention of one sequence whose new tokens are the last ``len(q)`` of ``k``."""
    t, hq, d = q.shape
    s, hkv, _ = k.shape
    group = hq // hkv
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros(t, hq, d, dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for j in range(t):
            visible = s - t + j + 1
            scores = (kh[:visible] @ q[j, h].double()) * scale
            w = torch.softmax(scores, dim=0)
            out[j, h] = w @ vh[:visible]
    return out


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """Float64 values of ``x`` ``[S, Hkv, D]`` after Scaled-FP8 storage, worked out here from the
    definition instead of read back from pages the code under test wrote: per (token, head)
    ``scale = max(amax |x|, AMAX_FLOOR) / 448`` rounded once to float32 (a float64 quotient of two
    floats rounded to float32 is the correctly rounded float32 quotient), payload = E4M3 of
    ``x / scale`` (correctly rounded the same way, clamped to +-448, torch's round-to-nearest cast),
    value = payload x scale."""
    fp8_max = torch.finfo(FP8_DTYPE).max
    xf = x.float()
    scale = (xf.abs().amax(dim=-1).clamp(min=AMAX_FLOOR).double() / fp8_max).float().double()
    payload = (xf.double() / scale[..., None]).float().clamp(-fp8_max, fp8_max).to(FP8_DTYPE)
    return payload.double() * scale[..., None]


def oracle(batch: Batch, dequantised: bool = True) -> torch.Tensor:
    """Oracle output of the whole flat batch, from the K/V the batch was made of: as the cache should
    hold them (FP8: :func:`fp8_round_trip`; auto: the values themselves), or unquantised. Nothing is
    read from the cache, so a store that writes wrong pages or scales shows up as a wrong output."""
    outs = []
    start = 0
    for b, (_, new) in enumerate(batch.seqs):
        k, v = batch.k_full[b], batch.v_full[b]
        if dequantised and batch.cache.is_fp8:
            k, v = fp8_round_trip(k), fp8_round_trip(v)
        outs.append(naive_attention(batch.q[start : start + new], k, v, batch.meta.scale))
        start += new
    return torch.cat(outs)


SCENARIOS = {
    "b1_fresh_1": [(0, 1)],
    "b1_decode_17": [(16, 1)],
    "b1_prefill_33": [(0, 33)],
    "b1_chunk_50": [(17, 33)],
    "b3_mixed": [(20, 7), (40, 1), (0, 13)],
    "b3_decode": [(16, 1), (32, 1), (49, 1)],
    "b3_prefill": [(0, 1), (0, 17), (0, 50)],
}
DECODE_SCENARIOS = {"b1_fresh_1", "b1_decode_17", "b3_decode"}


# --------------------------------------------------------------------------------------------------
# Attention versus the oracle
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("page_size", [16, 4])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_paged_attention_matches_oracle(scenario, page_size, head_dim, group, kv_dtype):
    seed = zlib.crc32(f"{scenario}-{page_size}-{head_dim}-{group}-{kv_dtype}".encode()) % 1000
    batch = make_batch(SCENARIOS[scenario], page_size, 2, head_dim, group, kv_dtype, seed=seed)
    out = paged_attention(batch.q, batch.cache, batch.meta)
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    ref = oracle(batch, dequantised=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    if scenario in DECODE_SCENARIOS:
        assert batch.meta.is_decode_only
        dec = paged_decode_attention(batch.q, batch.cache, batch.meta)
        torch.testing.assert_close(dec, out, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(dec.double(), ref, atol=1e-5, rtol=1e-5)
    else:
        assert not batch.meta.is_decode_only


def test_custom_softmax_scale():
    batch = make_batch(SCENARIOS["b3_mixed"], 4, 2, 16, 2, "fp8", seed=3)
    batch.meta.scale = 0.3
    torch.testing.assert_close(
        paged_attention(batch.q, batch.cache, batch.meta).double(), oracle(batch), atol=1e-5, rtol=1e-5
    )


def test_padding_rows_output_zero_and_not_stored():
    batch = make_batch(SCENARIOS["b3_mixed"], 4, 2, 16, 2, "auto", seed=4, pad_rows=3)
    out = paged_attention(batch.q, batch.cache, batch.meta)
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))
    torch.testing.assert_close(out[:-3].double(), oracle(batch), atol=1e-5, rtol=1e-5)
    # spare pages were never written: still NaN
    used = {p for t in batch.tables for p in t}
    spare = [p for p in range(batch.cache.num_pages) if p not in used]
    assert spare and torch.isnan(batch.cache.k_cache[spare]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_half_precision_queries(dtype, kv_dtype):
    batch = make_batch(SCENARIOS["b3_mixed"], 16, 2, 64, 4, kv_dtype, dtype=dtype, seed=5)
    out = paged_attention(batch.q, batch.cache, batch.meta)
    assert out.dtype == dtype
    # float32 accumulation, one final rounding to the half type
    torch.testing.assert_close(out.double(), oracle(batch), atol=1e-2, rtol=1e-2)
    dec_batch = make_batch(SCENARIOS["b3_decode"], 16, 2, 64, 4, kv_dtype, dtype=dtype, seed=6)
    a = paged_attention(dec_batch.q, dec_batch.cache, dec_batch.meta)
    b = paged_decode_attention(dec_batch.q, dec_batch.cache, dec_batch.meta)
    torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)


def test_decode_rejects_prefill_metadata():
    batch = make_batch(SCENARIOS["b3_mixed"], 4, 2, 16, 1, "auto")
    with pytest.raises(ValueError, match="one new token"):
        paged_decode_attention(batch.q[:3], batch.cache, batch.meta)


def test_attention_input_errors():
    batch = make_batch([(3, 2)], 4, 2, 16, 2, "auto")
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(batch.q[:, :3], batch.cache, batch.meta)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(batch.q[..., :8], batch.cache, batch.meta)
    short = AttentionMetadata.build([2], [5], [batch.tables[0][:1]], batch.meta.slot_mapping.tolist())
    with pytest.raises(ValueError, match="pages"):
        paged_attention(batch.q, batch.cache, short)
    with pytest.raises(ValueError, match="query_len"):
        AttentionMetadata.build([3], [2], [[0]], [0, 1, 2])


# --------------------------------------------------------------------------------------------------
# FP8 error versus unquantised K/V
# --------------------------------------------------------------------------------------------------


def _normal_kv(s, hkv, d, g):
    return torch.randn(s, hkv, d, generator=g), torch.randn(s, hkv, d, generator=g)


def _outlier_kv(s, hkv, d, g):
    """Normal K/V with 4 channels per head scaled x20 (keys) / x8 (values), like real K outlier channels."""
    k, v = _normal_kv(s, hkv, d, g)
    idx = torch.randperm(d, generator=g)[:4]
    k[..., idx] *= 20.0
    v[..., idx] *= 8.0
    return k, v


def _mean_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean over (token, head) of ||out - ref||_2 / ||ref||_2 along head_dim."""
    return ((out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).mean().item()


# Error metric: per (token, query head), ||out - ref||_2 / ||ref||_2 along head_dim, where ref is the
# float64 oracle on the *unquantised* K/V; "agg" is ||out - ref||_F / ||ref||_F over the whole batch.
# Per element, E4M3 round-to-nearest has relative error <= 2^-4 (3 mantissa bits); measured on these
# K/V: mean 2.2%, RMS 2.7%. K and V errors each add ~2.5% to the output, so ~3.5% together.
# Measured (batch (0,64),(100,28),(200,1), page_size 16, 2 KV heads, GQA 4, head_dim 128, float32, seed 0;
# seeds 0-4 in brackets):
#   normal K/V:                          mean 3.49% [3.45-3.54]  max 5.9% [5.8-6.6]   agg 3.21% [3.19-3.30]
#   4 outlier channels (K x20, V x8):    mean 4.39% [4.11-4.39]  max 26%  [21-40]     agg 4.09% [3.67-4.38]
# With outlier keys the scores are ~4x larger, attention is sharper, and the K error dominates (K only:
# mean 5.7%, V only: 2.0%); single rows whose top keys nearly tie can move by tens of percent.
# bfloat16 "auto" storage for comparison: mean 0.16% (the final bfloat16 rounding of the output).
# Tested bounds (seed 0, the case run; each about 15-20% above its measured value, printed by the test):
#   normal:   mean < 4% (3.49), agg < 3.7% (3.21), max < 7% (5.88)
#   outliers: mean < 5% (4.39), agg < 4.7% (4.09), max < 30% (25.8)
# A real bug fails them: V quantised with K's scale (one scale for both, the bug planted in the mutation
# check) measured normal mean 4.73% / agg 4.24% / max 8.65%, outliers agg 4.75% / max 39%.
FP8_BOUNDS = {"normal": (0.04, 0.037, 0.07), "outliers": (0.05, 0.047, 0.30)}


@pytest.mark.parametrize("kind", ["normal", "outliers"])
def test_fp8_error_versus_unquantised(kind):
    kv_fn = {"normal": _normal_kv, "outliers": _outlier_kv}[kind]
    seqs = [(0, 64), (100, 28), (200, 1)]
    batch = make_batch(seqs, 16, 2, 128, 4, "fp8", seed=0, kv_fn=kv_fn)
    out = paged_attention(batch.q, batch.cache, batch.meta).double()
    ref = oracle(batch, dequantised=False)
    rel = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
    agg = ((out - ref).norm() / ref.norm()).item()
    print(f"FP8 attention error ({kind}): mean {rel.mean():.3e}, max {rel.max():.3e}, agg {agg:.3e}")
    mean_bound, agg_bound, max_bound = FP8_BOUNDS[kind]
    assert rel.mean().item() < mean_bound
    assert agg < agg_bound
    assert rel.max().item() < max_bound
    # auto mode on the same data is exact up to float32 accumulation
    auto = make_batch(seqs, 16, 2, 128, 4, "auto", seed=0, kv_fn=kv_fn)
    assert _mean_rel_error(paged_attention(auto.q, auto.cache, auto.meta), oracle(auto, dequantised=False)) < 1e-6


# --------------------------------------------------------------------------------------------------
# Quantisation
# --------------------------------------------------------------------------------------------------


def _fp8_finite_values() -> torch.Tensor:
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
    return torch.unique(vals[torch.isfinite(vals)])


def test_quantize_zero_vector_round_trips():
    x = torch.zeros(3, 2, 16)
    x[1, 1] = torch.randn(16)
    q, s = quantize_fp8(x)
    assert (s > 0).all()
    assert s[0, 0].item() == pytest.approx(AMAX_FLOOR / 448)
    back = dequantize_fp8(q, s)
    assert torch.equal(back[0], torch.zeros_like(back[0]))
    assert torch.equal(back[1, 0], torch.zeros(16))


def test_quantize_large_values_finite_and_scale_exact():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g) * 1e4
    x[0, 0, 0] = 1e4
    x[1, 1, 5] = -3e4
    q, s = quantize_fp8(x)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == (5, 3)
    assert torch.isfinite(q.float()).all() and torch.isfinite(s).all()
    assert torch.equal(s, x.abs().amax(-1) / 448)  # exactly amax / 448 in float32
    assert torch.equal(s, (x.abs().amax(-1).double() / 448).float())  # correctly rounded division
    assert (q.float().abs().amax(-1) == 448).all()  # the amax element maps to +-448
    back = dequantize_fp8(q, s)
    assert torch.isfinite(back).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_rounds_to_nearest(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 4, 32, generator=g) * torch.logspace(-3, 3, 32)).to(dtype)
    q, s = quantize_fp8(x)
    y = (x.float() / s[..., None]).clamp(-448, 448)
    assert torch.equal(q.view(torch.uint8), y.to(FP8_DTYPE).view(torch.uint8))  # torch's cast
    # brute force: no finite E4M3 value is closer to y than the chosen one
    grid = _fp8_finite_values()
    best = (y.reshape(-1, 1) - grid[None]).abs().min(dim=1).values
    assert torch.equal((y.reshape(-1) - q.float().reshape(-1)).abs(), best)
    # per-element error: relative <= 2^-4 in the normal range, <= 2^-10 (half the subnormal step) below
    err = (q.float() - y).abs()
    normal = y.abs() >= 2**-6
    assert (err[normal] <= y.abs()[normal] * 2**-4).all()
    assert (err[~normal] <= 2**-10).all()


def test_dequantize_dtype_and_shape_errors():
    q, s = quantize_fp8(torch.randn(2, 3, 8))
    assert dequantize_fp8(q, s, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        dequantize_fp8(q, s[:, :2])
    with pytest.raises(TypeError):
        quantize_fp8(torch.ones(2, 2, dtype=torch.int32))


# --------------------------------------------------------------------------------------------------
# Capacity
# --------------------------------------------------------------------------------------------------


def test_kv_bytes_per_token():
    fp8 = kv_bytes_per_token(8, 128, "fp8", torch.bfloat16)
    bf16 = kv_bytes_per_token(8, 128, "auto", torch.bfloat16)
    assert fp8 == 2 * (8 * 128 * 1 + 8 * 4) == 2112
    assert bf16 == 2 * 8 * 128 * 2 == 4096
    assert bf16 / fp8 == 4096 / 2112
    assert round(bf16 / fp8, 4) == 1.9394 and bf16 / fp8 >= 1.9
    assert kv_bytes_per_token(8, 128, FP8_DTYPE, torch.bfloat16) == 2112
    assert kv_bytes_per_token(8, 128, "auto", torch.float32) == 8192
    # matches what the pool allocates
    for kv_dtype, expected in (("fp8", 2112), ("auto", 4096)):
        c = KVLayerCache.allocate(3, 16, 8, 128, kv_dtype, torch.bfloat16)
        total = sum(t.numel() * t.element_size() for t in (c.k_cache, c.v_cache, c.k_scale, c.v_scale) if t is not None)
        assert total == expected * c.num_slots
    with pytest.raises(ValueError):
        kv_bytes_per_token(8, 128, "int4", torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# store_kv, copy_pages, move_slots
# --------------------------------------------------------------------------------------------------


def _snapshot(cache: KVLayerCache) -> list[torch.Tensor]:
    """Bit-level token-major copies of the pool tensors (uint8 views, so NaN compares equal)."""
    ts = [cache.k_cache, cache.v_cache] + ([cache.k_scale, cache.v_scale] if cache.is_fp8 else [])
    return [tok(t).contiguous().view(torch.uint8) for t in ts]


def _filled_cache(kv_dtype: str, num_pages=4, page_size=4, hkv=2, d=8, seed=0) -> KVLayerCache:
    g = torch.Generator().manual_seed(seed)
    cache = KVLayerCache.allocate(num_pages, page_size, hkv, d, kv_dtype, torch.float32)
    n = num_pages * page_size
    store_kv(torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g), cache, torch.arange(n))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_auto_exact_and_padding_skipped(dtype):
    cache = KVLayerCache.allocate(3, 4, 2, 8, "auto", dtype)
    assert not cache.is_fp8 and cache.k_scale is None
    before = _snapshot(cache)
    k, v = torch.randn(5, 2, 8).to(dtype), torch.randn(5, 2, 8).to(dtype)
    slots = torch.tensor([-1, 9, -1, 2, 5])
    store_kv(k, v, cache, slots)
    flat_k, flat_v = tok(cache.k_cache).reshape(-1, 2, 8), tok(cache.v_cache).reshape(-1, 2, 8)
    assert torch.equal(flat_k[[9, 2, 5]], k[[1, 3, 4]]) and torch.equal(flat_v[[9, 2, 5]], v[[1, 3, 4]])
    untouched = [i for i in range(12) if i not in (9, 2, 5)]
    assert torch.equal(flat_k[untouched], before[0].view(dtype).view(-1, 2, 8)[untouched])
    assert torch.equal(flat_v[untouched], before[1].view(dtype).view(-1, 2, 8)[untouched])
    # all-padding: nothing written at all
    snap = _snapshot(cache)
    store_kv(k, v, cache, torch.full((5,), -1))
    assert all(torch.equal(a, b) for a, b in zip(snap, _snapshot(cache), strict=True))


def test_store_kv_fp8_writes_quantised_values_and_scales():
    cache = KVLayerCache.allocate(3, 4, 2, 8, "fp8", torch.bfloat16)
    before = _snapshot(cache)
    k, v = torch.randn(4, 2, 8).bfloat16(), torch.randn(4, 2, 8).bfloat16()
    slots = torch.tensor([7, -1, 0, 11])
    store_kv(k, v, cache, slots)
    kq, ks = quantize_fp8(k[[0, 2, 3]])
    vq, vs = quantize_fp8(v[[0, 2, 3]])
    pages, offs = torch.tensor([1, 0, 2]), torch.tensor([3, 0, 3])
    assert torch.equal(tok(cache.k_cache)[pages, offs].view(torch.uint8), kq.view(torch.uint8))
    assert torch.equal(tok(cache.v_cache)[pages, offs].view(torch.uint8), vq.view(torch.uint8))
    assert torch.equal(tok(cache.k_scale)[pages, offs], ks) and torch.equal(tok(cache.v_scale)[pages, offs], vs)
    after = _snapshot(cache)
    written = torch.zeros(3, 4, dtype=torch.bool)
    written[pages, offs] = True
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a[~written], b[~written])


def test_store_kv_errors():
    cache = KVLayerCache.allocate(2, 4, 2, 8, "fp8", torch.float32)
    k = torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match="out of range"):
        store_kv(k, k, cache, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="duplicate"):
        store_kv(k, k, cache, torch.tensor([3, 3]))
    with pytest.raises(ValueError):
        store_kv(k, k[:, :1], cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError):
        KVLayerCache(cache.k_cache, cache.v_cache)  # fp8 without scales
    with pytest.raises(ValueError):
        KVLayerCache(torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8), cache.k_scale, cache.v_scale)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_copy_pages(kv_dtype):
    cache = _filled_cache(kv_dtype, num_pages=5)
    old = _snapshot(cache)
    # chain 1 -> 2 -> 3 (overlap): destinations get the *old* sources; page 0 -> 4
    copy_pages(cache, torch.tensor([1, 2, 0]), torch.tensor([2, 3, 4]))
    new = _snapshot(cache)
    for a, b in zip(old, new, strict=True):  # includes the scales in fp8 mode
        assert torch.equal(b[2], a[1]) and torch.equal(b[3], a[2]) and torch.equal(b[4], a[0])
        assert torch.equal(b[0], a[0]) and torch.equal(b[1], a[1])
    with pytest.raises(ValueError, match="duplicate"):
        copy_pages(cache, torch.tensor([0, 1]), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="out of range"):
        copy_pages(cache, torch.tensor([5]), torch.tensor([0]))


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
@pytest.mark.parametrize(
    "src,dst",
    [
        ([3, 5, 6, 9, 10], [0, 1, 2, 3, 4]),  # compaction to the front, overlapping (3 is both)
        ([0, 1, 2, 3], [1, 2, 3, 4]),  # shift right by one: naive in-order copy would smear slot 0
        ([4, 5], [5, 4]),  # swap
        ([15], [7]),
    ],
)
def test_move_slots_matches_clone_oracle(kv_dtype, src, dst):
    cache = _filled_cache(kv_dtype, num_pages=4, page_size=4)
    old = _snapshot(cache)
    move_slots(cache, torch.tensor(src), torch.tensor(dst))
    new = _snapshot(cache)
    for a, b in zip(old, new, strict=True):
        expected = a.clone()
        flat_e, flat_a = expected.view(16, *a.shape[2:]), a.view(16, *a.shape[2:])
        for s, d in zip(src, dst, strict=True):
            flat_e[d] = flat_a[s]
        assert torch.equal(b, expected)


def test_move_slots_then_attention_sees_compacted_prefix():
    """Compacting tokens [3, 5, 6, 9, 10] of a sequence to positions 0..4 makes attention see exactly them."""
    for kv_dtype in ("auto", "fp8"):
        cache = _filled_cache(kv_dtype, num_pages=4, page_size=4, seed=2)
        kept = [3, 5, 6, 9, 10]
        k_kept, v_kept = dense_from_cache(cache, [0, 1, 2, 3], 16)
        k_kept, v_kept = k_kept[kept], v_kept[kept]
        move_slots(cache, torch.tensor(kept), torch.arange(5))
        q = torch.randn(1, 4, 8)
        meta = AttentionMetadata.build([1], [5], [[0, 1]], [4])  # decode token at position 4 (already there)
        ref = naive_attention(q, k_kept, v_kept)
        torch.testing.assert_close(paged_attention(q, cache, meta).double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(paged_decode_attention(q, cache, meta).double(), ref, atol=1e-5, rtol=1e-5)


def test_move_slots_errors():
    cache = _filled_cache("fp8")
    with pytest.raises(ValueError, match="duplicate"):
        move_slots(cache, torch.tensor([1, 2]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="out of range"):
        move_slots(cache, torch.tensor([-1]), torch.tensor([0]))


# --------------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------------


def test_metadata_build():
    meta = AttentionMetadata.build([7, 1, 13], [27, 41, 13], [[4, 1], [0, 2, 3], [5]], list(range(21)))
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.shape == (21,)
    assert meta.query_start_loc.tolist() == [0, 7, 8, 21]
    assert meta.seq_lens.tolist() == [27, 41, 13]
    assert meta.block_tables.tolist() == [[4, 1, -1], [0, 2, 3], [5, -1, -1]]
    assert meta.max_query_len == 13 and meta.max_seq_len == 41
    assert not meta.is_decode_only and meta.num_seqs == 3 and meta.num_tokens == 21
    assert meta.softmax_scale(64) == 64**-0.5
    dec = AttentionMetadata.build([1, 1], [5, 9], [[0], [1, 2]], [4, 8], scale=0.5)
    assert dec.is_decode_only and dec.softmax_scale(64) == 0.5
    with pytest.raises(ValueError, match="slot_mapping"):
        AttentionMetadata.build([2], [2], [[0]], [0])
    with pytest.raises(ValueError, match="one entry per sequence"):
        AttentionMetadata.build([1, 1], [1], [[0]], [0, 1])


# --------------------------------------------------------------------------------------------------
# CUDA (skipped without a device): the same ops on the GPU agree with the CPU
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_cuda_matches_cpu(kv_dtype):
    dev = "cuda"
    for name, seqs in SCENARIOS.items():
        b = make_batch(seqs, 16, 2, 128, 4, kv_dtype, seed=1)
        ref = paged_attention(b.q, b.cache, b.meta)
        c = b.cache
        cache = KVLayerCache(*[None if t is None else t.to(dev) for t in (c.k_cache, c.v_cache, c.k_scale, c.v_scale)])
        fields = ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")
        meta = dataclasses.replace(b.meta, **{f: getattr(b.meta, f).to(dev) for f in fields})
        torch.testing.assert_close(paged_attention(b.q.to(dev), cache, meta).cpu(), ref, atol=1e-5, rtol=1e-5)
        if name in DECODE_SCENARIOS:
            dec = paged_decode_attention(b.q.to(dev), cache, meta).cpu()
            torch.testing.assert_close(dec, ref, atol=1e-5, rtol=1e-5)
    x = torch.randn(500, 2, 128) * torch.logspace(-4, 4, 128)
    (qg, sg), (qc, sc) = quantize_fp8(x.to(dev)), quantize_fp8(x)
    assert torch.equal(qg.cpu().view(torch.uint8), qc.view(torch.uint8)) and torch.equal(sg.cpu(), sc)
    pools = {}
    for d in (dev, "cpu"):
        cache = KVLayerCache.allocate(4, 16, 2, 128, kv_dtype, torch.bfloat16, d)
        slots = torch.arange(50, device=d).flip(0)
        store_kv(x[:50].bfloat16().to(d), x[50:100].bfloat16().to(d), cache, slots)
        copy_pages(cache, torch.tensor([0, 1], device=d), torch.tensor([1, 3], device=d))
        move_slots(cache, torch.tensor([3, 5, 6, 9, 10], device=d), torch.arange(5, device=d))
        pools[d] = [t.cpu().view(torch.uint8) for t in _layer(cache)]
    assert all(torch.equal(a, b) for a, b in zip(pools[dev], pools["cpu"], strict=True))


def _layer(cache: KVLayerCache) -> list[torch.Tensor]:
    return [t for t in (cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale) if t is not None]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_store_kv_refuses_a_wrong_out(backend):
    """``out`` must be two contiguous tensors of K's shape, in the reference and the Triton store."""
    store = store_kv if backend == "reference" else pytest.importorskip("ops.triton_kernels").store_kv
    cache = KVLayerCache.allocate(2, 4, 2, 8, "fp8_e4m3", torch.float32)
    k = torch.randn(3, 2, 8)
    slots = torch.tensor([0, 1, 2])
    for out in ((torch.empty(2, 2, 8), torch.empty(3, 2, 8)), (torch.empty(3, 8, 2).transpose(1, 2), k.clone())):
        with pytest.raises(ValueError, match="out must be two contiguous tensors"):
            store(k, k, cache, slots, out=out)
