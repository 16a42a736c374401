"""The serving engine: paged generation, chunked prefill, continuous batching, preemption under
KV-pool pressure, cancellation, streaming, refusals, failures and thread safety.

Oracles: transformers' ``Qwen3VLForConditionalGeneration.generate`` (greedy) on the same tiny
checkpoint, and runs of our engine alone / unchunked / with an unpressured pool. Every engine here
stores K/V in the model dtype (``kv_cache_dtype="auto"``, float32) and has the prefix cache off, so
tokens must match exactly (FP8 is tested in test_fp8_engine.py, the prefix cache elsewhere).
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from conftest import TEST_DEVICE
from PIL import Image

from engine import (
    Completion,
    EngineOverloadedError,
    InvalidImageError,
    PrismError,
    RequestTooLargeError,
    SamplingParams,
)
from engine.cache.kv_pool import PagePool

MAX_PIXELS = 256 * 256  # every photo becomes ~256 x 256 pixels: 64 visual tokens
GEN = 16
GREEDY = SamplingParams(max_tokens=GEN, ignore_eos=True)
BASE = dict(kv_cache_dtype="auto", max_pixels=MAX_PIXELS, prefix_cache=False)


# ------------------------------------------------------------------------------------------------
# fixtures and helpers
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def photos(media_path) -> dict[str, Image.Image]:
    names = ["astronaut.png", "coffee.png", "page.png", "chelsea.png", "grace_hopper.jpg", "rocket.jpg",
             "coins.png", "logo.png"]
    out = {}
    for name in names:
        with Image.open(media_path(name)) as im:
            out[name.split(".")[0]] = im.convert("RGB")
    return out


def user(*parts) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def cases(photos) -> dict[str, list[dict]]:
    chelsea = photos["chelsea"]  # 451 x 300
    frames = [chelsea.crop((x, 60, x + 160, 60 + 128)) for x in range(0, 160, 40)]  # 4 frames, 160 x 128
    return {
        "text": [{"role": "user", "content": "Write a short poem about the sea, please."}],
        "one_photo": user(photos["astronaut"], "Describe this image."),
        "three_photos": user("Compare these:", photos["astronaut"], photos["coffee"], photos["page"],
                             "Which one has text?"),
        "two_turns": [
            {"role": "system", "content": "You are a terse assistant."},
            *user(photos["coffee"], "What is in the cup?"),
            {"role": "assistant", "content": "Coffee, with latte art."},
            {"role": "user", "content": "And what colour is the saucer?"},
        ],
        "video": [{"role": "user", "content": [
            {"type": "video", "video": frames, "fps": 2.0},
            {"type": "text", "text": "What happens in this clip?"},
        ]}],
    }


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    """The reference engine: big pool, unchunked (1024-token steps), K/V in float32."""
    return tiny_engine_factory(**BASE)


@pytest.fixture(scope="module")
def alone(engine, cases):
    """``alone(name, sampling=GREEDY) -> Completion``: the case run by itself on ``engine`` (memoised)."""
    memo = {}

    def run(name: str, sampling: SamplingParams = GREEDY) -> Completion:
        key = (name, sampling)
        if key not in memo:
            before = engine.stats()["steps"]
            memo[key] = engine.generate(cases[name], sampling)
            memo[key].steps = engine.stats()["steps"] - before  # steps it took by itself
        return memo[key]

    return run


@pytest.fixture(scope="module")
def hf(tiny_ckpt):
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(str(tiny_ckpt))


def hf_greedy(hf, messages, n: int = GEN) -> tuple[list[int], list[int]]:
    """transformers' prompt ids and ``n`` greedy tokens (its own processor, same pixel budget)."""
    model, processor = hf
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    kwargs = {}
    images = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"]
              if p["type"] == "image"]
    videos = [p for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "video"]
    if images:
        kwargs["images"] = images
        # transformers honours max_pixels only together with min_pixels (it keeps its 256 x 256 minimum
        # otherwise); any minimum below the result gives the same resize
        kwargs["images_kwargs"] = {"min_pixels": 32 * 32, "max_pixels": MAX_PIXELS}
    if videos:
        kwargs["videos"] = [v["video"] for v in videos]
        kwargs["videos_kwargs"] = {"do_sample_frames": False, "video_metadata": [
            {"fps": v["fps"], "total_num_frames": len(v["video"]), "frames_indices": list(range(len(v["video"])))}
            for v in videos]}
    inputs = processor(text=[text], return_tensors="pt", **kwargs)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()


