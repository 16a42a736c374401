"""The warms' time budget (engine/serving/warm_budget.py) in the scheduler, on a fake clock.

While a question runs or waits, the steps carrying warm chunks may take ``warm_time_share`` of
the wall-clock time (plus the bank ``warm_burst_s``); with nothing contended a warm goes at full
speed, and a warm a waiting question joined goes at full speed too. Time is a fake clock the
tests advance by a fake cost of each step (a decode-only step 1 ms, a step carrying warm chunks
2 ms a warm token: the per-token estimate is then exact), and the costs are reported to
:meth:`Scheduler.step_done` as the loop reports measured ones. Nothing reads the wall clock.
"""

from __future__ import annotations

import pytest
from test_scheduler_core import PREFIX, FakeRunner, request, submit
from test_warm_scheduler import make, runs, warm

from engine.serving import loop as loop_module
from engine.serving.loop import EngineLoop
from engine.serving.plan import StepOutput
from engine.serving.scheduler import SchedulerConfig

DECODE_S = 0.001
WARM_TOKEN_S = 0.002


class Clock:
    """Monotonic seconds that only the test moves."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def warm_tokens(sched, plan) -> int:
    return sum(r.num_tokens for r in plan.runs if sched.request(r.req_id).warm)


def timed_step(sched, clock: Clock):
    """Plan a step, "run" it for its fake cost (the clock moves by it), report the cost and apply
    a fake output. Returns ``(plan, cost in seconds, warm tokens)``."""
    plan = sched.schedule()
    n = warm_tokens(sched, plan)
    cost = WARM_TOKEN_S * n if n else DECODE_S
    clock.t += cost
    sched.step_done(plan, cost)
    sched.update(plan, StepOutput(sampled={r.req_id: 100 + r.req_id for r in plan.runs if r.sample}))
    return plan, cost, n


def budgeted(clock: Clock, share: float = 0.1, burst_s: float = 0.02, **config):
    return make(num_pages=1024, budget=16, clock=clock, warm_time_share=share, warm_burst_s=burst_s,
                max_warm_tokens=4, max_warm_images=0, **config)


def test_a_warm_beside_a_stream_takes_at_most_its_share_of_the_time_and_still_finishes():
    clock = Clock()
    sched = budgeted(clock, share=0.1, burst_s=0.02)
    stream = submit(sched, request([1, 2, 3], max_tokens=10_000))
    timed_step(sched, clock)  # the stream's prompt
    start = clock.t
    w = warm(sched)
    warm_s, steps, chunks = 0.0, 0, []
    while not sched.take_warmed():
        plan, cost, n = timed_step(sched, clock)
        steps += 1
        assert steps < 2_000, "the warm never finished under continuous contention"
        if n:
            warm_s += cost
            chunks.append(n)
        # the bound at every step: the bank starts empty and fills only while the warm waits, the
        # first step (8 ms, its cost unknown) waits for a full bank, every later cost was foreseen
        assert warm_s <= 0.1 * (clock.t - start) + 1e-9
        assert sched.warm_budget.credit <= 0.02 + 1e-12
    assert chunks == [4, 4, 4, 1]  # the per-step bound still holds within the budget
    assert w.num_computed == 13 and stream.status.name == "RUNNING"
    assert sched.warm_stats.warms_deferred_steps > 0
    # the warm waited for the first step's credit, then for each step's estimate: most steps were the stream's
    assert steps - len(chunks) == sched.warm_stats.warms_deferred_steps
    assert clock.t - start >= 0.02 / 0.1  # the first chunk waited for the full bank


def test_contention_before_a_warm_banks_nothing_and_the_bank_is_capped():
    """A stream running alone banks no credit for a warm that is not there yet (on the H200 a
    stream's banked burst let the next warm's first step, 51-81 ms, run inside the next stream at
    once); once the warm waits, the bank fills to ``burst_s`` and no further."""
    clock = Clock()
    sched = budgeted(clock, share=0.1, burst_s=0.012)
    submit(sched, request([1, 2, 3], max_tokens=10_000))
    for _ in range(500):  # 0.5 s of a stream alone: nothing to bank for
        timed_step(sched, clock)
    assert sched.warm_budget.credit == 0.0
    start = clock.t
    warm(sched)
    plan, cost, n = timed_step(sched, clock)
    assert n == 0  # the first chunk waits for the bank to fill: 12 ms at 10 % of the time
    waited, warm_s = 0, 0.0
    while not sched.take_warmed():
        plan, cost, n = timed_step(sched, clock)
        waited += not n and warm_s == 0.0
        warm_s += cost if n else 0.0
        assert sched.warm_budget.credit <= 0.012 + 1e-12
        assert warm_s <= 0.1 * (clock.t - start) + 1e-9
    assert waited >= 100  # ~120 decode steps of 1 ms before the first warm chunk


def test_with_nothing_contended_a_warm_ignores_the_budget_and_spends_none():
    clock = Clock()
    sched = budgeted(clock, share=0.03)
    w = warm(sched)
    plan, cost, n = timed_step(sched, clock)
    assert runs(plan) == [(w.id, 0, 13, False)]  # the whole prefix at once, with no credit at all
    assert sched.take_warmed() == [(w, "warmed")]
    assert sched.warm_budget.credit == 0.0 and sched.warm_stats.warms_deferred_steps == 0


def test_a_warm_a_waiting_question_joined_runs_unbounded_and_unbudgeted():
    clock = Clock()
    sched = budgeted(clock, share=0.1)
    other = submit(sched, request([1, 2, 3], max_tokens=10_000))  # another session's stream
    timed_step(sched, clock)
    w = warm(sched)
    while w.num_computed == 0:  # the warm starts once its first chunk is paid for
        timed_step(sched, clock)
    assert w.num_computed == 4
    q = submit(sched, request([*PREFIX, 20, 21, 22], image=True, reuse=sched.reuse))
    credit = sched.warm_budget.credit
    assert credit < WARM_TOKEN_S * 9  # the budget alone would not pay for the rest
    at = len(other.tokens) - 1  # the stream's next decode position
    plan, cost, n = timed_step(sched, clock)
    assert runs(plan) == [(other.id, at, 1, True), (w.id, 4, 9, False)]  # all of it: past max_warm_tokens
    assert sched.take_warmed() == [(w, "warmed")] and q.status.name == "WAITING"
    # accrued (planning accrues the time since the last planning: the warm's first step, 8 ms), not spent
    assert sched.warm_budget.credit == pytest.approx(credit + 0.1 * 4 * WARM_TOKEN_S)
    assert sched.warm_stats.warms_deferred_steps > 0  # it had waited for the budget before


def test_share_one_turns_the_budget_off_and_bad_shares_are_refused():
    clock = Clock()
    sched = budgeted(clock, share=1.0)
    a = submit(sched, request([1, 2, 3], max_tokens=100))
    w = warm(sched)
    assert runs(sched.schedule()) == [(a.id, 0, 3, True), (w.id, 0, 4, False)]  # no credit needed
    for share in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="warm_time_share"):
            SchedulerConfig(warm_time_share=share)
    with pytest.raises(ValueError, match="warm_burst_s"):
        SchedulerConfig(warm_burst_s=-1.0)


def test_the_loop_reports_each_steps_execution_time_to_the_budget(monkeypatch):
    """EngineLoop.step times the runner (perf_counter, faked here) and reports it: the budget
    spends exactly what the step carrying the warm chunk took."""

    class FakeTime:
        now = 0.0

        @classmethod
        def perf_counter(cls):
            return cls.now

    class TimedRunner(FakeRunner):
        def execute(self, plan):
            FakeTime.now += 0.25 if any(sched.request(r.req_id).warm for r in plan.runs) else 0.001
            return super().execute(plan)

    monkeypatch.setattr(loop_module, "time", FakeTime)
    clock = Clock()
    sched = budgeted(clock, share=0.1, burst_s=0.5)
    sched.warm_budget.credit = 0.5  # as if banked (the fake runner's steps are slow)
    req = request([1, 2, 3], max_tokens=50)
    loop = EngineLoop(sched, TimedRunner({req.id: [5] * 50}), sched.reuse, eos_token_ids={0}, start=False)
    loop.submit(req)
    loop.step()
    w = warm(sched)
    loop.step()  # the stream's decode row and the warm's first chunk
    assert w.num_computed == 4
    assert sched.warm_budget.credit == pytest.approx(0.5 - 0.25)
    assert sched.warm_budget.per_token_s == pytest.approx(0.25 / 4)
    loop.close()
