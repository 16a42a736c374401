"""A trainable Qwen3-VL in plain torch, with the Hugging Face checkpoint's parameter names.

Prism's engine model (``engine.model``) is built for inference (paged KV, fused kernels without
gradients); this one is built for training a small model fast on batches of same-size images:

- the vision tower runs every image of a batch as one ``[images, heads, patches, head_dim]``
  attention (all images have one size, so no per-image loop);
- the decoder runs a right-padded ``[batch, length]`` block with causal attention (a padding token
  comes after every real token of its row, so no real token attends to one);
- logits are computed only for the rows asked for (the answer tokens), against the tied embedding.

The architecture is Qwen3-VL's (Qwen3-VL model card and report, arXiv:2511.21631): a ViT with
interpolated learned positions and 2-D RoPE, a 2x2 patch merger, DeepStack mergers whose outputs
are added to the visual tokens' hidden states after the first decoder layers (arXiv:2406.04334),
and a Qwen3 decoder (pre-norm RMSNorm, Q/K RMSNorm per head, grouped-query attention, interleaved
M-RoPE, SwiGLU). ``state_dict()`` keys are the checkpoint's (``model.visual.*``,
``model.language_model.*``; ``lm_head`` tied), and the tests check its logits against
transformers' ``Qwen3VLForConditionalGeneration`` on the same weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import ModelConfig, TextConfig, VisionConfig
from engine.model.rope import MRoPE, vision_rope_cos_sin
from engine.model.tiny import IMAGE_PAD_ID

#: Projections that write into a residual stream (their init is scaled down with depth).
_RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "attn.proj.weight", "linear_fc2.weight")


class ProbeVL(nn.Module):
    """Qwen3-VL for training: ``model.visual`` (:class:`Vision`) and ``model.language_model``
    (:class:`Text`); the LM head is the token embedding (tied).

    Raises:
        ValueError: a config with an untied LM head (not supported here).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        if not config.tie_word_embeddings:
            raise ValueError("ProbeVL ties the LM head to the embedding; the config must say tie_word_embeddings")
        self.config = config
        self.model = nn.Module()
        self.model.visual = Vision(config.vision)
        self.model.language_model = Text(config.text)

    def encode_images(self, pixels: torch.Tensor, grid: tuple[int, int], n_images: int):
        """Vision features of ``n_images`` images of one ``grid = (patch rows, patch cols)``.

        Args:
            pixels: ``[n_images * rows * cols, 3 * T * P * P]`` processor patches, images in order.

        Returns:
            ``(embeds, deepstack)``: ``[n_images * rows * cols / 4, hidden]`` merged tokens in prompt
            order, and one tensor of that shape per DeepStack tap.
        """
        return self.model.visual(pixels, grid, n_images)

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, embeds: torch.Tensor | None,
               deepstack: list[torch.Tensor]) -> torch.Tensor:
        """Final-normed hidden states ``[B, L, hidden]`` of right-padded prompts.

        Args:
            input_ids: int64 ``[B, L]``; the ``<|image_pad|>`` tokens, in row-major order, take
                ``embeds`` rows in order.
            positions: int64 ``[3, B, L]`` M-RoPE positions.
            embeds, deepstack: from :meth:`encode_images` (None and [] without images).
        """
        return self.model.language_model(input_ids, positions, embeds, deepstack)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> logits ``[..., vocab]`` through the tied embedding."""
        return F.linear(hidden, self.model.language_model.embed_tokens.weight)

    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Fresh weights for training: matrices and embeddings N(0, std), the output projection of
        each residual branch N(0, std / sqrt(2 * layers)) (GPT-2's scaled init), biases 0, norms 1."""
        gen = torch.Generator().manual_seed(seed)
        layers = self.config.text.num_hidden_layers + self.config.vision.depth
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    scale = std / (2 * layers) ** 0.5 if name.endswith(_RESIDUAL_OUTPUTS) else std
                    p.copy_(torch.randn(p.shape, generator=gen) * scale)
                elif "norm" in name.rsplit(".", 2)[-2] and name.endswith("weight"):
                    p.fill_(1.0)
                else:
                    p.zero_()


# --------------------------------------------------------------------------------------------
# Vision tower
# --------------------------------------------------------------------------------------------


