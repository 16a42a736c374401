"""The paged KV pool: page accounting, copy-on-write of a shared last page, the debug check, and
capacity (bytes per page, FP8 versus bfloat16, the engine's ``kv_cache_bytes``)."""

from __future__ import annotations

import pytest
import torch

from engine.cache.kv_pool import OutOfPagesError, PageCopy, PagePool, SlotMove
from ops import dequantize_fp8, store_kv

LAYERS, HKV, D, PAGE = 2, 2, 8, 4


def make_pool(num_pages=8, kv_cache_dtype="fp8_e4m3", model_dtype=torch.float32) -> PagePool:
    return PagePool(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D, num_pages=num_pages, page_size=PAGE,
                    kv_cache_dtype=kv_cache_dtype, model_dtype=model_dtype)


def snapshot(pool: PagePool) -> tuple[list[int], int, list[int]]:
    return list(pool.refcount), pool.num_free, sorted(pool._free)


# ------------------------------------------------------------------------------------------------
# accounting
# ------------------------------------------------------------------------------------------------


def test_allocate_release_incref_accounting():
    pool = make_pool(num_pages=8)
    assert (pool.num_free, pool.num_used) == (8, 0)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert len(set(a) | set(b)) == 5, "pages handed out twice"
    assert all(pool.refcount[p] == 1 for p in a + b)
    assert (pool.num_free, pool.num_used) == (3, 5)
    pool.check([a, b])

    pool.incref(a[:2])  # a second holder shares two of a's pages
    shared = a[:2]
    assert [pool.refcount[p] for p in shared] == [2, 2] and pool.is_shared(a[0]) and not pool.is_shared(a[2])
    assert pool.num_used == 5, "sharing takes no new page"
    pool.check([a, b, shared])

    pool.release(a)  # the first holder lets go: shared pages survive, the private one is freed
    assert [pool.refcount[p] for p in shared] == [1, 1] and pool.refcount[a[2]] == 0
    assert (pool.num_free, pool.num_used) == (4, 4)
    pool.check([b, shared])

    pool.release(shared)
    pool.release(b)
    assert (pool.num_free, pool.num_used) == (8, 0)
    assert pool.refcount == [0] * 8
    pool.check([])

    with pytest.raises(RuntimeError, match="free page"):
        pool.release([a[0]])
    with pytest.raises(RuntimeError, match="free page"):
        pool.incref([a[0]])
    assert pool.allocate(0) == [] and pool.num_free == 8


def test_out_of_pages_leaves_nothing_taken():
    pool = make_pool(num_pages=4)
    held = pool.allocate(3)
    before = snapshot(pool)
    with pytest.raises(OutOfPagesError, match="asked for 2 KV pages, 1 free"):
        pool.allocate(2)
    assert snapshot(pool) == before
    pool.check([held])
    # the one free page is still usable afterwards
    (last,) = pool.allocate(1)
    assert last not in held and pool.num_free == 0
    with pytest.raises(OutOfPagesError):
        pool.allocate(1)
    pool.check([held, [last]])


def test_check_catches_corrupted_accounting():
    pool = make_pool(num_pages=6)
    a = pool.allocate(2)
    b = pool.allocate(1)
    pool.check([a, b])

    pool.refcount[a[1]] += 1  # a reference nobody holds
    with pytest.raises(AssertionError, match=f"page {a[1]}: refcount 2 but 1 holders"):
        pool.check([a, b])
    pool.refcount[a[1]] -= 1

    with pytest.raises(AssertionError, match=f"page {b[0]}: refcount 1 but 0 holders"):
        pool.check([a])  # a holder forgot it holds b's page (a leak)

    pool._free.append(a[0])  # a held page also on the free list
    with pytest.raises(AssertionError, match="free list"):
        pool.check([a, b])
    pool._free.remove(a[0])

    pool.refcount[a[0]] = 0  # a held page whose count dropped to zero without being freed
    with pytest.raises(AssertionError, match=f"page {a[0]}: refcount 0 but 1 holders"):
        pool.check([a, b])


# ------------------------------------------------------------------------------------------------
# copy-on-write of a shared, partly filled last page
# ------------------------------------------------------------------------------------------------


