"""The whole Qwen3-VL network (vision tower + decoder + LM head) and its checkpoint loading.

Loading reads Hugging Face safetensors files (one file or shards listed in
``model.safetensors.index.json``) straight into our modules, built on the ``meta`` device first so
no memory is spent on a random initialisation.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from ..errors import CheckpointError
from .attention import AttentionContext
from .config import ModelConfig
from .decoder import LMHead, TextDecoder, VisualInjection
from .vision import VisionEncoder, VisionFeatures

# Checkpoint-name prefixes -> our module paths. The first form is what transformers >= 4.52
# saves for Qwen3-VL; the second is the older flat layout some exports still use.
_PREFIXES = (
    ("model.visual.", "visual."),
    ("model.language_model.", "language_model."),
    ("visual.", "visual."),
    ("model.", "language_model."),
    ("lm_head.", "lm_head."),
)


class Qwen3VL(nn.Module):
    """Qwen3-VL: ``visual`` (:class:`VisionEncoder`), ``language_model`` (:class:`TextDecoder`),
    ``lm_head`` (:class:`LMHead`, sharing the embedding matrix when the checkpoint ties them)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.visual = VisionEncoder(config.vision)
        self.language_model = TextDecoder(config.text)
        self.lm_head = LMHead(config.text)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.language_model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @torch.inference_mode()
    def encode_vision(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]],
                      attention: bool = False) -> VisionFeatures:
        """Vision features of the processor's ``pixel_values`` (see :class:`VisionEncoder`;
        ``attention``: also the attention each merged token receives in the last block)."""
        return self.visual(pixels.to(self.device, self.dtype), grids, attention)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        visual: VisualInjection | None = None,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decoder step over ``T`` new tokens; see :meth:`TextDecoder.forward`.

        Returns:
            float32 logits ``[len(logits_rows), vocab]`` for the rows asked for (all ``T`` when
            ``logits_rows`` is None).
        """
        hidden = self.language_model(input_ids, positions, ctx, visual)
        if logits_rows is not None:
            hidden = hidden[logits_rows]
        return self.lm_head(hidden)


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder.

    Raises:
        CheckpointError: no weights, or an index naming a missing shard.
    """
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (folder / n).exists()]
        if missing:
            raise CheckpointError(f"{folder} is missing shard(s) listed in its index: {', '.join(missing)}")
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    raise CheckpointError(f"No model.safetensors or model.safetensors.index.json in {folder}")


def _our_name(name: str) -> str | None:
    for prefix, ours in _PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix) :]
    return None


def _checkpoint_name(ours: str, flat: bool) -> str:
    """How a checkpoint names our parameter ``ours`` (``flat``: the older layout of :data:`_PREFIXES`)."""
    for prefix, mine in _PREFIXES[2:] if flat else _PREFIXES:
        if ours.startswith(mine):
            return prefix + ours[len(mine) :]
    return ours  # pragma: no cover - every parameter lives under one of the prefixes


def eos_token_ids(folder: str | Path, tokenizer) -> set[int]:
    """The token ids that end generation: ``eos_token_id`` of the checkpoint's
    ``generation_config.json`` (one id or a list), else the tokenizer's end-of-sequence token."""
    ids: set[int] = set()
    gen = Path(folder) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def load_model(folder: str | Path, *, device="cpu", dtype=torch.float32, progress: bool = True) -> Qwen3VL:
    """Build :class:`Qwen3VL` from a checkpoint folder and load its weights.

    Args:
        folder: a folder with ``config.json`` and safetensors weights.
        device: where the weights go.
        dtype: parameter dtype (float32, bfloat16 or float16).
        progress: show a tqdm bar over tensors.

    Raises:
        CheckpointError: an inconsistent config, missing files, or tensors that are unknown,
            missing or of the wrong shape (the message lists their names).
    """
    folder = Path(folder)
    config = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = Qwen3VL(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:  # to_empty() unties shared parameters
        model.lm_head.weight = model.language_model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {n for n in params if not (config.tie_word_embeddings and n == "lm_head.weight")}
    loaded, unknown, bad_shape, seen = set(), [], [], []
    files = checkpoint_files(folder)
    total = sum(len(safe_open(str(f), framework="pt").keys()) for f in files)
    with tqdm(total=total, desc=f"Loading {folder.name}", unit="tensor", disable=not progress) as bar:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    bar.update(1)
                    seen.append(name)
                    ours = _our_name(name)
                    if ours == "lm_head.weight" and config.tie_word_embeddings:
                        continue
                    if ours not in expected:
                        unknown.append(name)
                        continue
                    tensor = f.get_tensor(name)
                    target = params[ours]
                    if tuple(tensor.shape) != tuple(target.shape):
                        bad_shape.append(f"{name} {tuple(tensor.shape)} != {tuple(target.shape)}")
                        continue
                    with torch.no_grad():
                        target.copy_(tensor.to(dtype))
                    loaded.add(ours)
    flat = bool(loaded) and not any(n.startswith(("model.visual.", "model.language_model.")) for n in seen)
    missing = sorted(_checkpoint_name(n, flat) for n in expected - loaded)
    problems = []
    if missing:
        problems.append("missing tensors: " + ", ".join(missing))
    if unknown:
        problems.append("unknown tensors: " + ", ".join(sorted(unknown)))
    if bad_shape:
        problems.append("wrong shapes: " + "; ".join(bad_shape))
    if problems:
        raise CheckpointError(f"Checkpoint {folder} does not match Qwen3-VL: " + " | ".join(problems))
    return model.eval()
