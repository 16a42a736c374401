"""Why ``kam_p8`` (keys-as-M FP8 decode, P in E4M3) hits an illegal address on the H200: one launch
per process, each checked on its own (issue 36; GPU, by hand, < 2 minutes).

    python3 benchmarks/debug_kam.py [--point 32x4k] [--setting block_n=64,num_stages=1,waves=2]
                                    [--cases p8,p16,...] [--sanitize] [--dump DIR] [--budget-s 80]

At one point of ``benchmarks/bench_fp8_decode.py`` (its pools, queries and 8B attention shape, via
its ``setup``), each *case* of :data:`CASES` runs in a process of its own, with
``CUDA_LAUNCH_BLOCKING=1``: one :class:`ops.dispatch.DecodePlan` call (what the bench and the engine
run), then ``torch.cuda.synchronize()``; the case prints the error (a fault kills only its own
process) or ``max |out - ref|`` against float32 attention over the same FP8 pages. Per case, from
the kernel Triton compiled (``bench_fp8_decode.compiled_kernels``): the bench's PTX instruction
counts (``wgmma_e4m3`` > 0: ``wgmma`` on E4M3 operands), each ``warp_group_dot`` of the TTGIR with
its operands' shapes, types and shared-memory swizzle, the shared bytes and registers.

The cases separate the suspects (docs/PERFORMANCE.md, "kam_p8"): the only construct ``kam_p8`` has
that ``kam_p16`` (which runs) lacks is the second E4M3 ``wgmma``, ``O^T = V^T P^T`` with both
operands in shared memory; at ``block_n`` 64 both are 64-byte swizzled (each row 64 keys), at 128
both 128-byte (as the logits product of both variants, which runs), at 32 32-byte; ``pv_t=False``
computes PV on ``mma.sync`` after widening (no E4M3 PV ``wgmma`` at all). Every global load of the
kernel is masked in the source and predicated in the PTX (same addresses as ``kam_p16``), so there is
no "force the masks on" case.

``--sanitize``: after the first two cases, ``p8`` again under ``compute-sanitizer --tool memcheck``
(found on ``PATH``, ``$PRISM_COMPUTE_SANITIZER``, ``$CUDA_HOME``, ``/usr/local/cuda*``,
``/opt/nvidia/*``, or a pip ``nvidia`` package; only the kam kernel instrumented, PyTorch's caching
allocator off so that each tensor is an allocation of its own), printing the first 60 lines of its
report. Without one it says so and runs ``p8`` under ``TRITON_DEBUG=1`` instead (Triton's debug
build: device-side asserts and integer-overflow checks on the address arithmetic).

``--dump DIR``: each case's TTGIR, PTX and SASS (``cuobjdump`` from Triton's own binaries, else
``PATH``) and ``kam_debug.json`` (every case's result) go to DIR. ``--budget-s``: no case starts
after that many seconds; the rest are listed as skipped. ``PRISM_BENCH_SMOKE=1`` runs it on the CPU
(the bench's smoke mode: interpreter, tiny shapes; no PTX) to check the script itself.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import re
import shutil
import site
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
KERNEL_NAME = "_fp8_kam_decode_kernel"

#: name -> (variant, setting overrides, mode, extra environment). ``mode`` "eager": one call, then a
#: synchronize; "graph": captured in a CUDA graph and replayed, as the bench times it.
CASES = {
    "p8": ("kam_p8", {}, "eager", {}),
    "p16": ("kam_p16", {}, "eager", {}),  # the control: same loads, PV in float16
    "p8_bn128": ("kam_p8", {"block_n": 128}, "eager", {}),  # PV operands 128-byte swizzled
    "p8_pv": ("kam_p8", {"pv_t": False}, "eager", {}),  # PV on mma.sync after widening
    "p8_bn32": ("kam_p8", {"block_n": 32}, "eager", {}),  # 32-byte swizzle; logits on mma.sync
    "p8_graph": ("kam_p8", {}, "graph", {}),
    "p8_nopdl": ("kam_p8", {}, "eager", {"PRISM_PDL": "0"}),  # plain launch, no griddepcontrol
    "p8_w8": ("kam_p8", {"num_warps": 8}, "eager", {}),
    "p8_debug": ("kam_p8", {}, "eager", {"TRITON_DEBUG": "1"}),
}
DEFAULT_CASES = ("p8", "p16", "p8_bn128", "p8_pv", "p8_bn32", "p8_graph", "p8_nopdl")
#: The longest one case may take (a fresh machine compiles every kernel: a few seconds each).
CASE_TIMEOUT_S = 60
#: The sanitizer run's share of the budget and the number of its report lines printed.
SANITIZER_TIMEOUT_S = 60
REPORT_LINES = 60


def log(*a):
    print(*a, flush=True)


def parse_setting(text: str | None) -> dict:
    """``"block_n=64,num_warps=4,pv_t=0,waves=2"`` -> settings (ints; ``pv_t`` a bool)."""
    out = {}
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in ("block_n", "num_warps", "num_stages", "pv_t", "waves"):
            raise SystemExit(f"unknown setting {key!r} (block_n, num_warps, num_stages, pv_t, waves)")
        out[key] = value.strip().lower() in ("1", "true", "yes") if key == "pv_t" else int(value)
    return out


# --------------------------------------------------------------------------------------------------
# One case, in its own process (--case JSON)
# --------------------------------------------------------------------------------------------------


def _swizzles(ttgir: str) -> dict[str, str]:
    """TTGIR shared layouts by alias: ``#shared1`` -> ``"nvmma swizzle 128B"`` / ``"swizzled ..."``."""
    out = {}
    for alias, body in re.findall(r"^(#shared\d*) = #ttg\.(\w+<\{[^}]*\}>)", ttgir, re.M):
        m = re.search(r"swizzlingByteWidth = (\d+), transposed = (\w+)", body)
        out[alias] = f"{m.group(1)}B swizzle{', transposed' if m.group(2) == 'true' else ''}" if m else body
    return out


