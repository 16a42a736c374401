"""Token scores under tensor parallelism: the hook score-based compaction selectors need.

A selector that scores visual tokens from attention over KV heads (see
:data:`engine.cache.compaction.TokenScores`, stored as ``PrefixEntry.scores``) sees, on each rank,
only that rank's KV heads. Every rank must keep the same tokens (rank 0 decides the slot moves and
the workers apply them), so the per-rank partial scores are summed over the ranks before any
selector reads them: a sum of per-head scores is the score over all heads, and a mean over heads
is that sum divided by the query-head count, which the caller applies after the sum.

Not wired yet: no score source exists in the engine when this was written. Where one is added
(scores computed during the prefix's forward, in ``model/attention.py``), the worker side
(:mod:`engine.parallel.worker`) needs a plan message after the forward that computed the prefix's
last chunk, on which every rank calls :func:`combine_token_scores` with its partial scores, in
sorted name order; rank 0 then stores the result with the entry and runs the selector alone.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def combine_token_scores(partial: Mapping[str, torch.Tensor], collectives) -> dict[str, torch.Tensor]:
    """The scores over all ranks' KV heads from this rank's ``partial`` ones.

    Args:
        partial: per-token scores by name, each ``[prefix_len]`` or ``[prefix_len, d]`` (any
            device), summed over this rank's KV heads.
        collectives: the rank's :class:`~engine.parallel.group.Collectives` (every rank calls
            this with the same names and shapes, in the same step).

    Returns:
        float32 tensors, the sum over ranks, on the CPU (as selectors take them), by name.
    """
    out = {}
    for name in sorted(partial):  # every rank reduces the same tensors in the same order
        total = partial[name].to(torch.float32).contiguous().clone()
        collectives.all_reduce(total)
        out[name] = total.cpu()
    return out
