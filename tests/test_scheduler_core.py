"""The scheduler alone, with no engine and no model: a :class:`Scheduler` on a tiny CPU
:class:`PagePool` with a real :class:`PrefixReuse` / :class:`PrefixCache`, driven by fake step
outputs (the token a model would have sampled), as a runner and a loop would drive it.

Every expected plan is written out by hand from the rules (pages of 4 tokens handed out lowest
index first, a released page going to the end of the free list, decode first, then partial
prefills, then admissions in arrival order; the prefix's kept tokens under the uniform selector
``floor((j + 1/2) * m / k)``), never computed with the code under test. The last test drives
:meth:`EngineLoop.step` with a fake runner.
"""

from __future__ import annotations

import threading

import torch

from engine.cache.compaction import CompactionConfig
from engine.cache.kv_pool import PageCopy, PagePool, SlotMove
from engine.cache.prefix_cache import PrefixCache
from engine.cache.prefix_reuse import PrefixReuse
from engine.inputs.prompts import Prompt
from engine.model.rope import VisualSpan
from engine.serving.loop import EngineLoop
from engine.serving.outputs import Completion
from engine.serving.plan import ScheduledRun, StepOutput, StepPlan
from engine.serving.request import Request, Status
from engine.serving.sampling import SamplingParams
from engine.serving.scheduler import Scheduler, SchedulerConfig

PAGE = 4
IMAGE = ("image", 0)
#: A media-first prompt: 4 text tokens, an image of 2 x 4 merged tokens (positions 4 .. 11), its
#: <|vision_end|> (12): the public prefix is 13 tokens. The question follows.
PREFIX = [10, 11, 12, 13, *[99] * 8, 14]
SPAN = VisualSpan(start=4, grid_h=2, grid_w=4, kind="image", item=0)
#: What the uniform selector keeps of the 8 visual tokens at keep ratio 0.5: k = 4 of m = 8,
#: candidates floor((j + 1/2) * 2) = 1, 3, 5, 7, i.e. positions 5, 7, 9, 11; text and
#: <|vision_end|> stay: 9 of the 13 prefix tokens.
KEPT = (0, 1, 2, 3, 5, 7, 9, 11, 12)


class FakeStream:
    """A text stream that shows each token as ``<id>``; ``stop_on`` ends the request; ``probe()``
    (if set) runs at each push."""

    def __init__(self, stop_on: int | None = None):
        self.text, self.stopped, self.stop_on = "", False, stop_on
        self.probe = None

    def push(self, token: int) -> str:
        if self.probe is not None:
            self.probe()
        if token == self.stop_on:
            self.stopped = True
            return ""
        self.text += f"<{token}>"
        return f"<{token}>"

    def finish(self) -> str:
        return ""


def prompt(ids: list[int], image: bool) -> Prompt:
    n = len(ids)
    positions = torch.arange(n).unsqueeze(0).expand(3, -1).clone()
    if not image:
        return Prompt(list(ids), positions, 0, [])
    return Prompt(list(ids), positions, 0, [SPAN], image_hashes=["img"], image_keys=["img"])


def request(ids: list[int], *, image: bool = False, salt: str = "s", reuse: PrefixReuse | None = None,
            max_tokens: int = 8, stop_on: int | None = None) -> Request:
    req = Request(prompt(ids, image), SamplingParams(max_tokens=max_tokens), None, FakeStream(stop_on))
    req.salt = salt
    if reuse is not None:
        req.prefix_key = reuse.key(req.prompt, salt)
    return req


def make(num_pages: int, budget: int = 64, *, cache: str | None = None, compaction: CompactionConfig | None = None,
         pressure: tuple[CompactionConfig, ...] = (), conversation_reuse: bool = True):
    """A scheduler on a fresh pool; ``cache``: None (no prefix cache), ``"always"`` or ``"on_pressure"``."""
    pool = PagePool(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=num_pages, page_size=PAGE,
                    kv_cache_dtype="auto")
    reuse = None
    if cache is not None:
        reuse = PrefixReuse(PrefixCache(pool, pressure), compaction or CompactionConfig(None), "test",
                            conversation_reuse=conversation_reuse, mode=cache)
    return Scheduler(pool, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget), reuse)


