"""FP8-MMA decode attention against the current kernels, per batch x context point (GPU, by hand).

    python benchmarks/bench_fp8_decode.py [OUT.json] [--points 8x16k,32x4k] [--budget-s 240]
    python benchmarks/bench_fp8_decode.py --table OUT.json   # print its DECODE_KERNEL_TABLE literal

Default OUT: ``$OUT/fp8_decode.json``, else ``./fp8_decode.json``. At the 8B attention shape (32
query heads, 8 KV heads, head_dim 128, 16-token pages), one layer, at each point of :data:`POINTS`
(batch x context: 1x2k, 8x2k, 32x2k, 32x4k, 8x16k): the same random K/V (normal, bf16) in bf16 pages
and in Scaled-FP8 pages (quantised by ``ops.reference.quantize_fp8``), consecutive pages per
sequence, every sequence the point's context. Each launch goes through :class:`ops.dispatch.DecodePlan`
(what the engine and its decode graphs run), timed inside a CUDA graph (20 calls per graph, median
of 10 replays, CUDA events):

* ``bf16``: the current kernel over bf16 pages; ``fp8_widen``: the current kernel over FP8 pages
  (every K/V element widened to 16 bits); both with their ``DECODE_CONFIG``;
* ``mma_p8`` / ``mma_p16``: the FP8-MMA kernel with the GQA group as M (``fp8_decode.py``) over
  :data:`MMA_CONFIGS`;
* ``kam_p8`` / ``kam_p16``: keys as M (``fp8_decode_kam.py``) over :data:`KAM_CONFIGS` (``block_n``
  64/128, 4/8 warps, 1-3 stages, PV as ``V^T P^T``; two with ``P V``) x :data:`WAVES` (context
  splits; settings that give the same split are timed once);
* the two-term-Q variants (``*_q2``) at their one-term sibling's fastest setting only.

A setting that fails to compile is recorded with its error. Accuracy per variant at its fastest
setting: ``max |out - ref|`` against float32 attention over the same FP8 pages (``err_vs_fp8_ref``)
and over the bf16 pages (``err_vs_bf16_ref``), ``sanity_ok`` when the relative error against the FP8
reference is within :data:`SANITY`. Which matrix instructions Triton emitted per setting (``wgmma``,
``mma.sync`` on e4m3 or f16, conversions) from the PTX: on sm_90 Triton lowers an FP8 ``tl.dot`` it
cannot give ``wgmma`` to float16 ``mma.sync`` after widening the operands (what the 16-row settings
of docs/gpu/fp8_decode_v1.json show: ``mma_e4m3`` 0, ``mma_f16`` > 0), so ``wgmma`` > 0 is what
"on the FP8 tensor cores" means here.

Per point, ``best``: the fastest kernel that passed its check (``fp8_widen`` included), with its
settings and its speedup vs bf16 pages, vs the current FP8 kernel and vs the best group-as-M
setting; ``best_mma``: the same for the fastest FP8-MMA kernel alone. The top-level ``table`` has
one entry per point for :func:`ops.dispatch.decode_table_from_bench` (``PRISM_DECODE_TABLE=OUT.json``
runs the engine with it; ``--table`` prints the literal for ``ops/dispatch.py``). Its settings'
``waves`` give the measured split only where the engine's graphs cap the context at the point's
(graphs split for their longest context). Top level also:
``fp8_attention_speedup`` (8 x 16k) and ``fp8_attention_speedup_32x4k`` (bf16 time / the fastest
FP8-MMA time that passed), per variant too. Needs nothing beyond the repo (torch, triton); the
sweep stops timing new settings after ``--budget-s`` seconds (200 by default; about 3 minutes on the
H200 expected, most of it compiling ~40 kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import pprint
import re
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: ``PRISM_BENCH_SMOKE=1``: a check of this script on the CPU (Triton interpreter, tiny shapes, one
#: wall-clock call instead of graph timing, a few settings): its numbers mean nothing.
SMOKE = os.environ.get("PRISM_BENCH_SMOKE") == "1"
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

from ops import AttentionMetadata, KVLayerCache, dispatch  # noqa: E402
from ops import reference as ref  # noqa: E402
from ops import triton_kernels as tk  # noqa: E402
from ops.triton_kernels import fp8_decode, fp8_decode_kam  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
#: batch x context points: the issue's two (8x16k, 32x4k) and short contexts at batch 1 / 8 / 32.
POINTS = {"1x2k": (1, 2048), "8x2k": (8, 2048), "32x2k": (32, 2048), "32x4k": (32, 4096), "8x16k": (8, 16384)}
DEVICE = "cpu" if SMOKE else "cuda"
if SMOKE:
    HQ, HKV, D = 8, 2, 64
    POINTS = {"8x16k": (2, 64), "32x4k": (3, 32)}

#: Group-as-M settings: (block_n, num_warps, num_stages, rows, waves). The 16-row ``mma.sync`` ones
#: (the fastest in docs/gpu/fp8_decode_v1.json; its 64-row ``wgmma`` ones were 2-3x slower).
MMA_CONFIGS = [(64, 1, 1, 16, 16), (64, 1, 2, 16, 16), (128, 1, 1, 16, 16), (64, 2, 2, 16, 8)]
#: Keys-as-M settings: (block_n, num_warps, num_stages, pv_t); each timed at every :data:`WAVES`.
KAM_CONFIGS = [(bn, w, st, True) for bn in (64, 128) for w in (4, 8) for st in (1, 2, 3)] + [
    (64, 4, 2, False), (128, 4, 2, False)]
WAVES = (2, 4, 8)
if SMOKE:
    MMA_CONFIGS, KAM_CONFIGS, WAVES = MMA_CONFIGS[:1], [(32, 4, 1, True), (64, 4, 1, False)], (2,)
ONE_TERM = {"mma_p8_q2": "mma_p8", "mma_p16_q2": "mma_p16", "kam_p8_q2": "kam_p8", "kam_p16_q2": "kam_p16"}

#: Relative error bounds against float32 attention over the same FP8 pages: 2x the CPU test's (qstd 1,
#: contexts up to 4k; tests/test_fp8_mma_decode.py) plus 2^-8, the bf16 output's own rounding.
_BOUNDS = {"fp8_widen": 0.01, "p8": 0.052, "p16": 0.037, "p8_q2": 0.029, "p16_q2": 0.0013}
SANITY = {"fp8_widen": 2 * _BOUNDS["fp8_widen"] + 2.0**-8}
SANITY.update({f"{fam}_{v}": 2 * b + 2.0**-8 for fam in ("mma", "kam") for v, b in _BOUNDS.items() if v != "fp8_widen"})


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


_KERNELS = {"mma": fp8_decode._fp8_mma_decode_kernel, "kam": fp8_decode_kam._fp8_kam_decode_kernel}


def compiled_ptx(family: str) -> dict[int, str]:
    """PTX of every compiled kernel of ``family`` (``"mma"`` / ``"kam"``), by object id (Triton
    internals: {} if they moved)."""
    out = {}
    try:
        for entry in _KERNELS[family].device_caches.values():
            for kernel in entry[0].values():
                out[id(kernel)] = kernel.asm.get("ptx", "")
    except Exception:  # noqa: BLE001 - only a report
        return {}
    return out


def instructions(ptx: str) -> dict:
    return {
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "wgmma_e4m3": len(re.findall(r"wgmma\.mma_async\S*e4m3", ptx)),
        "mma_e4m3": len(re.findall(r"mma\.sync\.aligned\.\S*e4m3", ptx)),
        "mma_f16": len(re.findall(r"mma\.sync\.aligned\.\S*f16\.f16", ptx)),
        "cvt_from_e4m3": len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)),
        "cvt_to_e4m3": len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2", ptx)),
    }


def max_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.float() - want).abs().max())


def settings_of(variant: str, setting: tuple) -> dict:
    """A sweep tuple as :class:`ops.dispatch.DecodePlan` settings."""
    if variant.startswith("kam"):
        bn, warps, stages, pv_t, waves = setting
        return {"block_n": bn, "num_warps": warps, "num_stages": stages, "pv_t": pv_t, "waves": waves}
    bn, warps, stages, rows, waves = setting
    return {"block_n": bn, "num_warps": warps, "num_stages": stages, "rows": rows, "waves": waves}


class Sweep:
    """One point's timings: plans timed, accuracy, the clock of the whole run's budget."""

    def __init__(self, name: str, batch: int, ctx: int, deadline: float):
        self.name, self.batch, self.ctx, self.deadline = name, batch, ctx, deadline
        self.q, self.b16, self.fp8, self.meta = setup(batch, ctx)
        self.ref_fp8 = ref.paged_decode_attention(self.q.float(), self.fp8, self.meta).float()
        self.ref_b16 = ref.paged_decode_attention(self.q.float(), self.b16, self.meta).float()
        self.scale = float(self.ref_fp8.abs().max())

    def plan(self, kernel: str, settings: dict) -> dispatch.DecodePlan:
        splits = dispatch.decode_splits_for(kernel, settings, self.batch, HKV, self.ctx, True)
        return dispatch.DecodePlan(kernel, settings, splits)

    def accuracy(self, out: torch.Tensor, variant: str) -> dict:
        e8, e16 = max_err(out, self.ref_fp8), max_err(out, self.ref_b16)
        return {"err_vs_fp8_ref": e8, "err_vs_bf16_ref": e16, "rel_err_vs_fp8_ref": e8 / self.scale,
                "sanity_ok": bool(e8 / self.scale <= SANITY[variant])}

    def time_variant(self, variant: str, settings_list: list[dict]) -> dict:
        """Time ``variant`` at each of ``settings_list`` (one per distinct split); the fastest's accuracy."""
        family = "kam" if variant.startswith("kam") else "mma"
        runs, seen = [], set()
        for settings in settings_list:
            plan = self.plan(variant, settings)
            key = (tuple(sorted((k, v) for k, v in settings.items() if k != "waves")), plan.num_splits)
            if key in seen:
                continue
            seen.add(key)
            row = {**settings, "splits": plan.num_splits}
            if time.time() > self.deadline:
                row["skipped"] = "time budget"
                runs.append(row)
                continue
            before = compiled_ptx(family)
            try:
                row["ms"] = graph_ms(lambda plan=plan: plan(self.q, self.fp8, self.meta))
            except Exception as exc:  # noqa: BLE001 - a setting that does not compile is a result
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                log(f"[{self.name}] {variant} {row}: FAILED")
                runs.append(row)
                continue
            new = [ptx for k, ptx in compiled_ptx(family).items() if k not in before]
            if new:
                row["ptx"] = instructions(new[0])
            runs.append(row)
            log(f"[{self.name}] {variant} {settings} splits={plan.num_splits}: {row['ms'] * 1e3:.1f} us "
                f"{row.get('ptx', '')}")
        entry = {"configs": runs}
        ok = [r for r in runs if "ms" in r]
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            settings = {k: best[k] for k in settings_list[0]}
            plan = self.plan(variant, settings)
            entry.update({"ms": best["ms"], "settings": settings, "splits": plan.num_splits,
                          **self.accuracy(plan(self.q, self.fp8, self.meta), variant)})
        return entry


