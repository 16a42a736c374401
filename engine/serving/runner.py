"""Executes one scheduled step on the model: builds the flat batch, runs the decoder over the
paged KV pool, and samples the next token of every request that reached the end of its tokens."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ops import AttentionMetadata

from ..cache.kv_pool import PagePool
from ..model.attention import PagedStep
from ..model.decoder import VisualInjection
from ..model.qwen3_vl import Qwen3VL
from ..model.vision import VisionFeatures, span_features
from .batch import Batch
from .request import Request

#: A prefill rides the decode graph only while its rows' attention reads stay small: each row reads
#: its sequence's whole KV, so (new tokens x KV length) is bounded, in tokens (64 rows over 1k-token
#: contexts). Longer ones are cheaper as one eager prefill, which reads the context once.
GRAPH_PREFILL_READS = 1 << 16


@dataclass
class StepInputs:
    """What an eager step feeds the model, on the host: everything a tensor-parallel worker needs
    to run the same step on its shard (:mod:`engine.parallel`).

    Attributes:
        ids: the step's ``T`` token ids, flat (sequences without cached context first).
        positions: int64 ``[3, T]`` M-RoPE positions (CPU).
        fresh, cached: ``(query_lens, seq_lens, block_tables, slot_mapping)`` host lists of the
            sequences without / with cached context (see
            :meth:`ops.metadata.AttentionMetadata.build`), None when there are none.
        visual: ``(rows, features)``: int64 ``[V]`` rows (CPU) of the visual tokens among the ``T``
            and their :class:`~engine.model.vision.VisionFeatures` (model device), or None.
        logit_rows: rows whose next token is sampled.
    """

    ids: list[int]
    positions: torch.Tensor
    fresh: tuple[list, list, list, list] | None
    cached: tuple[list, list, list, list] | None
    visual: tuple[torch.Tensor, VisionFeatures] | None
    logit_rows: list[int]


class ModelRunner:
    """Runs batches on ``model`` with K/V in ``pool``.

    ``encode_vision(prompt, salt, items) -> (features by item, encoder ran)`` computes the features
    of some of a request's images / videos (``(kind, index)`` keys; see
    :meth:`engine.inputs.vision_features.VisionLookup.encode_items`). It runs when a step first
    reaches an image's tokens; the features stay with the request (also across preemption), so
    recomputation never reruns the encoder.
    """

    def __init__(self, model: Qwen3VL, pool: PagePool, encode_vision, graphs=None, prefill_graphs=None):
        self.model = model
        self.pool = pool
        self.encode_vision = encode_vision
        self.device = model.device
        self.graphs = graphs  # DecodeGraphs for pure decode steps on CUDA, or None
        self.prefill_graphs = prefill_graphs  # PrefillGraphs for short cold prompts alone in a step, or None

    def execute(self, batch: Batch) -> list[tuple[Request, int]]:
        """Run one step. Returns ``(request, sampled token)`` for requests that produced a token.

        K/V of the step's tokens are stored; ``num_computed`` advances.
        """
        if self.graphs is not None and self._fits_graph(batch):
            return self._run_graph(batch)
        if self.prefill_graphs is not None and self._fits_prefill_graph(batch):
            return self._run_prefill_graph(batch)
        page = self.pool.page_size
        # Sequences with no cached context first: their rows attend to the step's own K/V.
        items = sorted(batch.items, key=lambda item: item[0].kv_len > 0)
        ids, positions, logit_rows, samplers = [], [], [], []
        vis_rows, vis_parts = [], []
        parts: dict[bool, tuple[list, list, list, list]] = {True: ([], [], [], []), False: ([], [], [], [])}
        offset = 0
        for req, n in items:
            start, end = req.num_computed, req.num_computed + n
            query_lens, seq_lens, tables, slots = parts[req.kv_len == 0]
            ids.extend(req.tokens[start:end])
            positions.append(req.positions(start, end))
            slots.extend(req.slot(i, page) for i in range(start, end))
            query_lens.append(n)
            seq_lens.append(end - req.kv_offset)
            tables.append(req.block_table)
            rows, features = self._vision(req, start, end)
            if features is not None:
                vis_rows.append(rows + offset)
                vis_parts.append(features)
            if end == len(req.tokens):
                logit_rows.append(offset + n - 1)
                samplers.append(req)
            offset += n
        visual = None
        if vis_rows:
            visual = (torch.cat(vis_rows), VisionFeatures.concat(vis_parts))
        inputs = StepInputs(ids, torch.cat(positions, dim=1), parts[True] if parts[True][0] else None,
                            parts[False] if parts[False][0] else None, visual, logit_rows)
        logits = self.forward(inputs)
        for req, n in batch.items:
            req.num_computed += n
        return self._sample(samplers, logits, None)

    def forward(self, inputs: StepInputs, *, head: bool = True) -> torch.Tensor:
        """The model on one eager step's inputs: float32 logits ``[len(inputs.logit_rows), vocab]``,
        or with ``head=False`` the final-normed hidden states ``[T, hidden]`` (a tensor-parallel
        worker, whose rank 0 samples)."""
        dev = self.device
        fresh, cached = (AttentionMetadata.build(*part, dev) if part is not None else None
                         for part in (inputs.fresh, inputs.cached))
        visual = None
        if inputs.visual is not None:
            rows, feats = inputs.visual
            visual = VisualInjection(rows.to(dev), feats.embeds, feats.deepstack)
        args = (torch.tensor(inputs.ids, device=dev), inputs.positions.to(dev), PagedStep(self.pool, cached, fresh),
                visual)
        if not head:
            with torch.inference_mode():
                return self.model.language_model(*args)
        return self.model(*args, torch.tensor(inputs.logit_rows, device=dev, dtype=torch.long))

    def replay_decode(self, ids, positions, slots, seq_lens, tables):
        """One replay of the decode graphs (see :meth:`engine.graphs.decode.DecodeGraphs.run`)."""
        return self.graphs.run(ids, positions, slots, seq_lens, tables)

    def replay_prefill(self, ids, positions, slots, rows, features):
        """One replay of the prefill graphs (see :meth:`engine.graphs.prefill.PrefillGraphs.run`)."""
        return self.prefill_graphs.run(ids, positions, slots, rows, features)

    def _sample(self, reqs: list[Request], logits: torch.Tensor, greedy: torch.Tensor | None):
        """Next token of each request: greedy rows from one batched argmax (one host sync),
        the others through their own sampler."""
        own_sampler = [not r.sampling.greedy or r.sampling.repetition_penalty != 1.0 for r in reqs]
        if greedy is None and not all(own_sampler):
            greedy = logits.argmax(dim=-1)
        greedy_ids = greedy.tolist() if greedy is not None else []
        out = []
        for i, req in enumerate(reqs):
            if not own_sampler[i]:
                out.append((req, greedy_ids[i]))
                continue
            seen = None
            if req.sampling.repetition_penalty != 1.0:
                seen = torch.tensor(req.tokens, device=self.device)
            out.append((req, req.sampler(logits[i], seen)))
        return out

    def _fits_graph(self, batch: Batch) -> bool:
        """A step replays the captured decode graph when it is text only and has at most
        ``graphs.max_batch`` new tokens. Decode steps qualify, and so do short prefills, such as
        a question after a cached prefix: that prefill is the whole TTFT of a prefix hit."""
        rows = sum(n for _, n in batch.items)
        return 0 < rows <= self.graphs.max_batch and not any(
            req.visual_items_in(req.num_computed, req.num_computed + n)
            or (n > 1 and n * (req.num_computed + n - req.kv_offset) > GRAPH_PREFILL_READS)
            for req, n in batch.items
        )

    def _run_graph(self, batch: Batch) -> list[tuple[Request, int]]:
        """Every new token becomes one row of the decode graph, attending to its sequence's KV up
        to and including itself (``seq_len`` = its position + 1). The graph stores all rows' K/V
        of a layer before any row attends, so the rows of one prefill see each other causally,
        exactly as one prefill would; the prefix's KV is read once per row (fine for short
        prefills, which is all that fits a graph)."""
        page = self.pool.page_size
        ids, slots, seq_lens, tables, logit_rows, samplers = [], [], [], [], [], []
        positions: list[list[int]] = [[], [], []]
        for req, n in batch.items:
            start, end = req.num_computed, req.num_computed + n
            ids.extend(req.tokens[start:end])
            for axis, row in zip(positions, req.position_lists(start, end), strict=True):
                axis.extend(row)
            for i in range(start, end):
                slots.append(req.slot(i, page))
                seq_lens.append(i + 1 - req.kv_offset)
                tables.append(req.block_table)
            if end == len(req.tokens):
                logit_rows.append(len(ids) - 1)
                samplers.append(req)
        logits, greedy = self.replay_decode(ids, positions, slots, seq_lens, tables)
        for req, n in batch.items:
            req.num_computed += n
        if len(logit_rows) < len(ids):  # some rows are prefill tokens with no next token
            pick = torch.tensor(logit_rows, dtype=torch.long, device=logits.device)
            logits, greedy = logits[pick], greedy[pick]
        return self._sample(samplers, logits, greedy)

    def _fits_prefill_graph(self, batch: Batch) -> bool:
        """A step replays a prefill graph when it holds one sequence and no cached context: a cold
        prompt (or its first chunk) of at most ``prefill_graphs.max_tokens`` tokens, alone."""
        if len(batch.items) != 1:
            return False
        req, n = batch.items[0]
        return req.kv_len == 0 and self.prefill_graphs.fits(n)

    def _run_prefill_graph(self, batch: Batch) -> list[tuple[Request, int]]:
        ((req, n),) = batch.items
        start, end = req.num_computed, req.num_computed + n
        page = self.pool.page_size
        rows, features = self._vision(req, start, end)
        logits = self.replay_prefill(req.tokens[start:end], req.positions(start, end),
                                     [req.slot(i, page) for i in range(start, end)], rows, features)
        req.num_computed += n
        return self._sample([req], logits, None) if end == len(req.tokens) else []

    def encode_pending(self, batch: Batch) -> list[tuple[Request, Exception]]:
        """Run the vision encoder, one request at a time, for the images and videos whose tokens
        this step computes (``execute`` then reuses the features). Returns the requests whose
        encoding failed, with the error, so that only they fail."""
        failed = []
        for req, n in batch.items:
            try:
                self._encode_missing(req, req.visual_items_in(req.num_computed, req.num_computed + n))
            except Exception as exc:
                failed.append((req, exc))
        return failed

    def _vision(self, req: Request, start: int, end: int):
        """Offsets and features of the visual tokens among the request's tokens ``start .. end - 1``.

        Images are encoded when a step first reaches their tokens, not all at the first chunk, so a
        prompt with many images spreads its encoder work over its prefill chunks.
        """
        items = req.visual_items_in(start, end)
        if not items:
            return torch.empty(0, dtype=torch.long), None
        self._encode_missing(req, items)
        return span_features(req.prompt.spans, req.vision, start, end, self.device)

    def _encode_missing(self, req: Request, items: list[tuple[str, int]]) -> None:
        missing = [key for key in items if key not in req.vision]
        if not missing:
            return
        t = time.perf_counter()
        features, ran = self.encode_vision(req.prompt, req.salt, missing)
        req.vision.update(features)
        if ran:  # cached features: the encoder took no time
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            req.telemetry.vision_ms += (time.perf_counter() - t) * 1e3
            req.telemetry.vision_encoder_ran = True