def run_threads(targets, timeout: float = 120, on_hang=None) -> list:
    """Run each zero-argument callable in its own thread, started together through a barrier.
    Returns their results (or the exception each raised), in order."""
    barrier = threading.Barrier(len(targets))
    results: list = [None] * len(targets)

    def work(i, fn):
        barrier.wait()
        try:
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i, fn), daemon=True) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive() and on_hang is not None:
            on_hang()
        assert not t.is_alive(), "a request hung"
    return results


def call_with_timeout(fn, timeout: float = 30):
    """``fn()``'s result or exception, failing the test instead of hanging."""
    (result,) = run_threads([fn], timeout)
    if isinstance(result, BaseException):
        raise result
    return result


def wait_until(cond, timeout: float = 30, what: str = "condition"):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.002)


def assert_pool_idle(eng):
    stats = eng.stats()
    assert stats["pages_free"] == stats["pages_total"] and stats["pages_used"] == 0, stats
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    eng.pool.check([])


# ------------------------------------------------------------------------------------------------
# paged generation == transformers
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["text", "one_photo", "three_photos", "two_turns", "video"])
def test_paged_greedy_equals_transformers(name, cases, alone, hf, engine):
    ids, tokens = hf_greedy(hf, cases[name])
    done = alone(name)
    assert done.prompt_token_ids == ids
    assert done.token_ids == tokens
    assert done.finish_reason == "length" and len(done.token_ids) == GEN
    prompt = engine.prompts.build(cases[name])
    if name == "text":
        assert prompt.rope_delta == 0 and not prompt.spans
    else:
        assert prompt.rope_delta < 0 and prompt.spans  # images shift later positions
    assert_pool_idle(engine)


# ------------------------------------------------------------------------------------------------
# chunked prefill
# ------------------------------------------------------------------------------------------------


def _mid_image_chunk(prompt) -> int:
    """A chunk size whose first boundary falls strictly inside the prompt's first visual span."""
    span = prompt.spans[0]
    chunk = span.start + span.length // 2
    assert span.start < chunk < span.end
    return chunk


@pytest.mark.parametrize("name", ["one_photo", "three_photos", "two_turns"])
@pytest.mark.parametrize("chunk", [16, 64, "mid-image"])
def test_chunked_prefill_equals_unchunked(name, chunk, cases, alone, engine, tiny_engine_factory):
    prompt = engine.prompts.build(cases[name])
    if chunk == "mid-image":
        chunk = _mid_image_chunk(prompt)
    p = len(prompt.input_ids)
    assert p > chunk, "the prompt must really be split"
    boundaries = range(chunk, p, chunk)
    assert any(s.start < b < s.end for b in boundaries for s in prompt.spans), "a chunk boundary splits an image"

    chunked = tiny_engine_factory(**BASE, max_num_batched_tokens=chunk)
    done = chunked.generate(cases[name], GREEDY)
    assert done.token_ids == alone(name).token_ids
    # it really was chunked: ceil(P / chunk) prefill steps (the last one samples token 1), then decode
    assert chunked.stats()["steps"] == math.ceil(p / chunk) + GEN - 1
    assert done.telemetry.computed_tokens == p
    assert_pool_idle(chunked)
    chunked.close()


# ------------------------------------------------------------------------------------------------
# continuous batching
# ------------------------------------------------------------------------------------------------


