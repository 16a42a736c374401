"""Where building a prompt's time goes on this machine's CPU (run by hand): eight 448×448 photos,
media-first, built cold (every image processed) and again from the processed-image cache (what a
prefix hit does), with the slowest functions of each from cProfile. No GPU and no model needed.

    python benchmarks/profile_prompt.py [--photos 8] [--repeats 20]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pathlib
import pstats
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from media import load_photos  # noqa: E402

QUESTION = "What is shown in these photos? Describe the differences between them in detail, please."


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def top_functions(fn, repeats: int, rows: int = 14) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(repeats):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(rows)
    return out.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--photos", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    import torch
    from transformers import AutoProcessor

    from engine.inputs.prompts import PromptBuilder, media_first_messages
    from engine.model.tiny import build_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_checkpoint(pathlib.Path(tmp), "test", seed=0)
        processor = AutoProcessor.from_pretrained(str(folder))
        cfg = json.loads((folder / "config.json").read_text())
    builder = PromptBuilder(processor, image_token_id=cfg["image_token_id"], video_token_id=cfg["video_token_id"],
                            merge_size=2, max_pixels=448 * 448, pixel_dtype=torch.bfloat16)
    messages = media_first_messages(load_photos(args.photos), QUESTION)

    def cold():
        builder.images.clear()  # every image processed again
        builder.build(messages)

    def hit():
        builder.build(messages)

    cold()
    print(f"{args.photos} photos, {len(builder.build(messages).input_ids)} tokens, "
          f"{torch.get_num_threads()} torch threads")
    for name, fn in (("cold (images processed)", cold), ("from the processed-image cache (a hit)", hit)):
        print(f"\n== {name}: median {median_ms(fn, args.repeats):.2f} ms")
        print(top_functions(fn, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
