"""Random-weight Qwen3-VL engines at real model shapes, built in memory for the GPU benchmarks.

Shapes from the public model cards (Qwen/Qwen3-VL-2B-Instruct and -8B-Instruct config.json).
The weights are drawn on the device (no multi-GB checkpoint is written); the tokenizer and
processor files come from a tiny checkpoint (:mod:`engine.tiny`). A transformers twin with the
same weights is built on demand for side-by-side timing.
"""

from __future__ import annotations

import json
import math
import pathlib

import torch

SHAPES = {
    "8b": {
        "tie_word_embeddings": False,
        "text": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, mrope_section=[24, 20, 20]),
        "vision": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                       deepstack_visual_indexes=[8, 16, 24]),
    },
    "2b": {
        "tie_word_embeddings": True,
        "text": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128, mrope_section=[24, 20, 20]),
        "vision": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                       deepstack_visual_indexes=[5, 11, 17]),
    },
}


def config_dict(shape: str) -> dict:
    """A Hugging Face ``config.json`` dict for ``shape`` ("8b" or "2b")."""
    s = SHAPES[shape]
    t = dict(s["text"])
    section = t.pop("mrope_section")
    return {
        "model_type": "qwen3_vl",
        "transformers_version": "4.57.0",
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "tie_word_embeddings": s["tie_word_embeddings"],
        "image_token_id": 151655, "video_token_id": 151656,
        "vision_start_token_id": 151652, "vision_end_token_id": 151653,
        "text_config": {
            "model_type": "qwen3_vl_text", "vocab_size": 151936, "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "rope_theta": 5000000,
            "rope_scaling": {"rope_type": "default", "mrope_interleaved": True, "mrope_section": section},
            "tie_word_embeddings": s["tie_word_embeddings"], **t,
        },
        "vision_config": {
            "model_type": "qwen3_vl_vision", "hidden_act": "gelu_pytorch_tanh", "in_channels": 3,
            "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 2304,
            "out_hidden_size": s["text"]["hidden_size"], **s["vision"],
        },
    }


def make_folder(shape: str, workdir: pathlib.Path) -> pathlib.Path:
    """A checkpoint folder without weights: ``config.json`` for ``shape`` plus a tiny checkpoint's
    tokenizer, processor and generation files."""
    from engine.model.tiny import build_tiny_checkpoint

    tiny = build_tiny_checkpoint(workdir / "tiny", "test", seed=0)
    folder = workdir / f"shape-{shape}"
    folder.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (folder / f.name).write_bytes(f.read_bytes())
    (folder / "config.json").write_text(json.dumps(config_dict(shape), indent=2))
    return folder


@torch.no_grad()
def random_model(folder: pathlib.Path, device, dtype, seed: int = 0):
    """Our :class:`engine.model.qwen3_vl.Qwen3VL` for ``folder``'s config with random weights on ``device``:
    matrices N(0, 1/fan_in), embeddings N(0, 1), norms 1, biases 0."""
    from engine.model.config import ModelConfig
    from engine.model.qwen3_vl import Qwen3VL

    config = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = Qwen3VL(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.language_model.embed_tokens.weight
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif p.dim() == 1:
            p.fill_(1.0)
        elif "embed" in name or p.dim() == 2 and name == "visual.pos_embed.weight":
            p.normal_(0, 1.0, generator=gen)
        else:
            fan_in = math.prod(p.shape[1:])
            p.normal_(0, fan_in**-0.5, generator=gen)
    return model.eval()


def random_engine(shape: str, workdir: pathlib.Path, device="cuda", dtype=torch.bfloat16, **options):
    """An :class:`engine.Engine` at ``shape`` with random weights (see :func:`random_model`)."""
    from transformers import AutoProcessor

    from engine import Engine
    from engine.engine import EngineOptions

    folder = make_folder(shape, workdir)
    model = random_model(folder, torch.device(device), dtype)
    processor = AutoProcessor.from_pretrained(str(folder))
    return Engine(model, processor, model_id=f"random-{shape}", folder=folder, options=EngineOptions(**options))


@torch.no_grad()
def transformers_twin(model, folder: pathlib.Path):
    """transformers' ``Qwen3VLForConditionalGeneration`` holding the same weights as ``model``."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    cfg = Qwen3VLConfig(**json.loads((folder / "config.json").read_text()))
    with torch.device(model.device):
        hf = Qwen3VLForConditionalGeneration._from_config(cfg, dtype=model.dtype)
    ours = dict(model.named_parameters(remove_duplicate=False))
    for name, p in hf.named_parameters(remove_duplicate=False):
        key = name.replace("model.visual.", "visual.").replace("model.language_model.", "language_model.")
        p.copy_(ours[key])
    return hf.eval()
