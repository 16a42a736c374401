"""The compact prefix cache end to end: a cache hit must change nothing but the work done.

Every case compares the tokens of a cache hit with a cold run of the same prompt (a fresh engine
with the same settings, or the engine's own miss), and, where the cache is exact (compaction
off, K/V pages in the model dtype), with transformers' ``Qwen3VLForConditionalGeneration``. With
compaction on, the oracle is :mod:`engine.cache.reference_masked` (dense attention whose mask drops the
removed prefix positions for every later query).

Engines come from ``tiny_engine_factory`` (one shared "test" checkpoint model, float32, CPU), with
small images (``max_pixels`` 256 x 256: 64 visual tokens for a square photo) and 12 greedy tokens
(``ignore_eos``). ``debug_checks`` checks the pool's page accounting, cache entries included,
after every engine step.
"""

from __future__ import annotations

import contextlib
import io
import threading
import time

import pytest
import torch
from conftest import TEST_DEVICE
from PIL import Image

from engine import Completion, SamplingParams
from engine.cache.compaction import SELECTORS
from engine.cache.prefix_cache import prefix_key
from engine.cache.reference_masked import masked_greedy, masked_greedy_logits
from engine.inputs.prompts import media_first_messages
from engine.serving.request import Status

N_TOKENS = 12
SP = SamplingParams(max_tokens=N_TOKENS, ignore_eos=True)
MAX_PIXELS = 256 * 256
#: Settings of most engines here: small images and pool, page accounting checked every step.
BASE = {"max_pixels": MAX_PIXELS, "kv_cache_bytes": 16 << 20, "debug_checks": True}
#: Exact settings: K/V pages in float32, so a hit can be compared with dense references.
EXACT = {**BASE, "kv_cache_dtype": "auto"}
#: Hit vs cold logits. The cold prompt attends to its own K/V through SDPA, the hit's question to
#: the pages through the paged reference (on CUDA: decode-graph rows, split-context attention):
#: float32 sums in other orders, measured up to 1.3e-5 on the CPU, 1.5e-5 on CUDA.
LOGITS_ATOL = 3e-5 if TEST_DEVICE == "cpu" else 1e-4

Q1 = "What is in this picture?"
Q2 = "Describe the colours you can see."
Q3 = "Is there any text?"
LONG_Q = "Please list, one by one and in great detail, every object, colour, shape and texture you see " * 2


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def wait_done(handle, timeout: float = 120.0) -> Completion:
    """The completion of a submitted request's handle (deltas skipped; errors raised)."""
    return handle.result(timeout=timeout)


def run(engine, messages, salt: str | None = "s", sampling: SamplingParams = SP):
    """Submit, wait, and return ``(completion, request)`` (the engine's request carries its prefix key)."""
    handle = engine.submit(messages, sampling, cache_salt=salt)
    return wait_done(handle), handle.request


def gen(engine, messages, salt: str | None = "s", sampling: SamplingParams = SP) -> Completion:
    return run(engine, messages, salt, sampling)[0]


def poll(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)


class LogitsRecorder:
    """Stands in for ``engine.loop.runner.model``: forwards every step and keeps the float32 logits
    rows it returns (one per request that samples in that step, in batch order)."""

    def __init__(self, model):
        self.model = model
        self.rows: list[torch.Tensor] = []

    def __call__(self, *args, **kwargs):
        logits = self.model(*args, **kwargs)
        self.rows.extend(logits.detach().clone())
        return logits


@contextlib.contextmanager
def recorded_logits(engine):
    """Record the logits of every sampled token while the block runs (run one request at a time:
    then row ``i`` is the distribution generated token ``i`` was chosen from)."""
    recorder = LogitsRecorder(engine.loop.runner.model)
    runner = engine.loop.runner
    runner.model, graphs, prefill_graphs = recorder, runner.graphs, runner.prefill_graphs
    # (CUDA) replayed graphs would bypass the recorder: steps run eagerly
    runner.graphs = runner.prefill_graphs = None
    try:
        yield recorder.rows
    finally:
        runner.model, runner.graphs, runner.prefill_graphs = recorder.model, graphs, prefill_graphs


def gen_with_logits(engine, messages, salt="s") -> tuple[Completion, torch.Tensor]:
    with recorded_logits(engine) as rows:
        done = gen(engine, messages, salt)
    assert len(rows) == N_TOKENS
    return done, torch.stack(rows)


def solid(colour: str, size: int = 256) -> Image.Image:
    return Image.new("RGB", (size, size), colour)


@pytest.fixture(scope="module")
def make(tiny_engine_factory):
    return tiny_engine_factory


