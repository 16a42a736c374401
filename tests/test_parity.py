"""Parity of our engine with transformers' ``Qwen3VLForConditionalGeneration`` (the oracle).

Every case runs the same prompt through both: all-position logits, the M-RoPE position ids and
rope delta (against ``get_rope_index``), and greedy generations must agree. The transformers
side gets its inputs from its own processor, called directly; we assert that our prompt builder
produced the same ids and pixels.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import TEST_DEVICE
from PIL import Image
from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

from engine import CheckpointError, Engine, SamplingParams
from engine.model.attention import DenseKVCache
from engine.model.config import ModelConfig
from engine.model.decoder import VisualInjection

LAST_ATOL = 1e-4  # last-position logits, float32
ALL_ATOL = 1e-3  # every position's logits, float32
GEN_TOKENS = 16

#: Pixel budget per image for the three-photo case (keeps each photo to ~100 visual tokens).
THREE_PHOTO_MAX_PIXELS = 100_000

#: A config unlike the "test" preset in every dimension the forward pass depends on.
CUSTOM_OVERRIDES = {
    "text_config": {
        "hidden_size": 96,
        "intermediate_size": 160,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,  # GQA ratio 4
        "head_dim": 32,  # 16 rotary frequencies: T H W interleaved, 6 / 5 / 5
        "rope_scaling": {"mrope_section": [6, 5, 5]},
    },
    "vision_config": {
        "depth": 5,
        "hidden_size": 48,
        "num_heads": 3,
        "intermediate_size": 80,
        "out_hidden_size": 96,
        "deepstack_visual_indexes": [0, 2, 4],
    },
}


# ------------------------------------------------------------------------------------------------
# fixtures and helpers
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Pair:
    """Our engine and transformers' model + processor, loaded from the same checkpoint."""

    engine: Engine
    hf: Qwen3VLForConditionalGeneration
    processor: object


#: Engine options for exact parity: K/V pages kept in the model dtype and no prefix cache (the
#: default Scaled-FP8 pages and compacted cached prefixes are lossy by design), a small pool (the
#: CPU default is 512 MiB), page accounting checked after every step.
PARITY_OPTIONS = {"kv_cache_dtype": "auto", "prefix_cache": False, "kv_cache_bytes": 32 << 20, "debug_checks": True}


def _engine(ckpt, dtype=torch.float32, **options) -> Engine:
    options = {**PARITY_OPTIONS, **options}
    return Engine.from_pretrained(ckpt, device=TEST_DEVICE, dtype=dtype, progress=False, **options)


def _load_pair(ckpt, dtype=torch.float32, **engine_options) -> Pair:
    engine = _engine(ckpt, dtype, **engine_options)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=dtype).eval()
    return Pair(engine, hf, AutoProcessor.from_pretrained(ckpt))


@pytest.fixture(scope="module")
def f32(tiny_ckpt):
    pair = _load_pair(tiny_ckpt)
    yield pair
    pair.engine.close()


@pytest.fixture(scope="module")
def custom_ckpt(tmp_path_factory):
    from engine.model.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-custom"), "test", seed=1, overrides=CUSTOM_OVERRIDES)


@pytest.fixture(scope="module")
def custom(custom_ckpt):
    pair = _load_pair(custom_ckpt)
    yield pair
    pair.engine.close()


def _photo(media_path, name: str) -> Image.Image:
    with Image.open(media_path(name)) as im:
        return im.convert("RGB")


def _video_frames(media_path, n: int = 8) -> list[Image.Image]:
    """``n`` frames of equal size panning across chelsea.png (451 x 300)."""
    src = _photo(media_path, "chelsea.png")
    return [src.crop((x, 50, x + 256, 50 + 192)) for x in range(0, 25 * n, 25)]


def _images_in(messages) -> list[Image.Image]:
    found = []
    for msg in messages:
        if isinstance(msg["content"], list):
            found += [p["image"] for p in msg["content"] if p.get("type") == "image"]
    return found


def _videos_in(messages) -> list[tuple[list[Image.Image], float]]:
    found = []
    for msg in messages:
        if isinstance(msg["content"], list):
            found += [(p["video"], p["fps"]) for p in msg["content"] if p.get("type") == "video"]
    return found


