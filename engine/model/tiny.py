"""Build tiny random-weight Qwen3-VL checkpoints in the Hugging Face layout.

A tiny checkpoint has the files, tensor names, token ids and processor settings of a real
Qwen3-VL instruct checkpoint (``Qwen/Qwen3-VL-2B-Instruct`` and its siblings), but only a few
small layers with random weights.  Tests and the CPU demo use it wherever a real model would be
too big or cannot be downloaded.

The tokenizer is the real Qwen2/Qwen3 byte-level BPE, rebuilt offline by
:mod:`engine.model.qwen_tokenizer` (it needs ``pip install --no-deps dashscope==2.0.2``).

Usage::

    python -m engine.tiny OUT_DIR [--preset test|demo] [--seed N]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointError
from .qwen_tokenizer import (
    ADDED_TOKENS,
    CHAT_TEMPLATE,
    ENDOFTEXT_ID,
    IM_END_ID,
    IMAGE_PAD_ID,
    NUM_BPE_TOKENS,
    TOKENIZER_FILES,
    VIDEO_PAD_ID,
    VISION_END_ID,
    VISION_START_ID,
    cached_tokenizer_files,
    tokenizer_config,
)

# --------------------------------------------------------------------------------------------
# The files' fixed contents
# --------------------------------------------------------------------------------------------

#: Size of the embedding table of every Qwen3-VL checkpoint (ids past the tokenizer are unused).
VOCAB_SIZE = 151936

#: Image processor settings shipped by the real Qwen3-VL instruct checkpoints.  ``size`` is a
#: pixel-count budget: shortest_edge = min pixels (256x256), longest_edge = max pixels (4096x4096).
IMAGE_PROCESSOR_CONFIG: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "image_std": [0.5, 0.5, 0.5],
    "merge_size": 2,
    "patch_size": 16,
    "processor_class": "Qwen3VLProcessor",
    "resample": 3,
    "rescale_factor": 1.0 / 255.0,
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "temporal_patch_size": 2,
}

#: Video processor settings shipped by the real Qwen3-VL instruct checkpoints.  ``size`` is a
#: pixel budget over the whole clip (frames x height x width): min 4,096, max 25,165,824.
VIDEO_PROCESSOR_CONFIG: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "do_sample_frames": True,
    "fps": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "max_frames": 768,
    "merge_size": 2,
    "min_frames": 4,
    "patch_size": 16,
    "processor_class": "Qwen3VLProcessor",
    "resample": 3,
    "rescale_factor": 1.0 / 255.0,
    "return_metadata": False,
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "temporal_patch_size": 2,
    "video_processor_type": "Qwen3VLVideoProcessor",
}

#: The transformers version recorded in config.json / generation_config.json (first with Qwen3-VL).
TRANSFORMERS_VERSION = "4.57.0"

GENERATION_CONFIG: dict[str, Any] = {
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
    "pad_token_id": ENDOFTEXT_ID,
    "transformers_version": TRANSFORMERS_VERSION,
}

# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------

#: Keys of a preset besides ``text_config`` and ``vision_config`` that ``overrides`` may set.
_TOP_LEVEL_OVERRIDES = ("tie_word_embeddings", "dtype")

PRESETS: dict[str, dict[str, Any]] = {
    # Seconds to build and run on a CPU.  head_dim 16 -> 8 rotary frequencies, interleaved as
    # T H W T H W T T: mrope_section [4, 2, 2] is the split transformers' interleaved M-RoPE
    # really applies (a section like [2, 3, 3] would be silently truncated to 3/3/2).
    # Three text layers with two deepstack levels leave the last layer without visual injection.
    "test": {
        "dtype": "float32",
        "tie_word_embeddings": True,
        "text_config": {
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "hidden_act": "silu",
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-6,
            "rope_theta": 5000000,
            "rope_scaling": {"mrope_interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default"},
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
        },
        "vision_config": {
            "depth": 4,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 64,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [1, 2],
            "hidden_act": "gelu_pytorch_tanh",
            "initializer_range": 0.02,
        },
    },
    # A little bigger, for the CPU demo: untied lm_head and bfloat16 storage like the real
    # checkpoints.  head_dim 64 -> 32 frequencies, split [12, 10, 10] like the real [24, 20, 20].
    "demo": {
        "dtype": "bfloat16",
        "tie_word_embeddings": False,
        "text_config": {
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "hidden_act": "silu",
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_theta": 5000000,
            "rope_scaling": {"mrope_interleaved": True, "mrope_section": [12, 10, 10], "rope_type": "default"},
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
        },
        "vision_config": {
            "depth": 6,
            "hidden_size": 128,
            "intermediate_size": 512,
            "num_heads": 4,
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 256,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [1, 3, 4],
            "hidden_act": "gelu_pytorch_tanh",
            "initializer_range": 0.02,
        },
    },
}

_DTYPES = ("float32", "bfloat16", "float16")


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def resolve_preset(preset: str = "test", overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Return the settings of ``preset`` with ``overrides`` merged in, checked for consistency.

    ``overrides`` may hold ``text_config`` and ``vision_config`` dicts (merged key by key into the
    preset's, nested dicts such as ``rope_scaling`` merged too; a ``None`` value deletes the key,
    e.g. ``{"rope_scaling": None, "rope_theta": None, "rope_parameters": {...}}`` writes the
    transformers 5 spelling of the rotary settings) and the top-level keys
    ``tie_word_embeddings`` (bool) and ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``:
    the storage dtype of the weights).

    Raises :class:`CheckpointError` for an unknown preset or override key, or for settings no
    Qwen3-VL model can have (heads not dividing, deepstack index outside the vision depth, rotary
    sections not summing to ``head_dim / 2``, ...).
    """
    if preset not in PRESETS:
        raise CheckpointError(f"unknown tiny preset {preset!r}; choose one of {sorted(PRESETS)}")
    spec = copy.deepcopy(PRESETS[preset])
    for key, value in (overrides or {}).items():
        if key in ("text_config", "vision_config"):
            if not isinstance(value, Mapping):
                raise CheckpointError(f"overrides[{key!r}] must be a dict, got {type(value).__name__}")
            spec[key] = _deep_merge(spec[key], value)
        elif key in _TOP_LEVEL_OVERRIDES:
            spec[key] = value
        else:
            allowed = ["text_config", "vision_config", *_TOP_LEVEL_OVERRIDES]
            raise CheckpointError(f"unknown override {key!r}; allowed keys are {allowed}")
    try:
        _check_spec(spec)
    except KeyError as exc:
        raise CheckpointError(f"tiny Qwen3-VL settings lack the required key {exc}") from None
    return spec


