"""Warm at upload through the engine API: a session's first question cold, after a warm, and a hit,
and a running stream's TPOT while another session warms (run by hand).

    python benchmarks/bench_warm_engine.py --shape 8b --device cuda --out warm_engine.json   # the H200
    python benchmarks/bench_warm_engine.py --model test --sessions 3 --out warm_engine.json  # CPU, the script

In one run, on one engine (the defaults: Scaled-FP8 pages, compaction on pressure, CUDA graphs):

* ``--sessions`` sessions of ``--photos`` photos each (crops of the committed photos, distinct per
  session, ``--side`` px). For each session, side by side: session ``cold`` asks its first question
  with nothing cached (TTFT of a miss), session ``warmed`` first calls ``Engine.warm`` on its photos
  and waits for it, then asks (TTFT of the first question after its warm finished), and the cold
  session asks again (TTFT of a hit). Reported: the medians and ``warmed / hit``, the goal's ratio
  (<= 1.2).
* TPOT: a stream of ``--stream-tokens`` tokens (ignore EOS) on a session whose prefix is cached,
  alone, then with another session's warm submitted after its 16th token; p50 of the inter-token
  intervals of each, and their ratio (the goal: <= 1.05), ``--repeats`` times alternating.

The engine API, not HTTP: the issue's /v1 measurement at the 8B shape needs a checkpoint on disk
for the app (benchmarks/bench_http.py writes 16 GB for it); this one builds random weights in
memory. Times are the engine's telemetry (TTFT from submission, preprocessing included) and
``perf_counter`` between a stream's tokens.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import working_set as ws  # noqa: E402
from media import MEDIA_DIR, PHOTOS  # noqa: E402


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def build_engine(args, workdir: pathlib.Path):
    from engine import Engine

    if args.shape:
        import shapes

        return shapes.random_engine(args.shape, workdir, device=args.device, progress=False)
    from engine.model.tiny import build_tiny_checkpoint

    folder = build_tiny_checkpoint(workdir / args.model, args.model, seed=0)
    return Engine.from_pretrained(folder, device=args.device, progress=False)


def session_photos(index: int, args, photo_dir: pathlib.Path) -> list[dict]:
    group = ws.make_group(index, 7, photo_dir, media_dir=MEDIA_DIR, photos=PHOTOS, sides=(args.side, args.side),
                          count=(args.photos, args.photos))
    return group.images


def ttft(engine, images, question: str, salt: str):
    from engine import SamplingParams, media_first_messages

    done = engine.generate(media_first_messages(images, question), SamplingParams(max_tokens=1), cache_salt=salt)
    return done.telemetry


def stream_tpot(engine, images, salt: str, tokens: int, during=None) -> float:
    """p50 ms between the stream's tokens after the first; ``during()`` is called after the 16th."""
    from engine import Completion, SamplingParams, media_first_messages

    stamps = []
    handle = engine.submit(media_first_messages(images, "Tell a long story about these photos."),
                           SamplingParams(max_tokens=tokens, ignore_eos=True), cache_salt=salt)
    for item in handle:
        if isinstance(item, Completion):
            break
        stamps.append(time.perf_counter())
        if len(stamps) == 16 and during is not None:
            during()
    gaps = [(b - a) * 1e3 for a, b in zip(stamps[1:], stamps[2:], strict=False)]
    return statistics.median(gaps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", default="test", help="tiny preset 'test' or 'demo' (default test)")
    which.add_argument("--shape", choices=("8b", "2b"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--photos", type=int, default=8)
    parser.add_argument("--side", type=int, default=512)
    parser.add_argument("--stream-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="warm_engine.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="prism-warm-") as tmp:
        workdir = pathlib.Path(tmp)
        engine = build_engine(args, workdir)
        photos = workdir / "photos"
        try:
            ttft(engine, session_photos(999, args, photos), "Warm-up?", "warm-up")  # captures, kernels
            rows = []
            for i in range(args.sessions):
                cold_images, warm_images = session_photos(2 * i, args, photos), session_photos(2 * i + 1, args, photos)
                cold = ttft(engine, cold_images, "What is in the photos?", f"cold-{i}")
                t = time.perf_counter()
                engine.warm(warm_images, cache_salt=f"warmed-{i}").result(120)
                warm_s = time.perf_counter() - t
                warmed = ttft(engine, warm_images, "What is in the photos?", f"warmed-{i}")
                hit = ttft(engine, cold_images, "And what else?", f"cold-{i}")
                rows.append({"cold_ms": cold.ttft_ms, "cold_state": cold.prefix_cache, "warm_ms": warm_s * 1e3,
                             "warmed_ms": warmed.ttft_ms, "warmed_state": warmed.prefix_cache,
                             "warmed_flag": warmed.warmed, "hit_ms": hit.ttft_ms, "hit_state": hit.prefix_cache,
                             "prompt_tokens": cold.prompt_tokens})
                log(f"session {i}: cold {cold.ttft_ms:.1f} ({cold.prefix_cache}), warm took {warm_s * 1e3:.1f}, "
                    f"warmed {warmed.ttft_ms:.1f} ({warmed.prefix_cache}, warmed={warmed.warmed}), "
                    f"hit {hit.ttft_ms:.1f} ms")
            streaming = session_photos(500, args, photos)
            ttft(engine, streaming, "Cache it.", "stream")
            tpot = {"alone": [], "with_warm": []}
            for r in range(args.repeats):
                tpot["alone"].append(stream_tpot(engine, streaming, "stream", args.stream_tokens))
                other, salt, handles = session_photos(600 + r, args, photos), f"during-{r}", []

                def start_warm(other=other, salt=salt, handles=handles):
                    handles.append(engine.warm(other, cache_salt=salt))

                tpot["with_warm"].append(
                    stream_tpot(engine, streaming, "stream", args.stream_tokens, during=start_warm))
                for h in handles:
                    h.result(120)
                log(f"TPOT p50 alone {tpot['alone'][-1]:.3f} ms, with a warm {tpot['with_warm'][-1]:.3f} ms")
        finally:
            stats = engine.stats()
            engine.close()

    def med(key):
        return statistics.median(r[key] for r in rows)

    result = {
        "setup": {"shape": args.shape, "model": None if args.shape else args.model, "device": args.device,
                  "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                  "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else argv},
        "sessions": rows,
        "ttft_ms_median": {"cold": med("cold_ms"), "warmed": med("warmed_ms"), "hit": med("hit_ms"),
                           "warm_took": med("warm_ms")},
        "warmed_over_hit": med("warmed_ms") / med("hit_ms"),
        "tpot_ms_p50": tpot,
        "tpot_with_warm_over_alone": statistics.median(tpot["with_warm"]) / statistics.median(tpot["alone"]),
        "warm_stats": {k: v for k, v in stats.items() if k.startswith("warms")},
    }
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("ttft_ms_median", "warmed_over_hit", "tpot_with_warm_over_alone",
                                              "warm_stats")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
