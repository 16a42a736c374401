"""Tests of engine.tiny: tiny Qwen3-VL checkpoints that transformers loads like real ones."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import unicodedata

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from engine.errors import CheckpointError
from engine.model import qwen_tokenizer, tiny

# The real Qwen3-VL added tokens, written out independently of engine.tiny's table.
REAL_ADDED_TOKEN_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|fim_prefix|>": 151659,
    "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661,
    "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663,
    "<|file_sep|>": 151664,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}

SAMPLE_TEXTS = [
    "Hello world",
    "你好，世界",
    "def f(x): return x**2",
    "  leading spaces,\ttabs\n\n\nand   runs   of   spaces   ",
    "Numbers 1234567890 and 3.14159, dates 2025-11-29.",
    "Emoji 🚀🌍👩‍🚀 and symbols ©®™ — “quotes” …",
    "Ünïcödé: café naïve façade (composed) and cafe\u0301 (decomposed)",
    "日本語のテキストです。한국어 텍스트. Русский текст. النص العربي",
    "I'm sure you'll see they've done it, hasn't he? DON'T SHOUT",
    '<html><body class="x">&nbsp;</body></html>\r\n{"key": [1, 2, {"a": null}]}',
]


@contextlib.contextmanager
def transformers_warnings():
    """Collect the warnings transformers logs (it does not propagate to pytest's caplog)."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Collect(level=logging.WARNING)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


@pytest.fixture(scope="module")
def processor(tiny_ckpt):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_ckpt, local_files_only=True)


@pytest.fixture(scope="module")
def hf_model(tiny_ckpt):
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_ckpt, local_files_only=True)
    return model.eval()


def _meta_state_dict_shapes(config) -> dict[str, tuple[int, ...]]:
    """Names and shapes transformers' Qwen3VLForConditionalGeneration saves for ``config``."""
    from transformers import Qwen3VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


# ------------------------------------------------------------------------------------------
# files and configs
# ------------------------------------------------------------------------------------------


def test_files_written(tiny_ckpt):
    names = {p.name for p in tiny_ckpt.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "merges.txt",
    }
    config = json.loads((tiny_ckpt / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl"
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert (config["image_token_id"], config["video_token_id"]) == (151655, 151656)
    assert (config["vision_start_token_id"], config["vision_end_token_id"]) == (151652, 151653)
    assert config["tie_word_embeddings"] is True


def test_config_round_trips_through_transformers(tiny_ckpt):
    from transformers import Qwen3VLConfig

    config = Qwen3VLConfig.from_pretrained(tiny_ckpt)
    text, vision = config.text_config, config.vision_config
    assert config.tie_word_embeddings is True
    assert (text.hidden_size, text.num_hidden_layers, text.intermediate_size) == (64, 3, 128)
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (4, 2, 16)
    assert text.vocab_size == 151936
    assert text.hidden_act == "silu"
    assert text.rope_parameters["rope_theta"] == 5_000_000
    assert text.rope_parameters["mrope_section"] == [4, 2, 2]
    assert text.rope_parameters["mrope_interleaved"] is True
    assert (vision.depth, vision.hidden_size, vision.num_heads, vision.intermediate_size) == (4, 32, 2, 64)
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size) == (16, 2, 2)
    assert vision.out_hidden_size == text.hidden_size
    assert list(vision.deepstack_visual_indexes) == [1, 2]
    assert vision.num_position_embeddings == 2304
    assert vision.hidden_act == "gelu_pytorch_tanh"


def test_generation_config(tiny_ckpt):
    from transformers import GenerationConfig

    gen = GenerationConfig.from_pretrained(tiny_ckpt)
    assert gen.eos_token_id == [151645, 151643]
    assert gen.pad_token_id == 151643
    assert gen.bos_token_id == 151643


def test_rope_parameters_spelling_override(tmp_path):
    """A None override drops a key, so tests can write transformers 5's rope_parameters spelling."""
    from transformers import Qwen3VLConfig

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    overrides = {"text_config": {"rope_scaling": None, "rope_theta": None, "rope_parameters": rope}}
    spec = tiny.resolve_preset("test", overrides)
    text = tiny.config_dict(spec)["text_config"]
    assert "rope_scaling" not in text and "rope_theta" not in text
    (tmp_path / "config.json").write_text(json.dumps(tiny.config_dict(spec)))
    assert Qwen3VLConfig.from_pretrained(tmp_path).text_config.rope_parameters["rope_theta"] == 1e6


# ------------------------------------------------------------------------------------------
# weights
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("test", None),
        ("demo", None),
        (
            "test",
            {
                "text_config": {"num_hidden_layers": 5},
                "vision_config": {"depth": 5, "deepstack_visual_indexes": [1, 3]},
            },
        ),
        ("test", {"text_config": {"attention_bias": True}, "tie_word_embeddings": False}),
    ],
)
def test_tensor_names_and_shapes_match_transformers(preset, overrides):
    from transformers import Qwen3VLConfig

    spec = tiny.resolve_preset(preset, overrides)
    config = Qwen3VLConfig(**tiny.config_dict(spec))
    assert tiny.tensor_shapes(spec) == _meta_state_dict_shapes(config)


