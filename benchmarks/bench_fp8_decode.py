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

Each point's variants are swept in worker processes, one per group of :data:`GROUPS` (the suspect
``kam_p8*`` last, alone), each appending every measured setting to a JSON-lines log
(``OUT.rows/POINT.GROUP.jsonl``) as it goes; a worker stops at its first CUDA error (a dead context
fails every later launch) and is restarted for the rest, a variant's settings being skipped after
:data:`MAX_CUDA_ERRORS` such errors. A setting that fails (compile or launch) is recorded with its error.

Accuracy per variant at its fastest setting: ``max |out - ref|`` against float32 attention over the
same FP8 pages (``err_vs_fp8_ref``) and over the bf16 pages (``err_vs_bf16_ref``), ``sanity_ok``
when the relative error against the FP8 reference is within :data:`SANITY`. Which matrix
instructions Triton emitted per setting (``wgmma``, ``mma.sync`` on e4m3 or f16, conversions) from
the PTX: on sm_90 Triton lowers an FP8 ``tl.dot`` it cannot give ``wgmma`` to float16 ``mma.sync``
after widening the operands (what the 16-row settings of docs/gpu/fp8_decode_v1.json show:
``mma_e4m3`` 0, ``mma_f16`` > 0), so ``wgmma`` > 0 is what "on the FP8 tensor cores" means here.

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
import subprocess
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


def compiled_kernels(family: str) -> dict[int, object]:
    """Every compiled kernel of ``family`` (``"mma"`` / ``"kam"``) in this process, Triton's
    ``CompiledKernel`` objects by object id (Triton internals: {} if they moved, or under the
    interpreter)."""
    out = {}
    try:
        for entry in _KERNELS[family].device_caches.values():
            for kernel in entry[0].values():
                out[id(kernel)] = kernel
    except Exception:  # noqa: BLE001 - only a report
        return {}
    return out


def compiled_ptx(family: str) -> dict[int, str]:
    """PTX of every compiled kernel of ``family``, by object id (see :func:`compiled_kernels`)."""
    return {k: kernel.asm.get("ptx", "") for k, kernel in compiled_kernels(family).items()}


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


#: Variant groups: each point's groups are swept in processes of their own, in this order. A kernel
#: that poisons the CUDA context (kam_p8's first setting did, on the H200: docs/gpu/fp8_decode_kam_dbg_v1.txt)
#: then costs only the rest of its own group, and only until the worker is restarted: the suspect
#: kam_p8 family last, alone. Two-term-Q variants follow their one-term sibling in the same group.
GROUPS = (("bf16", "fp8_widen", "kam_p16", "mma_p16", "mma_p8", "kam_p16_q2", "mma_p16_q2", "mma_p8_q2"),
          ("kam_p8", "kam_p8_q2"))
#: CUDA errors a variant may raise before its remaining settings are skipped (each costs a restart).
MAX_CUDA_ERRORS = 2
#: ``PRISM_BENCH_CRASH=kam_p8,...``: those variants raise a CUDA-like error at each launch (the CPU
#: test of the recovery; a worker treats it as a dead context).
CRASH = set(filter(None, os.environ.get("PRISM_BENCH_CRASH", "").split(",")))
_SETTING_KEYS = {"kam": ("block_n", "num_warps", "num_stages", "pv_t", "waves"),
                 "mma": ("block_n", "num_warps", "num_stages", "rows", "waves")}


def family(variant: str) -> str:
    return "kam" if variant.startswith("kam") else "mma"


def context_dead(exc: BaseException) -> bool:
    """Whether ``exc`` left the process's CUDA context unusable (every later launch would fail)."""
    text = f"{type(exc).__name__}: {exc}"
    if "[CUDA]" in text or "CUDA error" in text or type(exc).__name__ == "AcceleratorError":
        return True
    if SMOKE:
        return False
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - a failing probe is the answer
        return True
    return False


