"""Checkpoint loading: shards, clear errors for broken checkpoints, the Hugging Face cache,
the processor, tied and untied LM heads."""

from __future__ import annotations

import json
import os
import pathlib
import socket

import pytest
import torch
from conftest import TEST_DEVICE
from safetensors.torch import load_file, save_file
from transformers import AutoProcessor, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

from engine import CheckpointError, Engine
from engine.model.qwen3_vl import load_model

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _clone(ckpt: pathlib.Path, dest: pathlib.Path, *, weights: bool = False) -> pathlib.Path:
    """``dest`` with links to every file of ``ckpt`` (the weights file too when ``weights``)."""
    dest.mkdir()
    for f in ckpt.iterdir():
        if f.name != WEIGHTS or weights:
            (dest / f.name).symlink_to(f)
    return dest


def _with_tensors(ckpt: pathlib.Path, dest: pathlib.Path, tensors: dict) -> pathlib.Path:
    _clone(ckpt, dest)
    save_file(tensors, str(dest / WEIGHTS), metadata={"format": "pt"})
    return dest


def _hf_to_ours(name: str) -> str:
    """transformers' parameter names -> ours (written out here, independently of engine.model)."""
    for theirs, ours in (("model.visual.", "visual."), ("model.language_model.", "language_model.")):
        if name.startswith(theirs):
            return ours + name[len(theirs) :]
    return name


@pytest.fixture(scope="module")
def tiny_tensors(tiny_ckpt) -> dict:
    return load_file(str(tiny_ckpt / WEIGHTS))


@pytest.fixture(scope="module")
def tiny_model(tiny_ckpt):
    return load_model(tiny_ckpt, progress=False)


# ------------------------------------------------------------------------------------------------
# shards
# ------------------------------------------------------------------------------------------------


