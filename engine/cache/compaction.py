"""Query-independent selection of the visual tokens a compact prefix keeps.

A selector sees one visual span (an image, or one video frame) and returns the offsets of the
tokens to keep, in increasing order. Text, ``<|vision_start|>`` and ``<|vision_end|>`` tokens are
never removed. Selectors must not look at the question, so one compact prefix serves every
question about the same images.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..model.rope import VisualSpan

Selector = Callable[[VisualSpan, float, int], torch.Tensor]


def uniform_selector(span: VisualSpan, keep_ratio: float, min_keep: int) -> torch.Tensor:
    """Keep ``max(min_keep, round(keep_ratio * n))`` of a span's ``n`` tokens, evenly spaced over its
    row-major token grid (token ``floor((j + 1/2) * n / k)`` for ``j < k``), so every region of
    the image keeps a proportional share.

    Returns:
        int64 ``[k]`` increasing offsets within the span.
    """
    n = span.length
    k = min(n, max(min_keep, round(keep_ratio * n)))
    return ((torch.arange(k, dtype=torch.float64) + 0.5) * n / k).floor().long()


SELECTORS: dict[str, Selector] = {"uniform": uniform_selector}


@dataclass(frozen=True)
class CompactionConfig:
    """How a prefix is compacted.

    Attributes:
        method: a key of :data:`SELECTORS` (``"uniform"``), or None for no compaction.
        keep_ratio: share of each image's visual tokens kept.
        min_keep: fewest visual tokens kept per image (or frame).
        compact_video: whether video frames are compacted too.
    """

    method: str | None = "uniform"
    keep_ratio: float = 0.6
    min_keep: int = 16
    compact_video: bool = False

    def __post_init__(self):
        if self.method is not None and self.method not in SELECTORS:
            raise ValueError(f"compaction must be None or one of {sorted(SELECTORS)}, got {self.method!r}")
        if not 0 < self.keep_ratio <= 1:
            raise ValueError(f"keep_ratio must be in (0, 1], got {self.keep_ratio}")
        if self.min_keep < 1:
            raise ValueError(f"min_keep must be >= 1, got {self.min_keep}")

    def namespace(self) -> str:
        """A stable description, part of the prefix cache key."""
        if self.method is None:
            return "compaction=none"
        return f"compaction={self.method};keep={self.keep_ratio!r};min={self.min_keep};video={self.compact_video}"

    def kept_positions(self, prefix_len: int, spans: list[VisualSpan]) -> torch.Tensor:
        """Indices (int64, increasing) of the prefix tokens ``0 .. prefix_len - 1`` that stay."""
        keep = torch.ones(prefix_len, dtype=torch.bool)
        if self.method is not None:
            select = SELECTORS[self.method]
            for span in spans:
                if span.end > prefix_len or (span.kind == "video" and not self.compact_video):
                    continue
                keep[span.start : span.end] = False
                keep[span.start + select(span, self.keep_ratio, self.min_keep)] = True
        return keep.nonzero().flatten()
