"""What compaction costs a model that sees: the quality suite through Prism's engine (issue 20).

    python benchmarks/bench_quality.py --model benchmarks/quality/probe --samples 500 --blind --out q.json
    python benchmarks/bench_quality.py --model PATH --device cuda --samples 2500 --out q.json   # real weights

For compaction off and for each selector x keep ratio (``--selectors``, ``--ratios``; default
every selector of ``engine.cache.compaction.SELECTORS`` at 1.0, 0.8, 0.6, 0.4, 0.25 with
``--min-keep 1``, so the ratio alone decides), the held-out samples ``heldout(N)`` are answered
greedily through ``engine.Engine``, each question under a fresh cache salt: its prefix is computed,
compacted and cached, and the question then attends to the compact prefix exactly as a later hit
would (see ``benchmarks/quality/harness.py``). Requests are submitted from many threads at once,
so the engine batches them. At keep ratio 1.0 every selector keeps every token (``keep_count`` is
the span length), so 1.0 is run once (``uniform``) and stands for all of them.

``--blind`` adds the blind control (images shuffled between samples with the same image count,
compaction off) and the answer-frequency prior it should fall to.

Prints accuracy per type and the kept share per configuration, and how many samples give a
±2-point 95% interval; writes everything, the per-sample answers included (for paired
comparisons), to ``--out``. The JSON is rewritten after every configuration. Works on any
Qwen3-VL checkpoint the engine loads (``--kv-cache-dtype`` defaults to ``auto``: the model dtype).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.quality import QUESTION_TYPES, heldout  # noqa: E402
from benchmarks.quality.harness import (  # noqa: E402
    answer_all,
    answer_prior,
    blind,
    half_width,
    majority_rate,
    report,
    samples_for,
)

RATIOS = (1.0, 0.8, 0.6, 0.4, 0.25)


def configurations(selectors: list[str], ratios: list[float]) -> list[tuple[str | None, float]]:
    """``(None, 1.0)`` (compaction off), then each selector x ratio; ratio 1.0 once (uniform)."""
    out: list[tuple[str | None, float]] = [(None, 1.0)]
    if 1.0 in ratios:
        out.append(("uniform", 1.0))
    out += [(s, r) for s in selectors for r in ratios if r != 1.0]
    return out


def line(name: str, rep: dict) -> str:
    cells = " ".join(f"{100 * rep[t]['accuracy']:6.1f}" if t in rep else "     -" for t in (*QUESTION_TYPES, "all"))
    return f"{name:<22} {cells}   kept {100 * rep['kept_share']:5.1f}% ({rep['kept_tokens']:.1f} tokens)"


def main(argv: list[str] | None = None) -> int:
    from engine import Engine
    from engine.cache.compaction import SELECTORS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint folder (benchmarks/quality/probe) or model id")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the engine's for the device)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--samples", type=int, default=500)
    ap.add_argument("--start", type=int, default=0, help="first held-out index")
    ap.add_argument("--selectors", default=",".join(sorted(SELECTORS)))
    ap.add_argument("--ratios", default=",".join(map(str, RATIOS)))
    ap.add_argument("--min-keep", type=int, default=1)
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--blind", action="store_true", help="also the blind control (images shuffled)")
    ap.add_argument("--out", type=pathlib.Path, required=True)
    args = ap.parse_args(argv)

    samples = heldout(args.samples, start=args.start)
    selectors = [s for s in args.selectors.split(",") if s]
    ratios = [float(r) for r in args.ratios.split(",") if r]
    out: dict = {"model": str(args.model), "device": args.device, "samples": len(samples), "start": args.start,
                 "min_keep": args.min_keep, "kv_cache_dtype": args.kv_cache_dtype,
                 "majority_rate": majority_rate(samples), "runs": []}
    header = f"{'configuration':<22} " + " ".join(f"{t[:6]:>6}" for t in (*QUESTION_TYPES, "all"))
    print(f"{len(samples)} held-out samples; {header}", flush=True)
    plan = [("off", None, 1.0, samples)]
    plan += [(f"{m}@{r}", m, r, samples) for m, r in configurations(selectors, ratios)[1:]]
    if args.blind:
        plan.insert(1, ("blind", None, 1.0, blind(samples)))
    for name, method, ratio, qs in plan:
        t0 = time.perf_counter()
        with Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype, progress=False,
                                    kv_cache_dtype=args.kv_cache_dtype, compaction=method, keep_ratio=ratio,
                                    compaction_mode="always", min_keep=args.min_keep, conversation_reuse=False,
                                    max_num_seqs=args.threads) as engine:
            answers = answer_all(engine, qs, name, args.threads)
        rep = report(qs, answers)
        run = {"name": name, "selector": method, "keep_ratio": ratio, "seconds": time.perf_counter() - t0,
               "report": rep, "answers": answers.texts}
        if name == "blind":
            run["answer_prior"] = answer_prior(qs, answers.texts)
        out["runs"].append(run)
        print(line(name, rep) + f"   {run['seconds']:.0f} s", flush=True)
        if name == "blind":
            print(f"{'  answer-frequency prior':<22} " + " ".join(
                f"{100 * run['answer_prior'].get(t, float('nan')):6.1f}" for t in (*QUESTION_TYPES, "all")), flush=True)
        args.out.write_text(json.dumps(out, indent=1))
    dense = out["runs"][0]["report"]["all"]["accuracy"]
    print(f"±{100 * half_width(dense, len(samples)):.1f} points (95%) on the dense accuracy with {len(samples)} "
          f"samples; ±2 points needs {samples_for(0.02, dense)} samples at p = {dense:.2f} "
          f"({samples_for(0.02)} at p = 0.5); per type it needs that many of each type "
          f"({5 * samples_for(0.02)} held-out samples in all at p = 0.5).", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
