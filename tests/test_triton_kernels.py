"""Triton kernels against their PyTorch references (ops/reference.py).

On a CPU-only machine the kernels run under ``TRITON_INTERPRET=1`` (set in conftest) at small
shapes; with CUDA the same tests also run compiled on the GPU over larger shapes. The
interpreter's FP8 cast is not bit-exact with the GPU's (a known slip, see ``assert_same_fp8_pages``),
so there stored FP8 pages may differ from the reference's in exactly that way (scales not at all);
attention is compared on one shared cache (written by the reference store), where both read
identical bytes and only the arithmetic differs.
"""

from __future__ import annotations

import random

import pytest
import torch

from ops import AttentionMetadata, KVLayerCache
from ops import reference as ref

tk = pytest.importorskip("ops.triton_kernels")

CUDA = torch.cuda.is_available()
# compiled kernels need CUDA tensors; without a GPU they run in the interpreter on CPU tensors
DEVICES = ["cuda"] if CUDA else ["cpu"]


def _layout(device, kv, hkv, d, page, query_lens, ctx_lens, dtype, seed=0):
    """A pool with random context K/V already stored (by the reference), plus step metadata."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    total_pages = sum(-(-(q + c) // page) for q, c in zip(query_lens, ctx_lens, strict=True)) + 3
    cache = KVLayerCache.allocate(total_pages, page, hkv, d, kv, dtype, device)
    free = list(range(total_pages))
    rnd.shuffle(free)
    tables, seq_lens, new_slots = [], [], []
    for q, c in zip(query_lens, ctx_lens, strict=True):
        n = q + c
        table = [free.pop() for _ in range(-(-n // page))]
        slots = torch.tensor([table[i // page] * page + i % page for i in range(n)], device=device)
        k = torch.randn(n, hkv, d, generator=g).to(device, dtype)
        v = torch.randn(n, hkv, d, generator=g).to(device, dtype)
        ref.store_kv(k, v, cache, slots)
        tables.append(table)
        seq_lens.append(n)
        new_slots += slots[c:].tolist()
    meta = AttentionMetadata.build(list(query_lens), seq_lens, tables, new_slots, device)
    return cache, meta, g


def _tol(dtype):
    return dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


CPU_CASES = [  # (gqa, hkv, head_dim, page, query_lens, ctx_lens)
    (1, 2, 16, 4, (5,), (0,)),
    (2, 2, 16, 4, (7, 1, 13), (20, 40, 0)),
    (4, 1, 32, 16, (3, 9), (17, 33)),
    (8, 1, 16, 16, (1, 2), (50, 1)),
]
GPU_CASES = [
    (g, hkv, d, 16, ql, cl)
    for g, hkv in ((1, 8), (2, 4), (4, 8), (8, 8))
    for d in (64, 128)
    for ql, cl in (((1,), (1700,)), ((30, 1, 200), (941, 1656, 0)), ((1,) * 8, (513, 16, 17, 1023, 1, 33, 250, 4000)))
]


def _cases(device):
    return CPU_CASES if device == "cpu" else GPU_CASES


def _params():
    out = []
    for device in DEVICES:
        for kv in ("auto", "fp8_e4m3"):
            for dtype in ((torch.float32,) if device == "cpu" else (torch.bfloat16, torch.float32)):
                for case in _cases(device):
                    out.append(pytest.param(device, kv, dtype, case, id=f"{device}-{kv}-{dtype}-{case[:4]}"))
    return out


@pytest.mark.parametrize("device,kv,dtype,case", _params())
def test_paged_attention_matches_reference(device, kv, dtype, case):
    gqa, hkv, d, page, qlens, clens = case
    cache, meta, g = _layout(device, kv, hkv, d, page, qlens, clens, dtype)
    q = torch.randn(sum(qlens), hkv * gqa, d, generator=g).to(device, dtype)
    expected = ref.paged_attention(q, cache, meta)
    got = tk.paged_attention(q, cache, meta)
    torch.testing.assert_close(got.float(), expected.float(), **_tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("settings", [dict(rows=128, block_n=64, num_warps=8, num_stages=2),
                                      dict(rows=64, block_n=32, num_warps=4, num_stages=3)])
def test_prefill_launch_settings_agree(device, kv, settings):
    """The settings the prefill sweep tries give the reference's result (several query blocks of
    one prompt over cached context, a second prompt cold)."""
    gqa, hkv, d = 4, 2, 32
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    cache, meta, g = _layout(device, kv, hkv, d, 16, (45, 70), (19, 0), dtype)
    q = torch.randn(115, hkv * gqa, d, generator=g).to(device, dtype)
    expected = ref.paged_attention(q, cache, meta)
    got = tk.paged_attention(q, cache, meta, **settings)
    torch.testing.assert_close(got.float(), expected.float(), **_tol(dtype))


@pytest.mark.parametrize("device,kv,dtype,case", _params())
def test_decode_attention_matches_reference(device, kv, dtype, case):
    gqa, hkv, d, page, qlens, clens = case
    lens = [q + c for q, c in zip(qlens, clens, strict=True)]
    cache, meta, g = _layout(device, kv, hkv, d, page, [1] * len(lens), [n - 1 for n in lens], dtype)
    q = torch.randn(len(lens), hkv * gqa, d, generator=g).to(device, dtype)
    expected = ref.paged_decode_attention(q, cache, meta)
    for splits, rows in ((None, None), (1, 16), (3, 64)):  # rows: query rows padded per program
        got = tk.paged_decode_attention(q, cache, meta, num_splits=splits, rows=rows)
        torch.testing.assert_close(got.float(), expected.float(), **_tol(dtype))


@pytest.mark.skipif(not CUDA, reason="inline assembly runs on the GPU only")
@pytest.mark.parametrize("case", GPU_CASES[::4])
def test_fp8_widening_modes_match_reference(case):
    """Every way of widening FP8 pages gives the reference's decode and prefill attention."""
    gqa, hkv, d, page, qlens, clens = case
    cache, meta, g = _layout("cuda", "fp8_e4m3", hkv, d, page, qlens, clens, torch.bfloat16)
    q = torch.randn(sum(qlens), hkv * gqa, d, generator=g).to("cuda", torch.bfloat16)
    assert tk.attention._dequant_mode(q, cache, "asm") and not tk.attention._dequant_mode(q, cache, "triton")
    expected = ref.paged_attention(q, cache, meta)
    for mode in ("asm", "triton"):
        saved, tk.attention.FP8_DEQUANT = tk.attention.FP8_DEQUANT, mode  # the global the kernels read
        try:
            got = tk.paged_attention(q, cache, meta)
        finally:
            tk.attention.FP8_DEQUANT = saved
        torch.testing.assert_close(got.float(), expected.float(), **_tol(torch.bfloat16))
    lens = [q + c for q, c in zip(qlens, clens, strict=True)]
    cache, meta, g = _layout("cuda", "fp8_e4m3", hkv, d, page, [1] * len(lens), [n - 1 for n in lens], torch.bfloat16)
    q = torch.randn(len(lens), hkv * gqa, d, generator=g).to("cuda", torch.bfloat16)
    expected = ref.paged_decode_attention(q, cache, meta)
    for mode in ("asm", "triton"):
        for rows in (16, 64):
            got = tk.paged_decode_attention(q, cache, meta, rows=rows, dequant=mode)
            torch.testing.assert_close(got.float(), expected.float(), **_tol(torch.bfloat16))


