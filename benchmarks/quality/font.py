"""A 5x7 bitmap font of the capital letters, defined here so that rendered words need no system font.

Each glyph is 7 rows of 5 cells (``#`` ink, ``.`` paper), drawn for this project. Words are drawn
by :mod:`benchmarks.quality.render` with every cell an integer ``scale`` x ``scale`` block of pixels,
so a word's pixels are the same on every machine and device.
"""

from __future__ import annotations

import torch

GLYPH_ROWS = 7
GLYPH_COLS = 5

_GLYPHS: dict[str, tuple[str, ...]] = {
    "A": (".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"),
    "B": ("####.", "#...#", "#...#", "####.", "#...#", "#...#", "####."),
    "C": (".###.", "#...#", "#....", "#....", "#....", "#...#", ".###."),
    "D": ("####.", "#...#", "#...#", "#...#", "#...#", "#...#", "####."),
    "E": ("#####", "#....", "#....", "####.", "#....", "#....", "#####"),
    "F": ("#####", "#....", "#....", "####.", "#....", "#....", "#...."),
    "G": (".###.", "#...#", "#....", "#.###", "#...#", "#...#", ".####"),
    "H": ("#...#", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"),
    "I": (".###.", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."),
    "J": ("..###", "...#.", "...#.", "...#.", "...#.", "#..#.", ".##.."),
    "K": ("#...#", "#..#.", "#.#..", "##...", "#.#..", "#..#.", "#...#"),
    "L": ("#....", "#....", "#....", "#....", "#....", "#....", "#####"),
    "M": ("#...#", "##.##", "#.#.#", "#.#.#", "#...#", "#...#", "#...#"),
    "N": ("#...#", "##..#", "#.#.#", "#..##", "#...#", "#...#", "#...#"),
    "O": (".###.", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."),
    "P": ("####.", "#...#", "#...#", "####.", "#....", "#....", "#...."),
    "Q": (".###.", "#...#", "#...#", "#...#", "#.#.#", "#..#.", ".##.#"),
    "R": ("####.", "#...#", "#...#", "####.", "#.#..", "#..#.", "#...#"),
    "S": (".####", "#....", "#....", ".###.", "....#", "....#", "####."),
    "T": ("#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."),
    "U": ("#...#", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."),
    "V": ("#...#", "#...#", "#...#", "#...#", "#...#", ".#.#.", "..#.."),
    "W": ("#...#", "#...#", "#...#", "#.#.#", "#.#.#", "#.#.#", ".#.#."),
    "X": ("#...#", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "#...#"),
    "Y": ("#...#", "#...#", ".#.#.", "..#..", "..#..", "..#..", "..#.."),
    "Z": ("#####", "....#", "...#.", "..#..", ".#...", "#....", "#####"),
}

#: The letters the font draws, in glyph-index order.
LETTERS = "".join(sorted(_GLYPHS))


def glyph_index(letter: str) -> int:
    """Index of ``letter`` (a capital A-Z) in :func:`glyph_table`.

    Raises:
        KeyError: the font has no such glyph.
    """
    if letter not in _GLYPHS:
        raise KeyError(f"the bitmap font has no glyph for {letter!r}; it draws {LETTERS}")
    return LETTERS.index(letter)


def glyph_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """All glyphs as a bool tensor ``[26, 7, 5]`` (letter, row, column), True where the cell is ink."""
    rows = [[[cell == "#" for cell in row] for row in _GLYPHS[letter]] for letter in LETTERS]
    return torch.tensor(rows, dtype=torch.bool, device=device)