def hf_inputs(processor, messages, *, max_pixels: int | None = None) -> dict:
    """transformers' own processing of ``messages`` (images / frames given as RGB PIL images)."""
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    kwargs = {}
    if images := _images_in(messages):
        kwargs["images"] = images
        if max_pixels is not None:  # (a call-time ``max_pixels=`` is silently ignored by transformers 5.17)
            kwargs["size"] = {
                "shortest_edge": processor.image_processor.size["shortest_edge"],
                "longest_edge": max_pixels,
            }
    if videos := _videos_in(messages):
        kwargs["videos"] = [frames for frames, _ in videos]
        kwargs["videos_kwargs"] = {
            "do_sample_frames": False,  # every frame given is a frame of the clip
            "video_metadata": [
                {"fps": fps, "total_num_frames": len(frames), "frames_indices": list(range(len(frames)))}
                for frames, fps in videos
            ],
        }
    return dict(processor(text=[text], return_tensors="pt", **kwargs))


def our_all_logits(engine: Engine, prompt) -> torch.Tensor:
    """float32 logits ``[T, vocab]`` of every prompt position, from one prefill of our model."""
    dev = engine.device
    ids = torch.tensor(prompt.input_ids, device=dev)
    n = len(ids)
    cfg = engine.config.text
    cache = DenseKVCache(cfg.num_hidden_layers, n, cfg.num_key_value_heads, cfg.head_dim, engine.dtype, dev)
    visual = None
    if prompt.spans:
        feats = engine.vision_features(prompt)
        visual = VisualInjection(prompt.visual_rows().to(dev), feats.embeds, feats.deepstack)
    return engine.model(ids, prompt.positions.to(dev), cache.step(n), visual).cpu()


@torch.no_grad()
def hf_all_logits(hf, inputs) -> torch.Tensor:
    return hf(**inputs).logits[0].float()


@torch.no_grad()
def hf_greedy(hf, inputs, n: int) -> list[int]:
    out = hf.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def assert_parity(pair: Pair, messages, *, hf_max_pixels: int | None = None, expect_visual: int | None = None):
    """Logits, M-RoPE positions and 16 greedy tokens of ours against transformers'."""
    engine, hf = pair.engine, pair.hf
    inputs = hf_inputs(pair.processor, messages, max_pixels=hf_max_pixels)
    prompt = engine.prompts.build(messages)

    # identical model inputs
    assert prompt.input_ids == inputs["input_ids"][0].tolist()
    if "pixel_values" in inputs:
        # kept in the model dtype: rounded as the device would round the processor's float32
        assert prompt.pixel_values.dtype == engine.dtype
        assert torch.equal(prompt.pixel_values, inputs["pixel_values"].to(engine.dtype))
        assert prompt.image_grids == [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    else:
        assert prompt.pixel_values is None and not prompt.image_grids
    if "pixel_values_videos" in inputs:
        assert torch.equal(prompt.pixel_values_videos, inputs["pixel_values_videos"])
        assert prompt.video_grids == [tuple(g) for g in inputs["video_grid_thw"].tolist()]
    else:
        assert prompt.pixel_values_videos is None and not prompt.video_grids
    mm_types = inputs["mm_token_type_ids"][0]
    assert prompt.num_visual_tokens == int((mm_types != 0).sum())
    if expect_visual is not None:
        assert prompt.num_visual_tokens == expect_visual

    # M-RoPE positions and delta
    positions, delta = hf.model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        inputs.get("image_grid_thw"),
        inputs.get("video_grid_thw"),
    )
    assert torch.equal(prompt.positions, positions[:, 0])
    assert prompt.rope_delta == int(delta)

    # logits of every position
    ours = our_all_logits(engine, prompt)
    theirs = hf_all_logits(hf, inputs)
    assert ours.shape == theirs.shape == (len(prompt.input_ids), engine.config.text.vocab_size)
    torch.testing.assert_close(ours[-1], theirs[-1], rtol=0, atol=LAST_ATOL)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=ALL_ATOL)

    # greedy generation (ignore_eos vs min_new_tokens: neither may stop early)
    done = engine.generate(messages, SamplingParams(max_tokens=GEN_TOKENS, ignore_eos=True))
    assert done.prompt_token_ids == prompt.input_ids
    assert done.token_ids == hf_greedy(hf, inputs, GEN_TOKENS)
    return prompt