def test_unknown_fp8_widening_is_refused():
    cache = KVLayerCache.allocate(2, 4, 1, 16, "fp8_e4m3", torch.float32, "cpu")
    meta = AttentionMetadata.build([1], [1], [[0]], [0], "cpu")
    with pytest.raises(ValueError, match="dequant"):
        tk.paged_decode_attention(torch.zeros(1, 1, 16), cache, meta, dequant="fast")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_store_kv_matches_reference(device, kv, d):
    g = torch.Generator().manual_seed(1)
    dtype = torch.float32
    a = KVLayerCache.allocate(8, 16, 2, d, kv, dtype, device)
    b = KVLayerCache.allocate(8, 16, 2, d, kv, dtype, device)
    k = (torch.randn(37, 2, d, generator=g) * 3).to(device)
    v = torch.randn(37, 2, d, generator=g).to(device)
    k[5] = 0  # a zero vector must round-trip to zeros
    slots = torch.randperm(128, generator=g)[:37].to(device)
    slots[7] = -1  # padding: not stored
    ref.store_kv(k, v, a, slots)
    tk.store_kv(k, v, b, slots)
    if kv == "auto":
        assert torch.equal(a.k_cache, b.k_cache) and torch.equal(a.v_cache, b.v_cache)
        return
    assert_same_fp8_pages(b, a, exact=device == "cuda")
    for x in ("k", "v"):
        assert torch.isfinite(ref.dequantize_fp8(getattr(b, f"{x}_cache"), getattr(b, f"{x}_scale"))).all(), x
    page, off = divmod(int(slots[5]), 16)
    assert (ref.dequantize_fp8(b.k_cache, b.k_scale)[page, :, off] == 0).all()  # head-major: [page, head, slot, dim]


