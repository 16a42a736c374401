"""Rotary position embeddings: Qwen3-VL's 3-D M-RoPE for the decoder and 2-D RoPE for the vision tower.

M-RoPE (Qwen2-VL paper, arXiv:2409.12191, section 2.1; Qwen3-VL model card) gives every token three
position ids: temporal, height, width. Text tokens carry the same id on all three axes. The visual
tokens of an image (or of one video frame) laid out on a ``h × w`` merged grid get
``(start, start + row, start + col)``; the text after it continues from ``start + max(h, w)``. Qwen3-VL
assigns rotary frequencies to the three axes *interleaved* (frequency ``i`` goes to height when
``i % 3 == 1`` and ``i < 3 * mrope_section[1]``, to width when ``i % 3 == 2`` and
``i < 3 * mrope_section[2]``, else to time) instead of in contiguous blocks.

Logical positions are computed once per prompt here and kept apart from where K/V is stored, so
that a later compaction of the KV cache can move storage without touching positions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisualSpan:
    """One run of visual placeholder tokens: an image, or one frame of a video.

    ``start`` is the index of its first token in the prompt; ``grid_h`` × ``grid_w`` is the merged
    token grid (patch grid divided by the spatial merge size), so the span has ``grid_h * grid_w``
    tokens. ``kind`` is ``"image"`` or ``"video"``; ``item`` is the image / video index in the
    prompt and ``frame`` the frame index within a video (0 for images).
    """

    start: int
    grid_h: int
    grid_w: int
    kind: str
    item: int
    frame: int = 0

    @property
    def length(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def end(self) -> int:
        return self.start + self.length


def find_visual_spans(
    input_ids: list[int],
    image_grids: list[tuple[int, int, int]],
    video_grids: list[tuple[int, int, int]],
    *,
    image_token_id: int,
    video_token_id: int,
    merge_size: int,
) -> list[VisualSpan]:
    """Match each run of image / video placeholder tokens to its grid.

    Args:
        input_ids: the prompt token ids, visual placeholders already expanded by the processor.
        image_grids: ``image_grid_thw`` rows ``(t, h, w)`` in patches, one per image, in order.
        video_grids: ``video_grid_thw`` rows, one per video; a video of ``t`` temporal patches
            appears in the prompt as ``t`` runs (one per frame pair, separated by timestamps).
        merge_size: the vision spatial merge size (2 for Qwen3-VL).

    Returns:
        The spans in prompt order.

    Raises:
        ValueError: the placeholder runs do not match the grids.
    """
    expected = {
        image_token_id: [(h // merge_size, w // merge_size, i, 0) for i, (t, h, w) in enumerate(image_grids)],
        video_token_id: [
            (h // merge_size, w // merge_size, i, f) for i, (t, h, w) in enumerate(video_grids) for f in range(t)
        ],
    }
    kinds = {image_token_id: "image", video_token_id: "video"}
    cursor = {image_token_id: 0, video_token_id: 0}
    spans: list[VisualSpan] = []
    i, n = 0, len(input_ids)
    while i < n:
        tok = input_ids[i]
        if tok not in kinds:
            i += 1
            continue
        grids = expected[tok]
        if cursor[tok] >= len(grids):
            raise ValueError(f"more {kinds[tok]} placeholder runs than {kinds[tok]} grids")
        gh, gw, item, frame = grids[cursor[tok]]
        cursor[tok] += 1
        length = gh * gw
        if input_ids[i : i + length] != [tok] * length or (i + length < n and input_ids[i + length] == tok):
            raise ValueError(f"{kinds[tok]} {item} expects {length} placeholder tokens at position {i}")
        spans.append(VisualSpan(i, gh, gw, kinds[tok], item, frame))
        i += length
    for tok, grids in expected.items():
        if cursor[tok] != len(grids):
            raise ValueError(f"{len(grids)} {kinds[tok]} grids but {cursor[tok]} placeholder runs")
    return spans


@functools.lru_cache(maxsize=64)
def _grid_offsets(grid_h: int, grid_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each merged patch of a ``grid_h x grid_w`` grid in raster order, int64
    ``[grid_h * grid_w]`` each (cached: photos of one size repeat; read, never written)."""
    return torch.arange(grid_h).repeat_interleave(grid_w), torch.arange(grid_w).repeat(grid_h)