def test_sharded_checkpoint_loads_like_the_single_file(tiny_ckpt, tiny_tensors, tiny_model, tmp_path):
    folder = _clone(tiny_ckpt, tmp_path / "sharded")
    names = sorted(tiny_tensors)
    # three shards of interleaved names, so every module has tensors in several files
    shards = {f"model-{i + 1:05d}-of-00003.safetensors": names[i::3] for i in range(3)}
    weight_map = {}
    for shard, members in shards.items():
        save_file({n: tiny_tensors[n] for n in members}, str(folder / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(members, shard))
    total = sum(t.numel() * t.element_size() for t in tiny_tensors.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    assert not (folder / WEIGHTS).exists()

    sharded = load_model(folder, progress=False)
    ours_single = dict(tiny_model.named_parameters())
    ours_sharded = dict(sharded.named_parameters())
    assert ours_sharded.keys() == ours_single.keys()
    for name, param in ours_single.items():
        assert torch.equal(ours_sharded[name], param), name

    # and transformers' load of the same shards holds the same numbers
    hf = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    hf_params = {_hf_to_ours(n): p for n, p in hf.named_parameters()}
    assert hf_params.keys() <= ours_sharded.keys()
    for name, param in hf_params.items():
        assert torch.equal(ours_sharded[name], param), name


def test_index_naming_a_missing_shard(tiny_ckpt, tiny_tensors, tmp_path):
    folder = _clone(tiny_ckpt, tmp_path / "ckpt")
    save_file(tiny_tensors, str(folder / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = dict.fromkeys(tiny_tensors, "model-00001-of-00002.safetensors")
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_model(folder, progress=False)


# ------------------------------------------------------------------------------------------------
# broken checkpoints
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "removed",
    [
        "model.language_model.layers.1.mlp.up_proj.weight",
        "model.visual.blocks.2.attn.qkv.bias",
        "model.visual.deepstack_merger_list.1.norm.weight",
    ],
)
def test_missing_tensor_is_named(tiny_ckpt, tiny_tensors, tmp_path, removed):
    assert removed in tiny_tensors
    folder = _with_tensors(tiny_ckpt, tmp_path / "ckpt", {n: t for n, t in tiny_tensors.items() if n != removed})
    with pytest.raises(CheckpointError) as info:
        load_model(folder, progress=False)
    message = str(info.value)
    assert "missing" in message and removed in message and str(folder) in message


def _flat_layout(name: str) -> str:
    """The older flat names some exports use: ``visual.*``, ``model.*`` (decoder), ``lm_head.*``."""
    for new, old in (("model.visual.", "visual."), ("model.language_model.", "model.")):
        if name.startswith(new):
            return old + name[len(new) :]
    return name


def test_flat_layout_loads_and_names_missing_tensors_its_way(tiny_ckpt, tiny_tensors, tiny_model, tmp_path):
    flat = {_flat_layout(n): t for n, t in tiny_tensors.items()}
    model = load_model(_with_tensors(tiny_ckpt, tmp_path / "flat", flat), progress=False)
    for name, param in tiny_model.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name], param), name
    removed = "model.layers.0.self_attn.q_norm.weight"
    folder = _with_tensors(tiny_ckpt, tmp_path / "flat-missing", {n: t for n, t in flat.items() if n != removed})
    with pytest.raises(CheckpointError, match=rf"missing tensors: {removed}"):
        load_model(folder, progress=False)


def test_unknown_tensor_is_named(tiny_ckpt, tiny_tensors, tmp_path):
    extra = "model.language_model.layers.0.mlp.extra_proj.weight"
    folder = _with_tensors(tiny_ckpt, tmp_path / "ckpt", {**tiny_tensors, extra: torch.zeros(4, 4)})
    with pytest.raises(CheckpointError) as info:
        load_model(folder, progress=False)
    assert "unknown" in str(info.value) and extra in str(info.value)


def test_wrong_shape_is_named(tiny_ckpt, tiny_tensors, tmp_path):
    name = "model.language_model.layers.2.self_attn.k_proj.weight"
    bad = {**tiny_tensors, name: torch.zeros(3, 64)}
    folder = _with_tensors(tiny_ckpt, tmp_path / "ckpt", bad)
    with pytest.raises(CheckpointError, match=rf"{name} \(3, 64\)"):
        load_model(folder, progress=False)


def test_tied_checkpoint_that_also_stores_lm_head_loads(tiny_ckpt, tiny_tensors, tiny_model, tmp_path):
    """Some tied exports store lm_head.weight too; it is the embedding and is not an error."""
    embed = tiny_tensors["model.language_model.embed_tokens.weight"]
    folder = _with_tensors(tiny_ckpt, tmp_path / "ckpt", {**tiny_tensors, "lm_head.weight": embed.clone()})
    model = load_model(folder, progress=False)
    assert model.lm_head.weight is model.language_model.embed_tokens.weight


def test_missing_config_names_the_folder(tiny_ckpt, tmp_path):
    folder = _clone(tiny_ckpt, tmp_path / "no-config", weights=True)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json") as info:
        Engine.from_pretrained(folder, device="cpu", progress=False)
    assert str(folder) in str(info.value)


def test_missing_weights_names_the_folder(tiny_ckpt, tmp_path):
    folder = _clone(tiny_ckpt, tmp_path / "no-weights")
    with pytest.raises(CheckpointError, match="model.safetensors") as info:
        Engine.from_pretrained(folder, device="cpu", progress=False)
    assert str(folder) in str(info.value)


def test_missing_folder_is_named(tmp_path):
    folder = tmp_path / "does-not-exist"
    with pytest.raises(CheckpointError) as info:
        Engine.from_pretrained(folder, device="cpu", progress=False)
    assert str(folder) in str(info.value)


def test_uncached_model_id_offline_names_the_hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    # any attempt to reach the network fails at once (and is recorded) instead of hanging
    attempts = []

    def no_network(sock, address, *args, **kwargs):
        attempts.append(address)
        raise OSError("network disabled by test_loading")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", lambda address, *a, **k: no_network(None, address))

    with pytest.raises(CheckpointError) as info:
        Engine.from_pretrained("not-a-folder/nor-cached-model-xyz", device="cpu", progress=False)
    message = str(info.value)
    assert str(cache) in message and "not-a-folder/nor-cached-model-xyz" in message
    assert attempts == []
    assert os.environ["HF_HUB_OFFLINE"] == "1"


# ------------------------------------------------------------------------------------------------
# processor, tied and untied heads
# ------------------------------------------------------------------------------------------------


def test_processor_is_a_real_qwen3vl_processor(tiny_ckpt):
    engine = Engine.from_pretrained(tiny_ckpt, device=TEST_DEVICE, progress=False, kv_cache_bytes=8 << 20)
    try:
        proc = engine.processor
        assert isinstance(proc, Qwen3VLProcessor)
        assert type(proc) is type(AutoProcessor.from_pretrained(tiny_ckpt))
        assert type(proc.image_processor).__name__.startswith("Qwen2VLImageProcessor")
        assert type(proc.video_processor).__name__ == "Qwen3VLVideoProcessor"
        assert proc.tokenizer is engine.tokenizer
        assert proc.tokenizer.convert_tokens_to_ids("<|image_pad|>") == engine.config.image_token_id
        assert proc.tokenizer.convert_tokens_to_ids("<|video_pad|>") == engine.config.video_token_id
        assert proc.chat_template
    finally:
        engine.close()


def test_test_preset_ties_lm_head_to_the_embedding(tiny_ckpt, tiny_tensors, tiny_model):
    assert "lm_head.weight" not in tiny_tensors
    hf = Qwen3VLForConditionalGeneration.from_pretrained(tiny_ckpt, dtype=torch.float32)
    assert hf.config.tie_word_embeddings  # transformers reads the checkpoint as tied too
    head, embed = tiny_model.lm_head.weight, tiny_model.language_model.embed_tokens.weight
    assert head is embed and head.data_ptr() == embed.data_ptr()
    assert torch.equal(head, tiny_tensors["model.language_model.embed_tokens.weight"])
    assert torch.equal(head, hf.lm_head.weight)


def test_demo_preset_loads_its_own_lm_head(demo_ckpt):
    tensors = load_file(str(demo_ckpt / WEIGHTS))
    assert "lm_head.weight" in tensors
    model = load_model(demo_ckpt, dtype=torch.bfloat16, progress=False)
    head, embed = model.lm_head.weight, model.language_model.embed_tokens.weight
    assert head is not embed and head.data_ptr() != embed.data_ptr()
    assert torch.equal(head, tensors["lm_head.weight"])
    assert torch.equal(embed, tensors["model.language_model.embed_tokens.weight"])
    assert not torch.equal(head, embed)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(demo_ckpt, dtype=torch.bfloat16)
    assert not hf.config.tie_word_embeddings
    assert torch.equal(head, hf.lm_head.weight)