def submit(sched: Scheduler, req: Request) -> Request:
    """What the loop does at intake: the prefix lookup, then the waiting queue."""
    if sched.reuse is not None:
        sched.reuse.look_up(req)
    sched.add(req)
    return req


def step(sched: Scheduler, tokens: dict[int, int] | None = None, scores: dict | None = None) -> StepPlan:
    """Plan a step and apply a fake output: each run that samples gets ``tokens[id]`` (default
    100 + id)."""
    plan = sched.schedule()
    tokens = tokens or {}
    sampled = {run.req_id: tokens.get(run.req_id, 100 + run.req_id) for run in plan.runs if run.sample}
    sched.update(plan, StepOutput(sampled=sampled, scores=scores or {}))
    return plan


def finish(sched: Scheduler, req: Request, normal: bool = True) -> None:
    """What the loop does when a request ends (a normal end keeps its conversation)."""
    if normal and sched.reuse is not None:
        sched.reuse.keep_conversation(req)
    sched.finish(req)


def check_pages(sched: Scheduler) -> None:
    holders = [r.block_table for r in sched.running]
    if sched.reuse is not None:
        holders += sched.reuse.cache.holders()
    sched.pool.check(holders)


def run(req: Request, start: int, n: int, table: tuple[int, ...], *, kv_offset: int = 0, visual=(),
        sample: bool = True, ids: tuple[int, ...] | None = None) -> ScheduledRun:
    token_ids = tuple(req.tokens[start : start + n]) if ids is None else ids
    return ScheduledRun(req.id, start, n, token_ids, table, kv_offset, tuple(visual), sample)


# ------------------------------------------------------------------------------------------------
# admission, chunked prefill, decode
# ------------------------------------------------------------------------------------------------


def test_admission_chunked_prefill_then_decode():
    sched = make(num_pages=8, budget=8)
    a = submit(sched, request(list(range(1, 11))))  # 10 tokens, 8 a step
    first = step(sched)
    assert first.runs == [run(a, 0, 8, (0, 1), sample=False)]
    assert [n.req_id for n in first.new] == [a.id] and first.new[0].token_ids == tuple(range(1, 11))
    assert (first.finished, first.preempted, first.kv_orders, first.scores) == ([], [], [], [])
    assert a.num_computed == 8 and a.status is Status.RUNNING and a.tokens == list(range(1, 11))

    second = step(sched, {a.id: 500})
    assert second.runs == [run(a, 8, 2, (0, 1, 2))] and second.new == []  # the last 2 prompt tokens, sampled
    assert a.num_computed == 10 and a.tokens[-1] == 500

    third = step(sched)
    assert third.runs == [run(a, 10, 1, (0, 1, 2), ids=(500,))]  # a decode: 11 tokens still fit 3 pages
    assert a.num_computed == 11
    check_pages(sched)


def test_decode_first_then_partial_prefill_then_admission_in_arrival_order():
    sched = make(num_pages=8, budget=6)
    a = submit(sched, request([1, 2, 3, 4]))
    assert step(sched).runs == [run(a, 0, 4, (0,))]
    b = submit(sched, request(list(range(20, 30))))  # 10 tokens
    c = submit(sched, request([40, 41, 42]))
    # a decodes (its 5th token needs page 1), b gets the rest of the budget, c waits
    assert step(sched).runs == [run(a, 4, 1, (0, 1)), run(b, 0, 5, (2, 3), sample=False)]
    assert [r.id for r in sched.waiting] == [c.id]
    # a decodes, b's partial prefill comes before any admission and takes the 5 tokens left
    assert step(sched).runs == [run(a, 5, 1, (0, 1)), run(b, 5, 5, (2, 3, 4))]
    # both decode, then c is admitted into the 4 tokens left
    plan = step(sched)
    assert plan.runs == [run(a, 6, 1, (0, 1)), run(b, 10, 1, (2, 3, 4)), run(c, 0, 3, (5,))]
    assert [n.req_id for n in plan.new] == [c.id]
    check_pages(sched)


