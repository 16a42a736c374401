"""Train the probe Qwen3-VL from scratch on the synthetic suite, evaluate it, write a checkpoint.

Data never waits on the CPU: DataLoader workers draw layouts and glue cached token pieces (a few
integers per object); the training device renders the pixels and cuts the processor's patches
(:func:`benchmarks.quality.data.device_pixels`). Inputs are dense (no visual token is dropped),
the loss covers the answer tokens and the closing ``<|im_end|>`` only, and a curriculum
(``--curriculum``, see :data:`benchmarks.quality.scenes.CURRICULA`) starts with one image and few shapes. Training
stops at ``--steps`` or when ``--minutes`` are spent, whichever comes first; learning rate and
curriculum follow the progress towards that end. Checkpoints are written every
``--ckpt-minutes`` and at the end, in bfloat16 (see :mod:`benchmarks.quality.checkpoint`); the
held-out split is then answered greedily with those bfloat16 weights and scored by exact match
per question type.

Usage (on the GPU machine, with a skeleton built here by ``python -m benchmarks.quality.checkpoint
skeleton DIR``)::

    python -m benchmarks.quality.train --skeleton DIR --out CKPT --minutes 8 --metrics metrics.json

``--init DIR`` continues from a checkpoint (the committed probe) instead of a fresh model, e.g. a
short fine-tune with ``--curriculum binding`` (docs/QUALITY.md gives the command).

``--aux-weight W`` adds an auxiliary loss on the visual tokens the decoder receives: a linear
head (:class:`AuxHeads`, training only, never saved) predicts for each merged token what its
32 x 32-pixel cell shows (the kind and colour of its main shape, whether a word is there; see
:func:`benchmarks.quality.data.cell_labels`), so the vision tower is told shape kinds directly.
``--aux-place`` adds a second head that predicts each token's cell row and column (the
position questions compare two shapes' columns, which the committed probe's visual tokens do
not carry); ``--curriculum place`` is the continuation of the committed probe that goes with it.
``--vision-width`` and the other size options (:func:`benchmarks.quality.checkpoint.add_size_arguments`)
change the model's size; the run refuses a model whose committed folder would exceed
:data:`benchmarks.quality.checkpoint.PROBE_BUDGET_BYTES`, and the saved ``config.json`` is the
run's own (a skeleton of the default size may be passed).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import tiny
from engine.model.config import ModelConfig

from . import checkpoint as ckpt
from .data import CELL_CLASSES, Batch, TrainStream, build_batch, cell_labels, device_pixels
from .model import ProbeVL
from .scenes import CURRICULA, IMAGE_SIZE, QUESTION_TYPES, TRAINING_TYPES, Sample, accuracy_by_type, heldout
from .tokens import PromptTokens

#: Answers are one word or digit: the answer token, <|im_end|>, and a little slack.
MAX_NEW_TOKENS = 4


@dataclass(frozen=True)
class Schedule:
    """Learning rate over training: linear warm-up over ``warmup`` steps, then cosine decay from
    ``peak`` to ``peak * floor`` as progress goes from 0 to 1 (Loshchilov & Hutter, arXiv:1608.03983)."""

    peak: float
    warmup: int = 200
    floor: float = 0.05

    def lr(self, step: int, progress: float) -> float:
        warm = min(1.0, (step + 1) / self.warmup)
        cosine = self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
        return self.peak * warm * cosine


def build_model(spec, device, seed: int = 0) -> ProbeVL:
    """A freshly initialised :class:`ProbeVL` for a resolved preset, float32 on ``device``."""
    model = ProbeVL(ModelConfig.from_dict(tiny.config_dict(spec)))
    model.init_weights(seed)
    return model.to(device)


def load_init(model: ProbeVL, folder: str | pathlib.Path) -> None:
    """Continue from a checkpoint: load ``folder``'s weights (e.g. the committed probe,
    ``benchmarks/quality/probe``, bfloat16 as stored) into ``model`` as float32.

    Raises:
        RuntimeError: a missing, unexpected or differently shaped tensor (the folder is not a
            checkpoint of this model's shape; strict loading).
    """
    model.load_state_dict({k: v.float() for k, v in ckpt.load_weights(folder).items()}, strict=True)


def make_optimizer(model: ProbeVL, lr: float, weight_decay: float = 0.05) -> torch.optim.Optimizer:
    """AdamW (betas 0.9/0.95); weight decay on the matrices only (not embeddings, norms, biases)."""
    decay, rest = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in name else rest).append(p)
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), fused=fused)


class AuxLoss(NamedTuple):
    """What :meth:`AuxHeads.loss` computes.

    Attributes:
        loss: float32 scalar, the auxiliary loss (levels averaged).
        kind_hits, colour_hits: float32 ``[2]`` ``(correct, cells)`` of the merger head on the
            cells holding a shape.
        place: float32 scalar, the place part of ``loss`` (row and column cross-entropies, levels
            averaged; zero without a grid).
        column_hits: float32 ``[2]`` ``(correct, cells)`` of the merger head's column on the cells
            holding a shape (None without a grid).
    """

    loss: torch.Tensor
    kind_hits: torch.Tensor
    colour_hits: torch.Tensor
    place: torch.Tensor
    column_hits: torch.Tensor | None = None


class AuxHeads(nn.Module):
    """Training-only linear heads on the visual tokens: per merged token, logits of the cell's
    shape kind, colour and word classes (:data:`benchmarks.quality.data.CELL_CLASSES`), one head
    for the merger output and one per DeepStack output when ``levels > 1``. Not part of the
    checkpoint (the saved model is :class:`ProbeVL` alone).

    With ``grid = (rows, cols)`` (``--aux-place``) a second head per level (:attr:`places`)
    predicts each token's cell row and column in the image (every image has the same grid), so
    the visual tokens carry their place linearly in their features, where the decoder's attention
    can read it off the tokens a question selects (the position questions compare two shapes'
    columns). The place heads are built after the cell heads, so under one seed the cell heads
    start from the same weights with or without them: a continuation from a checkpoint trained
    with aux heads under that seed (the committed probe: seed 0) finds its vision tower already
    matched to them (aux loss ~0.1 at the first step instead of ~9).

    Args:
        width: the visual tokens' width (``vision_config.out_hidden_size``).
        levels: 1 (merger output) or 1 + the DeepStack taps.
        grid: ``(rows, cols)`` of merged tokens per image for the place targets, or None (no place
            targets).
    """

    def __init__(self, width: int, levels: int = 1, grid: tuple[int, int] | None = None):
        super().__init__()
        self.grid = grid
        self.heads = nn.ModuleList(nn.Linear(width, sum(CELL_CLASSES)) for _ in range(levels))
        self.places = nn.ModuleList(nn.Linear(width, sum(grid)) for _ in range(levels)) if grid is not None else None

    def place_labels(self, tokens: int, device) -> torch.Tensor:
        """int64 ``[tokens, 2]``: each merged token's ``(row, col)`` in its image (cells in raster
        order, image after image). Raises ValueError: ``tokens`` is not a whole number of images."""
        rows, cols = self.grid
        if tokens % (rows * cols):
            raise ValueError(f"{tokens} visual tokens are not whole images of {rows}x{cols} cells")
        cell = torch.arange(tokens, device=device) % (rows * cols)
        return torch.stack([cell // cols, cell % cols], dim=1)

    def loss(self, tokens: Sequence[torch.Tensor], labels: torch.Tensor) -> AuxLoss:
        """The auxiliary loss over the levels' tokens, and the merger head's hits on cells holding a shape.

        Per level: cross-entropy of kind, colour and word averaged over every cell, plus that of
        kind and colour averaged over the cells holding a shape (most cells are empty; this keeps
        the signal for shapes from being diluted), plus with :attr:`grid` the mean of the row and
        column cross-entropies, likewise averaged over every cell plus over the cells holding a
        shape (a position question reads the place of shapes, and an empty cell's place is nearly
        the vision tower's position embedding); the levels are averaged.

        Args:
            tokens: ``levels`` tensors ``[T, width]`` (the merger output, then DeepStack outputs).
            labels: int64 ``[T, 3]`` (:func:`benchmarks.quality.data.cell_labels`, flattened).

        Returns:
            :class:`AuxLoss`.

        Raises:
            ValueError: with a grid, ``T`` is not a whole number of images.
        """
        nk, nc, _ = CELL_CLASSES
        place = self.place_labels(len(labels), labels.device) if self.grid is not None else None
        shape = (labels[:, 0] > 0).float()
        cells = shape.sum().clamp(min=1.0)
        total = torch.zeros((), device=labels.device)
        place_total = torch.zeros((), device=labels.device)
        kind_hits = colour_hits = column_hits = None
        for j, (head, x) in enumerate(zip(self.heads, tokens, strict=False)):
            logits = head(x).float()
            kind, colour, word = logits[:, :nk], logits[:, nk:nk + nc], logits[:, nk + nc:]
            ce_kind = F.cross_entropy(kind, labels[:, 0], reduction="none")
            ce_colour = F.cross_entropy(colour, labels[:, 1], reduction="none")
            ce_word = F.cross_entropy(word, labels[:, 2], reduction="none")
            every_cell = (ce_kind + ce_colour + ce_word).mean() / 3
            total = total + every_cell + ((ce_kind + ce_colour) * shape).sum() / (2 * cells)
            if place is not None:
                where = self.places[j](x).float()
                row, col = where[:, :self.grid[0]], where[:, self.grid[0]:]
                ce_place = (F.cross_entropy(row, place[:, 0], reduction="none")
                            + F.cross_entropy(col, place[:, 1], reduction="none")) / 2
                place_total = place_total + ce_place.mean() + (ce_place * shape).sum() / cells
                if j == 0:
                    column_hits = torch.stack([((col.argmax(-1) == place[:, 1]).float() * shape).sum(), shape.sum()])
            if j == 0:
                kind_hits = torch.stack([((kind.argmax(-1) == labels[:, 0]).float() * shape).sum(), shape.sum()])
                colour_hits = torch.stack([((colour.argmax(-1) == labels[:, 1]).float() * shape).sum(), shape.sum()])
        levels = len(self.heads)
        return AuxLoss((total + place_total) / levels, kind_hits, colour_hits, place_total / levels, column_hits)


@dataclass
class StepLosses:
    """What one training step computes (:func:`batch_losses`).

    Attributes:
        answer: float32 scalar, mean cross-entropy over the target tokens.
        hits: bool ``[M]``, argmax-correctness of each target token.
        aux: float32 scalar auxiliary loss (None without aux heads).
        aux_kind, aux_colour: float32 ``[2]`` ``(correct, cells)`` of the merger head on cells
            holding a shape (None without aux heads).
        aux_place: float32 scalar, the place part of ``aux`` (None without aux heads).
        aux_column: float32 ``[2]`` ``(correct, cells)`` of the merger head's column on cells
            holding a shape (None without place targets).
    """

    answer: torch.Tensor
    hits: torch.Tensor
    aux: torch.Tensor | None = None
    aux_kind: torch.Tensor | None = None
    aux_colour: torch.Tensor | None = None
    aux_place: torch.Tensor | None = None
    aux_column: torch.Tensor | None = None


def batch_losses(model: ProbeVL, batch: Batch, processor_config, aux: AuxHeads | None = None) -> StepLosses:
    """The answer loss of :func:`batch_loss` and, with ``aux``, the auxiliary per-token loss on
    the merged visual tokens (labels from :func:`benchmarks.quality.data.cell_labels`, made on the
    batch's device; visual tokens and labels are both image by image, cells in raster order)."""
    pixels, grid = device_pixels(batch, processor_config)
    embeds, deepstack = model.encode_images(pixels, grid, batch.n_images)
    hidden = model.hidden(batch.input_ids, batch.positions, embeds, deepstack)
    logits = model.logits(hidden.reshape(-1, hidden.shape[-1])[batch.target_rows]).float()
    out = StepLosses(F.cross_entropy(logits, batch.target_ids), logits.argmax(-1) == batch.target_ids)
    if aux is not None:
        labels = cell_labels(batch.scenes, batch.size).reshape(-1, 3)
        out.aux, out.aux_kind, out.aux_colour, out.aux_place, out.aux_column = aux.loss(
            [embeds, *deepstack][:len(aux.heads)], labels)
    return out


def batch_loss(model: ProbeVL, batch: Batch, processor_config) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over the batch's target tokens, and the argmax-correctness of each target.

    Returns:
        ``(loss, correct)``: a float32 scalar and bool ``[M]``.
    """
    out = batch_losses(model, batch, processor_config)
    return out.answer, out.hits


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def greedy_answers(model: ProbeVL, samples: Sequence[Sample], tokens: PromptTokens, device, processor_config, *,
                   batch_size: int = 256, max_new_tokens: int = MAX_NEW_TOKENS) -> list[str]:
    """Greedy answers (decoded text, special tokens dropped) to ``samples``.

    Each sample's prompt is exactly what Prism and transformers build for it; decoding stops at
    ``<|im_end|>`` or ``<|endoftext|>`` or after ``max_new_tokens``. The images are encoded once
    per chunk and the decoder reruns the whole prompt each step (answers are a token or two).
    """
    device = torch.device(device)
    model.eval()
    answers: list[str] = []
    for start in range(0, len(samples), batch_size):
        chunk = list(samples[start:start + batch_size])
        prompts = [tokens.prompt(len(s.scenes), s.question, s.size) for s in chunk]
        generated: list[list[int]] = [[] for _ in chunk]
        done = [False] * len(chunk)
        with _autocast(device):
            first = build_batch(chunk, tokens, with_targets=False, prompts=prompts).to(device)
            pixels, grid = device_pixels(first, processor_config)
            embeds, deepstack = model.encode_images(pixels, grid, first.n_images)
            for _ in range(max_new_tokens):
                batch = build_batch(chunk, tokens, with_targets=False, prompts=prompts, extra=generated).to(device)
                hidden = model.hidden(batch.input_ids, batch.positions, embeds, deepstack)
                last = hidden[torch.arange(len(chunk), device=device), batch.lengths - 1]
                next_ids = model.logits(last).float().argmax(-1).tolist()
                for i, tok in enumerate(next_ids):
                    if not done[i]:
                        generated[i].append(tok)
                        done[i] = tok in (tiny.IM_END_ID, tiny.ENDOFTEXT_ID)
                if all(done):
                    break
        answers += [tokens.decode(g) for g in generated]
    model.train()
    return answers


def evaluate(model: ProbeVL, samples: Sequence[Sample], tokens: PromptTokens, device, processor_config) -> dict:
    """Greedy exact-match accuracy per question type on ``samples`` (see :func:`accuracy_by_type`),
    with the first few answers for a look."""
    answers = greedy_answers(model, samples, tokens, device, processor_config)
    report = accuracy_by_type(samples, answers)
    report["examples"] = [{"uid": s.uid, "question": s.question, "answer": s.answer, "predicted": a}
                          for s, a in zip(samples[:10], answers[:10], strict=True)]
    return report


def round_to_storage(model: ProbeVL, dtype: torch.dtype = torch.bfloat16) -> None:
    """Round the weights in place to what the checkpoint stores (evaluate what is shipped)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).to(p.dtype))


