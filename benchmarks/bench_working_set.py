"""The working-set benchmark: fit / knee / pressure / deep, every variant on the same KV bytes (run by hand).

    python benchmarks/bench_working_set.py --quick --out ws.json                  # tiny "demo", CPU, minutes
    python benchmarks/bench_working_set.py --model test --quick --requests 24 --time-scale 0 --out ws.json
    python benchmarks/bench_working_set.py --shape 8b --device cuda --worksets pressure --requests 200 \\
        --time-budget-s 500 --out $OUT/ws.json                                      # the H200 run
    python benchmarks/bench_working_set.py --shape 8b --device cuda --worksets deep,knee --only knee=on_pressure \\
        --variants on_pressure,on_pressure_host1x,on_pressure_host4x --requests 200 --out $OUT/ws_deep.json

Chat sessions ("groups") of 2-9 photos each ask questions about their photos in a traffic mix
whose hot groups fit in the KV memory and whose tail does not; every variant (compact FP8 prefix,
compaction on pressure in one step and in two, dense FP8, dense bf16, vision-feature cache only,
the host-memory tier at 1 x B and 4 x B host bytes, and policies added to ``working_set.VARIANTS``)
serves the same seeded trace on the same KV bytes. The protocol is in ``benchmarks/working_set.py``
and docs/PERFORMANCE.md ("Working set", "Host-memory tier").

``--only WORKSET=V1,V2`` runs only those of ``--variants`` on that workset (repeatable): the
host tier's goal compares ``deep`` against the ``knee`` TTFT p99 of ``on_pressure`` in the same
run, which needs knee for one variant only. A variant with the host tier fails alone (recorded,
the others run) on an engine without it.

The model (a tiny checkpoint, ``--model test|demo|FOLDER``, or random weights at a real shape,
``--shape 8b``, see ``benchmarks/shapes.py``) is built once; each variant gets a fresh engine
(KV pool, caches, CUDA graphs) on it, closed before the next. The JSON is rewritten after every
variant (and the markdown table beside it), so a run stopped part way keeps the variants that
finished; a variant that fails is recorded with its error and the next one runs. The plot is
drawn at the end (``python benchmarks/working_set_report.py ws.json`` draws it again).

``--time-scale S`` multiplies every planned arrival time (S > 1 slows the Poisson traffic down
for a slow machine); ``--time-scale 0`` sends the measured requests closed loop, one after the
other in trace order, so that nothing sleeps and the cache behaviour does not depend on the
machine's speed (the CPU test uses it; TTFT then counts from the previous request's end).

``--quick``: 40 requests, B = 160 FP8 pages and photos of 256-320 px (64-100 visual tokens), so
every workset is a handful of groups (3 / 6 / 9 / 15) and the bf16 pool still holds the longest
request; each flag given still wins. About 4 minutes with the "demo" checkpoint on a 2-core CPU,
20 seconds with ``--model test --worksets pressure --requests 24 --time-scale 0`` (the test's run).

Defaults otherwise: 600 requests; photos of 256-768 px; B = the published 4.28 GB with
``--shape`` (3,518 FP8 pages at the 8B shape: fit / knee / pressure / deep = 25 / 38 / 56 / 106 groups),
1,024 FP8 pages with a tiny checkpoint.
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import platform
import sys
import tempfile
import time
import traceback

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import step_trace_report  # noqa: E402
import working_set as ws  # noqa: E402
import working_set_report as report  # noqa: E402
from media import MEDIA_DIR, PHOTOS  # noqa: E402

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: The published protocol's KV budget (Qwen3-VL-8B, issue 18): 4.28 GB.
PUBLISHED_BUDGET_BYTES = 4_280_000_000
QUICK = {"requests": 40, "budget_pages": 160, "photo_sides": "256,320"}
DEFAULTS = {"requests": 600, "budget_pages": 1024, "photo_sides": "256,768"}


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", default="demo", help="tiny preset 'test' or 'demo', or a checkpoint folder "
                                                       "(default demo)")
    which.add_argument("--shape", choices=("8b", "2b"), help="random weights at a real model's shapes")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16",
                        help="model dtype, also the dense_bf16 variant's KV dtype (default bfloat16)")
    parser.add_argument("--worksets", default=",".join(ws.WORKSETS), help="comma-separated (default all)")
    parser.add_argument("--variants", default=",".join(ws.VARIANTS),
                        help=f"comma-separated, run in this order (default {','.join(ws.VARIANTS)})")
    parser.add_argument("--only", action="append", default=[], metavar="WORKSET=V1,V2",
                        help="run only these of --variants on WORKSET (repeatable)")
    parser.add_argument("--requests", type=int, help="measured requests per variant (default 600; --quick 40)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budget-pages", type=int, help="KV budget as B FP8 pages (default with a tiny "
                                                         "checkpoint: 1024; --quick 160)")
    budget.add_argument("--kv-cache-gib", type=float, help="KV budget in GiB (default with --shape: the "
                                                           "published 4.28 GB)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    parser.add_argument("--vision-cache-mib", type=float, help="vision-feature cache of every variant "
                                                               "(default: the engine's, 256 MiB)")
    parser.add_argument("--photo-sides", help="LO,HI: photo widths and heights in px (default 256,768; "
                                              "--quick 256,320)")
    parser.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second (default 4)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply planned arrival times; 0 = closed loop (default 1)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-groups", type=int, default=400, help="most groups generated (default 400)")
    parser.add_argument("--workers", type=int, default=64, help="client threads sending requests (default 64)")
    parser.add_argument("--time-budget-s", type=float,
                        help="start no variant that would end past this many seconds from the start")
    parser.add_argument("--quick", action="store_true", help="a small run (see below)")
    parser.add_argument("--no-plot", action="store_true", help="skip the plot")
    parser.add_argument("--out", default="ws.json", help="results JSON (default ws.json); .md and .png beside")
    parser.add_argument("--step-trace", type=pathlib.Path, metavar="DIR",
                        help="write each variant's step trace in DIR (<workset>-<variant>.jsonl) and summarise "
                             "its measured phase's steps (benchmarks/step_trace_report.py)")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None and not (key == "budget_pages" and (args.kv_cache_gib or args.shape)):
            setattr(args, key, value)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    args.worksets = [w for w in args.worksets.split(",") if w]
    if not args.worksets or set(args.worksets) - set(ws.WORKSETS):
        parser.error(f"--worksets: choose from {','.join(ws.WORKSETS)}")
    args.variants = [v for v in args.variants.split(",") if v]
    try:
        ws.check_variants(args.variants)
        args.only = parse_only(args.only, args.worksets, args.variants)
    except ValueError as exc:
        parser.error(f"--variants / --only: {exc}")
    lo, hi = (int(x) for x in args.photo_sides.split(","))
    if not 32 <= lo <= hi:
        parser.error("--photo-sides: LO,HI with 32 <= LO <= HI")
    args.sides = (lo, hi)
    if args.requests < 1 or args.max_tokens < 1 or args.time_scale < 0 or args.rate <= 0:
        parser.error("--requests and --max-tokens must be >= 1, --time-scale >= 0, --rate > 0")
    return args


def parse_only(items: list[str], worksets: list[str], variants: list[str]) -> dict[str, list[str]]:
    """``--only`` values (``WORKSET=V1,V2``) -> workset -> its variants, in ``variants``' order.

    Raises:
        ValueError: a malformed item, a workset not in ``worksets``, a variant not in
            ``variants``, or a workset given twice.
    """
    only: dict[str, list[str]] = {}
    for item in items:
        name, sep, names = item.partition("=")
        chosen = [v for v in names.split(",") if v]
        if not sep or not chosen:
            raise ValueError(f"--only {item!r}: expected WORKSET=V1,V2")
        if name not in worksets or name in only:
            raise ValueError(f"--only {item!r}: {name!r} is not one of --worksets {','.join(worksets)} "
                             f"or is given twice")
        if set(chosen) - set(variants):
            raise ValueError(f"--only {item!r}: {sorted(set(chosen) - set(variants))} not in --variants")
        only[name] = [v for v in variants if v in chosen]
    return only


# --------------------------------------------------------------------------------------------
# the model, built once
# --------------------------------------------------------------------------------------------


def build_model(args, workdir: pathlib.Path, device: torch.device, dtype: torch.dtype):
    """(model, processor, checkpoint folder, model id, description)."""
    from transformers import AutoProcessor

    if args.shape:
        import shapes

        folder = shapes.make_folder(args.shape, workdir)
        model = shapes.random_model(folder, device, dtype)
        return (model, AutoProcessor.from_pretrained(str(folder)), folder, f"random-{args.shape}",
                f"Qwen3-VL-{args.shape.upper()} shape, random weights")
    from engine.model.hub import resolve_checkpoint
    from engine.model.qwen3_vl import load_model

    if args.model in ("test", "demo"):
        from engine.model.tiny import build_tiny_checkpoint

        folder = build_tiny_checkpoint(workdir / args.model, args.model, seed=0)
        description = f"tiny '{args.model}' preset, random weights"
    else:
        folder = resolve_checkpoint(args.model)
        description = str(args.model)
    model = load_model(folder, device=device, dtype=dtype, progress=False)
    return model, AutoProcessor.from_pretrained(str(folder)), folder, str(args.model), description


def make_engine(model, processor, folder, model_id: str, options: dict):
    """An engine on the built model. Raises: ValueError: a host-tier option this engine lacks."""
    import dataclasses

    from engine import Engine, EngineOptions

    options = ws.fit_to_engine(options, {f.name for f in dataclasses.fields(EngineOptions)})
    return Engine(model, processor, model_id=model_id, folder=folder, options=EngineOptions(**options))


def fp8_page_bytes(model, page_size: int) -> int:
    """Bytes of one Scaled-FP8 page over all layers (scales included)."""
    from engine.cache.kv_pool import PagePool

    t = model.config.text
    return PagePool.bytes_per_page(num_layers=t.num_hidden_layers, num_kv_heads=t.num_key_value_heads,
                                   head_dim=t.head_dim, page_size=page_size, kv_cache_dtype="fp8_e4m3",
                                   model_dtype=model.dtype)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------


def measure_groups(args, build, budget_bytes: int, budget_pages: int, photo_dir: pathlib.Path,
                   device: torch.device) -> list[ws.Group]:
    """Generate groups in order and measure their dense prefix pages (one cold request each, on
    an engine of their own: dense FP8, no conversation reuse, no CUDA graphs) until every workset
    asked for is decided or ``--max-groups`` is reached."""
    options = {**ws.base_options(budget_bytes, 1 << 20, args.page_size), **ws.VARIANTS["dense_fp8"],
               "conversation_reuse": False, "cuda_graphs": False}
    engine = build(options)
    groups: list[ws.Group] = []
    try:
        while len(groups) < args.max_groups and not ws.enough_groups(
                [g.dense_pages for g in groups], budget_pages, args.worksets):
            group = ws.make_group(len(groups), args.seed, photo_dir, media_dir=MEDIA_DIR, photos=PHOTOS,
                                  sides=args.sides)
            ws.measure_dense_pages(engine, group)
            groups.append(group)
    finally:
        engine.close()
        free_memory(device)
    return groups


def run_one(args, build, groups, trace, options: dict, device: torch.device,
            step_trace: pathlib.Path | None = None) -> dict:
    """One variant on one workset: a fresh engine, the trace, the metrics (or the error). With
    ``step_trace`` the engine writes its step trace there (``PRISM_STEP_TRACE``) and the metrics gain
    ``steps``, the measured phase's :func:`step_trace_report.summary`."""
    t = time.perf_counter()
    engine = None
    if step_trace is not None:
        step_trace.parent.mkdir(parents=True, exist_ok=True)
        step_trace.unlink(missing_ok=True)
        os.environ["PRISM_STEP_TRACE"] = str(step_trace)  # read once, when the engine's loop is made
    try:
        engine = build(options)
        os.environ.pop("PRISM_STEP_TRACE", None)
        build_s = time.perf_counter() - t
        longest = max(g.prompt_tokens for g in groups) + args.max_tokens
        if longest > engine.max_model_len:
            raise RuntimeError(f"the KV budget holds {engine.max_model_len} tokens in this variant's pages, "
                               f"less than the longest request ({longest}): raise --budget-pages / --kv-cache-gib")
        metrics = ws.run_variant(engine, groups, trace, max_tokens=args.max_tokens, time_scale=args.time_scale,
                                 workers=args.workers, log=log)
        metrics["engine_build_s"] = build_s
    except Exception as exc:  # noqa: BLE001  (recorded; the other variants still run)
        metrics = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
    finally:
        os.environ.pop("PRISM_STEP_TRACE", None)
        if engine is not None:
            engine.close()
        free_memory(device)
    if step_trace is not None and "measured_start" in metrics:
        start = metrics["measured_start"]
        metrics["steps"] = step_trace_report.summary(step_trace_report.read(str(step_trace)), start,
                                                     start + metrics["measured_s"])
        log(step_trace_report.text(metrics["steps"]))
    metrics["options"] = {k: v for k, v in options.items() if k != "progress"}
    metrics["wall_s"] = time.perf_counter() - t
    return metrics