@pytest.fixture(scope="module")
def photos(media_path):
    def load(name):
        with Image.open(media_path(name)) as im:
            return im.convert("RGB")

    return {n: load(n + ".png") for n in ("astronaut", "chelsea", "coffee")}


# ------------------------------------------------------------------------------------------------
# exactness: hit == cold run == transformers (compaction off) / masked reference (compaction on)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf(tiny_ckpt):
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(tiny_ckpt)


def hf_greedy(hf, messages, engine) -> list[int]:
    """transformers' greedy tokens for ``messages`` (its own processor, our ``max_pixels``)."""
    model, processor = hf
    images = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"]
              if p["type"] == "image"]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    size = {"shortest_edge": processor.image_processor.size["shortest_edge"], "longest_edge": MAX_PIXELS}
    inputs = dict(processor(text=[text], images=images, size=size, return_tensors="pt"))
    assert "mm_token_type_ids" in inputs
    assert inputs["input_ids"][0].tolist() == engine.prompts.build(messages).input_ids
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=N_TOKENS, min_new_tokens=N_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_cached_images_give_the_processors_tokens(make, photos, hf):
    """Asking again about cached images splices the image pads between separately tokenised text
    pieces; the ids equal the processor's own for several photos of different sizes and questions
    with runs of whitespace, punctuation and non-ASCII text."""
    _, processor = hf
    engine = make(**EXACT)
    images = [photos["astronaut"], photos["coffee"].resize((120, 64)), photos["astronaut"].resize((48, 200))]
    size = {"shortest_edge": processor.image_processor.size["shortest_edge"], "longest_edge": MAX_PIXELS}
    for question in ("What is in the pictures?", "  Compare them:\n1) colours; 2) shapes ... ok?  ", "Ünïcödé ✓ 😀"):
        messages = media_first_messages(images, question)
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        expected = processor(text=[text], images=images, size=size, return_tensors="pt")["input_ids"][0].tolist()
        hits = engine.prompts.cache_hits
        assert engine.prompts.build(messages).input_ids == expected
        assert engine.prompts.build(messages).input_ids == expected
        assert engine.prompts.cache_hits >= hits + len(images)  # the second build used the cached pixels


def test_dense_hit_equals_cold_run_and_transformers(make, photos, hf):
    cached = make(**EXACT, compaction=None, conversation_reuse=False)
    cold = make(**EXACT, prefix_cache=False)
    img = photos["astronaut"]
    first = gen(cached, media_first_messages([img], Q1))
    assert first.telemetry.prefix_cache == "miss"
    messages = media_first_messages([img], Q2)
    hit, hit_logits = gen_with_logits(cached, messages)
    ref, ref_logits = gen_with_logits(cold, messages)
    assert hit.telemetry.prefix_cache == "hit" and ref.telemetry.prefix_cache == "off"
    assert hit.telemetry.cached_tokens == cached.prompts.build(messages).prefix_len
    assert hit.token_ids == ref.token_ids == hf_greedy(hf, messages, cold)
    torch.testing.assert_close(hit_logits[0], ref_logits[0], rtol=0, atol=LOGITS_ATOL)
    torch.testing.assert_close(hit_logits, ref_logits, rtol=0, atol=LOGITS_ATOL)


@pytest.fixture(scope="module", params=sorted(SELECTORS))
def compact_pair(make, request):
    """Two engines with compaction on (keep 0.6, each selector of SELECTORS) and exact pages: one
    warmed by Q1, one fresh."""
    return (make(**EXACT, conversation_reuse=False, compaction=request.param),
            make(**EXACT, conversation_reuse=False, compaction=request.param))


def test_compacted_hit_equals_cold_run_and_masked_reference(compact_pair, photos):
    warm, fresh = compact_pair
    img = photos["astronaut"]
    assert gen(warm, media_first_messages([img], Q1)).telemetry.prefix_cache == "miss"
    messages = media_first_messages([img], Q2)
    hit, hit_logits = gen_with_logits(warm, messages)
    cold, cold_logits = gen_with_logits(fresh, messages)
    assert (hit.telemetry.prefix_cache, cold.telemetry.prefix_cache) == ("hit", "miss")
    assert hit.telemetry.visual_tokens_kept < hit.telemetry.visual_tokens
    assert hit.token_ids == cold.token_ids
    torch.testing.assert_close(hit_logits, cold_logits, rtol=0, atol=LOGITS_ATOL)
    ref_tokens, ref_logits = masked_greedy_logits(warm, messages, N_TOKENS)
    assert hit.token_ids == ref_tokens
    torch.testing.assert_close(hit_logits, ref_logits, rtol=0, atol=1e-4)


