"""Rank 0's model runner under tensor parallelism: before each step's forward it sends the step
plan to the workers (one message kind, ``("plan", plan, features)``) and broadcasts the step's
vision features it names, so every rank applies the same data moves and runs the same step on its
shard, and the decoder's all-reduces pair up. Scheduling, vision and sampling stay on rank 0
(:class:`ModelRunner`)."""

from __future__ import annotations

from ..model.vision import VisionFeatures
from ..serving.plan import ScheduledRun, StepPlan
from ..serving.runner import ModelRunner, RunFeatures
from .group import TensorParallelGroup, feature_shape


class ParallelRunner(ModelRunner):
    """A :class:`~engine.serving.runner.ModelRunner` for rank 0 of ``group`` (other arguments as
    the base class's)."""

    orders_between_steps = False  # the workers learn of copies from plans only

    def __init__(self, *args, group: TensorParallelGroup, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group

    def _launch(self, plan: StepPlan, runs: list[ScheduledRun], features: dict[int, RunFeatures]):
        # The plan goes out after rank 0's encoder ran, without the runs whose encoding failed;
        # the features follow as one broadcast on the model device, in run order, each run's
        # visual-token offsets named in the message (tensors cross the pipe as lists: through
        # torch.multiprocessing they would move to shared memory).
        named = [(run.req_id, features[run.req_id][0].tolist()) for run in runs if run.req_id in features]
        parts = [features[req_id][1] for req_id, _ in named]
        step = VisionFeatures.concat(parts) if parts else None
        message = ("plan", (plan.for_worker(runs), named, feature_shape(step) if step is not None else None))
        if not runs:
            self.group.send(message)
            return []
        return self.group.step(message, step, lambda: super(ParallelRunner, self)._launch(plan, runs, features))