def test_preemption_frees_the_latest_request_and_its_resume_recomputes_without_resending():
    sched = make(num_pages=3, budget=16)
    a = submit(sched, request([1, 2, 3, 4]))
    b = submit(sched, request([5, 6, 7, 8]))
    assert step(sched).runs == [run(a, 0, 4, (0,)), run(b, 0, 4, (1,))]
    # a's 5th token takes the last free page; b's needs one more: b, the latest, is preempted
    plan = step(sched, {a.id: 61})
    assert plan.runs == [run(a, 4, 1, (0, 2), ids=(100 + a.id,))]
    assert plan.preempted == [b.id]
    assert (b.status, b.num_computed, b.block_table, b.telemetry.preempted) == (Status.WAITING, 0, [], 1)
    assert list(sched.waiting) == [b] and b.tokens == [5, 6, 7, 8, 100 + b.id]  # it keeps its token
    finish(sched, a)
    # a's pages 0 and 2 went back after b's page 1: b gets the last two freed, 2 then 0; it
    # recomputes its prompt and its generated token, and the runner is not sent it again
    plan = step(sched)
    assert plan.finished == [a.id] and plan.new == [] and plan.preempted == []
    assert plan.runs == [run(b, 0, 5, (2, 0), ids=(5, 6, 7, 8, 100 + b.id))]
    assert b.num_computed == 5 and len(b.generated) == 2
    check_pages(sched)


# ------------------------------------------------------------------------------------------------
# the prefix cache: attach, copy-on-write, compaction, eviction, pressure
# ------------------------------------------------------------------------------------------------


def test_prefix_attach_and_copy_on_write():
    sched = make(num_pages=8, cache="always")
    a = submit(sched, request([*PREFIX, 20, 21, 22], image=True, reuse=sched.reuse))
    assert a.telemetry.prefix_cache == "miss"
    # the cold prefix's chunk stops at its end (13 tokens, 4 pages); it is cached dense
    cold = step(sched)
    assert cold.runs == [run(a, 0, 13, (0, 1, 2, 3), visual=[IMAGE], sample=False)]
    assert cold.kv_orders == [] and cold.scores == []
    entry = sched.reuse.cache.prefixes[a.prefix_key]
    assert entry.pages == [0, 1, 2, 3] and a.attached is entry and a.kv_offset == 0
    # the question writes into the shared, partly filled page 3: a private copy first (page 4)
    question = step(sched)
    assert question.kv_orders == [PageCopy(3, 4)]
    assert question.runs == [run(a, 13, 3, (0, 1, 2, 4))]
    b = submit(sched, request([*PREFIX, 30, 31], image=True, reuse=sched.reuse))
    assert b.telemetry.prefix_cache == "hit"
    # a decodes first (17 tokens: page 5), then b attaches pages 0..3 and copies page 3 (page 6)
    plan = step(sched)
    assert plan.runs == [run(a, 16, 1, (0, 1, 2, 4, 5), ids=(100 + a.id,)), run(b, 13, 2, (0, 1, 2, 6))]
    assert plan.kv_orders == [PageCopy(3, 6)]
    assert b.telemetry.cached_tokens == 13 and entry.users == 2
    check_pages(sched)