def wgmma_operands(ttgir: str) -> list[str]:
    """Each ``warp_group_dot`` of the TTGIR: ``"A 64x128xf8E4M3FN smem (128B swizzle) * B ..."``."""
    layouts = _swizzles(ttgir)
    out = []
    for line in ttgir.splitlines():
        if "ttng.warp_group_dot " not in line or " : " not in line:
            continue
        types = line.rsplit(" : ", 1)[1].split(" -> ")[0]
        parts = []
        for name, ty in zip("AB", types.split(" * "), strict=False):
            m = re.search(r"memdesc<([\dx]+x\w+), (#shared\d*)", ty)
            if m:
                parts.append(f"{name} {m.group(1)} smem ({layouts.get(m.group(2), m.group(2))})")
            else:
                m = re.search(r"tensor<([\dx]+x\w+)", ty)
                parts.append(f"{name} {m.group(1) if m else ty} registers")
        out.append(" * ".join(parts))
    return out


def _cuobjdump() -> str | None:
    try:
        import triton

        bundled = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    except Exception:  # noqa: BLE001 - only a report
        pass
    return shutil.which("cuobjdump")


def kernel_report(bench, name: str, dump: pathlib.Path | None) -> dict:
    """What Triton compiled for this process's kam kernel (one per case process): instruction
    counts, the ``wgmma`` operands, shared bytes, registers; its TTGIR / PTX / SASS into ``dump``."""
    kernels = list(bench.compiled_kernels("kam").values())
    if not kernels:
        return {"compiled": "none found (interpreter, or Triton internals moved)"}
    kernel = kernels[-1]
    asm = kernel.asm
    ptx, ttgir = asm.get("ptx", ""), asm.get("ttgir", "")
    out = {"ptx": bench.instructions(ptx), "wgmma_operands": wgmma_operands(ttgir)}
    meta = getattr(kernel, "metadata", None)
    for key, obj, attr in (("shared_bytes", meta, "shared"), ("num_warps", meta, "num_warps"),
                           ("registers", kernel, "n_regs"), ("spills", kernel, "n_spills")):
        try:  # registers are known once the module is loaded, which may touch a dead context
            value = getattr(obj, attr, None)
        except Exception:  # noqa: BLE001 - only a report
            value = None
        if isinstance(value, int):
            out[key] = value
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{name}.ttgir").write_text(ttgir)
        (dump / f"{name}.ptx").write_text(ptx)
        cubin, tool = asm.get("cubin"), _cuobjdump()
        if isinstance(cubin, bytes) and tool:
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(cubin)
                f.flush()
                sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, timeout=60)
            (dump / f"{name}.sass").write_text(sass.stdout or sass.stderr)
    return out


