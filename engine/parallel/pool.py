"""Rank 0's KV pool under tensor parallelism: every data move it makes (a copy-on-write page
copy, a compaction's slot moves) is first sent to the workers, whose pools (their own KV heads,
FP8 values and scales alike) make the same move. The moves travel down the same ordered pipes as
the step plans, so every rank applies them in the same order relative to every forward.

Reference counts, allocation and frees stay rank 0's bookkeeping: a worker writes exactly the
slots a plan names, so which pages are free needs no copy elsewhere.
"""

from __future__ import annotations

from ..cache.kv_pool import PagePool
from .group import TensorParallelGroup


class MirroredPagePool(PagePool):
    """A :class:`~engine.cache.kv_pool.PagePool` whose data moves also run on every worker.

    Set :attr:`group` after construction (``PagePool.sized`` builds it); None acts alone."""

    group: TensorParallelGroup | None = None

    def copy_page(self, src: int, dst: int) -> None:
        if self.group is not None:
            self.group.send(("copy", (src, dst)))
        super().copy_page(src, dst)

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        if src and self.group is not None:
            self.group.send(("move", (list(src), list(dst))))
        super().move_slots(src, dst)