def test_compaction_orders_the_kept_slots_before_the_next_copy_on_write():
    sched = make(num_pages=8, cache="always", compaction=CompactionConfig("uniform", 0.5, min_keep=1))
    a = submit(sched, request([*PREFIX, 20, 21, 22], image=True, reuse=sched.reuse))
    cold = step(sched)
    assert cold.runs == [run(a, 0, 13, (0, 1, 2, 3), visual=[IMAGE], sample=False)] and cold.kv_orders == []
    # compacted after the step: 9 tokens kept in pages 0..2, page 3 released
    assert (a.block_table, a.kv_offset, sched.pool.refcount[3]) == ([0, 1, 2], 4, 0)
    entry = sched.reuse.cache.prefixes[a.prefix_key]
    assert entry.pages == [0, 1, 2] and entry.kv_len == 9 and entry.kept.positions.tolist() == list(KEPT)
    # the next plan moves the kept slots first, then copies the shared, partly filled page 2
    # (9 tokens stored) onto the page just freed
    plan = step(sched)
    assert plan.kv_orders == [SlotMove(KEPT, tuple(range(9))), PageCopy(2, 3)]
    assert plan.runs == [run(a, 13, 3, (0, 1, 3), kv_offset=4)]
    check_pages(sched)


def test_a_score_based_compaction_asks_the_runner_for_scores_at_the_prefix_boundary():
    sched = make(num_pages=8, budget=8, cache="always", compaction=CompactionConfig("attention", 0.5, min_keep=1))
    a = submit(sched, request([*PREFIX, 20, 21, 22], image=True, reuse=sched.reuse))
    assert step(sched).scores == []  # 8 of the 13 prefix tokens: not at the boundary yet
    # the runner's scores (here: attention rising with the position) choose the kept tokens
    scores = {a.id: {"attention": torch.arange(13, dtype=torch.float32)}}
    plan = step(sched, scores=scores)
    assert plan.scores == [a.id] and plan.runs == [run(a, 8, 5, (0, 1, 2, 3), visual=[IMAGE], sample=False)]
    entry = sched.reuse.cache.prefixes[a.prefix_key]
    assert entry.kept.positions.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 12] and entry.scores is scores[a.id]
    assert step(sched).kv_orders[0] == SlotMove((0, 1, 2, 3, 8, 9, 10, 11, 12), tuple(range(9)))


def test_an_idle_entry_is_evicted_before_a_request_waits():
    sched = make(num_pages=5, cache="always", conversation_reuse=False)
    a = submit(sched, request([*PREFIX, 20, 21, 22], image=True, reuse=sched.reuse))
    step(sched)
    assert step(sched).kv_orders == [PageCopy(3, 4)]
    finish(sched, a)
    # the entry holds pages 0..3, page 4 is free; c needs 2 pages: the entry goes, nobody waits
    c = submit(sched, request(list(range(1, 9))))
    plan = step(sched)
    assert plan.finished == [a.id] and plan.preempted == []
    assert plan.runs == [run(c, 0, 8, (3, 2))]  # pages 0..3 went back after page 4: the last two first
    stats = sched.reuse.cache.stats
    assert (stats.prefix_evictions, stats.extension_evictions, len(sched.reuse.cache.entries)) == (1, 0, 0)
    check_pages(sched)


def test_pressure_order_extension_then_a_compaction_step_then_eviction():
    sched = make(num_pages=6, cache="on_pressure", compaction=CompactionConfig("uniform", 0.5, min_keep=1),
                 pressure=(CompactionConfig("uniform", 0.5, min_keep=1),))
    cache = sched.reuse.cache
    a = submit(sched, request([*PREFIX, 20, 21, 22], image=True, reuse=sched.reuse))
    assert step(sched).kv_orders == []  # cached dense under on_pressure: no move
    assert step(sched).kv_orders == [PageCopy(3, 4)]
    finish(sched, a)  # its turn is kept as an extension: pages 0, 1, 2, 4
    (ext,) = cache.prefixes[a.prefix_key].children
    assert ext.pages == [0, 1, 2, 4]
    # c needs 3 pages, 1 is free: the idle extension goes first (page 4 back), then the prefix is
    # compacted one step (page 3 back), and nothing is evicted
    c = submit(sched, request(list(range(1, 12))))  # 11 tokens
    plan = step(sched)
    assert plan.kv_orders == [SlotMove(KEPT, tuple(range(9)))]
    assert plan.runs == [run(c, 0, 11, (3, 4, 5))]  # the move runs before c writes page 3
    entry = cache.prefixes[a.prefix_key]
    assert entry.pages == [0, 1, 2] and entry.kv_len == 9
    stats = cache.stats
    assert (stats.extension_evictions, stats.pressure_compactions, stats.prefix_evictions) == (1, 1, 0)
    # d needs 2 pages, none is free and the prefix has had its one step: it is evicted
    d = submit(sched, request(list(range(1, 9))))
    plan = step(sched)
    assert plan.runs == [run(c, 11, 1, (3, 4, 5), ids=(100 + c.id,)), run(d, 0, 8, (2, 1))]
    assert plan.kv_orders == [] and plan.preempted == []
    assert (cache.stats.pressure_compactions, cache.stats.prefix_evictions) == (1, 1) and not cache.entries
    check_pages(sched)