def run_case(spec: dict) -> int:
    """One case (``--case``): prints ``RESULT {json}`` last; exit 3 if the launch failed."""
    sys.path.insert(0, str(HERE))
    import bench_fp8_decode as bench
    import torch

    from ops import dispatch
    from ops import reference as ref

    t0 = time.time()
    variant, settings, mode = spec["variant"], spec["settings"], spec["mode"]
    batch, ctx = bench.POINTS[spec["point"]]
    q, _, fp8, meta = bench.setup(batch, ctx)
    splits = dispatch.decode_splits_for(variant, settings, batch, bench.HKV, ctx, True)
    plan = dispatch.DecodePlan(variant, settings, splits)
    res = {"case": spec["name"], "variant": variant, "settings": settings, "splits": splits, "mode": mode,
           "env": spec["env"]}
    cuda = bench.DEVICE == "cuda"
    try:
        if variant in bench.CRASH:  # the CPU test of a faulting case (as the bench's PRISM_BENCH_CRASH)
            raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered (PRISM_BENCH_CRASH)")
        if mode == "graph":
            res["ms"] = bench.graph_ms(lambda: plan(q, fp8, meta), calls=2, repeats=2)
        out = plan(q, fp8, meta)
        if cuda:
            torch.cuda.synchronize()
        res["ok"] = True
    except Exception as exc:  # noqa: BLE001 - the fault is the result
        res["ok"] = False
        res["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    if res["ok"] and not spec.get("no_ref"):
        want = ref.paged_decode_attention(q.float(), fp8, meta).float()
        err, scale = float((out.float() - want).abs().max()), float(want.abs().max())
        res.update({"max_err": err, "max_abs_ref": scale, "rel_err": err / scale,
                    "sanity_ok": bool(err / scale <= bench.SANITY[variant])})
    dump = pathlib.Path(spec["dump"]) if spec.get("dump") else None
    try:
        res.update(kernel_report(bench, spec["name"], dump))
    except Exception as exc:  # noqa: BLE001 - only a report
        res["report_error"] = f"{type(exc).__name__}: {exc}"
    res["seconds"] = round(time.time() - t0, 1)
    print("RESULT " + json.dumps(res), flush=True)
    return 0 if res["ok"] else 3


# --------------------------------------------------------------------------------------------------
# The driver: cases in subprocesses, the sanitizer run
# --------------------------------------------------------------------------------------------------


def find_sanitizer() -> str | None:
    """A ``compute-sanitizer`` executable: ``$PRISM_COMPUTE_SANITIZER``, ``PATH``, ``$CUDA_HOME`` /
    ``$CUDA_PATH``, ``/usr/local/cuda*``, ``/opt/nvidia/*`` (three levels), pip ``nvidia/*``."""
    found = [os.environ.get("PRISM_COMPUTE_SANITIZER"), shutil.which("compute-sanitizer")]
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
             *sorted(glob.glob("/usr/local/cuda*"), reverse=True)]
    for root in filter(None, roots):
        found += [f"{root}/bin/compute-sanitizer", f"{root}/compute-sanitizer/compute-sanitizer"]
    for depth in range(1, 4):
        found += sorted(glob.glob("/opt/nvidia" + "/*" * depth + "/compute-sanitizer"))
        found += sorted(glob.glob("/opt/nvidia" + "/*" * depth + "/bin/compute-sanitizer"))
    for packages in site.getsitepackages() + [site.getusersitepackages()]:
        found += sorted(glob.glob(f"{packages}/nvidia/*/bin/compute-sanitizer"))
        found += sorted(glob.glob(f"{packages}/nvidia/*/compute-sanitizer/compute-sanitizer"))
    return next((p for p in found if p and os.path.isfile(p) and os.access(p, os.X_OK)), None)


