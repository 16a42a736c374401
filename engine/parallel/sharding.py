"""Megatron-style sharding of the text decoder for one rank of ``world`` (Shoeybi et al.,
arXiv:1909.08053, section 3): Q/K/V heads and the gate/up columns are split across ranks
(column-parallel), ``o_proj`` and ``down_proj`` take the matching input slice (row-parallel) and
their partial outputs are summed by one all-reduce each. Embeddings, norms, the LM head and the
vision tower stay whole on every rank.

Apply it before :meth:`~engine.model.decoder.TextDecoder.fuse_projections`: the fused matrices are
then built from the shards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..errors import InvalidRequestError
from ..model.config import TextConfig
from ..model.qwen3_vl import Qwen3VL


def check_divisible(cfg: TextConfig, world: int) -> None:
    """Raises: InvalidRequestError: ``world`` does not divide the query heads, the KV heads or
    the MLP width (each rank must hold whole heads and an equal slice)."""
    for name, n in (("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads", cfg.num_key_value_heads),
                    ("intermediate_size", cfg.intermediate_size)):
        if n % world:
            raise InvalidRequestError(f"tensor_parallel_size={world} must divide the model's {name} ({n})")


def _rows(linear: nn.Linear, rank: int, world: int) -> None:
    """Keep output rows ``rank``-th of ``world`` equal slices (column parallel)."""
    n = linear.out_features // world
    linear.weight = nn.Parameter(linear.weight.detach()[rank * n : (rank + 1) * n].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rank * n : (rank + 1) * n].clone(), requires_grad=False)
    linear.out_features = n


def _columns(linear: nn.Linear, rank: int, world: int) -> None:
    """Keep input columns ``rank``-th of ``world`` equal slices (row parallel); the bias is added
    by rank 0 only, so the all-reduced sum holds it once."""
    n = linear.in_features // world
    linear.weight = nn.Parameter(linear.weight.detach()[:, rank * n : (rank + 1) * n].clone(), requires_grad=False)
    if linear.bias is not None and rank:
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    linear.in_features = n


def shard_decoder(model: Qwen3VL, rank: int, world: int, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Shard ``model.language_model`` in place for ``rank`` of ``world``.

    Query heads ``rank * H/world ..`` and KV heads ``rank * Hkv/world ..`` stay on this rank (a
    query head's KV head stays with it: GQA groups are contiguous), so the rank's KV pool holds
    ``Hkv / world`` heads; ``reduce(partial) -> sum over ranks`` is installed after each row-parallel
    projection.

    Raises:
        InvalidRequestError: ``world`` does not divide the heads or the MLP width.
        RuntimeError: the projections are already fused.
    """
    cfg = model.config.text
    check_divisible(cfg, world)
    for layer in model.language_model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv is not None or mlp.gate_up is not None:
            raise RuntimeError("shard the decoder before fusing its projections")
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            _rows(proj, rank, world)
        _columns(attn.o_proj, rank, world)
        attn.heads, attn.kv_heads = cfg.num_attention_heads // world, cfg.num_key_value_heads // world
        for proj in (mlp.gate_proj, mlp.up_proj):
            _rows(proj, rank, world)
        _columns(mlp.down_proj, rank, world)
        attn.reduce = mlp.reduce = reduce
    if model.device.type == "cuda":
        torch.cuda.empty_cache()  # the whole matrices' memory, so the KV budget measured next counts it
