"""Sweep the paged decode kernel's launch settings on the GPU (run by hand), FP8 and bf16 KV:
batch 8 x 16k context (KV-bound) and batch 1 x 1.7k (latency-bound), 8B attention shape.

    python benchmarks/sweep_decode.py [8x16384 32x1700 ...]

Small shapes are timed with their Python launch overhead (graph replay removes it in the engine).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import cuda_time  # noqa: E402

from ops import AttentionMetadata, KVLayerCache  # noqa: E402
from ops import triton_kernels as tk  # noqa: E402


def setup(batch, ctx, kv, hq=32, hkv=8, d=128, page=16):
    pages = batch * -(-ctx // page)
    tables = [list(range(b * pages // batch, (b + 1) * pages // batch)) for b in range(batch)]
    slots = [t[-1] * page for t in tables]
    meta = AttentionMetadata.build([1] * batch, [ctx] * batch, tables, slots, "cuda")
    cache = KVLayerCache.allocate(pages, page, hkv, d, kv, torch.bfloat16, "cuda")
    cache.k_cache.view(torch.uint8).random_(0, 120)
    cache.v_cache.view(torch.uint8).random_(0, 120)
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device="cuda")
    return q, cache, meta


def main() -> int:
    results = []
    shapes = [tuple(map(int, x.split('x'))) for x in sys.argv[1:]] or [(8, 16384), (1, 1700), (32, 1700)]
    for batch, ctx in shapes:
        for kv in ("fp8_e4m3", "auto"):
            q, cache, meta = setup(batch, ctx, kv)
            kv_bytes = 2 * batch * ctx * 8 * 128 * (1 if kv != "auto" else 2)
            best = None
            for bn, warps, stages, waves in itertools.product((32, 64, 128), (4, 8), (2, 3), (2, 4, 8)):
                try:
                    splits = tk.decode_splits(batch, 8, ctx, bn, waves=waves)
                    args = dict(num_splits=splits, block_n=bn, num_warps=warps, num_stages=stages)
                    ms = cuda_time(lambda a=args, x=(q, cache, meta): tk.paged_decode_attention(*x, **a), repeats=20)
                except Exception as exc:  # a config that does not compile or fit
                    print(f"  skip bn={bn} w={warps} st={stages}: {type(exc).__name__}")
                    continue
                row = (ms, bn, warps, stages, waves)
                best = min(best, row) if best else row
            ms, bn, warps, stages, waves = best
            print(f"batch {batch} ctx {ctx} {kv}: best {ms * 1e3:.1f} us (block_n {bn}, warps {warps}, "
                  f"stages {stages}, waves {waves}) = {kv_bytes / ms / 1e9:.2f} TB/s")
            results.append((batch, ctx, kv, best))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
