"""The probe model's settings and its Hugging Face checkpoint folder.

The probe is engine.tiny's ``demo`` preset narrowed by :data:`PROBE_OVERRIDES`: tied embeddings,
text hidden 128 (the 151,936 x 128 embedding is most of its ~22 M parameters), 4 decoder layers, a
4-block vision tower of width 128 and a 16 x 16 learned position table (the suite's 256 x 256
images have exactly a 16 x 16 patch grid). Weights are stored in bfloat16.

A checkpoint folder holds what :func:`engine.tiny.build_tiny_checkpoint` writes (config, generation
config, processor configs, the real Qwen BPE tokenizer files, the chat template) with the trained
weights in place of random ones, in safetensors shards of at most 15 MiB each where tensors allow
(the embedding alone is 37 MiB and gets a shard of its own) plus ``model.safetensors.index.json``.

The GPU machine has no network and no ``dashscope`` package, so the files that need the tokenizer
ranks are built here first (:func:`write_skeleton`) and carried along; the trainer adds the
weights. A device returns files of at most 16 MiB, so :func:`split_for_transfer` cuts large files
into parts and :func:`join_parts` glues them back (checking SHA-256).

Command line::

    python -m benchmarks.quality.checkpoint skeleton DIR      # config + tokenizer files, no weights
    python -m benchmarks.quality.checkpoint skeleton DIR --vision-width 160   # ... of another size
    python -m benchmarks.quality.checkpoint join PARTS DIR    # parts (+ skeleton in DIR) -> checkpoint
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import pathlib
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from engine.model import tiny

#: Overrides of engine.tiny's "demo" preset that make the probe model.
PROBE_OVERRIDES: dict[str, Any] = {
    "dtype": "bfloat16",
    "tie_word_embeddings": True,
    "text_config": {
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 8192,
        # 16 rotary frequencies interleaved T H W: 6 temporal, 5 height, 5 width
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [6, 5, 5], "rope_type": "default"},
    },
    "vision_config": {
        "depth": 4,
        "hidden_size": 128,
        "intermediate_size": 512,
        "num_heads": 4,
        "out_hidden_size": 128,
        "num_position_embeddings": 256,
        "deepstack_visual_indexes": [1, 2],
    },
}

#: A toy-sized variant for CPU smoke tests of the trainer.
TOY_OVERRIDES: dict[str, Any] = {
    "dtype": "float32",
    "tie_word_embeddings": True,
    "text_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                    "num_key_value_heads": 1, "head_dim": 16,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default"}},
    "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32,
                      "num_position_embeddings": 256, "deepstack_visual_indexes": [0]},
}

#: The committed probe folder must stay within this on disk (issue 35).
PROBE_BUDGET_BYTES = 50 << 20

#: Skeleton files the committed probe folder leaves out (the fast tokenizer needs only tokenizer.json).
UNCOMMITTED_FILES = ("vocab.json", "merges.txt")

#: Bytes :func:`projected_bytes` allows per tensor for the safetensors headers and the index, and
#: for the training metrics the folder also carries.
_PER_TENSOR_BYTES = 256
_METRICS_BYTES = 64 << 10

SHARD_BYTES = 15 << 20
INDEX_FILE = "model.safetensors.index.json"
_WEIGHT_SUFFIX = ".safetensors"


def probe_spec(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The resolved preset (see :func:`engine.tiny.resolve_preset`) of the probe, or of ``demo``
    with other ``overrides`` (e.g. :data:`TOY_OVERRIDES`)."""
    return tiny.resolve_preset("demo", PROBE_OVERRIDES if overrides is None else overrides)


def size_overrides(base: Mapping[str, Any] | None = None, *, vision_width: int | None = None,
                   vision_depth: int | None = None, vision_mlp: int | None = None, vision_heads: int | None = None,
                   deepstack: Sequence[int] | None = None, text_layers: int | None = None,
                   text_mlp: int | None = None) -> dict[str, Any]:
    """``base`` (default :data:`PROBE_OVERRIDES`) with other sizes of the vision tower and decoder.

    The text width stays (the vision tower's ``out_hidden_size`` must equal it, and the tied
    151,936-row embedding is most of the 50 MiB budget). With a new ``vision_width`` and no
    ``vision_heads``, heads of 32 channels are used when the width is a multiple of 32, else the
    base's head count. None leaves a setting as it is. The result is checked by
    :func:`probe_spec` (engine.tiny's consistency checks).

    Args:
        vision_width: vision hidden size (channels per patch).
        vision_depth: vision blocks; ``deepstack`` (DeepStack tap layers) must lie below it.
        vision_mlp: vision MLP width.
        text_layers: decoder layers (at least as many as DeepStack taps).
        text_mlp: decoder MLP width.
    """
    out = copy.deepcopy(dict(PROBE_OVERRIDES if base is None else base))
    vision = out.setdefault("vision_config", {})
    text = out.setdefault("text_config", {})
    if vision_width is not None:
        vision["hidden_size"] = vision_width
        if vision_heads is None:
            vision["num_heads"] = vision_width // 32 if vision_width % 32 == 0 else vision.get("num_heads", 4)
    for key, value in (("num_heads", vision_heads), ("depth", vision_depth), ("intermediate_size", vision_mlp),
                       ("deepstack_visual_indexes", None if deepstack is None else list(deepstack))):
        if value is not None:
            vision[key] = value
    for key, value in (("num_hidden_layers", text_layers), ("intermediate_size", text_mlp)):
        if value is not None:
            text[key] = value
    return out


