"""Query-independent selection of the visual tokens a compact prefix keeps.

A selector sees one visual span (an image, or one video frame), the number ``k`` of its tokens
to keep (:func:`keep_count`, decided here so every selector keeps exactly the same count), the
span's slice of the prefix's token scores (:data:`TokenScores`, computed when the prefix is built
and stored with the cache entry, so compaction can also happen later) and, for a later
compaction step, which of its tokens an earlier step kept (``candidates``). It returns the
offsets of the ``k`` tokens to keep, in increasing order, chosen among the candidates. Text,
``<|vision_start|>`` and ``<|vision_end|>`` tokens are never removed. Selectors must not look at
the question, so one compact prefix serves every question about the same images.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..model.rope import VisualSpan

COMPACTION_MODES = ("always", "on_pressure")
"""When a cached prefix is compacted: as soon as it is computed, or only when the KV pool must
free pages (:class:`~engine.cache.prefix_reuse.PrefixReuse`, ``EngineOptions.compaction_mode``)."""

TokenScores = Mapping[str, torch.Tensor]
"""Per-token inputs of score-based selectors, by name: tensors whose first dimension runs over
the logical prefix tokens (``[prefix_len]`` or ``[prefix_len, d]``, CPU). A selector is handed
each tensor's ``[span.start : span.end]`` slice."""

Selector = Callable[[VisualSpan, int, "TokenScores | None", "torch.Tensor | None"], torch.Tensor]
"""``select(span, k, scores, candidates) -> int64 [k]`` increasing offsets within the span, a
subset of ``candidates`` (int64 increasing offsets, or None for all ``span.length`` tokens)."""


def pressure_ratios(ratios) -> tuple[float, ...]:
    """The keep ratios of the compaction steps made on pressure, from the ones asked for.

    ``ratios`` must decrease strictly within (0, 1]. A ratio of 1.0 keeps every token (``keep_count(n,
    1.0, k) == n``), so it frees nothing and is no step: it may only come first, and is dropped
    (``(1.0,)``: never compact on pressure; ``(1.0, 0.6)``: one step, to 0.6).

    Args:
        ratios: a sequence of floats, the keep ratio of each step in order.

    Returns:
        The ratios below 1, in order (possibly empty).

    Raises:
        ValueError: a ratio outside (0, 1], or ratios that do not decrease.
    """
    ratios = tuple(ratios)
    if not all(0 < r <= 1 for r in ratios) or any(b >= a for a, b in zip(ratios, ratios[1:], strict=False)):
        raise ValueError(f"pressure keep ratios must decrease within (0, 1] (1.0, kept whole, is no step), "
                         f"got {list(ratios)}")
    return tuple(r for r in ratios if r < 1)


def keep_count(n: int, keep_ratio: float, min_keep: int) -> int:
    """Visual tokens a span of ``n`` tokens keeps: ``min(n, max(min_keep, round(keep_ratio * n)))``
    (Python's round: ties to the even count)."""
    return min(n, max(min_keep, round(keep_ratio * n)))


def uniform_selector(span: VisualSpan, k: int, scores: TokenScores | None = None,
                     candidates: torch.Tensor | None = None) -> torch.Tensor:
    """Keep ``k`` of the candidates evenly spaced in their row-major order (candidate
    ``floor((j + 1/2) * m / k)`` of ``m`` for ``j < k``), so every region of the image keeps a
    proportional share. Ignores ``scores``.

    Returns:
        int64 ``[k]`` increasing offsets within the span.

    Raises:
        ValueError: ``k`` exceeds the number of candidates.
    """
    pool = torch.arange(span.length) if candidates is None else candidates.long()
    m = len(pool)
    if k > m:
        raise ValueError(f"cannot keep {k} of {m} candidate tokens")
    return pool[((torch.arange(k, dtype=torch.float64) + 0.5) * m / k).floor().long()]


#: Row phases of :func:`staggered_selector`: row ``r`` starts at ``frac(r * PHI)`` of a stride
#: (the golden ratio's fractional part spreads successive rows' offsets evenly over the stride).
PHI = (5**0.5 - 1) / 2


