"""GPU correctness smoke (run by hand on the GPU machine): the engine on CUDA against transformers
and against itself with its switches flipped (CUDA graphs, Triton vs reference ops, FP8 vs auto).

    python benchmarks/gpu_smoke.py
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
import threading

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from media import MEDIA_DIR as MEDIA  # noqa: E402

from engine import Engine, SamplingParams, media_first_messages  # noqa: E402
from engine.model.tiny import build_tiny_checkpoint  # noqa: E402


def run(engine, prompts, salt_prefix="s"):
    out = [None] * len(prompts)

    def one(i):
        sp = SamplingParams(max_tokens=16, ignore_eos=True)
        out[i] = engine.generate(prompts[i], sp, cache_salt=f"{salt_prefix}{i}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def transformers_greedy(folder, engine, messages, dtype):
    from transformers import Qwen3VLForConditionalGeneration

    hf = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=dtype).cuda().eval()
    torch.backends.cuda.matmul.allow_tf32 = False
    p = engine.prompts.build(messages)
    ids = torch.tensor([p.input_ids], device="cuda")
    kw = {}
    if p.pixel_values is not None:
        kw = dict(pixel_values=p.pixel_values.cuda(), image_grid_thw=torch.tensor(p.image_grids, device="cuda"))
    out = hf.generate(input_ids=ids, mm_token_type_ids=(ids == 151655).int(), max_new_tokens=16, min_new_tokens=16,
                      do_sample=False, **kw)
    return out[0, len(p.input_ids):].tolist()


def main() -> int:
    tmp = pathlib.Path(tempfile.mkdtemp())
    folder = build_tiny_checkpoint(tmp / "tiny", "test", seed=0)
    imgs = [MEDIA / "astronaut.png", MEDIA / "coffee.png", MEDIA / "page.png"]
    prompts = [
        [{"role": "user", "content": "Tell me a story about a cat."}],
        media_first_messages(imgs[:1], "What is in the picture?"),
        media_first_messages(imgs, "Compare the pictures."),
    ]
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        builder = Engine.from_pretrained(folder, device="cuda", dtype=dtype, cuda_graphs=False, progress=False,
                                         max_pixels=256 * 256, kv_cache_bytes=64 << 20)
        ref_tokens = [transformers_greedy(folder, builder, m, dtype) for m in prompts]
        builder.close()
        for kv in ("auto", "fp8_e4m3"):
            for graphs in (False, True):
                for ops_mode in ("triton", "reference"):
                    os.environ["PRISM_OPS"] = ops_mode
                    eng = Engine.from_pretrained(folder, device="cuda", dtype=dtype, kv_cache_dtype=kv,
                                                 cuda_graphs=graphs, progress=False, max_pixels=256 * 256,
                                                 kv_cache_bytes=256 << 20, debug_checks=True, compaction=None)
                    got = [c.token_ids for c in run(eng, prompts)]
                    again = run(eng, prompts)  # same salts: the image prompts now hit their prefix
                    same = [a.token_ids == g for a, g in zip(again, got, strict=True)]
                    hits = [a.telemetry.prefix_cache for a in again]
                    match = [g == r for g, r in zip(got, ref_tokens, strict=True)]
                    print(f"{dtype} kv={kv} graphs={graphs} ops={ops_mode}: equal to transformers {match}; "
                          f"repeat equal {same} ({hits})", flush=True)
                    if kv == "auto" and dtype == torch.float32 and not all(match):
                        ok = False
                    if dtype == torch.float32 and not all(same):  # bf16: batch shapes change rounding
                        ok = False
                    eng.close()
    os.environ.pop("PRISM_OPS", None)
    print("SMOKE", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
