"""Warms in the scheduler alone (no model): below every question, bounded per step, taking only
free pages or unhit entries, preempted first, and joined by the questions that need their prefix.

The helpers are those of tests/test_scheduler_core.py (pages of 4 tokens, the 13-token
media-first prefix ``PREFIX`` with one image at positions 4 .. 11, fake step outputs); every
expected run is written out from the rules in engine/serving/scheduler.py's docstring.
"""

from __future__ import annotations

import torch
from test_scheduler_core import PAGE, PREFIX, FakeStream, check_pages, finish, prompt, request, step, submit

from engine.cache.compaction import CompactionConfig
from engine.cache.kv_pool import PagePool
from engine.cache.prefix_cache import PrefixCache
from engine.cache.prefix_reuse import PrefixReuse
from engine.errors import EngineOverloadedError
from engine.inputs.prompts import Prompt
from engine.model.rope import VisualSpan
from engine.serving.request import Request, Status
from engine.serving.sampling import SamplingParams
from engine.serving.scheduler import Scheduler, SchedulerConfig

QUESTION = [20, 21, 22]


def make(num_pages: int, budget: int = 16, clock=None, **config) -> Scheduler:
    """A scheduler on a fresh pool. The warms' time budget is off (``warm_time_share=1``) unless
    ``config`` sets it: these tests are about the per-step rules (tests/test_warm_budget.py has the
    budget's, on the fake ``clock``)."""
    pool = PagePool(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=num_pages, page_size=PAGE,
                    kv_cache_dtype="auto")
    reuse = PrefixReuse(PrefixCache(pool, ()), CompactionConfig(None), "test", mode="always")
    config = {"warm_time_share": 1.0, **config}
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, **config)
    return Scheduler(pool, cfg, reuse, **({} if clock is None else {"clock": clock}))


def warm(sched: Scheduler, ids=PREFIX, salt: str = "s", p: Prompt | None = None) -> Request:
    """A warm as Intake.warm_request makes one: the prefix (``ids``, or the prompt ``p``) and a
    placeholder question, marked ``warm``; added as the loop adds one (nothing looked up)."""
    p = prompt([*ids, 7], image=True) if p is None else p
    req = Request(p, SamplingParams(max_tokens=1), None, FakeStream())
    req.salt, req.prefix_key, req.warm = salt, sched.reuse.key(p, salt), True
    sched.add(req)
    return req


def runs(plan) -> list[tuple[int, int, int, bool]]:
    return [(r.req_id, r.start, r.num_tokens, r.sample) for r in plan.runs]


def test_a_warm_takes_what_questions_leave_stops_at_its_prefix_and_never_samples():
    sched = make(num_pages=16, budget=8, max_warm_tokens=6, max_warm_images=0)
    a = submit(sched, request([1, 2, 3]))
    w = warm(sched)
    assert runs(step(sched)) == [(a.id, 0, 3, True), (w.id, 0, 5, False)]  # 8 - 3 left, under the cap of 6
    assert runs(step(sched)) == [(a.id, 3, 1, True), (w.id, 5, 6, False)]  # the cap
    plan = step(sched)
    assert runs(plan) == [(a.id, 4, 1, True), (w.id, 11, 2, False)]  # up to the prefix boundary, not past it
    assert sched.take_warmed() == [(w, "warmed")]
    entry = sched.reuse.cache.lookup(w.prefix_key, w.tokens, 13).entry
    assert entry.warmed and entry.hits == 0 and w.num_computed == 13
    assert sched.warm_stats.warms_computed == 1
    check_pages(sched)


def test_a_warms_chunk_reaches_one_new_image_a_step_while_a_question_runs():
    two = [VisualSpan(start=2, grid_h=1, grid_w=4, kind="image", item=0),  # 2 .. 5, end token 6
           VisualSpan(start=8, grid_h=1, grid_w=4, kind="image", item=1)]  # 8 .. 11, end token 12
    ids = [10, 11, 98, 98, 98, 98, 12, 13, 99, 99, 99, 99, 14, 7]
    p = Prompt(ids, torch.arange(14).unsqueeze(0).expand(3, -1).clone(), 0, two, image_hashes=["a", "b"],
               image_keys=["a", "b"])
    sched = make(num_pages=16, budget=16, max_warm_tokens=16, max_warm_images=1)
    a = submit(sched, request([1, 2, 3], max_tokens=8))
    w = warm(sched, p=p)
    assert runs(step(sched)) == [(a.id, 0, 3, True), (w.id, 0, 8, False)]  # image 0; stops before image 1
    assert runs(step(sched)) == [(a.id, 3, 1, True), (w.id, 8, 5, False)]
    assert sched.take_warmed() == [(w, "warmed")]


def test_with_no_question_running_a_warm_goes_at_full_speed():
    sched = make(num_pages=16, budget=16, max_warm_tokens=4, max_warm_images=1)
    w = warm(sched)
    assert runs(step(sched)) == [(w.id, 0, 13, False)]  # the whole prefix, image and all, in one step
    assert sched.take_warmed() == [(w, "warmed")]


