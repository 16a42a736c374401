"""Batches of samples for training and evaluation: small integer tensors built on the CPU, pixels and
patches made on the training device.

A :class:`Batch` carries the packed scenes (a few integers per shape or letter, see
:mod:`.render`), the right-padded token ids and M-RoPE positions, and the rows whose logits are
trained. :func:`device_pixels` renders and patchifies on the device, so the CPU's share of a sample
is drawing its layout (~60 µs) and gluing cached token pieces; :class:`TrainStream` does that in
DataLoader workers, following the curriculum as training progresses.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from engine.model.tiny import ENDOFTEXT_ID

from .patches import patchify
from .render import PackedScenes, pack_scenes, render
from .scenes import COLOURS, SHAPES, TRAINING_TYPES, Sample, curriculum_stage, train_sample
from .tokens import PromptIds, PromptTokens


@dataclass
class Batch:
    """Samples of one image size, padded to one length.

    Attributes:
        scenes: every image of the batch, sample by sample, image by image.
        input_ids: int64 ``[B, L]``, right-padded with ``<|endoftext|>``.
        positions: int64 ``[3, B, L]`` M-RoPE positions (0 on padding).
        lengths: int64 ``[B]`` real tokens per row.
        target_rows: int64 ``[M]`` flat indices ``b * L + t`` of the positions whose next token is
            trained (empty for evaluation batches).
        target_ids: int64 ``[M]`` those next tokens (answer tokens, then ``<|im_end|>``).
        first_rows: bool ``[M]``: the target is the answer's first token.
        target_types: int64 ``[M]``: index of the sample's type in :data:`TRAINING_TYPES`.
        size: ``(height, width)`` of every image.
        stage: the curriculum stage the samples were drawn from (``"eval"`` for held-out batches).
    """

    scenes: PackedScenes
    input_ids: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor
    target_rows: torch.Tensor
    target_ids: torch.Tensor
    first_rows: torch.Tensor
    target_types: torch.Tensor
    size: tuple[int, int]
    stage: str = "eval"

    def to(self, device, non_blocking: bool = False) -> Batch:
        """The batch with every tensor on ``device``."""
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                 for f in fields(self) if isinstance(getattr(self, f.name), (torch.Tensor, PackedScenes))}
        return replace(self, **moved)

    def pin_memory(self) -> Batch:
        """The batch in pinned host memory (DataLoader's ``pin_memory=True`` calls this)."""
        packed = PackedScenes(self.scenes.items.pin_memory(), self.scenes.background.pin_memory(), self.scenes.window)
        pinned = {f.name: getattr(self, f.name).pin_memory() for f in fields(self)
                  if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, scenes=packed, **pinned)

    @property
    def n_images(self) -> int:
        return self.scenes.items.shape[0]


def build_batch(samples: Sequence[Sample], tokens: PromptTokens, *, with_targets: bool = True,
                prompts: Sequence[PromptIds] | None = None, extra: Sequence[Sequence[int]] | None = None,
                stage: str = "eval") -> Batch:
    """Pack samples (all of one image size) into a :class:`Batch`.

    Args:
        samples: the samples.
        tokens: the prompt-piece cache.
        with_targets: append each answer and ``<|im_end|>`` and train on them; without, the rows
            end with the generation prompt (plus ``extra``).
        prompts: the samples' prompts if already built (else built here).
        extra: tokens generated so far per sample, appended after the prompt (greedy decoding).
        stage: recorded in the batch.

    Raises:
        ValueError: samples of different image sizes, or no samples.
    """
    if not samples:
        raise ValueError("a batch needs at least one sample")
    size = samples[0].size
    if any(s.size != size for s in samples):
        raise ValueError("all samples of a batch must have one image size")
    prompts = prompts or [tokens.prompt(len(s.scenes), s.question, size) for s in samples]
    rows, targets = [], []
    for i, (sample, prompt) in enumerate(zip(samples, prompts, strict=True)):
        tail = list(extra[i]) if extra is not None else []
        target = tokens.target(sample.answer) if with_targets else []
        rows.append(prompt.ids + tail + target)
        targets.append((len(prompt.ids) + len(tail), target, TRAINING_TYPES.index(sample.qtype)))
    b, length = len(rows), max(len(r) for r in rows)
    input_ids = torch.full((b, length), ENDOFTEXT_ID, dtype=torch.long)
    positions = torch.zeros(3, b, length, dtype=torch.long)
    target_rows, target_ids, first, types = [], [], [], []
    for i, (row, prompt, (start, target, qtype)) in enumerate(zip(rows, prompts, targets, strict=True)):
        input_ids[i, :len(row)] = torch.tensor(row)
        positions[:, i, :len(row)] = prompt.positions(len(row) - len(prompt.ids))
        for j, tok in enumerate(target):
            target_rows.append(i * length + start - 1 + j)  # logits at t predict token t + 1
            target_ids.append(tok)
            first.append(j == 0)
            types.append(qtype)
    return Batch(
        scenes=pack_scenes([scene for s in samples for scene in s.scenes]),
        input_ids=input_ids,
        positions=positions,
        lengths=torch.tensor([len(r) for r in rows], dtype=torch.long),
        target_rows=torch.tensor(target_rows, dtype=torch.long),
        target_ids=torch.tensor(target_ids, dtype=torch.long),
        first_rows=torch.tensor(first, dtype=torch.bool),
        target_types=torch.tensor(types, dtype=torch.long),
        size=size,
        stage=stage,
    )


def device_pixels(batch: Batch, processor_config: Mapping[str, Any]) -> tuple[torch.Tensor, tuple[int, int]]:
    """Render the batch's images where its tensors are and cut them into processor patches.

    Returns:
        ``(pixel_values, (patch rows, patch cols))``: float32 ``[N * rows * cols, 3 * T * P * P]``.
    """
    values, grid = patchify(render(batch.scenes, batch.size), processor_config)
    return values, (int(grid[0, 1]), int(grid[0, 2])) if len(grid) else (0, 0)


#: Classes of the auxiliary per-token labels (:func:`cell_labels`): no shape + the kinds in
#: :data:`SHAPES` order; no shape + the colours in :data:`COLOURS` order; no word / word.
CELL_CLASSES = (1 + len(SHAPES), 1 + len(COLOURS), 2)

#: Pixels of an object a cell must hold for the object to label it (a sliver of a neighbour's
#: edge does not count).
CELL_MIN_PIXELS = 8

_COLOUR_RGB = torch.tensor(list(COLOURS.values()), dtype=torch.int32)  # [colours, 3]


def cell_labels(packed: PackedScenes, size: tuple[int, int], cell: int = 32,
                min_pixels: int = CELL_MIN_PIXELS) -> torch.Tensor:
    """Per merged visual token, what the image shows in its ``cell x cell`` pixel square: the
    auxiliary targets of the trainer's ``--aux-weight`` loss.

    A merged token covers ``patch_size * merge_size`` = 32 x 32 pixels; Qwen3-VL's processor takes
    patches in merge-block order and the merger joins each block's ``merge²`` consecutive patches,
    so an image's merged tokens are its cells in raster order (row by row, left to right). The
    label of a cell comes from the scene objects as painted (:func:`.render.render` of an id per
    paint slot, so later objects cover earlier ones and clipping at the border is exact): the shape
    with the most pixels in the cell, if it has at least ``min_pixels`` there, gives the kind and
    colour; any letter with ``min_pixels`` pixels in the cell marks it as holding a word.

    Made where the batch's scenes are (the training device, next to :func:`device_pixels`): on
    the GPU it is one more render of the batch, while on a CPU core it takes seconds for a batch
    of 256 samples (the windowed painter is built for the GPU), too slow for the DataLoader workers.

    Args:
        packed: the scenes (:func:`.render.pack_scenes`), on any device.
        size: ``(height, width)`` in pixels, multiples of ``cell``.

    Returns:
        int64 ``[N, (height / cell) * (width / cell), 3]`` on ``packed``'s device: ``(kind, colour,
        word)`` with kind 0 = no shape else 1 + index in :data:`SHAPES`, colour 0 = no shape else
        1 + index in :data:`COLOURS`, word 0/1 (class counts :data:`CELL_CLASSES`).

    Raises:
        ValueError: a side is not a multiple of ``cell``, or more than 254 paint slots.
    """
    height, width = size
    if height % cell or width % cell:
        raise ValueError(f"image sides {height}x{width} must be multiples of the cell size {cell}")
    items = packed.items
    n, k, _ = items.shape
    if k > 254:
        raise ValueError("cell_labels paints slot ids as uint8 and handles at most 254 slots")
    device = items.device
    ids = items.clone()
    ids[..., 5] = torch.arange(1, k + 1, dtype=items.dtype, device=device)  # slot id in the red channel
    ids[..., 6:8] = 0
    slot_map = render(PackedScenes(ids, torch.zeros_like(packed.background), packed.window), size)[..., 0].long()
    rows, cols = height // cell, width // cell
    cells = rows * cols
    per_cell = slot_map.view(n, rows, cell, cols, cell).permute(0, 1, 3, 2, 4).reshape(n * cells, cell * cell)
    flat = (torch.arange(n * cells, device=device)[:, None] * (k + 1) + per_cell).reshape(-1)
    counts = torch.bincount(flat, minlength=n * cells * (k + 1)).view(n, cells, k + 1)[..., 1:]  # [N, C, K]
    kind = items[..., 0].long()  # [N, K]: 0 empty, 1..4 shapes, 5 letter
    is_shape = (kind >= 1) & (kind <= len(SHAPES))
    shape_counts = torch.where(is_shape[:, None, :], counts, torch.zeros_like(counts))
    best_count, best = shape_counts.max(-1)  # [N, C]
    has_shape = best_count >= min_pixels
    match = (items[..., None, 5:8] == _COLOUR_RGB.to(device)).all(-1)  # [N, K, colours]
    colour = torch.where(match.any(-1), match.int().argmax(-1) + 1, torch.zeros_like(kind))  # [N, K]
    kind_label = torch.where(has_shape, kind.gather(1, best), torch.zeros_like(best))
    colour_label = torch.where(has_shape, colour.gather(1, best), torch.zeros_like(best))
    glyph_pixels = torch.where((kind == len(SHAPES) + 1)[:, None, :], counts, torch.zeros_like(counts)).sum(-1)
    word = (glyph_pixels >= min_pixels).long()
    return torch.stack([kind_label, colour_label, word], -1)


class TrainStream(torch.utils.data.IterableDataset):
    """Endless training batches; in DataLoader workers, each worker makes every ``num_workers``-th batch.

    Batch ``k`` holds samples ``train:<seed>:<k>:<i>`` drawn from the curriculum stage at the
    training progress read when the batch is made (a shared value the trainer updates).

    Args:
        tokenizer_file: the checkpoint's ``tokenizer.json`` (each worker loads its own tokenizer).
        batch_size: samples per batch.
        seed: the run's seed (part of every sample key).
        progress: a ``multiprocessing.Value('d')`` holding the training progress in [0, 1].
        curriculum: a key of :data:`benchmarks.quality.scenes.CURRICULA`.
    """

    def __init__(self, tokenizer_file: str | os.PathLike[str], batch_size: int, seed: int, progress=None,
                 curriculum: str = "v1"):
        super().__init__()
        self.tokenizer_file, self.batch_size, self.seed = str(tokenizer_file), batch_size, seed
        self.curriculum = curriculum
        self.progress = progress if progress is not None else multiprocessing.Value("d", 0.0)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        tokens = PromptTokens(self.tokenizer_file)
        for k in itertools.count(worker, workers):
            stage, dist = curriculum_stage(self.progress.value, self.curriculum)
            samples = [train_sample(f"{self.seed}:{k}:{i}", dist) for i in range(self.batch_size)]
            yield build_batch(samples, tokens, stage=stage)
