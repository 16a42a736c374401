"""Plot a bench_gpu.py result (run by hand): decode TPOT per batch size (ours, transformers, the
bandwidth floor) and TTFT (cold, prefix hit, transformers, compute floor) for each shape.

    python benchmarks/plot_gpu.py docs/gpu/bench_gpu_v3.json docs/gpu/bench_gpu_v3.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> int:
    data = json.load(open(src))
    shapes = data["shapes"]
    fig, axes = plt.subplots(len(shapes), 2, figsize=(11, 3.6 * len(shapes)), squeeze=False)
    for row, shape in zip(axes, shapes, strict=True):
        dec = shape["decode"]
        batches = [str(d["batch"]) for d in dec]
        x = range(len(batches))
        w = 0.27
        row[0].bar([i - w for i in x], [d["ours_tpot_ms"] for d in dec], w, label="Prism")
        row[0].bar(list(x), [d.get("transformers_tpot_ms", 0) for d in dec], w, label="transformers")
        row[0].bar([i + w for i in x], [d["floor_ms"] for d in dec], w, label="bandwidth floor")
        row[0].set_xticks(list(x), batches)
        row[0].set_xlabel("batch (contexts ~1.7k tokens)")
        row[0].set_ylabel("ms per output token")
        row[0].set_title(f"Qwen3-VL-{shape['shape'].upper()} shape: decode TPOT")
        row[0].legend()
        tt = shape["ttft"]
        labels = [f"{t['images']} image(s)" for t in tt]
        x = range(len(labels))
        w = 0.2
        row[1].bar([i - 1.5 * w for i in x], [t["ours_cold_ttft_ms"] for t in tt], w, label="Prism cold")
        row[1].bar([i - 0.5 * w for i in x], [t["hit_ttft_ms"] for t in tt], w, label="Prism prefix hit")
        row[1].bar([i + 0.5 * w for i in x], [t.get("transformers_ttft_ms", 0) for t in tt], w, label="transformers")
        row[1].bar([i + 1.5 * w for i in x], [t["compute_floor_ms"] for t in tt], w, label="compute floor")
        row[1].set_xticks(list(x), labels)
        row[1].set_ylabel("ms to first token")
        row[1].set_title("TTFT, 448x448 photos")
        row[1].legend(fontsize=8)
    fig.suptitle(f"{data['gpu']}, torch {data['torch']}, bf16 weights, FP8 KV, random weights")
    fig.tight_layout()
    fig.savefig(dst, dpi=90)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
