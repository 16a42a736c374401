"""The Qwen3-VL image processor's patches, built from uint8 pixels with torch on any device.

For an image the processor does not resize (see :func:`check_unresized`), the Qwen2-VL/Qwen3-VL
image processor of transformers computes, per image of ``H x W`` pixels:

1. ``(x - mean / rescale) / (std / rescale)`` in float32 per channel (rescale and normalise fused,
   ``x`` the uint8 value), channels first;
2. the ``(H / P) x (W / P)`` grid of ``P x P`` patches (``P = patch_size``) taken in *merge-block*
   order: blocks of ``m x m`` patches (``m = merge_size``) in raster order of blocks, raster order
   inside a block, so that each merged visual token's ``m²`` patches are adjacent rows;
3. each patch flattened as ``[channel, temporal, row, col]`` with the frame repeated
   ``temporal_patch_size`` times (an image is a clip of identical frames);
4. ``image_grid_thw = (1, H / P, W / P)``.

:func:`patchify` does the same; the tests hold it to the processor bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def check_unresized(height: int, width: int, config: Mapping[str, Any]) -> None:
    """Check that the processor with ``config`` (a ``preprocessor_config.json`` dict) leaves an image
    of ``height x width`` pixels as it is: both sides multiples of ``patch_size * merge_size`` and
    the area within ``size.shortest_edge .. size.longest_edge`` (the processor's pixel budget).

    Raises:
        ValueError: the processor would resize such an image.
    """
    factor = config["patch_size"] * config["merge_size"]
    lo, hi = config["size"]["shortest_edge"], config["size"]["longest_edge"]
    if height % factor or width % factor or not lo <= height * width <= hi:
        raise ValueError(f"a {height}x{width} image would be resized by the processor: sides must be multiples "
                         f"of {factor} and the area within {lo}..{hi} pixels")


def patchify(pixels: torch.Tensor, config: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The processor's ``pixel_values`` and ``image_grid_thw`` for a batch of same-size images.

    Args:
        pixels: uint8 ``[N, H, W, 3]`` RGB, on any device.
        config: the checkpoint's ``preprocessor_config.json`` dict (``patch_size``, ``merge_size``,
            ``temporal_patch_size``, ``image_mean``, ``image_std``, ``rescale_factor``; ``do_rescale``
            and ``do_normalize`` must be true).

    Returns:
        ``(pixel_values, grid_thw)``: float32 ``[N * gh * gw, 3 * T * P * P]`` on the input's device,
        images one after another, and int64 ``[N, 3]`` rows ``(1, gh, gw)`` (patches) on the CPU.

    Raises:
        ValueError: a side is not a multiple of ``patch_size * merge_size``, or the config does not
            rescale and normalise.
    """
    if not (config.get("do_rescale", True) and config.get("do_normalize", True)):
        raise ValueError("patchify reproduces a processor that rescales and normalises")
    n, height, width, channels = pixels.shape
    p, m, t = config["patch_size"], config["merge_size"], config["temporal_patch_size"]
    if height % (p * m) or width % (p * m):
        raise ValueError(f"image sides {height}x{width} must be multiples of {p * m}")
    # the processor fuses the two steps: mean and std scaled by 1 / rescale_factor, in float32
    scale = 1.0 / config["rescale_factor"]
    mean = (torch.tensor(config["image_mean"], dtype=torch.float32) * scale).to(pixels.device)
    std = (torch.tensor(config["image_std"], dtype=torch.float32) * scale).to(pixels.device)
    x = (pixels.float() - mean) / std  # [N, H, W, C]
    gh, gw = height // p, width // p
    x = x.view(n, gh // m, m, p, gw // m, m, p, channels)
    # -> [N, block row, block col, row in block, col in block, channel, pixel row, pixel col]
    x = x.permute(0, 1, 4, 2, 5, 7, 3, 6)
    x = x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, t, -1, -1)
    values = x.reshape(n * gh * gw, channels * t * p * p)
    grid = torch.tensor([[1, gh, gw]] * n, dtype=torch.long).reshape(n, 3)
    return values, grid
