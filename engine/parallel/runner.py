"""Rank 0's model runner under tensor parallelism: before each forward (eager, a decode-graph
replay or a prefill-graph replay) it sends the step's plan to the workers and broadcasts the
step's vision features, so every rank runs the same step on its shard and the decoder's
all-reduces pair up. Scheduling, vision and sampling stay on rank 0 (:class:`ModelRunner`)."""

from __future__ import annotations

from dataclasses import replace

from ..serving.runner import ModelRunner, StepInputs
from .group import TensorParallelGroup, feature_shape


class ParallelRunner(ModelRunner):
    """A :class:`~engine.serving.runner.ModelRunner` for rank 0 of ``group`` (other arguments as
    the base class's)."""

    def __init__(self, *args, group: TensorParallelGroup, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group

    def forward(self, inputs: StepInputs, *, head: bool = True):
        # Tensors cross the pipe as lists: pickling a tensor through torch.multiprocessing would
        # move it to shared memory; vision features follow as a broadcast on the model device.
        features, visual = None, None
        if inputs.visual is not None:
            rows, features = inputs.visual
            visual = (rows.tolist(), feature_shape(features))
        plan = replace(inputs, positions=inputs.positions.tolist(), visual=visual)
        return self.group.step(("forward", plan), features,
                               lambda: super(ParallelRunner, self).forward(inputs, head=head))

    def replay_decode(self, ids, positions, slots, seq_lens, tables):
        plan = ("decode", (ids, positions, slots, seq_lens, [list(t) for t in tables]))  # positions: lists
        return self.group.step(plan, None, lambda: super(ParallelRunner, self).replay_decode(
            ids, positions, slots, seq_lens, tables))

    def replay_prefill(self, ids, positions, slots, rows, features):
        shape = feature_shape(features) if features is not None else None
        plan = ("prefill", (ids, positions.tolist(), slots, rows.tolist(), shape))
        return self.group.step(plan, features, lambda: super(ParallelRunner, self).replay_prefill(
            ids, positions, slots, rows, features))