def read_records(path: pathlib.Path) -> list[dict]:
    """A worker's JSON-lines log (what it measured so far; a torn last line is dropped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def close_dangling(records: list[dict], why: str) -> list[dict]:
    """Error rows for settings a dead worker started and never finished (the process died inside the
    launch): they count as CUDA errors of their variant, so a restart skips them."""
    finished = {(r["variant"], r["key"]) for r in records if r["kind"] == "row"}
    return [{"kind": "row", "variant": r["variant"], "key": r["key"],
             "row": {**r["settings"], "error": why, "cuda_error": True}}
            for r in records if r["kind"] == "start" and (r["variant"], r["key"]) not in finished]


def variant_rows(records: list[dict], variant: str) -> dict[str, dict]:
    return {r["key"]: r["row"] for r in records if r["kind"] == "row" and r["variant"] == variant}


def fastest(rows: dict[str, dict]) -> str | None:
    timed = {k: r for k, r in rows.items() if "ms" in r}
    return min(timed, key=lambda k: timed[k]["ms"]) if timed else None


class Sweep:
    """One point in one worker process: its pools, references, and the sweep of some variants,
    each result appended to the worker's log as it is measured."""

    def __init__(self, name: str, batch: int, ctx: int, deadline: float, records: list[dict], emit):
        self.name, self.batch, self.ctx, self.deadline = name, batch, ctx, deadline
        self.records, self._emit = records, emit
        self.q, self.b16, self.fp8, self.meta = setup(batch, ctx)
        self.ref_fp8 = ref.paged_decode_attention(self.q.float(), self.fp8, self.meta).float()
        self.ref_b16 = ref.paged_decode_attention(self.q.float(), self.b16, self.meta).float()
        self.scale = float(self.ref_fp8.abs().max())
        if not any(r["kind"] == "point" for r in records):
            self.emit({"kind": "point", "max_abs_ref": self.scale})

    def emit(self, record: dict):
        self.records.append(record)
        self._emit(record)

    def plan(self, kernel: str, settings: dict) -> dispatch.DecodePlan:
        splits = dispatch.decode_splits_for(kernel, settings, self.batch, HKV, self.ctx, True)
        return dispatch.DecodePlan(kernel, settings, splits)

    def accuracy(self, out: torch.Tensor, variant: str) -> dict:
        e8, e16 = max_err(out, self.ref_fp8), max_err(out, self.ref_b16)
        return {"err_vs_fp8_ref": e8, "err_vs_bf16_ref": e16, "rel_err_vs_fp8_ref": e8 / self.scale,
                "sanity_ok": bool(e8 / self.scale <= SANITY[variant])}

    def grid(self, variant: str) -> list[dict]:
        """The settings to time: the family's sweep, or (two-term Q) the sibling's fastest only."""
        if variant in ONE_TERM:
            rows = variant_rows(self.records, ONE_TERM[variant])
            best = fastest(rows)
            return [] if best is None else [{k: rows[best][k] for k in _SETTING_KEYS[family(variant)]}]
        if family(variant) == "kam":
            return [settings_of("kam", (*c, w)) for c in KAM_CONFIGS for w in WAVES]
        return [settings_of("mma", c) for c in MMA_CONFIGS]

    def run(self, variant: str) -> bool:
        """Sweep ``variant`` (what an earlier worker finished is skipped); False once the CUDA context
        is dead (the worker must exit)."""
        if variant in ("bf16", "fp8_widen"):
            return self.baseline(variant)
        done = variant_rows(self.records, variant)
        fam = family(variant)
        for settings in self.grid(variant):
            plan = self.plan(variant, settings)
            key = json.dumps([sorted((k, v) for k, v in settings.items() if k != "waves"), plan.num_splits])
            if key in done:
                continue
            row = {**settings, "splits": plan.num_splits}
            errors = sum(bool(r.get("cuda_error")) for r in done.values())
            if errors >= MAX_CUDA_ERRORS:
                row["skipped"] = f"after {errors} CUDA errors of {variant}"
            elif time.time() > self.deadline:
                row["skipped"] = "time budget"
            if "skipped" in row:
                done[key] = row
                self.emit({"kind": "row", "variant": variant, "key": key, "row": row})
                continue
            self.emit({"kind": "start", "variant": variant, "key": key, "settings": row})
            before = compiled_ptx(fam)
            try:
                if variant in CRASH:
                    raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered "
                                       "(PRISM_BENCH_CRASH)")
                row["ms"] = graph_ms(lambda plan=plan: plan(self.q, self.fp8, self.meta))
            except Exception as exc:  # noqa: BLE001 - a setting that fails is a result
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                dead = context_dead(exc)
                if dead:
                    row["cuda_error"] = True
                done[key] = row
                self.emit({"kind": "row", "variant": variant, "key": key, "row": row})
                log(f"[{self.name}] {variant} {row}: FAILED" + (" (CUDA context lost)" if dead else ""))
                if dead:
                    return False
                continue
            new = [ptx for k, ptx in compiled_ptx(fam).items() if k not in before]
            if new:
                row["ptx"] = instructions(new[0])
            is_best = fastest(done) is None or row["ms"] < done[fastest(done)]["ms"]
            done[key] = row
            self.emit({"kind": "row", "variant": variant, "key": key, "row": row})
            log(f"[{self.name}] {variant} {settings} splits={plan.num_splits}: {row['ms'] * 1e3:.1f} us "
                f"{row.get('ptx', '')}")
            if is_best:  # the accuracy of every fastest-so-far: the final fastest has one, whichever worker ran it
                try:
                    acc = self.accuracy(plan(self.q, self.fp8, self.meta), variant)
                except Exception as exc:  # noqa: BLE001
                    acc = {"accuracy_error": f"{type(exc).__name__}: {str(exc)[:300]}", "sanity_ok": False}
                    if context_dead(exc):
                        self.emit({"kind": "accuracy", "variant": variant, "key": key, "accuracy": acc})
                        return False
                self.emit({"kind": "accuracy", "variant": variant, "key": key, "accuracy": acc})
        return True

    def baseline(self, variant: str) -> bool:
        """The current kernel over bf16 pages (``bf16``) or over the FP8 pages (``fp8_widen``)."""
        if any(r["kind"] == "baseline" and r["variant"] == variant for r in self.records):
            return True
        pages = self.b16 if variant == "bf16" else self.fp8
        plan = dispatch.DecodePlan("widen", {}, dispatch.decode_splits_for("widen", {}, self.batch, HKV, self.ctx,
                                                                           variant == "fp8_widen"))
        try:
            ms = graph_ms(lambda: plan(self.q, pages, self.meta))
            out = plan(self.q, pages, self.meta)
        except Exception as exc:  # noqa: BLE001
            self.emit({"kind": "baseline", "variant": variant, "entry": {"error": f"{type(exc).__name__}: {exc}"}})
            return not context_dead(exc)
        entry = {"ms": ms, "err_vs_bf16_ref": max_err(out, self.ref_b16)} if variant == "bf16" else {
            "ms": ms, "settings": {}, "splits": plan.num_splits, **self.accuracy(out, variant)}
        self.emit({"kind": "baseline", "variant": variant, "entry": entry})
        log(f"[{self.name}] {variant} {ms * 1e3:.1f} us")
        return True