def test_masked_reference_keep_all_equals_plain_engine(make, photos):
    plain = make(**EXACT, prefix_cache=False)
    keep_all = make(**EXACT, keep_ratio=1.0)
    messages = media_first_messages([photos["chelsea"]], Q1)
    expected = gen(plain, messages).token_ids
    assert masked_greedy(keep_all, messages, N_TOKENS) == expected
    assert masked_greedy(plain, messages, N_TOKENS) == expected  # no prefix cache: nothing removed
    assert gen(keep_all, messages).token_ids == expected


def test_masked_reference_is_not_trivial(compact_pair, make, photos):
    """With keep 0.6 the masked reference really differs from dense attention (the oracle bites)."""
    plain = make(**EXACT, prefix_cache=False)
    messages = media_first_messages([photos["astronaut"]], Q3)
    _, masked = masked_greedy_logits(compact_pair[0], messages, 1)
    _, dense = masked_greedy_logits(plain, messages, 1)
    assert (masked - dense).abs().max() > 1e-2


def test_fp8_hit_equals_cold_run(make, photos):
    warm, fresh = make(**BASE), make(**BASE)  # default kv_cache_dtype: Scaled-FP8 pages
    assert warm.pool.kv_cache_dtype == "fp8_e4m3"
    img = photos["coffee"]
    assert gen(warm, media_first_messages([img], Q1)).telemetry.prefix_cache == "miss"
    messages = media_first_messages([img], Q2)
    hit, cold = gen(warm, messages), gen(fresh, messages)
    assert (hit.telemetry.prefix_cache, cold.telemetry.prefix_cache) == ("hit", "miss")
    assert hit.token_ids == cold.token_ids


# ------------------------------------------------------------------------------------------------
# isolation: what may never hit
# ------------------------------------------------------------------------------------------------


def test_different_images_never_hit_each_other(make, photos):
    engine = make(**BASE)
    a, b = photos["astronaut"], photos["chelsea"]
    assert gen(engine, media_first_messages([a], Q1), "one").telemetry.prefix_cache == "miss"
    assert gen(engine, media_first_messages([b], Q1), "one").telemetry.prefix_cache == "miss"  # same session
    assert gen(engine, media_first_messages([b], Q2), "two").telemetry.prefix_cache == "miss"  # other session
    assert gen(engine, media_first_messages([a], Q2), "one").telemetry.prefix_cache == "hit"
    assert gen(engine, media_first_messages([b], Q3), "one").telemetry.prefix_cache == "hit"


def test_same_image_under_another_salt_is_a_miss_with_no_shared_work(make, photos):
    engine = make(**BASE)
    img = photos["astronaut"]
    first = gen(engine, media_first_messages([img], Q1), "alice")
    other = gen(engine, media_first_messages([img], Q2), "bob")
    again = gen(engine, media_first_messages([img], Q2), "alice")
    assert (first.telemetry.prefix_cache, first.telemetry.vision_encoder_ran) == ("miss", True)
    # nothing of alice's session is observable to bob: no KV reuse and no vision-feature reuse
    assert (other.telemetry.prefix_cache, other.telemetry.vision_encoder_ran) == ("miss", True)
    assert other.telemetry.cached_tokens == 0
    assert (again.telemetry.prefix_cache, again.telemetry.vision_encoder_ran) == ("hit", False)
    assert other.token_ids == again.token_ids  # the answer itself does not depend on the session
    assert engine.stats()["vision_cache_hits"] == 0


def test_global_scope_shares_across_salts(make, photos):
    engine = make(**BASE, cache_scope="global")
    img = photos["astronaut"]
    assert gen(engine, media_first_messages([img], Q1), "alice").telemetry.prefix_cache == "miss"
    other = gen(engine, media_first_messages([img], Q2), "bob")
    assert (other.telemetry.prefix_cache, other.telemetry.vision_encoder_ran) == ("hit", False)


def test_max_pixels_is_part_of_the_key(make):
    """A small image gives the same grid, tokens and pixels under both settings; the key must still differ
    (two engines never share a cache, but the namespace is what keeps a shared store apart)."""
    big, small = make(**BASE), make(**{**BASE, "max_pixels": 128 * 128})
    messages = media_first_messages([solid("purple", 96)], Q1)
    pb, ps = big.prompts.build(messages), small.prompts.build(messages)
    assert pb.input_ids == ps.input_ids and torch.equal(pb.pixel_values, ps.pixel_values)
    assert pb.image_hashes == ps.image_hashes
    assert big.namespace != small.namespace
    (_, rb), (_, rs) = run(big, messages), run(small, messages)
    assert rb.prefix_key != rs.prefix_key