def test_no_warm_is_admitted_while_a_question_waits_for_pages():
    sched = make(num_pages=4, budget=16, max_warm_tokens=4)
    a = submit(sched, request(list(range(1, 12)), max_tokens=4))  # 11 tokens: 3 of the 4 pages
    step(sched)
    b = submit(sched, request(list(range(30, 38))))  # needs 2 pages, 1 is free: b waits
    w = warm(sched)  # its first chunk (4 tokens) would fit the free page: it must not take it
    plan = step(sched)
    assert runs(plan) == [(a.id, 11, 1, True)]  # a decodes in its pages; neither b nor the warm is admitted
    assert sched.pool.num_free == 1
    assert list(sched.waiting) == [b] and list(sched.warming) == [w] and w.status is Status.WAITING


def test_a_question_takes_a_running_warms_pages_and_the_warm_resumes_later():
    sched = make(num_pages=6, budget=16, max_warm_tokens=8, max_warm_images=0)
    c = submit(sched, request([1, 2], max_tokens=40))  # a stream: the warm is throttled beside it
    w = warm(sched)
    assert runs(step(sched)) == [(c.id, 0, 2, True), (w.id, 0, 8, False)]  # c 1 page, the warm 2
    q = submit(sched, request(list(range(40, 56)), max_tokens=2))  # 15 tokens this step: 4 pages; 3 are free
    plan = step(sched)
    assert plan.preempted == [w.id] and w.telemetry.preempted == 1
    assert runs(plan) == [(c.id, 2, 1, True), (q.id, 0, 15, False)]  # the warm gave its pages up
    assert list(sched.warming) == [w] and w.num_computed == 0 and q.telemetry.preempted == 0
    step(sched)
    step(sched)
    finish(sched, q, normal=False)
    while not sched.take_warmed():  # the warm starts over once there is room
        step(sched)
    assert w.num_computed == 13 and c.telemetry.preempted == 0
    check_pages(sched)


def test_a_warm_evicts_only_entries_nobody_hit_and_is_dropped_when_nothing_frees_pages():
    sched = make(num_pages=5, budget=16)
    hit_once = submit(sched, request([*PREFIX, *QUESTION], image=True, salt="a", reuse=sched.reuse, max_tokens=1))
    step(sched)
    finish(sched, hit_once, normal=False)  # cached: 4 pages (13 tokens); 1 page free
    again = submit(sched, request([*PREFIX, 30], image=True, salt="a", reuse=sched.reuse, max_tokens=1))
    step(sched)
    assert again.telemetry.prefix_cache == "hit"
    finish(sched, again, normal=False)
    entry = sched.reuse.cache.prefixes[hit_once.prefix_key]
    assert entry.hits == 1 and sched.pool.num_free == 1

    w = warm(sched, ids=[*PREFIX[:4], *[55] * 8, PREFIX[-1]], salt="b")  # another session: 4 pages
    step(sched)
    (dropped, error), = sched.take_failures()
    assert dropped is w and isinstance(error, EngineOverloadedError)
    assert entry.alive and sched.warm_stats.warms_dropped == 1  # the hit entry stayed

    unhit = make(num_pages=5, budget=16, max_warm_images=0)
    cold = submit(unhit, request([*PREFIX, *QUESTION], image=True, salt="a", reuse=unhit.reuse, max_tokens=1))
    step(unhit)
    finish(unhit, cold, normal=False)
    first = unhit.reuse.cache.prefixes[cold.prefix_key]
    w2 = warm(unhit, ids=[*PREFIX[:4], *[55] * 8, PREFIX[-1]], salt="b")
    step(unhit)
    assert not first.alive and w2.status is Status.RUNNING  # a zero-hit idle entry may go
    assert unhit.reuse.cache.stats.prefix_evictions == 1


def test_a_question_for_a_prefix_being_warmed_waits_and_hits_it_first_and_once():
    sched = make(num_pages=16, budget=8, max_warm_tokens=8, max_warm_images=0)
    w = warm(sched)
    step(sched)  # 8 of the 13 prefix tokens
    q = submit(sched, request([*PREFIX, *QUESTION], image=True, reuse=sched.reuse))
    assert q.telemetry.prefix_cache == "miss"  # looked up while the warm computes
    plan = step(sched)
    assert runs(plan) == [(w.id, 8, 5, False)]  # q waits for the computation in flight
    assert sched.take_warmed() == [(w, "warmed")]
    finish(sched, w, normal=False)
    plan = step(sched)
    assert runs(plan) == [(q.id, 13, 3, True)]  # only its question: the warm's prefix attached
    tel = q.telemetry
    assert (tel.prefix_cache, tel.warmed, tel.cached_tokens) == ("hit", True, 13)
    r = submit(sched, request([*PREFIX, 40, 41], image=True, reuse=sched.reuse))
    step(sched)
    assert (r.telemetry.prefix_cache, r.telemetry.warmed) == ("hit", False)  # the first attach only
    stats = sched.reuse.cache.stats
    assert (stats.hits, stats.misses) == (2, 0)
    check_pages(sched)


def test_a_warm_for_a_prefix_a_question_computes_waits_then_ends_as_cached():
    sched = make(num_pages=16, budget=8)
    q = submit(sched, request([*PREFIX, *QUESTION], image=True, reuse=sched.reuse))
    w = warm(sched)
    assert runs(step(sched)) == [(q.id, 0, 8, False)]  # the question first; the warm waits for it
    step(sched)
    step(sched)
    assert sched.take_warmed() == [(w, "cached")]
    assert sched.warm_stats.warms_cached == 1 and sched.warm_stats.warms_computed == 0
    assert not sched.reuse.cache.prefixes[q.prefix_key].warmed
