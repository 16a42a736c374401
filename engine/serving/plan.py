"""The step plan and the step's output: the data that crosses between the scheduling side and the
model side of the loop, in both directions.

The scheduler decides a :class:`StepPlan`; the runner executes it (the pool's data moves first,
then the vision encoder, then the forward) and returns a :class:`StepOutput`; the scheduler alone
writes request state from the two (:meth:`Scheduler.update
<engine.serving.scheduler.Scheduler.update>`). No live request crosses: a plan names requests by
id, so under tensor parallelism (:mod:`engine.parallel`) the other ranks are sent the same plan.

Block tables travel whole (:attr:`ScheduledRun.block_table`), not as page diffs: a table changes
by appending pages, by a copy-on-write replacement of its last page, by a prefix attach, by
compaction's truncation and by preemption's reset, and a diff would make every rank replay those
edits in the scheduler's order; the attention metadata needs each sequence's whole table every
step anyway, so the full table costs nothing the forward does not already copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..cache.kv_pool import KVOrder, PageCopy, SlotMove, ValueMerge
from ..cache.kv_transfer import Offload, Restore, TransferDone
from ..model.rope import VisualSpan

__all__ = ["NewRequest", "ScheduledRun", "StepPlan", "StepOutput", "KVOrder", "PageCopy", "SlotMove", "ValueMerge",
           "Offload", "Restore"]


@dataclass(frozen=True)
class NewRequest:
    """What the runner keeps of a request, sent in the first plan that schedules it (kept by the
    runner across preemption, dropped when a plan lists the id in :attr:`StepPlan.finished`).

    Attributes:
        req_id: the request's id.
        token_ids: its prompt token ids (rank 0's repetition penalty reads them).
        positions: int64 ``[3, num_prompt]`` M-RoPE positions of the prompt (CPU; a nested list
            in a tensor-parallel worker's copy, see :meth:`for_worker`).
        rope_delta: position offset of generated tokens (``position = index + rope_delta``).
        spans: the prompt's visual spans (logical positions).
        prompt: the :class:`~engine.inputs.prompts.Prompt` (the encoder's and the token scores'
            input), None in a worker's copy.
        salt: the cache salt the encoder's caches are keyed by.
        sampling, sampler: the request's :class:`~engine.serving.sampling.SamplingParams` and
            :class:`~engine.serving.sampling.Sampler`, None in a worker's copy.
    """

    req_id: int
    token_ids: tuple[int, ...]
    positions: Any
    rope_delta: int
    spans: tuple[VisualSpan, ...]
    prompt: Any = None
    salt: str = ""
    sampling: Any = None
    sampler: Any = None

    @property
    def num_prompt(self) -> int:
        return len(self.token_ids)

    def for_worker(self) -> NewRequest:
        """The copy a tensor-parallel worker is sent: positions as lists (a tensor through the
        pipe would move to shared memory), no prompt, sampler or sampling."""
        return replace(self, positions=self.positions.tolist(), prompt=None, sampling=None, sampler=None, salt="")


@dataclass(frozen=True)
class ScheduledRun:
    """One request's work in a step: compute logical tokens ``start .. start + num_tokens - 1``.

    Attributes:
        req_id: the request.
        start: its ``num_computed`` before the step (logical index of the first token computed).
        num_tokens: tokens computed (1 for a decode).
        token_ids: the ids of those tokens.
        block_table: the request's pages after the step's allocation (whole, see the module
            docstring).
        kv_offset: logical tokens removed by compaction (physical index = logical - kv_offset).
        visual_items: ``(kind, index)`` of the images / videos with tokens in the range: the
            runner encodes those it does not hold yet.
        sample: whether the step reaches the end of the request's tokens (a next token is sampled).
    """

    req_id: int
    start: int
    num_tokens: int
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]
    kv_offset: int
    visual_items: tuple[tuple[str, int], ...] = ()
    sample: bool = True

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def kv_len(self) -> int:
        """Tokens already stored in the pages before the step (0: no cached context)."""
        return self.start - self.kv_offset


@dataclass
class StepPlan:
    """The work of one step, decided by :meth:`Scheduler.schedule
    <engine.serving.scheduler.Scheduler.schedule>`.

    Attributes:
        runs: decodes first, then prefill chunks in admission order (the runner lays out the flat
            batch: it puts sequences without cached context first).
        new: the requests scheduled for the first time (:class:`NewRequest`).
        finished: ids of requests that ended since the last plan (the runner drops their state and
            vision features).
        preempted: ids of requests preempted by this plan (their pages were freed; the runner
            keeps their state and features, so recomputation never reruns the encoder).
        kv_orders: the pool's data moves (:class:`PageCopy`, :class:`SlotMove`, :class:`ValueMerge`) and the copies
            between the KV tiers (:class:`Offload`, :class:`Restore`: started on the copy stream,
            not waited for) decided since the last plan, in the order decided: applied before
            anything else.
        scores: ids of requests whose cold public prefix this step completes and whose compaction
            needs token scores: the runner, which holds the vision features, computes them.
        transfers_landed: ids of the tier copies rank 0 saw land since the last plan (their pages
            are reused or read from this plan on: a tensor-parallel rank's forward first waits for
            its own copies of them).
        transfers_awaited: ids of the host-to-GPU copies this plan's runs read that have not been
            seen landing (one ordered in this very plan, for the question it restores): every
            rank's stream waits for its own copy of them before it computes anything after it.
        in_flight: tier copies are in flight: the runner polls them even in a plan with no runs.
    """

    runs: list[ScheduledRun] = field(default_factory=list)
    new: list[NewRequest] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    kv_orders: list[KVOrder | Offload | Restore] = field(default_factory=list)
    scores: list[int] = field(default_factory=list)
    transfers_landed: list[int] = field(default_factory=list)
    transfers_awaited: list[int] = field(default_factory=list)
    in_flight: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(run.num_tokens for run in self.runs)

    def is_empty(self) -> bool:
        """Nothing to compute, move, forget or poll."""
        return not (self.runs or self.new or self.finished or self.kv_orders or self.transfers_landed
                    or self.in_flight)

    def for_worker(self, runs: list[ScheduledRun]) -> StepPlan:
        """The plan a tensor-parallel worker executes: ``runs`` (rank 0's runs minus those whose
        encoding failed), new requests in their worker form, no scores."""
        return replace(self, runs=list(runs), new=[n.for_worker() for n in self.new], scores=[])


@dataclass
class StepOutput:
    """What the runner returns for a plan.

    Attributes:
        sampled: the next token of each run with ``sample`` set, by request id.
        failed: the requests whose vision encoding failed, with the error (their runs were left out
            of the forward; only they fail).
        scores: per request of :attr:`StepPlan.scores`, its prefix's
            :data:`~engine.cache.compaction.TokenScores` (None when the selector needs none).
        vision_ms: milliseconds the encoder ran for a request this step (only where it ran).
        transfers: the tier copies that landed since the last output (rank 0's), in start order.
        path: the forward that ran: ``"graph"`` (decode CUDA graphs), ``"prefill_graph"``,
            ``"eager"``, or ``"none"`` (no run left to compute).
    """

    sampled: dict[int, int] = field(default_factory=dict)
    failed: dict[int, Exception] = field(default_factory=dict)
    scores: dict[int, dict[str, torch.Tensor] | None] = field(default_factory=dict)
    vision_ms: dict[int, float] = field(default_factory=dict)
    transfers: list[TransferDone] = field(default_factory=list)
    path: str = "none"
