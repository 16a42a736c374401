"""Qwen3-VL model configuration, read from a checkpoint's ``config.json`` and validated.

Field names follow the Hugging Face ``Qwen3VLConfig`` layout (``text_config`` / ``vision_config``).
Both spellings of the rotary settings are accepted: the older ``rope_theta`` + ``rope_scaling``
pair that released checkpoints ship, and transformers 5's ``rope_parameters``.

transformers does not check several relations that the forward pass relies on; :func:`validate`
does, and names the field at fault in a :class:`~engine.errors.CheckpointError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError


@dataclass(frozen=True)
class VisionConfig:
    """Vision tower hyper-parameters (Qwen3-VL model card / ``vision_config``)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class TextConfig:
    """Language-model hyper-parameters (``text_config``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    mrope_section: tuple[int, int, int]
    mrope_interleaved: bool = True
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """The whole Qwen3-VL configuration plus the special token ids the engine needs."""

    text: TextConfig
    vision: VisionConfig
    tie_word_embeddings: bool
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        """Build and validate a config from the parsed ``config.json``.

        Raises:
            CheckpointError: a required field is missing or the fields are inconsistent.
        """
        try:
            text = _text_config(cfg["text_config"])
            vision = _vision_config(cfg["vision_config"])
        except KeyError as exc:
            raise CheckpointError(f"config.json lacks the field {exc.args[0]!r}") from exc
        tie = cfg.get("tie_word_embeddings", cfg["text_config"].get("tie_word_embeddings", False))
        config = cls(
            text=text,
            vision=vision,
            tie_word_embeddings=bool(tie),
            image_token_id=cfg.get("image_token_id", 151655),
            video_token_id=cfg.get("video_token_id", 151656),
            vision_start_token_id=cfg.get("vision_start_token_id", 151652),
            vision_end_token_id=cfg.get("vision_end_token_id", 151653),
            raw=cfg,
        )
        validate(config)
        return config

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        """Read ``folder/config.json``.

        Raises:
            CheckpointError: the file is missing, not JSON, not a Qwen3-VL config, or inconsistent.
        """
        path = Path(folder) / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise CheckpointError(f"No config.json in {Path(folder)}") from exc
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
        if cfg.get("model_type") != "qwen3_vl":
            raise CheckpointError(
                f"{path} has model_type {cfg.get('model_type')!r}; Prism runs 'qwen3_vl' checkpoints"
            )
        return cls.from_dict(cfg)


def _rope_settings(cfg: dict) -> tuple[float, dict]:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta"))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ("default", "axial"):
        raise CheckpointError(f"rope_type {rope_type!r} is not supported (only 'default')")
    return theta, merged


def _text_config(t: dict) -> TextConfig:
    theta, rope = _rope_settings(t)
    if theta is None:
        raise CheckpointError("text_config lacks rope_theta (in rope_parameters or rope_scaling)")
    heads = t["num_attention_heads"]
    section = rope.get("mrope_section")
    if section is None:
        raise CheckpointError("text_config lacks mrope_section (in rope_parameters or rope_scaling)")
    return TextConfig(
        vocab_size=t["vocab_size"],
        hidden_size=t["hidden_size"],
        intermediate_size=t["intermediate_size"],
        num_hidden_layers=t["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=t.get("num_key_value_heads") or heads,
        head_dim=t.get("head_dim") or t["hidden_size"] // heads,
        max_position_embeddings=t.get("max_position_embeddings", 128000),
        rope_theta=float(theta),
        mrope_section=tuple(section),
        mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
        rms_norm_eps=t.get("rms_norm_eps", 1e-6),
        hidden_act=t.get("hidden_act", "silu"),
        attention_bias=bool(t.get("attention_bias", False)),
    )


def _vision_config(v: dict) -> VisionConfig:
    theta, _ = _rope_settings(v)
    return VisionConfig(
        depth=v["depth"],
        hidden_size=v["hidden_size"],
        num_heads=v["num_heads"],
        intermediate_size=v["intermediate_size"],
        out_hidden_size=v["out_hidden_size"],
        hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"),
        in_channels=v.get("in_channels", 3),
        patch_size=v.get("patch_size", 16),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        num_position_embeddings=v.get("num_position_embeddings", 2304),
        deepstack_visual_indexes=tuple(v.get("deepstack_visual_indexes", ())),
        rope_theta=float(theta if theta is not None else 10000.0),
    )


def validate(config: ModelConfig) -> None:
    """Check the relations between fields that the forward pass relies on.

    Raises:
        CheckpointError: naming the first inconsistent field.
    """
    t, v = config.text, config.vision
    if t.num_attention_heads % t.num_key_value_heads:
        raise CheckpointError(
            f"text_config.num_attention_heads ({t.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({t.num_key_value_heads})"
        )
    if len(t.mrope_section) != 3 or sum(t.mrope_section) != t.head_dim // 2:
        raise CheckpointError(
            f"text_config mrope_section {list(t.mrope_section)} must have 3 entries summing to "
            f"head_dim/2 = {t.head_dim // 2}"
        )
    for index in v.deepstack_visual_indexes:
        if not 0 <= index < v.depth:
            raise CheckpointError(
                f"vision_config.deepstack_visual_indexes entry {index} is outside the vision depth {v.depth}"
            )
    if len(v.deepstack_visual_indexes) > t.num_hidden_layers:
        raise CheckpointError(
            f"vision_config.deepstack_visual_indexes has {len(v.deepstack_visual_indexes)} entries but the "
            f"text model has only {t.num_hidden_layers} layers"
        )
    if v.out_hidden_size != t.hidden_size:
        raise CheckpointError(
            f"vision_config.out_hidden_size ({v.out_hidden_size}) must equal text_config.hidden_size "
            f"({t.hidden_size})"
        )
    if v.hidden_size % v.num_heads or v.head_dim % 4:
        raise CheckpointError(
            f"vision_config.hidden_size ({v.hidden_size}) must split into num_heads ({v.num_heads}) heads "
            "whose size is a multiple of 4"
        )
    if int(v.num_position_embeddings**0.5) ** 2 != v.num_position_embeddings:
        raise CheckpointError(
            f"vision_config.num_position_embeddings ({v.num_position_embeddings}) must be a square number"
        )