def _check_spec(spec: dict[str, Any]) -> None:
    text, vision = spec["text_config"], spec["vision_config"]
    problems = []
    if spec["dtype"] not in _DTYPES:
        problems.append(f"dtype {spec['dtype']!r} is not one of {_DTYPES}")
    if not isinstance(spec["tie_word_embeddings"], bool):
        problems.append("tie_word_embeddings must be a bool")
    if text["num_attention_heads"] % text["num_key_value_heads"]:
        problems.append("text_config.num_attention_heads must be a multiple of num_key_value_heads")
    if text["head_dim"] % 2:
        problems.append("text_config.head_dim must be even")
    rope = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    if rope.get("rope_theta", text.get("rope_theta")) is None:
        problems.append("text_config needs rope_theta (top level or in rope_parameters)")
    if rope.get("rope_type", "default") != "default":
        problems.append("only rope_type 'default' is supported")
    section = rope.get("mrope_section")
    if section is None or len(section) != 3 or sum(section) != text["head_dim"] // 2:
        problems.append(
            f"text_config mrope_section {section} must have 3 parts summing to head_dim/2 = {text['head_dim'] // 2}"
        )
    elif rope.get("mrope_interleaved", False):
        # Interleaved M-RoPE gives frequency i to H when i % 3 == 1 and i < 3 * h, to W when
        # i % 3 == 2 and i < 3 * w, and to T otherwise; the section must be what that yields.
        n = text["head_dim"] // 2
        h = len(range(1, min(3 * section[1], n), 3))
        w = len(range(2, min(3 * section[2], n), 3))
        if [n - h - w, h, w] != list(section):
            problems.append(
                f"interleaved mrope_section {section} cannot be laid out over {n} frequencies "
                f"(it would act as {[n - h - w, h, w]})"
            )
    if text["vocab_size"] < NUM_BPE_TOKENS + len(ADDED_TOKENS):
        problems.append(f"text_config.vocab_size must be at least {NUM_BPE_TOKENS + len(ADDED_TOKENS)}")
    if vision["hidden_size"] % vision["num_heads"]:
        problems.append("vision_config.hidden_size must be a multiple of num_heads")
    elif (vision["hidden_size"] // vision["num_heads"]) % 4:
        problems.append("vision head dim (hidden_size / num_heads) must be a multiple of 4 (2-D rotary)")
    side = int(round(vision["num_position_embeddings"] ** 0.5))
    if side * side != vision["num_position_embeddings"]:
        problems.append("vision_config.num_position_embeddings must be a perfect square")
    indexes = list(vision["deepstack_visual_indexes"])
    if any(not 0 <= i < vision["depth"] for i in indexes) or len(set(indexes)) != len(indexes):
        problems.append(
            f"vision_config.deepstack_visual_indexes {indexes} must be distinct layers in [0, {vision['depth']})"
        )
    if len(indexes) > text["num_hidden_layers"]:
        problems.append("more deepstack levels than text layers to inject them into")
    if vision["out_hidden_size"] != text["hidden_size"]:
        problems.append(
            f"vision_config.out_hidden_size {vision['out_hidden_size']} must equal text_config.hidden_size "
            f"{text['hidden_size']}"
        )
    if problems:
        raise CheckpointError("inconsistent tiny Qwen3-VL settings: " + "; ".join(problems))


def config_dict(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Return the ``config.json`` contents for a resolved preset (see :func:`resolve_preset`).

    The layout follows the real Hub checkpoints: rotary settings as ``rope_theta`` plus
    ``rope_scaling`` inside ``text_config`` (transformers 5 reads them into ``rope_parameters``).
    """
    text = dict(spec["text_config"])
    text.update(
        {
            "model_type": "qwen3_vl_text",
            "bos_token_id": ENDOFTEXT_ID,
            "eos_token_id": IM_END_ID,
            "tie_word_embeddings": spec["tie_word_embeddings"],
            "dtype": spec["dtype"],
        }
    )
    vision = dict(spec["vision_config"])
    vision["model_type"] = "qwen3_vl_vision"
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "dtype": spec["dtype"],
        "image_token_id": IMAGE_PAD_ID,
        "video_token_id": VIDEO_PAD_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "tie_word_embeddings": spec["tie_word_embeddings"],
        # The Hub checkpoints were written by 4.57; without this key transformers 5 treats a local
        # tokenizer as a possibly broken Mistral one and logs a bogus regex warning.
        "transformers_version": TRANSFORMERS_VERSION,
        "text_config": dict(sorted(text.items())),
        "vision_config": dict(sorted(vision.items())),
    }


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def tensor_shapes(spec: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Return ``{tensor name: shape}`` of the checkpoint for a resolved preset, in file order.

    Names are those of the Hub checkpoints and of transformers' ``Qwen3VLForConditionalGeneration``
    state dict (``model.visual.*``, ``model.language_model.*``, ``lm_head.weight``); ``lm_head`` is
    absent when the word embeddings are tied.
    """
    t, v = spec["text_config"], spec["vision_config"]
    shapes: dict[str, tuple[int, ...]] = {}

    hv, iv = v["hidden_size"], v["intermediate_size"]
    merged = hv * v["spatial_merge_size"] ** 2
    p, tp = v["patch_size"], v["temporal_patch_size"]
    shapes["model.visual.patch_embed.proj.weight"] = (hv, v["in_channels"], tp, p, p)
    shapes["model.visual.patch_embed.proj.bias"] = (hv,)
    shapes["model.visual.pos_embed.weight"] = (v["num_position_embeddings"], hv)
    for i in range(v["depth"]):
        b = f"model.visual.blocks.{i}."
        shapes[b + "norm1.weight"] = (hv,)
        shapes[b + "norm1.bias"] = (hv,)
        shapes[b + "norm2.weight"] = (hv,)
        shapes[b + "norm2.bias"] = (hv,)
        shapes[b + "attn.qkv.weight"] = (3 * hv, hv)
        shapes[b + "attn.qkv.bias"] = (3 * hv,)
        shapes[b + "attn.proj.weight"] = (hv, hv)
        shapes[b + "attn.proj.bias"] = (hv,)
        shapes[b + "mlp.linear_fc1.weight"] = (iv, hv)
        shapes[b + "mlp.linear_fc1.bias"] = (iv,)
        shapes[b + "mlp.linear_fc2.weight"] = (hv, iv)
        shapes[b + "mlp.linear_fc2.bias"] = (hv,)
    mergers = ["model.visual.merger."] + [
        f"model.visual.deepstack_merger_list.{j}." for j in range(len(v["deepstack_visual_indexes"]))
    ]
    for j, m in enumerate(mergers):
        norm_dim = hv if j == 0 else merged  # the deepstack mergers normalise after the 2x2 shuffle
        shapes[m + "norm.weight"] = (norm_dim,)
        shapes[m + "norm.bias"] = (norm_dim,)
        shapes[m + "linear_fc1.weight"] = (merged, merged)
        shapes[m + "linear_fc1.bias"] = (merged,)
        shapes[m + "linear_fc2.weight"] = (v["out_hidden_size"], merged)
        shapes[m + "linear_fc2.bias"] = (v["out_hidden_size"],)

    h, it, hd = t["hidden_size"], t["intermediate_size"], t["head_dim"]
    q, kv = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
    shapes["model.language_model.embed_tokens.weight"] = (t["vocab_size"], h)
    for i in range(t["num_hidden_layers"]):
        b = f"model.language_model.layers.{i}."
        shapes[b + "input_layernorm.weight"] = (h,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[b + f"self_attn.{name}.weight"] = (rows, h)
            if t.get("attention_bias"):
                shapes[b + f"self_attn.{name}.bias"] = (rows,)
        shapes[b + "self_attn.o_proj.weight"] = (h, q)
        if t.get("attention_bias"):
            shapes[b + "self_attn.o_proj.bias"] = (h,)
        shapes[b + "self_attn.q_norm.weight"] = (hd,)
        shapes[b + "self_attn.k_norm.weight"] = (hd,)
        shapes[b + "post_attention_layernorm.weight"] = (h,)
        shapes[b + "mlp.gate_proj.weight"] = (it, h)
        shapes[b + "mlp.up_proj.weight"] = (it, h)
        shapes[b + "mlp.down_proj.weight"] = (h, it)
    shapes["model.language_model.norm.weight"] = (h,)
    if not spec["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (t["vocab_size"], h)
    return shapes


def _is_norm(name: str) -> bool:
    leaf = name.rsplit(".", 2)
    return "norm" in leaf[-2]


#: Norm weights scaled up from ~1: q/k norms x2 sharpen attention (logits std ~4), so that
#: positions are told apart instead of averaged over hundreds of image tokens; the final norm x3
#: gives output logits a std of ~3 (top-1 probability of a few percent, not a flat 1/151936).
_NORM_GAINS = (("self_attn.q_norm.weight", 2.0), ("self_attn.k_norm.weight", 2.0), ("language_model.norm.weight", 3.0))


def random_weights(spec: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
    """Return ``{name: torch.Tensor}`` random weights for a resolved preset, in its storage dtype.

    Every tensor is drawn from its own generator seeded from ``(seed, name)``, so a tensor's
    values do not depend on which other tensors exist (a 5-layer override shares layers 0-2 with
    the 3-layer preset).  Scales are chosen for lively outputs, not to mimic training: greedy
    decoding gives varied tokens that depend on the prompt and the image.

    - matrices, convolutions and embeddings (2+ dims): N(0, 1 / fan_in), fan_in = the product of
      all dims but the first, so every layer's output has roughly unit scale and each layer
      changes the residual stream at least as much as the token embedding does (with
      transformers' N(0, 0.02) init a tied model just repeats its input token);
    - biases: N(0, 0.1); norm weights: gain * (1 + N(0, 0.1)), gain 1 except
      :data:`_NORM_GAINS`, so that a forgotten bias or a misapplied norm changes the outputs
      instead of hiding behind zeros and ones.

    ``initializer_range`` in the config is not used.
    """
    import torch

    dtype = getattr(torch, spec["dtype"])
    out = {}
    for name, shape in tensor_shapes(spec).items():
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        values = torch.randn(shape, generator=gen, dtype=torch.float32)
        if len(shape) >= 2:
            values *= math.prod(shape[1:]) ** -0.5
        elif _is_norm(name) and name.endswith(".weight"):
            gain = next((g for suffix, g in _NORM_GAINS if name.endswith(suffix)), 1.0)
            values = gain * (1.0 + 0.1 * values)
        else:
            values *= 0.1
        out[name] = values.to(dtype).contiguous()
    return out


# --------------------------------------------------------------------------------------------
# The checkpoint
# --------------------------------------------------------------------------------------------


def _write_json(path: pathlib.Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_tiny_checkpoint(
    out_dir: str | os.PathLike[str],
    preset: str = "test",
    *,
    seed: int = 0,
    overrides: Mapping[str, Any] | None = None,
) -> pathlib.Path:
    """Write a tiny random-weight Qwen3-VL checkpoint into ``out_dir`` and return its path.

    Files written (the layout of the real Hub checkpoints):

    - ``config.json``: ``Qwen3VLForConditionalGeneration`` config (see :func:`config_dict`);
    - ``model.safetensors``: random weights (see :func:`random_weights`), metadata ``format: pt``;
    - ``generation_config.json``: eos ``[151645, 151643]``, pad and bos ``151643``;
    - ``preprocessor_config.json`` / ``video_preprocessor_config.json``: the real image and video
      processor settings (patch 16, merge 2, temporal patch 2, mean/std 0.5);
    - ``tokenizer.json``, ``vocab.json``, ``merges.txt``, ``tokenizer_config.json``: the real
      Qwen BPE with Qwen3-VL's added tokens (ids 151643..151668);
    - ``chat_template.jinja``: :data:`CHAT_TEMPLATE` (also in ``tokenizer_config.json``).

    ``out_dir`` is created if needed; existing files of these names are replaced, others are left.
    The same ``preset``, ``seed`` and ``overrides`` always give byte-identical weights.
    ``overrides`` is described in :func:`resolve_preset`.

    Raises :class:`CheckpointError` for an unknown preset, bad overrides, or a missing
    ``dashscope`` package (which ships the tokenizer ranks).
    """
    from safetensors.torch import save_file

    spec = resolve_preset(preset, overrides)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_files = cached_tokenizer_files()

    _write_json(out / "config.json", config_dict(spec))
    _write_json(out / "generation_config.json", GENERATION_CONFIG)
    save_file(random_weights(spec, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors creates it owner-only
    _write_json(out / "preprocessor_config.json", IMAGE_PROCESSOR_CONFIG)
    _write_json(out / "video_preprocessor_config.json", VIDEO_PROCESSOR_CONFIG)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config())
    for name in TOKENIZER_FILES:
        (out / name).write_bytes((tokenizer_files / name).read_bytes())
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m engine.tiny OUT_DIR [--preset test|demo] [--seed N]``."""
    parser = argparse.ArgumentParser(prog="python -m engine.tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="folder to write the checkpoint into (created if missing)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="test")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    args = parser.parse_args(argv)
    try:
        path = build_tiny_checkpoint(args.out_dir, args.preset, seed=args.seed)
    except CheckpointError as exc:
        parser.exit(2, f"error: {exc}\n")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