def case_spec(name: str, args, base: dict) -> dict:
    variant, over, mode, env = CASES[name]
    return {"name": name, "variant": variant, "settings": {**base, **over}, "mode": mode, "env": env,
            "point": args.point, "dump": args.dump}


def _result(text: str) -> dict | None:
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):]) if lines else None


def run_child(spec: dict, timeout: float, prefix: list[str] | None = None, extra_env: dict | None = None) -> tuple:
    """Run one case in a new process (``prefix``: e.g. the sanitizer command); returns
    ``(result or None, exit code or "timeout", combined output)``."""
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])), **spec["env"], **(extra_env or {})}
    cmd = [*(prefix or []), sys.executable, str(pathlib.Path(__file__).resolve()), "--case", json.dumps(spec)]
    try:
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired as exc:
        text = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr))
        return _result(text), "timeout", text
    text = run.stdout + run.stderr
    return _result(run.stdout), run.returncode, text


def describe(res: dict | None, rc, text: str) -> str:
    if res is None:
        tail = [ln for ln in text.strip().splitlines() if ln.strip()][-3:]
        return f"DIED (exit {rc}) before reporting: " + " | ".join(tail)[-600:]
    if res.get("ok"):
        s = "OK"
        if "max_err" in res:
            s += (f" max|out-ref| {res['max_err']:.3g} (rel {res['rel_err']:.3g}, "
                  f"sanity {'ok' if res['sanity_ok'] else 'FAIL'})")
    else:
        s = f"FAULT {res.get('error')}"
    if "ptx" in res:
        p = res["ptx"]
        s += (f"\n      ptx: wgmma {p['wgmma']} (e4m3 {p['wgmma_e4m3']}), mma.sync e4m3 {p['mma_e4m3']} / f16 "
              f"{p['mma_f16']}")
        labels = (("shared_bytes", "shared bytes"), ("registers", "registers"), ("spills", "spills"))
        s += "".join(f"; {res[k]} {label}" for k, label in labels if k in res)
        for i, ops in enumerate(res.get("wgmma_operands", [])):
            s += f"\n      warp_group_dot {i}: {ops}"
    elif "compiled" in res:
        s += f"\n      compiled kernel: {res['compiled']}"
    return s


