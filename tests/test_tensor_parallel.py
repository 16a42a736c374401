"""Tensor parallelism on the CPU: two gloo processes on the tiny checkpoint (engine/parallel/).

TP2 is checked against TP1 on the same weights, fp32 and ``kv_cache_dtype="auto"``: the greedy
tokens must be equal (the decoder's all-reduce sums each layer's two halves in another order than
one matrix product does, float32 rounding only), with images, chunked prefill, batched requests, a
prefix hit and a conversation extension, with compaction off and with the same compaction on
both, and with Scaled-FP8 pages. Vision runs once per image (rank 0); a failing or killed rank
becomes a clear error for every waiting caller. Each TP2 engine costs a worker start-up (~5-15 s
on two busy cores), so the module builds four (dense, compacted, FP8 pages, merging compaction)
and breaks two of them in its last tests.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from PIL import Image

from engine import Engine, SamplingParams, media_first_messages
from engine.errors import InvalidRequestError, PrismError, TensorParallelError
from engine.serving.outputs import Completion

pytestmark = pytest.mark.tensor_parallel

SP = SamplingParams(max_tokens=10, ignore_eos=True)
#: Exact settings: float32 pages, chunks of 24 tokens (an image here is 16 visual tokens or fewer), page
#: accounting checked every step.
EXACT = {"min_pixels": 32 * 32, "max_pixels": 128 * 128, "kv_cache_bytes": 8 << 20, "kv_cache_dtype": "auto",
         "debug_checks": True, "max_num_batched_tokens": 24, "progress": False}
DENSE = {**EXACT, "compaction": None}
COMPACT = {**EXACT, "compaction": "uniform", "keep_ratio": 0.5, "min_keep": 4, "compaction_mode": "always"}
#: Scaled-FP8 pages: each rank stores its KV heads' values and per-(slot, head) scales, the same
#: numbers TP1 stores for those heads (a scale never spans heads), so only the all-reduce's
#: rounding order differs from TP1 here too.
#: With the score-based ``attention`` selector: rank 0 alone runs the vision encoder and its score
#: pass, stores the scores and decides the kept slots, so the worker keeps the same tokens.
FP8 = {**COMPACT, "kv_cache_dtype": "fp8_e4m3", "compaction": "attention"}
#: The merging variant (issue 35.3) on Scaled-FP8 pages: each rank dequantises, merges and
#: quantises again the V of its own KV heads (the weights are per token): rank-local, no collective.
MERGE = {**COMPACT, "kv_cache_dtype": "fp8_e4m3", "compaction": "staggered", "merge_values": True}
#: How long a test waits for an answer that must come (a deadline against a hang). The engines'
#: collectives keep their default timeout (60 s), longer than this: an error that arrives in time
#: was detected, not timed out.
WAIT_S = 30.0


def images(*colours: str, size: int = 128) -> list[Image.Image]:
    return [Image.new("RGB", (size, size - 16 * i), colour) for i, colour in enumerate(colours)]


# TP1 runs on the CPU as TP2 does (gloo), whatever PRISM_TEST_DEVICE says: like for like, and a
# CUDA TP1 would count its vision-graph captures as encoder runs.
def tp_engine(tiny_ckpt, **options) -> Engine:
    return Engine.from_pretrained(tiny_ckpt, device="cpu", tensor_parallel_size=2, **options)


def tp_pair(tiny_ckpt, options: dict):
    """(TP1, TP2) engines on the CPU with the same ``options``, closed after the module."""
    tp2 = tp_engine(tiny_ckpt, **options)
    tp1 = Engine.from_pretrained(tiny_ckpt, device="cpu", **options)
    yield tp1, tp2
    tp1.close()
    tp2.close()


@pytest.fixture(scope="module")
def dense_pair(tiny_ckpt):
    yield from tp_pair(tiny_ckpt, DENSE)


@pytest.fixture(scope="module")
def compact_pair(tiny_ckpt):
    yield from tp_pair(tiny_ckpt, COMPACT)


@pytest.fixture(scope="module")
def fp8_pair(tiny_ckpt):
    yield from tp_pair(tiny_ckpt, FP8)


@pytest.fixture(scope="module")
def merge_pair(tiny_ckpt):
    yield from tp_pair(tiny_ckpt, MERGE)


def both(pair, messages, salt: str) -> tuple[Completion, Completion]:
    return tuple(engine.generate(messages, SP, cache_salt=salt) for engine in pair)


def test_tp2_equals_tp1_with_images_and_chunked_prefill(dense_pair):
    tp1, tp2 = dense_pair
    messages = media_first_messages(images("red", "navy"), "What is in these pictures?")
    assert tp2.count_prompt_tokens(messages) > 2 * DENSE["max_num_batched_tokens"]  # three chunks or more
    steps_before = tp2.tensor_parallel_counters()[1]["steps"]
    one, two = both(dense_pair, messages, "chunked")
    assert two.token_ids == one.token_ids
    assert two.telemetry.prefix_cache == one.telemetry.prefix_cache == "miss"
    worker_steps = tp2.tensor_parallel_counters()[1]["steps"] - steps_before
    assert worker_steps >= 3 + SP.max_tokens - 1  # the worker ran every prefill chunk and decode step


def test_tp2_prefix_hit_and_conversation_equal_tp1(dense_pair):
    tp1, tp2 = dense_pair
    pics = images("green", "orange")
    first = both(dense_pair, media_first_messages(pics, "Describe them."), "hit")
    copies = tp2.tensor_parallel_counters()[1]["page_copies"]
    second = both(dense_pair, media_first_messages(pics, "Which colours?"), "hit")
    assert first[1].token_ids == first[0].token_ids
    assert second[1].token_ids == second[0].token_ids
    assert second[1].telemetry.prefix_cache == second[0].telemetry.prefix_cache == "hit"
    assert second[1].telemetry.cached_tokens % DENSE.get("page_size", 16)  # a partly filled last page:
    assert tp2.tensor_parallel_counters()[1]["page_copies"] > copies  # copied on write on the worker too
    # the next turn extends the conversation kept from the second
    history = [("Which colours?", second[0].text)]
    third = both(dense_pair, media_first_messages(pics, "And the shapes?", history), "hit")
    assert third[1].token_ids == third[0].token_ids
    assert third[1].telemetry.prefix_cache == third[0].telemetry.prefix_cache == "hit"
    assert third[1].telemetry.conversation_reuse_tokens == third[0].telemetry.conversation_reuse_tokens > 0


def test_tp2_batched_requests_equal_tp1(dense_pair):
    tp1, tp2 = dense_pair
    prompts = [media_first_messages(images(c), q) for c, q in (("purple", "What?"), ("teal", "Why?"),
                                                               ("gold", "Which colour is it?"))]
    expected = [tp1.generate(m, SP, cache_salt=f"batch{i}").token_ids for i, m in enumerate(prompts)]
    reqs = [tp2.submit(m, SP, cache_salt=f"batch{i}") for i, m in enumerate(prompts)]  # one loop, batched
    got = [r.result().token_ids for r in reqs]
    assert got == expected


def test_vision_encoder_runs_once_per_image_not_once_per_rank(dense_pair):
    tp1, tp2 = dense_pair
    messages = media_first_messages(images("white", "black", "yellow"), "Count them.")
    before = [rank["vision_images_encoded"] for rank in tp2.tensor_parallel_counters()]
    tp1_before = tp1.tensor_parallel_counters()[0]["vision_images_encoded"]
    one, two = both(dense_pair, messages, "vision")
    after = [rank["vision_images_encoded"] for rank in tp2.tensor_parallel_counters()]
    delta = [a - b for a, b in zip(after, before, strict=True)]
    assert delta == [3, 0]  # rank 0 encoded each image once, the worker none
    assert sum(delta) == 3 == tp1.tensor_parallel_counters()[0]["vision_images_encoded"] - tp1_before
    assert two.token_ids == one.token_ids  # the worker used rank 0's broadcast features


def test_tp2_host_tier_every_rank_offloads_and_restores_its_shard(tiny_ckpt, dense_pair):
    """A TP2 pool of 6 pages per rank over a host tier of 24 pages: sessions push each other to
    host memory and come back; every rank copies its own half of the KV heads (the worker counts
    the orders it ran), and every answer equals TP1's (float32 pages: a restored hit, a GPU hit and
    a cold run give the same tokens)."""
    tp1 = dense_pair[0]
    page = 16 * 3 * 1 * 16 * 4 * 2  # one rank's page: 16 tokens, 3 layers, 1 of 2 KV heads, 16 dims, K and V
    tp2 = tp_engine(tiny_ckpt, **{**DENSE, "kv_cache_bytes": 6 * page, "host_cache_bytes": 24 * 2 * page})
    try:
        assert tp2.host.num_pages == 24
        asks = [(colour, question) for question in ("What is here?", "Which colour?")
                for colour in ("red", "navy", "olive")]
        for colour, question in asks:
            messages = media_first_messages(images(colour), question)
            two = tp2.generate(messages, SP, cache_salt=colour)
            assert two.token_ids == tp1.generate(messages, SP, cache_salt="tp1-" + colour).token_ids
        stats, worker = tp2.stats(), tp2.tensor_parallel_counters()[1]
        assert stats["cache_restores"] >= 1 and stats["cache_hits_host"] >= 1
        assert (worker["offloads"], worker["restores"]) == (stats["cache_offloads"], stats["cache_restores"])
        assert worker["transfers_held"] == 0  # the worker lets its finished copies go (no growing record)
    finally:
        tp2.close()


def test_tp2_concurrent_first_questions_and_a_warm_compute_each_prefix_once(dense_pair):
    """Through the tensor-parallel path: four first questions sent at once on one session's
    images are one miss and three hits, answered as TP1 answers them one after another; a warm
    on TP2 makes the next session's first question a warmed hit with TP1's answer."""
    tp1, tp2 = dense_pair
    pics = images("purple", "gray")
    questions = [f"Question {i}: what is here?" for i in range(4)]
    expected = [tp1.generate(media_first_messages(pics, q), SP, cache_salt="tp1-together").token_ids
                for q in questions]
    start, out = threading.Barrier(4), [None] * 4

    def ask(i: int) -> None:
        start.wait()
        out[i] = tp2.generate(media_first_messages(pics, questions[i]), SP, cache_salt="together")

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert sorted(c.telemetry.prefix_cache for c in out) == ["hit"] * 3 + ["miss"]
    assert [c.token_ids for c in out] == expected

    other = images("teal")
    tp2.warm(other, cache_salt="warmed").result(WAIT_S)
    done = tp2.generate(media_first_messages(other, "Which colour?"), SP, cache_salt="warmed")
    assert (done.telemetry.prefix_cache, done.telemetry.warmed) == ("hit", True)
    assert done.token_ids == tp1.generate(media_first_messages(other, "Which colour?"), SP,
                                          cache_salt="tp1-warmed").token_ids


def test_a_failing_rank_gives_a_clear_error(dense_pair):
    """Runs after the dense pair's other tests: it breaks its TP2 engine. A worker that raises
    (here on a plan it does not know) reports its error and exits; every later request fails with
    both."""
    _, tp2 = dense_pair
    tp2.parallel.send(("no such plan",))
    with pytest.raises(TensorParallelError, match=r"tensor-parallel rank 1 died .*unknown plan message"):
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:  # the watchdog notices within ~0.5 s
            tp2.generate(media_first_messages(images("red"), "Still there?"), SP, cache_salt="fail")


def test_tp2_compaction_equals_tp1_compaction(compact_pair):
    tp1, tp2 = compact_pair
    pics = images("red", "blue")
    moves = tp2.tensor_parallel_counters()[1]["slot_moves"]
    cold = both(compact_pair, media_first_messages(pics, "What is here?"), "compact")
    hit = both(compact_pair, media_first_messages(pics, "Anything else?"), "compact")
    for one, two in (cold, hit):
        assert two.token_ids == one.token_ids
    assert hit[1].telemetry.prefix_cache == "hit"
    kept = cold[1].telemetry.visual_tokens_kept
    assert kept == cold[0].telemetry.visual_tokens_kept
    assert 0 < kept < cold[1].telemetry.visual_tokens
    assert tp2.tensor_parallel_counters()[1]["slot_moves"] == moves + 1  # the worker moved its slots too


def test_tp2_fp8_pages_with_compaction_equal_tp1(fp8_pair):
    """FP8 values and scales sharded by KV head, copied on write and moved by compaction (the
    attention selector's, from rank 0's stored scores) on both ranks: the same tokens as TP1 with
    the same pages, and the same visual tokens kept."""
    tp1, tp2 = fp8_pair
    pics = images("olive", "silver")
    for question in ("What is here?", "Anything else?", "Which colours?"):
        one, two = both(fp8_pair, media_first_messages(pics, question), "fp8")
        assert two.token_ids == one.token_ids
        assert 0 < two.telemetry.visual_tokens_kept == one.telemetry.visual_tokens_kept < two.telemetry.visual_tokens
    assert two.telemetry.prefix_cache == "hit"
    assert tp2.pool.kv_cache_dtype == "fp8_e4m3" and tp2.pool.layers[0].num_kv_heads == 1  # 2 heads / 2 ranks


def test_tp2_merging_compaction_equals_tp1(merge_pair):
    """A merging compaction's V rewrite reaches the worker in the plan and is applied there to its
    own KV head: the same tokens as TP1 (cold and hit), one value merge per compacted prefix."""
    tp1, tp2 = merge_pair
    pics = images("teal", "maroon")
    merges = tp2.tensor_parallel_counters()[1]["value_merges"]
    for question in ("What is here?", "Anything else?"):
        one, two = both(merge_pair, media_first_messages(pics, question), "merge")
        assert two.token_ids == one.token_ids
        assert 0 < two.telemetry.visual_tokens_kept == one.telemetry.visual_tokens_kept < two.telemetry.visual_tokens
    assert two.telemetry.prefix_cache == "hit"
    assert tp2.tensor_parallel_counters()[1]["value_merges"] == merges + 1


def test_bad_tensor_parallel_sizes_are_refused(tiny_ckpt):
    with pytest.raises(InvalidRequestError, match="must divide"):
        Engine.from_pretrained(tiny_ckpt, device="cpu", tensor_parallel_size=3, progress=False)
    with pytest.raises(InvalidRequestError, match=">= 1"):
        Engine.from_pretrained(tiny_ckpt, device="cpu", tensor_parallel_size=0, progress=False)


def test_killing_a_rank_gives_every_waiting_caller_a_clear_error(fp8_pair):
    """Runs last: it breaks the FP8 pair's TP2 engine."""
    _, tp2 = fp8_pair
    (pid,) = tp2.parallel.pids
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    running = tp2.stream(media_first_messages(images("pink"), "Talk."), long, cache_salt="kill")
    waiting = [tp2.submit(media_first_messages(images("gray"), f"Wait {i}."), long, cache_salt="kill")
               for i in range(2)]
    assert isinstance(next(running), str)  # the stream is under way
    os.kill(pid, signal.SIGKILL)
    errors: list[BaseException] = []

    def drain(items) -> None:
        try:
            for _ in items:
                pass
        except PrismError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=drain, args=(it,)) for it in (running, *(iter(r) for r in waiting))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)  # shorter than the collectives' timeout: the death must be detected
    assert not any(t.is_alive() for t in threads), "a caller still waits after the rank died"
    assert len(errors) == 3, errors
    assert all(isinstance(e, TensorParallelError) and "tensor-parallel rank 1" in str(e) for e in errors), errors
    with pytest.raises(TensorParallelError, match="tensor-parallel rank 1 died"):  # and every later caller too
        tp2.generate(media_first_messages(images("red"), "Again?"), SP, cache_salt="kill")