def test_mixed_batch_from_three_threads_equals_alone(cases, alone, engine, monkeypatch):
    names = ["text", "one_photo", "three_photos"]
    expected = {n: alone(n) for n in names}

    # Observe the batches, and hold the first step until all three requests are queued, so the
    # three really run side by side however fast each thread builds its prompt.
    submitted, sizes = [], []
    real_submit, real_execute = engine.submit, engine.loop.runner.execute

    def submit(*args, **kwargs):
        req = real_submit(*args, **kwargs)
        submitted.append(req)
        return req

    def execute(plan):
        wait_until(lambda: len(submitted) == 3, what="three submissions")
        sizes.append(len(plan.runs))
        return real_execute(plan)

    monkeypatch.setattr(engine, "submit", submit)
    monkeypatch.setattr(engine.loop.runner, "execute", execute)
    before = engine.stats()["steps"]
    results = run_threads([lambda n=n: engine.generate(cases[n], GREEDY) for n in names])
    steps = engine.stats()["steps"] - before

    for name, done in zip(names, results, strict=True):
        assert isinstance(done, Completion), done
        assert done.token_ids == expected[name].token_ids, name  # text-only kept rope delta 0
    assert max(sizes) == 3, f"never batched all three: batch sizes {sizes}"
    assert steps < sum(expected[n].steps for n in names) == 3 * GEN
    assert_pool_idle(engine)


PRESSURE_TEXTS = [
    "Count from one to ten.", "Name three rivers.", "What is two plus two?", "Say hello in French.",
    "List some colours.", "Why is the sky blue?", "Tell me a joke.", "Describe a cat.",
    "What is rain?", "Spell 'banana'.", "Give me a recipe idea.", "Who wrote Hamlet?",
]


@pytest.fixture(scope="module")
def pressure_cases(photos) -> list[list[dict]]:
    texts = [[{"role": "user", "content": t}] for t in PRESSURE_TEXTS]
    images = [user(photos[n], "What is this?") for n in ("astronaut", "coffee", "chelsea", "grace_hopper")]
    return texts[:4] + images[:2] + texts[4:8] + images[2:] + texts[8:]  # 16 requests, images in between


def _small_pool_engine(engine, tiny_engine_factory, cases, max_tokens: int):
    """An engine (K/V float32) whose pool holds ~3-4 of ``cases`` at once, each run to ``max_tokens``."""
    need = [math.ceil((len(engine.prompts.build(m).input_ids) + max_tokens) / 16) for m in cases]
    pages = round(3.5 * sum(need) / len(need))
    assert max(need) <= pages < sum(need) / 4
    cfg = engine.config.text
    per_page = PagePool.bytes_per_page(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                                       head_dim=cfg.head_dim, page_size=16, kv_cache_dtype="auto",
                                       model_dtype=torch.float32)
    return tiny_engine_factory(**BASE, kv_cache_bytes=pages * per_page, debug_checks=True)


