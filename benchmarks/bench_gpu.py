"""Prism on the GPU beside transformers and the hardware floors, in one run (run by hand).

    python benchmarks/bench_gpu.py --out results.json          # 8B and 2B shapes, H200
    python benchmarks/bench_gpu.py --shapes 8b --out results.json   # 8B only (v4-v7 reported this)

Random weights at Qwen3-VL-8B and -2B shapes (benchmarks/shapes.py), bfloat16 weights, FP8 KV.
Measured side by side in the same process:

* ceilings: device-to-device copy bandwidth and the bf16 matrix-product rate, measured first;
* decode TPOT at batch 1, 8 and 32 with ~1.7k-token contexts: ours (CUDA graphs; the median
  period of steady decode steps, see :func:`record_steps`, and each request's own TPOT beside it),
  transformers ``generate``, and the floor = (LM weight bytes + KV bytes read per step) / copy
  bandwidth;
* TTFT cold for one and eight 448x448 photos: ours (telemetry, from submission; median of five
  new sessions after a warm-up request), transformers (processor + forward), and the compute
  floor = forward FLOPs / matrix rate;
* TTFT of a prefix hit on the same photos with a ~30-token question, on the compact prefix: the
  engines compact when the prefix is cached (``compaction_mode="always"``, keep ratio 0.6, see
  :func:`engine_options`), so ``prefix_pages`` vs ``prefix_pages_dense`` is compact vs dense (the
  engine's default ``"on_pressure"`` would keep the prefix dense in a pool that never runs short;
  ``--compaction-mode on_pressure`` measures that). Each shape's JSON says the mode it measured;
* cold and hit both with the photos given as PIL images (hashed for every question) and as the
  app gives them (stored files with their digests). "Cold" is a new chat session: since issue 16
  every cache is the session's own (processed pixels, vision features, the vision encoder's CUDA
  graphs), so a cold request processes its photos and runs the encoder eagerly whatever other
  sessions sent (before, later sessions reused the first one's processed pixels and graphs). The
  engine takes 8,192-token steps (its default on CUDA);
* FP8 vs bf16 KV: tokens held in 4 GiB, and paged decode attention time at batch 8 with 16k-token
  contexts, all layers (where reading KV dominates).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import pathlib
import statistics
import sys
import tempfile
import threading
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import shapes  # noqa: E402
from media import load_photos as photos  # noqa: E402

QUESTION = "Which of these pictures shows the most people, and what are they doing in it? Answer briefly."


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def cuda_time(fn, repeats=10, warmup=3) -> float:
    """Median milliseconds of ``fn`` by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def wall_times(fn, repeats: int) -> list[float]:
    """Host wall-clock milliseconds of each of ``repeats`` calls of ``fn``, up to the GPU finishing
    it (what a caller waits, host work included)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # the CPU test runs it too
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def graph_time(fn, calls: int = 20, repeats: int = 10) -> float:
    """Median milliseconds of one ``fn()`` on the GPU alone: ``calls`` calls captured in one CUDA
    graph and replayed, so the host's launch time (tens of microseconds per Triton launch) is not
    counted, as in the engine's captured decode step."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_time(graph.replay, repeats=repeats) / calls


def ceilings() -> dict:
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm = cuda_time(lambda: a @ b)
    return {"copy_tb_s": 2 * n / ms / 1e9, "matmul_tflop_s": 2 * 8192**3 / mm / 1e9}


def lm_weight_bytes(model) -> int:
    # the fused [q;k;v] / [gate;up] matrices share storage with the per-projection views: count once
    lm = sum(p.numel() * p.element_size() for n, p in model.language_model.named_parameters()
             if not n.endswith((".qkv", ".gate_up")))
    if not model.config.tie_word_embeddings:
        lm += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return lm