def reading(results: dict) -> str:
    """What the pattern of faults says (each case's ``ok``; missing = not run)."""
    ok = {name: r["ok"] for name, r in results.items() if r is not None and "ok" in r}
    died = {name for name, r in results.items() if r is None}
    bad = {n for n, v in ok.items() if not v} | died
    if "p8" not in ok and "p8" not in died:
        return "p8 did not run"
    if "p8" not in bad:
        return ("p8 ran cleanly here: the bench's fault needs more than one launch at this point and setting "
                "(its sequence: graph capture after the eager call, earlier kernels, another setting)")
    lines = ["p8 faults at this setting."]
    if "p16" in ok and "p16" not in bad:
        lines.append("p16 (same loads and stores, PV in float16) runs: not the global addressing.")
    for case, meaning in (("p8_bn128", "PV operands 128-byte swizzled (as the logits product that works)"),
                          ("p8_bn32", "PV operands 32-byte swizzled"),
                          ("p8_pv", "no E4M3 PV wgmma (PV on mma.sync after widening)"),
                          ("p8_nopdl", "no PDL"), ("p8_w8", "8 warps")):
        if case in ok or case in died:
            lines.append(f"{case} ({meaning}): {'faults too' if case in bad else 'runs'}.")
    if "p8_pv" in ok and "p8_pv" not in bad and "p8_bn128" in ok and "p8_bn128" not in bad:
        lines.append("=> the fault needs the E4M3 x E4M3 PV wgmma on 64-byte-swizzled shared operands "
                     "(block_n 64); 128-key blocks avoid it.")
    elif "p8_pv" in ok and "p8_pv" not in bad:
        lines.append("=> the fault needs the E4M3 PV wgmma (V^T and P^T from shared memory).")
    elif "p8_pv" in bad:
        lines.append("=> not (only) the PV wgmma: the E4M3 quantisation of P or the V tile's path.")
    return "\n  ".join(lines)


def sanitize(args, base: dict, deadline: float) -> dict | None:
    """``p8`` under compute-sanitizer memcheck; prints its report's first lines. None without one."""
    tool = find_sanitizer()
    if tool is None:
        log("--sanitize: no compute-sanitizer found (PATH, $PRISM_COMPUTE_SANITIZER, $CUDA_HOME, /usr/local/cuda*, "
            "/opt/nvidia/*, pip nvidia/*); running p8 under TRITON_DEBUG=1 instead")
        return None
    spec = {**case_spec("p8", args, base), "name": "p8_sanitizer", "no_ref": True, "dump": None}
    timeout = min(SANITIZER_TIMEOUT_S, deadline - time.time())
    # the caching allocator off: memcheck sees each tensor as an allocation of its own, so a read past
    # one is reported instead of landing in a neighbour of the same segment
    env = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    prefix = [tool, "--tool", "memcheck", "--print-limit", "20", "--show-backtrace", "device",
              "--kernel-name", f"kns={KERNEL_NAME}"]
    log(f"--sanitize: {' '.join(prefix)} (timeout {timeout:.0f} s)")
    res, rc, text = run_child(spec, timeout, prefix, env)
    if res is None and rc != "timeout" and re.search(r"(?i)unrecognized|unknown option|invalid option", text):
        prefix = prefix[:-2]  # an older sanitizer without --kernel-name: every kernel instrumented
        log("--sanitize: no --kernel-name in this sanitizer; every kernel instrumented")
        res, rc, text = run_child(spec, min(SANITIZER_TIMEOUT_S, deadline - time.time()), prefix, env)
    report = [ln for ln in text.splitlines() if ln.startswith("=====")] or text.splitlines()
    log(f"--- compute-sanitizer report (exit {rc}; first {REPORT_LINES} of {len(report)} lines)")
    for ln in report[:REPORT_LINES]:
        log(ln)
    log(f"--- p8 under the sanitizer: {describe(res, rc, text).splitlines()[0]}")
    return {"tool": tool, "exit": rc, "report": report[:REPORT_LINES], "result": res}


