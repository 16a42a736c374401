"""FP8-MMA decode attention against the current kernels, side by side in one run (GPU, by hand).

    python benchmarks/bench_fp8_decode.py [OUT.json]      # default $OUT/fp8_decode.json, else ./fp8_decode.json

At the 8B attention shape (32 query heads, 8 KV heads, head_dim 128, 16-token pages), batch 8 x 16k
and 32 x 4k contexts, one layer: the same random K/V (normal, bf16) in bf16 pages and in Scaled-FP8
pages (quantised by ``ops.reference.quantize_fp8``), consecutive pages per sequence. Timed, each
call inside a CUDA graph (as the engine's decode step runs it; 20 calls per graph, median of 10
replays, CUDA events):

* ``bf16``: the current kernel over bf16 pages (``DECODE_CONFIG["bf16"]``);
* ``fp8_widen``: the current kernel over FP8 pages (every K/V element widened to 16 bits);
* ``mma_p8``, ``mma_p16``, ``mma_p8_q2``, ``mma_p16_q2``: the FP8-MMA kernel
  (``ops/triton_kernels/fp8_decode.py``; P in E4M3 or float16 against widened V; Q in one or two
  E4M3 terms) over a few launch settings each (:data:`CONFIGS`), a setting that fails to compile
  recorded with its error.

Accuracy per kernel (its default and its fastest setting): ``max |out - ref|`` against float32
attention over the same FP8 pages (``err_vs_fp8_ref``: what the kernel adds) and over the bf16
pages (``err_vs_bf16_ref``: FP8 storage included), with ``max |ref|`` beside them; ``sanity_ok``
says the relative error against the FP8 reference is within :data:`SANITY` (twice the CPU bound
of its variant, tests/test_fp8_mma_decode.py, plus the bf16 output's rounding). Also which matrix
instructions Triton emitted per setting (``wgmma`` / ``mma.sync`` on e4m3, conversions), from the PTX.

Writes ``fp8_attention_speedup`` (8 x 16k) and ``fp8_attention_speedup_32x4k``: bf16 time / the
fastest FP8-MMA time, and the same per variant and for the current FP8 kernel. Needs nothing beyond
the repo (torch, triton); about a minute on the H200.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: ``PRISM_BENCH_SMOKE=1``: a check of this script on the CPU (Triton interpreter, tiny shapes, one
#: wall-clock call instead of graph timing, two settings): its numbers mean nothing.
SMOKE = os.environ.get("PRISM_BENCH_SMOKE") == "1"
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

from ops import AttentionMetadata, KVLayerCache  # noqa: E402
from ops import reference as ref  # noqa: E402
from ops import triton_kernels as tk  # noqa: E402
from ops.triton_kernels import fp8_decode  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
SHAPES = {"8x16k": (8, 16384), "32x4k": (32, 4096)}
DEVICE = "cpu" if SMOKE else "cuda"
if SMOKE:
    SHAPES = {"8x16k": (2, 64), "32x4k": (3, 32)}

#: Launch settings tried per FP8-MMA variant: (block_n, num_warps, num_stages, rows, waves). rows 16
#: with 1-2 warps: ``mma.sync`` (m16n8k32 e4m3); rows 64 with 4 warps: the tile Hopper's ``wgmma`` takes.
CONFIGS = [
    (64, 1, 1, 16, 16),  # the current FP8 kernel's settings (MMA_DECODE_CONFIG)
    (64, 1, 2, 16, 16),
    (128, 1, 1, 16, 16),
    (64, 2, 2, 16, 8),
    (64, 4, 2, 64, 8),
    (128, 4, 2, 64, 4),
]

#: Relative error bounds against float32 attention over the same FP8 pages: 2x the CPU test's (qstd 1,
#: contexts up to 4k) plus 2^-8, the bf16 output's own rounding (half an ulp of the largest value).
SANITY = {k: 2 * v + 2.0**-8 for k, v in
          {"fp8_widen": 0.01, "mma_p8": 0.052, "mma_p16": 0.037, "mma_p8_q2": 0.029, "mma_p16_q2": 0.0013}.items()}


def log(*a):
    print(*a, flush=True)


def graph_ms(fn, calls: int = 20, repeats: int = 10) -> float:
    """Median milliseconds of one ``fn()``: ``calls`` calls captured in one CUDA graph, replayed."""
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def setup(batch: int, ctx: int, seed: int = 0):
    """bf16 and FP8 pools holding the same random K/V, decode metadata and bf16 queries."""
    torch.manual_seed(seed)
    pages = batch * ctx // PAGE
    tables = [list(range(b * ctx // PAGE, (b + 1) * ctx // PAGE)) for b in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [ctx] * batch, tables, [-1] * batch, DEVICE)
    b16 = KVLayerCache.allocate(pages, PAGE, HKV, D, "auto", torch.bfloat16, DEVICE)
    fp8 = KVLayerCache.allocate(pages, PAGE, HKV, D, "fp8", torch.bfloat16, DEVICE)
    step = 1024  # pages quantised at a time (bounded float32 temporaries)
    for x16, x8, xs in ((b16.k_cache, fp8.k_cache, fp8.k_scale), (b16.v_cache, fp8.v_cache, fp8.v_scale)):
        x16.normal_()
        for p0 in range(0, pages, step):
            q8, s = ref.quantize_fp8(x16[p0:p0 + step])
            x8.view(torch.uint8)[p0:p0 + step] = q8.view(torch.uint8)
            xs[p0:p0 + step] = s
    q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device=DEVICE)
    return q, b16, fp8, meta


def compiled_ptx() -> dict[int, str]:
    """PTX of every compiled FP8-MMA decode kernel, by object id (Triton internals: {} if they moved)."""
    out = {}
    try:
        for entry in fp8_decode._fp8_mma_decode_kernel.device_caches.values():
            for kernel in entry[0].values():
                out[id(kernel)] = kernel.asm.get("ptx", "")
    except Exception:  # noqa: BLE001 - only a report
        return {}
    return out


def instructions(ptx: str) -> dict:
    return {
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "mma_e4m3": len(re.findall(r"mma\.sync\.aligned\.\S*e4m3", ptx)),
        "mma_f16": len(re.findall(r"mma\.sync\.aligned\.\S*f16\.f16", ptx)),
        "cvt_from_e4m3": len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)),
        "cvt_to_e4m3": len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2", ptx)),
    }


def max_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.float() - want).abs().max())


def run_shape(name: str, batch: int, ctx: int) -> dict:
    t0 = time.time()
    q, b16, fp8, meta = setup(batch, ctx)
    ref_fp8 = ref.paged_decode_attention(q.float(), fp8, meta).float()
    ref_b16 = ref.paged_decode_attention(q.float(), b16, meta).float()
    scale = float(ref_fp8.abs().max())
    res = {"batch": batch, "context": ctx, "max_abs_ref": scale, "kernels": {}}

    def accuracy(out: torch.Tensor, variant: str) -> dict:
        e8, e16 = max_err(out, ref_fp8), max_err(out, ref_b16)
        return {"err_vs_fp8_ref": e8, "err_vs_bf16_ref": e16, "rel_err_vs_fp8_ref": e8 / scale,
                "sanity_ok": bool(e8 / scale <= SANITY[variant])}

    bf16_ms = graph_ms(lambda: tk.paged_decode_attention(q, b16, meta))
    res["kernels"]["bf16"] = {"ms": bf16_ms, "err_vs_bf16_ref": max_err(tk.paged_decode_attention(q, b16, meta),
                                                                       ref_b16)}
    old_ms = graph_ms(lambda: tk.paged_decode_attention(q, fp8, meta))
    res["kernels"]["fp8_widen"] = {"ms": old_ms, **accuracy(tk.paged_decode_attention(q, fp8, meta), "fp8_widen")}
    log(f"[{name}] bf16 {bf16_ms * 1e3:.1f} us, fp8 widen {old_ms * 1e3:.1f} us")
    for variant, (p_fp8, q_terms) in tk.MMA_VARIANTS.items():
        runs = []
        for bn, warps, stages, rows, waves in CONFIGS[::3] if SMOKE else CONFIGS:
            splits = tk.mma_decode_splits(batch, HKV, ctx, bn, waves)
            kw = dict(num_splits=splits, p_fp8=p_fp8, q_terms=q_terms, block_n=bn, num_warps=warps,
                      num_stages=stages, rows=rows)
            row = {"block_n": bn, "num_warps": warps, "num_stages": stages, "rows": rows, "waves": waves,
                   "splits": splits}
            before = compiled_ptx()
            try:
                row["ms"] = graph_ms(lambda kw=kw: tk.paged_decode_attention_fp8_mma(q, fp8, meta, **kw))
            except Exception as exc:  # noqa: BLE001 - a setting that does not compile is a result
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                log(f"[{name}] {variant} {row}: FAILED")
                runs.append(row)
                continue
            new = [ptx for k, ptx in compiled_ptx().items() if k not in before]
            if new:
                row["ptx"] = instructions(new[0])
            if not runs or all("ms" not in r for r in runs):  # the first setting that runs: the default's
                row.update(accuracy(tk.paged_decode_attention_fp8_mma(q, fp8, meta, **kw), variant))
            runs.append(row)
            log(f"[{name}] {variant} bn={bn} w={warps} st={stages} rows={rows} splits={splits}: "
                f"{row['ms'] * 1e3:.1f} us {row.get('ptx', '')}")
        ok = [r for r in runs if "ms" in r]
        entry = {"configs": runs}
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            kw = dict(num_splits=best["splits"], p_fp8=p_fp8, q_terms=q_terms, block_n=best["block_n"],
                      num_warps=best["num_warps"], num_stages=best["num_stages"], rows=best["rows"])
            entry.update({"ms": best["ms"], "best": {k: best[k] for k in ("block_n", "num_warps", "num_stages",
                                                                           "rows", "waves", "splits")},
                          **accuracy(tk.paged_decode_attention_fp8_mma(q, fp8, meta, **kw), variant)})
        res["kernels"][variant] = entry
    timed = {v: res["kernels"][v]["ms"] for v in tk.MMA_VARIANTS if "ms" in res["kernels"][v]}
    res["speedup_vs_bf16"] = {k: bf16_ms / v["ms"] for k, v in res["kernels"].items() if "ms" in v}
    if timed:
        fastest = min(timed, key=timed.get)
        res["fastest_mma"] = fastest
        res["fp8_attention_speedup"] = bf16_ms / timed[fastest]
    res["fp8_attention_speedup_old"] = bf16_ms / old_ms
    res["seconds"] = time.time() - t0
    return res


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = pathlib.Path(argv[0]) if argv else pathlib.Path(os.environ.get("OUT", ".")) / "fp8_decode.json"
    if not SMOKE and not torch.cuda.is_available():
        log("bench_fp8_decode needs a CUDA GPU")
        return 2
    import triton

    result = {
        "device": "cpu (PRISM_BENCH_SMOKE)" if SMOKE else torch.cuda.get_device_name(),
        "capability": [0, 0] if SMOKE else list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fp8_mma_supported": tk.fp8_mma_supported(DEVICE),
        "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "page": PAGE},
        "shapes": {},
    }
    if not result["fp8_mma_supported"]:
        log(f"no FP8 matrix units on {result['device']} (capability {result['capability']})")
    for name, (batch, ctx) in SHAPES.items():
        result["shapes"][name] = run_shape(name, batch, ctx)
        if not SMOKE:
            torch.cuda.empty_cache()  # the shape's pools are gone with run_shape's frame
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))  # what is measured so far survives a later failure
    s8, s32 = result["shapes"]["8x16k"], result["shapes"]["32x4k"]
    for key, shape in (("fp8_attention_speedup", s8), ("fp8_attention_speedup_32x4k", s32)):
        if "fp8_attention_speedup" in shape:
            result[key] = shape["fp8_attention_speedup"]
        result[key + "_old"] = shape["fp8_attention_speedup_old"]
        for variant in tk.MMA_VARIANTS:
            if variant in shape["speedup_vs_bf16"]:
                result[f"{key}_{variant}"] = shape["speedup_vs_bf16"][variant]
    out.write_text(json.dumps(result, indent=1))
    log("")
    for name, shape in result["shapes"].items():
        log(f"{name}: max |ref| {shape['max_abs_ref']:.3g}")
        for k, v in shape["kernels"].items():
            acc = (f" err vs fp8 ref {v['err_vs_fp8_ref']:.3g} (rel {v['rel_err_vs_fp8_ref']:.3g}, "
                   f"sanity {'ok' if v['sanity_ok'] else 'FAIL'}), vs bf16 ref {v['err_vs_bf16_ref']:.3g}"
                   if "err_vs_fp8_ref" in v else "")
            ms = f"{v['ms'] * 1e3:7.1f} us  x{shape['speedup_vs_bf16'][k]:.2f} vs bf16" if "ms" in v else "no run"
            log(f"  {k:11s} {ms}{acc} {v.get('best', '')}")
    log(f"fp8_attention_speedup {result.get('fp8_attention_speedup')} (old {result['fp8_attention_speedup_old']:.3f}), "
        f"32x4k {result.get('fp8_attention_speedup_32x4k')} (old {result['fp8_attention_speedup_32x4k_old']:.3f})")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