def _png_with_alpha() -> bytes:
    """A 256 x 256 RGBA PNG: an opaque red disc on a fully transparent, half-transparent ramp."""
    im = Image.new("RGBA", (256, 256), (0, 0, 0, 0))
    for x in range(256):
        for y in range(0, 256, 2):
            im.putpixel((x, y), (0, 128, 255, x))
    im.paste((255, 0, 0, 255), (64, 64, 192, 192))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def test_image_background_is_part_of_the_key(make):
    """The same RGBA PNG bytes composited on white and on black: different pixels, different keys."""
    data = _png_with_alpha()
    with Image.open(io.BytesIO(data)) as im:
        assert im.mode == "RGBA" and im.getextrema()[3] == (0, 255)
    white, black = make(**BASE), make(**{**BASE, "image_background": (0, 0, 0)})
    messages = media_first_messages([data], Q1)
    pw, pk = white.prompts.build(messages), black.prompts.build(messages)
    assert pw.input_ids == pk.input_ids and pw.image_hashes != pk.image_hashes
    assert white.namespace != black.namespace
    (dw, rw), (dk, rk) = run(white, messages), run(black, messages)
    assert rw.prefix_key != rk.prefix_key
    assert dw.telemetry.prefix_cache == dk.telemetry.prefix_cache == "miss"
    # and a key computed as if the backgrounds shared a namespace still differs, through the hashes
    n = pw.prefix_len
    assert prefix_key("ns", "s", pw.image_hashes, "c", pw.input_ids[:n]) != prefix_key(
        "ns", "s", pk.image_hashes, "c", pk.input_ids[:n])


def test_four_colours_in_one_session_each_answer_like_a_fresh_engine(make):
    session = make(**BASE)
    outputs = []
    for colour in ("red", "green", "blue", "yellow"):
        messages = media_first_messages([solid(colour)], Q1)
        got = gen(session, messages, "one-chat")
        assert got.telemetry.prefix_cache == "miss"
        assert got.token_ids == gen(make(**BASE), messages, "one-chat").token_ids, colour
        outputs.append(tuple(got.token_ids))
    assert len(set(outputs)) > 1  # the image matters to this model (else the check above is empty)
    assert session.stats()["cache_hits"] == 0


# ------------------------------------------------------------------------------------------------
# batching, chunking, memory pressure
# ------------------------------------------------------------------------------------------------


def test_hit_with_chunked_question_and_concurrent_text_request(make, photos):
    engine = make(**EXACT, max_num_batched_tokens=8, conversation_reuse=False)
    img = photos["chelsea"]
    assert gen(engine, media_first_messages([img], Q1)).telemetry.prefix_cache == "miss"
    image_msgs = media_first_messages([img], LONG_Q)
    text_msgs = [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}]
    with engine.loop.paused():  # both arrive in the same loop iteration
        r_img = engine.submit(image_msgs, SP, cache_salt="s")
        r_txt = engine.submit(text_msgs, SP, cache_salt="s")
    together_img, together_txt = wait_done(r_img), wait_done(r_txt)
    assert together_img.telemetry.prefix_cache == "hit"
    assert together_img.telemetry.computed_tokens > 8  # the question really was chunked
    assert together_txt.telemetry.prefix_cache == "off"
    alone_img, alone_txt = gen(engine, image_msgs), gen(engine, text_msgs)
    assert alone_img.telemetry.prefix_cache == "hit"
    assert together_img.token_ids == alone_img.token_ids == masked_greedy(engine, image_msgs, N_TOKENS)
    assert together_txt.token_ids == alone_txt.token_ids


def _pool_bytes(engine_pages: int) -> int:
    # "test" preset: 3 layers x 2 KV heads x 16 dims x float32, K and V: 768 bytes a token a page row
    return engine_pages * 16 * 3 * 2 * 2 * 16 * 4


def test_eviction_round_robin_three_sessions(make):
    """A pool for about two cached prefixes and three sessions asked in turn, two questions a visit:
    each visit's first question misses (the two other sessions' visits since evicted its prefix),
    its second hits (the prefix the first cached); every answer equals a cold run, and the page
    accounting (cache entries included) holds after every step."""
    # each prompt: 74-token prefix (64 visual) -> 48 kept tokens = 3 pages; a request runs in 5 pages
    engine = make(**{**EXACT, "kv_cache_bytes": _pool_bytes(9)})
    reference = make(**EXACT, conversation_reuse=False)
    assert engine.stats()["pages_total"] == 9
    images = {"a": solid("red"), "b": solid("green"), "c": solid("blue")}
    seen = {"hit": 0, "miss": 0}
    for visit, questions in enumerate(((Q1, Q2), (Q3, LONG_Q))):
        for salt, img in images.items():
            for question, expected in zip(questions, ("miss", "hit"), strict=True):
                messages = media_first_messages([img], question)
                got = gen(engine, messages, salt)
                assert got.telemetry.prefix_cache == expected, (visit, salt, question)
                seen[expected] += 1
                assert got.token_ids == gen(reference, messages, f"ref-{visit}").token_ids, (visit, salt)
    stats = engine.stats()
    assert stats["cache_evictions"] > 0 and seen["miss"] >= 6 and seen["hit"] >= 6
    assert stats["cache_misses"] == seen["miss"] and stats["cache_hits"] == seen["hit"]
    assert stats["pages_used"] == stats["cache_pages"] <= 9