class _Linear(nn.Linear):
    """``nn.Linear`` whose construction draws no random numbers (weights come from a checkpoint or
    :meth:`ProbeVL.init_weights`)."""

    def reset_parameters(self) -> None:
        pass


class Vision(nn.Module):
    """The vision tower; see :meth:`ProbeVL.encode_images`."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        hv, merged = cfg.hidden_size, cfg.hidden_size * cfg.spatial_merge_size**2
        patch = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Module()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.patch_embed.proj.weight = nn.Parameter(torch.empty(hv, cfg.in_channels, *k))
        self.patch_embed.proj.bias = nn.Parameter(torch.empty(hv))
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, hv)
        self.blocks = nn.ModuleList(_VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = _Merger(hv, merged, cfg.out_hidden_size, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            _Merger(hv, merged, cfg.out_hidden_size, postshuffle=True) for _ in cfg.deepstack_visual_indexes)
        self._patch = patch
        self._tables: dict = {}

    def forward(self, pixels, grid, n_images):
        cfg = self.cfg
        rows, cols = grid
        seq = rows * cols
        w = self.patch_embed.proj.weight
        x = F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.patch_embed.proj.bias)
        pos_index, pos_weight, cos, sin = self._grid_tables(rows, cols, x.device)
        pos = (self.pos_embed(pos_index) * pos_weight[..., None]).sum(1)  # [seq, hidden]
        x = (x.view(n_images, seq, -1) + pos.to(x.dtype))
        taps = {layer: j for j, layer in enumerate(cfg.deepstack_visual_indexes)}
        deepstack: list[torch.Tensor] = [None] * len(taps)  # type: ignore[list-item]
        for layer, block in enumerate(self.blocks):
            x = block(x, cos, sin)
            if layer in taps:
                deepstack[taps[layer]] = self.deepstack_merger_list[taps[layer]](x)
        return self.merger(x), deepstack

    def _grid_tables(self, rows: int, cols: int, device):
        """Bilinear taps into the learned position table (corners aligned) in merge-block order,
        and the 2-D rotary cos/sin ``[seq, 1, head_dim]`` (float32), cached per grid."""
        key = (rows, cols, str(device))
        if key not in self._tables:
            side = int(round(self.cfg.num_position_embeddings**0.5))
            m = self.cfg.spatial_merge_size
            r_idx, r_w = _taps(rows, side)
            c_idx, c_w = _taps(cols, side)
            index = (r_idx[:, None, :, None] * side + c_idx[None, :, None, :]).reshape(rows, cols, 4)
            weight = (r_w[:, None, :, None] * c_w[None, :, None, :]).reshape(rows, cols, 4)

            def blocks(t):
                return t.view(rows // m, m, cols // m, m, 4).permute(0, 2, 1, 3, 4).reshape(rows * cols, 4)

            cos, sin = vision_rope_cos_sin([(1, rows, cols)], m, self.cfg.head_dim, self.cfg.rope_theta, "cpu")
            self._tables[key] = (blocks(index).to(device), blocks(weight).to(device),
                                 cos[:, None].to(device), sin[:, None].to(device))
        return self._tables[key]


def _taps(size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two source indices ``[size, 2]`` and weights ``[size, 2]`` for ``size`` points spread over
    ``side`` table entries with the end points aligned (bilinear, align-corners)."""
    src = torch.linspace(0, side - 1, size, dtype=torch.float32)
    lo = src.floor().long().clamp(max=side - 1)
    hi = (lo + 1).clamp(max=side - 1)
    frac = src - lo.float()
    return torch.stack([lo, hi], 1), torch.stack([1 - frac, frac], 1)


