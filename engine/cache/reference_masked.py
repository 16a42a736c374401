"""A dense, masked reference for compacted prefixes: the oracle the compact prefix cache is tested
against.

The engine computes a prompt's public prefix (every token up to the last ``<|vision_end|>``)
densely, then keeps only the prefix tokens that :meth:`CompactionConfig.kept_positions` selects;
everything after the prefix (the question, earlier turns, generated tokens) attends to the kept
tokens only. Positions are logical throughout (M-RoPE is applied before K/V are stored), so
compaction changes *which* keys a later query sees, never their positions.

This module computes the same function without pages, quantisation or moves: one contiguous
float K/V store holds every token at its logical index, and the attention mask does the
compaction. For query ``i`` and key ``j`` (logical indices)::

    visible(i, j) = j <= i  and  (i < prefix_len  or  keep[j])

where ``keep[j]`` is False exactly for the prefix positions compaction removes. So prefix queries
use ordinary causal attention (as the engine's cold prefill does before compacting), and every
later query masks out the removed prefix positions.

Use it with an engine in float32 and ``kv_cache_dtype="auto"``: then the engine's tokens for a
compacted prompt (cold or a cache hit) must equal :func:`masked_greedy`'s, up to float rounding.

The merging variant (``CompactionConfig.merge_values``) computes another function, and so does the
oracle then: later queries see the kept keys unchanged but each kept token's V replaced, in every
layer, by the mean of the original V of the tokens it stands for (its ``owner`` group, see
:func:`merge_owner`), as a dense matrix product ``W @ V`` over the prefix; prefix queries still
attend to the original V (the engine merges only after the dense prefill). The groups are worked
out here again by brute force (nearest kept token in the span's grid, ties to the lower offset),
independently of :func:`~engine.cache.compaction.value_merge_plan` and of the pool's order.
"""

from __future__ import annotations

import torch

from ..model.attention import DenseKVCache, DenseStep, causal_gqa_attention
from ..model.decoder import VisualInjection
from ..model.vision import VisionFeatures
from .token_scores import media_hashes, prefix_scores