def test_a_preempted_stream_sends_each_token_once(pressure_cases, engine, tiny_engine_factory):
    """A request preempted and recomputed goes on from the token after its last one: its joined
    stream equals its final text and the stream of the same request run without preemption
    (a resume that sampled its last token again would stream that token's text twice, with the
    right token ids)."""
    sampling = SamplingParams(max_tokens=48, ignore_eos=True)
    small = _small_pool_engine(engine, tiny_engine_factory, pressure_cases, 48)

    def streamed(eng, messages):
        items = list(eng.stream(messages, sampling))
        return "".join(items[:-1]), items[-1]

    reference = run_threads([lambda m=m: streamed(engine, m) for m in pressure_cases])
    pressured = run_threads([lambda m=m: streamed(small, m) for m in pressure_cases], timeout=120)
    for n, (ref, got) in enumerate(zip(reference, pressured, strict=True)):
        assert isinstance(ref, tuple) and isinstance(got, tuple), (ref, got)
        (ref_text, ref_done), (text, done) = ref, got
        assert ref_done.telemetry.preempted == 0 and ref_text == ref_done.text
        assert done.token_ids == ref_done.token_ids, n
        assert text == done.text == ref_text, (n, done.telemetry.preempted)
    assert sum(done.telemetry.preempted for _, done in pressured) > 0, "the pool was never short: no preemption"
    assert_pool_idle(small)


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_preemption_under_a_small_pool_keeps_every_answer(pressure_cases, engine, tiny_engine_factory, kv):
    """Also with FP8 pages: a recomputed (or differently chunked) prompt's first chunk attends to its
    K/V as the pages hold them, so it computes the numbers its first run did."""
    options = {**BASE, "kv_cache_dtype": kv}
    if kv != "auto":
        engine = tiny_engine_factory(**options)
    sampling = SamplingParams(max_tokens=48, ignore_eos=True)
    need = [math.ceil((len(engine.prompts.build(m).input_ids) + 48) / 16) for m in pressure_cases]
    pages = round(3.5 * sum(need) / len(need))  # room for ~3-4 of the 16 requests at once
    assert max(need) <= pages < sum(need) / 4
    cfg = engine.config.text
    per_page = PagePool.bytes_per_page(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                                       head_dim=cfg.head_dim, page_size=16, kv_cache_dtype=kv,
                                       model_dtype=torch.float32)
    small = tiny_engine_factory(**options, kv_cache_bytes=pages * per_page, debug_checks=True)
    assert small.stats()["pages_total"] == pages

    # unpressured: all 16 at once on the big pool
    reference = run_threads([lambda m=m: engine.generate(m, sampling) for m in pressure_cases])
    assert all(isinstance(r, Completion) and r.telemetry.preempted == 0 for r in reference)

    running_seen = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            running_seen.append(small.stats()["running"])
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    def dump():  # what the scheduler holds, should a request hang
        sch = small.loop.scheduler
        print("hung:", small.stats())
        for what, reqs in (("running", sch.running), ("waiting", sch.waiting)):
            print(what, [(r.id, r.status, r.num_computed, len(r.tokens), r.block_table) for r in reqs])

    pressured = run_threads([lambda m=m: small.generate(m, sampling) for m in pressure_cases], timeout=120,
                            on_hang=dump)
    stop.set()
    watcher.join()

    for ref, done in zip(reference, pressured, strict=True):
        assert isinstance(done, Completion), done  # debug_checks raised nothing inside the loop
        assert done.finish_reason == "length" and len(done.token_ids) == 48
        if TEST_DEVICE == "cpu" or kv == "auto":
            assert done.token_ids == ref.token_ids
        else:  # CUDA, FP8: other chunks run other kernels; FP8 rounding can amplify their summation order
            assert done.token_ids[0] == ref.token_ids[0]
        tel = done.telemetry
        assert tel.kv_pages <= pages
        if tel.preempted:
            assert tel.computed_tokens > tel.prompt_tokens  # recomputed after preemption
        else:
            assert tel.computed_tokens == tel.prompt_tokens
    assert sum(d.telemetry.preempted for d in pressured) > 0, "the pool was never short: no preemption"
    assert max(running_seen) >= 2
    assert_pool_idle(small)
    small.close()


# ------------------------------------------------------------------------------------------------
# cancellation
# ------------------------------------------------------------------------------------------------


def test_closing_a_stream_frees_its_pages(cases, engine):
    free_before = engine.stats()["pages_free"]
    stream = engine.stream(cases["one_photo"], SamplingParams(max_tokens=1000, ignore_eos=True))
    deltas = [next(stream), next(stream)]
    assert all(isinstance(d, str) and d for d in deltas)
    assert engine.stats()["pages_free"] < free_before  # it holds pages while running
    stream.close()  # cancels and waits until the pages are free
    stats = engine.stats()
    assert stats["pages_free"] == free_before and stats["running"] == 0
    assert_pool_idle(engine)


def test_cancel_from_another_thread(cases, engine):
    free_before = engine.stats()["pages_free"]
    handle = engine.submit(cases["text"], SamplingParams(max_tokens=1000, ignore_eos=True))
    reading = iter(handle)
    first = next(reading)
    assert isinstance(first, str)
    call_with_timeout(lambda: engine.cancel(handle))
    items = list(reading)
    done = items[-1]
    assert isinstance(done, Completion) and done.finish_reason == "cancelled"
    assert 1 <= len(done.token_ids) < 1000
    assert first + "".join(items[:-1]) == done.text
    assert engine.stats()["pages_free"] == free_before
    engine.cancel(handle)  # cancelling a finished request is a no-op
    assert_pool_idle(engine)