def _rows_of(span: VisualSpan, candidates: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The candidate offsets (all of the span's when None) and their split by grid row."""
    pool = torch.arange(span.length) if candidates is None else candidates.long()
    rows = pool // span.grid_w
    return pool, [pool[rows == r] for r in range(span.grid_h)]


def staggered_selector(span: VisualSpan, k: int, scores: TokenScores | None = None,
                       candidates: torch.Tensor | None = None) -> torch.Tensor:
    """Keep ``k`` candidates evenly spaced *per grid row*, each row's pattern shifted.

    Row ``r`` (``m_r`` candidates, ``M_r`` in the rows before it, ``m`` in all) keeps
    ``k_r = floor((M_r + m_r) k / m) - floor(M_r k / m)`` of them (so the counts add up to ``k`` and
    no row gets more than it has), its candidates ``floor((j + frac(r * PHI)) * m_r / k_r)`` for
    ``j < k_r``. :func:`uniform_selector` spaces the whole span in row-major order with one phase,
    so when its stride divides the grid width every row keeps the same columns and whole columns
    vanish (a 20-column grid at keep 0.6 keeps 12 of 20 columns and none of the other 8); here the
    columns a row keeps move with the row. Ignores ``scores``; query- and content-independent.

    Returns:
        int64 ``[k]`` increasing offsets within the span.

    Raises:
        ValueError: ``k`` exceeds the number of candidates.
    """
    pool, rows = _rows_of(span, candidates)
    m = len(pool)
    if k > m:
        raise ValueError(f"cannot keep {k} of {m} candidate tokens")
    out, before = [], 0
    for r, row in enumerate(rows):
        m_r = len(row)
        k_r = (before + m_r) * k // m - before * k // m
        before += m_r
        if k_r:
            phase = (r * PHI) % 1.0
            out.append(row[((torch.arange(k_r, dtype=torch.float64) + phase) * m_r / k_r).floor().long()])
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long)


def _scored_candidates(span: VisualSpan, k: int, scores: TokenScores | None, candidates: torch.Tensor | None,
                       score: str, who: str) -> torch.Tensor:
    """The candidate offsets (int64 ``[n]``, all of the span's when ``candidates`` is None) a
    score-based selector ranks, after its checks.

    Raises:
        ValueError: ``scores`` lacks ``score`` (the prefix was built without it), or ``k`` exceeds
            the candidates.
    """
    if scores is None or score not in scores:
        raise ValueError(f"the {who} selector needs the prefix's {score!r} scores")
    pool = torch.arange(span.length) if candidates is None else candidates.long()
    if k > len(pool):
        raise ValueError(f"cannot keep {k} of {len(pool)} candidate tokens")
    return pool


def coverage_selector(score: str, floor_share: float = 0.5) -> Selector:
    """A score-based selector with a per-region floor (a small object's tokens survive).

    The grid is cut into square regions of side ``s = ceil(sqrt(n / q))`` tokens (``n`` the span's
    tokens, ``q = max(1, floor(floor_share * k))`` the floor's budget); each region with a candidate
    first keeps its candidate of highest ``scores[score]`` (if there are more such regions than
    ``k``, the ``k`` best of those picks), then the rest of the ``k`` go to the remaining
    candidates of highest score, ties to the lower offset. A pure top-``k`` (:func:`priority_selector`)
    can spend the whole budget on a few salient areas and drop an object that covers one token;
    the floor keeps the most salient token of every area. Not nested across ``k`` (the regions
    depend on ``k``), so a stepwise compaction need not equal a direct one.

    The returned selector raises ValueError when ``scores`` lacks ``score`` or ``k`` exceeds the
    candidates.
    """

    def select(span: VisualSpan, k: int, scores: TokenScores | None = None,
               candidates: torch.Tensor | None = None) -> torch.Tensor:
        pool = _scored_candidates(span, k, scores, candidates, score, "coverage")
        if k == 0:
            return torch.empty(0, dtype=torch.long)
        priority = scores[score][pool].float()
        order = torch.sort(priority, descending=True, stable=True).indices  # best first, ties to lower offset
        q = max(1, int(floor_share * k))
        side = max(1, math.ceil(math.sqrt(span.length / q)))
        cols = -(-span.grid_w // side)
        region = (pool // span.grid_w // side) * cols + (pool % span.grid_w) // side
        seen: set[int] = set()
        picks = []
        for i in order.tolist():  # each region's best candidate, in the global score order
            reg = int(region[i])
            if reg not in seen:
                seen.add(reg)
                picks.append(i)
        picks = picks[:k]
        chosen = torch.zeros(len(pool), dtype=torch.bool)
        chosen[picks] = True
        rest = order[~chosen[order]][: k - len(picks)]
        chosen[rest] = True
        return pool[chosen]

    select.__name__ = f"coverage_{score}_selector"
    select.__doc__ = f"Coverage hybrid on ``{score}`` (:func:`coverage_selector`)."
    return select


def priority_selector(score: str) -> Selector:
    """A selector keeping the ``k`` candidates of highest ``scores[score]`` (a float32 priority
    ``[span.length]``, see :mod:`engine.cache.token_scores`), ties to the lower offset.

    Because every step ranks by the same stored priority, the kept sets are nested: the top ``k``
    among an earlier step's candidates is the top ``k`` of the whole span whenever the candidates
    came from the same priority.

    The returned selector raises ValueError when ``scores`` lacks ``score`` (the prefix was built
    without it) or ``k`` exceeds the candidates.
    """

    def select(span: VisualSpan, k: int, scores: TokenScores | None = None,
               candidates: torch.Tensor | None = None) -> torch.Tensor:
        pool = _scored_candidates(span, k, scores, candidates, score, repr(score))
        priority = scores[score][pool].float()
        best = torch.sort(priority, descending=True, stable=True).indices[:k]
        return pool[best].sort().values

    select.__name__ = f"{score}_selector"
    select.__doc__ = f"Keep the ``k`` candidates of highest ``{score}`` priority (:func:`priority_selector`)."
    return select


SELECTORS: dict[str, Selector] = {
    "uniform": uniform_selector,
    "attention": priority_selector("attention"),  # VisionZip-like: most attended in the vision tower
    "diversity": priority_selector("diversity"),  # DivPrune-like: greedy max-min on merged features
    "random": priority_selector("random"),  # control: a permutation seeded by the image's content
    "staggered": staggered_selector,  # uniform per row, each row's columns shifted
    "coverage": coverage_selector("attention"),  # most attended, with one token per region first
}

SELECTOR_SCORES: dict[str, tuple[str, ...]] = {
    "uniform": (), "attention": ("attention",), "diversity": ("diversity",), "random": ("random",),
    "staggered": (), "coverage": ("attention",),
}
"""The :mod:`~engine.cache.token_scores` each selector reads (computed when the prefix is built)."""


@dataclass(frozen=True)
class CompactionConfig:
    """How a prefix is compacted.

    Attributes:
        method: a key of :data:`SELECTORS` (``"uniform"``, ``"staggered"``, ``"attention"``,
            ``"coverage"``, ``"diversity"``, ``"random"``), or None for no compaction.
        keep_ratio: share of each image's visual tokens kept.
        min_keep: fewest visual tokens kept per image (or frame).
        compact_video: whether video frames are compacted too.
        merge_values: the merging variant (issue 35.3, off by default): besides dropping, fold each
            dropped visual token's value into its nearest kept neighbour (:func:`value_merge_plan`;
            keys untouched). An option of every selector rather than a selector of its own, since
            *which* tokens stay and *what* a kept slot holds are independent choices: the selector
            still decides the kept set (so ``prefix_info``'s bitmap, the counts and the pages freed
            are the drop-only ones), and the merge only rewrites kept slots' V. Requires a method.
    """

    method: str | None = "uniform"
    keep_ratio: float = 0.6
    min_keep: int = 16
    compact_video: bool = False
    merge_values: bool = False

    def __post_init__(self):
        if self.method is not None and self.method not in SELECTORS:
            raise ValueError(f"compaction must be None or one of {sorted(SELECTORS)}, got {self.method!r}")
        if self.merge_values and self.method is None:
            raise ValueError("merge_values needs a compaction method (it merges into the tokens a selector keeps)")
        if not 0 < self.keep_ratio <= 1:
            raise ValueError(f"keep_ratio must be in (0, 1], got {self.keep_ratio}")
        if self.min_keep < 1:
            raise ValueError(f"min_keep must be >= 1, got {self.min_keep}")

    @property
    def score_names(self) -> tuple[str, ...]:
        """The token scores the selector needs when the prefix is built (empty for uniform / off)."""
        return SELECTOR_SCORES.get(self.method, ()) if self.method is not None else ()

    def compacted_spans(self, spans: list[VisualSpan]) -> list[VisualSpan]:
        """The spans this configuration compacts (video frames only with ``compact_video``): the
        ones whose token scores are worth computing."""
        return [s for s in spans if s.kind != "video" or self.compact_video]

    def namespace(self) -> str:
        """A stable description, part of the prefix cache key."""
        if self.method is None:
            return "compaction=none"
        merge = ";merge=values" if self.merge_values else ""
        return (f"compaction={self.method};keep={self.keep_ratio!r};min={self.min_keep};video={self.compact_video}"
                f"{merge}")

    def kept_positions(self, prefix_len: int, spans: list[VisualSpan], scores: TokenScores | None = None,
                       within: torch.Tensor | None = None) -> torch.Tensor:
        """Indices (int64, increasing) of the prefix tokens ``0 .. prefix_len - 1`` that stay.

        Args:
            prefix_len: tokens in the public prefix.
            spans: its visual spans (logical positions).
            scores: the prefix's :data:`TokenScores`, for score-based selectors (None: none stored).
            within: int64 increasing logical indices an earlier compaction kept; this step keeps a
                subset of them (a span keeps ``keep_count`` of its original length, at most what
                it still has). None: the dense prefix.
        """
        keep = torch.ones(prefix_len, dtype=torch.bool)
        if within is not None:
            keep.zero_()
            keep[within] = True
        if self.method is not None:
            select = SELECTORS[self.method]
            for span in spans:
                if span.end > prefix_len or (span.kind == "video" and not self.compact_video):
                    continue
                left = keep[span.start : span.end].nonzero().flatten()
                k = min(len(left), keep_count(span.length, self.keep_ratio, self.min_keep))
                own = None if scores is None else {name: t[span.start : span.end] for name, t in scores.items()}
                chosen = select(span, k, own, None if len(left) == span.length else left)
                keep[span.start : span.end] = False
                keep[span.start + chosen] = True
        return keep.nonzero().flatten()


# --------------------------------------------------------------------------------------------------
# The merging variant (issue 35.3): dropped tokens' values folded into kept neighbours
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ValueMergePlan:
    """What one merging compaction step does to the values of a prefix (:func:`value_merge_plan`).

    Attributes:
        into: int64 ``[len(before)]``: for stored token ``i`` (logical ``before[i]``), the index in
            ``after`` of the kept token whose value absorbs it (a kept token: its own index).
        weight: float64 ``[len(before)]``: its weight in that kept token's new value, the share of
            original tokens it stands for (the weights into one kept token sum to 1).
        owner: int64 ``[prefix_len]``: after the step, for each logical prefix token, the logical
            position of the kept token whose value holds its share (kept tokens: themselves; -1:
            held by none, e.g. dropped by an earlier drop-only step).
    """

    into: torch.Tensor
    weight: torch.Tensor
    owner: torch.Tensor

    def merged_groups(self) -> int:
        """Kept tokens whose value changes (that absorb at least one other token)."""
        return int((torch.bincount(self.into) > 1).sum()) if len(self.into) else 0


def nearest_kept(span: VisualSpan, kept: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """For each token of ``tokens`` (int64 offsets within ``span``), the index in ``kept`` (int64
    increasing offsets within ``span``, at least one) of the kept token nearest to it in the span's
    grid: least squared distance ``(row - row')^2 + (col - col')^2`` (exact integers), ties to the
    kept token of lower offset (row-major). Query- and content-independent.

    Returns:
        int64 ``[len(tokens)]``.

    Raises:
        ValueError: ``kept`` is empty while ``tokens`` is not.
    """
    if len(tokens) == 0:
        return torch.empty(0, dtype=torch.long)
    if len(kept) == 0:
        raise ValueError("a span with dropped tokens keeps none to merge them into")
    w = span.grid_w
    dr = tokens[:, None] // w - kept[None, :] // w
    dc = tokens[:, None] % w - kept[None, :] % w
    return torch.argmin(dr * dr + dc * dc, dim=1)  # argmin returns the first minimum: the lowest offset


def value_merge_plan(prefix_len: int, spans: list[VisualSpan], before: torch.Tensor, after: torch.Tensor,
                     owner: torch.Tensor | None = None) -> ValueMergePlan:
    """How a merging compaction from the stored tokens ``before`` to ``after`` folds values.

    Each token of ``before`` not in ``after`` (a dropped visual token) goes to its nearest kept
    token of the same span (:func:`nearest_kept`: the span's 2D grid, ties to the lower offset;
    spatial, so query-independent and computable on the scheduling side without reading the
    pool). A kept token's new value is the mean of the *original* values of every token it stands
    for: its current value and those of the tokens folded in, each weighted by the number of
    original tokens it already stands for (``owner``). After one step from the dense prefix this
    is the plain average of the kept token and its dropped neighbours (VisionZip's contextual
    tokens average in feature space; here in each layer's V, per KV head); after several steps it
    is the plain average over the composed group (up to rounding: each step re-rounds).

    Keys are left unchanged (their rotary positions stay valid) and there is no per-token logit
    bias in the attention kernels, so the kept key is attended with its own logit only: the softmax
    mass the dropped tokens had is lost (renormalised over the remaining keys), not moved to their
    representative, whose value now carries their average. (A log(m) bias on a key standing for
    ``m`` tokens would move it; not buildable here.)

    Args:
        prefix_len: tokens of the public prefix.
        spans: its visual spans (logical positions).
        before: int64 increasing logical positions stored now (physical slot ``i`` holds ``before[i]``).
        after: int64 increasing subset of ``before``, the tokens this step keeps.
        owner: int64 ``[prefix_len]``, the previous step's :attr:`ValueMergePlan.owner`; None: each
            token of ``before`` stands for itself alone (a dense or drop-only prefix).

    Returns:
        The :class:`ValueMergePlan`.

    Raises:
        ValueError: ``after`` is not a subset of ``before``, a dropped token lies outside every span,
            or a span with dropped tokens keeps none.
    """
    before, after = before.long(), after.long()
    if owner is None:
        owner = torch.full((prefix_len,), -1, dtype=torch.long)
        owner[before] = before
    idx = torch.searchsorted(before, after)
    if len(after) and (int(idx.max()) >= len(before) or not torch.equal(before[idx], after)):
        raise ValueError("a merging compaction keeps tokens that are not stored")
    # into[i]: index in after of the kept token absorbing stored token i
    into = torch.full((len(before),), -1, dtype=torch.long)
    into[idx] = torch.arange(len(after))
    for span in spans:
        lo, hi = int(torch.searchsorted(before, span.start)), int(torch.searchsorted(before, span.end))
        dropped = (into[lo:hi] < 0).nonzero().flatten() + lo
        if len(dropped) == 0:
            continue
        k_lo, k_hi = int(torch.searchsorted(after, span.start)), int(torch.searchsorted(after, span.end))
        near = nearest_kept(span, after[k_lo:k_hi] - span.start, before[dropped] - span.start)
        into[dropped] = near + k_lo
    if bool((into < 0).any()):
        raise ValueError("a merging compaction drops a token outside every visual span")
    held = torch.zeros(prefix_len, dtype=torch.float64)
    valid = owner >= 0
    held.index_add_(0, owner[valid], torch.ones(int(valid.sum()), dtype=torch.float64))
    count = held[before]  # original tokens each stored token stands for
    total = torch.zeros(len(after), dtype=torch.float64).index_add_(0, into, count)
    weight = count / total[into]
    new_owner = owner.clone()
    where = torch.full((prefix_len,), -1, dtype=torch.long)
    where[before] = after[into]  # logical position each stored token's share moves to
    new_owner[valid] = where[owner[valid]]
    return ValueMergePlan(into, weight, new_owner)