def mrope_positions(num_tokens: int, spans: list[VisualSpan]) -> tuple[torch.Tensor, int]:
    """3-D M-RoPE position ids of a prompt and its rope delta.

    Args:
        num_tokens: prompt length in tokens.
        spans: its visual spans (from :func:`find_visual_spans`).

    Returns:
        ``(positions, delta)``: ``positions`` is int64 ``[3, num_tokens]`` (temporal, height, width);
        ``delta = max(positions) + 1 - num_tokens``, so generated token ``j`` (0-based index in the
        whole sequence) has position ``j + delta`` on all three axes.
    """
    pos = torch.empty(3, num_tokens, dtype=torch.long)
    next_pos = 0
    cursor = 0
    for span in spans:
        text_len = span.start - cursor
        pos[:, cursor : span.start] = torch.arange(next_pos, next_pos + text_len)
        next_pos += text_len
        rows, cols = _grid_offsets(span.grid_h, span.grid_w)
        pos[0, span.start : span.end] = next_pos
        pos[1, span.start : span.end] = next_pos + rows
        pos[2, span.start : span.end] = next_pos + cols
        next_pos += max(span.grid_h, span.grid_w)
        cursor = span.end
    pos[:, cursor:] = torch.arange(next_pos, next_pos + num_tokens - cursor)
    delta = (int(pos.max()) + 1 - num_tokens) if num_tokens else 0
    return pos, delta


def mrope_axis_of_frequency(half_dim: int, section: tuple[int, int, int], interleaved: bool) -> torch.Tensor:
    """Which axis (0 = time, 1 = height, 2 = width) drives each of the ``half_dim`` frequencies."""
    idx = torch.arange(half_dim, device="cpu")
    axis = torch.zeros(half_dim, dtype=torch.long, device="cpu")
    if interleaved:
        axis[(idx % 3 == 1) & (idx < 3 * section[1])] = 1
        axis[(idx % 3 == 2) & (idx < 3 * section[2])] = 2
    else:
        axis[section[0] : section[0] + section[1]] = 1
        axis[section[0] + section[1] :] = 2
    return axis


class MRoPE:
    """Cos/sin tables of the decoder's M-RoPE.

    ``inv_freq[i] = theta ** (-2i / head_dim)`` (RoFormer, arXiv:2104.09864); each frequency takes its
    angle from the position on the axis :func:`mrope_axis_of_frequency` assigns.
    """

    def __init__(self, head_dim: int, theta: float, section: tuple[int, int, int], interleaved: bool):
        half = head_dim // 2
        steps = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu")
        self.inv_freq = 1.0 / (theta ** (steps / head_dim))
        self.axis = mrope_axis_of_frequency(half, section, interleaved)
        self._device_tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` int64 ``[3, T]`` -> ``(cos, sin)``, each ``[T, head_dim]`` in ``dtype``."""
        inv_freq, axis = self._tables(positions.device)
        chosen = positions.float()[axis]  # [half, T]: the position each frequency rotates by
        angles = (chosen * inv_freq[:, None]).T  # [T, half], float32
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # kept on the device so a decode step copies nothing from the host (CUDA-graph safe)
        if self._device_tables is None or self._device_tables[0].device != device:
            self._device_tables = (self.inv_freq.to(device), self.axis.to(device))
        return self._device_tables


def vision_rope_cos_sin(
    grids: list[tuple[int, int, int]], merge_size: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D RoPE tables for the vision tower, float32 ``[num_patches, head_dim]`` each.

    Patches come in the processor's order: merge blocks of ``merge × merge`` patches in raster order
    of blocks, raster order inside a block, repeated for each temporal patch. The first half of the
    rotary frequencies (``head_dim / 4`` of them, theta ** (-4i / head_dim)) rotate by the patch row,
    the second half by its column.
    """
    quarter = head_dim // 4
    inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, dtype=torch.float32, device=device) * 2 / (head_dim // 2)))
    rows, cols = [], []
    for t, h, w in grids:
        r = torch.arange(h, device=device).view(h // merge_size, merge_size, 1, 1)
        c = torch.arange(w, device=device).view(1, 1, w // merge_size, merge_size)
        r = r.expand(h // merge_size, merge_size, w // merge_size, merge_size).permute(0, 2, 1, 3).flatten()
        c = c.expand(h // merge_size, merge_size, w // merge_size, merge_size).permute(0, 2, 1, 3).flatten()
        rows.append(r.repeat(t))
        cols.append(c.repeat(t))
    row = torch.cat(rows).float()[:, None] * inv_freq
    col = torch.cat(cols).float()[:, None] * inv_freq
    angles = torch.cat([row, col], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()
