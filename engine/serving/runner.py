"""Executes one step plan on the model: applies the pool's data moves, encodes the images the step
first reaches, builds the flat batch, runs the decoder over the paged KV pool, and samples the next
token of every run that reached the end of its tokens.

The runner never sees a :class:`~engine.serving.request.Request`: it keeps its own state per
request id (the prompt's positions, the tokens it sampled, the sampler) and the encoder's outputs
per request id, given by the plans (:class:`~engine.serving.plan.NewRequest` once, then
:class:`~engine.serving.plan.ScheduledRun` each step) and dropped when a plan lists the request as
finished. Vision features survive preemption, so recomputation never reruns the encoder.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ops import AttentionMetadata

from ..cache.kv_pool import PagePool
from ..cache.kv_transfer import KVTransfers, Offload, Restore
from ..model.attention import PagedStep
from ..model.decoder import VisualInjection
from ..model.qwen3_vl import Qwen3VL
from ..model.vision import VisionFeatures, span_features
from .plan import NewRequest, ScheduledRun, StepOutput, StepPlan

#: A prefill rides the decode graph only while its rows' attention reads stay small: each row reads
#: its sequence's whole KV, so (new tokens x KV length) is bounded, in tokens (64 rows over 1k-token
#: contexts). Longer ones are cheaper as one eager prefill, which reads the context once.
GRAPH_PREFILL_READS = 1 << 16

#: The visual tokens of one run: int64 ``[V]`` offsets within the run's tokens and their features.
RunFeatures = tuple[torch.Tensor, VisionFeatures]


@dataclass
class StepInputs:
    """What an eager step feeds the model, on the host.

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