def worker(spec_path: str) -> int:
    """One group of one point (``--worker SPEC.json``, started by :func:`run_group`): appends to the
    spec's JSON-lines log, resuming after what it already holds. Exit 3: the CUDA context died."""
    spec = json.loads(pathlib.Path(spec_path).read_text())
    path = pathlib.Path(spec["rows"])
    records = read_records(path)
    with path.open("a") as f:
        def emit(record):
            f.write(json.dumps(record) + "\n")
            f.flush()

        sw = Sweep(spec["name"], spec["batch"], spec["ctx"], spec["deadline"], records, emit)
        for variant in spec["variants"]:
            if not sw.run(variant):
                return 3
    return 0


def run_group(name: str, batch: int, ctx: int, group: tuple, deadline: float, path: pathlib.Path) -> list[dict]:
    """Sweep ``group`` at one point in worker processes, restarting one after each that dies (a dead
    CUDA context, a crash), until one finishes; returns the log's records."""
    path.unlink(missing_ok=True)
    spec = path.with_suffix(".spec.json")
    spec.write_text(json.dumps({"name": name, "batch": batch, "ctx": ctx, "deadline": deadline,
                                "variants": list(group), "rows": str(path)}))
    for _ in range(MAX_CUDA_ERRORS * len(group) + 2):
        try:
            rc = subprocess.run([sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", str(spec)],
                                timeout=max(deadline - time.time(), 0) + 600).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        records = read_records(path)
        if rc == 0:
            return records
        dangling = close_dangling(records, f"worker died (exit {rc})")
        with path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in dangling)
        log(f"[{name}] worker of {group[0]}.. exited {rc}; restarting it for the rest")
    return read_records(path)