def test_transformers_loads_without_missing_or_unexpected_keys(tiny_ckpt):
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    with transformers_warnings() as warned:
        AutoProcessor.from_pretrained(tiny_ckpt)
        model, info = Qwen3VLForConditionalGeneration.from_pretrained(tiny_ckpt, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and info["error_msgs"] == []
    assert [r.getMessage() for r in warned] == []
    assert model.dtype == torch.float32
    # tied: lm_head shares the embedding table, which the file stores once
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    with safe_open(tiny_ckpt / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert "lm_head.weight" not in f.keys()


def test_demo_checkpoint_is_untied_bfloat16(demo_ckpt):
    from transformers import Qwen3VLForConditionalGeneration

    with safe_open(demo_ckpt / "model.safetensors", "pt") as f:
        assert "lm_head.weight" in f.keys()
        assert f.get_slice("lm_head.weight").get_dtype() == "BF16"
    model, info = Qwen3VLForConditionalGeneration.from_pretrained(
        demo_ckpt, dtype=torch.float32, output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert model.config.tie_word_embeddings is False
    assert not torch.equal(model.lm_head.weight, model.model.language_model.embed_tokens.weight)


def test_weights_are_deterministic_and_seeded():
    spec = tiny.resolve_preset("test")
    a, b, c = tiny.random_weights(spec, 0), tiny.random_weights(spec, 0), tiny.random_weights(spec, 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.visual.merger.linear_fc1.weight"], c["model.visual.merger.linear_fc1.weight"])
    # a tensor's values do not depend on which other tensors exist
    deeper = tiny.random_weights(tiny.resolve_preset("test", {"text_config": {"num_hidden_layers": 4}}), 0)
    name = "model.language_model.layers.2.mlp.down_proj.weight"
    assert torch.equal(a[name], deeper[name])
    # no all-zero biases or all-one norms that would hide a missing bias or norm
    assert a["model.visual.blocks.0.attn.qkv.bias"].std() > 0.05
    assert a["model.language_model.layers.0.input_layernorm.weight"].std() > 0.05


# ------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------


def test_auto_processor_is_qwen3vl_processor(processor):
    from transformers import Qwen3VLProcessor

    assert type(processor) is Qwen3VLProcessor
    assert type(processor.tokenizer).__name__ == "Qwen2Tokenizer"
    assert type(processor.image_processor).__name__.startswith("Qwen2VLImageProcessor")
    assert type(processor.video_processor).__name__ == "Qwen3VLVideoProcessor"
    for sub in (processor.image_processor, processor.video_processor):
        assert (sub.patch_size, sub.merge_size, sub.temporal_patch_size) == (16, 2, 2)
        assert list(sub.image_mean) == [0.5, 0.5, 0.5] and list(sub.image_std) == [0.5, 0.5, 0.5]
    assert processor.image_processor.size == {"shortest_edge": 65536, "longest_edge": 16777216}
    assert processor.video_processor.size == {"shortest_edge": 4096, "longest_edge": 25165824}


def test_special_token_ids(processor):
    tok = processor.tokenizer
    assert len(tok) == 151669
    for content, token_id in REAL_ADDED_TOKEN_IDS.items():
        assert tok.convert_tokens_to_ids(content) == token_id, content
        assert tok.encode(content, add_special_tokens=False) == [token_id], content
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 151645)
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 151643)
    assert tok.bos_token is None
    assert (processor.image_token_id, processor.video_token_id) == (151655, 151656)
    # special tokens vanish with skip_special_tokens, the tool/think tokens stay (as in Qwen3)
    ids = tok.encode("<|im_start|>a<think>b</think><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>b</think>"


def test_known_token_ids(processor):
    tok = processor.tokenizer
    assert tok.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    assert tok.encode("<|im_start|>user\n", add_special_tokens=False) == [151644, 872, 198]
    assert tok.encode("你好，世界", add_special_tokens=False) == [108386, 3837, 99489]
    # single digits, as Qwen2's pre-tokenizer splits numbers
    assert tok.encode("12345", add_special_tokens=False) == [16, 17, 18, 19, 20]


def _rank_bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """Plain BPE straight from the tiktoken ranks: merge the lowest-ranked adjacent pair first."""
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        pairs = [(ranks.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1)]
        pairs = [(r, i) for r, i in pairs if r is not None]
        if not pairs:
            break
        _, i = min(pairs)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return [ranks[p] for p in parts]


def test_bpe_agrees_with_tiktoken_ranks(processor):
    """The recovered merges tokenize like BPE over the original ranks, and decode round-trips."""
    import regex

    ranks = {}
    for line in qwen_tokenizer.qwen_tiktoken_path().read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    tok = processor.tokenizer
    for text in SAMPLE_TEXTS:
        normal = unicodedata.normalize("NFC", text)
        expected = [
            i for piece in regex.findall(qwen_tokenizer.QWEN2_SPLIT_PATTERN, normal)
            for i in _rank_bpe(piece.encode(), ranks)
        ]
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == expected, text
        assert tok.decode(ids) == normal


def test_tokenizer_cache_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path))
    first = qwen_tokenizer.cached_tokenizer_files()
    assert first.parent == tmp_path / "tokenizer"
    stamp = (first / "tokenizer.json").stat().st_mtime_ns
    assert qwen_tokenizer.cached_tokenizer_files() == first
    assert (first / "tokenizer.json").stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging folders left


def test_missing_dashscope_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(qwen_tokenizer.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps dashscope"):
        tiny.build_tiny_checkpoint(tmp_path / "x")


# ------------------------------------------------------------------------------------------
# chat template and processor
# ------------------------------------------------------------------------------------------


def test_chat_template_exact(processor):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "An astronaut."},
        {"role": "user", "content": [{"type": "text", "text": "And the flag?"}]},
    ]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\nAn astronaut.<|im_end|>\n"
        "<|im_start|>user\nAnd the flag?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # no default system prompt, no generation prompt unless asked
    plain = processor.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"
    # the tokenizer carries the same template
    assert processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == rendered


