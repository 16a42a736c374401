"""Serving benchmark: N concurrent photo-chat requests through Prism's engine, beside transformers.

Run by hand (not a test)::

    python benchmarks/bench_serving.py                                   # tiny "demo" checkpoint, CPU
    python benchmarks/bench_serving.py --concurrency 1 4 16 --max-tokens 32 --out serving.json
    python benchmarks/bench_serving.py --checkpoint /models/Qwen3-VL-2B-Instruct --device cuda
    python benchmarks/bench_serving.py --shape 8b --device cuda          # Qwen3-VL-8B shapes, random bf16

For each concurrency level N, N client threads start together (a barrier) and each sends
``--rounds`` requests one after another through :meth:`Engine.generate`: one real photo from
``tests/media`` (or ``$PRISM_MEDIA_DIR``) plus a question, greedy, ``--max-tokens`` tokens with
``ignore_eos``. Photos and questions rotate, so concurrent requests differ. Reported per level:

* TTFT p50 / p99: the engine's telemetry ``ttft_ms`` (from submission: image preprocessing, queueing,
  vision encoder, prefill, first token);
* TPOT p50 / p99: telemetry ``tpot_ms`` (mean time per output token after the first);
* throughput: generated tokens of all requests / wall time of the level (first submission to last
  completion).

transformers' ``Qwen3VLForConditionalGeneration.generate`` runs ``--hf-requests`` of the same
requests one at a time (batch 1, ``min_new_tokens = max_new_tokens``), timed the same way: TTFT
from before the processor call to the first token (a streamer timestamps tokens), TPOT from the
first to the last token. ``vs HF`` is each row's throughput over transformers'.

Prism runs with its prefix and vision-feature caches off, so every request computes its whole
prompt (the rotating photos would otherwise hit the caches). ``--shape`` builds random weights in
memory with :mod:`benchmarks.shapes` (transformers gets a twin holding the same weights, built after
the engine is closed); the default builds the tiny "demo" checkpoint (:mod:`engine.tiny`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile
import threading
import time

import torch
from PIL import Image

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine import Engine, SamplingParams  # noqa: E402

MEDIA = pathlib.Path(os.environ.get("PRISM_MEDIA_DIR", ROOT / "tests" / "media"))
PHOTOS = ["astronaut.png", "chelsea.png", "coffee.png", "page.png", "grace_hopper.jpg", "logo.png", "rocket.jpg",
          "coins.png", "china.jpg", "hubble_deep_field.jpg", "text.png"]
QUESTIONS = ["Describe this image.", "What is in the picture?", "What colours stand out?", "Is there any text?",
             "Where could this be?", "Summarise the scene in one sentence.", "What is in the background?"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` (0-100) of ``values`` (NaN when empty)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def load_photos() -> list[Image.Image]:
    photos = []
    for name in PHOTOS:
        path = MEDIA / name
        if path.is_file():
            with Image.open(path) as im:
                photos.append(im.convert("RGB"))
    if not photos:
        raise SystemExit(f"no sample photos found in {MEDIA}")
    return photos


def request_messages(photos: list[Image.Image], i: int) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image", "image": photos[i % len(photos)]},
        {"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]},
    ]}]


def summarise(system: str, concurrency: int, ttft: list[float], tpot: list[float], tokens: int,
              wall_s: float) -> dict:
    return {
        "system": system, "concurrency": concurrency, "requests": len(ttft), "tokens": tokens,
        "wall_s": wall_s, "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
        "tpot_p50_ms": percentile(tpot, 50), "tpot_p99_ms": percentile(tpot, 99),
        "throughput_tok_s": tokens / wall_s if wall_s > 0 else float("nan"),
    }


# --------------------------------------------------------------------------------------------------
# Prism
# --------------------------------------------------------------------------------------------------


def run_level(engine: Engine, photos, concurrency: int, rounds: int, sampling: SamplingParams, first: int) -> dict:
    """``concurrency`` client threads, ``rounds`` requests each; request ids start at ``first``."""
    barrier = threading.Barrier(concurrency + 1)
    done, errors = [], []
    lock = threading.Lock()

    def client(c: int):
        barrier.wait()
        for r in range(rounds):
            try:
                out = engine.generate(request_messages(photos, first + c * rounds + r), sampling)
            except Exception as exc:  # report, do not hang the benchmark
                with lock:
                    errors.append(repr(exc))
                continue
            with lock:
                done.append(out)

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(concurrency)]
    for t in threads:
        t.start()
    steps_before = engine.stats()["steps"]
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        print(f"  {len(errors)} request(s) failed, e.g. {errors[0]}", file=sys.stderr)
    row = summarise("prism", concurrency, [d.telemetry.ttft_ms for d in done],
                    [d.telemetry.tpot_ms for d in done], sum(len(d.token_ids) for d in done), wall)
    row["steps"] = engine.stats()["steps"] - steps_before
    row["preempted"] = sum(d.telemetry.preempted for d in done)
    row["failed"] = len(errors)
    return row


# --------------------------------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------------------------------


class _Clock:
    """A generate() streamer recording when each new token arrives (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        value.cpu()  # wait for the device
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self):
        pass


