"""Where a decode step's time goes on the GPU (run by hand): graph replay alone vs the engine's
TPOT (the difference is host work per step), and a kernel-time table of one eager step.

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
from bench_gpu import cuda_time, text_prompt  # noqa: E402


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
        graphs = eng.runner.graphs
        graph = graphs._graphs[1][0]
        replay = cuda_time(graph.replay, repeats=50)
        print(f"graph replay alone {replay:.2f} ms  -> host work per step ~{c.telemetry.tpot_ms - replay:.2f} ms")
        eng.runner.graphs = None  # eager steps for the profile
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            eng.generate(text_prompt(eng, 1700, 1), SamplingParams(max_tokens=9, ignore_eos=True))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
