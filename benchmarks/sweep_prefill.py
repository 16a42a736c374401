"""Sweep the paged prefill kernel's launch settings on the GPU (run by hand): a cold prompt of
1,662 new tokens (eight photos) and a 4k one, 8B attention shape, FP8 and bf16 pages.

    python benchmarks/sweep_prefill.py [1x1662 1x4096 ...]

Each setting is timed inside a CUDA graph, checked against the default setting's output, and
reported with its causal-attention rate (4 * T^2 / 2 * head_dim * query heads FLOPs).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import graph_time  # noqa: E402

from ops import AttentionMetadata, KVLayerCache  # noqa: E402
from ops import triton_kernels as tk  # noqa: E402

SETTINGS = dict(rows=(64, 128), block_n=(32, 64), num_warps=(4, 8), num_stages=(2, 3))


def setup(batch: int, tokens: int, kv: str, hq=32, hkv=8, d=128, page=16):
    """``batch`` cold prompts of ``tokens`` new tokens each, their K/V already in the pages."""
    per_seq = -(-tokens // page)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    slots = [t[i // page] * page + i % page for t in tables for i in range(tokens)]
    meta = AttentionMetadata.build([tokens] * batch, [tokens] * batch, tables, slots, "cuda")
    cache = KVLayerCache.allocate(batch * per_seq, page, hkv, d, kv, torch.bfloat16, "cuda")
    if cache.is_fp8:
        cache.k_cache.view(torch.uint8).random_(0, 120)
        cache.v_cache.view(torch.uint8).random_(0, 120)
        cache.k_scale.uniform_(0.01, 0.02)
        cache.v_scale.uniform_(0.01, 0.02)
    else:
        cache.k_cache.normal_()
        cache.v_cache.normal_()
    q = torch.randn(batch * tokens, hq, d, dtype=torch.bfloat16, device="cuda")
    return q, cache, meta


def main() -> int:
    shapes = [tuple(map(int, x.split("x"))) for x in sys.argv[1:]] or [(1, 1662), (1, 4096)]
    for batch, tokens in shapes:
        for kv in ("fp8_e4m3", "auto"):
            sweep_case(batch, tokens, kv)
    return 0


def sweep_case(batch: int, tokens: int, kv: str) -> None:
    q, cache, meta = setup(batch, tokens, kv)
    flops = batch * 4 * tokens * tokens / 2 * q.shape[2] * q.shape[1]
    ref = tk.paged_attention(q, cache, meta)
    base = graph_time(lambda: tk.paged_attention(q, cache, meta))
    default = tk.PREFILL_CONFIG["fp8" if cache.is_fp8 else "bf16"]
    print(f"\n{batch} x {tokens} new tokens, {kv} pages: default {default} "
          f"{base * 1e3:.1f} us ({flops / base / 1e9:.0f} TFLOP/s)", flush=True)
    results = []
    for combo in itertools.product(*SETTINGS.values()):
        kw = dict(zip(SETTINGS, combo, strict=True))
        try:
            out = tk.paged_attention(q, cache, meta, **kw)
            err = (out.float() - ref.float()).abs().max().item()
            ms = graph_time(lambda kw=kw: tk.paged_attention(q, cache, meta, **kw))
        except Exception as exc:  # a setting that does not fit (shared memory, registers)
            print(f"  {kw}: failed ({type(exc).__name__})", flush=True)
            continue
        results.append((ms, kw, err))
        print(f"  {kw}: {ms * 1e3:.1f} us ({flops / ms / 1e9:.0f} TFLOP/s), max diff {err:.2e}", flush=True)
    best = min(results, key=lambda r: r[0])
    print(f"best: {best[1]} {best[0] * 1e3:.1f} us = {base / best[0]:.2f}x the default")
    if cache.is_fp8:
        widen_once(q, cache, meta, ref, base)


def widen_once(q, cache, meta, ref, base: float) -> None:
    """A prototype of the next step (docs/PERFORMANCE.md, v6): the step's FP8 pages widened once,
    scales applied, into float16 pages (plain torch ops here), then the 16-bit kernel over them."""
    def run():
        k = (cache.k_cache.float() * cache.k_scale[..., None]).half()
        v = (cache.v_cache.float() * cache.v_scale[..., None]).half()
        return tk.paged_attention(q.half(), KVLayerCache(k, v), meta)

    err = (run().float() - ref.float()).abs().max().item()
    ms = graph_time(run)
    print(f"widened once into float16 pages, then the 16-bit kernel: {ms * 1e3:.1f} us "
          f"= {base / ms:.2f}x the default, max diff {err:.2e}")


if __name__ == "__main__":
    raise SystemExit(main())
