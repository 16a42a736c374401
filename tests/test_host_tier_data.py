"""The host tier's data side (issue 33): host pages (``engine/cache/host_pool.py``) and the KV
copies between them and the pool (``engine/cache/kv_transfer.py``), plus the pool's accessors.

Round trips fill the pool with random **bits** (every byte pattern, FP8 NaNs included), offload a
scattered page set to scattered host pages over several chunks, restore it into other pool pages
and compare bits, every layer, K/V and scales; pages not restored into must be untouched.
"""

from __future__ import annotations

import mmap
import threading

import pytest
import torch

from engine.cache.host_pool import HostPool, Run
from engine.cache.kv_pool import OutOfPagesError, PagePool
from engine.cache.kv_transfer import KVTransfers, Offload, Restore, TransferDone, bits

LAYERS, HEADS, PAGE, DIM = 3, 2, 4, 8
CASES = [("fp8_e4m3", torch.float32), ("auto", torch.float32), ("auto", torch.bfloat16)]


def make_pool(kv="fp8_e4m3", dtype=torch.float32, num_pages=24, device="cpu", seed=0) -> PagePool:
    pool = PagePool(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, num_pages=num_pages, page_size=PAGE,
                    kv_cache_dtype=kv, model_dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for b in pool.buffers():
        if b is not None:
            view = bits(b)
            info = torch.iinfo(view.dtype)
            view.copy_(torch.randint(info.min, info.max, view.shape, dtype=torch.int64, device=device,
                                     generator=gen).to(view.dtype))
    return pool


def snapshot(pool: PagePool) -> list[torch.Tensor]:
    """Each buffer's bits, per layer and page: ``[layers, pages, ...]`` integer tensors (CPU)."""
    return [bits(b).view(pool.num_layers, pool.num_pages, *b.shape[1:]).cpu().clone()
            for b in pool.buffers() if b is not None]


def drain(transfers: KVTransfers) -> list[TransferDone]:
    transfers.synchronize()
    return transfers.poll()


# ---------------------------------------------------------------------------------- PagePool accessors
def test_rows_are_page_major_over_the_merged_layers():
    pool = make_pool(num_pages=5)
    rows = pool.rows([4, 1, 3])
    assert rows.dtype == torch.int64
    assert rows.tolist() == [layer * 5 + p for p in (4, 1, 3) for layer in range(LAYERS)]
    assert pool.rows([]).numel() == 0


@pytest.mark.parametrize("kv,dtype", CASES)
def test_buffers_are_the_pools_pages_and_page_bytes_counts_them(kv, dtype):
    pool = make_pool(kv, dtype, num_pages=5)
    k, v, ks, vs = pool.buffers()
    assert k.shape == v.shape == (LAYERS * 5, HEADS, PAGE, DIM)
    assert (ks is None) == (vs is None) == (kv == "auto")
    assert torch.equal(bits(k[2 * 5 + 3]), bits(pool.layers[2].k_cache[3]))  # row l * pages + p
    assert pool.page_bytes == PagePool.bytes_per_page(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                                                      page_size=PAGE, kv_cache_dtype=kv, model_dtype=dtype)


# ---------------------------------------------------------------------------------- HostPool
def test_chunks_are_allocated_lazily_as_pages_are_handed_out():
    pool = make_pool()
    host = HostPool(pool, 10, chunk_pages=4)  # chunks of 4, 4, 2 pages
    assert (host.bytes_allocated, host.num_free, host.pin) == (0, 10, False)
    assert host.allocate(3) == [0, 1, 2]
    assert host.bytes_allocated == 4 * pool.page_bytes
    assert host.allocate(1) == [3]
    assert host.bytes_allocated == 4 * pool.page_bytes  # still in chunk 0
    assert host.allocate(3) == [4, 5, 6]
    assert host.bytes_allocated == 8 * pool.page_bytes
    assert host.allocate(3) == [7, 8, 9]
    assert host.bytes_allocated == 10 * pool.page_bytes  # the last chunk holds only what is left
    assert host.counters() == {"host_pages_total": 10, "host_pages_used": 10,
                               "host_bytes_allocated": 10 * pool.page_bytes}
    chunk = host.chunk(0)
    assert chunk.buffer(0).shape == (4, LAYERS, HEADS, PAGE, DIM) and chunk.buffer(0).dtype == torch.uint8
    assert chunk.buffer(2).shape == (4, LAYERS, HEADS, PAGE) and chunk.buffer(2).dtype == torch.float32
    assert host.layout.groups == LAYERS and chunk.raw.shape == (LAYERS, 4, host.layout.plane_bytes)


class RecordingPool(HostPool):
    """A host pool that records the thread each chunk was allocated on."""

    def __init__(self, *args, **kwargs):
        self.allocated_on: dict[int, str] = {}
        super().__init__(*args, **kwargs)

    def _new_chunk(self, c):
        self.allocated_on[c] = threading.current_thread().name
        return super()._new_chunk(c)


def test_prefetch_pins_one_chunk_ahead_on_a_background_thread():
    """Pinning a chunk takes ~0.17 s per 256 MiB on the H200 host: with prefetch, the chunk a copy
    needs next is allocated ahead, on the pinning thread, never on the caller's (the engine loop)."""
    pool = make_pool()
    host = RecordingPool(pool, 10, chunk_pages=4, prefetch=True)
    assert host.allocate(3) == [0, 1, 2]  # chunk 0 was started at construction; chunk 1 now
    assert host.allocate(4) == [3, 4, 5, 6]  # chunk 1 waited for, not allocated again; chunk 2 started
    host.materialize([9])
    assert host.allocated_on == {0: "prism-host-pin_0", 1: "prism-host-pin_0", 2: "prism-host-pin_0"}
    assert host.bytes_allocated == 10 * pool.page_bytes
    transfers = KVTransfers(pool, host)
    before = snapshot(pool)
    transfers.submit(Offload(1, (3, 5), (8, 9)))
    transfers.submit(Restore(2, (8, 9), (0, 1)))
    assert [d.error for d in drain(transfers)] == [None, None]
    after = snapshot(pool)
    assert all(torch.equal(x[:, [0, 1]], y[:, [3, 5]]) for x, y in zip(after, before, strict=True))
    host.close()
    assert host.bytes_allocated == 0 and host.closed


class FakeCudart:
    """Stands in for ``torch.cuda.cudart()`` on the CPU: records what is registered (pinned)."""

    def __init__(self):
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802  (CUDA's name)
        # CUDA locks the OS pages the range touches and refuses one that is locked already
        # (cudaErrorHostMemoryAlreadyRegistered, 712)
        pages = set(range(ptr // mmap.PAGESIZE, -(-(ptr + size) // mmap.PAGESIZE)))
        if any(pages & set(range(p // mmap.PAGESIZE, -(-(p + n) // mmap.PAGESIZE)))
               for p, n in self.registered.items()):
            return 712
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        del self.registered[ptr]
        return 0


def test_pinned_chunks_are_touched_registered_and_unregistered_at_close(monkeypatch):
    """Pinned chunks are pageable memory registered with CUDA (cudaHostAlloc on a background
    thread stalled the engine loop's steps for up to 562 ms on the H200): every chunk, the one
    pinned ahead and never used included, is registered once and unregistered by close()."""
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    pool = make_pool()
    host = HostPool(pool, 10, pin=True, chunk_pages=4, prefetch=True)
    host.allocate(5)  # chunks 0 and 1 in use, chunk 2 pinned ahead
    host.close()  # waits for chunk 2, then unregisters all three
    assert fake.registered == {}
    host = HostPool(pool, 10, pin=True, chunk_pages=4, prefetch=False)
    pages = host.allocate(4)
    raw = host.chunk(0).raw
    # whole OS pages of its own: two small chunks on one heap page made CUDA refuse the second
    page = mmap.PAGESIZE
    assert raw.numel() == 4 * host.layout.row_bytes and raw.data_ptr() % page == 0
    assert fake.registered == {raw.data_ptr(): -(-raw.numel() // page) * page}
    other = HostPool(pool, 1, pin=True, prefetch=False)
    other.allocate(1)
    assert len(fake.registered) == 2  # the fake refuses a page registered twice, as CUDA does
    other.close()
    assert pages == [0, 1, 2, 3]
    host.close()
    assert fake.registered == {}


def test_a_pool_dropped_without_close_unpins_its_chunks(monkeypatch):
    """Memory unmapped while registered stays registered in the CUDA driver, and the next mapping
    at that address is refused (cudaError 712, seen on the H200 when tests dropped their pools):
    a pool garbage-collected without close() unregisters its chunks first."""
    import gc

    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    host = HostPool(make_pool(), 8, pin=True, chunk_pages=4, prefetch=False)
    host.allocate(8)
    assert len(fake.registered) == 2
    del host
    gc.collect()
    assert fake.registered == {}


class Refusing(FakeCudart):
    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802
        return 2  # cudaErrorMemoryAllocation


def test_a_chunk_that_cannot_be_registered_comes_from_the_pinned_allocator(monkeypatch):
    from engine.cache import host_pool

    fake, fallback = Refusing(), []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(host_pool, "_host_alloc",
                        lambda shape: fallback.append(shape) or torch.empty(shape, dtype=torch.uint8))
    host = HostPool(make_pool(), 10, pin=True, chunk_pages=4, prefetch=False)
    assert host.allocate(3) == [0, 1, 2]
    assert fallback == [(host.layout.groups, 4, host.layout.plane_bytes)] and fake.registered == {}
    host.close()  # nothing registered to undo


def test_a_chunk_that_cannot_be_pinned_at_all_fails_the_allocation_and_takes_nothing(monkeypatch):
    from engine.cache import host_pool

    def no_driver(shape):
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing())
    monkeypatch.setattr(host_pool, "_host_alloc", no_driver)
    host = HostPool(make_pool(), 10, pin=True, chunk_pages=4, prefetch=False)
    with pytest.raises(RuntimeError, match="no NVIDIA driver"):
        host.allocate(3)
    assert host.num_free == 10 and host.bytes_allocated == 0


def test_without_prefetch_chunks_come_on_the_callers_thread():
    host = RecordingPool(make_pool(), 10, chunk_pages=4, prefetch=False)
    host.allocate(5)
    assert host.allocated_on == {0: threading.current_thread().name, 1: threading.current_thread().name}


def test_default_chunk_is_256_mib_of_pages_at_most_the_pool():
    pool = make_pool()
    assert HostPool(pool, 7).chunk_pages == 7
    big = HostPool(pool, 10**7)
    assert big.chunk_pages == (256 << 20) // pool.page_bytes
    assert big.bytes_allocated == 0  # 10 million pages promised, none allocated


def test_auto_host_pages_keep_the_model_dtype_and_no_scales():
    host = HostPool(make_pool("auto", torch.bfloat16), 2)
    host.allocate(1)
    chunk = host.chunk(0)
    assert chunk.buffer(0).dtype == torch.bfloat16 and all(len(views) == 2 for views in chunk.planes)


def test_allocate_prefers_low_contiguous_pages_and_refuses_whole():
    host = HostPool(make_pool(), 10, chunk_pages=4)
    a = host.allocate(6)
    host.release([1, 2, 4])  # free: 1, 2, 4, 6..9
    assert host.allocate(3) == [6, 7, 8]  # the lowest free range long enough
    assert host.allocate(3) == [1, 2, 4]  # none long enough: the lowest free pages
    with pytest.raises(OutOfPagesError, match="asked for 2 host KV pages, 1 free"):
        host.allocate(2)
    assert host.num_free == 1 and host.allocate(1) == [9]
    host.release(a)
    assert host.num_free == 6 and host.allocate(6) == [0, 1, 2, 3, 4, 5]


def test_release_merges_free_ranges():
    host = HostPool(make_pool(), 8, chunk_pages=8)
    pages = host.allocate(8)
    host.release(pages[::2])
    host.release(pages[1::2])
    assert host.allocate(8) == list(range(8))  # one range again


def test_double_free_and_bad_ids_are_refused_taking_nothing():
    host = HostPool(make_pool(), 6, chunk_pages=2)
    host.allocate(4)
    host.release([3])
    with pytest.raises(RuntimeError, match="release of free host page 3"):
        host.release([0, 3])
    with pytest.raises(RuntimeError, match="release of free host page 1"):
        host.release([1, 1])
    with pytest.raises(ValueError, match="out of range"):
        host.release([6])
    assert host.num_used == 3 and all(host.is_used(p) for p in (0, 1, 2))


def test_runs_group_consecutive_pages_of_one_chunk():
    host = HostPool(make_pool(), 12, chunk_pages=4)
    host.allocate(12)
    assert host.runs([5, 6, 7, 2]) == [Run(1, 1, 4, 0), Run(0, 2, 3, 3)]
    assert host.runs([2, 3, 4, 5]) == [Run(0, 2, 4, 0), Run(1, 0, 2, 2)]  # a chunk border cuts a run
    assert host.runs([9, 8, 10, 11, 11]) == [Run(2, 1, 2, 0), Run(2, 0, 1, 1), Run(2, 2, 4, 2), Run(2, 3, 4, 4)]
    assert host.runs([]) == []
    with pytest.raises(ValueError, match="out of range"):
        host.runs([7, 12])


def test_a_tier_of_no_pages():
    host = HostPool(make_pool(), 0)
    assert (host.num_pages, host.num_free, host.bytes_allocated) == (0, 0, 0)
    assert host.allocate(0) == []
    with pytest.raises(OutOfPagesError):
        host.allocate(1)
    assert host.counters()["host_pages_total"] == 0
    host.close()


def test_close_frees_chunks_and_is_idempotent():
    host = HostPool(make_pool(), 4, chunk_pages=2)
    host.allocate(3)
    assert host.bytes_allocated > 0
    host.close()
    host.close()
    assert host.bytes_allocated == 0 and host.closed
    with pytest.raises(RuntimeError, match="closed"):
        host.allocate(1)
    with pytest.raises(RuntimeError, match="closed"):
        host.runs([0])


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        HostPool(make_pool(), -1)
    with pytest.raises(ValueError):
        HostPool(make_pool(), 4, chunk_pages=0)


# ---------------------------------------------------------------------------------- round trips
def round_trip(device: str, kv: str, dtype: torch.dtype, staging_bytes: int | None = None):
    pool = make_pool(kv, dtype, num_pages=24, device=device, seed=1)
    host = HostPool(pool, 16, chunk_pages=3)
    host.allocate(2)  # host ids 0, 1 taken: the ones used below are scattered over chunks
    taken = host.allocate(14)
    host_pages = [taken[i] for i in (9, 2, 3, 4, 13, 0, 7)]  # runs 2..4 cross a chunk border
    src = [17, 3, 4, 5, 21, 0, 11]
    dst = [8, 22, 1, 14, 2, 19, 6]
    kwargs = {} if staging_bytes is None else {"staging_bytes": staging_bytes}
    transfers = KVTransfers(pool, host, **kwargs)
    before = snapshot(pool)
    transfers.submit(Offload(1, tuple(src), tuple(host_pages)))
    (off,) = drain(transfers)
    assert off == TransferDone(1, "offload", 7, 7 * pool.page_bytes, off.ms) and off.ms >= 0
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(pool), strict=True))  # an offload writes no pool page
    for b in pool.buffers():  # the pool pages are free to be overwritten once offloaded
        if b is not None:
            bits(b).view(LAYERS, 24, *b.shape[1:])[:, src] = 0
    transfers.submit(Restore(2, tuple(host_pages), tuple(dst)))
    (res,) = drain(transfers)
    assert (res.xfer, res.kind, res.pages, res.error) == (2, "restore", 7, None)
    after = snapshot(pool)
    untouched = [p for p in range(24) if p not in src and p not in dst]
    for old, new in zip(before, after, strict=True):
        assert torch.equal(new[:, dst], old[:, src]), "restored pages differ from the offloaded ones"
        assert torch.equal(new[:, untouched], old[:, untouched]), "a page outside the transfer changed"
    transfers.close()
    return transfers, host


@pytest.mark.parametrize("kv,dtype", CASES)
def test_offload_then_restore_elsewhere_is_bit_exact(kv, dtype):
    round_trip("cpu", kv, dtype)


def test_host_pages_hold_the_pages_page_major():
    pool = make_pool(num_pages=6)
    host = HostPool(pool, 4, chunk_pages=4)
    transfers = KVTransfers(pool, host)
    transfers.submit(Offload(0, (5, 2), tuple(host.allocate(2))))
    drain(transfers)
    k = bits(pool.buffers()[0]).view(LAYERS, 6, HEADS, PAGE, DIM)
    assert torch.equal(host.chunk(0).buffer(0)[1], k[:, 2])  # host page 1 = pool page 2, every layer
    assert torch.equal(host.chunk(0).buffer(2)[0], pool.buffers()[2].view(LAYERS, 6, HEADS, PAGE)[:, 5])
    raw = host.chunk(0).raw  # a plane a layer (group): one row of bytes a host page in each
    assert raw.shape == (LAYERS, 4, pool.page_bytes // LAYERS) and raw.dtype == torch.uint8

    def page2(i, layer):  # pool page 2 of buffer i in one layer, as bytes
        return bits(pool.buffers()[i]).view(LAYERS, 6, -1)[layer, 2].reshape(-1).view(torch.uint8)

    for layer in range(LAYERS):  # scales first (aligned), then K, then V
        assert torch.equal(raw[layer, 1], torch.cat([page2(2, layer), page2(3, layer), page2(0, layer),
                                                     page2(1, layer)]))


def test_a_fault_fails_that_transfer_alone_and_poll_keeps_submit_order():
    pool = make_pool(num_pages=8)
    host = HostPool(pool, 6, chunk_pages=2)
    pages = host.allocate(6)
    transfers = KVTransfers(pool, host)
    seen = []

    def fault(order):
        seen.append(order.xfer)
        if order.xfer == 11:
            raise OSError("injected")

    transfers.fault = fault
    transfers.submit(Offload(10, (0, 1), tuple(pages[:2])))
    transfers.submit(Offload(11, (2, 3), tuple(pages[2:4])))
    transfers.submit(Offload(12, (4, 5), tuple(pages[4:])))
    transfers.submit(Restore(13, tuple(pages[:2]), (6, 7)))
    assert transfers.in_flight() == 4
    done = transfers.poll()
    assert [d.xfer for d in done] == [10, 11, 12, 13] and seen == [10, 11, 12, 13]
    assert [d.error for d in done] == [None, "OSError: injected", None, None]
    assert transfers.in_flight() == 0 and transfers.poll() == []
    assert torch.equal(snapshot(pool)[0][:, [6, 7]], snapshot(pool)[0][:, [0, 1]])


@pytest.mark.parametrize("order,message", [
    (Offload(1, (0, 1), (0,)), "2 GPU pages for 1 host pages"),
    (Offload(2, (99,), (0,)), "GPU pages out of range"),
    (Offload(3, (0,), (6,)), "host page 6 out of range"),
    (Restore(4, (0, 1), (2, 2)), "a destination page appears twice"),
    (Offload(5, (0, 1), (0, 0)), "a destination page appears twice"),
])
def test_a_bad_order_is_reported_not_raised(order, message):
    pool = make_pool(num_pages=4)
    host = HostPool(pool, 6)
    host.allocate(2)
    transfers = KVTransfers(pool, host)
    before = snapshot(pool)
    transfers.submit(order)
    (done,) = transfers.poll()
    assert done.xfer == order.xfer and message in done.error
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(pool), strict=True))


def test_a_mirror_tier_copies_to_the_host_pages_another_tier_handed_out():
    """A tensor-parallel worker's HostPool runs no bookkeeping: rank 0's decides the host pages;
    the worker's chunks come with its first copy to them, and the round trip is bit-exact."""
    pool = make_pool(num_pages=8)
    leader, mirror = HostPool(pool, 6, chunk_pages=2), HostPool(pool, 6, chunk_pages=2)
    host_pages = tuple(leader.allocate(6)[3:])  # 3, 4, 5: chunks 1 and 2
    transfers = KVTransfers(pool, mirror)
    before = snapshot(pool)
    transfers.submit(Offload(0, (1, 2, 6), host_pages))
    assert mirror.bytes_allocated == 4 * pool.page_bytes and mirror.num_used == 0  # chunks 1, 2 only
    transfers.submit(Restore(1, host_pages, (0, 3, 7)))
    assert [d.error for d in transfers.poll()] == [None, None]
    for old, new in zip(before, snapshot(pool), strict=True):
        assert torch.equal(new[:, [0, 3, 7]], old[:, [1, 2, 6]])


def test_wait_is_a_no_op_on_the_cpu_and_close_is_idempotent():
    pool = make_pool(num_pages=4)
    host = HostPool(pool, 2)
    transfers = KVTransfers(pool, host)
    transfers.submit(Offload(0, (1,), tuple(host.allocate(1))))
    transfers.wait([0, 99])
    transfers.close()
    transfers.close()
    transfers.submit(Offload(1, (2,), (0,)))
    assert [d.error for d in transfers.poll()] == [None, "RuntimeError: the transfer executor is closed"]


def test_empty_orders_are_done_at_once():
    pool = make_pool(num_pages=4)
    transfers = KVTransfers(pool, HostPool(pool, 0))
    transfers.submit(Restore(7, (), ()))
    (done,) = transfers.poll()
    assert done == TransferDone(7, "restore", 0, 0, done.ms) and done.error is None


# ---------------------------------------------------------------------------------- CUDA
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("kv,dtype", CASES)
def test_cuda_round_trip_through_a_small_staging_buffer(kv, dtype):
    pool = make_pool(kv, dtype, num_pages=4, device="cuda")
    transfers, host = round_trip("cuda", kv, dtype, staging_bytes=2 * pool.page_bytes + 1)  # 7 pages: 3 units a group
    assert transfers.staging_pages == 2 * host.layout.groups and host.pin  # planes of one layer group each
    assert host.chunk(0).raw.is_pinned() and host.chunk(0).planes[0][0].is_pinned()


@cuda
def test_cuda_wait_orders_the_compute_stream_after_a_restore():
    pool = make_pool(num_pages=64, device="cuda", seed=3)
    host = HostPool(pool, 64)
    transfers = KVTransfers(pool, host, staging_bytes=4 * pool.page_bytes)
    hp = tuple(host.allocate(32))
    transfers.submit(Offload(0, tuple(range(32)), hp))
    transfers.submit(Restore(1, hp, tuple(range(32, 64))))
    transfers.wait([1])
    k = bits(pool.buffers()[0]).view(LAYERS, 64, -1)
    same = torch.equal(k[:, 32:], k[:, :32])  # read on the current stream, after wait()
    transfers.synchronize()
    assert same
    assert [d.xfer for d in transfers.poll()] == [0, 1] and transfers.in_flight() == 0
    transfers.wait([1])  # done: a no-op
    transfers.close()


@cuda
def test_cuda_a_gated_restore_is_read_layer_group_by_layer_group_eagerly_and_in_a_graph():
    """A gated restore records each layer group's gate as it lands; a read of layer ``l`` queued
    after ``gates.wait(l)`` (eagerly, or replayed from a graph that captured the waits as external
    event waits, as the decode graphs do) sees the restored data, with no wait for the whole copy.
    The copy is queued behind ~0.5 s of compute work, so a read that skipped its gate would see the
    destination's old data."""
    pool = make_pool(num_pages=64, device="cuda", seed=3)
    host = HostPool(pool, 64)
    transfers = KVTransfers(pool, host, staging_bytes=4 * pool.page_bytes)
    gates = transfers.gates
    assert gates.groups == LAYERS
    hp = tuple(host.allocate(32))
    transfers.submit(Offload(0, tuple(range(32)), hp))
    transfers.synchronize()
    k = bits(pool.buffers()[0]).view(LAYERS, 64, -1)
    want = k[:, :32].clone()
    out = torch.zeros_like(want)

    def read_layers():
        for layer in range(LAYERS):
            gates.wait(layer)
            out[layer].copy_(k[layer, 32:])

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        read_layers()  # warm up outside the capture
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            read_layers()
    torch.cuda.current_stream().wait_stream(side)
    for replay in (False, True):
        k[:, 32:].zero_()
        out.zero_()
        torch.cuda._sleep(500_000_000)  # the copy stream waits for this work before copying
        transfers.submit(Restore(1 + replay, hp, tuple(range(32, 64))), gated=True)
        graph.replay() if replay else read_layers()
        gates.forward_queued()
        transfers.synchronize()
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"a layer read before its group landed (graph: {replay})"
    transfers.close()


@cuda
def test_cuda_submit_does_not_wait_for_the_compute_stream():
    """submit queues the copy behind the compute stream's work on the GPU; the host goes on."""
    pool = make_pool(num_pages=8, device="cuda")
    host = HostPool(pool, 8)
    transfers = KVTransfers(pool, host, staging_bytes=pool.page_bytes)  # several rounds
    transfers.submit(Offload(0, (0,), tuple(host.allocate(1))))  # warm up (pinned allocator, kernels)
    transfers.synchronize()
    transfers.poll()
    busy = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU work on the compute stream
    busy.record()
    transfers.submit(Restore(1, (0,), (5,)))
    transfers.submit(Offload(2, (1, 2, 3), tuple(host.allocate(3))))
    assert not busy.query(), "submit blocked the host until the compute stream's work finished"
    assert transfers.poll() == []  # queued behind that work
    transfers.synchronize()
    assert [d.error for d in transfers.poll()] == [None, None]
    transfers.close()
