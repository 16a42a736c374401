"""Where the vision step of a cold request goes on the GPU (run by hand): the encoder on eight
448×448 photos eagerly and through its CUDA graph (engine/graphs/vision.py), wall-clock from the
host (pixels on the CPU, as the engine holds them), the graph replay alone, a kernel table of the
eager encoder, and cold requests' telemetry.

    python benchmarks/profile_vision.py --shape 8b
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import shapes  # noqa: E402
from bench_gpu import QUESTION, cuda_time, wall_times  # noqa: E402
from media import load_photos  # noqa: E402


def wall_ms(fn, repeats: int = 7) -> float:
    """Median of :func:`bench_gpu.wall_times`."""
    return statistics.median(wall_times(fn, repeats))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="8b", choices=sorted(shapes.SHAPES))
    p.add_argument("--photos", type=int, default=8)
    args = p.parse_args(argv)
    from engine import SamplingParams, media_first_messages

    with tempfile.TemporaryDirectory() as tmp:
        eng = shapes.random_engine(args.shape, pathlib.Path(tmp), "cuda", torch.bfloat16, progress=False,
                                   max_num_seqs=8, max_num_batched_tokens=8192, gpu_memory_utilization=0.3)
        ims = load_photos(args.photos)
        prompt = eng.prompts.build(media_first_messages(ims, QUESTION))
        pixels, grids = prompt.pixel_values, prompt.image_grids
        print(f"{args.photos} photos: {pixels.shape[0]} patches, pixels {pixels.dtype} on {pixels.device}")
        graphs = eng.vision.encoder
        steps = wall_times(lambda: graphs(pixels, grids), 4)
        print(f"vision_encoder calls 1-4 (eager, capture, replay, replay): {' / '.join(f'{x:.1f}' for x in steps)} ms; "
              f"captures {getattr(graphs, 'captures', '-')}, replays {getattr(graphs, 'replays', '-')}")
        print(f"eager encoder, wall: {wall_ms(lambda: eng.model.encode_vision(pixels, grids)):.1f} ms")
        print(f"graph encoder, wall: {wall_ms(lambda: graphs(pixels, grids)):.1f} ms")
        on_gpu = pixels.to("cuda")
        print(f"graph encoder, pixels already on the GPU, wall: {wall_ms(lambda: graphs(on_gpu, grids)):.1f} ms")
        print(f"pixel upload alone, wall: {wall_ms(lambda: pixels.to('cuda')):.1f} ms")
        entry = next(iter(graphs._graphs.values()), None) if hasattr(graphs, "_graphs") else None
        if entry is not None:
            print(f"graph replay alone (CUDA events): {cuda_time(entry.graph.replay, repeats=10):.1f} ms")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            eng.model.encode_vision(on_gpu, grids)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        for i in range(4):
            t = eng.generate(media_first_messages(ims, QUESTION), one, cache_salt=f"cold-{i}").telemetry
            print(f"cold request {i}: TTFT {t.ttft_ms:.1f} ms (prompt {t.preprocess_ms:.1f}, queue {t.queue_ms:.1f}, "
                  f"vision {t.vision_ms:.1f}, prefill {t.prefill_ms:.1f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
