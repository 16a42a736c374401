"""CUDA-graph capture of the whole decode step (model, attention, greedy argmax).

A decode step of ``B`` sequences launches hundreds of small kernels; replaying them as one CUDA
graph takes the host out of the way. Short text-only prefills replay the same graphs, one row per
new token (see :meth:`engine.serving.runner.ModelRunner._run_graph`). Graphs are captured once per
batch-size bucket over fixed-address input buffers (token ids, M-RoPE positions, slot mapping,
sequence lengths, block tables); a step with ``n`` sequences copies its inputs into the buffers of
the smallest bucket ``>= n`` and pads the rest (slot -1: nothing stored; length 0: attention reads
nothing). The only host synchronisation of a step is reading the sampled token ids back.
"""

from __future__ import annotations

import torch

from ops import AttentionMetadata
from ops.dispatch import DecodePlan, decode_plan
from ops.triton_kernels import store_kv

from ..cache.kv_pool import PagePool
from ..model.qwen3_vl import Qwen3VL
from .capture import capture_per_size

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class _GraphDecodeStep:
    """Attention context of a captured decode step: Triton store + the bucket's decode plan (kernel,
    settings and split fixed at capture), after the layer group's gate (captured as an external
    event wait) when there is a host tier."""

    def __init__(self, pool: PagePool, meta: AttentionMetadata, plan: DecodePlan, gates=None):
        self.pool, self.meta, self.plan, self.gates = pool, meta, plan, gates

    def attend(self, layer, q, k, v):
        if self.gates is not None:
            self.gates.wait(layer)
        cache = self.pool.layers[layer]
        store_kv(k, v, cache, self.meta.slot_mapping)
        return self.plan(q, cache, self.meta)