def test_cancel_a_waiting_request(cases, tiny_engine_factory):
    eng = tiny_engine_factory(**BASE, max_num_seqs=1)
    busy = eng.submit(cases["text"], SamplingParams(max_tokens=1000, ignore_eos=True))
    busy_reading = iter(busy)  # kept: a dropped iterator cancels its request
    assert isinstance(next(busy_reading), str)
    queued = eng.submit(cases["one_photo"], GREEDY)
    wait_until(lambda: eng.stats()["waiting"] == 1, what="a waiting request")
    eng.cancel(queued)
    assert queued.result(timeout=30).finish_reason == "cancelled"
    req = queued.request
    assert req.telemetry.vision_encoder_ran is False and req.tokens == req.prompt.input_ids
    eng.cancel(busy)
    assert_pool_idle(eng)
    eng.close()


# ------------------------------------------------------------------------------------------------
# streaming through the engine
# ------------------------------------------------------------------------------------------------


def test_stream_deltas_join_to_the_text_of_multibyte_outputs(cases, engine):
    non_ascii = 0
    for seed in range(3):
        sampling = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
        items = list(engine.stream(cases["text"], sampling))
        *deltas, done = items
        assert isinstance(done, Completion) and all(isinstance(d, str) and d for d in deltas)
        assert "".join(deltas) == done.text
        assert engine.generate(cases["text"], sampling).token_ids == done.token_ids  # seeded: reproducible
        non_ascii += any(ord(c) > 127 for c in done.text)
    assert non_ascii >= 1, "no multibyte output among the sampled answers"


class ScriptedSampler:
    """Stands in for :class:`engine.serving.sampling.Sampler`: emits fixed token ids, whatever the logits."""

    script: list[int] = []

    def __init__(self, params, device=None):
        self.i = 0

    def __call__(self, logits, seen_tokens=None):
        token = self.script[min(self.i, len(self.script) - 1)]
        self.i += 1
        return token


def test_stop_string_is_never_partly_streamed(cases, engine, monkeypatch):
    tok = engine.tokenizer
    stop = "<<STOP>>"
    assert len(tok.encode(stop, add_special_tokens=False)) > 1, "the stop string must span several tokens"
    before = "Hi 👩‍👩‍👧 你好, café "
    ScriptedSampler.script = tok.encode(before + stop + " never shown", add_special_tokens=False)
    monkeypatch.setattr(engine.intake, "make_sampler", ScriptedSampler)

    # temperature > 0: the request's own sampler picks every token (greedy ones may be batched)
    sampling = SamplingParams(max_tokens=64, stop=stop, temperature=1.0, seed=0)
    *deltas, done = list(engine.stream(cases["text"], sampling))
    assert done.finish_reason == "stop" and done.text == before
    assert "".join(deltas) == before
    seen = ""
    for d in deltas:
        seen += d
        assert "<" not in seen, "part of the stop string was streamed"
        assert "\ufffd" not in d
    assert sum("👩‍👩‍👧" in d for d in deltas) == 1, "the ZWJ emoji sequence was split across deltas"


