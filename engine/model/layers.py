"""Small building blocks shared by the vision tower and the decoder."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ops.fused import add_rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019, arXiv:1910.07467), computed in float32.

    The normalised value is cast back to the input dtype before the weight multiplies it, as
    Qwen3's reference does, so bfloat16 results match it bit for bit.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rms_norm(x, None, self.weight, self.eps)[0]


def activation(name: str):
    """The activation function a config names (``silu``, ``gelu``, ``gelu_pytorch_tanh``).

    Raises:
        ValueError: an unknown name.
    """
    table = {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    }
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}") from None