def text_prompt(engine, tokens: int, salt: int) -> list[dict]:
    """A text-only prompt of about ``tokens`` tokens, different per ``salt``."""
    words = " ".join(f"w{salt}x{i}" for i in range(tokens * 10 // 58))  # ~5.8 tokens a word
    return [{"role": "user", "content": words}]


def bench_decode(engine, hf, batch: int, ctx: int, new: int, bw: float, kv_bytes_token_layer: int) -> dict:
    from engine import SamplingParams

    msgs = [text_prompt(engine, ctx, i) for i in range(batch)]
    sp = SamplingParams(max_tokens=new, ignore_eos=True)
    engine.generate(msgs[0], SamplingParams(max_tokens=4, ignore_eos=True))  # warm
    results = [None] * batch
    barrier = threading.Barrier(batch)

    def one(i):
        barrier.wait()
        results[i] = engine.generate(msgs[i], sp, cache_salt=f"d{i}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(batch)]
    with record_steps(engine) as steps:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    ours = steady_step_ms(steps, batch)
    prompt_len = statistics.mean(r.telemetry.prompt_tokens for r in results)
    layers = engine.config.text.num_hidden_layers
    kv_read = batch * (prompt_len + new / 2) * kv_bytes_token_layer * layers
    floor = (lm_weight_bytes(engine.model) + kv_read) / (bw * 1e12) * 1e3
    out = {"batch": batch, "context": prompt_len, "ours_tpot_ms": ours, "floor_ms": floor,
           "ours_vs_floor": ours / floor,
           "ours_tpot_request_median_ms": statistics.median(r.telemetry.tpot_ms for r in results)}
    if hf is not None:
        enc = [engine.prompts.build(m).input_ids for m in msgs]
        width = min(len(e) for e in enc)
        ids = torch.tensor([e[:width] for e in enc], device="cuda")
        with torch.no_grad():
            def prefill():
                hf(input_ids=ids, logits_to_keep=1)
            pre = cuda_time(prefill, repeats=2, warmup=1)
            steps = 16
            gen = cuda_time(lambda: hf.generate(input_ids=ids, max_new_tokens=steps, min_new_tokens=steps,
                                                do_sample=False), repeats=2, warmup=1)
        out["transformers_tpot_ms"] = (gen - pre) / (steps - 1)
        out["ours_speedup"] = out["transformers_tpot_ms"] / ours
    return out


@contextlib.contextmanager
def record_steps(engine):
    """Record ``(end time in s, tokens per request)`` of every engine step run inside the block.

    The requests of a batch arrive together, but their prompts prefill over a few steps, so a
    request's own TPOT (first token to last) also counts the prefill steps of the others that ran
    after its first token. This wraps the runner to time the steady decode steps instead.
    """
    runner = engine.loop.runner
    steps = []
    execute = runner.execute

    def timed(plan):
        out = execute(plan)
        steps.append((time.perf_counter(), [run.num_tokens for run in plan.runs]))
        return out

    runner.execute = timed
    try:
        yield steps
    finally:
        del runner.execute  # back to the class's method


def steady_step_ms(steps, batch: int) -> float:
    """Median ms between the ends of consecutive steps that both decoded one token for each of
    ``batch`` requests: the TPOT of a steady batch, host work between steps included."""
    periods = [(b[0] - a[0]) * 1e3 for a, b in zip(steps, steps[1:], strict=False)
               if a[1] == [1] * batch and b[1] == [1] * batch]
    if not periods:
        raise RuntimeError(f"no two consecutive decode steps at batch {batch}")
    return statistics.median(periods)


def vision_lm_flops(model, prompt) -> float:
    """Forward FLOPs of a prompt: 2 x params x tokens for every matrix, plus attention."""
    v, t = model.config.vision, model.config.text
    patches = sum(a * b * c for a, b, c in prompt.image_grids)
    vis_params = sum(p.numel() for n, p in model.visual.named_parameters() if p.dim() > 1 and "pos_embed" not in n)
    flops = 2 * vis_params * patches / 1  # mergers run on 1/4 of the rows: small over-count
    flops += sum(4 * (h * w) ** 2 * v.hidden_size for _, h, w in prompt.image_grids) * v.depth
    n = len(prompt.input_ids)
    lm_params = sum(p.numel() for n_, p in model.language_model.named_parameters() if p.dim() > 1 and "embed" not in n_)
    flops += 2 * lm_params * n + 2 * t.hidden_size * t.vocab_size  # logits of the last token only
    flops += 2 * n * n * t.num_attention_heads * t.head_dim * t.num_hidden_layers  # causal QK^T and PV
    return flops


def bench_ttft(engine, hf, n_images: int, tflops: float) -> dict:
    from engine import SamplingParams, media_first_messages

    ims = photos(n_images)
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    warm = media_first_messages(photos(n_images), "warm up")
    engine.generate(warm, sp, cache_salt="warm")
    cold = []
    # five new sessions: none reuses what the warm-up or another session left (caches and vision
    # graphs are per session), so each is a cold request as a new user's first question is
    for i in range(5):
        c = engine.generate(media_first_messages(ims, QUESTION), sp, cache_salt=f"cold{n_images}-{i}")
        cold.append(c.telemetry)
    hits = [
        engine.generate(media_first_messages(ims, QUESTION + f" ({j})"), sp, cache_salt=f"cold{n_images}-0").telemetry
        for j in range(3)
    ]
    app_cold, app_hits = _as_the_app_asks(engine, ims, sp, f"app{n_images}")
    enc = engine.vision.encoder
    log(f"   cold vision ms {[round(t.vision_ms, 1) for t in cold]}, "
        f"prefill ms {[round(t.prefill_ms, 1) for t in cold]}; vision graphs captured "
        f"{getattr(enc, 'captures', '-')}, replayed {getattr(enc, 'replays', '-')}")
    prompt = engine.prompts.build(media_first_messages(ims, QUESTION))
    walls = wall_times(lambda: enc(prompt.pixel_values, prompt.image_grids), 3)
    log(f"   vision encoder called directly: {[round(w, 1) for w in walls]} ms")
    floor = vision_lm_flops(engine.model, prompt) / (tflops * 1e12) * 1e3
    out = {
        "images": n_images, "prompt_tokens": len(prompt.input_ids),
        "ours_cold_ttft_ms": statistics.median(t.ttft_ms for t in cold),
        "ours_cold_vision_ms": statistics.median(t.vision_ms for t in cold),
        "hit_ttft_ms": statistics.median(t.ttft_ms for t in hits),
        "hit_prefix": [t.prefix_cache for t in hits], "hit_computed_tokens": hits[0].computed_tokens,
        "prefix_pages": hits[0].prefix_pages, "prefix_pages_dense": hits[0].prefix_pages_dense,
        "compute_floor_ms": floor,
        "cold_ttft_each_ms": [t.ttft_ms for t in cold], "cold_vision_each_ms": [t.vision_ms for t in cold],
        # where the TTFT went (medians; vision_ms waits for the GPU work queued before it too)
        "cold_breakdown_ms": _breakdown(cold), "hit_breakdown_ms": _breakdown(hits),
        "hit_ttft_app_ms": statistics.median(t.ttft_ms for t in app_hits),
        "hit_app_breakdown_ms": _breakdown(app_hits),
        "cold_ttft_app_ms": statistics.median(t.ttft_ms for t in app_cold),
        "cold_app_each_ms": [t.ttft_ms for t in app_cold], "cold_app_breakdown_ms": _breakdown(app_cold),
    }
    out["ours_cold_vs_floor"] = out["ours_cold_ttft_ms"] / floor
    out["ours_cold_app_vs_floor"] = out["cold_ttft_app_ms"] / floor
    if hf is not None:
        proc = engine.processor

        def theirs():
            text = proc.apply_chat_template(
                [{"role": "user", "content": [*({"type": "image"} for _ in ims), {"type": "text", "text": QUESTION}]}],
                tokenize=False, add_generation_prompt=True)
            inp = proc(text=[text], images=ims, return_tensors="pt").to("cuda")
            with torch.no_grad():
                hf(**inp, logits_to_keep=1)
        out["transformers_ttft_ms"] = cuda_time(theirs, repeats=3, warmup=1)
        out["ours_cold_speedup"] = out["transformers_ttft_ms"] / out["ours_cold_ttft_ms"]
        out["hit_speedup_vs_transformers"] = out["transformers_ttft_ms"] / out["hit_ttft_ms"]
    return out


def _as_the_app_asks(engine, images, sampling, salt: str) -> tuple[list, list]:
    """Telemetry of five cold questions (each in a new chat session) and then three prefix hits (in
    the first session) on ``images`` sent as the app sends them: stored PNG files with the SHA-256
    of their bytes (its store is content-addressed)."""
    from engine import media_first_messages

    with tempfile.TemporaryDirectory() as folder:
        parts = []
        for i, image in enumerate(images):
            path = pathlib.Path(folder) / f"{i}.png"
            image.save(path)
            parts.append({"image": path, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()})
        cold = [engine.generate(media_first_messages(parts, QUESTION), sampling, cache_salt=f"{salt}-{i}").telemetry
                for i in range(5)]
        hits = [engine.generate(media_first_messages(parts, QUESTION + f" ({j})"), sampling,
                                cache_salt=f"{salt}-0").telemetry for j in range(3)]
        return cold, hits


def _breakdown(telemetries) -> dict:
    fields = ("preprocess_ms", "queue_ms", "vision_ms", "prefill_ms")
    return {f: statistics.median(getattr(t, f) for t in telemetries) for f in fields}


def kv_bytes_read(cache, tokens: int) -> int:
    """Bytes of K, V (and scales) one layer's attention reads for ``tokens`` tokens."""
    per_token = 2 * cache.num_kv_heads * cache.head_dim * cache.k_cache.element_size()
    if cache.is_fp8:
        per_token += 2 * cache.num_kv_heads * cache.k_scale.element_size()
    return per_token * tokens


def bench_kv_formats(engine) -> dict:
    from ops import AttentionMetadata, KVLayerCache, kv_bytes_per_token
    from ops.triton_kernels import paged_decode_attention

    t = engine.config.text
    out = {}
    budget = 4 << 30
    for kv in ("fp8_e4m3", "auto"):
        per_token = kv_bytes_per_token(t.num_key_value_heads, t.head_dim, kv, torch.bfloat16) * t.num_hidden_layers
        out[f"tokens_in_4GiB_{kv}"] = budget // per_token
    batch, ctx, page = 8, 16384, 16
    pages = batch * ctx // page
    tables = [list(range(b * ctx // page, (b + 1) * ctx // page)) for b in range(batch)]
    slots = [tb[-1] * page + page - 1 for tb in tables]
    meta = AttentionMetadata.build([1] * batch, [ctx] * batch, tables, slots, "cuda")
    q = torch.randn(batch, t.num_attention_heads, t.head_dim, dtype=torch.bfloat16, device="cuda")
    for kv in ("fp8_e4m3", "auto"):
        cache = KVLayerCache.allocate(pages, page, t.num_key_value_heads, t.head_dim, kv, torch.bfloat16, "cuda")
        cache.k_cache.view(torch.uint8).random_(0, 120)
        cache.v_cache.view(torch.uint8).random_(0, 120)
        ms = graph_time(lambda c=cache: paged_decode_attention(q, c, meta))
        out[f"decode_attn_ms_per_layer_{kv}"] = ms
        out[f"decode_attn_eager_ms_per_layer_{kv}"] = cuda_time(lambda c=cache: paged_decode_attention(q, c, meta))
        out[f"decode_attn_tb_s_{kv}"] = kv_bytes_read(cache, batch * ctx) / ms / 1e9
        out[f"decode_attn_ms_all_layers_{kv}"] = ms * t.num_hidden_layers
    out["fp8_attention_speedup"] = out["decode_attn_ms_per_layer_auto"] / out["decode_attn_ms_per_layer_fp8_e4m3"]
    return out


def engine_options(args) -> dict:
    """The :class:`engine.engine.EngineOptions` fields every shape's engine is built with (``args``
    from :func:`parse_args`): FP8 KV, 8,192-token steps, 45% of the free GPU memory for KV (room for
    the transformers twin), keep ratio 0.6 compacted as ``args.compaction_mode`` says (``"always"``:
    when the prefix is cached, so the hits measure the compact prefix)."""
    return {"kv_cache_dtype": "fp8_e4m3", "max_num_seqs": 32, "max_num_batched_tokens": 8192, "progress": False,
            "gpu_memory_utilization": 0.45, "compaction": "uniform", "keep_ratio": 0.6,
            "compaction_mode": args.compaction_mode}


def run_shape(shape: str, args, ceil: dict, workdir: pathlib.Path) -> dict:
    log(f"== {shape}: building the engine")
    t0 = time.perf_counter()
    options = engine_options(args)
    engine = shapes.random_engine(shape, workdir, "cuda", torch.bfloat16, **options)
    log(f"   engine ready in {time.perf_counter() - t0:.0f} s; pool {engine.stats()['capacity_tokens']} tokens")
    hf = None if args.no_transformers else shapes.transformers_twin(engine.model, workdir / f"shape-{shape}")
    from ops import kv_bytes_per_token

    t = engine.config.text
    kvb = kv_bytes_per_token(t.num_key_value_heads, t.head_dim, "fp8_e4m3", torch.bfloat16)
    res = {"shape": shape, "lm_weight_gb": lm_weight_bytes(engine.model) / 1e9,
           "compaction_mode": engine.options.compaction_mode, "keep_ratio": engine.options.keep_ratio}
    res["decode"] = []
    for b in args.batches:
        log(f"   decode batch {b}")
        res["decode"].append(bench_decode(engine, hf, b, args.context, args.new_tokens, ceil["copy_tb_s"], kvb))
        log("   ", res["decode"][-1])
    res["ttft"] = []
    for n in (1, 8):
        log(f"   ttft {n} images")
        res["ttft"].append(bench_ttft(engine, hf, n, ceil["matmul_tflop_s"]))
        log("   ", res["ttft"][-1])
    res["kv_formats"] = bench_kv_formats(engine)
    log("   ", res["kv_formats"])
    engine.close()
    del hf, engine
    torch.cuda.empty_cache()
    return res


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (``argv``: the arguments, None for ``sys.argv``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["8b", "2b"], choices=sorted(shapes.SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--context", type=int, default=1700)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--compaction-mode", choices=("always", "on_pressure"), default="always",
                   help="when the cached prefix is compacted (default always: the hits measure the compact prefix)")
    p.add_argument("--out", type=pathlib.Path)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    ceil = ceilings()
    log("ceilings", ceil)
    from ops import pdl

    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "ceilings": ceil,
               "pdl": pdl.enabled(torch.zeros(1, device="cuda")), "shapes": []}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            results["shapes"].append(run_shape(shape, args, ceil, pathlib.Path(tmp)))
            if args.out:
                args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