def kv_budget(args, page_bytes: int) -> int:
    """The KV bytes every variant gets: ``--budget-pages`` FP8 pages, ``--kv-cache-gib``, or the
    published 4.28 GB."""
    if args.budget_pages is not None:
        return args.budget_pages * page_bytes
    return int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else PUBLISHED_BUDGET_BYTES


def run_skeleton(args, argv, description: str, device: torch.device, budget_bytes: int, page_bytes: int,
                 vision_cache_bytes: int, groups: list[ws.Group]) -> dict:
    """The result JSON before any variant ran: the setup, the protocol's settings and the groups."""
    return {
        "setup": {"checkpoint": description,
                  "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                  else f"CPU ({platform.processor() or platform.machine()})",
                  "dtype": args.dtype, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                  "argv": sys.argv[1:] if argv is None else list(argv)},
        "protocol": {"budget_bytes": budget_bytes, "budget_pages": budget_bytes // page_bytes,
                     "fp8_page_bytes": page_bytes, "page_size": args.page_size, "requests": args.requests,
                     "rate": args.rate, "zipf_alpha": 1.0, "max_tokens": args.max_tokens,
                     "time_scale": args.time_scale, "seed": args.seed, "photo_sides": list(args.sides),
                     "photos_per_group": [2, 9], "vision_cache_bytes": vision_cache_bytes,
                     "keep_ratio": ws.VARIANTS["compact_fp8"].get("keep_ratio"),
                     "thresholds": {"fit": ws.FIT, "knee": ws.KNEE, "pressure": ws.PRESSURE, "deep": ws.DEEP},
                     "variants": {v: ws.describe_variant(ws.VARIANTS[v]) for v in args.variants},
                     "only": args.only},
        "groups": [g.describe() for g in groups],
        "worksets": {},
        "results": {},
    }