# ------------------------------------------------------------------------------------------------
# EngineLoop.step with a fake runner
# ------------------------------------------------------------------------------------------------


class FakeRunner:
    """Records the plans it is given and samples ``script[id]`` tokens in order."""

    def __init__(self, script: dict[int, list[int]]):
        self.script, self.plans = script, []

    def execute(self, plan: StepPlan) -> StepOutput:
        self.plans.append(plan)
        return StepOutput(sampled={r.req_id: self.script[r.req_id].pop(0) for r in plan.runs if r.sample})


def test_engine_loop_step_runs_one_iteration_and_a_stop_ends_the_request_in_that_step():
    sched = make(num_pages=8, budget=8)
    req = request([1, 2, 3], stop_on=9)
    runner = FakeRunner({req.id: [7, 8, 9, 5]})
    loop = EngineLoop(sched, runner, None, eos_token_ids={0}, debug_checks=True, start=False)
    assert loop.step() is False  # nothing submitted
    loop.submit(req)
    assert loop.step() is True and req.tokens == [1, 2, 3, 7] and req.outbox.get_nowait() == "<7>"
    assert loop.step() is True and req.outbox.get_nowait() == "<8>"
    assert loop.step() is True  # 9 is the stop token: the request ends in this step
    assert req.status is Status.FINISHED and sched.pool.num_free == 8
    done = req.outbox.get_nowait()
    assert isinstance(done, Completion) and done.finish_reason == "stop" and done.token_ids == [7, 8, 9]
    assert [[r.num_tokens for r in p.runs] for p in runner.plans] == [[3], [1], [1]]
    # no work, but the runner is told to drop the finished request's state (and only once)
    assert loop.step() is False and runner.plans[-1].finished == [req.id] and runner.plans[-1].runs == []
    assert loop.step() is False and len(runner.plans) == 4
    other = request([4, 5])
    runner.script[other.id] = [6]
    loop.submit(other)
    assert loop.step() is True and runner.plans[-1].finished == []
    assert loop.close() is True
    assert isinstance(other.outbox.get_nowait(), str)


def test_detokenisation_runs_outside_the_loop_lock():
    """While a token is pushed through the text stream another thread can take the loop's lock
    (``paused()``: stats, a clear) instead of waiting for the detokeniser."""
    sched = make(num_pages=8, budget=8)
    req = request([1, 2, 3], max_tokens=2)
    loop = EngineLoop(sched, FakeRunner({req.id: [7, 8]}), None, eos_token_ids={0}, start=False)
    free = []

    def take_and_give_back():
        took = loop._cv.acquire(blocking=False)
        if took:
            loop._cv.release()
        free.append(took)

    def probe():
        other = threading.Thread(target=take_and_give_back)
        other.start()
        other.join()

    req.stream.probe = probe
    loop.submit(req)
    assert loop.step() and loop.step()
    assert free == [True, True]
    assert req.status is Status.FINISHED and req.outbox.get_nowait() == "<7>"
    loop.close()
