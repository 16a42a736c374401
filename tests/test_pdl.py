"""Programmatic dependent launch (ops/pdl.py): when it is on, and that the decode kernels chained
with it, eagerly and inside a CUDA graph, give bit for bit what they give without it."""

from __future__ import annotations

import pytest
import torch

from ops import AttentionMetadata, KVLayerCache, pdl

CUDA = torch.cuda.is_available()
HOPPER = CUDA and torch.cuda.get_device_capability()[0] >= 9


def test_off_for_cpu_tensors():
    x = torch.zeros(4)
    assert not pdl.enabled(x)
    assert pdl.launch_args(x) == {"PDL": False}


@pytest.mark.skipif(not HOPPER, reason="PDL needs a GPU of compute capability 9.0 or later")
def test_on_for_hopper_unless_turned_off(monkeypatch):
    """On the GPU the benchmarks run on, PDL must really be on (a Triton without ``launch_pdl``
    would silently measure the plain launches); ``PRISM_PDL=0`` turns it off."""
    x = torch.zeros(4, device="cuda")
    assert pdl.launch_args(x) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("PRISM_PDL", "0")
    assert pdl.launch_args(x) == {"PDL": False}


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


@pytest.mark.skipif(not HOPPER, reason="PDL needs a GPU of compute capability 9.0 or later")
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


@pytest.mark.skipif(not HOPPER, reason="PDL needs a GPU of compute capability 9.0 or later")
@pytest.mark.parametrize("n", [1000, 16400])
def test_gemv_agrees(n, monkeypatch):
    """The GEMV launched with PDL gives what it gives with plain launches, one and several rows
    (and a last program with fewer rows when ``n`` is not a multiple of the block)."""
    from ops.linear import linear

    torch.manual_seed(n)
    w = torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 3):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        monkeypatch.setenv("PRISM_PDL", "0")
        plain = linear(x, w)
        monkeypatch.delenv("PRISM_PDL")
        assert torch.equal(linear(x, w), plain)
