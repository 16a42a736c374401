"""Qwen3-VL vision tower: patch embedding, interpolated learned positions, 2-D RoPE, per-frame
attention blocks, the 2×2 patch merger and the DeepStack mergers.

Architecture from the Qwen3-VL model card and technical report (arXiv:2511.21631); DeepStack from
Meng et al., arXiv:2406.04334. Parameter names follow the Hugging Face checkpoint layout
(``model.visual.*``) so weights load without renaming.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from ops.fused import rope_float32
from ops.self_attention import SDPA_BACKENDS_WITHOUT_PLANS

from .config import VisionConfig
from .layers import activation
from .rope import vision_rope_cos_sin


@dataclass
class VisionFeatures:
    """What the vision step hands the decoder for one set of images or videos.

    ``embeds`` is ``[num_visual_tokens, text_hidden]`` in the model dtype, in prompt order (merged
    tokens of image 0, then image 1, ...). ``deepstack`` holds one tensor of the same shape per
    DeepStack tap; tap ``j`` is added to the decoder's hidden states after decoder layer ``j``.
    ``attention`` (float32 ``[num_visual_tokens]``, or None when not asked for: see
    :meth:`VisionEncoder.forward`) is the attention each merged token receives in the tower's last
    block, the input of the attention selector (:mod:`engine.cache.token_scores`).
    """

    embeds: torch.Tensor
    deepstack: list[torch.Tensor]
    attention: torch.Tensor | None = None

    def select(self, rows: torch.Tensor) -> VisionFeatures:
        """The features of the visual tokens at ``rows`` (int64 indices into ``embeds``)."""
        attention = None if self.attention is None else self.attention[rows.to(self.attention.device)]
        return VisionFeatures(self.embeds[rows], [d[rows] for d in self.deepstack], attention)

    @staticmethod
    def concat(parts: list[VisionFeatures]) -> VisionFeatures:
        """Concatenate features of several prompts' images along the token axis (``attention``
        only when every part has it)."""
        depth = len(parts[0].deepstack)
        attention = None
        if all(p.attention is not None for p in parts):
            attention = torch.cat([p.attention for p in parts])
        return VisionFeatures(
            torch.cat([p.embeds for p in parts]),
            [torch.cat([p.deepstack[j] for p in parts]) for j in range(depth)],
            attention,
        )


def span_features(spans, items: dict, start: int, end: int, device) -> tuple[torch.Tensor, VisionFeatures | None]:
    """The visual tokens among prompt tokens ``start .. end - 1`` and their features.

    Args:
        spans: the prompt's :class:`~engine.model.rope.VisualSpan` list.
        items: features per ``(kind, item)`` (one image, or one whole video in frame order).
        start, end: the token range.
        device: where the index tensors go.

    Returns:
        ``(offsets, features)``: int64 offsets of the visual tokens within the range, and their
        features in that order (None when the range holds no visual token).
    """
    offsets, parts = [], []
    for span in spans:
        lo, hi = max(span.start, start), min(span.end, end)
        if lo >= hi:
            continue
        base = span.frame * span.length - span.start  # a video frame's tokens follow the earlier frames'
        offsets.append(torch.arange(lo - start, hi - start))
        parts.append(items[(span.kind, span.item)].select(torch.arange(base + lo, base + hi, device=device)))
    if not parts:
        return torch.empty(0, dtype=torch.long), None
    return torch.cat(offsets), VisionFeatures.concat(parts)


class EncodeCounter:
    """Counts the images and video clips ``encoder`` (a :class:`VisionEncoder`) encodes, through a
    forward hook: every call of its forward (eager runs, and the run a CUDA-graph capture makes);
    replays of the encoder's graphs are not calls (``vision_graph_replays`` counts them).
    :meth:`remove` takes the hook off.

    Attributes:
        images: items encoded (one per ``(t, h, w)`` grid handed to the encoder).
    """

    def __init__(self, encoder: nn.Module):
        self.images = 0
        self._handle = encoder.register_forward_hook(self._count)

    def _count(self, module, args, output) -> None:
        self.images += len(args[1])  # VisionEncoder.forward(pixels, grids)

    def remove(self) -> None:
        self._handle.remove()


class PatchEmbed(nn.Module):
    """Linear projection of flattened ``(channels, temporal, patch, patch)`` patches.

    The checkpoint stores it as a Conv3d whose kernel equals its stride, i.e. a matrix product.
    """

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels [N, C*T*P*P]`` -> ``[N, hidden]``."""
        weight = self.proj.weight.reshape(self.proj.weight.shape[0], -1)
        return F.linear(pixels.to(weight.dtype), weight, self.proj.bias)


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention confined to each image or video frame."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg_lens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3 * self.num_heads, self.head_dim)
        qk = rope_float32(qkv[:, : 2 * self.num_heads], cos, sin)  # query and key heads in one launch
        q, k, v = qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, 2 * self.num_heads :]
        outs, start = [], 0
        for length, run in itertools.groupby(seg_lens):
            count = len(list(run))
            # consecutive segments of one length (same-size photos, a video's frames) attend as
            # one batch: [count, heads, length, head_dim]
            rows = slice(start, start + length * count)
            qs, ks, vs = (t[rows].view(count, length, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(length * count, -1))
            start += length * count
        return self.proj(torch.cat(outs) if len(outs) > 1 else outs[0])

    def received_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg_lens: list[int],
                           max_elements: int = 1 << 24) -> torch.Tensor:
        """The attention each patch receives: its softmax weight averaged over the heads and the
        queries of its image / frame, float32 ``[N]`` (each segment's values sum to 1).

        ``x`` is this block's normed input ``[N, hidden]``. The weights are computed in float32 a
        chunk of queries at a time (at most ``max_elements`` weights in memory, 64 MiB by
        default), never as a whole ``[heads, L, L]`` matrix, and only the column sums are kept.
        The output path (:meth:`forward`) is untouched: this is a second, score-only pass.
        """
        n, h = x.shape[0], self.num_heads
        qkv = self.qkv(x).view(n, 3 * h, self.head_dim)
        qk = rope_float32(qkv[:, : 2 * h], cos, sin).float()
        q, k = qk[:, :h].transpose(0, 1), qk[:, h:].transpose(0, 1)  # [heads, N, D]
        out = torch.empty(n, dtype=torch.float32, device=x.device)
        start = 0
        for length in seg_lens:
            qs, ks = q[:, start : start + length], k[:, start : start + length]
            acc = torch.zeros(length, dtype=torch.float32, device=x.device)
            chunk = max(1, max_elements // (h * length))
            for c in range(0, length, chunk):
                weights = torch.softmax(qs[:, c : c + chunk] @ ks.transpose(1, 2) * self.head_dim**-0.5, dim=-1)
                acc += weights.sum((0, 1))
            out[start : start + length] = acc / (h * length)
            start += length
        return out


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm transformer block (LayerNorm, eps 1e-6)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cos, sin, seg_lens):
        x = x + self.attn(self.norm1(x), cos, sin, seg_lens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Concatenate each 2×2 block of patch features and project to the text hidden size.

    The final merger normalises each patch before concatenation; the DeepStack mergers
    (``postshuffle_norm=True``) normalise the concatenated vector.
    """

    def __init__(self, cfg: VisionConfig, postshuffle_norm: bool):
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged if postshuffle_norm else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged, bias=True)
        self.linear_fc2 = nn.Linear(self.merged, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.reshape(-1, self.merged))
        else:
            x = self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionEncoder(nn.Module):
    """The whole vision tower.

    Input: the processor's ``pixel_values`` ``[num_patches, C*T*P*P]`` and ``grid_thw`` rows
    ``(t, h, w)`` in patches. Output: :class:`VisionFeatures` with ``num_patches / merge**2`` tokens.
    """

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, postshuffle_norm=True) for _ in cfg.deepstack_visual_indexes
        )

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]],
                attention: bool = False) -> VisionFeatures:
        """``attention=True`` also returns :attr:`VisionFeatures.attention`: the attention each
        patch receives in the last block (:meth:`VisionAttention.received_attention`), summed over
        the ``merge**2`` patches of each merged token (a merged token's share of its image's
        attention; an image's values sum to 1). It costs one more score-only attention pass over
        the last block and is not part of the CUDA-graph path (:mod:`engine.graphs.vision`)."""
        cfg = self.cfg
        x = self.patch_embed(pixels)
        x = x + self._position_embeddings(grids).to(x.dtype)
        cos, sin = vision_rope_cos_sin(grids, cfg.spatial_merge_size, cfg.head_dim, cfg.rope_theta, x.device)
        seg_lens = [h * w for t, h, w in grids for _ in range(t)]
        taps = {layer: j for j, layer in enumerate(cfg.deepstack_visual_indexes)}
        deepstack: list[torch.Tensor] = [None] * len(taps)  # type: ignore[list-item]
        # Not cuDNN's attention, whose plan per new length (every new image size) was the likely
        # cause of the ~10x TTFT the H200 serving benchmark showed for photos of new sizes.
        with sdpa_kernel(SDPA_BACKENDS_WITHOUT_PLANS):
            received = None
            for layer, block in enumerate(self.blocks):
                if attention and layer == len(self.blocks) - 1:
                    received = block.attn.received_attention(block.norm1(x), cos, sin, seg_lens)
                x = block(x, cos, sin, seg_lens)
                if layer in taps:
                    deepstack[taps[layer]] = self.deepstack_merger_list[taps[layer]](x)
        if received is not None:
            received = received.view(-1, cfg.spatial_merge_size**2).sum(1)
        return VisionFeatures(self.merger(x), deepstack, received)

    def _position_embeddings(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Bilinear (align-corners) resampling of the square learned table to each grid, float32.

        Returns ``[num_patches, hidden]`` in the processor's merge-block patch order.
        """
        side = int(self.cfg.num_position_embeddings**0.5)
        m = self.cfg.spatial_merge_size
        table = self.pos_embed.weight
        out = []
        for t, h, w in grids:
            rows = _bilinear_taps(h, side, table.device)
            cols = _bilinear_taps(w, side, table.device)
            # grid[r, c] = sum over the 2×2 taps of weight_r * weight_c * table[tap_r * side + tap_c]
            idx = rows[0][:, None, :, None] * side + cols[0][None, :, None, :]  # [h, w, 2, 2]
            wts = rows[1][:, None, :, None] * cols[1][None, :, None, :]
            grid = (table[idx].float() * wts[..., None]).sum((2, 3))  # [h, w, hidden]
            grid = grid.view(h // m, m, w // m, m, -1).permute(0, 2, 1, 3, 4).reshape(h * w, -1)
            out.append(grid.repeat(t, 1))
        return torch.cat(out)


def _bilinear_taps(size: int, side: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``size`` target points spread over ``side`` source points (corners aligned), the two
    source indices ``[size, 2]`` (int64) and their weights ``[size, 2]`` (float32)."""
    src = torch.arange(size, device=device, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    lo = src.floor()
    frac = src - lo
    taps = torch.stack([lo, lo + 1], dim=1).long().clamp(max=side - 1)
    weights = torch.stack([1 - frac, frac], dim=1)
    return taps, weights
