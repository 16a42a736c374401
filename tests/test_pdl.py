"""Programmatic dependent launch (ops/pdl.py): where it is on; that a kernel launched with it
really starts before the previous kernel ends (eagerly and in a CUDA graph) and still reads that
kernel's output; and that the decode kernels chained with it give bit for bit what they give with
plain launches."""

from __future__ import annotations

import pytest
import torch

from ops import AttentionMetadata, KVLayerCache, pdl

CUDA = torch.cuda.is_available()
HOPPER = CUDA and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="PDL needs a GPU of compute capability 9.0 or later")


def test_off_for_cpu_tensors():
    x = torch.zeros(4)
    assert not pdl.enabled(x)
    assert pdl.launch_args(x) == {"PDL": False}


@needs_hopper
def test_on_for_hopper_unless_turned_off(monkeypatch):
    """On the GPU the benchmarks run on, PDL must really be on (a Triton without ``launch_pdl``
    would silently measure the plain launches); ``PRISM_PDL=0`` turns it off."""
    monkeypatch.delenv("PRISM_PDL", raising=False)
    x = torch.zeros(4, device="cuda")
    assert pdl.launch_args(x) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("PRISM_PDL", "0")
    assert pdl.launch_args(x) == {"PDL": False}


if HOPPER:
    import triton
    import triton.language as tl

    @triton.jit
    def _global_ns():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def _ones_once_released(out_ptr, flag_ptr, status_ptr, n, limit_ns, BLOCK: tl.constexpr):
        """The producer: waits for the kernels before it (the zeroing), lets the next kernel launch,
        then spins until ``flag_ptr`` holds a nonzero value or ``limit_ns`` has passed, stores the
        value it saw in ``status_ptr`` (0: it gave up) and only then writes ones into ``out_ptr``."""
        pdl.pdl_sync(True)
        start = _global_ns()
        now = start
        seen = tl.load(flag_ptr, volatile=True)
        while (seen == 0) & (now - start < limit_ns):
            seen = tl.load(flag_ptr, volatile=True)
            now = _global_ns()
        tl.store(status_ptr, seen)
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.full([BLOCK], 1.0, tl.float32).to(out_ptr.dtype.element_ty), mask=offs < n)

    @triton.jit
    def _copy_then_release(x_ptr, y_ptr, flag_ptr, n, BLOCK: tl.constexpr):
        """The control: a PDL kernel that does not wait. It copies what ``x_ptr`` holds when it runs,
        then releases the producer (flag = 1 + the nonzero values it read). The flag's value is
        computed from every value read, so it is written only once the reads have returned; the
        volatile loads bypass L1, so they see memory as it is, not an earlier kernel's cache lines."""
        offs = tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < n, other=0.0, volatile=True)
        tl.store(y_ptr + offs, v, mask=offs < n)
        nonzero = tl.sum((v != 0).to(tl.int32), axis=0)
        tl.atomic_xchg(flag_ptr, nonzero + 1, sem="release")


#: How long the producer waits for the control before giving up. A working PDL releases it within
#: microseconds of the control's launch (the host's launch gap included); this bound only keeps a
#: broken PDL (the control scheduled after the producer ends) from hanging the test.
RELEASE_LIMIT_NS = 10_000_000_000
#: How long the producer holds back its ones before the kernel that waits (no one releases it).
HOLD_NS = 2_000_000


def _producer(x, flag, status, limit_ns):
    """Zero ``x`` and ``flag``, then launch the producer (it writes ones into ``x`` once released
    through ``flag`` or after ``limit_ns``)."""
    x.zero_()
    flag.zero_()
    n = x.shape[1]
    _ones_once_released[(1,)](x, flag, status, n, limit_ns, BLOCK=triton.next_power_of_2(n), num_warps=1,
                              launch_pdl=True)