def test_prefixes_of_equal_value_are_evicted_least_recently_used_first(make):
    """The documented tie-break: among entries of equal value (no hits yet, same saved tokens and
    pages) the least recently used goes first. Room for two 3-page prefixes beside a request (9
    pages, a request runs in 5): a, b, c miss, c's evicting a (older than b); then b hits, and a
    misses, evicting c (no hit, below b's one). Evicting the most recent first would evict b for c,
    so b would miss and a hit."""
    engine = make(**{**EXACT, "kv_cache_bytes": _pool_bytes(9)}, conversation_reuse=False)
    reference = make(**EXACT, conversation_reuse=False)
    images = {"a": solid("red"), "b": solid("green"), "c": solid("blue")}
    order = ["a", "b", "c", "b", "a"]
    want = [("miss", 0), ("miss", 0), ("miss", 1), ("hit", 1), ("miss", 2)]  # (prefix cache, evictions so far)
    got = []
    for salt in order:
        messages = media_first_messages([images[salt]], Q1)
        done = gen(engine, messages, salt)
        got.append((done.telemetry.prefix_cache, engine.stats()["cache_evictions"]))
        assert done.token_ids == gen(reference, messages, f"ref-{len(got)}").token_ids, salt
    assert got == want


def test_hit_that_needs_room_never_evicts_its_own_prefix(make):
    """Regression: making room for a hit's question could evict the very entry it matched (then the
    request ran on uninitialised pages while reporting a hit)."""
    # two dense 74-token prefixes (5 pages each) fill 10 of 12 pages; a long question needs 4 more
    engine = make(**{**EXACT, "kv_cache_bytes": _pool_bytes(12)}, compaction=None, conversation_reuse=False)
    reference = make(**EXACT, compaction=None)
    red, green = solid("red"), solid("green")
    assert gen(engine, media_first_messages([red], "What?"), "a").telemetry.prefix_cache == "miss"
    assert gen(engine, media_first_messages([green], "What?"), "b").telemetry.prefix_cache == "miss"
    assert engine.stats()["pages_free"] == 2
    messages = media_first_messages([red], LONG_Q)
    got = gen(engine, messages, "a")
    assert got.telemetry.prefix_cache == "hit"
    assert got.token_ids == gen(reference, messages, "a").token_ids
    assert engine.stats()["cache_evictions"] == 1  # green's entry made the room


def test_stale_prefix_falls_back_to_a_cold_run(make, photos):
    engine = make(**EXACT, max_num_seqs=1, conversation_reuse=False)
    img = photos["astronaut"]
    assert gen(engine, media_first_messages([img], Q1)).telemetry.prefix_cache == "miss"
    blocker = engine.submit([{"role": "user", "content": "Count."}], SamplingParams(max_tokens=4000, ignore_eos=True))
    poll(lambda: blocker.request.status is Status.RUNNING)
    messages = media_first_messages([img], Q2)
    waiting = engine.submit(messages, SP, cache_salt="s")
    poll(lambda: waiting.request.telemetry.prefix_cache == "hit")  # looked up at intake, waiting for a slot
    assert waiting.request.status is Status.WAITING
    engine.clear_prefix_cache()
    assert engine.stats()["cache_entries"] == 0
    engine.cancel(blocker)
    done = wait_done(waiting)
    assert done.telemetry.prefix_cache == "stale"
    assert done.telemetry.vision_encoder_ran is False  # features came from the session's vision cache
    assert done.telemetry.computed_tokens == done.telemetry.prompt_tokens
    assert done.token_ids == gen(make(**EXACT), messages).token_ids
    stats = engine.stats()
    assert stats["cache_stale"] == 1 and stats["cache_entries"] == 1  # recomputed and cached again


