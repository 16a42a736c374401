"""CUDA-graph capture of the whole decode step (model, attention, greedy argmax).

A decode step of ``B`` sequences launches hundreds of small kernels; replaying them as one CUDA
graph takes the host out of the way. Short text-only prefills replay the same graphs, one row per
new token (see :meth:`engine.runner.ModelRunner._run_graph`). Graphs are captured once per batch-size bucket over
fixed-address input buffers (token ids, M-RoPE positions, slot mapping, sequence lengths, block
tables); a step with ``n`` sequences copies its inputs into the buffers of the smallest bucket
``>= n`` and pads the rest (slot -1: nothing stored; length 0: attention reads nothing). The only
host synchronisation of a step is reading the sampled token ids back.
"""

from __future__ import annotations

import torch

from ops import AttentionMetadata
from ops.triton_kernels import decode_splits, paged_decode_attention, store_kv

from .kv_cache import PagePool
from .model import Qwen3VL

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class _GraphDecodeStep:
    """Attention context of a captured decode step: Triton store + split decode, fixed splits."""

    def __init__(self, pool: PagePool, meta: AttentionMetadata, num_splits: int):
        self.pool, self.meta, self.num_splits = pool, meta, num_splits

    def attend(self, layer, q, k, v):
        cache = self.pool.layers[layer]
        store_kv(k, v, cache, self.meta.slot_mapping)
        return paged_decode_attention(q, cache, self.meta, num_splits=self.num_splits)


class DecodeGraphs:
    """Captured decode graphs for batch sizes up to ``max_batch``.

    Args:
        model: the model (on CUDA).
        pool: the KV pool it decodes over.
        max_batch: the most rows captured: the scheduler's ``max_num_seqs``, or more so that short
            prefills (one row per token) fit.
        max_pages_per_seq: block-table width (the model length in pages).
        max_seq_len: the longest sequence, used to choose each bucket's context split.
    """

    def __init__(self, model: Qwen3VL, pool: PagePool, max_batch: int, max_pages_per_seq: int, max_seq_len: int):
        self.model, self.pool = model, pool
        dev = model.device
        self.buckets = sorted({b for b in DEFAULT_BUCKETS if b < max_batch} | {max_batch})
        top = self.buckets[-1]
        self.ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions = torch.zeros(3, top, dtype=torch.long, device=dev)
        self.slots = torch.full((top,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(top, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(top, max_pages_per_seq, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(top + 1, dtype=torch.int32, device=dev)
        self.max_seq_len = max_seq_len
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._mempool = None

    def capture(self) -> None:
        """Capture every bucket (largest first, sharing one memory pool)."""
        hkv = self.pool.layers[0].num_kv_heads
        head_dim = self.pool.layers[0].head_dim
        block_n = 64 if head_dim <= 64 else 32
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for b in reversed(self.buckets):
                meta = AttentionMetadata(
                    self.slots[:b], self.qsl[: b + 1], self.seq_lens[:b], self.tables[:b], 1, self.max_seq_len
                )
                ctx = _GraphDecodeStep(self.pool, meta, decode_splits(b, hkv, self.max_seq_len, block_n))
                for _ in range(2):  # compile the Triton kernels and warm the allocator outside capture
                    self.model(self.ids[:b], self.positions[:, :b], ctx)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._mempool, stream=stream):
                    logits = self.model(self.ids[:b], self.positions[:, :b], ctx)
                    greedy = logits.argmax(dim=-1)
                self._mempool = graph.pool()
                self._graphs[b] = (graph, logits, greedy)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def run(self, ids: list[int], positions: torch.Tensor, slots: list[int], seq_lens: list[int],
            tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the bucket for ``n = len(ids)`` sequences.

        Args:
            ids: the token of each row.
            positions: int64 ``[3, n]`` M-RoPE positions (host or device).
            slots: the slot each row's K/V goes to.
            seq_lens: the KV length each row attends to (its own token included).
            tables: each row's block table (rows of one sequence may pass the same list).

        Returns:
            ``(logits [n, vocab] float32, greedy ids [n] int64)``, views of the graph's outputs
            (valid until the next replay).
        """
        n = len(ids)
        b = next(x for x in self.buckets if x >= n)
        graph, logits, greedy = self._graphs[b]
        dev = self.ids.device
        width = self.tables.shape[1]
        table = torch.zeros(b, width, dtype=torch.int32)
        made: dict[int, torch.Tensor] = {}  # the rows of one prefill share their block table
        for i, t in enumerate(tables):
            row = made.get(id(t))
            if row is None:
                row = made[id(t)] = torch.tensor(t, dtype=torch.int32)
            table[i, : len(t)] = row
        pad = b - n
        self.ids[:b].copy_(torch.tensor(ids + [0] * pad), non_blocking=True)
        self.positions[:, :b].copy_(torch.cat([positions.cpu(), torch.zeros(3, pad, dtype=torch.long)], 1))
        self.slots[:b].copy_(torch.tensor(slots + [-1] * pad), non_blocking=True)
        self.seq_lens[:b].copy_(torch.tensor(seq_lens + [0] * pad, dtype=torch.int32), non_blocking=True)
        self.tables[:b].copy_(table.to(dev, non_blocking=True))
        graph.replay()
        return logits[:n], greedy[:n]