def projected_bytes(spec: Mapping[str, Any], skeleton: str | os.PathLike[str] | None = None) -> int:
    """Bytes the committed folder of a model with settings ``spec`` would take on disk: the
    weights in bfloat16 (plus header and index room per tensor), the skeleton's files but
    :data:`UNCOMMITTED_FILES` (``skeleton``'s sizes; without one, the committed probe's), and room
    for the training metrics. Compare with :data:`PROBE_BUDGET_BYTES`."""
    import math

    shapes = tiny.tensor_shapes(spec)
    weights = sum(2 * math.prod(shape) + _PER_TENSOR_BYTES for shape in shapes.values())
    folder = pathlib.Path(skeleton) if skeleton is not None else pathlib.Path(__file__).parent / "probe"
    files = sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and not _is_weight_file(p.name)
                and p.name not in UNCOMMITTED_FILES and p.name != "training_metrics.json")
    return weights + files + _METRICS_BYTES


def add_size_arguments(parser: argparse.ArgumentParser) -> None:
    """The size options (``--vision-width`` ...) of the trainer and of ``checkpoint skeleton``."""
    g = parser.add_argument_group("model size (default: the committed probe's; see size_overrides)")
    g.add_argument("--vision-width", type=int, help="vision hidden size (probe: 128)")
    g.add_argument("--vision-depth", type=int, help="vision blocks (probe: 4)")
    g.add_argument("--vision-mlp", type=int, help="vision MLP width (probe: 512)")
    g.add_argument("--vision-heads", type=int, help="vision heads (default: width / 32 when it divides)")
    g.add_argument("--deepstack", help="DeepStack tap layers, comma-separated (probe: 1,2)")
    g.add_argument("--text-layers", type=int, help="decoder layers (probe: 4)")
    g.add_argument("--text-mlp", type=int, help="decoder MLP width (probe: 384)")