def run_workset(args, name: str, members: list[ws.Group], result: dict, out: pathlib.Path, build, device,
                deadline: ws.Deadline) -> None:
    """Every variant on workset ``name`` (its groups ``members``), the JSON rewritten after each."""
    p = result["protocol"]
    trace = ws.make_trace(len(members), args.requests, args.seed, rate=args.rate)
    dense = sum(g.dense_pages for g in members)
    result["worksets"][name] = {
        "groups": len(members), "dense_pages": dense, "ratio": dense / p["budget_pages"],
        "group_dense_pages": [g.dense_pages for g in members],
        "trace_hash": ws.trace_hash([ws.trace_row(members, a) for a in trace]),
    }
    runs = result["results"][name] = {}
    for v in args.only.get(name, args.variants):
        if not deadline.allows_another():
            runs[v] = {"error": f"skipped: --time-budget-s {args.time_budget_s} would be exceeded "
                                f"(longest variant so far {deadline.longest:.0f} s)"}
            log(f"{name} / {v}: skipped (time budget)")
            continue
        log(f"{name} / {v}: {len(members)} groups, {args.requests} requests ...")
        options = ws.variant_options(v, p["budget_bytes"], p["vision_cache_bytes"], args.page_size)
        traced = args.step_trace / f"{name}-{v}.jsonl" if args.step_trace else None
        m = runs[v] = run_one(args, build, members, trace, options, device, traced)
        deadline.record(m["wall_s"])
        report.write(result, out, with_plot=False)
        if "error" in m:
            log(f"{name} / {v}: FAILED {m['error']}")
        else:
            log(f"{name} / {v}: TTFT p50 {m['ttft_ms_p50']:.1f} ms, p99 {m['ttft_ms_p99']:.1f} ms, recomputed "
                f"{m['recomputed_prompt_tokens']} tokens, hits {m['hits']} (host {m['hits_host']}), resident "
                f"{m['resident_prefixes']} ({m['wall_s']:.1f} s)")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    deadline = ws.Deadline(args.time_budget_s)
    from engine import EngineOptions

    with tempfile.TemporaryDirectory(prefix="prism-working-set-") as tmp:
        workdir = pathlib.Path(tmp)
        t = time.perf_counter()
        model, processor, folder, model_id, description = build_model(args, workdir, device, _DTYPES[args.dtype])
        model_s = time.perf_counter() - t
        log(f"model ready in {model_s:.1f} s ({description})")

        def build(options):
            return make_engine(model, processor, folder, model_id, options)

        page_bytes = fp8_page_bytes(model, args.page_size)
        budget_bytes = kv_budget(args, page_bytes)
        budget_pages = budget_bytes // page_bytes
        vision_cache_bytes = (int(args.vision_cache_mib * 2**20) if args.vision_cache_mib is not None
                              else EngineOptions().vision_cache_bytes)
        t = time.perf_counter()
        groups = measure_groups(args, build, budget_bytes, budget_pages, workdir / "photos", device)
        measure_s = time.perf_counter() - t
        runs = ws.choose_worksets([g.dense_pages for g in groups], budget_pages)
        log(f"{len(groups)} groups measured in {measure_s:.1f} s; B = {budget_pages} FP8 pages; worksets "
            + ", ".join(f"{w} = {runs[w]} groups" for w in args.worksets))

        result = run_skeleton(args, argv, description, device, budget_bytes, page_bytes, vision_cache_bytes, groups)
        result["setup"] |= {"model_build_s": model_s, "measure_s": measure_s}
        for w in args.worksets:
            run_workset(args, w, groups[: runs[w]], result, out, build, device, deadline)
    written = report.write(result, out, with_plot=not args.no_plot)
    print(report.markdown(result))
    log("written: " + ", ".join(f"{k} {v}" for k, v in written.items()))
    failed = [f"{w}/{v}" for w, r in result["results"].items() for v, m in r.items() if "error" in m]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
