"""Finding a checkpoint folder: a local path or a Hugging Face model id."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError

# Files an engine needs; nothing else of a model repository is downloaded.
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]


def resolve_checkpoint(model: str | os.PathLike) -> Path:
    """Return a local folder holding the checkpoint ``model``.

    ``model`` is either an existing folder or a Hugging Face id such as
    ``Qwen/Qwen3-VL-2B-Instruct``. An id is looked up in the local Hugging Face cache first and
    downloaded (config, tokenizer, processor and safetensors files only) when it is missing and
    the network allows.

    Raises:
        CheckpointError: not a folder, and the id is neither cached nor downloadable; the message
            names the cache folder that was searched.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    text = str(model)
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise CheckpointError(f"No checkpoint folder at {path} (and {text!r} is not a Hugging Face model id)")
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(text, allow_patterns=CHECKPOINT_PATTERNS, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(text, allow_patterns=CHECKPOINT_PATTERNS))
    except Exception as exc:
        raise CheckpointError(
            f"Model {text!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and could not "
            f"be downloaded ({type(exc).__name__}). Download it once with network access, or pass a local folder."
        ) from exc
