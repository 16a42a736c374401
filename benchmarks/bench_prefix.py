"""Time-to-first-token of prefix-cache misses and hits, and what the compact prefix saves (run by hand).

    python benchmarks/bench_prefix.py                          # tiny "demo" checkpoint, CPU
    python benchmarks/bench_prefix.py --sessions 1,4 --repeats 1 --skip-transformers
    python benchmarks/bench_prefix.py --shape 8b --device cuda --out prefix.json   # 8B-shaped, random

For each session size (1, 4 and 8 photos from ``tests/media``, resized to 448x448) a chat
session asks four different questions about the same photos in Prism's media-first layout
(:func:`engine.inputs.prompts.media_first_messages`): the first is a miss (vision encoder, whole prompt,
compaction, caching), the next three are prefix-cache hits. Each session has its own cache salt,
so a session never reuses another's KV or vision features. Reported per size, as the median over
``--repeats`` sessions (after one untimed warm-up session):

* TTFT of the miss and of each hit (engine telemetry: from submission, preprocessing included);
* prefix KV pages dense vs compact (``keep_ratio`` 0.6 by default) and the prefix's KV bytes. The
  engine compacts when the prefix is cached (``--compaction-mode always``, the default here), so
  the hits attend to the compact prefix and "compact" is its pages; ``--compaction-mode
  on_pressure`` (the engine's default) measures a pool that never runs short: the prefix stays
  dense and both columns are equal. The mode is printed and written to the JSON;
* transformers' cold TTFT on the same prompt (processor + one prefill forward, batch 1) and our
  miss / hit TTFT as a ratio of it (``--skip-transformers`` leaves it out);
* KV bytes per token over all layers, Scaled-FP8 vs bfloat16 (:func:`ops.kv_bytes_per_token`).

Photos come from ``$PRISM_MEDIA_DIR`` when set. ``--shape 8b`` builds random weights at
Qwen3-VL-8B's shapes on the device (see ``benchmarks/shapes.py``); on CUDA the engine's telemetry
and the transformers timings are taken after synchronising the device.
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

from media import load_photos  # noqa: E402

QUESTIONS = (
    "What do these pictures show? Answer briefly.",
    "Which picture has the most vivid colours, and why?",
    "Is there any readable text in the pictures? Quote it.",
    "Count the people in each picture.",
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# --------------------------------------------------------------------------------------------
# engines
# --------------------------------------------------------------------------------------------


def build(args, workdir: pathlib.Path, device: torch.device, dtype: torch.dtype):
    """(our engine, a loader of the transformers twin, description)."""
    options = {"progress": False, "keep_ratio": args.keep_ratio, "compaction_mode": args.compaction_mode}
    if args.kv_cache_gib is not None or device.type == "cuda":  # leave room for the transformers twin
        options["kv_cache_bytes"] = int((args.kv_cache_gib or 16) * 2**30)
    if args.kv_cache_dtype:
        options["kv_cache_dtype"] = args.kv_cache_dtype
    if args.shape:
        import shapes

        engine = shapes.random_engine(args.shape, workdir, device=str(device), dtype=dtype, **options)
        folder = workdir / f"shape-{args.shape}"

        def twin():
            return shapes.transformers_twin(engine.model, folder)

        return engine, folder, twin, f"Qwen3-VL-{args.shape.upper()} shape, random weights"

    from engine import Engine
    from engine.model.tiny import build_tiny_checkpoint

    folder = build_tiny_checkpoint(workdir / args.preset, args.preset, seed=0)
    engine = Engine.from_pretrained(folder, device=str(device), dtype=dtype, **options)

    def twin():
        from transformers import Qwen3VLForConditionalGeneration

        model = Qwen3VLForConditionalGeneration.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa")
        return model.to(device).eval()

    return engine, folder, twin, f"tiny '{args.preset}' preset, random weights"


# --------------------------------------------------------------------------------------------
# measurements
# --------------------------------------------------------------------------------------------


def run_session(engine, images, salt: str, max_tokens: int) -> list[dict]:
    """Ask the four questions in one session; telemetry of each as a dict."""
    from engine import SamplingParams
    from engine.inputs.prompts import media_first_messages

    out = []
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for q in QUESTIONS:
        tel = engine.generate(media_first_messages(images, q), sampling, cache_salt=salt).telemetry
        out.append(tel.to_dict())
    return out


def bench_ours(engine, images, args, n: int) -> dict:
    run_session(engine, images, f"warmup-{n}", args.max_tokens)
    sessions = [run_session(engine, images, f"bench-{n}-{r}-{time.time_ns()}", args.max_tokens)
                for r in range(args.repeats)]
    states = [[s[i]["prefix_cache"] for s in sessions] for i in range(len(QUESTIONS))]
    first = sessions[0]
    return {
        "prompt_tokens": first[0]["prompt_tokens"],
        "visual_tokens": first[0]["visual_tokens"],
        "visual_tokens_kept": first[0]["visual_tokens_kept"],
        "prefix_pages_dense": first[0]["prefix_pages_dense"],
        "prefix_pages": first[0]["prefix_pages"],
        "prefix_cache": states,
        "miss_ttft_ms": median(s[0]["ttft_ms"] for s in sessions),
        "hit_ttft_ms": [median(s[i]["ttft_ms"] for s in sessions) for i in range(1, len(QUESTIONS))],
        "hit_computed_tokens": [s[1]["computed_tokens"] for s in sessions],
        "miss_vision_ms": median(s[0]["vision_ms"] for s in sessions),
        "sessions": sessions,
    }


def bench_transformers(model, processor, images, device, repeats: int) -> dict:
    """Cold TTFT at batch 1: processor call + one prefill forward (last position's logits)."""
    from engine.inputs.prompts import media_first_messages

    messages = media_first_messages(images, QUESTIONS[0])
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            sync()
            t0 = time.perf_counter()
            inputs = processor(text=[text], images=images, return_tensors="pt")
            inputs = {k: v.to(device) for k, v in inputs.items()}
            out = model(**inputs, logits_to_keep=1, use_cache=True)
            int(out.logits[0, -1].argmax())
            sync()
            if i:  # the first is a warm-up
                times.append((time.perf_counter() - t0) * 1e3)
            del out
    return {"ttft_ms": median(times), "prompt_tokens": int(inputs["input_ids"].shape[1])}


def kv_bytes(config) -> dict:
    """KV bytes per token over all layers: Scaled-FP8 (scales included) vs bfloat16."""
    from ops import kv_bytes_per_token

    t = config.text
    per = {kind: kv_bytes_per_token(t.num_key_value_heads, t.head_dim, kind, torch.bfloat16) * t.num_hidden_layers
           for kind in ("fp8_e4m3", "auto")}
    return {"fp8_e4m3": per["fp8_e4m3"], "bfloat16": per["auto"], "ratio": per["auto"] / per["fp8_e4m3"]}


def engine_kv_bytes(engine) -> int:
    """KV bytes per token over all layers in ``engine``'s pool (its KV dtype and model dtype)."""
    from ops import kv_bytes_per_token

    t = engine.config.text
    per = kv_bytes_per_token(t.num_key_value_heads, t.head_dim, engine.pool.kv_cache_dtype, engine.dtype)
    return per * t.num_hidden_layers


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def fmt(v, digits=1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(rows: list[dict], page_size: int, bytes_per_token: int) -> str:
    head = (f"{'photos':>6} {'visual':>7} {'prompt':>7} {'miss ms':>9} {'hit1 ms':>8} {'hit2 ms':>8} {'hit3 ms':>8} "
            f"{'hit/miss':>8} {'pages dense':>11} {'compact':>8} {'prefix MiB':>10} {'HF ms':>8} {'miss/HF':>8} "
            f"{'hit/HF':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        o, hf = r["ours"], r.get("transformers")
        hit = median(o["hit_ttft_ms"])
        hf_ms = hf["ttft_ms"] if hf else None
        mib = o["prefix_pages"] * page_size * bytes_per_token / 2**20
        lines.append(
            f"{r['photos']:>6} {o['visual_tokens']:>7} {o['prompt_tokens']:>7} {fmt(o['miss_ttft_ms']):>9} "
            + " ".join(f"{fmt(h):>8}" for h in o["hit_ttft_ms"])
            + f" {fmt(hit / o['miss_ttft_ms'], 3):>8} {o['prefix_pages_dense']:>11} {o['prefix_pages']:>8} "
            f"{fmt(mib, 2):>10} {fmt(hf_ms):>8} {fmt(o['miss_ttft_ms'] / hf_ms if hf_ms else None, 2):>8} "
            f"{fmt(hit / hf_ms if hf_ms else None, 3):>7}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--preset", choices=("test", "demo"), default="demo", help="tiny checkpoint (default demo)")
    which.add_argument("--shape", choices=("8b", "2b"), help="random weights at a real model's shapes")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--sessions", default="1,4,8", help="photos per session, comma-separated (default 1,4,8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed sessions per size; medians (default 3)")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per question (default 4)")
    parser.add_argument("--keep-ratio", type=float, default=0.6, help="compaction keep ratio (default 0.6)")
    parser.add_argument("--compaction-mode", choices=("always", "on_pressure"), default="always",
                        help="when the prefix is compacted (default always: when cached, so hits use the compact "
                             "prefix; on_pressure keeps it dense in a pool that never runs short)")
    parser.add_argument("--kv-cache-dtype", choices=("fp8_e4m3", "auto"), help="default: the engine's (FP8)")
    parser.add_argument("--kv-cache-gib", type=float, help="KV pool size (default: 16 on cuda, the engine's on cpu)")
    parser.add_argument("--skip-transformers", action="store_true", help="time only our engine")
    parser.add_argument("--out", help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    if args.repeats < 1 or args.max_tokens < 1:
        parser.error("--repeats and --max-tokens must be >= 1")
    sizes = [int(s) for s in args.sessions.split(",") if s.strip()]
    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)

    rows = []
    with tempfile.TemporaryDirectory(prefix="prism-bench-prefix-") as tmp:
        t = time.perf_counter()
        engine, folder, twin, description = build(args, pathlib.Path(tmp), device, dtype)
        log(f"engine ready in {time.perf_counter() - t:.1f} s ({description})")
        try:
            for n in sizes:
                images = load_photos(n)
                log(f"{n} photo(s): ours ...")
                rows.append({"photos": n, "ours": bench_ours(engine, images, args, n)})
            stats = engine.stats()
            kv = kv_bytes(engine.config)
            page_size = engine.pool.page_size
            pool_bytes = engine_kv_bytes(engine)
            if not args.skip_transformers:
                from transformers import AutoProcessor

                log("transformers ...")
                processor = AutoProcessor.from_pretrained(str(folder))
                hf = twin()
                for row in rows:
                    theirs = bench_transformers(hf, processor, load_photos(row["photos"]), device, args.repeats)
                    row["transformers"] = theirs
                    if theirs["prompt_tokens"] != row["ours"]["prompt_tokens"]:
                        log(f"WARNING: prompt lengths differ for {row['photos']} photo(s): ours "
                            f"{row['ours']['prompt_tokens']}, transformers {theirs['prompt_tokens']}")
                del hf
        finally:
            engine.close()

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"checkpoint: {description}; device {dev_name}, dtype {str(dtype).removeprefix('torch.')}, "
          f"KV pages {stats['kv_cache_dtype']} x {page_size} tokens, keep_ratio {args.keep_ratio}, "
          f"compaction_mode {args.compaction_mode}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"each session: {len(QUESTIONS)} questions ({args.max_tokens} tokens each), first a miss, then hits; "
          f"median of {args.repeats} session(s) after 1 warm-up")
    print(table(rows, page_size, pool_bytes))
    print(f"KV bytes per token, all {engine.config.text.num_hidden_layers} layers: FP8 {kv['fp8_e4m3']} "
          f"(scales included) vs bf16 {kv['bfloat16']}: {kv['ratio']:.2f}x more tokens per byte with FP8")
    verdicts = []
    for r in rows:
        o = r["ours"]
        ratio = median(o["hit_ttft_ms"]) / o["miss_ttft_ms"]
        states_ok = all(s == "miss" for s in o["prefix_cache"][0]) and all(
            s == "hit" for q in o["prefix_cache"][1:] for s in q)
        verdicts.append(ratio < 0.5 and states_ok)
        print(f"{r['photos']} photo(s): hit TTFT = {ratio:.3f} x miss TTFT"
              f" ({'well under half' if ratio < 0.25 else 'under half' if ratio < 0.5 else 'NOT under half'});"
              f" states {'as expected' if states_ok else o['prefix_cache']}")
    print("hit TTFT under half of the miss TTFT for every size:", "yes" if all(verdicts) else "NO")
    if args.out:
        result = {"checkpoint": description, "device": dev_name, "dtype": str(dtype).removeprefix("torch."),
                  "kv_cache_dtype": stats["kv_cache_dtype"], "page_size": page_size, "keep_ratio": args.keep_ratio,
                  "compaction_mode": args.compaction_mode,
                  "questions": QUESTIONS, "max_tokens": args.max_tokens, "repeats": args.repeats,
                  "kv_bytes_per_token": kv, "rows": rows, "engine_stats": stats}
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
