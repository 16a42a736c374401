"""Draw scenes into uint8 RGB pixels with integer arithmetic only, so every device gives the same bytes.

:func:`pack_scenes` turns scenes into small integer tensors (one row per shape or letter);
:func:`render` paints a whole batch of them on any torch device. Inside tests are exact integer
comparisons on doubled coordinates (a pixel's centre is ``(2x + 1, 2y + 1)``), there is no
anti-aliasing and no floating point, so CPU and GPU agree bit for bit. :func:`render_reference` is
a plain NumPy painter of the same shapes, one image and one object at a time, that the tests hold
the batched renderer to.

Shapes, for centre ``(cx, cy)`` and half-extent ``r`` (``dx = 2x + 1 - 2cx``, ``dy = 2y + 1 - 2cy``):
circle ``dx² + dy² <= 4r²``; square ``|dx|, |dy| <= 2r``; diamond ``|dx| + |dy| <= 2r``; triangle
(apex up) ``0 <= dy + 2r <= 4r`` and ``2|dx| <= dy + 2r``. A letter paints font cell ``(row, col)``
as the ``scale`` x ``scale`` block at ``(x + col * scale, y + row * scale)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .font import GLYPH_COLS, GLYPH_ROWS, glyph_index, glyph_table
from .scenes import COLOURS, SHAPES, Scene

#: Item kinds in a packed row: 0 is an empty slot, shapes are 1 + their index in SHAPES, 5 a letter.
_KIND = {name: i + 1 for i, name in enumerate(SHAPES)}
_GLYPH = len(SHAPES) + 1
_FIELDS = 8  # kind, a, b, c, d, red, green, blue


@dataclass(frozen=True)
class PackedScenes:
    """Scenes as integer tensors.

    Attributes:
        items: int32 ``[N, K, 8]``, one row per painted item in paint order, zero rows for empty
            slots: ``(kind, cx, cy, r, 0, R, G, B)`` for a shape, ``(5, x, y, scale, glyph, R, G, B)``
            for a letter.
        background: int32 ``[N, 3]`` RGB.
        window: side in pixels of the square that holds any one item (the renderer's work area).
    """

    items: torch.Tensor
    background: torch.Tensor
    window: int

    def to(self, device, non_blocking: bool = False) -> PackedScenes:
        return PackedScenes(self.items.to(device, non_blocking=non_blocking),
                            self.background.to(device, non_blocking=non_blocking), self.window)


def pack_scenes(scenes: Sequence[Scene], slots: int | None = None) -> PackedScenes:
    """Pack scenes for :func:`render`.

    Args:
        scenes: the images to draw.
        slots: item slots per image (K); None for the most any scene needs.

    Raises:
        ValueError: a scene has more items than ``slots``.
    """
    rows = [_scene_rows(scene) for scene in scenes]
    k = max((len(r) for r in rows), default=0) if slots is None else slots
    items = np.zeros((len(scenes), max(k, 1), _FIELDS), dtype=np.int32)
    window = 1
    for n, scene_rows in enumerate(rows):
        if len(scene_rows) > k:
            raise ValueError(f"scene {n} has {len(scene_rows)} items, more than {k} slots")
        for j, row in enumerate(scene_rows):
            items[n, j] = row
            window = max(window, _extent(row))
    background = np.array([s.background for s in scenes], dtype=np.int32).reshape(len(scenes), 3)
    return PackedScenes(torch.from_numpy(items), torch.from_numpy(background), window)


def render(packed: PackedScenes, size: tuple[int, int]) -> torch.Tensor:
    """Paint packed scenes on ``packed.items.device``.

    Each item is evaluated on a ``window x window`` square at its top-left corner only, and
    written into the images by one scatter per slot (slot order is paint order).

    Args:
        packed: from :func:`pack_scenes` (possibly moved to another device).
        size: ``(height, width)`` of the images in pixels.

    Returns:
        uint8 ``[N, height, width, 3]`` RGB.
    """
    height, width = size
    items, device = packed.items, packed.items.device
    n, k, _ = items.shape
    s = packed.window
    out = torch.empty(n * height * width + 1, 3, dtype=torch.uint8, device=device)  # last row: discarded writes
    out[:-1] = packed.background.to(torch.uint8).repeat_interleave(height * width, dim=0)
    if n == 0:
        return out[:-1].view(0, height, width, 3)
    kind, a, b, c, d = (items[..., i, None, None] for i in range(5))  # each [N, K, 1, 1]
    is_glyph = kind == _GLYPH
    x0 = torch.where(is_glyph, a, a - c)  # window corner: a letter's top-left, a shape's box corner
    y0 = torch.where(is_glyph, b, b - c)
    wy = torch.arange(s, device=device, dtype=torch.int32).view(1, 1, s, 1)
    wx = torch.arange(s, device=device, dtype=torch.int32).view(1, 1, 1, s)
    x, y = x0 + wx, y0 + wy  # [N, K, S, S] pixel coordinates
    mask = _shape_mask(kind, x, y, a, b, c) | (is_glyph & _glyph_mask(x, y, a, b, c, d, device))
    mask &= (x >= 0) & (x < width) & (y >= 0) & (y < height)
    image = torch.arange(n, device=device, dtype=torch.int64).view(n, 1, 1, 1)
    flat = image * (height * width) + y.long() * width + x.long()
    flat = torch.where(mask, flat, torch.full_like(flat, n * height * width))
    colour = items[..., 5:8].to(torch.uint8)  # [N, K, 3]
    for j in range(k):
        rows = flat[:, j].reshape(-1)
        out.index_put_((rows,), colour[:, j, None, :].expand(n, s * s, 3).reshape(-1, 3))
    return out[:-1].view(n, height, width, 3)


def render_scenes(scenes: Sequence[Scene], size: tuple[int, int], device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`pack_scenes` then :func:`render` on ``device``: uint8 ``[N, height, width, 3]``."""
    return render(pack_scenes(scenes).to(device), size)


def to_pil(pixels: torch.Tensor) -> list:
    """uint8 ``[N, H, W, 3]`` -> a list of RGB ``PIL.Image``."""
    from PIL import Image

    return [Image.fromarray(np.ascontiguousarray(p)) for p in pixels.cpu().numpy()]


def render_reference(scene: Scene, size: tuple[int, int]) -> np.ndarray:
    """One scene painted object by object over the whole image in NumPy: uint8 ``[H, W, 3]``.

    Written apart from :func:`render` (full-image masks, letters as filled cell blocks) so the
    tests can hold the batched, windowed painter to it.
    """
    height, width = size
    img = np.empty((height, width, 3), dtype=np.uint8)
    img[:] = scene.background
    yy, xx = np.mgrid[0:height, 0:width]
    for shape in scene.shapes:
        dx, dy = 2 * xx + 1 - 2 * shape.cx, 2 * yy + 1 - 2 * shape.cy
        r2 = 2 * shape.r
        if shape.kind == "circle":
            m = dx * dx + dy * dy <= r2 * r2
        elif shape.kind == "square":
            m = (np.abs(dx) <= r2) & (np.abs(dy) <= r2)
        elif shape.kind == "diamond":
            m = np.abs(dx) + np.abs(dy) <= r2
        else:  # triangle
            depth = dy + r2
            m = (depth >= 0) & (depth <= 2 * r2) & (2 * np.abs(dx) <= depth)
        img[m] = COLOURS[shape.colour]
    if scene.word is not None:
        word, table = scene.word, glyph_table().numpy()
        for i, letter in enumerate(word.text):
            left = word.x + 6 * i * word.scale
            for row in range(GLYPH_ROWS):
                for col in range(GLYPH_COLS):
                    if table[glyph_index(letter), row, col]:
                        y, x = word.y + row * word.scale, left + col * word.scale
                        img[max(y, 0):y + word.scale, max(x, 0):x + word.scale] = word.ink
    return img


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _scene_rows(scene: Scene) -> list[tuple[int, ...]]:
    rows = [(_KIND[s.kind], s.cx, s.cy, s.r, 0, *COLOURS[s.colour]) for s in scene.shapes]
    if scene.word is not None:
        w = scene.word
        rows += [(_GLYPH, w.x + 6 * i * w.scale, w.y, w.scale, glyph_index(ch), *w.ink) for i, ch in enumerate(w.text)]
    return rows


def _extent(row: tuple[int, ...]) -> int:
    """Side of the square that holds one packed item."""
    return GLYPH_ROWS * row[3] if row[0] == _GLYPH else 2 * row[3]


def _shape_mask(kind, x, y, cx, cy, r) -> torch.Tensor:
    dx, dy, r2 = 2 * x + 1 - 2 * cx, 2 * y + 1 - 2 * cy, 2 * r
    depth = dy + r2
    return (((kind == _KIND["circle"]) & (dx * dx + dy * dy <= r2 * r2))
            | ((kind == _KIND["square"]) & (dx.abs() <= r2) & (dy.abs() <= r2))
            | ((kind == _KIND["diamond"]) & (dx.abs() + dy.abs() <= r2))
            | ((kind == _KIND["triangle"]) & (depth >= 0) & (depth <= 2 * r2) & (2 * dx.abs() <= depth)))


def _glyph_mask(x, y, x0, y0, scale, glyph, device) -> torch.Tensor:
    scale = scale.clamp(min=1)  # empty slots have scale 0; their kind already masks them out
    col = torch.div(x - x0, scale, rounding_mode="floor")
    row = torch.div(y - y0, scale, rounding_mode="floor")
    inside = (col >= 0) & (col < GLYPH_COLS) & (row >= 0) & (row < GLYPH_ROWS)
    cells = glyph_table(device).reshape(-1)
    index = (glyph.clamp(0, cells.numel() // (GLYPH_ROWS * GLYPH_COLS) - 1) * (GLYPH_ROWS * GLYPH_COLS)
             + row.clamp(0, GLYPH_ROWS - 1) * GLYPH_COLS + col.clamp(0, GLYPH_COLS - 1))
    return inside & cells[index.long()]
