"""A fresh prefill step attends to its own K/V (ops.self_attention) and agrees with the paged path."""

from __future__ import annotations

import pytest
import torch

from engine.cache.kv_pool import PagePool
from engine.model.attention import PagedStep
from ops import AttentionMetadata, KVLayerCache, paged_attention, store_kv
from ops.self_attention import causal_self_attention

PAGE = 16


def oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Float64 causal GQA attention of one sequence, written out."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q.double(), k) * q.shape[2] ** -0.5
    t = q.shape[0]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


def fresh_step(lens, hkv, group, d, dtype=torch.float32, device="cpu", seed=0):
    """q, k, v of fresh sequences ``lens`` laid out flat, their pages (in order) and metadata."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g).to(device, dtype) for h in (hkv * group, hkv, hkv))
    tables, slots, page = [], [], 0
    for n in lens:
        pages = list(range(page, page + -(-n // PAGE)))
        page += len(pages)
        tables.append(pages)
        slots += [pages[i // PAGE] * PAGE + i % PAGE for i in range(n)]
    meta = AttentionMetadata.build(list(lens), list(lens), tables, slots, device)
    return q, k, v, meta, page


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
def test_equals_paged_attention_over_model_dtype_pages_and_the_oracle(group, d):
    lens = [5, 17, 1, 33]  # not multiples of the page size
    q, k, v, meta, pages = fresh_step(lens, hkv=2, group=group, d=d)
    assert meta.fresh
    out = causal_self_attention(q, k, v, meta)
    cache = KVLayerCache.allocate(pages, PAGE, 2, d, "auto", torch.float32)
    store_kv(k, v, cache, meta.slot_mapping)
    torch.testing.assert_close(out, paged_attention(q, cache, meta), rtol=0, atol=2e-6)
    row = 0
    for n in lens:
        part = slice(row, row + n)
        torch.testing.assert_close(out[part].double(), oracle(q[part], k[part], v[part]), rtol=0, atol=1e-5)
        row += n


def test_over_fp8_pages_it_reads_what_the_store_hands_back():
    """``store_kv(..., out=)`` gives K/V as the FP8 pages hold them; attending to those equals the
    paged attention over the pages, and differs from attending to the unrounded K/V by the FP8
    rounding (so the rounding is really in there)."""
    q, k, v, meta, pages = fresh_step([40, 9], hkv=2, group=4, d=64, seed=1)
    cache = KVLayerCache.allocate(pages, PAGE, 2, 64, "fp8_e4m3", torch.float32)
    kr, vr = torch.empty_like(k), torch.empty_like(v)
    store_kv(k, v, cache, meta.slot_mapping, out=(kr, vr))
    out, over_pages = causal_self_attention(q, kr, vr, meta), paged_attention(q, cache, meta)
    torch.testing.assert_close(out, over_pages, rtol=0, atol=2e-6)
    unrounded = causal_self_attention(q, k, v, meta)
    err = float((unrounded - out).norm() / unrounded.norm())
    assert 1e-3 < err < 0.1, err


def test_store_hands_back_zeros_for_padding_rows_and_model_dtype_values_as_stored():
    q, k, v, meta, pages = fresh_step([5], hkv=1, group=2, d=64, seed=2)
    slots = torch.cat([meta.slot_mapping, torch.tensor([-1, -1])])
    k2, v2 = torch.cat([k, torch.ones(2, 1, 64)]), torch.cat([v, torch.ones(2, 1, 64)])
    for kv in ("fp8_e4m3", "auto"):
        cache = KVLayerCache.allocate(pages, PAGE, 1, 64, kv, torch.float32)
        kr, vr = torch.full_like(k2, float("nan")), torch.full_like(v2, float("nan"))
        store_kv(k2, v2, cache, slots, out=(kr, vr))
        assert (kr[5:] == 0).all() and (vr[5:] == 0).all()
        if kv == "auto":
            assert torch.equal(kr[:5], k) and torch.equal(vr[:5], v)
        else:
            assert not torch.equal(kr[:5], k) and torch.allclose(kr[:5], k, rtol=0.07, atol=1e-3)
    with pytest.raises(ValueError, match="contiguous"):
        store_kv(k, v, cache, meta.slot_mapping, out=(kr, vr))


def test_refuses_a_step_with_cached_context_or_other_rows():
    q, k, v, meta, _ = fresh_step([8], hkv=1, group=2, d=64)
    cached = AttentionMetadata.build([8], [12], [[0]], list(range(4, 12)))
    with pytest.raises(ValueError, match="fresh step"):
        causal_self_attention(q, k, v, cached)
    with pytest.raises(ValueError, match="rows"):
        causal_self_attention(q[:7], k[:7], v[:7], meta)
    with pytest.raises(ValueError, match="do not fit"):
        causal_self_attention(q, k[:, :, :32], v[:, :, :32], meta)


def test_a_mixed_step_gives_each_sequence_what_it_gets_alone():
    """Fresh rows first (the runner's order), then a sequence with 20 cached tokens: every row's
    output equals the one from a step holding its sequence alone, and both sequences' K/V are in
    their pages."""
    g = torch.Generator().manual_seed(3)
    prior_k, prior_v = torch.randn(20, 2, 64, generator=g), torch.randn(20, 2, 64, generator=g)
    q = torch.randn(13, 4, 64, generator=g)
    k, v = torch.randn(13, 2, 64, generator=g), torch.randn(13, 2, 64, generator=g)
    # sequence A: 10 fresh tokens on page 2; sequence B: 3 new tokens at positions 20..22 (page 1)
    fresh = AttentionMetadata.build([10], [10], [[2]], list(range(32, 42)))
    cached = AttentionMetadata.build([3], [23], [[0, 1]], list(range(20, 23)))

    def pool_with_b_cached():
        pool = PagePool(num_layers=1, num_kv_heads=2, head_dim=64, num_pages=8, page_size=PAGE,
                        kv_cache_dtype="fp8_e4m3", model_dtype=torch.float32)
        store_kv(prior_k, prior_v, pool.layers[0], torch.arange(20))  # sequence B: pages 0, 1
        return pool

    together_pool = pool_with_b_cached()
    together = PagedStep(together_pool, cached, fresh).attend(0, q, k, v)
    alone_pool = pool_with_b_cached()
    alone_a = PagedStep(alone_pool, None, fresh).attend(0, q[:10], k[:10], v[:10])
    alone_b = PagedStep(alone_pool, cached).attend(0, q[10:], k[10:], v[10:])
    torch.testing.assert_close(together, torch.cat([alone_a, alone_b]), rtol=0, atol=0)
    # A attended to its pages' numbers: the paged attention over them gives its rows
    torch.testing.assert_close(alone_a, paged_attention(q[:10], together_pool.layers[0], fresh), rtol=0, atol=2e-6)
    expected = PagePool(num_layers=1, num_kv_heads=2, head_dim=64, num_pages=8, page_size=PAGE,
                        kv_cache_dtype="fp8_e4m3", model_dtype=torch.float32)
    store_kv(torch.cat([prior_k, k[10:]]), torch.cat([prior_v, v[10:]]), expected.layers[0], torch.arange(23))
    store_kv(k[:10], v[:10], expected.layers[0], torch.arange(32, 42))
    written = torch.cat([torch.arange(23), torch.arange(32, 42)])
    for got, want in ((together_pool.layers[0], expected.layers[0]), (alone_pool.layers[0], expected.layers[0])):
        for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
            a, b = getattr(got, name), getattr(want, name)
            a, b = a.transpose(1, 2).reshape(-1, *a.shape[1::2]), b.transpose(1, 2).reshape(-1, *b.shape[1::2])
            assert torch.equal(a[written].float(), b[written].float()), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused attention on CUDA needs a GPU")
@pytest.mark.parametrize("lens", [[1662], [300, 7, 64, 129]])
def test_cuda_bfloat16_matches_the_float32_cpu_result(lens):
    q, k, v, meta, _ = fresh_step(lens, hkv=8, group=4, d=128, seed=4)
    ref = causal_self_attention(q, k, v, meta)
    qc, kc, vc, meta_c, _ = fresh_step(lens, hkv=8, group=4, d=128, dtype=torch.bfloat16, device="cuda", seed=4)
    out = causal_self_attention(qc, kc, vc, meta_c)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.float().cpu(), ref, rtol=0, atol=3e-2)