class DecodeGraphs:
    """Captured decode graphs for batch sizes up to ``max_batch``.

    The graphs read their inputs from fixed device buffers: one int64 ``[6, max_batch]`` block
    (token ids, the three M-RoPE position rows, slots, sequence lengths) and the int32 block tables
    ``[max_batch, max_pages_per_seq]``. A step fills a pinned host copy of the block and sends it in
    one transfer; table rows are sent only when some row changed since the last step (a sequence
    grows by a page every ``page_size`` tokens), so a steady decode step costs the host two small
    copies and one graph launch.

    Args:
        model: the model (on CUDA).
        pool: the KV pool it decodes over.
        max_batch: the most rows captured: the scheduler's ``max_num_seqs``, or more so that short
            prefills (one row per token) fit.
        max_pages_per_seq: block-table width (the model length in pages).
        max_seq_len: the longest sequence: with the bucket's batch size it chooses each bucket's
            decode attention (:func:`ops.dispatch.decode_plan`: kernel, settings, context split).
        gates: the host tier's :class:`~engine.cache.kv_transfer.LayerGates`, whose waits every
            graph holds (a host hit's first chunk replays a graph while its restore lands), or None.
    """

    IDS, POS, SLOTS, LENS = 0, slice(1, 4), 4, 5  # rows of the packed input block

    def __init__(self, model: Qwen3VL, pool: PagePool, max_batch: int, max_pages_per_seq: int, max_seq_len: int,
                 gates=None):
        self.model, self.pool, self.gates = model, pool, gates
        dev = model.device
        self.buckets = sorted({b for b in DEFAULT_BUCKETS if b < max_batch} | {max_batch})
        top = self.buckets[-1]
        self.inputs = torch.zeros(6, top, dtype=torch.long, device=dev)
        self.inputs[self.SLOTS] = -1
        self.tables = torch.zeros(top, max_pages_per_seq, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(top + 1, dtype=torch.int32, device=dev)
        pin = torch.cuda.is_available()
        # contiguous pinned host buffers (a strided or pageable source makes the copy synchronous)
        self._staging = {b: torch.zeros(6, b, dtype=torch.long, pin_memory=pin) for b in self.buckets}
        self._host_tables = torch.zeros(top, max_pages_per_seq, dtype=torch.int32, pin_memory=pin)
        self._host_rows: list[list[int] | None] = [None] * top  # what each device table row holds
        self._sent = torch.cuda.Event() if pin else None  # the staging buffers may be reused after it
        self.max_seq_len = max_seq_len
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.plans: dict[int, DecodePlan] = {}

    def decode_plans(self) -> dict[int, DecodePlan]:
        """Each bucket's decode attention, chosen for its batch size and :attr:`max_seq_len` (the
        table of :mod:`ops.dispatch`; the current kernel where it has no entry)."""
        layer = self.pool.layers[0]
        return {b: decode_plan(layer.is_fp8, b, self.max_seq_len, layer.num_kv_heads, layer.head_dim,
                               self.model.device) for b in self.buckets}

    def capture(self) -> None:
        """Capture every bucket (largest first, sharing one memory pool), each with its decode plan
        (:attr:`plans`, made before the capture)."""
        self.plans = self.decode_plans()
        ids, positions = self.inputs[self.IDS], self.inputs[self.POS]

        def step(b: int) -> tuple[torch.Tensor, torch.Tensor]:
            meta = AttentionMetadata(
                self.inputs[self.SLOTS, :b], self.qsl[: b + 1], self.inputs[self.LENS, :b], self.tables[:b],
                1, self.max_seq_len,
            )
            logits = self.model(ids[:b], positions[:, :b], _GraphDecodeStep(self.pool, meta, self.plans[b], self.gates))
            return logits, logits.argmax(dim=-1)

        captured = capture_per_size(self.model.device, self.buckets, step)
        self._graphs = {b: (graph, logits, greedy) for b, (graph, (logits, greedy)) in captured.items()}

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def run(self, ids: list[int], positions: list[list[int]], slots: list[int], seq_lens: list[int],
            tables: list[list[int]], before_replay=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the bucket for ``n = len(ids)`` rows.

        Args:
            ids: the token of each row.
            positions: three lists (temporal, height, width) of the rows' M-RoPE positions.
            slots: the slot each row's K/V goes to.
            seq_lens: the KV length each row attends to (its own token included).
            tables: each row's block table (rows of one sequence may pass the same list).
            before_replay: called after the inputs' uploads are queued, just before the replay.

        Returns:
            ``(logits [n, vocab] float32, greedy ids [n] int64)``, views of the graph's outputs
            (valid until the next replay).
        """
        n = len(ids)
        b = next(x for x in self.buckets if x >= n)
        graph, logits, greedy = self._graphs[b]
        if self._sent is not None:
            self._sent.synchronize()  # the previous step's transfers have left the staging buffers
        pad = [0] * (b - n)
        staging = self._staging[b]
        staging.copy_(torch.tensor([ids + pad, *(p + pad for p in positions), slots + [-1] * (b - n), seq_lens + pad]))
        self.inputs[:, :b].copy_(staging, non_blocking=True)
        self._send_tables(tables)
        if self._sent is not None:
            self._sent.record()
        if before_replay is not None:
            before_replay()
        graph.replay()
        return logits[:n], greedy[:n]

    def _send_tables(self, tables: list[list[int]]) -> None:
        """Copy the block-table rows that changed since the last step (compared by value:
        copy-on-write replaces a page in place). A run of rows holding the same list (the rows of
        one prefill) is sent once and repeated on the device."""
        i = 0
        while i < len(tables):
            t = tables[i]
            end = i + 1
            while end < len(tables) and tables[end] is t:
                end += 1
            if any(self._host_rows[r] != t for r in range(i, end)):
                width = len(t)
                self._host_tables[i, :width] = torch.tensor(t, dtype=torch.int32)
                self.tables[i, :width].copy_(self._host_tables[i, :width], non_blocking=True)
                if end > i + 1:
                    self.tables[i + 1 : end, :width] = self.tables[i, :width]
                kept = list(t)
                for r in range(i, end):
                    self._host_rows[r] = kept
            i = end