def save(model: ProbeVL, out: pathlib.Path, skeleton: pathlib.Path | None, transfer: pathlib.Path | None,
         spec=None) -> None:
    """Write the checkpoint folder (skeleton files + bfloat16 shards; ``config.json`` from
    ``spec``, the run's settings, when given); mirror it for transfer (weights and config)."""
    if skeleton is not None and skeleton.resolve() != out.resolve():
        ckpt.copy_skeleton(skeleton, out)
    if spec is not None:
        ckpt.write_config(out, spec)
    ckpt.save_weights(model.state_dict(), out)
    if transfer is not None:
        ckpt.split_for_transfer(out, transfer)


def train(args: argparse.Namespace) -> dict:
    """The training run of :func:`main`; returns the metrics it also writes."""
    if (args.aux_place or args.aux_deepstack) and args.aux_weight <= 0:
        raise SystemExit("--aux-place and --aux-deepstack add to the aux loss: give --aux-weight W > 0")
    device = torch.device(args.device)
    out = pathlib.Path(args.out)
    spec = ckpt.probe_spec(ckpt.overrides_from_args(args, ckpt.TOY_OVERRIDES if args.toy else None))
    skeleton = pathlib.Path(args.skeleton) if args.skeleton else ckpt.write_skeleton(out, spec)
    projected = ckpt.projected_bytes(spec, skeleton)
    print(f"projected committed folder: {projected / 2**20:.2f} MiB (limit {ckpt.PROBE_BUDGET_BYTES / 2**20:.0f} MiB)",
          flush=True)
    if projected > ckpt.PROBE_BUDGET_BYTES:
        raise SystemExit(f"refused: the checkpoint folder would take {projected / 2**20:.2f} MiB, over the "
                         f"{ckpt.PROBE_BUDGET_BYTES / 2**20:.0f} MiB limit; choose a smaller size")
    processor_config = json.loads((skeleton / "preprocessor_config.json").read_text())
    tokenizer_file = skeleton / "tokenizer.json"
    transfer = pathlib.Path(args.transfer) if args.transfer else None
    torch.manual_seed(args.seed)

    stream = TrainStream(tokenizer_file, args.batch, args.seed, curriculum=args.curriculum)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=args.workers,
                                         pin_memory=device.type == "cuda", prefetch_factor=4 if args.workers else None,
                                         persistent_workers=args.workers > 0)
    model = build_model(spec, device, args.seed)
    if args.init:
        load_init(model, args.init)
    aux = None
    if args.aux_weight > 0:
        levels = 1 + (len(spec["vision_config"]["deepstack_visual_indexes"]) if args.aux_deepstack else 0)
        torch.manual_seed(args.seed + 1)
        grid = None
        if args.aux_place:  # every sample's images have one size: its merged-token grid
            merged = spec["vision_config"]["patch_size"] * spec["vision_config"]["spatial_merge_size"]
            grid = (IMAGE_SIZE[0] // merged, IMAGE_SIZE[1] // merged)
        aux = AuxHeads(spec["vision_config"]["out_hidden_size"], levels, grid).to(device)
    trained = torch.nn.ModuleList([model] + ([aux] if aux is not None else []))
    optimizer = make_optimizer(trained, args.lr)
    schedule = Schedule(args.lr, warmup=args.warmup)
    tokens = PromptTokens(tokenizer_file)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f} M parameters; batch {args.batch}; budget {args.minutes} min"
          + (f" / {args.steps} steps" if args.steps else "")
          + (f"; aux weight {args.aux_weight} on {len(aux.heads)} level(s)" if aux is not None else ""), flush=True)

    budget = args.minutes * 60.0
    history = []
    running = torch.zeros((), device=device)
    aux_running = torch.zeros((), device=device)
    aux_kind = torch.zeros(2, device=device)
    aux_colour = torch.zeros(2, device=device)
    aux_place = torch.zeros((), device=device)
    aux_column = torch.zeros(2, device=device)
    correct = torch.zeros(len(TRAINING_TYPES), device=device)
    seen = torch.zeros(len(TRAINING_TYPES), device=device)
    step, samples_seen, start = 0, 0, time.monotonic()
    last_ckpt = start
    it = iter(loader)
    while True:
        elapsed = time.monotonic() - start
        progress = step / args.steps if args.steps else elapsed / budget
        if elapsed >= budget or (args.steps and step >= args.steps):
            break
        stream.progress.value = progress  # read by the workers for the curriculum stage
        batch = next(it).to(device, non_blocking=True)
        lr = schedule.lr(step, progress)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with _autocast(device):
            losses = batch_losses(model, batch, processor_config, aux)
        loss, hits = losses.answer, losses.hits
        total = loss if losses.aux is None else loss + args.aux_weight * losses.aux
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(trained.parameters(), 1.0)
        optimizer.step()
        step += 1
        samples_seen += len(batch.lengths)
        running += loss.detach()
        if losses.aux is not None:
            aux_running += losses.aux.detach()
            aux_kind += losses.aux_kind
            aux_colour += losses.aux_colour
            aux_place += losses.aux_place.detach()
            if losses.aux_column is not None:
                aux_column += losses.aux_column
        # first-token accuracy per type, without a host sync (no boolean indexing)
        seen.index_add_(0, batch.target_types, batch.first_rows.to(seen.dtype))
        correct.index_add_(0, batch.target_types, (hits & batch.first_rows).to(seen.dtype))
        if step % args.log_every == 0:
            acc = {t: round(float(c / max(s, 1)), 3) for t, c, s in zip(TRAINING_TYPES, correct.tolist(),
                                                                           seen.tolist(), strict=True)}
            entry = {"step": step, "samples": samples_seen, "seconds": round(time.monotonic() - start, 1),
                     "loss": round(float(running) / args.log_every, 4), "lr": lr, "stage": batch.stage,
                     "train_first_token_accuracy": acc}
            if aux is not None:  # the merger head on cells holding a shape
                entry.update({"aux_loss": round(float(aux_running) / args.log_every, 4),
                              "aux_kind_accuracy": round(float(aux_kind[0] / aux_kind[1].clamp(min=1)), 3),
                              "aux_colour_accuracy": round(float(aux_colour[0] / aux_colour[1].clamp(min=1)), 3)})
                if aux.grid is not None:  # the place part of aux_loss, and the column on shape cells
                    entry.update({"aux_place_loss": round(float(aux_place) / args.log_every, 4),
                                  "aux_column_accuracy": round(float(aux_column[0] / aux_column[1].clamp(min=1)), 3)})
            history.append(entry)
            print(json.dumps(entry), flush=True)
            for t in (running, correct, seen, aux_running, aux_kind, aux_colour, aux_place, aux_column):
                t.zero_()
        if args.ckpt_minutes and time.monotonic() - last_ckpt >= args.ckpt_minutes * 60:
            save(model, out, skeleton, transfer, spec)
            last_ckpt = time.monotonic()
    train_seconds = time.monotonic() - start
    del it, loader

    round_to_storage(model)
    save(model, out, skeleton, transfer, spec)
    samples = heldout(args.eval)
    t0 = time.monotonic()
    report = evaluate(model, samples, tokens, device, processor_config)
    metrics = {
        "steps": step, "samples": samples_seen, "batch": args.batch, "train_minutes": round(train_seconds / 60, 2),
        "steps_per_second": round(step / max(train_seconds, 1e-9), 2), "parameters": params,
        "lr": args.lr, "seed": args.seed, "curriculum": args.curriculum, "init": args.init,
        "aux_weight": args.aux_weight, "aux_levels": len(aux.heads) if aux is not None else 0,
        "aux_place": bool(args.aux_place),
        "vision_config": {k: spec["vision_config"][k] for k in ("hidden_size", "depth", "intermediate_size",
                                                                 "num_heads", "deepstack_visual_indexes")},
        "text_config": {k: spec["text_config"][k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size")},
        "projected_folder_bytes": projected,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "heldout": {"n": len(samples), "first": samples[0].uid if samples else None,
                    "eval_seconds": round(time.monotonic() - t0, 1), "dtype": "bfloat16 weights, bf16 autocast"
                    if device.type == "cuda" else "bfloat16 weights, float32 compute", **report},
        "history": history,
    }
    text = json.dumps(metrics, indent=1)
    print(json.dumps({k: metrics["heldout"][k]["accuracy"] for k in [*QUESTION_TYPES, "all"]
                      if k in metrics["heldout"]}), flush=True)
    if args.metrics:
        pathlib.Path(args.metrics).write_text(text + "\n")
    return metrics


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--skeleton", help="folder with config/processor/tokenizer files (default: build them into --out)")
    p.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget of the training loop")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: only the time budget)")
    p.add_argument("--batch", type=int, default=256, help="samples per step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=200, help="warm-up steps")
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers drawing layouts")
    p.add_argument("--eval", type=int, default=2000, help="held-out samples to evaluate at the end")
    p.add_argument("--ckpt-minutes", type=float, default=2.0, help="minutes between checkpoints (0: only at the end)")
    p.add_argument("--transfer", help="also mirror the weights here in parts of at most 15 MiB")
    p.add_argument("--metrics", help="write the metrics JSON here")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--curriculum", choices=sorted(CURRICULA), default="v1",
                   help="v1 trained the first probe; binding adds kind-naming questions (the committed probe's last "
                        "stage; docs/QUALITY.md); "
                        "binding2 asks them more often and weights colour/which_image/position up; place gives "
                        "position 36-50%% of the samples (with --aux-place, from the committed probe)")
    p.add_argument("--toy", action="store_true", help="a toy-sized model (CPU smoke tests); size options apply to it")
    p.add_argument("--aux-weight", type=float, default=0.0,
                   help="weight of the auxiliary per-visual-token loss (kind, colour, word of each cell; 0: off)")
    p.add_argument("--aux-deepstack", action="store_true", help="also put aux heads on the DeepStack outputs")
    p.add_argument("--aux-place", action="store_true",
                   help="the aux heads also predict each visual token's row and column (for position questions)")
    ckpt.add_size_arguments(p)
    p.add_argument("--init", help="start from this checkpoint's weights (e.g. benchmarks/quality/probe) "
                                  "instead of a fresh initialisation; the optimizer state starts fresh")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
