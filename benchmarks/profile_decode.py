"""Where a decode step's and a prefix hit's time goes on the GPU (run by hand): graph replay alone
vs the engine's TPOT (the difference is host work per step), a kernel-time table of eager steps,
and a prefix hit on eight photos with its question prefilled through the decode graph (rows) and
eagerly, with the host-side breakdown of its TTFT.

    python benchmarks/profile_decode.py --shape 8b
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import shapes  # noqa: E402
from bench_gpu import QUESTION, cuda_time, text_prompt  # noqa: E402
from media import load_photos  # noqa: E402


def profile_hit(eng) -> None:
    """TTFT of prefix hits on 8 photos, question through the graph rows and eagerly."""
    from engine import SamplingParams, media_first_messages

    ims = load_photos(8)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    for salt in ("cold-a", "hit"):  # the second cold run caches the prefix the hits use
        t = eng.generate(media_first_messages(ims, QUESTION), one, cache_salt=salt).telemetry
        print(f"cold, 8 photos: TTFT {t.ttft_ms:.1f} ms (queue {t.queue_ms:.1f} ms, prompt {t.preprocess_ms:.1f} ms, "
              f"vision {t.vision_ms:.1f} ms, prefill {t.prefill_ms:.1f} ms, {t.prompt_tokens} tokens)")
    prompt = eng.prompts.build(media_first_messages(ims, QUESTION))
    pixels = prompt.pixel_values
    vision = cuda_time(lambda: eng.model.encode_vision(pixels, prompt.image_grids), repeats=5, warmup=1)
    print(f"vision encoder alone, 8 photos: {vision:.1f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        eng.model.encode_vision(pixels, prompt.image_grids)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    graphs = eng.loop.runner.graphs
    for mode in ("graph rows", "eager", "graph rows"):
        eng.loop.runner.graphs = graphs if mode == "graph rows" else None
        asks = [media_first_messages(ims, f"{QUESTION} Variant {j}{mode}?") for j in range(5)]
        tels = [eng.generate(m, one, cache_salt="hit").telemetry for m in asks]
        t = sorted(tels, key=lambda x: x.ttft_ms)[2]
        print(f"prefix hit, question {mode}: TTFT {t.ttft_ms:.1f} ms (queue {t.queue_ms:.1f} ms, of which prompt "
              f"building {t.preprocess_ms:.1f} ms; prefill {t.prefill_ms:.1f} ms, computed {t.computed_tokens} "
              f"tokens, {t.prefix_cache})")
    eng.loop.runner.graphs = graphs
    build = cuda_time(lambda: eng.prompts.build(media_first_messages(ims, QUESTION)), repeats=5, warmup=1)
    print(f"prompt building alone (8 photos, cached pixels): {build:.1f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        eng.generate(media_first_messages(ims, QUESTION + " Profiled?"), one, cache_salt="hit")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="8b", choices=sorted(shapes.SHAPES))
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args(argv)
    from engine import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        eng = shapes.random_engine(args.shape, pathlib.Path(tmp), "cuda", torch.bfloat16, progress=False,
                                   max_num_seqs=8, gpu_memory_utilization=0.3)
        c = eng.generate(text_prompt(eng, 1700, 0), SamplingParams(max_tokens=64, ignore_eos=True))
        print(f"engine TPOT {c.telemetry.tpot_ms:.2f} ms at batch 1, context {c.telemetry.prompt_tokens}")
        graphs = eng.loop.runner.graphs
        graph = graphs._graphs[1][0]
        replay = cuda_time(graph.replay, repeats=50)
        print(f"graph replay alone {replay:.2f} ms  -> host work per step ~{c.telemetry.tpot_ms - replay:.2f} ms")
        eng.loop.runner.graphs = None  # eager steps for the profile
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            eng.generate(text_prompt(eng, 1700, 1), SamplingParams(max_tokens=9, ignore_eos=True))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        eng.loop.runner.graphs = graphs
        profile_hit(eng)
        eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
