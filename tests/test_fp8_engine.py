"""Scaled-FP8 KV pages against model-dtype pages on real-photo prompts.

Two measurements, both on the float32 "test" checkpoint with ~64-token photos:

* attention outputs: a decoder prefill (plus a few decode steps) where every layer stores its K/V
  in an FP8 pool and in a float32 pool and attends over each (:class:`DualStep`); the stream
  continues on the float32 result, so each layer's error is the KV quantisation's alone;
* the engine end to end: logits of an FP8-only run are finite and close to the
  ``kv_cache_dtype="auto"`` run's, and the first greedy token of the FP8 engine agrees with the auto
  engine's on most prompts, differing only where the auto logits nearly tie.

The bounds are about 1.2x the values measured when they were set (numbers and method in comments).
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from engine import SamplingParams
from engine.cache.kv_pool import PagePool
from engine.model.attention import PagedStep
from engine.model.decoder import VisualInjection
from ops import AttentionMetadata, paged_attention, store_kv

MAX_PIXELS = 256 * 256
PHOTOS = ["astronaut.png", "chelsea.png", "coffee.png", "page.png", "grace_hopper.jpg", "logo.png", "rocket.jpg",
          "coins.png", "china.jpg", "hubble_deep_field.jpg", "text.png"]
DECODE_STEPS = 2
BASE = dict(max_pixels=MAX_PIXELS, prefix_cache=False)

# How the bounds below were set: the tests print what they measure; on this CPU (float32 "test"
# checkpoint, seed 0, the 11 photos, reference ops) the values were those in the comments, and each
# bound is about 1.2x its measured value (an integer count: one prompt below it). The runs are
# deterministic, and on CUDA the FP8 pages are the same bytes (the Triton store matches the reference
# bit for bit there), so only float32 summation order differs.

#: Relative error ||out_fp8 - out_auto|| / ||out_auto|| of one layer's attention output over one
#: step. Measured (11 photos x 3 layers x (prefill + 2 decode steps)): max 0.0818 (chelsea, a decode
#: step), mean 0.0334. The K/V themselves round-trip E4M3 with a relative error of 2.2-2.5%; this
#: checkpoint's attention is sharp (scores' std ~3.6-3.9), which amplifies K errors.
MAX_ATTN_REL_ERR = 0.10
MEAN_ATTN_REL_ERR = 0.040
#: The same with the bfloat16 model (3 photos). Measured: max 0.0540.
MAX_ATTN_REL_ERR_BF16 = 0.065

#: First-token logits, FP8 engine vs auto engine (the same prompt through both pools), relative
#: error ||fp8 - auto|| / ||auto|| per prompt. Measured: max 0.1734 (rocket), mean 0.0993. Random
#: weights give flat logits (std ~3, top-2 gap often < 0.3), so FP8 moves them by 5-17%.
MAX_LOGIT_REL_ERR = 0.21
MEAN_LOGIT_REL_ERR = 0.12
#: Greedy first tokens that agree: measured 7 of the 11. Where they differ, the FP8 token was a near
#: tie in the auto logits: its auto logit is below the auto top by the "flip gap", measured at most
#: 0.302 (hubble_deep_field; ranks 1, 1, 1, 2), less than the FP8 logits' max shift (0.73-2.4). A
#: flip past a larger gap is a bug: one scale per token for all KV heads (instead of one per head)
#: flipped tokens 0.665 and 0.409 below the top (measured when these bounds were set).
MIN_FIRST_TOKENS_AGREEING = 6
MAX_FLIP_GAP = 0.36


def messages_for(media_path, name: str) -> list[dict]:
    with Image.open(media_path(name)) as im:
        photo = im.convert("RGB")
    return [{"role": "user", "content": [{"type": "image", "image": photo},
                                         {"type": "text", "text": "Describe this image."}]}]


@pytest.fixture(scope="module")
def prompts(media_path) -> dict[str, list[dict]]:
    return {name: messages_for(media_path, name) for name in PHOTOS}


@pytest.fixture(scope="module")
def engines(tiny_engine_factory):
    return (tiny_engine_factory(kv_cache_dtype="fp8_e4m3", **BASE),
            tiny_engine_factory(kv_cache_dtype="auto", **BASE))


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm())


class DualStep:
    """An attention context that stores every layer's K/V in both pools, attends over each, and
    returns the reference (auto) output, recording the FP8 output's relative error."""

    def __init__(self, auto: PagePool, fp8: PagePool, meta: AttentionMetadata, errors: list[float]):
        self.auto, self.fp8, self.meta, self.errors = auto, fp8, meta, errors

    def attend(self, layer, q, k, v):
        outs = []
        for pool in (self.auto, self.fp8):
            cache = pool.layers[layer]
            store_kv(k, v, cache, self.meta.slot_mapping)
            outs.append(paged_attention(q, cache, self.meta))
        assert torch.isfinite(outs[1]).all()
        self.errors.append(rel_err(outs[1], outs[0]))
        return outs[0]


