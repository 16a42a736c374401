"""How a request uses the prefix cache, from intake to finish: the bookkeeping around
:class:`~engine.cache.prefix_cache.PrefixCache`.

1. **Key** (caller's thread, :meth:`PrefixReuse.key`): a prompt with images and a question after
   them gets the key of its public prefix (:func:`~engine.cache.prefix_cache.prefix_key`).
2. **Lookup** (loop, at intake, :meth:`PrefixReuse.look_up`): this decides hit or miss. The
   longest cached run for the prompt (its prefix, or a conversation extension of it) is kept as the
   request's ``match`` and counted as a hit; no entry is a miss.
3. **Attach** (scheduler, at admission, :meth:`PrefixReuse.attach`): the matched entry's pages
   start the request's block table read-only (references taken, the pages returned for the
   scheduler to install; a partly filled last page is copied by the scheduler before it is
   written). An entry evicted since the lookup is dropped
   (:meth:`PrefixReuse.drop`: reported ``stale``, the hit taken back) and the prompt computed cold.
4. **Compact and cache** (scheduler, in the update after the step that computed a cold prefix,
   :meth:`PrefixReuse.compact_and_cache`): the prefix's kept visual tokens are moved together (a
   slot-move order the next step plan carries), the pages beyond them freed, and the compact
   prefix cached; the request's new table and offset are returned for the scheduler to install.
   Under ``mode="on_pressure"`` the prefix is cached dense instead; the cache compacts it later,
   only when pages run short
   (:meth:`PrefixCache.make_room <engine.cache.prefix_cache.PrefixCache.make_room>`), under the
   same key. A hit reports which form it used (telemetry ``prefix_form``).
5. **Keep the conversation** (loop, when a request finishes, :meth:`PrefixReuse.keep_conversation`):
   a finished turn's KV becomes an extension of its prefix, so the next turn prefills only its
   question.

For a caller, :meth:`PrefixReuse.prefix_info` reports which visual tokens a salt's cached prefix
kept, per image (read from :attr:`PrefixEntry.kept <engine.cache.prefix_cache.PrefixEntry.kept>`).

Requests are duck-typed (:class:`CachingRequest`): this module never imports the serving core,
and it writes none of a request's KV state (``num_computed``, ``block_table``, ``kv_offset``, the
attached entry): it returns what they become. It writes the lookup's outcome (``match``) and the
prefix telemetry it decides. Every method but :meth:`PrefixReuse.key` runs under the engine loop's
lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..model.vision import span_features
from .compaction import COMPACTION_MODES, CompactionConfig, value_merge_plan
from .prefix_cache import KeptTokens, Match, PrefixCache, PrefixEntry, prefix_key
from .token_scores import media_hashes, prefix_scores


class CachingRequest(Protocol):
    """What the prefix cache reads and writes of a request
    (:class:`engine.serving.request.Request` is one).

    ``prompt`` has ``input_ids``, ``prefix_len``, ``spans``, ``num_visual_tokens``,
    ``image_hashes``, ``video_hashes`` and ``image_keys``; ``telemetry`` is the request's
    :class:`~engine.serving.outputs.Telemetry`.
    """

    prompt: Any
    telemetry: Any
    tokens: list[int]
    num_computed: int
    block_table: list[int]
    kv_offset: int
    salt: str
    prefix_key: str | None
    match: Match | None
    attached: PrefixEntry | None
    cold_prefix: bool
    awaits: int | None
    warm: bool

    @property
    def kv_len(self) -> int: ...


@dataclass(frozen=True)
class Compacted:
    """What :meth:`PrefixReuse.compact_and_cache` made of a request's cold prefix.

    Attributes:
        block_table: the request's pages now (the kept ones; the others were released).
        kv_offset: logical tokens the compaction removed.
        entry: the cache entry the request now reads (references held by the cache), or None when
            an entry of that key was cached meanwhile.
    """

    block_table: list[int]
    kv_offset: int
    entry: PrefixEntry | None


class PrefixReuse:
    """The prefix cache as the serving core drives it (see the module docstring).

    Args:
        cache: the prefix cache (its pool is the engine's).
        compaction: how a cold prefix is compacted before it is cached.
        namespace: the model namespace keys start with (checkpoint and settings that change tokens
            or pixels).
        conversation_reuse: keep finished turns as extensions.
        mode: ``"always"`` (a cold prefix is compacted with ``compaction`` before it is cached) or
            ``"on_pressure"`` (cached dense; the cache compacts it when it needs pages, with its
            ``pressure_steps``).

    Raises:
        ValueError: an unknown ``mode``.
    """

    def __init__(self, cache: PrefixCache, compaction: CompactionConfig, namespace: str, *,
                 conversation_reuse: bool = True, mode: str = "always"):
        if mode not in COMPACTION_MODES:
            raise ValueError(f"mode must be 'always' or 'on_pressure', got {mode!r}")
        self.cache = cache
        self.pool = cache.pool
        self.compaction = compaction
        self.namespace = namespace
        self.conversation_reuse = conversation_reuse
        self.mode = mode

    def key_namespace(self) -> str:
        """The compaction part of every prefix key. Under ``"on_pressure"`` it names the policy
        (mode and steps), not an entry's state: a prefix compacted later keeps its key, so the
        next question about the same images still finds it."""
        if self.mode == "always":
            return self.compaction.namespace()
        steps = ",".join(repr(s.keep_ratio) for s in self.cache.pressure_steps)
        return f"mode=on_pressure;steps={steps};{self.compaction.namespace()}"

    # ------------------------------------------------------------------ intake
    def key(self, prompt, salt: str) -> str | None:
        """The key of ``prompt``'s public prefix under ``salt``; None when the prompt is not
        prefix-cached (no images, or nothing after them)."""
        if not 0 < prompt.prefix_len < len(prompt.input_ids):
            return None
        return prefix_key(self.namespace, salt, prompt.image_hashes + prompt.video_hashes,
                          self.key_namespace(), prompt.input_ids[: prompt.prefix_len])

    def look_up(self, req: CachingRequest) -> None:
        """Find the request's cached prefix (before admission): sets ``req.match`` and reports
        ``hit``, ``miss`` or ``off``."""
        tel = req.telemetry
        if req.prefix_key is None:
            tel.prefix_cache = "off"
            return
        req.match = self.cache.lookup(req.prefix_key, req.prompt.input_ids, req.prompt.prefix_len)
        tel.prefix_cache = "hit" if req.match else "miss"
        if req.match:
            self.cache.stats.hits += 1
            tel.prefix_tier = "gpu" if req.match.entry.tier == "gpu" else "host"
        else:
            self.cache.stats.misses += 1

    # ------------------------------------------------------------------ admission
    def waits(self, req: CachingRequest) -> bool:
        """Whether ``req`` must stay queued (others are admitted past it) for a copy or a
        computation in flight: its entry is being restored from the host tier, or another request
        is computing its prefix now (it then hits that prefix instead of computing it again)."""
        return req.prefix_key is not None and self.cache.waits_for(req.prefix_key, req.match)

    def admission_match(self, req: CachingRequest) -> Match | None:
        """The match to attach when ``req`` is admitted: its intake match if the entry is still
        there, else a fresh lookup (an evicted extension's prefix may still be cached; when nothing
        is, the match is dropped, see :meth:`drop`); without a match, a fresh lookup too (a
        request preempted since may find its own prefix; a miss may find the prefix another
        request computed meanwhile, and becomes a hit)."""
        match = req.match
        if match is not None and not match.entry.alive:
            # an extension dropped since intake (evicted, or its prefix compacted on pressure)
            # may leave its prefix cached: attach that rather than compute everything again
            match = req.match = self.cache.lookup(req.prefix_key, req.tokens, req.prompt.prefix_len)
            if match is None:
                self.drop(req)
        if match is None and req.prefix_key is not None:
            match = req.match = self.cache.lookup(req.prefix_key, req.tokens, req.prompt.prefix_len)
            if match is not None and not req.telemetry.preempted:
                self._now_a_hit(req)
        return match

    def _now_a_hit(self, req: CachingRequest) -> None:
        """A request looked up as a miss (or dropped as stale) finds its prefix at admission,
        computed by another request since: it is a hit, and the counters say so."""
        tel, stats = req.telemetry, self.cache.stats
        if tel.prefix_cache == "miss":
            stats.misses -= 1
        elif tel.prefix_cache == "stale":
            stats.stale -= 1
        else:
            return
        stats.hits += 1
        tel.prefix_cache = "hit"
        tel.prefix_tier = "gpu" if req.match.entry.tier == "gpu" else "host"

    @property
    def has_host_tier(self) -> bool:
        """Whether the cache has a host tier holding anything (a host hit is possible)."""
        host = self.cache.host
        return host is not None and host.num_used > 0

    def restorable(self, req: CachingRequest) -> bool:
        """Whether ``req``'s intake match is alive on the host tier and nobody restores or
        computes it now: admitting ``req`` starts its restore."""
        match = req.match
        return (match is not None and match.entry.alive and self.on_host(match) and not req.warm
                and not self.waits(req))

    def on_host(self, match: Match) -> bool:
        """Whether the matched entry's KV is in the host tier (restore it before attaching)."""
        return match.entry.base.tier == "host"

    def restore_pages(self, match: Match) -> int:
        """GPU pages restoring the matched entry's family takes."""
        return self.cache.restore_pages(match.entry)

    def restore(self, req: CachingRequest, match: Match) -> list[int]:
        """Order the matched entry's family back from the host tier (GPU pages allocated; the
        caller made room) and attach it to ``req`` at once, reported as a host hit: the question's
        first prefill chunk rides the plan that carries the copy. ``req.awaits`` is set to the
        copy's transfer id: until it lands, every plan with a run of ``req`` lists it in
        :attr:`~engine.serving.plan.StepPlan.transfers_awaited`, and the runner's forward waits
        for it on the GPU (the host never blocks). Other requests for the entry wait for the
        landing (:meth:`waits`). Returns the pages that start ``req``'s block table, as
        :meth:`attach` does."""
        req.telemetry.prefix_tier = "host"
        req.awaits = self.cache.restore(match.entry)
        pages = self.cache.acquire(match, restoring=True)
        self._report_hit(req, match)
        return pages

    def restored(self, req: CachingRequest) -> None:
        """The copy ``req`` awaited landed: it reports the restore's time and pages."""
        req.awaits = None
        base = req.attached.base if req.attached is not None else None
        if base is not None and not req.telemetry.preempted:
            req.telemetry.restore_ms, req.telemetry.restored_pages = base.restore_ms, base.restored_pages

    def begin_compute(self, req: CachingRequest) -> None:
        """``req`` computes its prefix cold: later requests for it wait instead of computing it too."""
        self.cache.begin_compute(req.prefix_key)

    def end_compute(self, req: CachingRequest) -> None:
        """``req`` no longer computes its prefix (cached it, or was preempted or finished first)."""
        self.cache.end_compute(req.prefix_key)

    def drop(self, req: CachingRequest) -> None:
        """Give up the request's match (computed cold instead): report it "stale" and take back the
        hit counted at intake. Only a match found at intake was counted (and reported) as a hit: a
        preempted request's own re-lookup (kept while it waited) has nothing to take back."""
        req.match = None
        if not req.telemetry.preempted:
            req.telemetry.prefix_cache = "stale"
            self.cache.stats.stale += 1
            self.cache.stats.hits -= 1

    @contextmanager
    def pinned(self, match: Match) -> Iterator[None]:
        """Keep the matched entry from eviction meanwhile. Unpinned (no user) it is itself an
        eviction candidate, and evicting it while making room for its own request left
        :meth:`attach` an empty page list, so the request ran on uninitialised pages while
        reporting a hit."""
        match.entry.users += 1
        try:
            yield
        finally:
            match.entry.users -= 1

    def attach(self, req: CachingRequest, match: Match) -> list[int]:
        """Take the matched entry for ``req`` (a user, references on its pages) and report the
        hit. Returns the pages that start the request's block table (read-only); the scheduler
        installs them, with ``match.length`` tokens computed and the entry's ``kv_offset``."""
        pages = self.cache.acquire(match)
        self._report_hit(req, match)
        return pages

    def _report_hit(self, req: CachingRequest, match: Match) -> None:
        entry, tel = match.entry, req.telemetry
        if not tel.preempted:  # a re-admission after preemption saves nothing new for the user
            self.cache.stats.tokens_saved += match.length
            # Set at the first admission only: a re-admission's match is not prompt reuse. It may
            # run into the request's own generated tokens (cached_tokens > prompt_tokens) or be
            # the request's own prefix (a "miss" reporting cached tokens).
            tel.cached_tokens = match.length
            tel.conversation_reuse_tokens = match.length - entry.prefix_len
        base = entry.base
        tel.visual_tokens_kept = base.visual_kept
        if tel.prefix_tier == "host" and not tel.preempted:  # counted once, when it attaches
            self.cache.stats.hits_host += 1
            if base.tier == "gpu":  # restored for an earlier request (else: :meth:`restored`)
                tel.restore_ms, tel.restored_pages = base.restore_ms, base.restored_pages
        tel.prefix_pages = self.pool.pages_for(entry.prefix_len - entry.kv_offset)
        tel.prefix_pages_dense = entry.dense_pages
        tel.prefix_form = "compact" if entry.compact else "dense"
        if base.warmed and not tel.preempted:
            tel.warmed, base.warmed = True, False

    def detach(self, entry: PrefixEntry) -> None:
        """A request no longer uses ``entry``, which it attached (its page references are its own
        to release)."""
        self.cache.release_user(entry)

    def make_room(self, pages_needed: int) -> bool:
        """Evict unused entries until ``pages_needed`` pages are free; whether that succeeded."""
        return self.cache.make_room(pages_needed)

    # ------------------------------------------------------------------ after a step
    @property
    def needs_scores(self) -> bool:
        """Whether compacting a cold prefix needs token scores (computed from its vision
        features by the runner, which holds them: :meth:`token_scores`)."""
        return bool(self.compaction.score_names)

    def compact_and_cache(self, req: CachingRequest, scores: dict | None = None) -> Compacted:
        """Keep the prefix's selected tokens (moved to the front of its pages: a
        :class:`~engine.cache.kv_pool.SlotMove` order; the pages beyond released), then cache the
        compact prefix. Under ``"on_pressure"`` every token is kept: the prefix is cached dense.
        ``scores``: the prefix's token scores (:meth:`token_scores`; None when the selector needs
        none). Returns the request's new table, offset and entry (:class:`Compacted`)."""
        self.end_compute(req)
        n = req.prompt.prefix_len
        dense = self.mode == "on_pressure" or self.compaction.method is None
        kept = torch.arange(n) if dense else self.compaction.kept_positions(n, req.prompt.spans, scores)
        k = len(kept)
        table = list(req.block_table)
        owner = None
        if k < n:
            if self.compaction.merge_values:  # V of the dropped tokens folded into kept neighbours first
                plan = value_merge_plan(n, req.prompt.spans, torch.arange(n), kept)
                self.pool.merge_values(table, kept[plan.into].tolist(), plan.weight.tolist())
                owner = plan.owner
            table = self.pool.keep_slots(table, kept.tolist())
        visual_kept = k - (n - req.prompt.num_visual_tokens)
        tel = req.telemetry
        tel.visual_tokens_kept = visual_kept
        tel.prefix_pages = len(table)
        tel.prefix_pages_dense = self.pool.pages_for(n)
        tel.prefix_form = "dense" if k == n else "compact"
        entry = self.cache.add_prefix(
            req.prefix_key, req.salt, req.tokens[:n], table, k, tel.prefix_pages_dense, visual_kept,
            images=req.prompt.image_keys, spans=req.prompt.spans,
        )
        if entry is not None:
            method = None if dense else self.compaction.method
            entry.record_kept(KeptTokens(kept, method, self.compaction.keep_ratio if method else 1.0, owner))
            entry.scores = scores
            entry.warmed = req.warm
            entry.users += 1
        return Compacted(table, n - k, entry)

    def token_scores(self, prompt, vision: dict) -> dict | None:
        """The prefix's :data:`~engine.cache.compaction.TokenScores` the configured selector needs
        (see :mod:`engine.cache.token_scores`; ``4 * prefix_len`` bytes per score), from the vision
        features of ``prompt``'s images (``vision``: :class:`~engine.model.vision.VisionFeatures`
        by ``(kind, index)``), before anything is dropped; None when it needs none."""
        names = self.compaction.score_names
        if not names:
            return None
        n = prompt.prefix_len
        device = next(iter(vision.values())).embeds.device
        offsets, features = span_features(prompt.spans, vision, 0, n, device)
        spans = self.compaction.compacted_spans(prompt.spans)
        return prefix_scores(names, n, spans, media_hashes(prompt), features, offsets)

    # ------------------------------------------------------------------ for a caller
    def prefix_info(self, salt: str, images: list[str | None] | None = None, *,
                    preview: bool = False) -> list[dict] | None:
        """What the salt's cached prefix kept of each image, or with ``preview`` what its next
        compaction step on pressure would keep: see :meth:`engine.Engine.prefix_info` (``salt``
        already settled by the engine's cache scope). None when nothing is cached."""
        entry = self.cache.latest_prefix(salt, images)
        if entry is None or entry.kept is None:
            return None
        steps = self.cache.pressure_steps
        tier = "gpu" if entry.tier == "gpu" else "host"
        step = self.cache.next_step(entry) if preview else None
        if step is None:
            return [{**item, "preview": False, "step": None, "steps": len(steps), "tier": tier}
                    for item in kept_by_image(entry)]
        cfg = steps[step]
        kept = KeptTokens(self.cache.step_keeps(entry, step), cfg.method, cfg.keep_ratio)
        return [{**item, "preview": True, "step": step, "steps": len(steps), "tier": tier}
                for item in kept_by_image(entry, kept)]

    # ------------------------------------------------------------------ finish
    def keep_conversation(self, req: CachingRequest) -> None:
        """Keep a finished turn's KV as an extension of its prefix (conversation reuse)."""
        entry = req.attached
        if entry is None or not entry.alive or not self.conversation_reuse or entry.base.tier != "gpu":
            return  # a family whose copy back was not seen landing yet (rare: it lands with the step) is left as it is
        if req.num_computed <= len(entry.tokens) or req.kv_offset != entry.kv_offset:
            return
        pages = req.block_table[: self.pool.pages_for(req.kv_len)]
        self.cache.add_extension(entry, req.tokens[: req.num_computed], pages, req.kv_len)


def kept_by_image(entry: PrefixEntry, kept: KeptTokens | None = None) -> list[dict]:
    """One dict per image span of a prefix entry, from ``kept`` (default: what the entry holds,
    :attr:`PrefixEntry.kept`) alone (plain Python values, copied out): ``image`` (its index among
    the prompt's images), ``rows`` × ``cols`` (its merged-token grid), ``kept`` (``rows`` lists
    of ``cols`` booleans, row-major as the span's tokens), ``kept_count``, ``selector`` and
    ``keep_ratio``. Video frames are left out."""
    kept = entry.kept if kept is None else kept
    mask = kept.mask(entry.prefix_len)
    out = []
    for span in entry.spans:
        if span.kind != "image":
            continue
        grid = mask[span.start : span.end].view(span.grid_h, span.grid_w)
        out.append({"image": span.item, "rows": span.grid_h, "cols": span.grid_w, "kept": grid.tolist(),
                    "kept_count": int(grid.sum()), "selector": kept.selector, "keep_ratio": float(kept.keep_ratio)})
    return out