def assert_same_fp8_pages(got: KVLayerCache, want: KVLayerCache, exact: bool) -> None:
    """``got``'s FP8 pages hold ``want``'s: K and V scales equal bit for bit (float32 amax and a
    correctly rounded division, on every device), K and V payloads equal bit for bit when ``exact``
    (compiled kernels). Under the interpreter the payloads may differ only by its FP8 cast's known
    slip, measured on these tests' data: a value that rounds up to a power of two (a mantissa carry
    into the exponent) comes out as half of it (the smallest subnormal, 2^-9, as 0), on at most 0.66%
    of the elements (seeds 0-5, head dims 16-128); everything else is equal bit for bit."""
    for x in ("k", "v"):
        g_scale, w_scale = getattr(got, f"{x}_scale"), getattr(want, f"{x}_scale")
        assert torch.equal(g_scale, w_scale), f"{x}_scale differs from the reference's"
        g_q, w_q = getattr(got, f"{x}_cache"), getattr(want, f"{x}_cache")
        if exact:
            assert torch.equal(g_q.view(torch.uint8), w_q.view(torch.uint8)), f"{x} pages differ"
            continue
        g, w = g_q.float(), w_q.float()
        off = g != w
        assert float(off.float().mean()) <= 0.01, f"{x}: {int(off.sum())} values differ"
        g, w = g[off], w[off]
        power_of_two = torch.frexp(w)[0].abs() == 0.5
        carry_slip = power_of_two & ((g * 2 == w) | ((g == 0) & (w.abs() == 2.0**-9)))
        bad = ~carry_slip
        assert bool(carry_slip.all()), f"{x}: reference {w[bad][:5].tolist()}, got {g[bad][:5].tolist()}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_hands_back_what_the_pages_hold(device, kv, out_dtype):
    """``out=``: the kernel's K/V as stored (FP8: dequantised, rounded once to the out dtype; zeros
    on padding rows), equal to dequantising the kernel's own pages, and to the reference's ``out=``
    (K and V each; under the interpreter, FP8 pages compared with the reference's pages)."""
    g = torch.Generator().manual_seed(2)
    d = 64
    a = KVLayerCache.allocate(8, 16, 2, d, kv, torch.float32, device)
    b = KVLayerCache.allocate(8, 16, 2, d, kv, torch.float32, device)
    k = (torch.randn(21, 2, d, generator=g) * 3).to(device)
    v = torch.randn(21, 2, d, generator=g).to(device)
    slots = torch.randperm(128, generator=g)[:21].to(device)
    slots[4] = -1
    ka, va = (torch.full((21, 2, d), float("nan"), dtype=out_dtype, device=device) for _ in range(2))
    kb, vb = (torch.full((21, 2, d), float("nan"), dtype=out_dtype, device=device) for _ in range(2))
    ref.store_kv(k, v, a, slots, out=(ka, va))
    tk.store_kv(k, v, b, slots, out=(kb, vb))
    assert (kb[4] == 0).all() and (vb[4] == 0).all() and torch.isfinite(kb).all()
    rows = slots >= 0
    page, off = slots[rows] // 16, slots[rows] % 16
    for got, cache, x in ((kb, b, "k"), (vb, b, "v"), (ka, a, "k"), (va, a, "v")):  # kernel's, reference's
        pages = getattr(cache, f"{x}_cache")[page, :, off]  # [N, Hkv, D]
        held = ref.dequantize_fp8(pages, getattr(cache, f"{x}_scale")[page, :, off]) if cache.is_fp8 else pages
        want = held.float().to(out_dtype)
        if device == "cuda" or out_dtype == torch.float32 or cache is a:  # its own pages, bit for bit
            assert torch.equal(got[rows], want), x
        else:  # the interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest): one ulp
            torch.testing.assert_close(got[rows].float(), want.float(), rtol=2**-7, atol=0)
    # and the kernel's pages or out= against the reference's
    if device == "cuda" or (kv == "auto" and out_dtype == torch.float32):  # the interpreter's casts differ
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    elif kv == "auto":  # the interpreter truncates float32 -> bfloat16: one ulp
        for got, want, x in ((kb, ka, "k"), (vb, va, "v")):
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0, msg=x)
    else:
        assert_same_fp8_pages(b, a, exact=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_move_slots_and_copy_pages_overlap_safe(device, kv):
    a, _, _ = _layout(device, kv, 2, 16, 4, (10,), (10,), torch.float32)
    b = KVLayerCache(*(t.clone() if t is not None else None for t in (a.k_cache, a.v_cache, a.k_scale, a.v_scale)))
    src = torch.tensor([3, 5, 6, 9, 10], device=device)
    dst = torch.tensor([0, 1, 2, 3, 4], device=device)  # overlapping ranges
    ref.move_slots(a, src, dst)
    tk.move_slots(b, src, dst)
    pages_src = torch.tensor([0, 2], device=device)
    pages_dst = torch.tensor([4, 5], device=device)
    ref.copy_pages(a, pages_src, pages_dst)
    tk.copy_pages(b, pages_src, pages_dst)
    for x, y in zip((a.k_cache, a.v_cache, a.k_scale, a.v_scale), (b.k_cache, b.v_cache, b.k_scale, b.v_scale),
                    strict=True):
        if x is not None:
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("elems,dtype", [(1, torch.float32), (40, torch.uint8), (3000, torch.bfloat16)])
def test_row_moves_over_many_tiles(device, elems, dtype):
    """Row moves in tiles of many short rows (scales, one head's bytes) or parts of long rows:
    300 rows, a tile boundary inside the moved set, sources and destinations overlapping."""
    g = torch.Generator().manual_seed(1)
    table = (torch.rand(700, elems, generator=g) * 100).to(dtype).to(device)
    src = torch.arange(100, 400, device=device)
    dst = torch.arange(0, 600, 2, device=device)  # overlaps the sources
    expected = table.clone()
    expected[dst] = table[src]
    tk.slot_moves._move_rows(table, src, dst)
    assert torch.equal(table, expected)


# --------------------------------------------------------------------------------------------------
# Fused elementwise kernels (ops/fused.py) against their references
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_match_references(device, dtype, monkeypatch):
    from ops import fused

    g = torch.Generator().manual_seed(3)
    t, hidden, heads, d, inter = 5, 96, 3, 32, 80
    x = torch.randn(t, hidden, generator=g).to(device, dtype)
    r = torch.randn(t, hidden, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype)
    q = torch.randn(t, heads, d, generator=g).to(device, dtype)
    qw = (1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype)
    kw = (1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype)
    qkv = torch.randn(t, heads + 4, d, generator=g).to(device, dtype)  # 3 query, 2 key, 2 value heads
    qk = qkv[:, : heads + 2]  # a strided view, as the decoder passes it
    ang = torch.randn(t, d // 2, generator=g)
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(device, dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(device, dtype)
    vis = torch.randn(t, 3 * heads, 24, generator=g).to(device, dtype)  # vision q/k/v heads, half = 12
    vang = torch.randn(t, 12, generator=g)
    vcos, vsin = torch.cat([vang.cos(), vang.cos()], -1).to(device), torch.cat([vang.sin(), vang.sin()], -1).to(device)
    gate = torch.randn(t, inter, generator=g).to(device, dtype)
    up = torch.randn(t, inter, generator=g).to(device, dtype)

    monkeypatch.setenv("PRISM_OPS", "reference")
    ref_norm, ref_sum = fused.add_rms_norm(x, r, w, 1e-6)
    ref_plain = fused.add_rms_norm(x, None, w, 1e-6)[0]
    ref_q = fused.qk_norm_rope(q, qw, cos, sin, 1e-6)
    ref_qk = fused.qk_norm_rope(qk, qw, cos, sin, 1e-6, k_weight=kw, q_heads=heads)
    ref_act = fused.silu_mul(gate, up)
    ref_vis = fused.rope_float32(vis[:, : 2 * heads], vcos, vsin)
    monkeypatch.setenv("PRISM_OPS", "triton")
    got_norm, got_sum = fused.add_rms_norm(x, r, w, 1e-6)
    got_plain = fused.add_rms_norm(x, None, w, 1e-6)[0]
    got_q = fused.qk_norm_rope(q, qw, cos, sin, 1e-6)
    got_qk = fused.qk_norm_rope(qk, qw, cos, sin, 1e-6, k_weight=kw, q_heads=heads)
    got_act = fused.silu_mul(gate, up)
    got_vis = fused.rope_float32(vis[:, : 2 * heads], vcos, vsin)

    if device == "cuda":  # compiled, the residual add rounds exactly as torch's (the interpreter truncates)
        assert torch.equal(got_sum, ref_sum)
    # same roundings, different reduction order: within two ulps of the dtype (the interpreter's
    # bfloat16 casts truncate, measured up to 2 ulps on the rotary output)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)
    pairs = ((got_sum, ref_sum), (got_norm, ref_norm), (got_plain, ref_plain), (got_q, ref_q), (got_qk, ref_qk),
             (got_act, ref_act), (got_vis, ref_vis))
    for got, expected in pairs:
        torch.testing.assert_close(got.float(), expected.float(), **tol)


def test_default_decode_splits_are_capped_for_long_graph_contexts():
    """A graph sized for 40k tokens at batch 1 must not launch hundreds of mostly empty chunks."""
    assert tk.default_decode_splits(1, 8, 40960, fp8=True) == tk.MAX_DECODE_SPLITS
    assert tk.default_decode_splits(1, 8, 40960, fp8=False) == tk.MAX_DECODE_SPLITS
    assert tk.default_decode_splits(1, 8, 100, fp8=True) == 2  # never chunks shorter than a key block
    assert tk.default_decode_splits(32, 8, 40960, fp8=False) == 3  # 4 waves of 132 programs over 256 pairs
