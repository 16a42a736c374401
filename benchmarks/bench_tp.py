"""Tensor parallel beside one GPU: TP2 next to TP1 on the same weights, one run, JSON out.

Run on a host with two GPUs (the lead's GPU batch; not a test)::

    python benchmarks/bench_tp.py --shape 8b --out tp.json                  # random bf16 8B weights
    python benchmarks/bench_tp.py --checkpoint /models/Qwen3-VL-8B-Instruct --out tp.json
    python benchmarks/bench_tp.py --shape tiny --device cpu --out tp.json   # the script itself, on gloo

For each tensor-parallel size (``--tp``, default 1 and 2), one engine in turn (the previous one
closed first), measured through :meth:`Engine.submit` and the engine's own telemetry:

* TPOT at batch 1 / 8 / 32 (``--batches``): that many text-only requests submitted together,
  ``--max-tokens`` greedy tokens each with ``ignore_eos``; the median of the requests'
  ``tpot_ms`` (decode steps only, the decode CUDA graphs replayed on every rank);
* TTFT cold: one photo (``--image-side`` square) and a question under a fresh cache salt, so the
  vision encoder, the whole prefill and the compaction run; median of ``--repeats``, with the
  vision encoder's share (``vision_ms``);
* TTFT prefix hit: the same photo and another question under the same salt (the compact prefix is
  attached, only the question is prefilled); median of ``--repeats``;
* per-rank counters (:meth:`Engine.tensor_parallel_counters`): the images each rank's vision tower
  encoded (rank 0 only: they sum to the cold requests' images) and the steps each ran.

The greedy tokens of TP2's cold answers are compared with TP1's (bf16: an all-reduce sums in
another order, so they may part after a near tie; reported, not asserted).

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, set here before NCCL starts). ``--shape``
writes random weights (:func:`benchmarks.shapes.random_model`, seed 0) as a safetensors checkpoint
under ``--workdir`` once (~17 GB for 8B), since every rank loads the checkpoint itself.
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before torch.distributed starts NCCL (workers inherit it)

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

QUESTIONS = ["Describe this image.", "What colours stand out?", "Is there any text?", "Where could this be?",
             "What is in the background?", "Summarise the scene in one sentence."]


def write_random_checkpoint(shape: str, workdir: pathlib.Path, dtype: torch.dtype, device: str) -> pathlib.Path:
    """A checkpoint folder for ``shape`` with random weights in safetensors shards (written once:
    an existing ``model.safetensors.index.json`` is reused)."""
    from safetensors.torch import save_file

    from benchmarks.shapes import make_folder, random_model

    folder = make_folder(shape, workdir)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return folder
    model = random_model(folder, torch.device(device), dtype)
    weight_map, shard, size, n = {}, {}, 0, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(folder / name))
            weight_map.update(dict.fromkeys(shard, name))
            shard, size, n = {}, 0, n + 1

    for ours, tensor in model.state_dict().items():
        if model.config.tie_word_embeddings and ours == "lm_head.weight":
            continue
        name = ours if ours.startswith("lm_head.") else f"model.{ours}"  # the Hugging Face layout
        shard[name] = tensor.detach().contiguous().cpu()
        size += tensor.numel() * tensor.element_size()
        if size > 4 << 30:
            flush()
    flush()
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return folder


def tiny_checkpoint(workdir: pathlib.Path) -> pathlib.Path:
    from engine.model.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(workdir / "tiny", "demo", seed=0)


def run_together(engine, prompts: list, sampling, salts: list[str]) -> list:
    """Submit every prompt at once, then wait for each; their completions in order."""
    handles = [engine.submit(p, sampling, cache_salt=s) for p, s in zip(prompts, salts, strict=True)]
    return [handle.result() for handle in handles]


def measure(engine, args, photos, tag: str) -> dict:
    """TPOT per batch size, TTFT cold and prefix hit, per-rank counters (see the module docstring)."""
    from engine import SamplingParams, media_first_messages

    decode = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    short = SamplingParams(max_tokens=args.answer_tokens, ignore_eos=True)
    out: dict = {"tpot_ms": {}, "tpot_ms_p90": {}}
    text = [{"role": "user", "content": f"Request {i}: tell me a long story about the sea, in detail."}
            for i in range(max(args.batches))]
    run_together(engine, [[text[0]]], decode, [f"{tag}-warm"])  # warm-up: kernels, graphs, allocator
    for b in args.batches:
        done = run_together(engine, [[m] for m in text[:b]], decode, [f"{tag}-tpot-{b}-{i}" for i in range(b)])
        tpots = sorted(d.telemetry.tpot_ms for d in done)
        out["tpot_ms"][str(b)] = statistics.median(tpots)
        out["tpot_ms_p90"][str(b)] = tpots[int(0.9 * (len(tpots) - 1))]
    before = engine.tensor_parallel_counters()
    cold, hit, cold_tokens = [], [], []
    for r in range(args.repeats):
        photo = photos[r % len(photos)]
        salt = f"{tag}-ttft-{r}"
        first = engine.generate(media_first_messages([photo], QUESTIONS[0]), short, cache_salt=salt)
        again = engine.generate(media_first_messages([photo], QUESTIONS[1 + r % (len(QUESTIONS) - 1)]), short,
                                cache_salt=salt)
        assert first.telemetry.prefix_cache == "miss" and again.telemetry.prefix_cache == "hit", (first, again)
        cold.append(first.telemetry)
        hit.append(again.telemetry)
        cold_tokens.append(first.token_ids)
    after = engine.tensor_parallel_counters()
    out |= {
        "ttft_cold_ms": statistics.median(t.ttft_ms for t in cold),
        "ttft_cold_vision_ms": statistics.median(t.vision_ms for t in cold),
        "ttft_cold_prefill_ms": statistics.median(t.prefill_ms for t in cold),
        "ttft_hit_ms": statistics.median(t.ttft_ms for t in hit),
        "prompt_tokens_cold": cold[0].prompt_tokens,
        "computed_tokens_hit": hit[0].computed_tokens,
        "vision_images_encoded_per_rank": [a["vision_images_encoded"] - b["vision_images_encoded"]
                                           for a, b in zip(after, before, strict=True)],
        "images_sent": args.repeats,
        "steps_per_rank": [a["steps"] for a in after],
        "cold_token_ids": cold_tokens,
    }
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("8b", "2b", "tiny"), default="8b")
    parser.add_argument("--checkpoint", type=pathlib.Path, help="a real checkpoint folder instead of --shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on the CPU by default")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per TPOT request")
    parser.add_argument("--answer-tokens", type=int, default=8, help="tokens per TTFT request")
    parser.add_argument("--repeats", type=int, default=5, help="TTFT cold / hit pairs")
    parser.add_argument("--image-side", type=int, default=448)
    parser.add_argument("--kv-cache-gb", type=float, default=None, help="KV pool per rank (default: the engine's)")
    parser.add_argument("--workdir", type=pathlib.Path, default=pathlib.Path(tempfile.gettempdir()) / "prism-bench-tp")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)

    from benchmarks.media import load_photos
    from engine import Engine

    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.checkpoint is not None:
        folder = args.checkpoint
    elif args.shape == "tiny":
        folder = tiny_checkpoint(args.workdir)
    else:
        t = time.perf_counter()
        folder = write_random_checkpoint(args.shape, args.workdir, getattr(torch, dtype), args.device)
        print(f"checkpoint {folder} ready in {time.perf_counter() - t:.0f} s", flush=True)
    photos = load_photos(max(1, args.repeats), args.image_side)
    options = {"progress": False, "max_num_seqs": max(args.batches)}
    if args.kv_cache_gb is not None:
        options["kv_cache_bytes"] = int(args.kv_cache_gb * 2**30)
    results: dict = {
        "config": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()},
        "env": {"torch": torch.__version__, "python": platform.python_version(),
                "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")},
        "runs": {},
    }
    for tp in args.tp:
        t = time.perf_counter()
        engine = Engine.from_pretrained(folder, device=args.device, dtype=dtype, tensor_parallel_size=tp, **options)
        start_s = time.perf_counter() - t
        try:
            run = measure(engine, args, photos, f"tp{tp}")
        finally:
            engine.close()
        run["start_s"] = start_s
        results["runs"][str(tp)] = run
        print(f"TP{tp}: start {start_s:.1f} s  TPOT {run['tpot_ms']} ms  TTFT cold {run['ttft_cold_ms']:.1f} ms "
              f"(vision {run['ttft_cold_vision_ms']:.1f})  hit {run['ttft_hit_ms']:.1f} ms  "
              f"vision images per rank {run['vision_images_encoded_per_rank']} of {run['images_sent']}", flush=True)
    runs = results["runs"]
    if "1" in runs:
        for tp, run in runs.items():
            if tp == "1":
                continue
            same = [a == b for a, b in zip(run["cold_token_ids"], runs["1"]["cold_token_ids"], strict=True)]
            run["vs_tp1"] = {
                "tpot_speedup": {b: runs["1"]["tpot_ms"][b] / run["tpot_ms"][b] for b in run["tpot_ms"]},
                "ttft_cold_speedup": runs["1"]["ttft_cold_ms"] / run["ttft_cold_ms"],
                "ttft_hit_speedup": runs["1"]["ttft_hit_ms"] / run["ttft_hit_ms"],
                "cold_answers_equal": f"{sum(same)}/{len(same)}",
            }
            print(f"TP{tp} vs TP1: {json.dumps(run['vs_tp1'])}", flush=True)
    text = json.dumps(results, indent=1)
    if args.out is not None:
        args.out.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
