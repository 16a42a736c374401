"""What each compaction selector costs in time to first token, side by side in one run (run by hand).

    python benchmarks/bench_selectors.py --sessions 1 --repeats 1           # tiny "demo" checkpoint, CPU
    python benchmarks/bench_selectors.py --shape 8b --device cuda --out sel.json

The selectors of :data:`engine.cache.compaction.SELECTORS` differ in what they need when a prefix
is built: ``uniform`` and ``random`` nothing, ``diversity`` a greedy max-min order over the
span's merged features, ``attention`` a score-only pass over the vision tower's last block, which
also makes the vision encoder run eagerly instead of from its CUDA graphs (docs/QUALITY.md §4).
This benchmark measures that cost: one model, then for each selector (and compaction off) an
engine on it with ``compaction_mode="always"`` (so the miss pays for the selection), and for each
session size the four-question sessions of ``bench_prefix.py``: the miss's TTFT and vision time
and the hits' TTFT, medians over ``--repeats`` sessions with their own cache salts after one
warm-up session. Ratios are against ``uniform`` in the same run.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_prefix import bench_ours, build, log  # noqa: E402
from media import load_photos  # noqa: E402

VARIANTS = ("uniform", "attention", "diversity", "random", "off")


def engine_for(model, processor, folder, model_id: str, selector: str, args):
    """An engine on ``model`` compacting with ``selector`` (``"off"``: no compaction) at the
    run's keep ratio, as soon as each prefix is computed."""
    from engine import Engine
    from engine.engine import EngineOptions

    options = EngineOptions(compaction=None if selector == "off" else selector, compaction_mode="always",
                            keep_ratio=args.keep_ratio, kv_cache_bytes=int(args.kv_cache_gib * 2**30),
                            progress=False)
    return Engine(model, processor, model_id=model_id, folder=folder, options=options)


def ratio(value, base):
    return None if value is None or not base else value / base


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--preset", choices=("test", "demo"), default="demo", help="tiny checkpoint (default demo)")
    which.add_argument("--shape", choices=("8b", "2b"), help="random weights at a real model's shapes")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--sessions", default="1,8", help="photos per session, comma-separated (default 1,8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed sessions per size; medians (default 3)")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per question (default 4)")
    parser.add_argument("--keep-ratio", type=float, default=0.6, help="compaction keep ratio (default 0.6)")
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="KV pool (default: 16 on cuda, 0.25 on cpu)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated of {','.join(VARIANTS)}")
    parser.add_argument("--out", help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    args.kv_cache_dtype, args.skip_transformers = None, True
    if args.kv_cache_gib is None:
        args.kv_cache_gib = 16.0 if args.device == "cuda" else 0.25
    sizes = [int(s) for s in args.sessions.split(",")]
    variants = args.variants.split(",")
    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if args.device == "cuda" else torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        first, folder, _, _ = build(args, pathlib.Path(tmp), device, dtype)  # the model, once
        model, processor, model_id = first.model, first.processor, first.model_id
        first.close()
        results: dict[str, dict] = {}
        for selector in variants:
            engine = engine_for(model, processor, folder, model_id, selector, args)
            try:
                results[selector] = {str(n): bench_ours(engine, load_photos(n), args, n) for n in sizes}
            finally:
                engine.close()
            for n in sizes:
                r = results[selector][str(n)]
                log(f"{selector:>9} {n} photos: miss {r['miss_ttft_ms']:.1f} ms (vision {r['miss_vision_ms']:.1f} ms), "
                    f"hit {r['hit_ttft_ms'][0]:.1f} ms, kept {r['visual_tokens_kept']} of {r['visual_tokens']}")
    lines = ["| selector | photos | miss TTFT ms | vs uniform | miss vision ms | vs uniform | hit TTFT ms "
             "| visual tokens kept |", "|---|---|---|---|---|---|---|---|"]
    for selector in variants:
        for n in sizes:
            r, base = results[selector][str(n)], results.get("uniform", {}).get(str(n), {})
            cells = (r["miss_ttft_ms"], ratio(r["miss_ttft_ms"], base.get("miss_ttft_ms")), r["miss_vision_ms"],
                     ratio(r["miss_vision_ms"], base.get("miss_vision_ms")), r["hit_ttft_ms"][0])
            lines.append(f"| {selector} | {n} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells)
                         + f" | {r['visual_tokens_kept']} of {r['visual_tokens']} |")
    print("\n".join(lines))
    if args.out:
        meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "shape": args.shape or args.preset, "keep_ratio": args.keep_ratio, "repeats": args.repeats}
        pathlib.Path(args.out).write_text(json.dumps({"meta": meta, "results": results, "table": lines}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