class _VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        hv = cfg.hidden_size
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.norm1 = nn.LayerNorm(hv, eps=1e-6)
        self.norm2 = nn.LayerNorm(hv, eps=1e-6)
        self.attn = nn.Module()
        self.attn.qkv = _Linear(hv, 3 * hv)
        self.attn.proj = _Linear(hv, hv)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = _Linear(hv, cfg.intermediate_size)
        self.mlp.linear_fc2 = _Linear(cfg.intermediate_size, hv)
        self.act = _activation(cfg.hidden_act)

    def forward(self, x, cos, sin):
        n, seq, hv = x.shape
        qkv = self.attn.qkv(self.norm1(x)).view(n, seq, 3, self.heads, self.head_dim)
        q, k, v = qkv.unbind(2)
        q, k = _rotate_float32(q, cos, sin), _rotate_float32(k, cos, sin)  # rotary in float32, as the reference
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.attn.proj(out.transpose(1, 2).reshape(n, seq, hv))
        return x + self.mlp.linear_fc2(self.act(self.mlp.linear_fc1(self.norm2(x))))


class _Merger(nn.Module):
    """2x2 patch merger: the final one norms each patch before the 4 are concatenated, the
    DeepStack ones (``postshuffle``) norm the concatenation; then Linear, GELU, Linear."""

    def __init__(self, hv: int, merged: int, out: int, postshuffle: bool):
        super().__init__()
        self.merged, self.postshuffle = merged, postshuffle
        self.norm = nn.LayerNorm(merged if postshuffle else hv, eps=1e-6)
        self.linear_fc1 = _Linear(merged, merged)
        self.linear_fc2 = _Linear(merged, out)

    def forward(self, x):
        x = self.norm(x.reshape(-1, self.merged)) if self.postshuffle else self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


# --------------------------------------------------------------------------------------------
# Decoder
# --------------------------------------------------------------------------------------------


class Text(nn.Module):
    """Token embedding, decoder layers with DeepStack injection, final norm; see :meth:`ProbeVL.hidden`."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = MRoPE(cfg.head_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved)

    def forward(self, input_ids, positions, embeds, deepstack):
        b, length = input_ids.shape
        x = self.embed_tokens(input_ids)
        visual = (input_ids == IMAGE_PAD_ID)[..., None]
        if embeds is not None:
            x = x.masked_scatter(visual, embeds.to(x.dtype))
        cos, sin = self.rope.cos_sin(positions.reshape(3, -1), x.dtype)
        cos, sin = cos.view(b, 1, length, -1), sin.view(b, 1, length, -1)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin)
            if i < len(deepstack):
                x = x + torch.zeros_like(x).masked_scatter(visual, deepstack[i].to(x.dtype))
        return self.norm(x)


class _RMSNorm(nn.Module):
    """RMSNorm in float32, cast back to the input dtype before the weight multiplies (as Qwen3's)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.input_layernorm = _RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = nn.Module()
        a = self.self_attn
        a.q_proj = _Linear(h, self.heads * hd, bias=cfg.attention_bias)
        a.k_proj = _Linear(h, self.kv_heads * hd, bias=cfg.attention_bias)
        a.v_proj = _Linear(h, self.kv_heads * hd, bias=cfg.attention_bias)
        a.o_proj = _Linear(self.heads * hd, h, bias=cfg.attention_bias)
        a.q_norm = _RMSNorm(hd, cfg.rms_norm_eps)
        a.k_norm = _RMSNorm(hd, cfg.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = _Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = _Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = _Linear(cfg.intermediate_size, h, bias=False)
        self.act = _activation(cfg.hidden_act)

    def forward(self, x, cos, sin):
        b, length, _ = x.shape
        a = self.self_attn
        h = self.input_layernorm(x)
        q = a.q_norm(a.q_proj(h).view(b, length, self.heads, self.head_dim)).transpose(1, 2)
        k = a.k_norm(a.k_proj(h).view(b, length, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = a.v_proj(h).view(b, length, self.kv_heads, self.head_dim).transpose(1, 2)
        # under autocast the norms' float32 weights promote q and k; attention takes v's dtype
        q, k = _rotate(q, cos, sin).to(v.dtype), _rotate(k, cos, sin).to(v.dtype)
        if self.heads != self.kv_heads:  # each K/V head serves a run of consecutive query heads
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a.o_proj(out.transpose(1, 2).reshape(b, length, -1))
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(self.act(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _rotate(x, cos, sin):
    """Rotary embedding (RoFormer, arXiv:2104.09864) in ``x``'s dtype; cos/sin broadcast to ``x``."""
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


def _rotate_float32(x, cos, sin):
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


def _activation(name: str):
    if name == "silu":
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"unsupported activation {name!r}")