def test_chat_template_videos_and_vision_ids(processor):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "video", "video": "clip.mp4"},
                {"image_url": {"url": "http://x/y.png"}, "type": "image_url"},
                {"type": "text", "text": "Compare."},
            ],
        }
    ]
    rendered = processor.apply_chat_template(messages, tokenize=False, add_vision_id=True)
    assert rendered == (
        "<|im_start|>user\n"
        "Picture 1: <|vision_start|><|image_pad|><|vision_end|>"
        "Video 1: <|vision_start|><|video_pad|><|vision_end|>"
        "Picture 2: <|vision_start|><|image_pad|><|vision_end|>"
        "Compare.<|im_end|>\n"
    )


def _two_image_inputs(processor, media_path):
    img1 = Image.open(media_path("astronaut.png")).convert("RGB")
    img2 = Image.open(media_path("coffee.png")).convert("RGB")
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": img1},
                {"type": "text", "text": "Compare this"},
                {"type": "image", "image": img2},
                {"type": "text", "text": " with this."},
            ],
        }
    ]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Compare this"
        "<|vision_start|><|image_pad|><|vision_end|> with this.<|im_end|>\n<|im_start|>assistant\n"
    )
    return processor(text=[prompt], images=[img1, img2], return_tensors="pt")


def test_processor_expands_image_pads(processor, media_path):
    inputs = _two_image_inputs(processor, media_path)
    assert {"input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids"} <= set(inputs)
    grid = inputs["image_grid_thw"]
    assert grid.tolist() == [[1, 32, 32], [1, 24, 38]]  # 512x512 and 600x400 at 16-pixel patches
    ids = inputs["input_ids"][0]
    n_pads = int(grid.prod(-1).sum()) // 4
    assert int((ids == 151655).sum()) == n_pads
    assert inputs["mm_token_type_ids"][0].tolist() == (ids == 151655).long().tolist()
    assert inputs["pixel_values"].shape == (int(grid.prod(-1).sum()), 3 * 2 * 16 * 16)
    assert inputs["attention_mask"].all()


# ------------------------------------------------------------------------------------------
# running it in transformers
# ------------------------------------------------------------------------------------------


