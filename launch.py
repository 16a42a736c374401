"""Start Prism.

Until the web app lands this is a terminal chat about images on the embedded engine::

    python launch.py --image ../shared/media/astronaut.png --prompt "What is in the picture?"
    python launch.py --image photo.jpg            # then type questions, empty line to quit

Model: ``--model`` (a folder or Hugging Face id); by default ``Qwen/Qwen3-VL-2B-Instruct`` when it
is in the local Hugging Face cache, otherwise the built-in tiny demo checkpoint (random weights:
its answers are random text), created on first use under the data dir.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REAL_MODEL = "Qwen/Qwen3-VL-2B-Instruct"


def default_data_dir() -> Path:
    from platformdirs import user_data_dir

    return Path(os.environ.get("PRISM_DATA_DIR") or user_data_dir("prism"))


def pick_model(requested: str | None, data_dir: Path) -> tuple[str, bool]:
    """The model to load and whether it is the random-weight demo checkpoint."""
    if requested:
        return requested, False
    from huggingface_hub import snapshot_download

    from engine.hub import CHECKPOINT_PATTERNS

    try:
        return snapshot_download(REAL_MODEL, allow_patterns=CHECKPOINT_PATTERNS, local_files_only=True), False
    except Exception:
        pass
    from engine.tiny import build_tiny_checkpoint

    demo = data_dir / "models" / "tiny-demo"
    if not (demo / "model.safetensors").exists():
        print(f"Building the tiny demo checkpoint in {demo} ...", file=sys.stderr)
        build_tiny_checkpoint(demo, "demo", seed=0)
    return str(demo), True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.environ.get("PRISM_MODEL"), help="checkpoint folder or HF model id")
    parser.add_argument("--device", default=os.environ.get("PRISM_DEVICE", "auto"), help="auto, cpu or cuda")
    parser.add_argument("--data-dir", type=Path, default=None, help="where Prism keeps its files")
    parser.add_argument("--image", action="append", default=[], help="an image to ask about (repeatable)")
    parser.add_argument("--prompt", help="ask one question and exit")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens per answer")
    args = parser.parse_args(argv)

    from engine import Engine, PrismError, SamplingParams

    data_dir = args.data_dir or default_data_dir()
    model, is_demo = pick_model(args.model, data_dir)
    if is_demo:
        print(
            "NOTE: running the built-in tiny demo model with random weights; its answers are random text. "
            f"For real answers: python launch.py --model {REAL_MODEL}",
            file=sys.stderr,
        )
    engine = Engine.from_pretrained(model, device=args.device)
    print(f"Prism ready: {model} on {engine.device} ({engine.dtype})", file=sys.stderr)
    images = [{"type": "image", "image": path} for path in args.image]

    def ask(question: str) -> None:
        messages = [{"role": "user", "content": [*images, {"type": "text", "text": question}]}]
        try:
            for item in engine.stream(messages, SamplingParams(max_tokens=args.max_tokens)):
                if isinstance(item, str):
                    print(item, end="", flush=True)
                else:
                    t = item.telemetry
                    print(f"\n[TTFT {t.ttft_ms:.0f} ms · {t.prompt_tokens} prompt tok · "
                          f"{t.decode_tokens_per_s:.1f} tok/s · {item.finish_reason}]")
        except PrismError as exc:
            print(f"Error: {exc}", file=sys.stderr)

    with engine:
        if args.prompt:
            ask(args.prompt)
            return 0
        while True:
            try:
                question = input("? ").strip()
            except EOFError:
                break
            if not question:
                break
            ask(question)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