# ------------------------------------------------------------------------------------------------
# 1-5: float32 parity on the "test" preset
# ------------------------------------------------------------------------------------------------


def test_text_only(f32):
    messages = [{"role": "user", "content": "Write a short poem about the sea, please."}]
    prompt = assert_parity(f32, messages, expect_visual=0)
    assert prompt.rope_delta == 0


def test_fused_projections_give_the_same_logits(tiny_ckpt, f32):
    """The fused QKV / gate-up matrices (used on CUDA) and the one-launch Q/K norm + rotary of the
    adjacent query and key heads compute what the separate projections do; fusing twice (a second
    engine on the same model) keeps the first fused weights, which captured CUDA graphs point to."""
    from types import SimpleNamespace

    from engine.model.qwen3_vl import load_model

    model = load_model(tiny_ckpt, device=TEST_DEVICE, progress=False)
    unfused = SimpleNamespace(model=model, config=model.config, device=model.device, dtype=model.dtype)
    prompt = f32.engine.prompts.build([{"role": "user", "content": "Write a short poem about the sea, please."}])
    before = our_all_logits(unfused, prompt)
    model.language_model.fuse_projections()
    attn = model.language_model.layers[0].self_attn
    fused = attn.qkv
    model.language_model.fuse_projections()
    assert fused is not None and attn.qkv is fused
    torch.testing.assert_close(our_all_logits(unfused, prompt), before, rtol=0, atol=LAST_ATOL)


def test_one_photo(f32, media_path):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": _photo(media_path, "astronaut.png")},
                {"type": "text", "text": "Describe this image."},
            ],
        },
    ]
    # 512 x 512 -> 32 x 32 patches of 16 -> 16 x 16 merged tokens
    prompt = assert_parity(f32, messages, expect_visual=256)
    assert prompt.image_grids == [(1, 32, 32)]
    assert prompt.rope_delta == 16 - 256


@pytest.fixture(scope="module")
def f32_small_images(tiny_ckpt, f32):
    """The same checkpoint with our engine's ``max_pixels`` option (transformers: its ``max_pixels``)."""
    engine = _engine(tiny_ckpt, max_pixels=THREE_PHOTO_MAX_PIXELS)
    yield Pair(engine, f32.hf, f32.processor)
    engine.close()


def test_three_photos_of_different_shapes(f32_small_images, media_path):
    names = ["astronaut.png", "coffee.png", "page.png"]  # 512x512 RGB, 600x400 RGB, 384x191 grayscale
    photos = [_photo(media_path, n) for n in names]
    assert len({p.size for p in photos}) == 3 and len({round(p.width / p.height, 2) for p in photos}) == 3
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare these:"},
                *({"type": "image", "image": p} for p in photos),
                {"type": "text", "text": "Which one has text?"},
            ],
        },
    ]
    prompt = assert_parity(f32_small_images, messages, hf_max_pixels=THREE_PHOTO_MAX_PIXELS)
    grids = prompt.image_grids
    assert len(grids) == 3 and len({(h, w) for _, h, w in grids}) == 3
    assert all(h * w * 16 * 16 <= THREE_PHOTO_MAX_PIXELS for _, h, w in grids)
    assert 150 <= prompt.num_visual_tokens <= 400


def test_video_of_eight_frames(f32, media_path):
    frames = _video_frames(media_path)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video", "video": frames, "fps": 2.0},
                {"type": "text", "text": "What happens in this clip?"},
            ],
        },
    ]
    prompt = assert_parity(f32, messages)
    # 8 frames of 256 x 192 -> 4 temporal patches of 16 x 12 patches -> 4 runs of 8 x 6 tokens
    assert prompt.video_grids == [(4, 12, 16)]
    assert [(s.kind, s.frame, s.grid_h, s.grid_w) for s in prompt.spans] == [("video", f, 6, 8) for f in range(4)]


