"""A synthetic multi-image question suite and a small Qwen3-VL trained on it (issue 20).

Held-out samples for a harness::

    from benchmarks.quality import MODEL_DIR, accuracy_by_type, heldout

    samples = heldout(100)                      # fixed split: keys heldout:0 .. heldout:99
    for s in samples:
        s.images()                              # 1-4 RGB PIL images, 256 x 256
        s.question, s.answer, s.qtype           # str, str, one of QUESTION_TYPES
        s.messages()                            # engine.inputs.prompts.media_first_messages(images, question)
    accuracy_by_type(samples, predictions)      # exact match per type and overall
    transfer(100)                               # the transfer split (count_colour), reported apart

``MODEL_DIR`` is the committed probe checkpoint (transformers and ``engine.Engine.from_pretrained``
load it); docs/QUALITY.md says how it was trained and what it reached. Modules: :mod:`.scenes`
(generator, splits, scoring), :mod:`.font` and :mod:`.render` (deterministic pixels),
:mod:`.patches` and :mod:`.tokens` (the processor's patches and ids, rebuilt), :mod:`.data`,
:mod:`.model`, :mod:`.checkpoint` and :mod:`.train` (the trainer).
"""

from __future__ import annotations

import pathlib

from .scenes import (
    EVAL,
    QUESTION_TYPES,
    TRANSFER_TYPES,
    Distribution,
    Sample,
    Scene,
    Shape,
    Word,
    accuracy_by_type,
    heldout,
    is_correct,
    make_sample,
    normalise_answer,
    transfer,
)

#: The committed probe checkpoint (bfloat16 safetensors shards, config, processor and tokenizer files).
MODEL_DIR = pathlib.Path(__file__).resolve().parent / "probe"

__all__ = [
    "EVAL",
    "MODEL_DIR",
    "QUESTION_TYPES",
    "TRANSFER_TYPES",
    "Distribution",
    "Sample",
    "Scene",
    "Shape",
    "Word",
    "accuracy_by_type",
    "heldout",
    "is_correct",
    "make_sample",
    "normalise_answer",
    "transfer",
]