def test_transformers_forward_on_image_prompt(processor, hf_model, media_path):
    inputs = _two_image_inputs(processor, media_path)
    with torch.no_grad():
        out = hf_model(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
            mm_token_type_ids=inputs["mm_token_type_ids"],
        )
    logits = out.logits[0, -1]
    assert out.logits.shape == (1, inputs["input_ids"].shape[1], 151936)
    assert torch.isfinite(out.logits).all()
    assert 1.0 < float(logits.std()) < 10.0  # neither flat nor one-hot
    # the pictures matter: other pixels give other logits
    with torch.no_grad():
        other = hf_model(**{**inputs, "pixel_values": inputs["pixel_values"].flip(0)})
    assert not torch.allclose(other.logits[0, -1], logits, atol=1e-3)


def test_video_prompt_runs(processor, hf_model):
    """The video processor settings work end to end: 8 frames of 96x128 -> grid (4, 6, 8)."""
    import numpy as np
    from transformers.video_utils import VideoMetadata

    frames = np.random.default_rng(0).integers(0, 256, (8, 96, 128, 3), dtype=np.uint8)
    meta = VideoMetadata(total_num_frames=8, fps=4.0, frames_indices=list(range(8)), width=128, height=96)
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    inputs = processor(
        text=[prompt], videos=[frames], video_metadata=[meta], do_sample_frames=False, return_tensors="pt"
    )
    assert inputs["video_grid_thw"].tolist() == [[4, 6, 8]]
    ids = inputs["input_ids"][0]
    assert int((ids == 151656).sum()) == 4 * 6 * 8 // 4
    assert inputs["mm_token_type_ids"][0].tolist() == [2 if i == 151656 else 0 for i in ids.tolist()]
    with torch.no_grad():
        out = hf_model(**inputs)
    assert torch.isfinite(out.logits).all()


def test_greedy_tokens_vary_with_the_prompt(processor, hf_model):
    outputs = []
    for question in ("What is this?", "Tell me a story about a dragon.", "2+2="):
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        inputs = processor(text=[prompt], return_tensors="pt")
        with torch.no_grad():
            seq = hf_model.generate(**inputs, max_new_tokens=6, do_sample=False)
        outputs.append(seq[0, inputs["input_ids"].shape[1] :].tolist())
    assert len({tuple(o) for o in outputs}) == 3
    assert all(len(set(o)) > 1 for o in outputs), outputs  # not one token repeated


# ------------------------------------------------------------------------------------------
# presets, overrides, CLI
# ------------------------------------------------------------------------------------------


def test_overrides_build_a_loadable_deeper_model(tmp_path):
    from transformers import Qwen3VLForConditionalGeneration

    overrides = {
        "text_config": {"num_hidden_layers": 4},
        "vision_config": {"depth": 5, "deepstack_visual_indexes": [1, 3]},
    }
    path = tiny.build_tiny_checkpoint(tmp_path / "deep", seed=3, overrides=overrides)
    model, info = Qwen3VLForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert model.config.text_config.num_hidden_layers == 4
    assert list(model.config.vision_config.deepstack_visual_indexes) == [1, 3]


@pytest.mark.parametrize(
    "preset, overrides, message",
    [
        ("huge", None, "unknown tiny preset"),
        ("test", {"layers": 3}, "unknown override"),
        ("test", {"vision_config": {"deepstack_visual_indexes": [1, 9]}}, "deepstack_visual_indexes"),
        ("test", {"text_config": {"num_key_value_heads": 3}}, "num_key_value_heads"),
        ("test", {"text_config": {"rope_scaling": {"mrope_section": [2, 3, 3, 0]}}}, "mrope_section"),
        ("test", {"text_config": {"rope_scaling": {"mrope_section": [2, 3, 3]}}}, "would act as \\[3, 3, 2\\]"),
        ("test", {"text_config": {"hidden_size": 96}}, "out_hidden_size"),
        ("test", {"dtype": "int8"}, "dtype"),
        ("test", {"text_config": {"head_dim": None}}, "head_dim"),
    ],
)
def test_bad_settings_raise_checkpoint_error(preset, overrides, message):
    with pytest.raises(CheckpointError, match=message):
        tiny.resolve_preset(preset, overrides)


def test_presets_as_documented():
    test, demo = tiny.resolve_preset("test"), tiny.resolve_preset("demo")
    assert test["tie_word_embeddings"] is True and demo["tie_word_embeddings"] is False
    assert (test["dtype"], demo["dtype"]) == ("float32", "bfloat16")
    assert demo["text_config"]["hidden_size"] == demo["vision_config"]["out_hidden_size"] == 256


def test_cli_prints_the_path(tmp_path, capsys):
    assert tiny.main([str(tmp_path / "cli"), "--preset", "test", "--seed", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert (tmp_path / "cli" / "model.safetensors").is_file()
