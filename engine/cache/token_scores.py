"""The per-token scores score-based selectors read (:data:`~engine.cache.compaction.TokenScores`),
computed once when a prefix is built and stored with its cache entry.

Every score is a **priority**: float32 ``[prefix_len]`` over the logical prefix positions, higher
kept first, 0 outside visual spans. A selector keeps the ``k`` candidates of highest priority
(:func:`~engine.cache.compaction.priority_selector`), so the orders are nested: compacting a
dense prefix to 0.6 and that to 0.4 keeps exactly the tokens a direct 0.4 keeps, which is what a
later, on-pressure compaction step needs. Stored bytes per entry: ``4 * prefix_len`` per score
(one score per configured selector; 1,200 bytes for a prefix of 300 tokens), never the
feature matrices.

- ``attention`` (the VisionZip-like selector, after Yang et al., arXiv:2412.04467): the attention
  each merged token receives in the vision tower's last block, averaged over heads and queries
  and summed over its ``merge**2`` patches (:attr:`VisionFeatures.attention
  <engine.model.vision.VisionFeatures.attention>`; Qwen3-VL has no CLS token, so all queries vote).
- ``diversity`` (DivPrune-like, after Alvar et al., arXiv:2503.02175): the greedy max-min order
  of the span's merged features (the merger output fed to the decoder) under cosine distance;
  the first pick is the token farthest from the span's mean feature, each next one the token
  whose nearest already-picked token is farthest. Priority ``n - order``.
- ``random`` (the control): a permutation drawn from a generator seeded with the SHA-256 of the
  image's (or video's) content hash and the frame index, so it depends on the pixels only.

None of them sees the question: their inputs are the spans, the media hashes and the vision
features, all fixed before the question's tokens.
"""

from __future__ import annotations

import hashlib

import torch

from ..model.rope import VisualSpan
from ..model.vision import VisionFeatures

SCORE_NAMES = ("attention", "diversity", "random")


def prefix_scores(needs: tuple[str, ...], prefix_len: int, spans: list[VisualSpan], hashes: dict,
                  features: VisionFeatures | None, offsets: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The scores ``needs`` names for one prefix (CPU, float32 ``[prefix_len]`` each).

    Args:
        needs: names from :data:`SCORE_NAMES` (empty: returns ``{}`` without touching features).
        prefix_len: tokens in the public prefix.
        spans: its visual spans (logical positions; spans ending past ``prefix_len`` are skipped).
        hashes: content hash by ``(span.kind, span.item)``.
        features: the visual tokens' features, row ``r`` at logical position ``offsets[r]``.
        offsets: int64 ``[V]`` logical positions of ``features``' rows (None: the visual tokens
            in span order, as ``Prompt.visual_rows()`` lists them).

    Raises:
        ValueError: an unknown name, or ``attention`` asked for features computed without it.
    """
    unknown = set(needs) - set(SCORE_NAMES)
    if unknown:
        raise ValueError(f"unknown token scores {sorted(unknown)}")
    if not needs:
        return {}
    if offsets is None:
        offsets = torch.cat([torch.arange(s.start, s.end) for s in spans] or [torch.empty(0, dtype=torch.long)])
    offsets = offsets.cpu()
    row_of = torch.full((max([prefix_len, *(offsets + 1).tolist()]),), -1, dtype=torch.long)
    row_of[offsets] = torch.arange(len(offsets))
    out = {name: torch.zeros(prefix_len, dtype=torch.float32) for name in needs}
    for span in spans:
        if span.end > prefix_len:
            continue
        here = slice(span.start, span.end)
        rows = row_of[here]
        if "attention" in needs:
            if features is None or features.attention is None:
                raise ValueError("the attention score needs vision features computed with attention=True")
            out["attention"][here] = features.attention[rows.to(features.attention.device)].float().cpu()
        if "diversity" in needs:
            order = max_min_order(features.embeds[rows.to(features.embeds.device)])
            priority = torch.empty(span.length, dtype=torch.float32)
            priority[order] = torch.arange(span.length, 0, -1, dtype=torch.float32)
            out["diversity"][here] = priority
        if "random" in needs:
            out["random"][here] = content_random(hashes[(span.kind, span.item)], span.frame, span.length)
    return out


def media_hashes(prompt) -> dict[tuple[str, int], str]:
    """Content hash by ``(kind, item)`` of a prompt's images and videos (``prompt.image_hashes``,
    ``prompt.video_hashes``)."""
    return {("image", i): h for i, h in enumerate(prompt.image_hashes)} | {
        ("video", i): h for i, h in enumerate(prompt.video_hashes)}


def max_min_order(feats: torch.Tensor) -> torch.Tensor:
    """Greedy max-min (farthest-point) order of ``feats [n, d]`` under cosine distance: int64
    ``[n]`` (CPU), a permutation. O(n^2 d) time and O(n^2) float32 memory on ``feats``' device (n
    is one image's tokens); the loop makes ~4 small launches per token and no host sync, so on
    CUDA a 1,024-token image costs about 4k kernel launches."""
    x = torch.nn.functional.normalize(feats.float(), dim=-1)
    n = x.shape[0]
    dist = 1 - x @ x.T  # [n, n] cosine distances
    mean = torch.nn.functional.normalize(x.mean(0), dim=0)
    order = torch.empty(n, dtype=torch.long, device=x.device)
    pick = torch.argmin(x @ mean)  # the token least like the image's mean feature
    nearest = torch.full((n,), float("inf"), device=x.device)
    for i in range(n):
        order[i] = pick
        nearest = torch.minimum(nearest, dist[pick])
        nearest[pick] = -1.0  # picked tokens stay at -1
        pick = torch.argmax(nearest)  # ties: the lowest offset
    return order.cpu()


def content_random(content_hash: str, frame: int, n: int) -> torch.Tensor:
    """float32 ``[n]`` uniform draws in [0, 1) seeded by ``content_hash`` and ``frame`` only."""
    seed = int.from_bytes(hashlib.sha256(f"{content_hash}|{frame}".encode()).digest()[:8], "little") >> 1
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))