def test_preempted_request_attached_to_a_prefix(make, photos):
    """Two hits decoding long answers in a pool too small for both: one is preempted (its attached
    prefix released and re-attached on readmission) and both answers equal their solo runs."""
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    # the kept prefix is 3 full pages; each answer needs 4 private pages more: 11 > 10
    engine = make(**{**EXACT, "kv_cache_bytes": _pool_bytes(10)}, conversation_reuse=False)
    solo = make(**EXACT, conversation_reuse=False)
    img = photos["astronaut"]
    assert gen(engine, media_first_messages([img], Q1), sampling=sp).telemetry.prefix_cache == "miss"
    m2, m3 = media_first_messages([img], Q2), media_first_messages([img], Q3)
    with engine.loop.paused():
        r2, r3 = engine.submit(m2, sp, cache_salt="s"), engine.submit(m3, sp, cache_salt="s")
    d2, d3 = wait_done(r2), wait_done(r3)
    assert d2.telemetry.prefix_cache == d3.telemetry.prefix_cache == "hit"
    assert d2.telemetry.preempted + d3.telemetry.preempted >= 1
    assert d2.token_ids == gen(solo, m2, sampling=sp).token_ids
    assert d3.token_ids == gen(solo, m3, sampling=sp).token_ids
    stats = engine.stats()
    assert stats["cache_entries"] == 1 and stats["pages_used"] == stats["cache_pages"]


def test_identical_concurrent_cold_pair(make, photos):
    """Both looked up (misses) before either computed the prefix: the first computes it, the second
    waits for that computation (one in-flight mechanism with host-tier restores) and then hits it,
    instead of computing the same prefix again."""
    engine = make(**EXACT)
    messages = media_first_messages([photos["coffee"]], Q1)
    with engine.loop.paused():
        ra, rb = engine.submit(messages, SP, cache_salt="s"), engine.submit(messages, SP, cache_salt="s")
    da, db = wait_done(ra), wait_done(rb)
    assert da.telemetry.prefix_cache == "miss" and db.telemetry.prefix_cache == "hit"
    prefix_len = engine.prompts.build(messages).prefix_len
    assert db.telemetry.cached_tokens == prefix_len
    assert db.telemetry.computed_tokens == db.telemetry.prompt_tokens - prefix_len
    stats = engine.stats()
    assert (stats["cache_hits"], stats["cache_misses"]) == (1, 1)
    assert da.token_ids == db.token_ids == gen(make(**EXACT), messages).token_ids
    assert len(engine.prefix_cache.prefixes) == 1
    later = gen(engine, media_first_messages([photos["coffee"]], Q2))
    assert later.telemetry.prefix_cache == "hit"


# ------------------------------------------------------------------------------------------------
# conversation reuse, page saving, telemetry
# ------------------------------------------------------------------------------------------------


def test_conversation_reuse_computes_only_the_new_question(make, photos):
    engine = make(**EXACT)
    plain = make(**EXACT, conversation_reuse=False)
    img = photos["chelsea"]
    t1 = gen(engine, media_first_messages([img], Q1))
    t2 = gen(engine, media_first_messages([img], Q2, history=[(Q1, t1.text)]))
    messages = media_first_messages([img], Q3, history=[(Q1, t1.text), (Q2, t2.text)])
    t3 = gen(engine, messages)
    tel = t3.telemetry
    prompt = engine.prompts.build(messages)
    assert tel.prefix_cache == "hit"
    assert tel.conversation_reuse_tokens > 0
    assert tel.cached_tokens == prompt.prefix_len + tel.conversation_reuse_tokens
    assert tel.computed_tokens == tel.prompt_tokens - tel.cached_tokens
    # everything of turn 2's prompt is reused: only its answer's re-tokenised tail and the new question run
    assert tel.cached_tokens >= t2.telemetry.prompt_tokens
    cold = gen(plain, messages)
    assert cold.telemetry.conversation_reuse_tokens == 0
    assert t3.token_ids == cold.token_ids == masked_greedy(engine, messages, N_TOKENS)