@dataclass
class _Sequence:
    """The runner's own state of one request."""

    info: NewRequest
    positions: torch.Tensor  # int64 [3, num_prompt], CPU
    tokens: list[int] = field(default_factory=list)  # prompt + sampled (rank 0's repetition penalty)

    def position_lists(self, start: int, end: int) -> list[list[int]]:
        """:meth:`positions_of` as three Python lists; generated tokens take no tensor op
        (decode's per-step host path)."""
        if start >= self.info.num_prompt:
            delta = self.info.rope_delta
            row = list(range(start + delta, end + delta))
            return [row, row, row]
        return self.positions_of(start, end).tolist()

    def positions_of(self, start: int, end: int) -> torch.Tensor:
        """Logical M-RoPE positions ``[3, end - start]`` of tokens ``start .. end - 1``."""
        n = self.info.num_prompt
        parts = []
        if start < n:
            parts.append(self.positions[:, start : min(end, n)])
        if end > n:
            idx = torch.arange(max(start, n), end) + self.info.rope_delta
            parts.append(idx.unsqueeze(0).expand(3, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


class ModelRunner:
    """Runs step plans on ``model`` with K/V in ``pool``.

    ``encode_vision(prompt, salt, items) -> (features by item, encoder ran)`` computes the features
    of some of a request's images / videos (``(kind, index)`` keys; see
    :meth:`engine.inputs.vision_features.VisionLookup.encode_items`); None on a tensor-parallel
    worker, which receives rank 0's. ``scorer(prompt, features by item) -> scores`` computes the
    token scores of a prefix the plan asks for (:meth:`PrefixReuse.token_scores
    <engine.cache.prefix_reuse.PrefixReuse.token_scores>`), or None. ``transfers``: the executor of
    the plans' copies between the pool and the host tier
    (:class:`~engine.cache.kv_transfer.KVTransfers`), None without a host tier.

    Attributes:
        features: the encoder-output store, ``{request id: {(kind, index): VisionFeatures}}``.
    """

    def __init__(self, model: Qwen3VL, pool: PagePool, encode_vision, graphs=None, prefill_graphs=None, *,
                 scorer=None, transfers: KVTransfers | None = None):
        self.model = model
        self.pool = pool
        self.transfers = transfers  # copies between the pool and the host tier, or None without one
        # each layer waits for its layer group of a restore this step reads (CUDA host tier only)
        self.gates = transfers.gates if transfers is not None else None
        self._deferred: list[Restore] = []  # gated restores of the plan taken, not started yet
        self._gated: list[int] = []  # ids of the gated restores started this step
        self.encode_vision = encode_vision
        self.scorer = scorer
        self.device = model.device
        self.graphs = graphs  # DecodeGraphs for pure decode steps on CUDA, or None
        self.prefill_graphs = prefill_graphs  # PrefillGraphs for short cold prompts alone in a step, or None
        self._seqs: dict[int, _Sequence] = {}
        self.features: dict[int, dict[tuple[str, int], VisionFeatures]] = {}
        # set by the loop: called once a step while its GPU work runs (see :meth:`start_transfers`)
        self.meanwhile: Callable[[str], None] | None = None
        self._meanwhile_due: str | None = None  # the step's forward path until meanwhile ran
        self._moves_done: torch.cuda.Event | None = None  # the step's data moves, queued before its forward

    #: Whether :meth:`start_transfers` may run between two plans (a tensor-parallel rank 0's
    #: workers learn of copies from plans only, so its runner says no).
    orders_between_steps = True

    # ------------------------------------------------------------------ one plan
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one plan: the data moves, then the encoder (a failure fails its own request: its
        run is left out), then the forward and sampling, then the token scores asked for.

        Raises:
            Exception: whatever the forward raised (the plan's requests then fail).
        """
        self.take(plan)
        if self.transfers is not None and self.transfers.cuda and self.meanwhile is not None:
            self._moves_done = torch.cuda.Event()
            self._moves_done.record()
        out = StepOutput()
        self._encode(plan, out)
        runs = [run for run in plan.runs if run.req_id not in out.failed]
        features = {run.req_id: f for run in runs if (f := self._run_features(run)) is not None}
        out.path = self.path_of(runs) if runs else "none"
        self._meanwhile_due = out.path if self.meanwhile is not None else None
        try:
            sampled = self._launch(plan, runs, features)
        finally:  # also when the forward raised: its restores must not start in a later step
            self.finish_forward()
        self._run_meanwhile()  # a step that samples nothing ran it nowhere yet
        for req_id, token in sampled:
            out.sampled[req_id] = token
            self._seqs[req_id].tokens.append(token)
        # after the forward: under tensor parallelism every rank has then taken the plan (its data
        # moves included) whatever the scores do
        for req_id in plan.scores:
            if req_id not in out.failed:
                seq = self._seqs[req_id]
                out.scores[req_id] = self.scorer(seq.info.prompt, self.features.get(req_id, {}))
        if self.transfers is not None:
            out.transfers = self.transfers.poll()
        return out

    def take(self, plan: StepPlan) -> None:
        """The plan's bookkeeping on this rank: drop the finished requests' state and features,
        keep the new ones', apply the pool's data moves in order (tier copies started on the copy
        stream; the stream waits for a restore this plan's runs read right after starting it), and
        make this rank's stream wait for its own copies rank 0 saw land."""
        for req_id in plan.finished:
            self._seqs.pop(req_id, None)
            self.features.pop(req_id, None)
        for new in plan.new:
            positions = new.positions
            if not isinstance(positions, torch.Tensor):  # a worker's copy
                positions = torch.tensor(positions, dtype=torch.long)
            self._seqs[new.req_id] = _Sequence(new, positions, list(new.token_ids))
        awaited = set(plan.transfers_awaited)
        if awaited:
            self.transfers.wait(awaited)  # ordered by an earlier plan, not seen landing yet
        orders = plan.kv_orders
        for i, order in enumerate(orders):
            if isinstance(order, (Offload, Restore)):
                read = order.xfer in awaited  # by this step's forward
                # the forward waits layer group by layer group, and the restore starts with the
                # forward (submit_deferred), so only the plan's last order can be: a data move
                # after it may read its pages whole, and a copy after it must keep plan order
                gated = read and self.gates is not None and i == len(orders) - 1
                if gated:  # started once the forward's inputs are queued (see submit_deferred)
                    self._deferred.append(order)
                    continue
                self.transfers.submit(order)
                if read:
                    self.transfers.wait((order.xfer,))
            else:
                self.pool.apply(order)
        if self.transfers is not None and plan.transfers_landed:
            self.transfers.wait(plan.transfers_landed)

    def submit_deferred(self) -> None:
        """Start the plan's gated restores (the ones its forward reads layer group by layer group).
        Called once the forward's inputs are queued and before its kernels: the inputs' small
        host-to-device copies share the copy engine with the restore, and queued behind its
        ~125 MB they held the whole forward back until the restore had landed (H200, v9)."""
        deferred, self._deferred = self._deferred, []
        for order in deferred:
            self.transfers.submit(order, gated=True)
            self._gated.append(order.xfer)

    def finish_forward(self) -> None:
        """After the step's forward is queued (or failed, or there was none: a plan whose reading
        run failed, a tensor-parallel worker's plan without runs): start any gated restore not yet
        started, order the compute stream after every gated restore of the step (a page one of them
        writes, such as a fork folded into it, may be freed with a failed request and reused by the
        next plan's moves or prefill graph, which hold no gate waits), and note the forward queued
        for :meth:`LayerGates.reopen <engine.cache.kv_transfer.LayerGates.reopen>`. The forward
        itself waited for every gate, so the wait costs it nothing."""
        self.submit_deferred()
        gated, self._gated = self._gated, []
        if gated:
            self.transfers.wait(gated)
        if self.gates is not None:
            self.gates.forward_queued()

    def _run_meanwhile(self) -> None:
        """Call :attr:`meanwhile` once this step, with the step's GPU work queued and not waited for."""
        path, self._meanwhile_due = self._meanwhile_due, None
        if path is not None:
            self.meanwhile(path)

    def start_transfers(self, orders: list[Restore]) -> None:
        """Start restores from the host tier at once, while the step in progress runs (its plan
        was taken, its forward queued): the serving loop admits a host hit that arrives meanwhile
        and its copy overlaps the rest of the step instead of delaying the next one. The copy
        stream waits for this step's data moves only, not for its forward: the restore's pages
        were free, and a step writes no free page (its moves may read pages they free, hence the
        wait). The next plan's forward waits for the copy on the GPU if it has not landed
        (``transfers_awaited``).

        Raises:
            TypeError: an order that is not a :class:`~engine.cache.kv_transfer.Restore`.
        """
        for order in orders:
            if not isinstance(order, Restore):
                raise TypeError(f"only restores start between plans, not {order!r}")
            self.transfers.submit(order, after=self._moves_done)

    def _launch(self, plan: StepPlan, runs: list[ScheduledRun], features: dict[int, RunFeatures]):
        """The forward of ``runs`` and its samples (tensor parallelism sends the plan first)."""
        return self.compute(runs, features) if runs else []

    def compute(self, runs: list[ScheduledRun], features: dict[int, RunFeatures], *, head: bool = True):
        """The forward of ``runs`` (decode graphs, a prefill graph or eager), ``features`` by
        request id. Returns ``(request id, sampled token)`` for the runs with ``sample`` set;
        with ``head=False`` (a tensor-parallel worker, whose rank 0 samples) nothing."""
        path = self.path_of(runs)
        if path == "graph":
            return self._run_graph(runs, head)
        if path == "prefill_graph":
            return self._run_prefill_graph(runs[0], features.get(runs[0].req_id), head)
        # Sequences with no cached context first: their rows attend to the step's own K/V.
        ordered = sorted(runs, key=lambda run: run.kv_len > 0)
        ids, positions, logit_rows, samplers = [], [], [], []
        vis_rows, vis_parts = [], []
        parts: dict[bool, tuple[list, list, list, list]] = {True: ([], [], [], []), False: ([], [], [], [])}
        offset = 0
        for run in ordered:
            seq = self._seqs[run.req_id]
            query_lens, seq_lens, tables, slots = parts[run.kv_len == 0]
            ids.extend(run.token_ids)
            positions.append(seq.positions_of(run.start, run.end))
            slots.extend(self.pool.slot(run.block_table, i - run.kv_offset) for i in range(run.start, run.end))
            query_lens.append(run.num_tokens)
            seq_lens.append(run.end - run.kv_offset)
            tables.append(list(run.block_table))
            found = features.get(run.req_id)
            if found is not None:
                vis_rows.append(found[0] + offset)
                vis_parts.append(found[1])
            if run.sample:
                logit_rows.append(offset + run.num_tokens - 1)
                samplers.append(run.req_id)
            offset += run.num_tokens
        visual = None
        if vis_rows:
            visual = (torch.cat(vis_rows), VisionFeatures.concat(vis_parts))
        inputs = StepInputs(ids, torch.cat(positions, dim=1), parts[True] if parts[True][0] else None,
                            parts[False] if parts[False][0] else None, visual, logit_rows)
        logits = self.forward(inputs, head=head)
        return self._sample(samplers, logits, None) if head else []

    def path_of(self, runs: list[ScheduledRun]) -> str:
        """Which forward :meth:`compute` runs for ``runs``: ``"graph"`` (the decode graphs),
        ``"prefill_graph"`` or ``"eager"``."""
        if self.graphs is not None and self._fits_graph(runs):
            return "graph"
        if self.prefill_graphs is not None and self._fits_prefill_graph(runs):
            return "prefill_graph"
        return "eager"

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
        args = (torch.tensor(inputs.ids, device=dev), inputs.positions.to(dev),
                PagedStep(self.pool, cached, fresh, self.gates), visual)
        logit_rows = torch.tensor(inputs.logit_rows, device=dev, dtype=torch.long) if head else None
        self.submit_deferred()
        if not head:
            with torch.inference_mode():
                return self.model.language_model(*args)
        return self.model(*args, logit_rows)

    def _sample(self, req_ids: list[int], logits: torch.Tensor, greedy: torch.Tensor | None):
        """Next token of each request: greedy rows from one batched argmax (one host sync),
        the others through their own sampler. :attr:`meanwhile` runs first (the sync would end
        the step's overlap with it)."""
        self._run_meanwhile()
        infos = [self._seqs[i].info for i in req_ids]
        own_sampler = [not s.sampling.greedy or s.sampling.repetition_penalty != 1.0 for s in infos]
        if greedy is None and not all(own_sampler):
            greedy = logits.argmax(dim=-1)
        greedy_ids = greedy.tolist() if greedy is not None else []
        out = []
        for i, (req_id, info) in enumerate(zip(req_ids, infos, strict=True)):
            if not own_sampler[i]:
                out.append((req_id, greedy_ids[i]))
                continue
            seen = None
            if info.sampling.repetition_penalty != 1.0:
                seen = torch.tensor(self._seqs[req_id].tokens, device=self.device)
            out.append((req_id, info.sampler(logits[i], seen)))
        return out

    # ------------------------------------------------------------------ graph replays
    def _fits_graph(self, runs: list[ScheduledRun]) -> bool:
        """A step replays the captured decode graph when it is text only and has at most
        ``graphs.max_batch`` new tokens. Decode steps qualify, and so do short prefills, such as
        a question after a cached prefix: that prefill is the whole TTFT of a prefix hit."""
        rows = sum(run.num_tokens for run in runs)
        return 0 < rows <= self.graphs.max_batch and not any(
            run.visual_items
            or (run.num_tokens > 1 and run.num_tokens * (run.end - run.kv_offset) > GRAPH_PREFILL_READS)
            for run in runs
        )

    def _run_graph(self, runs: list[ScheduledRun], head: bool):
        """Every new token becomes one row of the decode graph, attending to its sequence's KV up
        to and including itself (``seq_len`` = its position + 1). The graph stores all rows' K/V
        of a layer before any row attends, so the rows of one prefill see each other causally,
        exactly as one prefill would; the prefix's KV is read once per row (fine for short
        prefills, which is all that fits a graph)."""
        ids, slots, seq_lens, tables, logit_rows, samplers = [], [], [], [], [], []
        positions: list[list[int]] = [[], [], []]
        for run in runs:
            ids.extend(run.token_ids)
            for axis, row in zip(positions, self._seqs[run.req_id].position_lists(run.start, run.end), strict=True):
                axis.extend(row)
            table = list(run.block_table)
            for i in range(run.start, run.end):
                slots.append(self.pool.slot(table, i - run.kv_offset))
                seq_lens.append(i + 1 - run.kv_offset)
                tables.append(table)
            if run.sample:
                logit_rows.append(len(ids) - 1)
                samplers.append(run.req_id)
        logits, greedy = self.replay_decode(ids, positions, slots, seq_lens, tables)
        if not head:
            return []
        if len(logit_rows) < len(ids):  # some rows are prefill tokens with no next token
            pick = torch.tensor(logit_rows, dtype=torch.long, device=logits.device)
            logits, greedy = logits[pick], greedy[pick]
        return self._sample(samplers, logits, greedy)

    def _fits_prefill_graph(self, runs: list[ScheduledRun]) -> bool:
        """A step replays a prefill graph when it holds one sequence and no cached context: a cold
        prompt (or its first chunk) of at most ``prefill_graphs.max_tokens`` tokens, alone."""
        return len(runs) == 1 and runs[0].kv_len == 0 and self.prefill_graphs.fits(runs[0].num_tokens)

    def _run_prefill_graph(self, run: ScheduledRun, found: RunFeatures | None, head: bool):
        rows, features = found if found is not None else (torch.empty(0, dtype=torch.long), None)
        seq = self._seqs[run.req_id]
        slots = [self.pool.slot(run.block_table, i - run.kv_offset) for i in range(run.start, run.end)]
        logits = self.replay_prefill(list(run.token_ids), seq.positions_of(run.start, run.end), slots, rows, features)
        return self._sample([run.req_id], logits, None) if head and run.sample else []

    def replay_decode(self, ids, positions, slots, seq_lens, tables):
        """One replay of the decode graphs (see :meth:`engine.graphs.decode.DecodeGraphs.run`); the
        plan's gated restores start between the inputs' upload and the replay."""
        return self.graphs.run(ids, positions, slots, seq_lens, tables, before_replay=self.submit_deferred)

    def replay_prefill(self, ids, positions, slots, rows, features):
        """One replay of the prefill graphs (see :meth:`engine.graphs.prefill.PrefillGraphs.run`): a
        cold prompt, which reads no restored page, so the plan's restores may start first."""
        self.submit_deferred()
        return self.prefill_graphs.run(ids, positions, slots, rows, features)

    # ------------------------------------------------------------------ vision
    def _encode(self, plan: StepPlan, out: StepOutput) -> None:
        """Run the vision encoder, one request at a time, for the images and videos the plan's runs
        reach and the store lacks (images are encoded when a step first reaches their tokens, so a
        prompt with many images spreads its encoder work over its prefill chunks). A failure is
        recorded for its request only."""
        for run in plan.runs:
            store = self.features.setdefault(run.req_id, {})
            missing = [key for key in run.visual_items if key not in store]
            if not missing:
                continue
            seq = self._seqs[run.req_id]
            t = time.perf_counter()
            try:
                found, ran = self.encode_vision(seq.info.prompt, seq.info.salt, missing)
            except Exception as exc:
                out.failed[run.req_id] = exc
                continue
            store.update(found)
            if ran:  # cached features: the encoder took no time
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                out.vision_ms[run.req_id] = (time.perf_counter() - t) * 1e3

    def _run_features(self, run: ScheduledRun) -> RunFeatures | None:
        """Offsets and features of the visual tokens among the run's tokens, from the store."""
        if not run.visual_items:
            return None
        rows, features = span_features(self._seqs[run.req_id].info.spans, self.features[run.req_id],
                                       run.start, run.end, self.device)
        return None if features is None else (rows, features)