def summarize(name: str, batch: int, ctx: int, records: list[dict], seconds: float) -> dict:
    """One point's result from its workers' records: per kernel its timed settings, the fastest with
    its accuracy, and the speedups (bf16 pages, current FP8 kernel, group-as-M)."""
    res = {"batch": batch, "context": ctx, "kernels": {}}
    points = [r for r in records if r["kind"] == "point"]
    res["max_abs_ref"] = points[0]["max_abs_ref"] if points else None
    for r in records:
        if r["kind"] == "baseline":
            res["kernels"][r["variant"]] = r["entry"]
    accuracy = {(r["variant"], r["key"]): r["accuracy"] for r in records if r["kind"] == "accuracy"}
    for variant in (v for group in GROUPS for v in group if v not in ("bf16", "fp8_widen")):
        rows = variant_rows(records, variant)
        entry = {"configs": list(rows.values())}  # none: not reached, or (two-term Q) no sibling timed
        best = fastest(rows)
        if best is not None:
            top = rows[best]
            entry.update({"ms": top["ms"], "settings": {k: top[k] for k in _SETTING_KEYS[family(variant)]},
                          "splits": top["splits"],
                          **accuracy.get((variant, best), {"accuracy_error": "not measured", "sanity_ok": False})})
        res["kernels"][variant] = entry
    kernels = res["kernels"]
    bf16_ms = kernels.get("bf16", {}).get("ms")
    widen_ms = kernels.get("fp8_widen", {}).get("ms")
    if bf16_ms:
        res["speedup_vs_bf16"] = {k: bf16_ms / v["ms"] for k, v in kernels.items() if "ms" in v}
    passed = {k: v for k, v in kernels.items() if "ms" in v and v.get("sanity_ok") and k != "bf16"}
    mma_passed = {k: v for k, v in passed.items() if k != "fp8_widen"}
    if mma_passed and bf16_ms and widen_ms:
        top_name = min(mma_passed, key=lambda k: mma_passed[k]["ms"])
        top = mma_passed[top_name]
        res["fastest_mma"] = top_name
        res["fp8_attention_speedup"] = bf16_ms / top["ms"]
        res["best_mma"] = {"kernel": top_name, "settings": top["settings"], "splits": top["splits"], "ms": top["ms"],
                           "speedup_vs_bf16": bf16_ms / top["ms"], "speedup_vs_fp8_widen": widen_ms / top["ms"]}
    if bf16_ms and widen_ms:
        res["fp8_attention_speedup_old"] = bf16_ms / widen_ms
    group_as_m = [v["ms"] for k, v in passed.items() if k.startswith("mma")]
    if passed and bf16_ms and widen_ms:
        name_best = min(passed, key=lambda k: passed[k]["ms"])
        best = passed[name_best]
        res["best"] = {"kernel": "widen" if name_best == "fp8_widen" else name_best, "settings": best["settings"],
                       "splits": best["splits"], "ms": best["ms"], "speedup_vs_bf16": bf16_ms / best["ms"],
                       "speedup_vs_fp8_widen": widen_ms / best["ms"],
                       "speedup_vs_group_as_m": min(group_as_m) / best["ms"] if group_as_m else None}
    res["seconds"] = seconds
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
    ap.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)  # one group's process (run_group)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker(args.worker)
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
        "groups": [list(g) for g in GROUPS],
        "shapes": {},
    }
    if not result["fp8_mma_supported"]:
        log(f"no FP8 matrix units on {result['device']} (capability {result['capability']})")
    logs = out.parent / f"{out.stem}.rows"  # the workers' JSON-lines logs: what each measured, as it went
    logs.mkdir(parents=True, exist_ok=True)
    # the issue's two points first: they get the budget before the short contexts do
    order = sorted(points, key=lambda k: (k not in ("8x16k", "32x4k"), k))
    for name in order:
        batch, ctx = points[name]
        t1, records = time.time(), []
        for i, group in enumerate(GROUPS):
            records += run_group(name, batch, ctx, group, t0 + args.budget_s, logs / f"{name}.{i}.jsonl")
            result["shapes"][name] = summarize(name, batch, ctx, records, time.time() - t1)
            result["table"] = table_entries(result["shapes"])
            out.write_text(json.dumps(result, indent=1))  # what is measured so far survives a later failure
    for key, name in (("fp8_attention_speedup", "8x16k"), ("fp8_attention_speedup_32x4k", "32x4k")):
        shape = result["shapes"].get(name)
        if shape is None:
            continue
        if "fp8_attention_speedup" in shape:
            result[key] = shape["fp8_attention_speedup"]
        if "fp8_attention_speedup_old" in shape:
            result[key + "_old"] = shape["fp8_attention_speedup_old"]
        for variant, speedup in shape.get("speedup_vs_bf16", {}).items():
            if variant not in ("bf16", "fp8_widen"):
                result[f"{key}_{variant}"] = speedup
    result["seconds"] = time.time() - t0
    out.write_text(json.dumps(result, indent=1))
    log("")
    for name, shape in result["shapes"].items():
        log(f"{name}: max |ref| {shape['max_abs_ref']}")
        for k, v in shape["kernels"].items():
            acc = (f" err vs fp8 ref {v['err_vs_fp8_ref']:.3g} (rel {v['rel_err_vs_fp8_ref']:.3g}, "
                   f"sanity {'ok' if v['sanity_ok'] else 'FAIL'}), vs bf16 ref {v['err_vs_bf16_ref']:.3g}"
                   if "err_vs_fp8_ref" in v else "")
            x = shape.get("speedup_vs_bf16", {}).get(k)
            ms = (f"{v['ms'] * 1e3:7.1f} us  x{x:.2f} vs bf16" if x else f"{v['ms'] * 1e3:7.1f} us") if "ms" in v \
                else "no run"
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
