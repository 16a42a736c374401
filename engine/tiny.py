"""Shim: ``python -m engine.tiny OUT_DIR [--preset test|demo] [--seed N]`` and ``engine.tiny.X``
keep working; the code is :mod:`engine.model.tiny` (checkpoints) and
:mod:`engine.model.qwen_tokenizer` (the tokenizer)."""

from .model.qwen_tokenizer import *  # noqa: F403
from .model.tiny import *  # noqa: F403
from .model.tiny import main

if __name__ == "__main__":
    raise SystemExit(main())