def test_video_prompt_ids_equal_the_processors_own_chat_template(f32, media_path):
    """Our built ids equal transformers' one-call ``apply_chat_template(tokenize=True)`` path."""
    frames = _video_frames(media_path)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video", "video": frames, "fps": 2.0},
                {"type": "text", "text": "Describe."},
            ],
        }
    ]
    direct = f32.processor.apply_chat_template(
        messages,
        tokenize=True,
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
        processor_kwargs={
            "do_sample_frames": False,
            "video_metadata": [{"fps": 2.0, "total_num_frames": 8, "frames_indices": list(range(8))}],
        },
    )
    prompt = f32.engine.prompts.build(messages)
    assert prompt.input_ids == direct["input_ids"][0].tolist()
    assert torch.equal(prompt.pixel_values_videos, direct["pixel_values_videos"])


def test_two_turns_with_system_message(f32, media_path):
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": _photo(media_path, "coffee.png")},
                {"type": "text", "text": "What is in the cup?"},
            ],
        },
        {"role": "assistant", "content": "Coffee, with latte art."},
        {"role": "user", "content": [{"type": "text", "text": "And what colour is the saucer?"}]},
    ]
    prompt = assert_parity(f32, messages)
    assert len(prompt.image_grids) == 1
    text = f32.processor.tokenizer.decode(prompt.input_ids)
    assert text.startswith("<|im_start|>system\nYou are a terse assistant.<|im_end|>")
    assert text.count("<|im_start|>user") == 2 and text.endswith("<|im_start|>assistant\n")


def test_chunked_prefill_generates_transformers_tokens(tiny_ckpt, f32, media_path, request):
    """A prompt prefilled in 64-token chunks (image features injected across chunk borders)."""
    engine = _engine(tiny_ckpt, max_num_batched_tokens=64, page_size=16)
    request.addfinalizer(engine.close)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "First,"},
                {"type": "image", "image": _photo(media_path, "coffee.png")},
                {"type": "text", "text": "then what?"},
            ],
        },
    ]
    inputs = hf_inputs(f32.processor, messages)
    assert inputs["input_ids"].shape[1] > 3 * 64
    done = engine.generate(messages, SamplingParams(max_tokens=GEN_TOKENS, ignore_eos=True))
    assert done.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert done.token_ids == hf_greedy(f32.hf, inputs, GEN_TOKENS)


# ------------------------------------------------------------------------------------------------
# 6: another architecture; config validation
# ------------------------------------------------------------------------------------------------


def test_custom_architecture_one_photo(custom, media_path):
    cfg = custom.hf.config
    assert cfg.text_config.num_hidden_layers == 3 and cfg.vision_config.depth == 5
    assert cfg.text_config.num_attention_heads // cfg.text_config.num_key_value_heads == 4
    assert list(cfg.vision_config.deepstack_visual_indexes) == [0, 2, 4]
    assert cfg.text_config.rope_parameters["mrope_section"] == [6, 5, 5]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image", "image": _photo(media_path, "grace_hopper.jpg")},
                {"type": "text", "text": "Who is this?"},
            ],
        },
    ]
    assert_parity(custom, messages)


def _valid_config() -> dict:
    from engine.model.tiny import config_dict, resolve_preset

    cfg = config_dict(resolve_preset("test"))
    ModelConfig.from_dict(json.loads(json.dumps(cfg)))  # the unmodified config is accepted
    return cfg


@pytest.mark.parametrize(
    "section, key, value, field",
    [
        (
            "text_config",
            "rope_scaling",
            {"mrope_section": [4, 2, 3], "mrope_interleaved": True, "rope_type": "default"},
            "mrope_section",
        ),
        ("vision_config", "deepstack_visual_indexes", [1, 4], "deepstack_visual_indexes"),  # depth is 4
        ("vision_config", "deepstack_visual_indexes", [0, 1, 2, 3], "deepstack_visual_indexes"),  # 3 text layers
        ("vision_config", "out_hidden_size", 32, "out_hidden_size"),  # text hidden is 64
    ],
    ids=["mrope-section-sum", "deepstack-beyond-depth", "more-deepstack-than-layers", "out-hidden-size"],
)
def test_inconsistent_config_names_the_field(section, key, value, field):
    cfg = _valid_config()
    cfg[section][key] = value
    with pytest.raises(CheckpointError, match=field):
        ModelConfig.from_dict(cfg)