def run_point(name: str, batch: int, ctx: int, deadline: float) -> dict:
    t0 = time.time()
    sw = Sweep(name, batch, ctx, deadline)
    res = {"batch": batch, "context": ctx, "max_abs_ref": sw.scale, "kernels": {}}
    current = dispatch.DecodePlan("widen", {}, dispatch.decode_splits_for("widen", {}, batch, HKV, ctx, False))
    bf16_ms = graph_ms(lambda: current(sw.q, sw.b16, sw.meta))
    res["kernels"]["bf16"] = {"ms": bf16_ms, "err_vs_bf16_ref": max_err(current(sw.q, sw.b16, sw.meta), sw.ref_b16)}
    widen = sw.plan("widen", {})
    widen_ms = graph_ms(lambda: widen(sw.q, sw.fp8, sw.meta))
    res["kernels"]["fp8_widen"] = {"ms": widen_ms, "settings": {}, "splits": widen.num_splits,
                                   **sw.accuracy(widen(sw.q, sw.fp8, sw.meta), "fp8_widen")}
    log(f"[{name}] bf16 {bf16_ms * 1e3:.1f} us, fp8 widen {widen_ms * 1e3:.1f} us")
    grids = {
        "mma": [settings_of("mma", c) for c in MMA_CONFIGS],
        "kam": [settings_of("kam", (*c, w)) for c in KAM_CONFIGS for w in WAVES],
    }
    for variant in ("kam_p16", "kam_p8", "mma_p16", "mma_p8"):
        res["kernels"][variant] = sw.time_variant(variant, grids[variant[:3]])
    for variant, sibling in ONE_TERM.items():  # two-term Q: at the sibling's fastest setting only
        if "settings" in res["kernels"][sibling]:
            res["kernels"][variant] = sw.time_variant(variant, [res["kernels"][sibling]["settings"]])
    res["speedup_vs_bf16"] = {k: bf16_ms / v["ms"] for k, v in res["kernels"].items() if "ms" in v}
    passed = {k: v for k, v in res["kernels"].items() if "ms" in v and v.get("sanity_ok") and k != "bf16"}
    mma_passed = {k: v for k, v in passed.items() if k != "fp8_widen"}
    if mma_passed:
        fastest = min(mma_passed, key=lambda k: mma_passed[k]["ms"])
        res["fastest_mma"] = fastest
        res["fp8_attention_speedup"] = bf16_ms / mma_passed[fastest]["ms"]
        top = mma_passed[fastest]
        res["best_mma"] = {"kernel": fastest, "settings": top["settings"], "splits": top["splits"], "ms": top["ms"],
                           "speedup_vs_bf16": bf16_ms / top["ms"], "speedup_vs_fp8_widen": widen_ms / top["ms"]}
    res["fp8_attention_speedup_old"] = bf16_ms / widen_ms
    group_as_m = [v["ms"] for k, v in passed.items() if k.startswith("mma")]
    if passed:
        name_best = min(passed, key=lambda k: passed[k]["ms"])
        best = passed[name_best]
        res["best"] = {"kernel": "widen" if name_best == "fp8_widen" else name_best, "settings": best["settings"],
                       "splits": best["splits"], "ms": best["ms"], "speedup_vs_bf16": bf16_ms / best["ms"],
                       "speedup_vs_fp8_widen": widen_ms / best["ms"],
                       "speedup_vs_group_as_m": min(group_as_m) / best["ms"] if group_as_m else None}
    res["seconds"] = time.time() - t0
    return res


