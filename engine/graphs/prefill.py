"""Short cold prefills through CUDA graphs, one per token-count bucket.

A cold prompt of a few hundred tokens (one photo and a question) costs the GPU ~5 ms on an 8B
model, but its eager forward launches ~1,000 kernels from Python: 20-40 ms of host time
(docs/PERFORMANCE.md, v7). A step that holds one such prompt and nothing else (no cached context)
is run instead by replaying a graph captured for the next larger bucket of tokens.

The prompt fills the first ``n`` rows of fixed input buffers; rows ``n .. b - 1`` are padding.
Padding cannot reach the prompt: its K/V slots are -1 (never stored), and it comes after every real
row in causal attention (:mod:`ops.self_attention`), so no real row attends to it. Its keys and
values must still be finite, because masked keys enter the sum with weight 0 and 0 * inf is NaN.
The visual features are padded with zeros, their rows pointing at the last padding row (each
bucket is larger than every prompt it serves, so that row exists).
"""

from __future__ import annotations

import torch

from ops import AttentionMetadata

from ..cache.kv_pool import PagePool
from ..model.attention import PagedStep
from ..model.decoder import VisualInjection
from ..model.qwen3_vl import Qwen3VL
from ..model.vision import VisionFeatures
from .capture import capture_per_size

#: Token-count buckets captured (a prompt of ``n`` tokens takes the smallest bucket ``> n``).
PREFILL_BUCKETS = (64, 128, 256, 512)


class PrefillGraphs:
    """Captured forwards of one fresh prompt of up to ``max(buckets) - 1`` tokens.

    Args:
        model: the model (on CUDA for :meth:`capture`; elsewhere :meth:`run` runs the same padded
            forward eagerly, which is what the CPU tests check).
        pool: the KV pool the prompt's K/V are stored in.
        buckets: token counts captured, increasing.

    The input buffers are one int64 block ``[7, max(buckets)]`` (token ids, the three M-RoPE
    position rows, slots, the rows of the visual tokens, and the row whose logits are returned, in
    column 0) filled from a pinned host copy in one transfer, and the visual features
    ``[max(buckets), hidden]`` (one embedding buffer and one per DeepStack tap), copied on the GPU.
    """

    IDS, POS, SLOTS, VIS, LOGIT = 0, slice(1, 4), 4, 5, 6  # rows of the packed input block

    def __init__(self, model: Qwen3VL, pool: PagePool, buckets: tuple[int, ...] = PREFILL_BUCKETS):
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 2:
            raise ValueError(f"buckets must be increasing token counts >= 2, got {buckets}")
        self.model, self.pool, self.buckets = model, pool, tuple(buckets)
        dev, dtype, top = model.device, model.dtype, buckets[-1]
        hidden = model.config.text.hidden_size
        taps = len(model.config.vision.deepstack_visual_indexes)
        self.inputs = torch.zeros(7, top, dtype=torch.long, device=dev)
        self.embeds = torch.zeros(top, hidden, dtype=dtype, device=dev)
        self.deepstack = [torch.zeros(top, hidden, dtype=dtype, device=dev) for _ in range(taps)]
        self._staging = torch.zeros(7, top, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._sent = torch.cuda.Event() if dev.type == "cuda" else None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._metas = {b: self._meta(b) for b in self.buckets}  # made here: no transfers while capturing
        self.runs = self.replays = 0  # prompts prefilled; of them, by a graph replay

    @property
    def max_tokens(self) -> int:
        """The longest prompt served: one less than the largest bucket."""
        return self.buckets[-1] - 1

    def fits(self, num_tokens: int) -> bool:
        """Whether a prompt of ``num_tokens`` new tokens has a bucket."""
        return 0 < num_tokens <= self.max_tokens

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b > n)

    def _meta(self, b: int) -> AttentionMetadata:
        """One fresh sequence of ``b`` tokens, stored through the slot buffer (the attention reads
        only the step's own K/V, so the block table is a placeholder)."""
        dev = self.inputs.device
        return AttentionMetadata(
            slot_mapping=self.inputs[self.SLOTS, :b],
            query_start_loc=torch.tensor([0, b], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([b], dtype=torch.int32, device=dev),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=dev),
            max_query_len=b, max_seq_len=b, fresh=True,
        )

    def _forward(self, b: int) -> torch.Tensor:
        """The model over the first ``b`` rows of the buffers: float32 logits ``[1, vocab]``."""
        meta = self._metas[b]
        visual = VisualInjection(self.inputs[self.VIS, :b], self.embeds[:b], [d[:b] for d in self.deepstack])
        return self.model(self.inputs[self.IDS, :b], self.inputs[self.POS, :b], PagedStep(self.pool, None, meta),
                          visual, self.inputs[self.LOGIT, :1])

    def capture(self) -> None:
        """Capture every bucket (largest first, sharing one memory pool). CUDA only. The warm-up
        forwards store nothing (all slots are -1)."""
        self.inputs[self.SLOTS] = -1
        self.inputs[self.VIS] = 0
        self._graphs = capture_per_size(self.model.device, self.buckets, self._forward)

    def run(self, ids: list[int], positions: torch.Tensor, slots: list[int], visual_rows: torch.Tensor,
            features: VisionFeatures | None) -> torch.Tensor:
        """Prefill one fresh prompt of ``n = len(ids)`` tokens (``n <= max_tokens``).

        Args:
            ids: its token ids.
            positions: int64 ``[3, n]`` M-RoPE positions.
            slots: the slot of each token's K/V.
            visual_rows: int64 ``[V]`` offsets of its visual tokens (``features`` hold theirs).
            features: the visual tokens' features (``[V, hidden]`` each, on the model's device), or
                None.

        Returns:
            float32 logits ``[1, vocab]`` of the last token (a view of the graph's output, valid
            until the next replay).

        Raises:
            ValueError: the prompt has no bucket, or the features do not match the rows.
        """
        n = len(ids)
        if not self.fits(n):
            raise ValueError(f"a prompt of {n} tokens has no prefill bucket (at most {self.max_tokens})")
        v = visual_rows.numel()
        if (features is None) != (v == 0) or (features is not None and features.embeds.shape[0] != v):
            raise ValueError("visual rows and features disagree")
        b = self._bucket(n)
        if self._sent is not None:
            self._sent.synchronize()  # the previous prefill's transfer has left the staging buffer
        host = self._staging[:, :b]
        host[self.IDS, :n] = torch.tensor(ids)
        host[self.IDS, n:] = 0
        host[self.POS, :n] = positions
        host[self.POS, n:] = 0
        host[self.SLOTS, :n] = torch.tensor(slots)
        host[self.SLOTS, n:] = -1
        host[self.VIS, :v] = visual_rows
        host[self.VIS, v:] = b - 1  # padded visual rows all land on the last padding row
        host[self.LOGIT, 0] = n - 1
        self.inputs.copy_(self._staging, non_blocking=True)  # whole: a strided slice would skip the pin
        if self._sent is not None:
            self._sent.record()
        # The padded visual rows all add into the last padding row: zeros, so that no earlier
        # prompt's features pile up there into an inf that attention's 0 * inf would spread.
        self.embeds[v:b].zero_()
        for buf in self.deepstack:
            buf[v:b].zero_()
        if features is not None:
            self.embeds[:v].copy_(features.embeds)
            for buf, tap in zip(self.deepstack, features.deepstack, strict=True):
                buf[:v].copy_(tap)
        self.runs += 1
        if b not in self._graphs:  # not captured (CPU): the same padded forward, eagerly
            return self._forward(b)
        graph, logits = self._graphs[b]
        graph.replay()
        self.replays += 1
        return logits
