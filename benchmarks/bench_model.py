"""Time prefill and decode of Prism's engine beside transformers' Qwen3-VL on one checkpoint.

Run by hand (not a test)::

    python benchmarks/bench_model.py                           # tiny "demo" checkpoint, CPU
    python benchmarks/bench_model.py --preset test --images 1 --decode-tokens 16
    python benchmarks/bench_model.py --checkpoint /models/Qwen3-VL-2B-Instruct --device cuda
    python benchmarks/bench_model.py --shape 8b --device cuda  # Qwen3-VL-8B shape, random weights in GPU memory

The prompt is one user turn with ``--images`` photos from ``tests/media`` (relative to the
repository root), each resized to 448x448, and a question. Measured, after warm-up runs, as the
median of ``--repeats``:

* prefill: ours = the engine's telemetry ``vision_ms + prefill_ms`` (vision encoder and prompt
  forward, no image preprocessing); transformers = one forward over the whole prompt with the
  pixels (vision encoder included, ``logits_to_keep=1``);
* TTFT: ours = telemetry ``ttft_ms`` (from submission: preprocessing, vision, prefill, first
  token); transformers = processor call + the prefill forward;
* decode ms/token: ours = telemetry ``tpot_ms`` of a ``--decode-tokens`` greedy run with
  ``ignore_eos``; transformers = (time of ``generate`` with ``min_new_tokens = max_new_tokens =
  N`` minus the time of the same ``generate`` for 1 token, i.e. its prefill) / (N - 1).

Our engine runs with its prefix and vision-feature caches off (every repeat computes the whole
prompt) and otherwise its defaults (e.g. its KV-cache dtype; see ``--kv-cache-dtype``). The two
models run one after the other, so only one is in (GPU) memory at a time. On CUDA every timing
synchronises the device first.

Building a tiny or 8B-shaped checkpoint needs the Qwen tokenizer ranks from the ``dashscope``
package (see :mod:`engine.tiny`); on a machine without it, carry its wheel along. ``--shape 8b``
writes about 17.5 GB of bfloat16 weights into a temporary folder and loads them twice, one model
after the other, so it wants a GPU with 40+ GB and a few minutes.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from media import IMAGE_SIDE, load_photos  # noqa: E402

QUESTION = "Describe these pictures in detail and say what they have in common."

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------------------------
# Setup
# --------------------------------------------------------------------------------------------


def messages_for(images) -> list[dict]:
    parts = [{"type": "image", "image": im} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


def prepare_checkpoint(args, workdir: pathlib.Path) -> tuple[pathlib.Path, str]:
    """Return (checkpoint folder, description)."""
    if args.checkpoint:
        return pathlib.Path(args.checkpoint), str(args.checkpoint)
    from engine.model.tiny import build_tiny_checkpoint

    if args.shape == "8b":  # config and tokenizer only: the weights are drawn in device memory
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import shapes

        return shapes.make_folder("8b", workdir), "Qwen3-VL-8B shape, random weights (in memory)"
    preset = args.preset or "demo"
    return build_tiny_checkpoint(workdir / preset, preset, seed=0), f"tiny '{preset}' preset, random weights"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# --------------------------------------------------------------------------------------------
# Ours
# --------------------------------------------------------------------------------------------


def bench_ours(folder, args, device, dtype, images) -> dict:
    from engine import Engine, SamplingParams

    options = {"progress": False, "prefix_cache": False, "vision_cache_bytes": 0}
    if args.kv_cache_dtype:
        options["kv_cache_dtype"] = args.kv_cache_dtype
    t = time.perf_counter()
    if args.shape:
        import shapes
        from transformers import AutoProcessor

        from engine.engine import EngineOptions

        model = shapes.random_model(folder, device, dtype)
        engine = Engine(model, AutoProcessor.from_pretrained(str(folder)), model_id=f"random-{args.shape}",
                        folder=folder, options=EngineOptions(**options))
    else:
        engine = Engine.from_pretrained(folder, device=str(device), dtype=dtype, **options)
    load_s = time.perf_counter() - t
    messages = messages_for(images)
    sampling = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
    runs = []
    try:
        for i in range(args.warmup + args.repeats):
            done = engine.generate(messages, sampling)
            tel = done.telemetry
            if len(done.token_ids) != args.decode_tokens:
                raise RuntimeError(f"expected {args.decode_tokens} tokens, got {len(done.token_ids)}")
            if i >= args.warmup:
                runs.append({
                    "ttft_ms": tel.ttft_ms,
                    "vision_ms": tel.vision_ms,
                    "prefill_ms": tel.vision_ms + tel.prefill_ms,
                    "decode_ms_per_token": tel.tpot_ms,
                })
        prompt_tokens, visual_tokens = tel.prompt_tokens, tel.visual_tokens
        tokens = list(done.token_ids)
    finally:
        engine.close()
        del engine
        release(device)
    return {
        "load_s": load_s,
        "prompt_tokens": prompt_tokens,
        "visual_tokens": visual_tokens,
        "tokens": tokens,
        "runs": runs,
        **{key: median([r[key] for r in runs]) for key in runs[0]},
    }


# --------------------------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------------------------


def timed_generate(model, inputs: dict, tokens: int, pad: int, device: torch.device):
    """(ms, output ids) of a greedy ``generate`` of exactly ``tokens`` new tokens."""
    sync(device)
    t = time.perf_counter()
    out = model.generate(
        **inputs, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=pad,
        temperature=None, top_p=None, top_k=None,
    )
    sync(device)
    return (time.perf_counter() - t) * 1e3, out


def bench_transformers(folder, args, device, dtype, images) -> dict:
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    t = time.perf_counter()
    processor = AutoProcessor.from_pretrained(str(folder))
    if args.shape:  # the same random weights as ours (same seed), copied into transformers' model
        import shapes

        model = shapes.transformers_twin(shapes.random_model(folder, device, dtype), folder)
    else:
        model = Qwen3VLForConditionalGeneration.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa")
        model.to(device).eval()
    load_s = time.perf_counter() - t
    text = processor.apply_chat_template(messages_for(images), tokenize=False, add_generation_prompt=True)
    n = args.decode_tokens
    pad = processor.tokenizer.pad_token_id

    def preprocess():
        kwargs = {"images": images} if images else {}
        inputs = processor(text=[text], return_tensors="pt", **kwargs)
        return {k: v.to(device) for k, v in inputs.items()}

    runs = []
    try:
        with torch.inference_mode():
            for i in range(args.warmup + args.repeats):
                sync(device)
                t0 = time.perf_counter()
                inputs = preprocess()
                sync(device)
                t1 = time.perf_counter()
                out = model(**inputs, logits_to_keep=1, use_cache=True)
                first = int(out.logits[0, -1].argmax())
                sync(device)
                t2 = time.perf_counter()
                del out
                vision_ms = None
                if images:
                    sync(device)
                    tv = time.perf_counter()
                    model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
                    sync(device)
                    vision_ms = (time.perf_counter() - tv) * 1e3
                gen1_ms, _ = timed_generate(model, inputs, 1, pad, device)
                gen_ms, generated = timed_generate(model, inputs, n, pad, device)
                if i >= args.warmup:
                    runs.append({
                        "ttft_ms": (t2 - t0) * 1e3,
                        "vision_ms": vision_ms,
                        "prefill_ms": (t2 - t1) * 1e3,
                        "decode_ms_per_token": (gen_ms - gen1_ms) / (n - 1),
                        "generate_ms": gen_ms,
                        "generate_1_ms": gen1_ms,
                    })
        prompt_len = inputs["input_ids"].shape[1]
        tokens = generated[0, prompt_len:].tolist()
        image_token = model.config.image_token_id
        visual_tokens = int((inputs["input_ids"] == image_token).sum())
    finally:
        del model
        release(device)
    return {
        "load_s": load_s,
        "prompt_tokens": prompt_len,
        "visual_tokens": visual_tokens,
        "first_token": first,
        "tokens": tokens,
        "runs": runs,
        **{key: median([r[key] for r in runs]) for key in runs[0]},
    }


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

ROWS = (
    ("prefill_ms", "prefill incl. vision (ms)"),
    ("vision_ms", "  vision encoder (ms)"),
    ("ttft_ms", "TTFT incl. preprocessing (ms)"),
    ("decode_ms_per_token", "decode (ms/token)"),
)


def fmt(value, digits=1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(ours: dict, theirs: dict) -> str:
    lines = [f"{'':32}{'ours':>12}{'transformers':>15}{'ours/transf.':>14}"]
    for key, label in ROWS:
        a, b = ours.get(key), theirs.get(key)
        ratio = a / b if a is not None and b else None
        lines.append(f"{label:32}{fmt(a):>12}{fmt(b):>15}{fmt(ratio, 2):>14}")
    a, b = ours["decode_ms_per_token"], theirs["decode_ms_per_token"]
    ratio = (1e3 / a) / (1e3 / b) if a and b else None
    lines.append(f"{'decode (tokens/s)':32}{fmt(1e3 / a if a else None):>12}{fmt(1e3 / b if b else None):>15}"
                 f"{fmt(ratio, 2):>14}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--checkpoint", help="a Qwen3-VL checkpoint folder (or Hub id)")
    which.add_argument("--preset", choices=("test", "demo"), help="build a tiny random checkpoint (default: demo)")
    which.add_argument("--shape", choices=("8b",), help="build a random checkpoint with a real model's shapes")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--images", type=int, default=2, help="photos in the prompt (default 2)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; medians are reported (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    parser.add_argument("--kv-cache-dtype", choices=("fp8_e4m3", "auto"), help="our KV cache (default: engine's)")
    parser.add_argument("--skip-transformers", action="store_true", help="time only our engine")
    parser.add_argument("--out", help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    if args.decode_tokens < 2:
        parser.error("--decode-tokens must be at least 2")
    if args.repeats < 1 or args.images < 0 or args.warmup < 0:
        parser.error("--repeats must be >= 1, --images and --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    images = load_photos(args.images)

    with tempfile.TemporaryDirectory(prefix="prism-bench-") as tmp:
        folder, description = prepare_checkpoint(args, pathlib.Path(tmp))
        ours = bench_ours(folder, args, device, dtype, images)
        theirs = None if args.skip_transformers else bench_transformers(folder, args, device, dtype, images)

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"checkpoint: {description}")
    print(f"device: {dev_name}, dtype {str(dtype).removeprefix('torch.')}, torch threads {torch.get_num_threads()}")
    print(f"prompt: {args.images} photo(s) at {IMAGE_SIDE}x{IMAGE_SIDE} + question = {ours['prompt_tokens']} tokens "
          f"({ours['visual_tokens']} visual); decode {args.decode_tokens} tokens; "
          f"median of {args.repeats} after {args.warmup} warm-up")
    if theirs is None:
        for key, label in ROWS:
            print(f"{label:32}{fmt(ours.get(key)):>12}")
    else:
        if theirs["prompt_tokens"] != ours["prompt_tokens"]:
            print(f"WARNING: prompt lengths differ: ours {ours['prompt_tokens']}, "
                  f"transformers {theirs['prompt_tokens']}")
        print(table(ours, theirs))
        pairs = zip(ours["tokens"], theirs["tokens"], strict=True)
        same = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        agree = args.decode_tokens if same is None else same
        print(f"greedy tokens identical for the first {agree} of {args.decode_tokens}"
              " (random weights give near-ties; the KV-cache dtype matters)")
    if args.out:
        result = {
            "checkpoint": description,
            "device": dev_name,
            "dtype": str(dtype).removeprefix("torch."),
            "images": args.images,
            "image_side": IMAGE_SIDE,
            "decode_tokens": args.decode_tokens,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "ours": ours,
            "transformers": theirs,
        }
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