def test_max_tokens_counts_generated_tokens_only(cases, engine):
    prompt_len = len(engine.prompts.build(cases["one_photo"]).input_ids)
    done = engine.generate(cases["one_photo"], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(done.token_ids) == 5 and done.finish_reason == "length" and prompt_len > 5
    assert done.telemetry.generated_tokens == 5 and done.telemetry.prompt_tokens == prompt_len
    assert len(done.prompt_token_ids) == prompt_len


# ------------------------------------------------------------------------------------------------
# refusals
# ------------------------------------------------------------------------------------------------


def test_oversized_requests_are_refused_at_submission(cases, engine, tiny_engine_factory):
    p = len(engine.prompts.build(cases["one_photo"]).input_ids)
    with pytest.raises(RequestTooLargeError, match="exceeds"):
        call_with_timeout(lambda: engine.generate(cases["one_photo"], SamplingParams(max_tokens=engine.max_model_len)))
    # a small pool: the request would fit the model's context but never the pool
    per_page = engine.pool.bytes_per_page(num_layers=3, num_kv_heads=2, head_dim=16, page_size=16,
                                          kv_cache_dtype="auto", model_dtype=torch.float32)
    small = tiny_engine_factory(**BASE, kv_cache_bytes=10 * per_page)
    assert small.max_model_len == 160 < engine.config.text.max_position_embeddings
    with pytest.raises(RequestTooLargeError):
        call_with_timeout(lambda: small.generate(cases["one_photo"], SamplingParams(max_tokens=160 - p + 1)))
    done = call_with_timeout(lambda: small.generate(cases["one_photo"], SamplingParams(max_tokens=160 - p,
                                                                                        ignore_eos=True)))
    assert len(done.token_ids) == 160 - p  # exactly the pool: accepted and finished
    assert_pool_idle(small)
    small.close()


def test_a_full_queue_refuses_the_excess(cases, tiny_engine_factory):
    eng = tiny_engine_factory(**BASE, max_num_seqs=1, max_waiting=2)
    slow = eng.submit(cases["text"], SamplingParams(max_tokens=5000, ignore_eos=True))
    slow_reading = iter(slow)  # kept: a dropped iterator cancels its request
    assert isinstance(next(slow_reading), str)  # running
    queued = [eng.submit(cases["text"], GREEDY) for _ in range(2)]
    assert eng.stats()["waiting"] == 2
    with pytest.raises(EngineOverloadedError, match="busy"):
        eng.submit(cases["text"], GREEDY)
    eng.cancel(slow)  # the queue drains: the waiting two complete
    for handle in queued:
        assert handle.result(timeout=30).finish_reason == "length"
    assert eng.generate(cases["text"], GREEDY).finish_reason == "length"  # accepted again
    assert_pool_idle(eng)
    eng.close()


def test_a_broken_image_fails_alone_among_concurrent_requests(cases, alone, engine, media_path, photos):
    broken = media_path("astronaut.png").read_bytes()[:5000]  # a truncated PNG
    jobs = {
        "one_photo": lambda: engine.generate(cases["one_photo"], GREEDY),
        "broken": lambda: engine.generate(user(photos["coffee"], broken, "Compare."), GREEDY),
        "three_photos": lambda: engine.generate(cases["three_photos"], GREEDY),
        "text": lambda: engine.generate(cases["text"], GREEDY),
    }
    results = dict(zip(jobs, run_threads(list(jobs.values())), strict=True))
    assert isinstance(results.pop("broken"), InvalidImageError)
    for name, done in results.items():
        assert isinstance(done, Completion), done
        assert done.token_ids == alone(name).token_ids
    assert_pool_idle(engine)


# ------------------------------------------------------------------------------------------------
# an internal failure
# ------------------------------------------------------------------------------------------------


def test_an_internal_error_fails_one_request_and_the_engine_goes_on(cases, alone, engine, photos, monkeypatch):
    bad_messages = user(photos["rocket"], "What is this?")
    bad_hash = engine.prompts.build(bad_messages).image_hashes[0]
    real = engine.loop.runner.encode_vision

    def encode(prompt, salt, items):
        if bad_hash in prompt.image_hashes:
            raise RuntimeError("simulated device failure")
        return real(prompt, salt, items)

    monkeypatch.setattr(engine.loop.runner, "encode_vision", encode)
    with pytest.raises(PrismError, match="simulated device failure"):
        call_with_timeout(lambda: engine.generate(bad_messages, GREEDY))
    assert_pool_idle(engine)
    # the next requests are served as usual
    assert engine.generate(cases["one_photo"], GREEDY).token_ids == alone("one_photo").token_ids
    assert engine.generate(cases["text"], GREEDY).token_ids == alone("text").token_ids
    assert_pool_idle(engine)


def test_an_internal_error_spares_the_requests_sharing_its_step(cases, alone, engine, photos, monkeypatch):
    bad_messages = user(photos["rocket"], "What is this?")
    bad_hash = engine.prompts.build(bad_messages).image_hashes[0]
    real_encode, real_execute = engine.loop.runner.encode_vision, engine.loop.runner.execute

    def encode(prompt, salt, items):
        if bad_hash in prompt.image_hashes:
            raise RuntimeError("simulated device failure")
        return real_encode(prompt, salt, items)

    # A plug request's step waits until the three requests are queued, so that the next step
    # admits them together: the failing request shares its step with the two good ones.
    plug_running, batches = threading.Event(), []
    real_schedule = engine.loop.scheduler.schedule

    def execute(plan):
        if not plug_running.is_set():
            plug_running.set()
            wait_until(lambda: engine.stats()["waiting"] == 3, what="three queued requests")
        return real_execute(plan)

    def schedule():
        plan = real_schedule()
        batches.append([run.req_id for run in plan.runs])
        return plan

    monkeypatch.setattr(engine.loop.runner, "encode_vision", encode)
    monkeypatch.setattr(engine.loop.runner, "execute", execute)
    monkeypatch.setattr(engine.loop.scheduler, "schedule", schedule)
    plug = engine.submit(cases["text"], SamplingParams(max_tokens=1))
    assert plug_running.wait(30)
    jobs = [lambda: engine.generate(bad_messages, GREEDY), lambda: engine.generate(cases["one_photo"], GREEDY),
            lambda: engine.generate(cases["text"], GREEDY)]
    bad, photo, text = run_threads(jobs)
    assert isinstance(plug.result(timeout=30), Completion)
    assert max(len(b) for b in batches) >= 3, batches
    assert isinstance(bad, PrismError) and "simulated device failure" in str(bad)
    assert isinstance(photo, Completion) and photo.token_ids == alone("one_photo").token_ids
    assert isinstance(text, Completion) and text.token_ids == alone("text").token_ids
    assert_pool_idle(engine)


def test_a_crash_of_the_engine_loop_fails_requests_instead_of_hanging(cases, tiny_engine_factory, monkeypatch):
    eng = tiny_engine_factory(**BASE)
    assert eng.generate(cases["text"], SamplingParams(max_tokens=2)).finish_reason == "length"

    def broken_schedule():
        raise RuntimeError("simulated scheduler bug")

    monkeypatch.setattr(eng.loop.scheduler, "schedule", broken_schedule)
    with pytest.raises(PrismError, match="simulated scheduler bug"):
        call_with_timeout(lambda: eng.generate(cases["text"], GREEDY))
    with pytest.raises(PrismError, match="closed"):  # the engine stopped: it says so at once
        eng.generate(cases["text"], GREEDY)
    eng.close()


def test_identical_prompts_in_flight_finish_in_any_order(cases, alone, engine):
    """Requests are told apart by identity: two of the same prompt (equal ids, positions, pixels)
    running side by side, the later one finishing first."""
    lengths = [12, 6, 3]
    results = run_threads([lambda n=n: engine.generate(cases["one_photo"], SamplingParams(max_tokens=n,
                                                                                         ignore_eos=True))
                           for n in lengths])
    for n, done in zip(lengths, results, strict=True):
        assert isinstance(done, Completion), done
        assert done.token_ids == alone("one_photo").token_ids[:n]
    assert_pool_idle(engine)


# ------------------------------------------------------------------------------------------------
# threads, lifecycle, telemetry, stats
# ------------------------------------------------------------------------------------------------


def test_eight_threads_two_requests_each(photos, engine):
    prompts = [[{"role": "user", "content": t}] for t in PRESSURE_TEXTS[:5]]
    prompts += [user(photos[n], "What is this?") for n in ("coins", "logo", "page")]
    sampling = SamplingParams(max_tokens=10, ignore_eos=True)
    expected = [engine.generate(m, sampling).token_ids for m in prompts]

    def worker(i):
        return [engine.generate(prompts[i], sampling).token_ids,
                engine.generate(prompts[(i + 3) % 8], sampling).token_ids]

    results = run_threads([lambda i=i: worker(i) for i in range(8)])
    for i, got in enumerate(results):
        assert not isinstance(got, BaseException), got
        assert got == [expected[i], expected[(i + 3) % 8]]
    assert_pool_idle(engine)


def test_close_context_manager_and_requests_after_close(cases, alone, tiny_engine_factory):
    with tiny_engine_factory(**BASE) as eng:
        assert eng.generate(cases["text"], GREEDY).token_ids == alone("text").token_ids
        # a request still running when the engine closes fails instead of hanging
        running = eng.stream(cases["text"], SamplingParams(max_tokens=5000, ignore_eos=True))
        assert isinstance(next(running), str)
    assert not eng.loop.is_alive(), "close() must stop the loop thread"
    with pytest.raises(PrismError, match="closed"):
        call_with_timeout(lambda: list(running))
    with pytest.raises(PrismError, match="closed"):
        eng.generate(cases["text"], GREEDY)
    with pytest.raises(PrismError, match="closed"):
        eng.submit(cases["text"], GREEDY)
    eng.close()  # closing twice is harmless


def test_telemetry_and_stats(cases, photos, tiny_engine_factory):
    eng = tiny_engine_factory(**BASE)
    stats = eng.stats()
    for key in ("pages_total", "pages_used", "pages_free", "running", "waiting", "steps", "tokens_generated"):
        assert key in stats
    assert (stats["steps"], stats["tokens_generated"], stats["pages_used"]) == (0, 0, 0)

    messages = user(photos["grace_hopper"], "Who is this?")
    prompt = eng.prompts.build(messages)
    done = eng.generate(messages, GREEDY)
    tel = done.telemetry
    assert tel.prompt_tokens == len(prompt.input_ids) and tel.visual_tokens == prompt.num_visual_tokens > 0
    assert tel.computed_tokens == tel.prompt_tokens and tel.preempted == 0
    assert tel.vision_encoder_ran is True and tel.vision_ms > 0
    assert tel.generated_tokens == GEN
    assert 0 <= tel.queue_ms <= tel.ttft_ms <= tel.e2e_ms
    assert 0 < tel.preprocess_ms <= tel.queue_ms  # building the prompt is part of the wait
    assert tel.decode_tokens_per_s > 0 and tel.tpot_ms > 0
    # the K/V of the prompt and of all generated tokens but the last
    assert tel.kv_pages == math.ceil((tel.prompt_tokens + GEN - 1) / 16)

    text = eng.generate(cases["text"], GREEDY).telemetry
    assert text.visual_tokens == 0 and text.vision_encoder_ran is False and text.vision_ms == 0
    assert text.computed_tokens == text.prompt_tokens

    stats = eng.stats()
    assert stats["steps"] == 2 * GEN and stats["tokens_generated"] == 2 * GEN
    assert stats["pages_used"] == 0 and stats["pages_free"] == stats["pages_total"] == eng.pool.num_pages
    assert stats["running"] == 0 and stats["waiting"] == 0

    # while one request runs and another waits
    one_seq = tiny_engine_factory(**BASE, max_num_seqs=1)
    busy = one_seq.submit(cases["text"], SamplingParams(max_tokens=1000, ignore_eos=True))
    busy_reading = iter(busy)  # kept: a dropped iterator cancels its request
    assert isinstance(next(busy_reading), str)
    queued = one_seq.submit(cases["text"], GREEDY)
    wait_until(lambda: one_seq.stats()["waiting"] == 1, what="one waiting request")
    live = one_seq.stats()
    assert live["running"] == 1 and live["pages_used"] == len(busy.request.block_table) > 0
    assert live["pages_used"] + live["pages_free"] == live["pages_total"]
    one_seq.cancel(queued)
    one_seq.cancel(busy)
    assert_pool_idle(one_seq)
    one_seq.close()
    eng.close()