def table_entries(points: dict) -> list[dict]:
    """One :data:`ops.dispatch.DECODE_KERNEL_TABLE` entry per measured point (its ``best``); points
    sharing a bucket keep the larger context's (the engine's graphs split for their longest)."""
    out = {}
    for res in sorted(points.values(), key=lambda r: (r["batch"], r["context"])):
        if "best" not in res:
            continue
        bb, cb = dispatch.decode_buckets(res["batch"], res["context"])
        out["fp8", bb, cb] = {"page_format": "fp8", "batch_bucket": bb, "context_bucket": cb,
                              "kernel": res["best"]["kernel"], "settings": res["best"]["settings"],
                              "measured": f"{res['batch']}x{res['context']}"}
    return list(out.values())


def print_table(path: str) -> int:
    table = dispatch.decode_table_from_bench(path)
    print("DECODE_KERNEL_TABLE: dict[tuple[str, int, int], tuple[str, dict]] = " + pprint.pformat(table, width=110))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", help="JSON path (default $OUT/fp8_decode.json or ./fp8_decode.json)")
    ap.add_argument("--points", help=f"comma-separated subset of {','.join(POINTS)}")
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop timing new settings after this long")
    ap.add_argument("--table", metavar="JSON", help="print the DECODE_KERNEL_TABLE literal of a result, exit")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.table:
        return print_table(args.table)
    out = pathlib.Path(args.out) if args.out else pathlib.Path(os.environ.get("OUT", ".")) / "fp8_decode.json"
    points = POINTS if not args.points else {k: POINTS[k] for k in args.points.split(",")}
    if not SMOKE and not torch.cuda.is_available():
        log("bench_fp8_decode needs a CUDA GPU")
        return 2
    import triton

    t0 = time.time()
    result = {
        "device": "cpu (PRISM_BENCH_SMOKE)" if SMOKE else torch.cuda.get_device_name(),
        "capability": [0, 0] if SMOKE else list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fp8_mma_supported": tk.fp8_mma_supported(DEVICE),
        "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "page": PAGE},
        "budget_s": args.budget_s,
        "shapes": {},
    }
    if not result["fp8_mma_supported"]:
        log(f"no FP8 matrix units on {result['device']} (capability {result['capability']})")
    # the issue's two points first: they get the budget before the short contexts do
    order = sorted(points, key=lambda k: (k not in ("8x16k", "32x4k"), k))
    for name in order:
        batch, ctx = points[name]
        result["shapes"][name] = run_point(name, batch, ctx, t0 + args.budget_s)
        if not SMOKE:
            torch.cuda.empty_cache()  # the point's pools are gone with run_point's frame
        result["table"] = table_entries(result["shapes"])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))  # what is measured so far survives a later failure
    for key, name in (("fp8_attention_speedup", "8x16k"), ("fp8_attention_speedup_32x4k", "32x4k")):
        shape = result["shapes"].get(name)
        if shape is None:
            continue
        if "fp8_attention_speedup" in shape:
            result[key] = shape["fp8_attention_speedup"]
        result[key + "_old"] = shape["fp8_attention_speedup_old"]
        for variant, speedup in shape["speedup_vs_bf16"].items():
            if variant not in ("bf16", "fp8_widen"):
                result[f"{key}_{variant}"] = speedup
    result["seconds"] = time.time() - t0
    out.write_text(json.dumps(result, indent=1))
    log("")
    for name, shape in result["shapes"].items():
        log(f"{name}: max |ref| {shape['max_abs_ref']:.3g}")
        for k, v in shape["kernels"].items():
            acc = (f" err vs fp8 ref {v['err_vs_fp8_ref']:.3g} (rel {v['rel_err_vs_fp8_ref']:.3g}, "
                   f"sanity {'ok' if v['sanity_ok'] else 'FAIL'}), vs bf16 ref {v['err_vs_bf16_ref']:.3g}"
                   if "err_vs_fp8_ref" in v else "")
            ms = f"{v['ms'] * 1e3:7.1f} us  x{shape['speedup_vs_bf16'][k]:.2f} vs bf16" if "ms" in v else "no run"
            log(f"  {k:11s} {ms}{acc} {v.get('settings', '')}")
        log(f"  best: {shape.get('best')}")
        log(f"  best FP8-MMA: {shape.get('best_mma')}")
    log(f"fp8_attention_speedup {result.get('fp8_attention_speedup')} "
        f"(old {result.get('fp8_attention_speedup_old')}), 32x4k {result.get('fp8_attention_speedup_32x4k')} "
        f"(old {result.get('fp8_attention_speedup_32x4k_old')}); {result['seconds']:.0f} s")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
