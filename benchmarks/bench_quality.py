"""What compaction costs a model that sees: the quality suite through Prism's engine (issue 20).

    python benchmarks/bench_quality.py --model benchmarks/quality/probe --samples 500 --blind --out q.json
    python benchmarks/bench_quality.py --model PATH --device cuda --samples 2500 --out q.json   # real weights

For compaction off and for each selector x keep ratio (``--selectors``, ``--ratios``; default
every selector of ``engine.cache.compaction.SELECTORS`` at 1.0, 0.8, 0.6, 0.4, 0.25 with
``--min-keep 1``, so the ratio alone decides), the held-out samples ``heldout(N)`` are answered
greedily through ``engine.Engine``, each question under a fresh cache salt: its prefix is computed,
compacted and cached, and the question then attends to the compact prefix exactly as a later hit
would (see ``benchmarks/quality/harness.py``). The engines compact when the prefix is cached
(``compaction_mode="always"``, :data:`COMPACTION_MODE`): under the engine's default
``"on_pressure"`` a prefix is compacted only when the KV pool runs short, which these pools never
do, so every row would be the dense model's. Requests are submitted from many threads at once,
so the engine batches them. At keep ratio 1.0 every selector keeps every token (``keep_count`` is
the span length), so 1.0 is run once (``uniform``) and stands for all of them.

A selector named ``<selector>+merge`` (e.g. ``--selectors staggered,staggered+merge``) runs the
merging variant of that selector (``merge_values=True``, issue 35.3: the same kept tokens, the
dropped ones' values folded into their nearest kept neighbours); it is in no default list, so the
curves include it only when asked, under its own name.

``--blind`` adds the blind control (images shuffled between samples with the same image count,
compaction off) and the answer-frequency prior it should fall to.

``--transfer N`` also asks the first N questions of the transfer split (``transfer(N)``:
``count_colour``, a combination of skills no training stage asks) in every configuration, in
the same engine; they are reported beside the others (``run["transfer"]``, the ``transf`` column)
and stay out of the held-out report and its ``all``. ``--no-dense`` leaves compaction off out (to
split the configurations over several processes; ``quality_report.py`` merges their JSONs).
``--kv-cache-gib`` sizes each engine's KV pool (default: the engine's, most free GPU memory on
CUDA, which several processes on one GPU cannot share).

Prints accuracy per type and the kept share per configuration (the visual tokens the answers'
prefixes kept, from the engine's telemetry: 38 of each 64-token probe image at 0.6), and how many
samples give a ±2-point 95% interval; writes everything, the per-sample answers included (for paired
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

from benchmarks.quality import QUESTION_TYPES, heldout, transfer  # noqa: E402
from benchmarks.quality.harness import (  # noqa: E402
    Answers,
    answer_all,
    answer_prior,
    blind,
    half_width,
    majority_rate,
    report,
    samples_for,
)

RATIOS = (1.0, 0.8, 0.6, 0.4, 0.25)
#: What the harness measures: answers that attend to the compact prefix, as a hit on a compacted
#: entry does. Compaction at cache time is the only mode that guarantees it for every question.
COMPACTION_MODE = "always"


def configurations(selectors: list[str], ratios: list[float]) -> list[tuple[str | None, float]]:
    """``(None, 1.0)`` (compaction off), then each selector x ratio; ratio 1.0 once (uniform)."""
    out: list[tuple[str | None, float]] = [(None, 1.0)]
    if 1.0 in ratios:
        out.append(("uniform", 1.0))
    out += [(s, r) for s in selectors for r in ratios if r != 1.0]
    return out


MERGE_SUFFIX = "+merge"


def parse_selector(name: str | None) -> tuple[str | None, bool]:
    """``(method, merge_values)`` of a ``--selectors`` entry: ``"staggered"`` -> ``("staggered",
    False)``, ``"staggered+merge"`` -> ``("staggered", True)``; None (compaction off) -> ``(None, False)``."""
    if name is not None and name.endswith(MERGE_SUFFIX):
        return name[: -len(MERGE_SUFFIX)], True
    return name, False


def line(name: str, rep: dict, trans: dict | None = None) -> str:
    cells = " ".join(f"{100 * rep[t]['accuracy']:6.1f}" if t in rep else "     -" for t in (*QUESTION_TYPES, "all"))
    if trans is not None:
        cells += f" {100 * trans['all']['accuracy']:6.1f}"
    return f"{name:<22} {cells}   kept {100 * rep['kept_share']:5.1f}% ({rep['kept_tokens']:.1f} tokens)"


def split_answers(answers: Answers, n: int) -> tuple[Answers, Answers]:
    """The first ``n`` answers (the held-out questions) and the rest (the transfer questions)."""
    return (Answers(answers.texts[:n], answers.kept[:n], answers.visual[:n]),
            Answers(answers.texts[n:], answers.kept[n:], answers.visual[n:]))


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
    ap.add_argument("--selectors", default=",".join(sorted(SELECTORS)),
                    help=f"comma-separated SELECTORS keys; '<key>{MERGE_SUFFIX}' for the merging variant")
    ap.add_argument("--ratios", default=",".join(map(str, RATIOS)))
    ap.add_argument("--min-keep", type=int, default=1)
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--blind", action="store_true", help="also the blind control (images shuffled)")
    ap.add_argument("--transfer", type=int, default=0, help="also this many transfer-split questions, reported apart")
    ap.add_argument("--dense", action=argparse.BooleanOptionalAction, default=True,
                    help="run compaction off (--no-dense: only the compacted configurations)")
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="KV pool per engine in GiB")
    ap.add_argument("--out", type=pathlib.Path, required=True)
    args = ap.parse_args(argv)

    samples = heldout(args.samples, start=args.start)
    trans = transfer(args.transfer)
    kv_bytes = None if args.kv_cache_gib is None else int(args.kv_cache_gib * (1 << 30))
    selectors = [s for s in args.selectors.split(",") if s]
    unknown = [s for s in selectors if parse_selector(s)[0] not in SELECTORS]
    if unknown:
        ap.error(f"unknown selectors {unknown}: keys of SELECTORS {sorted(SELECTORS)}, optionally + '{MERGE_SUFFIX}'")
    ratios = [float(r) for r in args.ratios.split(",") if r]
    out: dict = {"model": str(args.model), "device": args.device, "samples": len(samples), "start": args.start,
                 "min_keep": args.min_keep, "kv_cache_dtype": args.kv_cache_dtype, "compaction_mode": COMPACTION_MODE,
                 "transfer": len(trans),
                 "majority_rate": majority_rate(samples), "runs": []}
    header = f"{'configuration':<22} " + " ".join(f"{t[:6]:>6}" for t in (*QUESTION_TYPES, "all"))
    if trans:
        header += " transf"
    print(f"{len(samples)} held-out samples; {header}", flush=True)
    plan = [("off", None, 1.0, samples, trans)] if args.dense else []
    plan += [(f"{m}@{r}", m, r, samples, trans) for m, r in configurations(selectors, ratios)[1:]]
    if args.blind:
        plan.insert(1 if args.dense else 0, ("blind", None, 1.0, blind(samples), blind(trans)))
    for name, selector, ratio, qs, tq in plan:
        t0 = time.perf_counter()
        method, merge = parse_selector(selector)
        with Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype, progress=False,
                                    kv_cache_dtype=args.kv_cache_dtype, compaction=method, keep_ratio=ratio,
                                    merge_values=merge,
                                    compaction_mode=COMPACTION_MODE, min_keep=args.min_keep, conversation_reuse=False,
                                    max_num_seqs=args.threads, kv_cache_bytes=kv_bytes) as engine:
            answers, tanswers = split_answers(answer_all(engine, [*qs, *tq], name, args.threads), len(qs))
        rep = report(qs, answers)
        run = {"name": name, "selector": selector, "merge_values": merge, "keep_ratio": ratio,
               "seconds": time.perf_counter() - t0, "report": rep, "answers": answers.texts}
        if tq:
            run["transfer"] = {"report": report(tq, tanswers), "answers": tanswers.texts}
        if name == "blind":
            run["answer_prior"] = answer_prior(qs, answers.texts)
            if tq:
                run["transfer"]["answer_prior"] = answer_prior(tq, tanswers.texts)
        out["runs"].append(run)
        print(line(name, rep, run["transfer"]["report"] if tq else None) + f"   {run['seconds']:.0f} s", flush=True)
        if name == "blind":
            print(f"{'  answer-frequency prior':<22} " + " ".join(
                f"{100 * run['answer_prior'].get(t, float('nan')):6.1f}" for t in (*QUESTION_TYPES, "all")), flush=True)
        args.out.write_text(json.dumps(out, indent=1))
    if not args.dense:
        return 0
    dense = out["runs"][0]["report"]["all"]["accuracy"]
    print(f"±{100 * half_width(dense, len(samples)):.1f} points (95%) on the dense accuracy with {len(samples)} "
          f"samples; ±2 points needs {samples_for(0.02, dense)} samples at p = {dense:.2f} "
          f"({samples_for(0.02)} at p = 0.5); per type it needs that many of each type "
          f"({5 * samples_for(0.02)} held-out samples in all at p = 0.5).", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