class MaskedStep(DenseStep):
    """Stores one step's K/V at their logical indices and attends under :meth:`MaskedDenseCache.visible`
    (with merged values for the queries after the prefix when the cache has a ``merge`` matrix)."""

    def __init__(self, cache: MaskedDenseCache, start: int, num_new: int):
        super().__init__(cache, start, num_new)
        self.mask = cache.visible(start, num_new)  # [T, S], the same for every layer

    def attend(self, layer, q, k, v):
        cache = self.cache
        if cache.merge is None:
            return super().attend(layer, q, k, v)
        start, end, n = self.start, self.start + self.num_new, cache.prefix_len
        cache.k[layer][start:end] = k
        cache.v[layer][start:end] = v
        after = cache.v_after[layer]
        after[start:end] = v
        if start < n <= end:  # the prefix is complete: the V later queries see, W @ V over the prefix
            dense = cache.v[layer][:n].float().reshape(n, -1)
            after[:n] = (cache.merge @ dense).reshape(after[:n].shape).to(after.dtype)
        split = min(max(n - start, 0), self.num_new)  # queries inside the prefix come first
        keys = cache.k[layer][:end]
        parts = []
        if split:
            parts.append(causal_gqa_attention(q[:split], keys, cache.v[layer][:end], start, self.mask[:split]))
        if split < self.num_new:
            parts.append(causal_gqa_attention(q[split:], keys, after[:end], start + split, self.mask[split:]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class MaskedDenseCache(DenseKVCache):
    """K/V of one sequence in contiguous per-layer tensors ``[capacity, Hkv, D]`` plus a key mask.

    Args:
        num_layers, num_kv_heads, head_dim: decoder shape.
        capacity: most tokens (prompt + generated).
        prefix_len: queries at logical index ``>= prefix_len`` do not see removed prefix keys.
        removed: int64 ``[R]`` logical indices (all ``< prefix_len``) of the removed prefix tokens.
        dtype, device: of the stored K/V (the model's).
        owner: the merging variant: int64 ``[prefix_len]``, for each prefix token the logical
            position of the kept token whose V holds its share (-1: none; see :func:`merge_owner`).
            Queries after the prefix then read, for kept token ``j``, the mean of the original V
            of the tokens ``t`` with ``owner[t] == j`` (computed in float32, rounded to ``dtype``).
            None: drop-only.
    """

    def __init__(self, num_layers: int, capacity: int, num_kv_heads: int, head_dim: int, *,
                 prefix_len: int, removed: torch.Tensor, dtype, device, owner: torch.Tensor | None = None):
        if removed.numel() and int(removed.max()) >= prefix_len:
            raise ValueError("removed positions must lie inside the prefix")
        super().__init__(num_layers, capacity, num_kv_heads, head_dim, dtype, device)
        self.keep = torch.ones(capacity, dtype=torch.bool, device=device)  # [capacity]
        self.keep[removed.to(device)] = False
        self.prefix_len = prefix_len
        self.merge = None if owner is None else merge_matrix(owner).to(device)  # float32 [prefix_len, prefix_len]
        self.v_after = None
        if owner is not None:
            shape = (capacity, num_kv_heads, head_dim)
            self.v_after = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    step_class = MaskedStep

    def visible(self, start: int, num_new: int) -> torch.Tensor:
        """Bool ``[num_new, start + num_new]``: which keys each new query (logical ``start + t``) sees."""
        end = start + num_new
        device = self.keep.device
        q_pos = torch.arange(start, end, device=device)[:, None]  # [T, 1]
        k_pos = torch.arange(end, device=device)[None, :]  # [1, S]
        causal = k_pos <= q_pos
        after_prefix = q_pos >= self.prefix_len  # [T, 1]
        return causal & (~after_prefix | self.keep[:end][None, :])


def removed_positions(engine, prompt, features: VisionFeatures | None = None) -> torch.Tensor:
    """int64 logical indices of the prefix tokens ``engine`` drops when it caches ``prompt``'s
    public prefix (empty when the prompt is not prefix-cached, compaction keeps everything, or the
    engine caches prefixes dense and compacts only on pressure).

    Score-based selectors get the same :mod:`~engine.cache.token_scores` the engine stores with
    the entry, recomputed here from ``features`` (the prompt's vision features in
    ``prompt.visual_rows()`` order; None: ``engine.vision_features(prompt)``), so the oracle
    drops the same tokens for every selector.
    """
    n = prompt.prefix_len
    reuse = engine.prefix_reuse
    if reuse is None or reuse.mode == "on_pressure" or not 0 < n < len(prompt.input_ids):
        return torch.empty(0, dtype=torch.long)
    scores = None
    if engine.compaction.score_names:
        feats = engine.vision_features(prompt) if features is None else features
        spans = engine.compaction.compacted_spans(prompt.spans)
        offsets = prompt.visual_rows()  # the rows of feats
        scores = prefix_scores(engine.compaction.score_names, n, spans, media_hashes(prompt), feats, offsets)
    keep = torch.zeros(n, dtype=torch.bool)
    keep[engine.compaction.kept_positions(n, prompt.spans, scores)] = True
    return (~keep).nonzero().flatten()


def merge_matrix(owner: torch.Tensor) -> torch.Tensor:
    """float32 ``[n, n]`` (``n = len(owner)``): row ``j`` averages the tokens ``t`` with
    ``owner[t] == j`` (weight ``1 / |group|`` each; a row of a token holding none is zero)."""
    n = len(owner)
    w = torch.zeros(n, n, dtype=torch.float64)
    held = (owner >= 0).nonzero().flatten()
    w[owner[held], held] = 1.0
    return (w / w.sum(dim=1, keepdim=True).clamp(min=1.0)).float()


def merge_owner(prefix_len: int, spans, steps) -> torch.Tensor:
    """The groups of the merging variant after the compaction steps ``steps`` (each int64
    increasing logical prefix positions kept, a subset of the step before; the first from the
    dense prefix), by brute force: at each step every stored token not kept goes to the kept token
    of its span nearest in the span's grid (squared distance in rows and columns), ties to the
    lower offset, and takes the tokens it stood for along.

    Returns:
        int64 ``[prefix_len]``: for each prefix token, the logical position of the kept token whose
        V holds its share.
    """
    owner = list(range(prefix_len))
    stored = list(range(prefix_len))
    for kept in steps:
        keep = kept.tolist()
        keep_set = set(keep)
        rep = {}
        for p in stored:
            if p in keep_set:
                rep[p] = p
                continue
            span = next(s for s in spans if s.start <= p < s.end)
            r, c = divmod(p - span.start, span.grid_w)

            def dist(q, span=span, r=r, c=c):
                qr, qc = divmod(q - span.start, span.grid_w)
                return (qr - r) ** 2 + (qc - c) ** 2, q

            rep[p] = min((q for q in keep if span.start <= q < span.end), key=dist)
        owner = [rep[o] if o >= 0 else -1 for o in owner]
        stored = keep
    return torch.tensor(owner, dtype=torch.long)


def merged_owner(engine, prompt, removed: torch.Tensor) -> torch.Tensor | None:
    """The :func:`merge_owner` groups of ``engine``'s merging compaction of ``prompt``'s prefix (one
    step from the dense prefix, dropping ``removed``); None when the engine does not merge or
    drops nothing."""
    if not engine.compaction.merge_values or removed.numel() == 0:
        return None
    n = prompt.prefix_len
    keep = torch.ones(n, dtype=torch.bool)
    keep[removed] = False
    return merge_owner(n, prompt.spans, [keep.nonzero().flatten()])


@torch.inference_mode()
def masked_greedy_logits(engine, messages, max_tokens: int, kept: torch.Tensor | None = None,
                         owner: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding of ``messages`` under the compaction mask of ``engine``'s settings, or, with
    ``kept`` (int64 logical prefix positions, e.g. a cache entry's ``kept.positions`` after an
    on-pressure compaction), under the mask that keeps exactly those prefix tokens.

    When ``engine`` merges values (``merge_values``), later queries read the merged V of the kept
    tokens: the groups are ``owner`` when given (:func:`merge_owner` of the steps the entry had),
    else those of one merging step from the dense prefix to the kept tokens.

    The whole prompt is prefilled in one dense forward (images' features from
    ``engine.vision_features``), then ``max_tokens`` tokens are decoded one by one (end-of-sequence
    tokens do not stop it, like ``ignore_eos``).

    Returns:
        The generated ids and their float32 logits ``[max_tokens, vocab]`` (row ``i`` chose token ``i``).
    """
    prompt = engine.prompts.build(messages)
    model, cfg = engine.model, engine.config.text
    n = len(prompt.input_ids)
    feats = engine.vision_features(prompt) if prompt.spans else None
    removed = removed_positions(engine, prompt, feats) if kept is None else _complement(kept, prompt.prefix_len)
    if owner is None:
        owner = merged_owner(engine, prompt, removed)
    cache = MaskedDenseCache(
        cfg.num_hidden_layers, n + max_tokens, cfg.num_key_value_heads, cfg.head_dim,
        prefix_len=prompt.prefix_len, removed=removed, dtype=model.dtype, device=model.device, owner=owner,
    )
    visual = None
    if feats is not None:
        visual = VisualInjection(prompt.visual_rows().to(model.device), feats.embeds, feats.deepstack)
    last = torch.tensor([n - 1], device=model.device)
    logits = model(torch.tensor(prompt.input_ids, device=model.device), prompt.positions.to(model.device),
                   cache.step(n), visual, last)[0]
    tokens, rows = [], []
    for i in range(max_tokens):
        token = int(torch.argmax(logits))
        tokens.append(token)
        rows.append(logits)
        if i + 1 == max_tokens:
            break
        pos = torch.full((3, 1), n + i + prompt.rope_delta, dtype=torch.long, device=model.device)
        logits = model(torch.tensor([token], device=model.device), pos, cache.step(1))[0]
    return tokens, torch.stack(rows)


def masked_greedy(engine, messages, max_tokens: int, kept: torch.Tensor | None = None,
                  owner: torch.Tensor | None = None) -> list[int]:
    """The ``max_tokens`` greedy token ids the compacted engine should produce for ``messages``
    (see :func:`masked_greedy_logits`)."""
    return masked_greedy_logits(engine, messages, max_tokens, kept, owner)[0]


def _complement(kept: torch.Tensor, prefix_len: int) -> torch.Tensor:
    keep = torch.zeros(prefix_len, dtype=torch.bool)
    keep[kept] = True
    return (~keep).nonzero().flatten()
