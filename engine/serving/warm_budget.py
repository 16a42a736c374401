"""The share of the engine's time warms may take while questions run: a token bucket of seconds.

A warm's chunks ride steps that also carry running streams' decode rows, and such a step cannot
replay the decode CUDA graphs: it runs the eager forward and the vision encoder, several times a
decode step (at the 8B shape on the H200, 29-52 ms against 5.1 ms; docs/PERFORMANCE.md, "Warm at
upload"). Per-step bounds alone cannot keep a stream's TPOT within a few percent, since a warm's
work (~75 ms for 8 photos) is already ~5.6% of a 256-token stream: the warm must wait its turn.

While the engine is contended (a question runs or waits) **and a warm waits for its turn**, the
bucket's ``credit`` (seconds) grows by ``share`` x the wall-clock time passed, up to ``burst_s``;
each contended step that carried warm chunks spends its measured execution time (the whole step's:
conservative, its decode rows included). A step may carry warm chunks only when the credit covers
its expected cost: the last charged step's cost per warm token times the chunk's tokens, and at most
``burst_s`` (a step dearer than the burst runs once the bucket is full, so a warm never starves);
before any step was charged, once the bucket is full (the cost unknown, the dearest the rule
allows). The credit may go below zero (a step dearer than expected): later steps wait until it is
repaid. So over any contended stretch of ``T`` seconds the steps carrying warms take at most
``share * T`` seconds, plus one step's misestimate. With nothing contended the bucket neither grows
nor is spent: warms go at full speed.

Why the bucket fills only while a warm waits: on the H200 (docs/PERFORMANCE.md, "Warm at upload",
budget v2) a stream that had run alone before a warm arrived had banked the whole burst, so the
warm's first contended step (51-81 ms at the 8B shape) ran at once inside the next 256-token stream:
1.084x its TPOT. Contention with no warm to pay for is no reason to let the next warm slow a stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class WarmBudget:
    """The bucket (see the module docstring).

    Args:
        share: the share of wall-clock time warms may take while contended, in (0, 1] (checked
            by :class:`~engine.serving.scheduler.SchedulerConfig`); 1 turns the budget off (every
            step may carry warm chunks, within the per-step bounds).
        burst_s: most credit banked, in seconds (>= 0).
        clock: seconds, monotonic (``time.monotonic``; tests pass a fake).

    Attributes:
        credit: seconds of step time warms may still spend (may be negative: a debt).
        per_token_s: the last charged step's execution seconds per warm token (None before one).
    """

    def __init__(self, share: float, burst_s: float, clock: Callable[[], float] = time.monotonic):
        self.share, self.burst_s, self.clock = share, burst_s, clock
        self.credit = 0.0
        self.per_token_s: float | None = None
        self._last = clock()
        self._accruing = False  # the state since the last tick

    @property
    def off(self) -> bool:
        return self.share >= 1

    def tick(self, accruing: bool) -> None:
        """Accrue for the time since the last tick (if the bucket was accruing meanwhile: the engine
        contended with a warm waiting) and note whether it accrues from now on. Called once a step,
        before it is planned."""
        now = self.clock()
        if self._accruing:
            self.credit = min(self.burst_s, self.credit + self.share * (now - self._last))
        self._last, self._accruing = now, accruing

    def allows(self, tokens: int) -> bool:
        """Whether a contended step may carry ``tokens`` warm tokens now."""
        if self.off:
            return True
        if self.per_token_s is None:
            need = self.burst_s
        else:
            need = min(self.per_token_s * tokens, self.burst_s)
        return self.credit >= need

    def spend(self, exec_s: float, tokens: int) -> None:
        """A contended step that carried ``tokens`` warm tokens took ``exec_s`` seconds."""
        self.credit -= exec_s
        if tokens > 0:
            self.per_token_s = exec_s / tokens