def test_page_saving_matches_keep_ratio(make, media_path):
    """Two photos at 448 x 448 max (~380 visual tokens), keep 0.6, 16-token pages: the compact prefix
    saves (1 - 0.6) * visual / 16 pages, within 1.5 pages (page rounding of the dense and the compact
    lengths), and the freed pages go back to the pool."""
    engine = make(kv_cache_bytes=16 << 20, debug_checks=True, max_pixels=448 * 448, page_size=16,
                  keep_ratio=0.6, conversation_reuse=False)
    photos = [media_path("astronaut.png"), media_path("coffee.png")]
    messages = media_first_messages(photos, Q1)
    prompt = engine.prompts.build(messages)
    done = gen(engine, messages)
    tel = done.telemetry
    assert tel.visual_tokens >= 300
    saved = tel.prefix_pages_dense - tel.prefix_pages
    assert abs(saved - 0.4 * tel.visual_tokens / 16) <= 1.5
    n = prompt.prefix_len
    assert tel.prefix_pages_dense == -(-n // 16)
    assert tel.prefix_pages == -(-(n - tel.visual_tokens + tel.visual_tokens_kept) // 16)
    stats = engine.stats()
    assert stats["pages_used"] == stats["cache_pages"] == tel.prefix_pages
    hit = gen(engine, media_first_messages(photos, Q2))
    assert hit.telemetry.prefix_cache == "hit"
    assert (hit.telemetry.prefix_pages, hit.telemetry.prefix_pages_dense) == (tel.prefix_pages, tel.prefix_pages_dense)


def test_hit_and_miss_telemetry_and_stats(make, photos):
    engine = make(**BASE, conversation_reuse=False)
    img = photos["astronaut"]
    miss = gen(engine, media_first_messages([img], Q1))
    messages = media_first_messages([img], Q2)
    hit = gen(engine, messages)
    prompt = engine.prompts.build(messages)
    m, h = miss.telemetry, hit.telemetry
    assert (m.prefix_cache, m.vision_encoder_ran, m.cached_tokens) == ("miss", True, 0)
    assert m.computed_tokens == m.prompt_tokens
    assert (h.prefix_cache, h.vision_encoder_ran) == ("hit", False)
    assert h.cached_tokens == prompt.prefix_len and h.conversation_reuse_tokens == 0
    assert h.computed_tokens == h.prompt_tokens - h.cached_tokens == len(prompt.input_ids) - prompt.prefix_len
    assert h.visual_tokens == 64 and h.visual_tokens_kept == m.visual_tokens_kept == 38  # 0.6 * 64 = 38.4
    assert abs(h.visual_tokens_kept - 0.6 * h.visual_tokens) <= 1
    assert h.vision_ms == 0.0 and m.vision_ms > 0.0
    stats = engine.stats()
    expected = {"prefix_cache": True, "cache_entries": 1, "cache_prefixes": 1, "cache_pages": h.prefix_pages,
                "cache_hits": 1,
                "cache_misses": 1, "cache_stale": 0, "cache_evictions": 0,
                "prompt_tokens_saved": h.cached_tokens, "vision_cache_hits": 0, "vision_cache_entries": 1}
    assert {k: stats[k] for k in expected} == expected
    # after clearing, the prefix is recomputed but the session's vision features are reused
    engine.clear_prefix_cache()
    again = gen(engine, media_first_messages([img], Q3))
    assert (again.telemetry.prefix_cache, again.telemetry.vision_encoder_ran) == ("miss", False)
    stats = engine.stats()
    assert stats["cache_evictions"] == 1 and stats["vision_cache_hits"] == 1 and stats["cache_misses"] == 2


def test_prefix_and_extension_evictions_are_counted_apart():
    """Evicting a conversation extension (a finished turn kept for reuse) and evicting an image
    prefix are counted apart, and ``evictions`` stays their sum. Model-free: a cache over a bare
    page pool. With one shared counter, the Engine tab could not tell a cache that drops old turns
    (cheap: one question recomputed) from one that drops the images' KV (the vision encoder and
    the whole prefix run again)."""
    from engine.cache.kv_pool import PagePool
    from engine.cache.prefix_cache import PrefixCache

    pool = PagePool(num_layers=1, num_kv_heads=1, head_dim=8, num_pages=8, page_size=4,
                    kv_cache_dtype="auto", model_dtype=torch.float32)
    cache = PrefixCache(pool)
    prefix_pages = pool.allocate(2)
    prefix = cache.add_prefix("key", "salt", list(range(8)), prefix_pages, 8, 2, 4)
    turn_pages = prefix_pages + pool.allocate(1)
    cache.add_extension(prefix, list(range(12)), turn_pages, 12)
    pool.release(turn_pages)  # the request is done: only the cache holds the pages now
    assert cache.evictable() == [prefix.children[0]]  # the turn goes first: the prefix is extended
    cache.make_room(pool.num_free + 1)
    assert (cache.stats.prefix_evictions, cache.stats.extension_evictions, cache.stats.evictions) == (0, 1, 1)
    cache.clear()
    assert (cache.stats.prefix_evictions, cache.stats.extension_evictions, cache.stats.evictions) == (1, 1, 2)
    assert pool.num_free == 8


def test_prefix_pages_against_their_dense_equivalent():
    """``counters()`` reports the pages the resident public prefixes hold (``cache_prefix_pages``)
    beside the pages they would hold without compaction (``cache_prefix_pages_dense``), without
    the conversation extensions' pages, and forgets an evicted prefix. Model-free: a cache over a
    bare page pool. The working-set benchmark (benchmarks/bench_working_set.py) reads these to show
    how much media a compact prefix keeps in the same memory."""
    from engine.cache.kv_pool import PagePool
    from engine.cache.prefix_cache import PrefixCache

    pool = PagePool(num_layers=1, num_kv_heads=1, head_dim=8, num_pages=16, page_size=4,
                    kv_cache_dtype="auto", model_dtype=torch.float32)
    cache = PrefixCache(pool)
    a_pages, b_pages = pool.allocate(2), pool.allocate(3)
    a = cache.add_prefix("a", "salt-a", list(range(8)), a_pages, 8, 4, 4)  # compacted: 4 dense pages -> 2
    cache.add_prefix("b", "salt-b", list(range(12)), b_pages, 12, 3, 4)  # dense: 3 pages
    turn_pages = a_pages + pool.allocate(2)
    cache.add_extension(a, list(range(16)), turn_pages, 16)
    pool.release(b_pages + turn_pages)  # the requests are done (a's table ran on into its turn)
    c = cache.counters()
    assert (c["cache_prefix_pages"], c["cache_prefix_pages_dense"], c["cache_pages"]) == (5, 7, 7)
    cache.clear()
    c = cache.counters()
    assert (c["cache_prefix_pages"], c["cache_prefix_pages_dense"], c["cache_prefixes"]) == (0, 0, 0)


def test_engine_stats_split_evictions(make, photos):
    """``Engine.stats()`` reports prefix and extension evictions apart, their sum as
    ``cache_evictions``: a two-turn conversation (one prefix, one extension), then a clear."""
    engine = make(**BASE)
    img = photos["coffee"]
    first = gen(engine, media_first_messages([img], Q1))
    gen(engine, media_first_messages([img], Q2, history=[(Q1, first.text)]))
    before = engine.stats()
    assert before["cache_prefixes"] == 1 and before["cache_entries"] == 3  # the prefix and two kept turns
    engine.clear_prefix_cache()
    stats = engine.stats()
    assert (stats["cache_prefix_evictions"], stats["cache_extension_evictions"]) == (1, 2)
    assert stats["cache_evictions"] == 3


def test_text_only_and_disabled_cache_report_off(make, photos):
    engine = make(**BASE)
    text = gen(engine, [{"role": "user", "content": "Hello there."}])
    assert (text.telemetry.prefix_cache, text.telemetry.cached_tokens) == ("off", 0)
    disabled = make(**BASE, prefix_cache=False)
    done = gen(disabled, media_first_messages([photos["astronaut"]], Q1))
    assert (done.telemetry.prefix_cache, done.telemetry.prefix_pages) == ("off", 0)
    assert disabled.stats()["prefix_cache"] is False


def _video_messages(question: str, compact: bool = False):
    frames = [solid(c, 128) for c in ("red", "orange", "yellow", "green", "blue", "indigo", "violet", "white")]
    return [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 2.0},
                                          {"type": "text", "text": question}]}]


