"""Qwen3-VL language decoder: embeddings, pre-norm decoder layers with Q/K RMSNorm, M-RoPE and
grouped-query attention, SwiGLU MLP, DeepStack injection, final norm and LM head.

Architecture from the Qwen3 technical report (arXiv:2505.09388) and the Qwen3-VL model card;
parameter names follow the Hugging Face checkpoint (``model.language_model.*``, ``lm_head``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ops.fused import add_rms_norm, qk_norm_rope, silu_mul
from ops.linear import add_rms_norm_linear, linear, silu_mul_linear

from .attention import AttentionContext
from .config import TextConfig
from .layers import RMSNorm, activation
from .rope import MRoPE


@dataclass
class VisualInjection:
    """Visual features to place into a step's flat token batch.

    ``rows`` int64 ``[V]`` are the indices (into the step's ``T`` tokens) of visual placeholder
    tokens; ``embeds`` ``[V, hidden]`` replace their token embeddings; ``deepstack[j]`` ``[V, hidden]``
    is added to their hidden states after decoder layer ``j``.
    """

    rows: torch.Tensor
    embeds: torch.Tensor
    deepstack: list[torch.Tensor]


def _reduced(reduce, partial: torch.Tensor) -> torch.Tensor:
    """``partial`` summed over the tensor-parallel ranks (``reduce``), or as it is on one rank."""
    return partial if reduce is None else reduce(partial)


class Attention(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

        self.qkv: nn.Parameter | None = None  # fused [q; k; v] weight, see fuse_projections()
        #: Under tensor parallelism (``engine.parallel.sharding``) this rank holds some heads only and
        #: ``o_proj`` is row-parallel: ``reduce`` sums the ranks' partial outputs in place.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def fuse_projections(self) -> None:
        """Store the Q, K, V weights as one matrix (their parameters become views of it) so a step
        runs one matrix product instead of three. Used on CUDA, where launches dominate decode.
        Idempotent: a second engine on the same model must not re-fuse, or the CUDA graphs the first
        one captured would read freed weight memory."""
        if self.q_proj.bias is not None or self.qkv is not None:
            return
        fused = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).detach()
        sizes = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
        for proj, view in zip((self.q_proj, self.k_proj, self.v_proj), fused.split(sizes), strict=True):
            proj.weight = nn.Parameter(view, requires_grad=False)
        self.qkv = nn.Parameter(fused, requires_grad=False)

    def forward(self, x, cos, sin, layer: int, ctx: AttentionContext):
        if self.qkv is not None:
            return self.attend_projected(linear(x, self.qkv), cos, sin, layer, ctx)
        t = x.shape[0]
        eps = self.q_norm.eps
        q = qk_norm_rope(self.q_proj(x).view(t, self.heads, self.head_dim), self.q_norm.weight, cos, sin, eps)
        k = qk_norm_rope(self.k_proj(x).view(t, self.kv_heads, self.head_dim), self.k_norm.weight, cos, sin, eps)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        return _reduced(self.reduce, self.o_proj(ctx.attend(layer, q, k, v).reshape(t, -1)))

    def attend_projected(self, qkv, cos, sin, layer: int, ctx: AttentionContext):
        """The layer from its fused QKV product ``qkv [T, (heads + 2 * kv_heads) * head_dim]`` on:
        Q/K norm and rotary embedding in one launch (query and key heads are adjacent), attention,
        and the output projection."""
        t = qkv.shape[0]
        heads = qkv.view(t, self.heads + 2 * self.kv_heads, self.head_dim)
        qk = qk_norm_rope(heads[:, : self.heads + self.kv_heads], self.q_norm.weight, cos, sin, self.q_norm.eps,
                          k_weight=self.k_norm.weight, q_heads=self.heads)
        q, k, v = qk[:, : self.heads], qk[:, self.heads :], heads[:, self.heads + self.kv_heads :]
        out = linear(ctx.attend(layer, q, k, v).reshape(t, -1), self.o_proj.weight, self.o_proj.bias)
        return _reduced(self.reduce, out)


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020, arXiv:2002.05202)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = activation(cfg.hidden_act)
        self.gate_up: nn.Parameter | None = None  # fused [gate; up] weight, see fuse_projections()
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # row-parallel down_proj, as Attention's

    def fuse_projections(self) -> None:
        """One matrix for the gate and up projections (their parameters become views of it).
        Idempotent, as :meth:`Attention.fuse_projections`."""
        if self.gate_up is not None:
            return
        fused = torch.cat([self.gate_proj.weight, self.up_proj.weight]).detach()
        n = self.gate_proj.out_features
        self.gate_proj.weight = nn.Parameter(fused[:n], requires_grad=False)
        self.up_proj.weight = nn.Parameter(fused[n:], requires_grad=False)
        self.gate_up = nn.Parameter(fused, requires_grad=False)

    def forward(self, x):
        if self.gate_up is not None:
            return self.down_from_gate_up(linear(x, self.gate_up))
        gate, up = self.gate_proj(x), self.up_proj(x)
        return _reduced(self.reduce, self.down_proj(silu_mul(gate, up) if self.act is F.silu else self.act(gate) * up))

    def down_from_gate_up(self, gate_up):
        """The down projection of ``act(gate) * up`` from ``gate_up = [gate | up]`` ``[T, 2I]``
        (the SwiGLU gate in the product's prologue where the GEMV takes it)."""
        if self.act is F.silu:
            return _reduced(self.reduce, silu_mul_linear(gate_up, self.down_proj.weight, self.down_proj.bias))
        gate, up = gate_up.chunk(2, dim=-1)
        return _reduced(self.reduce, linear(self.act(gate) * up, self.down_proj.weight, self.down_proj.bias))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, cos, sin, layer, ctx):
        """One layer with the residual add deferred into the next norm.

        Takes the previous layer's output ``x`` and residual stream ``residual`` (None at the first
        layer, where ``x`` is the stream) and returns the same pair; the hidden state is
        ``x + residual``. The additions happen in the same order as ``h + f(norm(h))``.
        """
        attn_norm, mlp_norm = self.input_layernorm, self.post_attention_layernorm
        if self.self_attn.qkv is not None and self.mlp.gate_up is not None:  # each norm in its product's prologue
            qkv, residual = add_rms_norm_linear(x, residual, attn_norm.weight, attn_norm.eps, self.self_attn.qkv)
            attn = self.self_attn.attend_projected(qkv, cos, sin, layer, ctx)
            gate_up, residual = add_rms_norm_linear(attn, residual, mlp_norm.weight, mlp_norm.eps, self.mlp.gate_up)
            return self.mlp.down_from_gate_up(gate_up), residual
        normed, residual = add_rms_norm(x, residual, attn_norm.weight, attn_norm.eps)
        attn = self.self_attn(normed, cos, sin, layer, ctx)
        normed, residual = add_rms_norm(attn, residual, mlp_norm.weight, mlp_norm.eps)
        return self.mlp(normed), residual


class TextDecoder(nn.Module):
    """Token embeddings, decoder layers and the final norm (no LM head)."""

    def fuse_projections(self) -> None:
        """Fuse each layer's Q/K/V and gate/up matrices (see :meth:`Attention.fuse_projections`)."""
        for layer in self.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = MRoPE(cfg.head_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        visual: VisualInjection | None = None,
    ) -> torch.Tensor:
        """Run the step's ``T`` new tokens.

        Args:
            input_ids: int64 ``[T]``.
            positions: int64 ``[3, T]`` logical M-RoPE positions.
            ctx: where K/V are stored and which earlier tokens each query sees.
            visual: features for the visual placeholder tokens among the ``T``.

        Returns:
            ``[T, hidden]`` final-normed hidden states, model dtype.
        """
        x = self.embed_tokens(input_ids)
        if visual is not None and visual.rows.numel():
            x = x.index_copy(0, visual.rows, visual.embeds.to(x.dtype))
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, i, ctx)
            if visual is not None and visual.rows.numel() and i < len(visual.deepstack):
                hidden = x + residual
                x, residual = hidden.index_add(0, visual.rows, visual.deepstack[i].to(x.dtype)), None
        return add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]


class LMHead(nn.Module):
    """Output projection to vocabulary logits; shares the embedding matrix when tied."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 logits ``[N, vocab]`` (rounded to the model dtype first, as
        the reference computes them)."""
        return linear(hidden, self.weight, out_dtype=torch.float32)
