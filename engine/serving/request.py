"""One request's state as it moves through the scheduler."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from ..cache.prefix_cache import Match, PrefixEntry
from ..inputs.prompts import Prompt
from .detokenize import TextStream
from .handle import OutputChannel
from .outputs import Telemetry
from .sampling import Sampler, SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# eq=False: requests compare (and hash) by identity. The generated value equality compared
# prompts field by field, so `req in running` / `running.remove(req)` with two requests of the same
# prompt evaluated `tensor == tensor` and raised, killing the engine loop (every request then hung).
@dataclass(eq=False)
class Request:
    """A request in the engine.

    ``tokens`` is the prompt followed by the generated tokens. ``num_computed`` counts the tokens
    whose K/V is stored in the pages of ``block_table``; the rest are prefilled in later steps.
    Deltas, the final completion or an exception go to ``outbox``, the
    :class:`~engine.serving.handle.OutputChannel` its caller reads through a
    :class:`~engine.serving.handle.RequestHandle`.
    Its KV state (``num_computed``, ``block_table``, ``status``, ``kv_offset``, ``attached``,
    ``cold_prefix``) is written by the :class:`~engine.serving.scheduler.Scheduler` alone; the
    runner never sees a request, only the step plan (its vision features live in the runner).
    """

    prompt: Prompt
    sampling: SamplingParams
    sampler: Sampler
    stream: TextStream
    submitted: float = field(default_factory=time.perf_counter)
    id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    outbox: OutputChannel = field(default_factory=OutputChannel)
    telemetry: Telemetry = field(default_factory=Telemetry)
    cancelled: bool = False
    finish_reason: str | None = None
    first_scheduled: float | None = None
    first_token_at: float | None = None
    max_pages_held: int = 0
    # prefix cache
    salt: str = ""
    prefix_key: str | None = None  # None: this prompt is not prefix-cached
    match: Match | None = None  # found at intake, attached at admission unless evicted meanwhile
    attached: PrefixEntry | None = None  # the entry whose pages this request uses
    cold_prefix: bool = False  # computing its public prefix: compact and cache it at the boundary
    awaits: int | None = None  # the copy (transfer id) of its attached entry from the host tier, until it lands
    kv_offset: int = 0  # logical tokens removed by compaction (physical = logical - kv_offset)
    warm: bool = False  # builds its public prefix only (Engine.warm): never samples, finishes when cached

    def __post_init__(self):
        self.tokens = list(self.prompt.input_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt.input_ids)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    @property
    def num_pending(self) -> int:
        """Tokens whose K/V is not stored yet (the next step must compute them)."""
        return len(self.tokens) - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        return self.num_pending > 1

    @property
    def kv_len(self) -> int:
        """Tokens physically stored in the block table's pages."""
        return self.num_computed - self.kv_offset

    def visual_items_in(self, start: int, end: int) -> list[tuple[str, int]]:
        """``(kind, item)`` of the images / videos with tokens among ``start .. end - 1``."""
        items = []
        for span in self.prompt.spans:
            key = (span.kind, span.item)
            if span.start < end and span.end > start and key not in items:
                items.append(key)
        return items
