"""Review findings: targeted tests that try to break the serving core (page accounting across
preemption, cancellation and eviction; hit == cold run; telemetry; threads).

Every engine here is a tiny "test" checkpoint engine (float32 on CPU) with small images
(``max_pixels`` 128 x 128: 16 visual tokens a photo), ``min_keep=4`` so that compaction really
drops visual tokens (16 -> 10), ``debug_checks`` (the pool's page accounting, cache entries
included, is checked after every step) and K/V pages in the model dtype, so tokens must match
exactly. "Cold" references are fresh engines with the same settings (they compute and compact the
prefix themselves), or engines with the prefix cache off where compaction cannot matter.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from PIL import Image

from engine import Completion, PrismError, SamplingParams
from engine.cache.kv_pool import PagePool
from engine.inputs.prompts import media_first_messages
from engine.serving.request import Status

MAX_PIXELS = 128 * 128
SP = SamplingParams(max_tokens=6, ignore_eos=True)
BASE = dict(kv_cache_dtype="auto", max_pixels=MAX_PIXELS, min_keep=4, debug_checks=True, kv_cache_bytes=4 << 20)
Q1 = "What is in this picture?"
Q2 = "Describe the colours."
Q3 = "Is there any text?"


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def photos(media_path):
    def load(name):
        with Image.open(media_path(name)) as im:
            return im.convert("RGB")

    return {n.split(".")[0]: load(n) for n in ("astronaut.png", "chelsea.png", "coffee.png")}


@pytest.fixture(scope="module")
def make(tiny_engine_factory):
    """``make(**options)``: an engine that is closed at the end of the test module."""
    return tiny_engine_factory


@pytest.fixture(scope="module")
def token_bytes(make):
    """KV bytes of one token (all layers, K and V, float32 pages)."""
    cfg = make(**BASE).config.text
    return PagePool.bytes_per_page(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                                   head_dim=cfg.head_dim, page_size=1, kv_cache_dtype="auto",
                                   model_dtype=torch.float32)


def wait_done(handle, timeout: float = 30.0) -> Completion:
    """The completion of ``handle`` (a RequestHandle; deltas skipped, errors raised); fails instead
    of hanging."""
    try:
        return handle.result(timeout=timeout)
    except TimeoutError:
        req = handle.request
        raise AssertionError(f"request {handle.id} did not finish in {timeout} s (status {req.status}, "
                             f"preempted {req.telemetry.preempted} times)") from None


def run(engine, messages, sampling=SP, salt="s", timeout: float = 30.0) -> Completion:
    return wait_done(engine.submit(messages, sampling, cache_salt=salt), timeout)


def cold(make, messages, sampling=SP, **options) -> Completion:
    """The answer of a fresh engine (nothing cached) with ``options``."""
    eng = make(**{**BASE, **options})
    try:
        return run(eng, messages, sampling, salt="cold")
    finally:
        eng.close()


def poll(cond, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.0005)


def assert_pool_settled(eng) -> None:
    """Nothing runs; every used page belongs to the cache; clearing the cache frees them all."""
    stats = eng.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    assert stats["pages_used"] == stats["cache_pages"], stats
    eng.pool.check(eng.prefix_cache.holders() if eng.prefix_cache is not None else [])
    eng.clear_prefix_cache()
    stats = eng.stats()
    assert stats["pages_used"] == 0 and stats["cache_entries"] == 0, stats


def close_on_failure(eng):
    """Context: close ``eng`` if the block fails (a hung engine loop must not spin for the rest of
    the session)."""

    class _Ctx:
        def __enter__(self):
            return eng

        def __exit__(self, exc_type, *exc):
            if exc_type is not None:
                eng.close()
            return False

    return _Ctx()


# ------------------------------------------------------------------------------------------------
# finding 1: a request that needs the whole pool hangs forever once the prefix cache is involved
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("conversation_reuse", [False, True])
def test_lone_cold_request_filling_the_pool_finishes_with_the_prefix_cache_on(
        make, photos, token_bytes, conversation_reuse):
    """prompt + max_tokens == the pool's capacity (accepted by _check_fits). The request caches
    its prefix, which shares the partly filled last prefix page; with the cache on it used to
    preempt itself at the last page, re-attach the same entry and wait forever for a page the
    entry pinned (the same request finishes with the prefix cache off)."""
    pages = 8
    eng = make(**{**BASE, "kv_cache_bytes": pages * 16 * token_bytes}, conversation_reuse=conversation_reuse,
               compaction=None)
    messages = media_first_messages([photos["astronaut"]], Q1)
    p = len(eng.prompts.build(messages).input_ids)
    sampling = SamplingParams(max_tokens=pages * 16 - p, ignore_eos=True)
    assert eng.max_model_len == pages * 16
    with close_on_failure(eng):
        done = run(eng, messages, sampling, timeout=30)
    assert done.finish_reason == "length" and len(done.token_ids) == sampling.max_tokens
    assert done.token_ids == cold(make, messages, sampling, prefix_cache=False).token_ids
    assert done.telemetry.computed_tokens == p and done.telemetry.preempted == 0
    assert_pool_settled(eng)


def test_hit_that_fills_the_pool_while_decoding_finishes(make, photos, token_bytes):
    """A hit on a cached prefix, then decoding into the last page of the pool: the prefix's own
    partly filled last page (the request decodes on a private copy) used to be pinned for good."""
    pages = 8
    opts = {**BASE, "kv_cache_bytes": pages * 16 * token_bytes, "conversation_reuse": False}
    eng = make(**opts)
    img = photos["astronaut"]
    assert run(eng, media_first_messages([img], Q1)).telemetry.prefix_cache == "miss"
    messages = media_first_messages([img], Q2)
    p = len(eng.prompts.build(messages).input_ids)
    sampling = SamplingParams(max_tokens=pages * 16 - p, ignore_eos=True)
    with close_on_failure(eng):
        done = run(eng, messages, sampling, timeout=30)
    tel = done.telemetry
    assert tel.prefix_cache == "hit" and tel.cached_tokens == eng.prompts.build(messages).prefix_len
    assert tel.computed_tokens == tel.prompt_tokens - tel.cached_tokens
    assert done.token_ids == cold(make, messages, sampling, **opts).token_ids
    assert_pool_settled(eng)


def test_hit_whose_first_chunk_needs_the_whole_pool_is_not_left_waiting(make, photos, token_bytes):
    """Nothing runs, and the hit's pinned entry + its first chunk exceed the pool although the
    request alone fits: admission used to wait forever. It now runs cold (reported ``stale``)."""
    pages = 8
    opts = {**BASE, "kv_cache_bytes": pages * 16 * token_bytes, "conversation_reuse": False, "compaction": None}
    eng = make(**opts)
    img = photos["astronaut"]
    assert run(eng, media_first_messages([img], Q1)).telemetry.prefix_cache == "miss"
    messages = media_first_messages([img], "word " * 80)
    p = len(eng.prompts.build(messages).input_ids)
    assert 7 * 16 < p < 8 * 16 - 2
    sampling = SamplingParams(max_tokens=pages * 16 - p, ignore_eos=True)
    with close_on_failure(eng):
        done = run(eng, messages, sampling, timeout=30)
    tel = done.telemetry
    assert tel.prefix_cache == "stale" and tel.cached_tokens == 0 and tel.computed_tokens == p
    assert done.token_ids == cold(make, messages, sampling, **opts).token_ids
    stats = eng.stats()
    assert (stats["cache_hits"], stats["cache_misses"], stats["cache_stale"]) == (0, 1, 1)
    assert_pool_settled(eng)


# ------------------------------------------------------------------------------------------------
# finding 2: telemetry and counters after preemption
# ------------------------------------------------------------------------------------------------


def test_cached_tokens_never_exceed_the_prompt_after_preemption(make, photos, token_bytes):
    """Two identical hits on a conversation extension in a pool too small for both: the one
    preempted re-attached, on re-admission, an extension running into its own generated tokens,
    and reported that as prompt reuse (cached_tokens 64 for a 36-token prompt)."""
    opts = {**BASE, "kv_cache_bytes": 8 * 16 * token_bytes}
    eng = make(**opts)
    messages = media_first_messages([photos["astronaut"]], "What?")
    first = run(eng, messages, SamplingParams(max_tokens=30, ignore_eos=True))
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    with close_on_failure(eng):
        with eng.loop.paused():  # looked up and admitted together
            a, b = eng.submit(messages, sampling, cache_salt="s"), eng.submit(messages, sampling, cache_salt="s")
        da, db = wait_done(a), wait_done(b)
    assert da.telemetry.preempted + db.telemetry.preempted >= 1, "no preemption: the test lost its point"
    prefix_len = eng.prompts.build(messages).prefix_len
    for done in (da, db):
        tel = done.telemetry
        assert tel.prefix_cache == "hit"
        assert prefix_len <= tel.cached_tokens < tel.prompt_tokens, tel
        assert tel.conversation_reuse_tokens == tel.cached_tokens - prefix_len
        assert done.token_ids[:30] == first.token_ids
    assert da.token_ids == db.token_ids
    assert_pool_settled(eng)


def run_behind_an_older_request(eng, messages, sampling, evict_when=None):
    """Submit ``messages`` while an older 70-token request runs, in a pool too small for both, so
    that the older one preempts it. If ``evict_when(req)`` holds (checked under the engine's lock)
    while it waits after preemption, the prefix cache is cleared right then. Returns its Completion."""
    with close_on_failure(eng):
        older = eng.submit([{"role": "user", "content": "Count."}], SamplingParams(max_tokens=70, ignore_eos=True))
        poll(lambda: older.request.status is Status.RUNNING, what="the older request to run")
        handle = eng.submit(messages, sampling, cache_salt="s")
        req = handle.request
        if evict_when is not None:
            def waiting_and_evicted():
                with eng.loop.paused():
                    if req.status is Status.WAITING and req.telemetry.preempted and evict_when(req):
                        eng.prefix_cache.clear()  # the entry goes while the request waits for pages
                        return True
                return False

            poll(waiting_and_evicted, what="the preempted request to wait (and its entry to be evicted)")
        done = wait_done(handle)
        wait_done(older)
    return done


@pytest.mark.parametrize("evict_while_waiting", [False, True])
def test_miss_preempted_after_caching_its_prefix_stays_a_miss(make, photos, token_bytes, evict_while_waiting):
    """A miss computes and caches its prefix, is preempted by an older request, and on
    re-admission finds its own prefix. It used to report ``cached_tokens`` for a miss; and when the
    entry was evicted while it waited, it was relabelled ``stale`` and took a hit off the counters
    that had never been added (``cache_hits == -1``)."""
    opts = {**BASE, "kv_cache_bytes": 6 * 16 * token_bytes, "conversation_reuse": False}
    eng = make(**opts)
    messages = media_first_messages([photos["astronaut"]], "What?")
    sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    on_its_own_prefix = (lambda req: req.match is not None) if evict_while_waiting else None
    done = run_behind_an_older_request(eng, messages, sampling, evict_when=on_its_own_prefix)
    tel = done.telemetry
    assert tel.preempted >= 1, "no preemption: the test lost its point"
    assert tel.prefix_cache == "miss" and tel.cached_tokens == 0 and tel.conversation_reuse_tokens == 0
    assert done.token_ids == cold(make, messages, sampling, **opts).token_ids
    stats = eng.stats()
    assert (stats["cache_hits"], stats["cache_misses"], stats["cache_stale"]) == (0, 1, 0)
    assert_pool_settled(eng)


def test_hit_preempted_whose_entry_is_evicted_while_waiting_recomputes_cold(make, photos, token_bytes):
    """Stale fallback after preemption: the hit stays a hit (KV was reused before preemption),
    the counters are not touched again, and the answer equals a cold run."""
    opts = {**BASE, "kv_cache_bytes": 6 * 16 * token_bytes, "conversation_reuse": False}
    eng = make(**opts)
    img = photos["astronaut"]
    assert run(eng, media_first_messages([img], Q1)).telemetry.prefix_cache == "miss"
    messages = media_first_messages([img], "What?")
    sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    done = run_behind_an_older_request(eng, messages, sampling, evict_when=lambda req: True)
    tel = done.telemetry
    assert tel.prefix_cache == "hit" and tel.preempted >= 1
    assert tel.cached_tokens == eng.prompts.build(messages).prefix_len
    assert done.token_ids == cold(make, messages, sampling, **opts).token_ids
    stats = eng.stats()
    assert (stats["cache_hits"], stats["cache_misses"], stats["cache_stale"]) == (1, 1, 0)
    assert_pool_settled(eng)


# ------------------------------------------------------------------------------------------------
# finding 3: submit racing close
# ------------------------------------------------------------------------------------------------


def test_generate_racing_close_raises_engine_closed(make, monkeypatch):
    """close() drops the model while another thread builds its prompt: that caller used to get
    AttributeError ('NoneType' object has no attribute 'device') instead of PrismError."""
    eng = make(**BASE)
    real_build = eng.prompts.build
    building, release = threading.Event(), threading.Event()

    def slow_build(messages, *args, **kwargs):
        building.set()
        release.wait(10)
        return real_build(messages, *args, **kwargs)

    monkeypatch.setattr(eng.prompts, "build", slow_build)
    result = {}

    def call():
        try:
            result["r"] = eng.generate([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2))
        except BaseException as exc:  # noqa: BLE001 - checked below
            result["r"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    assert building.wait(10)
    eng.close()
    release.set()
    thread.join(10)
    assert isinstance(result["r"], PrismError) and "closed" in str(result["r"]), repr(result["r"])


# ------------------------------------------------------------------------------------------------
# hit == cold run: page sizes, compaction, chunk boundaries, one-token questions
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("compaction", [None, "uniform"])
@pytest.mark.parametrize("chunk", ["whole", "at-prefix-end", "one-past-prefix-end", 5])
def test_hit_equals_cold_run(make, photos, page_size, compaction, chunk):
    img = photos["chelsea"]
    opts = {**BASE, "page_size": page_size, "compaction": compaction}
    probe = make(**opts)
    prefix_len = probe.prompts.build(media_first_messages([img], Q1)).prefix_len
    probe.close()
    opts["max_num_batched_tokens"] = {"whole": 1024, "at-prefix-end": prefix_len,
                                      "one-past-prefix-end": prefix_len + 1}.get(chunk, chunk)
    eng = make(**opts)
    assert run(eng, media_first_messages([img], Q1)).telemetry.prefix_cache == "miss"
    # "?": a one-token question; Q1 again: everything but the last prompt token is reused
    for question in (Q2, "?", Q1):
        messages = media_first_messages([img], question)
        hit = run(eng, messages)
        tel = hit.telemetry
        assert tel.prefix_cache == "hit" and tel.cached_tokens >= prefix_len
        assert tel.computed_tokens == tel.prompt_tokens - tel.cached_tokens
        assert hit.token_ids == cold(make, messages, **opts).token_ids, question
        if compaction:
            assert tel.visual_tokens_kept < tel.visual_tokens
    assert tel.computed_tokens == 1  # Q1 again
    assert_pool_settled(eng)


@pytest.mark.parametrize("page_size", [2, 5, 10])
def test_prompt_ending_on_a_page_boundary_after_compaction(make, photos, page_size):
    """The compacted prefix and the whole compacted prompt both end exactly on a page boundary:
    no copy-on-write page, the first decode token opens a new page."""
    img = photos["astronaut"]
    opts = {**BASE, "page_size": page_size}
    eng = make(**opts)
    messages = media_first_messages([img], "What?")
    prompt = eng.prompts.build(messages)
    kept = len(eng.compaction.kept_positions(prompt.prefix_len, prompt.spans))
    assert kept < prompt.prefix_len
    assert kept % page_size == 0 and (len(prompt.input_ids) - (prompt.prefix_len - kept)) % page_size == 0
    miss = run(eng, messages)
    assert miss.telemetry.prefix_pages == kept // page_size
    hit = run(eng, media_first_messages([img], "What?"), salt="s")
    reference = cold(make, messages, **opts).token_ids
    assert miss.token_ids == hit.token_ids == reference
    assert hit.telemetry.prefix_cache == "hit"
    other = media_first_messages([img], Q3)
    assert run(eng, other).token_ids == cold(make, other, **opts).token_ids
    assert_pool_settled(eng)


def test_history_whose_answer_retokenizes_differently(make, photos, monkeypatch):
    """Turn 1 generates "Hel" "lo" " wor" "ld"; the next turn's prompt tokenizes the answer as
    "Hello" " world". The conversation extension is reused only up to the divergence, and the
    answer equals a cold run."""
    eng = make(**BASE)
    tok = eng.tokenizer
    script = [t for piece in ("Hel", "lo", " wor", "ld") for t in tok.encode(piece, add_special_tokens=False)]
    assert tok.encode(tok.decode(script), add_special_tokens=False) != script

    class Scripted:
        def __init__(self, params, device=None):
            self.i = 0

        def __call__(self, logits, seen_tokens=None):
            self.i += 1
            return script[min(self.i - 1, len(script) - 1)]

    img = photos["chelsea"]
    monkeypatch.setattr(eng.intake, "make_sampler", Scripted)
    t1 = run(eng, media_first_messages([img], Q1), SamplingParams(max_tokens=len(script), temperature=1.0, seed=0))
    monkeypatch.undo()
    assert t1.token_ids == script and t1.text == "Hello world"
    p1 = len(eng.prompts.build(media_first_messages([img], Q1)).input_ids)
    messages = media_first_messages([img], Q2, history=[(Q1, t1.text)])
    t2 = run(eng, messages)
    tel = t2.telemetry
    assert tel.prefix_cache == "hit" and tel.cached_tokens == p1  # reused up to the divergence
    assert tel.computed_tokens == tel.prompt_tokens - tel.cached_tokens
    assert t2.token_ids == cold(make, messages).token_ids
    assert_pool_settled(eng)


def test_two_sessions_share_images_under_global_scope(make, photos):
    """Two chats about the same two photos, interleaved, under cache_scope="global": the second
    session's first turn reuses the first session's prefix; every answer equals a cold run."""
    opts = {**BASE, "cache_scope": "global"}
    eng = make(**opts)
    imgs = [photos["astronaut"], photos["coffee"]]
    history = {"alice": [], "bob": []}
    questions = {"alice": [Q1, Q2], "bob": [Q3, Q1]}
    reports = []
    for turn in range(2):
        for salt in ("alice", "bob"):
            q = questions[salt][turn]
            messages = media_first_messages(imgs, q, history=history[salt])
            done = run(eng, messages, salt=salt)
            assert done.token_ids == cold(make, messages, **opts).token_ids, (salt, turn)
            tel = done.telemetry
            assert tel.computed_tokens == tel.prompt_tokens - tel.cached_tokens
            reports.append(tel.prefix_cache)
            history[salt].append((q, done.text))
    assert reports == ["miss", "hit", "hit", "hit"]
    assert eng.stats()["vision_cache_entries"] == 2  # one salt: features shared too
    assert_pool_settled(eng)


# ------------------------------------------------------------------------------------------------
# cancellation at every stage of a cached prefix's life
# ------------------------------------------------------------------------------------------------


def _cancel_after_step(eng, monkeypatch, when):
    """Make the loop cancel (without waiting) the request for which ``when(req)`` holds right
    after a step computed it (the scheduler's update applied); returns the list of cancelled
    requests."""
    scheduler = eng.loop.scheduler
    real = scheduler.update
    cancelled = []

    def update(plan, output):
        out = real(plan, output)
        for run in plan.runs:
            req = scheduler.request(run.req_id)
            if req is not None and not cancelled and when(req):
                eng.loop.cancel(req, wait=False)  # taken up by the loop before its next step
                cancelled.append(req)
        return out

    monkeypatch.setattr(scheduler, "update", update)
    return cancelled


def test_cancel_while_prefilling_a_cold_prefix_caches_nothing(make, photos, monkeypatch):
    eng = make(**BASE, max_num_batched_tokens=8)
    messages = media_first_messages([photos["astronaut"]], Q1)
    prefix_len = eng.prompts.build(messages).prefix_len
    cancelled = _cancel_after_step(eng, monkeypatch, lambda r: 0 < r.num_computed < prefix_len)
    done = run(eng, messages)
    monkeypatch.undo()
    assert cancelled and done.finish_reason == "cancelled" and done.token_ids == []
    stats = eng.stats()
    assert stats["pages_used"] == 0 and stats["cache_entries"] == 0, stats
    again = run(eng, media_first_messages([photos["astronaut"]], Q2))
    assert again.telemetry.prefix_cache == "miss"
    assert again.token_ids == cold(make, media_first_messages([photos["astronaut"]], Q2)).token_ids
    assert_pool_settled(eng)


def test_cancel_right_after_compaction_keeps_a_usable_prefix(make, photos, monkeypatch):
    eng = make(**BASE, page_size=3)
    img = photos["astronaut"]
    messages = media_first_messages([img], Q1)
    prefix_len = eng.prompts.build(messages).prefix_len
    cancelled = _cancel_after_step(eng, monkeypatch, lambda r: r.num_computed == prefix_len)
    done = run(eng, messages)
    monkeypatch.undo()
    assert cancelled and done.finish_reason == "cancelled" and done.token_ids == []
    tel = done.telemetry  # it was compacted and cached before the cancel was taken up
    assert tel.visual_tokens_kept < tel.visual_tokens and tel.prefix_pages < tel.prefix_pages_dense
    stats = eng.stats()
    assert stats["cache_entries"] == 1 and stats["pages_used"] == stats["cache_pages"] > 0, stats
    follow = media_first_messages([img], Q2)
    hit = run(eng, follow)
    assert hit.telemetry.prefix_cache == "hit"
    assert hit.token_ids == cold(make, follow, page_size=3).token_ids
    assert_pool_settled(eng)


def test_cancel_a_hit_while_it_waits(make, photos):
    eng = make(**BASE, max_num_seqs=1)
    img = photos["astronaut"]
    run(eng, media_first_messages([img], Q1))
    blocker = eng.submit([{"role": "user", "content": "Count."}], SamplingParams(max_tokens=4000, ignore_eos=True))
    poll(lambda: blocker.request.status is Status.RUNNING, what="the blocker to run")
    waiting = eng.submit(media_first_messages([img], Q2), SP, cache_salt="s")
    poll(lambda: waiting.request.match is not None, what="the intake lookup")
    assert waiting.request.status is Status.WAITING
    eng.cancel(waiting)
    done = wait_done(waiting)
    assert done.finish_reason == "cancelled" and done.telemetry.cached_tokens == 0
    eng.cancel(blocker)
    stats = eng.stats()
    assert stats["pages_used"] == stats["cache_pages"] and stats["running"] == stats["waiting"] == 0, stats
    follow = media_first_messages([img], Q3)
    hit = run(eng, follow)
    assert hit.telemetry.prefix_cache == "hit" and hit.token_ids == cold(make, follow).token_ids
    assert_pool_settled(eng)


# ------------------------------------------------------------------------------------------------
# extensions: attached by running requests, preempted, evicted around
# ------------------------------------------------------------------------------------------------


def test_prefix_and_extension_survive_eviction_while_attached(make, photos):
    """A long second turn attaches the first turn's extension; clearing the cache meanwhile must
    evict neither the extension nor its prefix (their pages are read while it runs)."""
    eng = make(**BASE)
    img = photos["coffee"]
    t1 = run(eng, media_first_messages([img], Q1))
    messages = media_first_messages([img], Q2, history=[(Q1, t1.text)])
    sampling = SamplingParams(max_tokens=60, ignore_eos=True)
    handle = eng.submit(messages, sampling, cache_salt="s")
    req = handle.request
    poll(lambda: req.attached is not None, what="the second turn to attach")
    assert req.attached.parent is not None  # an extension
    entries = eng.stats()["cache_entries"]
    eng.clear_prefix_cache()
    with eng.loop.paused():
        assert req.attached is not None and req.attached.alive and req.attached.parent.alive
    assert eng.stats()["cache_entries"] >= 2 and entries >= 2
    done = wait_done(handle)
    assert done.telemetry.conversation_reuse_tokens > 0
    assert done.token_ids == cold(make, messages, sampling).token_ids
    assert_pool_settled(eng)


def test_extension_hits_preempted_in_a_small_pool(make, photos, token_bytes):
    """Two follow-up turns attached to the same conversation extension, decoding long answers in a
    pool too small for both; then a third turn continues each conversation."""
    opts = {**BASE, "kv_cache_bytes": 9 * 16 * token_bytes}
    eng = make(**opts)
    img = photos["chelsea"]
    t1 = run(eng, media_first_messages([img], Q1))
    hist = [(Q1, t1.text)]
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    m2, m3 = (media_first_messages([img], q, history=hist) for q in (Q2, Q3))
    with close_on_failure(eng):
        with eng.loop.paused():
            r2, r3 = eng.submit(m2, sampling, cache_salt="s"), eng.submit(m3, sampling, cache_salt="s")
        d2, d3 = wait_done(r2), wait_done(r3)
    assert d2.telemetry.preempted + d3.telemetry.preempted >= 1, "no preemption: the test lost its point"
    for done, messages in ((d2, m2), (d3, m3)):
        tel = done.telemetry
        assert tel.prefix_cache == "hit" and tel.conversation_reuse_tokens > 0
        assert tel.cached_tokens < tel.prompt_tokens
        assert done.token_ids == cold(make, messages, sampling, **opts).token_ids
    for done, q in ((d2, Q2), (d3, Q3)):
        messages = media_first_messages([img], "And?", history=[*hist, (q, done.text)])
        # nearly pool-sized prompts: whether they can keep using the cache here depends on how the
        # random answers retokenize (hit, stale fallback, or miss after eviction); never a hang
        nxt = run(eng, messages)
        assert nxt.token_ids == cold(make, messages, **opts).token_ids
    assert_pool_settled(eng)


# ------------------------------------------------------------------------------------------------
# threads
# ------------------------------------------------------------------------------------------------


#: What each thread of the test below does, in an order its seed shuffles: a fixed amount of work
#: (not "as much as fits in N seconds", which would test the machine's speed).
THREAD_OPS = ["generate", "generate", "stream", "cancel", "stats", "clear"] * 2


def test_many_threads_generate_stream_cancel_stats_and_clear(make, photos, token_bytes):
    """Eight threads, each running :data:`THREAD_OPS` (generate, stream-and-drop, submit-and-cancel,
    stats() and clear_prefix_cache()) on a small pool (preemption and eviction can happen): no error,
    no hang, every finished answer equals a cold run, the pool ends settled."""
    opts = {**BASE, "kv_cache_bytes": 24 * 16 * token_bytes, "max_num_batched_tokens": 32}
    eng = make(**opts)
    reference = make(**{k: v for k, v in opts.items() if k != "kv_cache_bytes"}, kv_cache_bytes=4 << 20)
    imgs = list(photos.values())
    cases = [media_first_messages([imgs[i]], q) for i in range(3) for q in (Q1, Q2)]
    cases += [media_first_messages(imgs[:2], Q3), [{"role": "user", "content": "Tell me a story."}]]
    expected = [run(reference, m, salt=f"ref{i}").token_ids for i, m in enumerate(cases)]
    errors, checked = [], []

    def worker(seed):
        rng = random.Random(seed)
        ops = rng.sample(THREAD_OPS, len(THREAD_OPS))
        try:
            for op in ops:
                i = rng.randrange(len(cases))
                salt = rng.choice(["a", "b"])
                if op == "generate":
                    done = eng.generate(cases[i], SP, cache_salt=salt)
                    checked.append((i, done.token_ids))
                elif op == "stream":
                    stream = eng.stream(cases[i], SamplingParams(max_tokens=50, ignore_eos=True), cache_salt=salt)
                    next(stream)
                    stream.close()  # cancels and frees its pages
                elif op == "cancel":
                    req = eng.submit(cases[i], SamplingParams(max_tokens=50, ignore_eos=True), cache_salt=salt)
                    time.sleep(rng.random() * 0.01)
                    eng.cancel(req)
                    assert req.request.status is Status.FINISHED
                elif op == "stats":
                    s = eng.stats()
                    assert s["pages_used"] + s["pages_free"] == s["pages_total"]
                    assert s["cache_pages"] <= s["pages_used"]
                else:
                    eng.clear_prefix_cache()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    with close_on_failure(eng):
        assert not any(t.is_alive() for t in threads), "a thread hung"
        assert not errors, errors
    assert len(checked) == 8 * THREAD_OPS.count("generate")  # every thread finished its work
    for i, tokens in checked:
        assert tokens == expected[i], i
    poll(lambda: eng.stats()["running"] == 0 and eng.stats()["waiting"] == 0, what="the engine to drain")
    assert_pool_settled(eng)