def test_video_prefix_is_cached_but_not_compacted_by_default(make):
    engine = make(**EXACT)
    fresh = make(**EXACT)
    miss = gen(engine, _video_messages(Q1))
    t = miss.telemetry
    assert t.prefix_cache == "miss" and t.visual_tokens == 64  # 4 frame pairs x 4 x 4 tokens
    assert t.visual_tokens_kept == t.visual_tokens and t.prefix_pages == t.prefix_pages_dense
    messages = _video_messages(Q2)
    hit = gen(engine, messages)
    assert hit.telemetry.prefix_cache == "hit" and hit.telemetry.vision_encoder_ran is False
    assert hit.token_ids == gen(fresh, messages).token_ids == masked_greedy(engine, messages, N_TOKENS)
    compacting = make(**EXACT, compact_video=True, min_keep=4)
    done = gen(compacting, messages)
    assert done.telemetry.visual_tokens_kept == 4 * 10  # round(0.6 * 16) per frame pair
    assert done.token_ids == masked_greedy(compacting, messages, N_TOKENS)


def test_concurrent_submitters_from_threads(make, photos):
    """Six threads, three sessions, the same two images: all answers equal the sequential ones."""
    engine = make(**EXACT)
    reference = make(**EXACT, conversation_reuse=False)
    cases = [(salt, name, q) for salt in ("x", "y", "z") for name, q in (("astronaut", Q1), ("chelsea", Q2))]
    results: dict = {}

    def ask(case):
        salt, name, q = case
        results[case] = gen(engine, media_first_messages([photos[name]], q), salt)

    threads = [threading.Thread(target=ask, args=(c,)) for c in cases]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert len(results) == len(cases)
    for (_salt, name, q), done in results.items():
        assert done.token_ids == gen(reference, media_first_messages([photos[name]], q), "r").token_ids
    assert len(engine.prefix_cache.prefixes) == 6