def make_pool(engine, kv_cache_dtype: str, pages: int) -> PagePool:
    t = engine.config.text
    return PagePool(num_layers=t.num_hidden_layers, num_kv_heads=t.num_key_value_heads, head_dim=t.head_dim,
                    num_pages=pages, page_size=16, kv_cache_dtype=kv_cache_dtype, model_dtype=engine.dtype,
                    device=engine.device)


def engine_step(pool: PagePool):
    """The runner's context for one sequence: its first step (no cached context) attends to its own
    K/V, later steps read the pages."""
    return lambda meta: PagedStep(pool, None, meta) if meta.fresh else PagedStep(pool, meta)


def run_steps(engine, prompt, ctx_for, steps: int = DECODE_STEPS) -> list[torch.Tensor]:
    """Prefill ``prompt`` then decode ``steps`` greedy tokens through ``ctx_for(meta)`` contexts;
    returns each step's last-row logits. One sequence in pages ``0 .. n - 1``."""
    p = len(prompt.input_ids)
    table = list(range(-(-(p + steps) // 16)))
    dev = engine.device
    feats = engine.vision_features(prompt)
    visual = VisualInjection(prompt.visual_rows().to(dev), feats.embeds, feats.deepstack)
    ids, positions, start = torch.tensor(prompt.input_ids, device=dev), prompt.positions.to(dev), 0
    logits = []
    for _ in range(steps + 1):
        n = len(ids)
        meta = AttentionMetadata.build([n], [start + n], [table], list(range(start, start + n)), dev)
        out = engine.model(ids, positions, ctx_for(meta), visual, torch.tensor([n - 1], device=dev))
        logits.append(out[0])
        start += n
        ids = out[0].argmax().reshape(1)
        positions = torch.full((3, 1), start + prompt.rope_delta, device=dev)
        visual = None
    return logits


def test_fp8_attention_outputs_stay_close_to_auto(engines, prompts):
    fp8_engine, _ = engines
    per_prompt = {}
    for name, messages in prompts.items():
        prompt = fp8_engine.prompts.build(messages)
        pages = -(-(len(prompt.input_ids) + DECODE_STEPS) // 16)
        auto, fp8 = make_pool(fp8_engine, "auto", pages), make_pool(fp8_engine, "fp8_e4m3", pages)
        errors: list[float] = []
        run_steps(fp8_engine, prompt, lambda meta, a=auto, f=fp8, e=errors: DualStep(a, f, meta, e))
        assert len(errors) == fp8_engine.config.text.num_hidden_layers * (DECODE_STEPS + 1)
        per_prompt[name] = errors
    every = [e for errs in per_prompt.values() for e in errs]
    worst = max(every)
    mean = sum(every) / len(every)
    print(f"FP8 attention rel. error: max {worst:.4f}, mean {mean:.4f}; per prompt max "
          + ", ".join(f"{n}={max(e):.4f}" for n, e in per_prompt.items()))
    assert 0 < worst <= MAX_ATTN_REL_ERR, per_prompt
    assert mean <= MEAN_ATTN_REL_ERR


def test_fp8_logits_are_finite_and_first_tokens_agree(engines, prompts):
    fp8_engine, auto_engine = engines
    agree, ranks, gaps, logit_errors = 0, [], [], []
    first = SamplingParams(max_tokens=1, ignore_eos=True)
    for messages in prompts.values():
        prompt = fp8_engine.prompts.build(messages)
        pages = -(-(len(prompt.input_ids) + DECODE_STEPS) // 16)
        fp8_pool, auto_pool = make_pool(fp8_engine, "fp8_e4m3", pages), make_pool(fp8_engine, "auto", pages)
        fp8_logits = run_steps(fp8_engine, prompt, engine_step(fp8_pool))
        assert all(torch.isfinite(x).all() for x in fp8_logits), "NaN / inf in FP8 logits"
        auto_logits = run_steps(fp8_engine, prompt, engine_step(auto_pool), steps=0)[0]

        fp8_token = fp8_engine.generate(messages, first).token_ids[0]
        auto_token = auto_engine.generate(messages, first).token_ids[0]
        # the harness runs what the engines run
        assert fp8_token == int(fp8_logits[0].argmax()) and auto_token == int(auto_logits.argmax())
        agree += fp8_token == auto_token
        ranks.append(int((auto_logits > auto_logits[fp8_token]).sum()))  # 0: the same token
        gaps.append(float(auto_logits.max() - auto_logits[fp8_token]))  # 0.0: the same token
        logit_errors.append(rel_err(fp8_logits[0], auto_logits))
    mean_logit_error = sum(logit_errors) / len(logit_errors)
    print(f"FP8 vs auto first-token agreement: {agree}/{len(prompts)}; rank of the FP8 token among the auto "
          f"logits: {ranks}; flip gaps: max {max(gaps):.3f}; logits rel. error: max {max(logit_errors):.4f}, "
          f"mean {mean_logit_error:.4f}")
    assert max(logit_errors) <= MAX_LOGIT_REL_ERR and mean_logit_error <= MEAN_LOGIT_REL_ERR, logit_errors
    assert agree >= MIN_FIRST_TOKENS_AGREEING
    assert max(gaps) <= MAX_FLIP_GAP, gaps


def test_fp8_with_a_bfloat16_model(tiny_engine_factory, prompts):
    fp8 = tiny_engine_factory(torch.bfloat16, kv_cache_dtype="fp8_e4m3", **BASE)
    assert fp8.dtype == torch.bfloat16 and fp8.pool.kv_cache_dtype == "fp8_e4m3"
    assert fp8.pool.layers[0].k_cache.dtype == torch.float8_e4m3fn
    errors: list[float] = []
    for name in ("astronaut.png", "coffee.png", "page.png"):
        done = fp8.generate(prompts[name], SamplingParams(max_tokens=8, ignore_eos=True))
        assert len(done.token_ids) == 8 and done.finish_reason == "length"
        assert all(0 <= t < fp8.config.text.vocab_size for t in done.token_ids) and isinstance(done.text, str)

        prompt = fp8.prompts.build(prompts[name])
        pages = -(-(len(prompt.input_ids) + DECODE_STEPS) // 16)
        ref, q8 = make_pool(fp8, "auto", pages), make_pool(fp8, "fp8_e4m3", pages)
        logits = run_steps(fp8, prompt, lambda meta, r=ref, q=q8: DualStep(r, q, meta, errors))
        assert all(torch.isfinite(x).all() for x in logits)
    print(f"FP8 attention rel. error, bfloat16 model: max {max(errors):.4f}")
    assert max(errors) <= MAX_ATTN_REL_ERR_BF16
    assert fp8.stats()["pages_used"] == 0
    fp8.close()