def write_json(dump: str | None, out: dict) -> None:
    if dump:
        path = pathlib.Path(dump)
        path.mkdir(parents=True, exist_ok=True)
        (path / "kam_debug.json").write_text(json.dumps(out, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--point", default="32x4k", help="a point of bench_fp8_decode.POINTS (default 32x4k)")
    ap.add_argument("--setting", help="overrides of KAM_DECODE_CONFIG, e.g. block_n=64,num_stages=1,pv_t=1,waves=2")
    ap.add_argument("--cases", help=f"comma-separated subset of {','.join(CASES)} (default {','.join(DEFAULT_CASES)})")
    ap.add_argument("--sanitize", action="store_true", help="also p8 under compute-sanitizer memcheck")
    ap.add_argument("--dump", help="directory for each case's TTGIR / PTX / SASS and kam_debug.json")
    ap.add_argument("--budget-s", type=float, default=80.0, help="start no case after this many seconds")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # one case, in its own process (run_child)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.case:
        return run_case(json.loads(args.case))
    t0 = time.time()
    deadline = t0 + args.budget_s
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    import bench_fp8_decode as bench
    import torch
    import triton

    from ops.triton_kernels import fp8_decode_kam

    if args.point not in bench.POINTS:
        raise SystemExit(f"unknown point {args.point!r}: one of {', '.join(bench.POINTS)}")
    if not bench.SMOKE and not torch.cuda.is_available():
        log("debug_kam needs a CUDA GPU (PRISM_BENCH_SMOKE=1: the CPU check of the script)")
        return 2
    names = args.cases.split(",") if args.cases else list(DEFAULT_CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}: {', '.join(CASES)}")
    base = {**fp8_decode_kam.KAM_DECODE_CONFIG, **parse_setting(args.setting)}
    device = "cpu (PRISM_BENCH_SMOKE)" if bench.SMOKE else torch.cuda.get_device_name()
    batch, ctx = bench.POINTS[args.point]
    log(f"debug_kam: {device}, torch {torch.__version__}, triton {triton.__version__}; point {args.point} "
        f"(batch {batch}, context {ctx}, {bench.HQ}/{bench.HKV} heads, head_dim {bench.D}); setting {base}; "
        f"CUDA_LAUNCH_BLOCKING=1, one process per case")
    sanitizer_pending = args.sanitize
    results, raw, out = {}, {}, {"device": device, "torch": torch.__version__, "triton": triton.__version__,
                                 "point": args.point, "setting": base, "cases": {}}
    queue = list(names)
    while queue:
        if sanitizer_pending and len(results) >= 2:  # after p8 and its control, before the rest
            sanitizer_pending = False
            out["sanitizer"] = sanitize(args, base, deadline)
            if out["sanitizer"] is None and "p8_debug" not in names:
                queue.insert(0, "p8_debug")
        name = queue.pop(0)
        left = deadline - time.time()
        if left <= 0:
            log(f"[{name}] skipped: time budget ({args.budget_s:.0f} s)")
            out["cases"][name] = {"skipped": "time budget"}
            continue
        spec = case_spec(name, args, base)
        res, rc, text = run_child(spec, min(CASE_TIMEOUT_S, left + 20))
        results[name], raw[name] = res, (rc, text)
        out["cases"][name] = res if res is not None else {"died": rc, "tail": text[-2000:]}
        log(f"[{name}] {spec['variant']} {spec['settings']} {spec['mode']}"
            f"{' ' + str(spec['env']) if spec['env'] else ''}: {describe(res, rc, text)}")
        write_json(args.dump, out)  # what is known so far survives an outer timeout
        if res is None or not res.get("ok"):  # the child's traceback: where the fault surfaced
            tb = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("RESULT ")][-6:]
            for ln in tb:
                log(f"      | {ln[:300]}")
    if sanitizer_pending:  # fewer cases than two
        out["sanitizer"] = sanitize(args, base, deadline)
        if out["sanitizer"] is None and "p8_debug" not in names and time.time() < deadline:
            res, rc, text = run_child(case_spec("p8_debug", args, base), CASE_TIMEOUT_S)
            results["p8_debug"] = res
            out["cases"]["p8_debug"] = res if res is not None else {"died": rc, "tail": text[-2000:]}
            log(f"[p8_debug] TRITON_DEBUG=1: {describe(res, rc, text)}")
    out["reading"] = reading(results)
    out["seconds"] = round(time.time() - t0, 1)
    log("reading:\n  " + out["reading"])
    if args.dump:
        write_json(args.dump, out)
        log(f"wrote {args.dump}/ (kam_debug.json, per case .ttgir/.ptx/.sass)")
    log(f"{out['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