def overrides_from_args(args: argparse.Namespace, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """:func:`size_overrides` of ``base`` with the options :func:`add_size_arguments` added."""
    deepstack = None if args.deepstack is None else [int(x) for x in str(args.deepstack).split(",") if x.strip()]
    return size_overrides(base, vision_width=args.vision_width, vision_depth=args.vision_depth,
                          vision_mlp=args.vision_mlp, vision_heads=args.vision_heads, deepstack=deepstack,
                          text_layers=args.text_layers, text_mlp=args.text_mlp)


def write_skeleton(folder: str | os.PathLike[str], spec: Mapping[str, Any] | None = None) -> pathlib.Path:
    """Write every file of a checkpoint but the weights into ``folder`` (created if needed).

    Raises:
        engine.errors.CheckpointError: the Qwen tokenizer ranks (``dashscope``) are not installed
            and the tokenizer files are not cached yet.
    """
    spec = probe_spec() if spec is None else spec
    out = pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    write_config(out, spec)
    _write_json(out / "generation_config.json", tiny.GENERATION_CONFIG)
    _write_json(out / "preprocessor_config.json", tiny.IMAGE_PROCESSOR_CONFIG)
    _write_json(out / "video_preprocessor_config.json", tiny.VIDEO_PROCESSOR_CONFIG)
    _write_json(out / "tokenizer_config.json", tiny.tokenizer_config())
    (out / "chat_template.jinja").write_text(tiny.CHAT_TEMPLATE, encoding="utf-8")
    tokenizer_files = tiny.cached_tokenizer_files()
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        shutil.copyfile(tokenizer_files / name, out / name)
    return out


def write_config(folder: str | os.PathLike[str], spec: Mapping[str, Any]) -> pathlib.Path:
    """Write ``config.json`` for the resolved settings ``spec`` into ``folder`` (replacing a
    skeleton's, so a run with size overrides saves its own)."""
    path = pathlib.Path(folder) / "config.json"
    _write_json(path, tiny.config_dict(spec))
    return path


def copy_skeleton(skeleton: str | os.PathLike[str], folder: str | os.PathLike[str]) -> pathlib.Path:
    """Copy a skeleton's files (everything but weights) into ``folder``."""
    out = pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for path in pathlib.Path(skeleton).iterdir():
        if path.is_file() and not _is_weight_file(path.name):
            shutil.copyfile(path, out / path.name)
    return out


def save_weights(state: Mapping[str, torch.Tensor], folder: str | os.PathLike[str], *,
                 dtype: torch.dtype = torch.bfloat16, shard_bytes: int = SHARD_BYTES) -> list[pathlib.Path]:
    """Write ``state`` (checkpoint names -> tensors) as safetensors shards plus the index.

    Tensors are cast to ``dtype`` and packed in name order into shards of at most ``shard_bytes``
    (a larger tensor gets a shard of its own); files are written under temporary names and renamed,
    so a reader never sees half a checkpoint. Earlier shards in ``folder`` are removed.

    Returns:
        the shard paths.
    """
    from safetensors.torch import save_file

    out = pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        tensor = state[name].detach().to("cpu", dtype).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}{_WEIGHT_SUFFIX}" for i in range(len(shards))]
    for old in out.glob(f"model*{_WEIGHT_SUFFIX}"):
        if old.name not in names:
            old.unlink()
    weight_map, total = {}, 0
    for name, shard in zip(names, shards, strict=True):
        tmp = out / (name + ".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, 0o644)
        os.replace(tmp, out / name)
        for key, t in shard.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
    _write_json(out / (INDEX_FILE + ".tmp"), {"metadata": {"total_size": total}, "weight_map": weight_map})
    os.replace(out / (INDEX_FILE + ".tmp"), out / INDEX_FILE)
    return [out / n for n in names]


def load_weights(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder's safetensors files (sharded or not), as stored."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in sorted(pathlib.Path(folder).glob(f"*{_WEIGHT_SUFFIX}")):
        state.update(load_file(str(path)))
    return state


def split_for_transfer(folder: str | os.PathLike[str], dest: str | os.PathLike[str], *,
                       part_bytes: int = SHARD_BYTES) -> dict[str, str]:
    """Copy the weights of ``folder`` (its safetensors files and their index) and its
    ``config.json`` (the model's size, which a size override changes) into ``dest``, files over
    ``part_bytes`` cut into ``NAME.partNN``; the other files are rebuilt by :func:`write_skeleton`.

    Returns:
        ``{file name: sha256 hex}`` of the whole files (also written to ``dest/sha256.json``).
    """
    src, out = pathlib.Path(folder), pathlib.Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    digests = {}
    carried = sorted(p for p in src.iterdir() if p.is_file() and (_is_weight_file(p.name) or p.name == "config.json"))
    for path in carried:
        data = path.read_bytes()
        digests[path.name] = hashlib.sha256(data).hexdigest()
        for old in out.glob(path.name + ".part*"):
            old.unlink()
        if len(data) <= part_bytes:
            (out / path.name).write_bytes(data)
            continue
        (out / path.name).unlink(missing_ok=True)
        for i in range(0, len(data), part_bytes):
            (out / f"{path.name}.part{i // part_bytes:02d}").write_bytes(data[i:i + part_bytes])
    _write_json(out / "sha256.json", digests)
    return digests


def join_parts(parts: str | os.PathLike[str], folder: str | os.PathLike[str]) -> pathlib.Path:
    """Reassemble what :func:`split_for_transfer` wrote into ``folder`` and check the digests.

    Raises:
        ValueError: a reassembled file does not match its recorded SHA-256.
    """
    src, out = pathlib.Path(parts), pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    digests = json.loads((src / "sha256.json").read_text())
    for name, digest in digests.items():
        pieces = sorted(src.glob(name + ".part*")) or [src / name]
        data = b"".join(p.read_bytes() for p in pieces)
        if hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"{name}: reassembled bytes do not match the recorded sha256")
        (out / name).write_bytes(data)
    return out


def _is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIX) or name == INDEX_FILE


def _write_json(path: pathlib.Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quality.checkpoint")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sk = sub.add_parser("skeleton", help="write config, processor and tokenizer files (no weights)")
    sk.add_argument("folder")
    add_size_arguments(sk)
    jn = sub.add_parser("join", help="reassemble transferred parts into a checkpoint folder")
    jn.add_argument("parts")
    jn.add_argument("folder")
    args = parser.parse_args(argv)
    if args.cmd == "skeleton":
        print(write_skeleton(args.folder, probe_spec(overrides_from_args(args))))
    else:
        print(join_parts(args.parts, args.folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