# ------------------------------------------------------------------------------------------------
# 7: half precision
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ckpt_fixture", ["tiny_ckpt", "demo_ckpt"])
def test_bfloat16_greedy_tokens_match(ckpt_fixture, media_path, request):
    """bfloat16 on both sides. Our decoder and vision blocks are bit-identical to transformers' in
    bfloat16; the patch embedding (a matrix product here, a Conv3d there) rounds differently in
    the last bit, so logits differ by a few bfloat16 ulps, but not the greedy tokens."""
    pair = _load_pair(request.getfixturevalue(ckpt_fixture), dtype=torch.bfloat16)
    request.addfinalizer(pair.engine.close)
    assert pair.engine.dtype == torch.bfloat16 and pair.hf.dtype == torch.bfloat16
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": _photo(media_path, "astronaut.png")},
                {"type": "text", "text": "Describe this image."},
            ],
        },
    ]
    inputs = hf_inputs(pair.processor, messages)
    done = pair.engine.generate(messages, SamplingParams(max_tokens=8, ignore_eos=True))
    assert done.prompt_token_ids == inputs["input_ids"][0].tolist()
    if TEST_DEVICE == "cpu":
        assert done.token_ids == hf_greedy(pair.hf, inputs, 8)
    else:
        # On the GPU our Triton kernels and cuBLAS round differently from transformers on the CPU:
        # near-ties of these random weights flip later tokens, so compare the prompt's logits
        # (bfloat16-sized tolerance) and the first token.
        ours = our_all_logits(pair.engine, pair.engine.prompts.build(messages))[-1].float()
        theirs = hf_all_logits(pair.hf, inputs)[-1]
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0.05 * float(theirs.abs().max()))
        assert done.token_ids[0] == hf_greedy(pair.hf, inputs, 1)[0]


def test_float16_logits_are_finite(tiny_ckpt, f32, media_path, request):
    engine = _engine(tiny_ckpt, torch.float16)
    request.addfinalizer(engine.close)
    assert engine.dtype == torch.float16
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": _photo(media_path, "coffee.png")},
                {"type": "text", "text": "What is this?"},
            ],
        },
    ]
    prompt = engine.prompts.build(messages)
    logits = our_all_logits(engine, prompt)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    # and still close to transformers' float32 answer at the last position (half precision slack)
    inputs = hf_inputs(f32.processor, messages)
    theirs = hf_all_logits(f32.hf, inputs)
    assert (logits[-1] - theirs[-1]).abs().max() < 0.25
    done = engine.generate(messages, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(done.token_ids) == 4


# ------------------------------------------------------------------------------------------------
# 8: the tiny test config exercises DeepStack and GQA
# ------------------------------------------------------------------------------------------------


def test_tiny_config_exercises_deepstack_and_gqa(f32):
    hf_cfg = f32.hf.config  # transformers' reading of the checkpoint
    indexes = list(hf_cfg.vision_config.deepstack_visual_indexes)
    assert indexes, "no DeepStack taps"
    assert all(0 <= i < hf_cfg.vision_config.depth for i in indexes)
    assert len(indexes) <= hf_cfg.text_config.num_hidden_layers
    assert len(indexes) < hf_cfg.text_config.num_hidden_layers  # at least one layer without injection
    assert hf_cfg.text_config.num_key_value_heads < hf_cfg.text_config.num_attention_heads
    ours = f32.engine.config
    assert list(ours.vision.deepstack_visual_indexes) == indexes
    assert len(f32.engine.model.visual.deepstack_merger_list) == len(indexes)
    assert ours.text.num_key_value_heads == hf_cfg.text_config.num_key_value_heads
    assert ours.text.num_attention_heads == hf_cfg.text_config.num_attention_heads
