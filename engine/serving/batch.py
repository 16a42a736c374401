"""The step plan: what the scheduler decided one step computes, handed by the loop to the runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request


@dataclass
class Batch:
    """The work of one step: ``(request, number of new tokens)`` pairs, decodes first, then prefill
    chunks in admission order (the runner lays out the flat batch: it puts sequences without cached
    context first), and the requests preempted to make room for it.

    This is the one object that crosses from the scheduling side to the model side of the loop.
    Under tensor parallelism (:mod:`engine.parallel`) the other ranks are sent what the runner
    makes of it (:class:`~engine.serving.runner.StepInputs`, or a graph replay's inputs), never the
    requests themselves.
    """

    items: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)