@torch.no_grad()
def run_transformers(hf, processor, photos, n: int, max_tokens: int, pixels: dict, device) -> dict:
    ttft, tpot, tokens, busy = [], [], 0, 0.0
    for i in range(n):
        messages = request_messages(photos, i)
        start = time.perf_counter()
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = processor(text=[text], images=[messages[0]["content"][0]["image"]], images_kwargs=pixels,
                           return_tensors="pt").to(device)
        clock = _Clock()
        out = hf.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                          streamer=clock)
        end = time.perf_counter()
        generated = out.shape[1] - inputs["input_ids"].shape[1]
        tokens += generated
        busy += end - start
        ttft.append((clock.times[0] - start) * 1e3)
        if generated > 1:
            tpot.append((clock.times[-1] - clock.times[0]) * 1e3 / (generated - 1))
    return summarise("transformers", 1, ttft, tpot, tokens, busy)


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------


def print_table(rows: list[dict]) -> None:
    hf = next((r for r in rows if r["system"] == "transformers"), None)
    head = (f"{'system':<13}{'conc':>5}{'reqs':>6}{'TTFT p50':>11}{'TTFT p99':>11}{'TPOT p50':>11}"
            f"{'TPOT p99':>11}{'tok/s':>9}{'vs HF':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = f"{r['throughput_tok_s'] / hf['throughput_tok_s']:.2f}x" if hf else "-"
        print(f"{r['system']:<13}{r['concurrency']:>5}{r['requests']:>6}{r['ttft_p50_ms']:>9.1f}ms"
              f"{r['ttft_p99_ms']:>9.1f}ms{r['tpot_p50_ms']:>9.1f}ms{r['tpot_p99_ms']:>9.1f}ms"
              f"{r['throughput_tok_s']:>9.1f}{ratio:>8}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--checkpoint", help="a Qwen3-VL checkpoint folder (or Hub id)")
    which.add_argument("--preset", choices=("test", "demo"), help="build a tiny random checkpoint (default: demo)")
    which.add_argument("--shape", choices=("8b", "2b"), help="random weights at a real model's shapes (GPU)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="levels (default 1 4 16)")
    parser.add_argument("--rounds", type=int, default=1, help="requests per client thread and level (default 1)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--max-pixels", type=int, help="image budget (default 256*256 on cpu, 448*448 on cuda)")
    parser.add_argument("--kv-cache-dtype", choices=("fp8_e4m3", "auto"), default="fp8_e4m3")
    parser.add_argument("--kv-cache-gb", type=float, help="KV pool size (default: the engine's)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--hf-requests", type=int, default=4, help="requests run through transformers (0: skip)")
    parser.add_argument("--out", help="write the results as JSON to this file")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    max_pixels = args.max_pixels or (256 * 256 if device.type == "cpu" else 448 * 448)
    min_pixels = min(64 * 64, max_pixels)
    options = dict(
        kv_cache_dtype=args.kv_cache_dtype, max_pixels=max_pixels, min_pixels=min_pixels,
        max_num_seqs=max(64, max(args.concurrency)), max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_cache=False, vision_cache_bytes=0, progress=False,
    )
    if args.kv_cache_gb:
        options["kv_cache_bytes"] = int(args.kv_cache_gb * (1 << 30))
    photos = load_photos()
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="prism-bench-"))

    # ---- our engine
    t0 = time.perf_counter()
    if args.shape:
        from benchmarks import shapes

        engine = shapes.random_engine(args.shape, workdir, device=device, dtype=dtype, **options)
        folder = shapes.make_folder(args.shape, workdir)
        model_name = f"random {args.shape} shapes"
    else:
        if args.checkpoint:
            folder = args.checkpoint
        else:
            from engine.model.tiny import build_tiny_checkpoint

            folder = build_tiny_checkpoint(workdir / "ckpt", args.preset or "demo", seed=0)
        engine = Engine.from_pretrained(folder, device=device, dtype=dtype, **options)
        model_name = str(args.checkpoint or f"tiny {args.preset or 'demo'}")
    print(f"{model_name} on {device} ({dtype}), KV {args.kv_cache_dtype}, {engine.stats()['pages_total']} pages; "
          f"loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    engine.generate(request_messages(photos, 0), SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    rows, next_id = [], 0
    for n in args.concurrency:
        rows.append(run_level(engine, photos, n, args.rounds, sampling, next_id))
        next_id += n * args.rounds
        print(f"  prism x{n}: {rows[-1]['throughput_tok_s']:.1f} tok/s", file=sys.stderr)
    model = engine.model
    engine.close()

    # ---- transformers, same requests, one at a time
    if args.hf_requests > 0:
        from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

        if args.shape:
            from benchmarks import shapes

            hf = shapes.transformers_twin(model, folder)
        else:
            hf = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=dtype).to(device).eval()
        del model
        processor = AutoProcessor.from_pretrained(str(folder))
        pixels = {"min_pixels": min_pixels, "max_pixels": max_pixels}
        run_transformers(hf, processor, photos, 1, 4, pixels, device)  # warm-up
        rows.insert(0, run_transformers(hf, processor, photos, args.hf_requests, args.max_tokens, pixels, device))

    print()
    print(f"{model_name}, {device} ({dtype}), KV cache {args.kv_cache_dtype}, {args.max_tokens} tokens/request, "
          f"images <= {max_pixels} px")
    print_table(rows)
    if args.out:
        meta = {"model": model_name, "device": str(device), "dtype": str(dtype), "kv_cache_dtype": args.kv_cache_dtype,
                "max_tokens": args.max_tokens, "max_pixels": max_pixels, "rounds": args.rounds,
                "torch": torch.__version__, "python": platform.python_version(),
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
        pathlib.Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