def _fill(pool: PagePool, table: list[int], start: int, n: int, seed: int) -> None:
    """Store ``n`` random tokens at positions ``start ..`` of ``table`` in every layer."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.tensor([table[i // PAGE] * PAGE + i % PAGE for i in range(start, start + n)])
    for layer in pool.layers:
        k = torch.randn(n, HKV, D, generator=gen) * 3
        v = torch.randn(n, HKV, D, generator=gen)
        store_kv(k, v, layer, slots)


def _page_state(pool: PagePool, page: int) -> list[torch.Tensor]:
    out = []
    for layer in pool.layers:
        out += [layer.k_cache[page].clone(), layer.v_cache[page].clone()]
        if layer.is_fp8:
            out += [layer.k_scale[page].clone(), layer.v_scale[page].clone()]
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    # compare bytes: float8 lacks elementwise equality on some builds, and bit equality is what we mean
    if len(a) != len(b):
        return False
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "auto"])
def test_fork_last_copies_a_shared_partly_filled_page(kv_cache_dtype):
    pool = make_pool(num_pages=6, kv_cache_dtype=kv_cache_dtype)
    first = pool.allocate(2)
    _fill(pool, first, 0, PAGE + 2, seed=1)  # page 0 full, page 1 holds 2 of 4 tokens
    second = list(first)
    pool.incref(second)  # another sequence shares both pages (a cached prefix, a fork)
    shared_last = first[-1]
    original = _page_state(pool, shared_last)
    pool.check([first, second])

    pool.fork_last(second)  # `second` is about to append: it needs a private last page

    fresh = second[-1]
    # the data copy is an order (the step plan carries it to the runner), not done yet
    assert pool.orders == [PageCopy(shared_last, fresh)]
    for order in pool.take_orders():
        pool.apply(order)
    assert pool.orders == []
    assert fresh != shared_last and fresh not in first
    assert second[:-1] == first[:-1], "only the last page is copied"
    assert first == [first[0], shared_last], "the other holder's table is unchanged"
    assert pool.refcount[shared_last] == 1 and pool.refcount[fresh] == 1 and pool.refcount[first[0]] == 2
    assert _equal(_page_state(pool, fresh), original), "payload and scales are copied"
    if kv_cache_dtype == "fp8_e4m3":
        assert len(original) == 4 * LAYERS  # k, v, k_scale, v_scale per layer
    pool.check([first, second])

    # the copy is private: writing the rest of it leaves the original (and its holder) untouched
    _fill(pool, second, PAGE + 2, 2, seed=2)
    _fill(pool, second, PAGE, 2, seed=3)  # even overwriting the copied positions
    assert _equal(_page_state(pool, shared_last), original)
    assert not _equal(_page_state(pool, fresh), original)

    # an unshared last page is not copied
    before = list(second)
    pool.fork_last(second)
    assert second == before and pool.num_used == 3 and pool.orders == []
    pool.release(first)
    pool.release(second)
    assert pool.num_free == 6
    pool.check([])


def test_fork_last_copy_dequantises_like_the_original():
    """In FP8 mode the copy reads back (dequantised) exactly like the original page."""
    pool = make_pool(num_pages=3)
    table = pool.allocate(1)
    _fill(pool, table, 0, 3, seed=4)
    other = list(table)
    pool.incref(other)
    pool.fork_last(other)
    (order,) = pool.take_orders()
    pool.apply(order)
    for layer in pool.layers:
        for cache, scale in ((layer.k_cache, layer.k_scale), (layer.v_cache, layer.v_scale)):
            a = dequantize_fp8(cache[table[0], :, :3], scale[table[0], :, :3])  # [head, offset, dim]
            b = dequantize_fp8(cache[other[0], :, :3], scale[other[0], :, :3])
            assert torch.equal(a, b) and a.abs().max() > 0


def test_fork_last_without_a_free_page_changes_nothing():
    pool = make_pool(num_pages=2)
    a = pool.allocate(2)
    b = list(a)
    pool.incref(b)
    before, table_before = snapshot(pool), list(b)
    with pytest.raises(OutOfPagesError):
        pool.fork_last(b)
    assert snapshot(pool) == before and b == table_before and pool.orders == []
    pool.check([a, b])


# ------------------------------------------------------------------------------------------------
# capacity
# ------------------------------------------------------------------------------------------------

#: Qwen3-VL-8B's decoder: 36 layers, 8 KV heads of 128.
QWEN3_VL_8B = dict(num_layers=36, num_kv_heads=8, head_dim=128)


def test_bytes_per_page_of_qwen3_vl_8b():
    fp8 = PagePool.bytes_per_page(**QWEN3_VL_8B, page_size=16, kv_cache_dtype="fp8_e4m3", model_dtype=torch.bfloat16)
    bf16 = PagePool.bytes_per_page(**QWEN3_VL_8B, page_size=16, kv_cache_dtype="auto", model_dtype=torch.bfloat16)
    # per token and layer: FP8 = K + V of 8 heads x (128 one-byte values + one float32 scale) = 2112 bytes;
    # bfloat16 = K + V of 8 heads x 128 two-byte values = 4096 bytes
    assert fp8 == 2 * 8 * (128 + 4) * 16 * 36 == 2112 * 16 * 36 == 1_216_512
    assert bf16 == 2 * 8 * 128 * 2 * 16 * 36 == 4096 * 16 * 36 == 2_359_296
    f32 = PagePool.bytes_per_page(**QWEN3_VL_8B, page_size=16, kv_cache_dtype="auto", model_dtype=torch.float32)
    assert f32 == 2 * bf16

    # equal bytes: FP8 holds 4096 / 2112 = 1.93939... times the tokens of bfloat16 (>= 1.9x)
    budget = 16 << 30
    tokens_fp8 = budget // fp8 * 16
    tokens_bf16 = budget // bf16 * 16
    assert bf16 / fp8 == pytest.approx(4096 / 2112) and 4096 / 2112 == pytest.approx(1.93939, abs=1e-5)
    assert tokens_fp8 / tokens_bf16 >= 1.9
    assert tokens_fp8 / tokens_bf16 == pytest.approx(4096 / 2112, rel=1e-3)


def test_pool_reports_capacity_in_pages_and_tokens():
    pool = make_pool(num_pages=10)
    assert pool.num_pages == 10 and pool.page_size == PAGE and pool.capacity_tokens == 10 * PAGE
    assert pool.num_free == 10 and pool.num_used == 0
    # the storage really is that size: FP8 payload plus one float32 scale per token and head
    assert pool._k.shape == (LAYERS, 10, HKV, PAGE, D) and pool._k.dtype == torch.float8_e4m3fn
    assert pool._ks.shape == (LAYERS, 10, HKV, PAGE) and pool._ks.dtype == torch.float32
    stored = sum(t.numel() * t.element_size() for t in (pool._k, pool._v, pool._ks, pool._vs))
    expected = 10 * PagePool.bytes_per_page(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D, page_size=PAGE,
                                            kv_cache_dtype="fp8_e4m3", model_dtype=torch.float32)
    assert stored == expected

    auto = make_pool(num_pages=3, kv_cache_dtype="auto", model_dtype=torch.bfloat16)
    assert auto._k.dtype == torch.bfloat16 and auto._ks is None and auto.capacity_tokens == 3 * PAGE
    with pytest.raises(ValueError):
        make_pool(num_pages=0)
    with pytest.raises(ValueError):
        make_pool(kv_cache_dtype="int8")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "auto"])
def test_engine_kv_cache_bytes_sets_the_page_count(tiny_engine_factory, kv_cache_dtype):
    t_layers, t_kv_heads, t_head_dim = 3, 2, 16  # the "test" preset's decoder
    per_page = PagePool.bytes_per_page(num_layers=t_layers, num_kv_heads=t_kv_heads, head_dim=t_head_dim,
                                       page_size=16, kv_cache_dtype=kv_cache_dtype, model_dtype=torch.float32)
    # fp8: 16 tokens x 3 layers x 2 x 2 heads x (16 + 4) bytes = 3840; float32: 16 x 3 x 2 x 2 x 16 x 4 = 12288
    assert per_page == {"fp8_e4m3": 3840, "auto": 12288}[kv_cache_dtype]
    budget = 37 * per_page + per_page - 1  # a page's worth minus one byte is not a page
    engine = tiny_engine_factory(kv_cache_dtype=kv_cache_dtype, kv_cache_bytes=budget)
    try:
        assert engine.pool.num_pages == budget // per_page == 37
        stats = engine.stats()
        assert stats["pages_total"] == 37 and stats["pages_free"] == 37 and stats["pages_used"] == 0
        assert stats["capacity_tokens"] == 37 * 16 and stats["kv_cache_dtype"] == kv_cache_dtype
        assert engine.max_model_len == 37 * 16, "a request can never be longer than the pool"
    finally:
        engine.close()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "auto"])
@pytest.mark.parametrize("move_rows", [PagePool.MOVE_ROWS, 10])  # both layers a launch, one a launch
def test_pool_move_slots_moves_every_layer_like_the_per_layer_reference(kv_cache_dtype, move_rows, monkeypatch):
    """Compaction moves kept tokens down in all layers at once (one launch per buffer, or per few
    layers for long prefixes); source and target ranges overlap. Oracle: the reference move, layer
    by layer, on a copy of the pool."""
    from ops.reference import move_slots as reference_move

    monkeypatch.setattr(PagePool, "MOVE_ROWS", move_rows)
    pool = make_pool(num_pages=6, kv_cache_dtype=kv_cache_dtype)
    table = pool.allocate(4)
    _fill(pool, table, 0, 4 * PAGE, seed=5)
    slot = lambda i: table[i // PAGE] * PAGE + i % PAGE  # noqa: E731
    kept = [0, 2, 3, 5, 6, 7, 9, 11, 12, 13]  # positions kept; they move to 0 .. 9
    src, dst = [slot(i) for i in kept], [slot(i) for i in range(len(kept))]
    expected = make_pool(num_pages=6, kv_cache_dtype=kv_cache_dtype)
    for mine, theirs in zip(pool.layers, expected.layers, strict=True):
        for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
            if getattr(mine, name) is not None:
                getattr(theirs, name).copy_(getattr(mine, name))
        reference_move(theirs, torch.tensor(src), torch.tensor(dst))

    pool.move_slots(src, dst)

    for page in table:
        assert _equal(_page_state(pool, page), _page_state(expected, page)), page


# ------------------------------------------------------------------------------------------------
# page arithmetic and the kept-slot move
# ------------------------------------------------------------------------------------------------


def test_pages_for_and_slot_are_the_page_arithmetic():
    pool = make_pool(num_pages=6)  # PAGE tokens a page
    assert [pool.pages_for(n) for n in (0, 1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE)] == [0, 1, 1, 1, 2, 3]
    table = [5, 2, 4]
    # physical token i lives at page table[i // PAGE], offset i % PAGE: slot page * PAGE + offset
    assert [pool.slot(table, i) for i in (0, PAGE - 1, PAGE, 2 * PAGE + 1)] == [
        5 * PAGE, 5 * PAGE + PAGE - 1, 2 * PAGE, 4 * PAGE + 1]


def _token_state(pool: PagePool, table: list[int], i: int) -> list[torch.Tensor]:
    """Every layer's K and V of physical token ``i`` of ``table`` (head-major pages)."""
    page, offset = table[i // PAGE], i % PAGE
    return [t[page, :, offset].clone() for layer in pool.layers for t in (layer.k_cache, layer.v_cache)]


def test_keep_slots_orders_the_move_and_releases_the_pages_past_the_kept_tokens():
    pool = make_pool(num_pages=6, kv_cache_dtype="auto")
    table = pool.allocate(3)
    _fill(pool, table, 0, 3 * PAGE, seed=5)
    kept = [1, PAGE, PAGE + 2, 2 * PAGE + 3]  # four tokens: one page
    want = [_token_state(pool, table, i) for i in kept]
    pages = pool.keep_slots(table, kept)
    assert pages == table[:1] and pool.num_used == 1 and pool.refcount[table[0]] == 1
    (move,) = pool.take_orders()
    assert move == SlotMove(tuple(pool.slot(table, i) for i in kept), tuple(pool.slot(table, i) for i in range(4)))
    pool.apply(move)
    assert all(_equal(_token_state(pool, pages, i), w) for i, w in enumerate(want))
    pool.release(pages)
    pool.check([])
