"""Build tiny random-weight Qwen3-VL checkpoints in the Hugging Face layout.

A tiny checkpoint has the files, tensor names, token ids and processor settings of a real
Qwen3-VL instruct checkpoint (``Qwen/Qwen3-VL-2B-Instruct`` and its siblings), but only a few
small layers with random weights.  Tests and the CPU demo use it wherever a real model would be
too big or cannot be downloaded.

The tokenizer is the real Qwen2/Qwen3 byte-level BPE.  Its 151,643 ranks come from the
``qwen.tiktoken`` file shipped inside the PyPI package ``dashscope`` (Apache-2.0); install it with
``pip install --no-deps dashscope==2.0.2``.  The BPE merges are recovered by replaying BPE over
the ranks, and the result is cached (see :func:`tokenizer_cache_dir`) so that later builds only
copy files.

Usage::

    python -m engine.tiny OUT_DIR [--preset test|demo] [--seed N]
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import importlib.util
import json
import math
import os
import pathlib
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from engine.errors import CheckpointError

# --------------------------------------------------------------------------------------------
# Token ids and the files' fixed contents
# --------------------------------------------------------------------------------------------

#: Number of ordinary (byte-level BPE) tokens: ids 0 .. 151642.
NUM_BPE_TOKENS = 151643

#: The added tokens of Qwen3-VL, as (content, id, special).  ``special`` tokens are dropped by
#: ``decode(skip_special_tokens=True)``; the tool/FIM/think tokens are not special in Qwen3.
ADDED_TOKENS: tuple[tuple[str, int, bool], ...] = (
    ("<|endoftext|>", 151643, True),
    ("<|im_start|>", 151644, True),
    ("<|im_end|>", 151645, True),
    ("<|object_ref_start|>", 151646, True),
    ("<|object_ref_end|>", 151647, True),
    ("<|box_start|>", 151648, True),
    ("<|box_end|>", 151649, True),
    ("<|quad_start|>", 151650, True),
    ("<|quad_end|>", 151651, True),
    ("<|vision_start|>", 151652, True),
    ("<|vision_end|>", 151653, True),
    ("<|vision_pad|>", 151654, True),
    ("<|image_pad|>", 151655, True),
    ("<|video_pad|>", 151656, True),
    ("<tool_call>", 151657, False),
    ("</tool_call>", 151658, False),
    ("<|fim_prefix|>", 151659, False),
    ("<|fim_middle|>", 151660, False),
    ("<|fim_suffix|>", 151661, False),
    ("<|fim_pad|>", 151662, False),
    ("<|repo_name|>", 151663, False),
    ("<|file_sep|>", 151664, False),
    ("<tool_response>", 151665, False),
    ("</tool_response>", 151666, False),
    ("<think>", 151667, False),
    ("</think>", 151668, False),
)

ENDOFTEXT_ID = 151643
IM_START_ID = 151644
IM_END_ID = 151645
VISION_START_ID = 151652
VISION_END_ID = 151653
IMAGE_PAD_ID = 151655
VIDEO_PAD_ID = 151656

#: Size of the embedding table of every Qwen3-VL checkpoint (ids past the tokenizer are unused).
VOCAB_SIZE = 151936

#: The pre-tokenizer split pattern of Qwen2/Qwen3 (single digits, unlike GPT-4's 1-3 digits).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: Bump when the tokenizer files written by :func:`_build_tokenizer_files` change, so that stale
#: caches are not reused.
_TOKENIZER_FORMAT = 1
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt")

#: Chat template rendering what Qwen3-VL's instruct template renders for plain conversations:
#: ``<|im_start|>{role}\n{content}<|im_end|>\n`` per turn, image and video parts replaced by
#: their vision placeholders, no default system prompt.  ``add_vision_id`` prefixes each image
#: with ``Picture N: `` and each video with ``Video N: `` (counting across the conversation).
CHAT_TEMPLATE = (
    "{%- set counts = namespace(image=0, video=0) -%}\n"
    "{%- for message in messages -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}\n"
    "{%- if message['content'] is string -%}\n"
    "{{- message['content'] -}}\n"
    "{%- elif message['content'] is not none -%}\n"
    "{%- for part in message['content'] -%}\n"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}\n"
    "{%- set counts.image = counts.image + 1 -%}\n"
    "{%- if add_vision_id -%}{{- 'Picture ' + counts.image|string + ': ' -}}{%- endif -%}\n"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}\n"
    "{%- elif part['type'] == 'video' or 'video' in part -%}\n"
    "{%- set counts.video = counts.video + 1 -%}\n"
    "{%- if add_vision_id -%}{{- 'Video ' + counts.video|string + ': ' -}}{%- endif -%}\n"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}\n"
    "{%- elif 'text' in part -%}\n"
    "{{- part['text'] -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}\n"
)

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
# Tokenizer
# --------------------------------------------------------------------------------------------


def qwen_tiktoken_path() -> pathlib.Path:
    """Return the path of ``qwen.tiktoken`` inside the installed ``dashscope`` package.

    The package is located without importing it (its dependencies need not be installed).
    Raises :class:`CheckpointError` with install instructions if it is missing.
    """
    spec = importlib.util.find_spec("dashscope")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = pathlib.Path(location) / "resources" / "qwen.tiktoken"
        if path.is_file():
            return path
    raise CheckpointError(
        "the Qwen tokenizer ranks (dashscope/resources/qwen.tiktoken) were not found; "
        "install them with: pip install --no-deps dashscope==2.0.2"
    )


def _read_ranks(path: pathlib.Path) -> list[bytes]:
    tokens: list[bytes | None] = [None] * NUM_BPE_TOKENS
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token_b64, rank_text = line.split()
                rank = int(rank_text)
                tokens[rank] = base64.b64decode(token_b64, validate=True)
            except (ValueError, IndexError) as exc:
                raise CheckpointError(f"{path}:{line_no}: not a 'base64 rank' line of {NUM_BPE_TOKENS} ranks") from exc
    if any(t is None for t in tokens):
        raise CheckpointError(f"{path}: expected ranks 0..{NUM_BPE_TOKENS - 1}, some are missing")
    return tokens  # type: ignore[return-value]


def _byte_alphabet() -> list[str]:
    """The printable stand-in character of each byte value, as used by byte-level BPE (GPT-2).

    Bytes that are printable Latin-1 characters stand for themselves; the others (controls,
    space, soft hyphen, ...) are given the code points from 256 upwards, in byte order.
    """
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    alphabet, extra = [], 0
    for b in range(256):
        if b in keep:
            alphabet.append(chr(b))
        else:
            alphabet.append(chr(256 + extra))
            extra += 1
    return alphabet


def _recover_merges(tokens: list[bytes]) -> list[tuple[bytes, bytes]]:
    """Recover the ordered BPE merges from token ranks.

    A token of rank r was created by merging two lower-ranked tokens.  Running BPE over its bytes
    with only the ranks below r must stop at exactly two parts: that pair is its merge.  Merges are
    returned in rank order, which is the priority order a BPE merge list uses.
    """
    rank = {tok: r for r, tok in enumerate(tokens)}
    merges = []
    for r, tok in enumerate(tokens):
        if len(tok) == 1:
            continue
        parts = [tok[i : i + 1] for i in range(len(tok))]
        while len(parts) > 2:
            best, at = r, -1
            for i in range(len(parts) - 1):
                pr = rank.get(parts[i] + parts[i + 1], r)
                if pr < best:
                    best, at = pr, i
            if at < 0:
                break
            parts[at : at + 2] = [parts[at] + parts[at + 1]]
        if len(parts) != 2:
            raise CheckpointError(f"token rank {r} ({tok!r}) cannot be formed by merging lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


def _build_tokenizer_files(tiktoken_path: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Write tokenizer.json, vocab.json and merges.txt for the Qwen BPE into ``out_dir``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    tokens = _read_ranks(tiktoken_path)
    alphabet = _byte_alphabet()

    def show(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    vocab = {show(tok): r for r, tok in enumerate(tokens)}
    if len(vocab) != NUM_BPE_TOKENS:
        raise CheckpointError(f"{tiktoken_path}: duplicate tokens in the ranks")
    merges = [(show(a), show(b)) for a, b in _recover_merges(tokens)]

    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for content, token_id, special in ADDED_TOKENS:
        added = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
        if tok.token_to_id(content) != token_id:
            raise CheckpointError(f"added token {content} got id {tok.token_to_id(content)}, expected {token_id}")

    tok.save(str(out_dir / "tokenizer.json"), pretty=False)
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    with open(out_dir / "merges.txt", "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for a, b in merges:
            f.write(f"{a} {b}\n")


def tokenizer_cache_dir() -> pathlib.Path:
    """Return the folder where rebuilt tokenizer files are cached.

    ``$PRISM_CACHE_DIR/tokenizer`` if that variable is set, else ``platformdirs``' user cache
    folder for ``prism`` (``~/.cache/prism/tokenizer`` on Linux).
    """
    root = os.environ.get("PRISM_CACHE_DIR")
    if root:
        return pathlib.Path(root) / "tokenizer"
    try:
        import platformdirs

        return pathlib.Path(platformdirs.user_cache_dir("prism")) / "tokenizer"
    except ImportError:
        return pathlib.Path.home() / ".cache" / "prism" / "tokenizer"


def cached_tokenizer_files() -> pathlib.Path:
    """Return a folder holding tokenizer.json, vocab.json and merges.txt for the Qwen BPE.

    The folder lies under :func:`tokenizer_cache_dir`, keyed by the sha256 of ``qwen.tiktoken``;
    it is built on first use (a few seconds) and written atomically, so concurrent builders are
    safe.  Raises :class:`CheckpointError` when ``qwen.tiktoken`` is missing or malformed.
    """
    source = qwen_tiktoken_path()
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    target = tokenizer_cache_dir() / f"qwen-bpe-v{_TOKENIZER_FORMAT}-{digest}"
    if all((target / name).is_file() for name in _TOKENIZER_FILES):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        _build_tokenizer_files(source, staging)
        try:
            os.replace(staging, target)
        except OSError:
            # Another process won the race (keep theirs), or a damaged folder is in the way.
            if not all((target / name).is_file() for name in _TOKENIZER_FILES):
                shutil.rmtree(target, ignore_errors=True)
                os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def tokenizer_config() -> dict[str, Any]:
    """Return the ``tokenizer_config.json`` contents (Qwen3-VL's, with our chat template)."""
    specials = [content for content, _, special in ADDED_TOKENS if special and content != "<|endoftext|>"]
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for content, token_id, special in ADDED_TOKENS
        },
        "additional_special_tokens": specials,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "processor_class": "Qwen3VLProcessor",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


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
    for name in _TOKENIZER_FILES:
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