def _copy_early(x, flag, status):
    """The producer, then the control launched with PDL right behind it: returns its copy of ``x``."""
    _producer(x, flag, status, RELEASE_LIMIT_NS)
    seen = torch.empty_like(x)
    _copy_then_release[(1,)](x, seen, flag, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=1,
                             launch_pdl=True)
    return seen


@needs_hopper
def test_a_pdl_kernel_starts_early_and_still_reads_its_input(monkeypatch):
    """With PDL the kernel after a producer starts before the producer ends, by construction: the
    producer writes its ones only once the control (a PDL kernel that does not wait) has run and
    released it, so the control reads the zeros from before, and the producer records that it was
    released. Without an early start the producer gives up after ``RELEASE_LIMIT_NS`` and the test
    says so. ``add_rms_norm``, which waits, reads the producer's ones (held back ``HOLD_NS``, which
    only makes a kernel that did not wait read zeros: a correct one reads ones however long the
    hold). Each race runs alone (the control breaks the chain's rule that every kernel waits),
    eagerly and replayed from a CUDA graph, so capture keeps the early launch too."""
    from ops.fused import add_rms_norm

    monkeypatch.delenv("PRISM_PDL", raising=False)
    x = torch.zeros(1, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.full((256,), 2.0, device="cuda", dtype=torch.bfloat16)
    flag = torch.zeros(1, device="cuda", dtype=torch.int32)
    status = torch.zeros(1, device="cuda", dtype=torch.int32)
    zeros, twos = torch.zeros_like(x), torch.full_like(x, 2.0)
    gave_up = (f"the PDL launch did not start before its predecessor ended: the producer waited "
               f"{RELEASE_LIMIT_NS / 1e9:.0f} s for it and gave up")

    def norm(v, flag, status):
        _producer(v, flag, status, HOLD_NS)
        return add_rms_norm(v, None, w, 1e-6)[0]

    # compile each kernel on its own first (a compile between the two launches would be in the race)
    flag.fill_(1)
    _ones_once_released[(1,)](x, flag, status, 256, RELEASE_LIMIT_NS, BLOCK=256, num_warps=1, launch_pdl=True)
    _copy_then_release[(1,)](x, torch.empty_like(x), flag, 256, BLOCK=256, num_warps=1, launch_pdl=True)
    norm(x, flag, status)
    torch.cuda.synchronize()

    def check(out, released: bool, where: str):
        torch.cuda.synchronize()
        if released:
            assert int(status) != 0, where + gave_up
            assert int(status) == int(flag) == 1, f"{where}the control read {int(flag) - 1} nonzero values"
            assert torch.equal(out, zeros), where + "the control read values the producer had not yet written"
        else:
            assert torch.equal(out, twos), where + "the kernel read its input before the producer wrote it"
        assert torch.equal(x, torch.ones_like(x)), where + "the producer did not write its ones"

    for consumer, released in ((_copy_early, True), (norm, False)):
        status.fill_(-1)
        check(consumer(x, flag, status), released, "")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = consumer(x, flag, status)
        for _ in range(2):
            out.fill_(-1.0)
            status.fill_(-1)
            graph.replay()
            check(out, released, "replayed: ")


@needs_hopper
def test_kernels_are_compiled_with_the_wait(monkeypatch):
    """The launch compiles a kernel that waits (``griddepcontrol.wait``) and is launched with PDL."""
    from ops import fused

    monkeypatch.delenv("PRISM_PDL", raising=False)
    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    y, w = torch.empty_like(x), torch.ones(256, device="cuda", dtype=torch.bfloat16)
    compiled = fused._add_rms_norm_kernel[(1,)](x, x, w, y, x, 256, 1e-6, HAS_RES=False, BLOCK=256,
                                                 **pdl.launch_args(x))
    assert compiled.metadata.launch_pdl
    assert "griddepcontrol.wait" in compiled.asm["ptx"]
    assert "griddepcontrol.launch_dependents" in compiled.asm["ptx"]


def _decode_layers(x, w, cache, meta, layers=4):
    """The decode step's Triton kernels of ``layers`` layers, one token: norm + QKV product,
    Q/K norm + rotary, KV store, split attention and its merge, output product, final norm."""
    from ops.fused import add_rms_norm, qk_norm_rope
    from ops.linear import add_rms_norm_linear, linear
    from ops.triton_kernels import paged_decode_attention, store_kv

    hq, hkv, d = w["hq"], cache.num_kv_heads, cache.head_dim
    residual = None
    for _ in range(layers):
        qkv, residual = add_rms_norm_linear(x, residual, w["norm"], 1e-6, w["qkv"])
        heads = qkv.view(1, hq + 2 * hkv, d)
        qk = qk_norm_rope(heads[:, : hq + hkv], w["q_norm"], w["cos"], w["sin"], 1e-6, k_weight=w["k_norm"],
                          q_heads=hq)
        store_kv(qk[:, hq:], heads[:, hq + hkv :], cache, meta.slot_mapping)
        x = linear(paged_decode_attention(qk[:, :hq], cache, meta).reshape(1, -1), w["o"])
    return add_rms_norm(x, residual, w["norm"], 1e-6)[0]


def _setup(kv: str):
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    hidden, hq, hkv, d, page, ctx = 512, 8, 2, 64, 16, 300
    w = {
        "hq": hq,
        "norm": torch.randn(hidden, device=dev, dtype=dt),
        "qkv": torch.randn((hq + 2 * hkv) * d, hidden, device=dev, dtype=dt) / hidden**0.5,
        "q_norm": torch.randn(d, device=dev, dtype=dt),
        "k_norm": torch.randn(d, device=dev, dtype=dt),
        "cos": torch.randn(1, d, device=dev, dtype=dt),
        "sin": torch.randn(1, d, device=dev, dtype=dt),
        "o": torch.randn(hidden, hq * d, device=dev, dtype=dt) / (hq * d) ** 0.5,
    }
    pages = -(-(ctx + 1) // page)
    cache = KVLayerCache.allocate(pages + 2, page, hkv, d, kv, dt, dev)
    from ops import reference

    table = list(range(2, pages + 2))
    slots = torch.tensor([table[i // page] * page + i % page for i in range(ctx)], device=dev)
    reference.store_kv(torch.randn(ctx, hkv, d, device=dev, dtype=dt), torch.randn(ctx, hkv, d, device=dev, dtype=dt),
                       cache, slots)
    new_slot = table[ctx // page] * page + ctx % page
    meta = AttentionMetadata.build([1], [ctx + 1], [table], [new_slot], dev)
    x = torch.randn(1, hidden, device=dev, dtype=dt)
    return x, w, cache, meta


@needs_hopper
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_chained_kernels_agree_with_plain_launches(kv, monkeypatch):
    x, w, cache, meta = _setup(kv)
    monkeypatch.setenv("PRISM_PDL", "0")
    plain = _decode_layers(x, w, cache, meta)
    monkeypatch.delenv("PRISM_PDL")
    assert torch.equal(_decode_layers(x, w, cache, meta), plain)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _decode_layers(x, w, cache, meta)  # compiled before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decode_layers(x, w, cache, meta)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain)


@needs_hopper
@pytest.mark.parametrize("rows,n", [(1, 4097), (3, 16400)])
def test_gemv_agrees(rows, n, monkeypatch):
    """The GEMV launched with PDL right after another PDL GEMV gives what plain launches give; in
    both cases its last program has fewer rows than the others (``n`` not a multiple of the block)."""
    from ops import linear as lin

    settings = lin.gemv_settings(rows, lin._PLAIN, n, 4096)
    assert settings is not None and n % settings[0], "the case must run the GEMV with a partial last block"
    torch.manual_seed(n)
    w = torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16) / 64
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)

    def two_products():
        return lin.linear(lin.linear(x, w)[:, :4096], w)

    monkeypatch.setenv("PRISM_PDL", "0")
    plain = two_products()
    monkeypatch.delenv("PRISM_PDL")
    assert torch.equal(two_products(), plain)
