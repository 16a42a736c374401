"""Seeded multi-image questions whose answer needs one specific image.

A :class:`Sample` is 1-4 images (each a :class:`Scene`: coloured shapes of several sizes, small
ones included, and at most one short word drawn in a bitmap font), a question about one of them
in Prism's media-first layout (``Image 1: <image> ... Question: ...``), a short answer and its
question type. Everything is drawn from a :class:`random.Random` seeded with a string key, so a key
always gives the same sample on every machine. Answers are right by construction: each question
type places exactly the objects that make its answer unique, and the distractor images carry the
same kinds of objects so that only the named image answers it.

Question types (:data:`QUESTION_TYPES`):

- ``colour``: "What colour is the triangle in Image 3?" (the named image has exactly one triangle);
- ``which_image``: "Which image has a blue square?" (exactly one of 2-4 images has one; answer "2");
- ``count``: "How many shapes are in Image 2?" (1-5 shapes; the word is not a shape);
- ``word``: "What word is written in Image 1?" (lowercase answer from :data:`WORDS`);
- ``position``: "Is the red circle left or right of the square in Image 2?" (the two shapes are
  unique in that image and apart horizontally; answer "left" or "right").

Training may also ask ``shape`` questions ("Which shape in Image 2 is red?"), never held out.

A transfer check no training stage sees (:data:`TRANSFER_TYPES`, split :func:`transfer`):
``count_colour``, "How many red shapes are in Image 2?" (1-3 shapes of that colour and at least
one of another, at most 5):
counting (trained) restricted by colour (trained through ``colour`` and ``which_image``), a
combination no training question asks for.

Splits: :func:`heldout` draws from the keys ``heldout:<i>``, :func:`transfer` from
``transfer:<i>``, training from ``train:<seed>:...`` (:func:`train_sample`), so no two share a seed.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: Image size of every sample (height, width) in pixels: a multiple of 32 (patch 16 x merge 2) whose
#: area equals the processor's minimum (65,536 pixels), so the Qwen3-VL processor leaves it unresized:
#: 16 x 16 patches, 64 visual tokens per image.
IMAGE_SIZE = (256, 256)

SHAPES = ("circle", "square", "triangle", "diamond")

#: Colour names and their RGB values (far apart, also for objects of a few pixels).
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 230),
    "yellow": (235, 205, 30),
    "purple": (150, 60, 200),
    "orange": (245, 140, 30),
}

#: Words that can be written in an image (each a single token of the Qwen BPE).
WORDS = ("cat", "dog", "sun", "map", "box", "cup", "hat", "key", "pen", "car", "bus", "egg", "fox", "ice",
         "jam", "owl", "pig", "sky", "toy", "van", "web", "zip", "bed", "bag", "gem", "hen", "ink", "jet",
         "kit", "moon", "ship", "star")

QUESTION_TYPES = ("colour", "which_image", "count", "word", "position")

#: Question types training may use: the held-out ones, and ``shape`` ("Which shape in Image 2 is
#: red?", the colour unique in that image), which rewards seeing a shape's kind directly.
TRAINING_TYPES = (*QUESTION_TYPES, "shape")

#: Question types of the transfer split (:func:`transfer`) only: never in a training distribution
#: nor in the held-out split, and reported outside its averages.
TRANSFER_TYPES = ("count_colour",)

#: Half-extent ranges of shapes in pixels: small (12-18 px across, about one 16-px patch), medium, large.
SIZE_CLASSES = ((6, 9), (10, 17), (18, 30))

#: Pixels per font cell of a word: letters 15x21 or 20x28 pixels, a word spans 2-3 visual tokens.
WORD_SCALES = (3, 4)

#: Light background colours (RGB).
BACKGROUNDS = ((250, 250, 250), (238, 238, 232), (232, 238, 244), (244, 236, 228))

_MARGIN = 5  # pixels kept free between objects and from the image border


@dataclass(frozen=True)
class Shape:
    """A filled shape: ``kind`` in :data:`SHAPES`, ``colour`` a key of :data:`COLOURS`, centre
    ``(cx, cy)`` and half-extent ``r`` in pixels (it covers pixels ``cx - r .. cx + r - 1``)."""

    kind: str
    colour: str
    cx: int
    cy: int
    r: int

    @property
    def box(self) -> tuple[int, int, int, int]:
        """``(x0, y0, x1, y1)``, end-exclusive pixel bounds."""
        return self.cx - self.r, self.cy - self.r, self.cx + self.r, self.cy + self.r


@dataclass(frozen=True)
class Word:
    """A word in capitals of the 5x7 bitmap font, each font cell ``scale`` x ``scale`` pixels, one
    empty cell between letters; top-left corner ``(x, y)``; ``ink`` RGB."""

    text: str
    x: int
    y: int
    scale: int
    ink: tuple[int, int, int]

    @property
    def box(self) -> tuple[int, int, int, int]:
        return self.x, self.y, self.x + word_width(self.text, self.scale), self.y + 7 * self.scale


@dataclass(frozen=True)
class Scene:
    """One image: background RGB, shapes (painted in order) and an optional word."""

    background: tuple[int, int, int]
    shapes: tuple[Shape, ...]
    word: Word | None = None


@dataclass(frozen=True)
class Sample:
    """One question about a set of images.

    Attributes:
        uid: the seed key it was drawn from (``heldout:17``, ``train:0:3:12``).
        qtype: one of :data:`QUESTION_TYPES` (held-out) or :data:`TRAINING_TYPES` (training).
        question: the question text (goes after ``Question: `` in the media-first layout).
        answer: the expected answer (lowercase; a colour, a digit, a word, ``left`` or ``right``).
        scenes: the images, in order (``Image 1`` first).
        target: 0-based index of the image the answer comes from.
        size: ``(height, width)`` of every image in pixels.
    """

    uid: str
    qtype: str
    question: str
    answer: str
    scenes: tuple[Scene, ...]
    target: int
    size: tuple[int, int] = IMAGE_SIZE

    def images(self) -> list:
        """The images as RGB ``PIL.Image`` objects (drawn on the CPU, see :mod:`.render`)."""
        from .render import render_scenes, to_pil

        return to_pil(render_scenes(self.scenes, self.size))

    def messages(self) -> list[dict]:
        """Chat messages in Prism's media-first layout (``engine.inputs.prompts.media_first_messages``)."""
        from engine.inputs.prompts import media_first_messages

        return media_first_messages(self.images(), self.question)


@dataclass(frozen=True)
class Distribution:
    """What a sample may contain (a curriculum stage, or the evaluation distribution).

    Attributes:
        types: question types drawn from (``which_image`` needs ``max_images >= 2``).
        type_weights: relative frequency of each of ``types`` (None: uniform); training may
            oversample the types that take longest to learn.
        min_images, max_images: images per sample (uniform; ``which_image`` uses at least 2).
        max_shapes: shapes per image at most (at least 1).
        max_count: the largest answer of a ``count`` question.
        word_prob: chance that an image not named by a ``word`` question carries a word anyway.
        min_gap: pixels between the horizontal extents of a ``position`` question's two shapes.
    """

    types: tuple[str, ...] = QUESTION_TYPES
    type_weights: tuple[float, ...] | None = None
    min_images: int = 1
    max_images: int = 4
    max_shapes: int = 5
    max_count: int = 5
    word_prob: float = 0.35
    min_gap: int = 8


#: The held-out split's distribution.
EVAL = Distribution()

#: Curriculum stages in training order, each with the share of training it starts at (see
#: :func:`curriculum_stage`): one image and few shapes first, then pairs, then the evaluation mix.
#: Reading words and comparing positions take longest to learn, so training draws them more often
#: than the held-out split does (answers and layouts are unchanged).
CURRICULUM: tuple[tuple[str, float, Distribution], ...] = (
    ("single", 0.0, Distribution(types=("colour", "count", "word", "position"), type_weights=(1, 1, 2, 2),
                                 max_images=1, max_shapes=3, max_count=3, word_prob=0.2, min_gap=20)),
    ("pair", 0.25, Distribution(type_weights=(1, 1, 1, 1.5, 1.5), max_images=2, max_shapes=4, max_count=4,
                                word_prob=0.3, min_gap=12)),
    ("full", 0.45, Distribution(type_weights=(1, 1.2, 1.2, 1.4, 1.4))),
)


#: A curriculum for the next run (not run yet; docs/QUALITY.md says why): the run of
#: :data:`CURRICULUM` never learned shape kinds, which colour, which_image and position need to
#: pick a shape; this one names the kind directly with ``shape`` questions from the first stage on.
BINDING_CURRICULUM: tuple[tuple[str, float, Distribution], ...] = (
    ("single", 0.0, Distribution(types=("colour", "count", "word", "position", "shape"),
                                 type_weights=(1.5, 1, 1.5, 1.5, 2), max_images=1, max_shapes=3, max_count=3,
                                 word_prob=0.2, min_gap=20)),
    ("pair", 0.25, Distribution(types=TRAINING_TYPES, type_weights=(1.2, 1, 1, 1.2, 1.5, 1), max_images=2,
                                max_shapes=4, max_count=4, word_prob=0.3, min_gap=12)),
    ("full", 0.45, Distribution(types=TRAINING_TYPES, type_weights=(1.2, 1.2, 1, 1, 1.4, 0.6))),
)

#: :data:`BINDING_CURRICULUM` pushed further (issue 35): the 4.6-minute fine-tune with it raised
#: the ``shape`` question to 74% while colour, which_image and position stayed near their floors,
#: so here ``shape`` keeps a larger share in the later stages (about 18% of the last one instead of
#: 9%), the three weak held-out types are drawn about twice as often as count and word (solved at
#: 99-100%, kept so they are not forgotten), and the multi-image stages start earlier.
BINDING2_CURRICULUM: tuple[tuple[str, float, Distribution], ...] = (
    ("single", 0.0, Distribution(types=("colour", "count", "word", "position", "shape"),
                                 type_weights=(2, 0.7, 1, 2, 3), max_images=1, max_shapes=3, max_count=3,
                                 word_prob=0.2, min_gap=20)),
    ("pair", 0.2, Distribution(types=TRAINING_TYPES, type_weights=(2, 1.5, 0.6, 0.6, 2, 2), max_images=2,
                               max_shapes=4, max_count=4, word_prob=0.3, min_gap=12)),
    ("full", 0.4, Distribution(types=TRAINING_TYPES, type_weights=(2, 2, 0.5, 0.5, 2, 1.5))),
)

#: The continuation of the committed probe for ``position`` (issue 35, with ``--aux-place``): that
#: probe answers the other four types at 99-100% but "right" to every position question, and its
#: visual tokens hold no place (a linear probe decodes a shape cell's column at 16%, chance 12.5%).
#: Position is already a fifth of :data:`BINDING_CURRICULUM` and its answers are balanced, so more
#: of the same data alone is not the fix; with the place targets making columns readable, this
#: gives the decoder more comparisons to learn from: position is half of the one-image stage (the
#: comparison without distractor images, shapes well apart), then about 40% and 36%; the solved
#: types keep about 12-14% each so they are not forgotten, ``shape`` a little.
PLACE_CURRICULUM: tuple[tuple[str, float, Distribution], ...] = (
    ("single", 0.0, Distribution(types=("colour", "count", "word", "position", "shape"),
                                 type_weights=(1, 1, 1, 4, 1), max_images=1, max_shapes=3, max_count=3,
                                 word_prob=0.2, min_gap=20)),
    ("pair", 0.25, Distribution(types=TRAINING_TYPES, type_weights=(1, 1, 1, 1, 3, 0.5), max_images=2,
                                max_shapes=4, max_count=4, word_prob=0.3, min_gap=12)),
    ("full", 0.5, Distribution(types=TRAINING_TYPES, type_weights=(1, 1, 1, 1, 2.5, 0.5))),
)

#: The curricula :func:`curriculum_stage` knows, by name (``v1`` trained the first probe; ``binding``
#: the last stage of the committed one; ``place`` is its continuation for position).
CURRICULA = {"v1": CURRICULUM, "binding": BINDING_CURRICULUM, "binding2": BINDING2_CURRICULUM,
             "place": PLACE_CURRICULUM}


def curriculum_stage(progress: float, curriculum: str = "v1") -> tuple[str, Distribution]:
    """The stage ``(name, distribution)`` of the named curriculum (a key of :data:`CURRICULA`) at
    ``progress`` (0 = start, 1 = end of training).

    Raises:
        KeyError: an unknown curriculum name.
    """
    stages = CURRICULA[curriculum]
    name, dist = stages[0][0], stages[0][2]
    for stage_name, start, stage_dist in stages:
        if progress >= start:
            name, dist = stage_name, stage_dist
    return name, dist


def word_width(text: str, scale: int) -> int:
    """Width in pixels of ``text`` drawn at ``scale`` (5 cells a letter, 1 between letters)."""
    return (6 * len(text) - 1) * scale


# --------------------------------------------------------------------------------------------
# Splits
# --------------------------------------------------------------------------------------------


def heldout(n: int, start: int = 0) -> list[Sample]:
    """The fixed held-out samples ``start .. start + n - 1`` (keys ``heldout:<i>``).

    Question types cycle through :data:`QUESTION_TYPES` (sample ``i`` has type ``i % 5``), so any
    run of 5k consecutive samples holds k of each type. Drawn from :data:`EVAL`.
    """
    return [make_sample(f"heldout:{i}", EVAL, QUESTION_TYPES[i % len(QUESTION_TYPES)]) for i in range(start, start + n)]


def transfer(n: int, start: int = 0) -> list[Sample]:
    """The transfer split: samples ``start .. start + n - 1`` (keys ``transfer:<i>``), every one a
    ``count_colour`` question ("How many red shapes are in Image 2?"), drawn from :data:`EVAL`'s
    layouts. It combines skills trained separately and no training stage asks it, so it measures
    transfer; it is a split of its own, so :func:`heldout`'s ``i % 5`` types are untouched."""
    return [make_sample(f"transfer:{i}", EVAL, "count_colour") for i in range(start, start + n)]


def train_sample(key: str, dist: Distribution) -> Sample:
    """A training sample for ``key`` (prefixed ``train:`` here, so it can never be a held-out key)."""
    return make_sample(f"train:{key}", dist)


def make_sample(key: str, dist: Distribution = EVAL, qtype: str | None = None,
                size: tuple[int, int] = IMAGE_SIZE) -> Sample:
    """Draw the sample of seed ``key`` from ``dist``.

    Args:
        key: seed string; the same key, distribution, type and size give the same sample.
        dist: what the sample may contain.
        qtype: the question type, or None to draw one from ``dist.types``.
        size: ``(height, width)`` of the images; each side a multiple of 32 and at least 128.

    Raises:
        ValueError: an unknown question type, a type ``dist`` cannot make, or a bad size.
    """
    height, width = size
    if height % 32 or width % 32 or min(size) < 128:
        raise ValueError(f"image size {size} must have sides that are multiples of 32, at least 128")
    rng = random.Random(key)
    if qtype is None:
        qtype = rng.choices(dist.types, weights=dist.type_weights)[0] if dist.type_weights else rng.choice(dist.types)
    if qtype not in _MAKERS:
        raise ValueError(f"unknown question type {qtype!r}; choose one of {TRAINING_TYPES + TRANSFER_TYPES}")
    lo = max(dist.min_images, 2 if qtype == "which_image" else 1)
    if lo > dist.max_images:
        raise ValueError(f"a {qtype} question needs at least {lo} images; the distribution allows {dist.max_images}")
    n_images = rng.randint(lo, dist.max_images)
    for _ in range(100):
        try:
            question, answer, scenes, target = _MAKERS[qtype](rng, dist, n_images, size)
        except _NoRoom:
            continue
        return Sample(key, qtype, question, answer, tuple(scenes), target, size)
    raise RuntimeError(f"no layout found for sample {key!r}")  # pragma: no cover - never seen


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------


def normalise_answer(text: str) -> str:
    """Lowercase, outer whitespace and punctuation removed, a leading ``image `` dropped (so
    ``"Image 2."`` scores as ``"2"``)."""
    text = text.strip().lower().strip(string.punctuation + string.whitespace)
    if text.startswith("image "):
        text = text[len("image "):].strip()
    return text


def is_correct(prediction: str, sample: Sample) -> bool:
    """Exact match of the normalised prediction with the sample's answer."""
    return normalise_answer(prediction) == sample.answer


def accuracy_by_type(samples: Sequence[Sample], predictions: Iterable[str]) -> dict[str, dict[str, float]]:
    """Exact-match accuracy per question type and over all samples.

    Returns:
        ``{qtype: {"n": count, "correct": count, "accuracy": fraction}, ..., "all": {...}}`` for the
        types present, in :data:`TRAINING_TYPES` then :data:`TRANSFER_TYPES` order.

    Raises:
        ValueError: a different number of predictions than samples.
    """
    predictions = list(predictions)
    if len(predictions) != len(samples):
        raise ValueError(f"{len(predictions)} predictions for {len(samples)} samples")
    tally: dict[str, list[int]] = {}
    for sample, pred in zip(samples, predictions, strict=True):
        for name in (sample.qtype, "all"):
            counts = tally.setdefault(name, [0, 0])
            counts[0] += 1
            counts[1] += is_correct(pred, sample)
    order = [t for t in (*TRAINING_TYPES, *TRANSFER_TYPES) if t in tally] + ["all"] if tally else []
    return {t: {"n": tally[t][0], "correct": tally[t][1], "accuracy": tally[t][1] / tally[t][0]} for t in order}


# --------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------


class _NoRoom(Exception):
    """The objects asked for did not fit; the sample is drawn again."""


@dataclass
class _Canvas:
    """Objects of one image being laid out: placed without overlap, ``_MARGIN`` apart."""

    rng: random.Random
    size: tuple[int, int]
    shapes: list[Shape] = field(default_factory=list)
    word: Word | None = None

    def _boxes(self):
        return [s.box for s in self.shapes] + ([self.word.box] if self.word else [])

    def _free(self, box) -> bool:
        x0, y0, x1, y1 = box
        return all(x1 + _MARGIN <= a or a1 + _MARGIN <= x0 or y1 + _MARGIN <= b or b1 + _MARGIN <= y0
                   for a, b, a1, b1 in self._boxes())

    def add_shape(self, kind: str, colour: str, r: int | None = None, where=None) -> Shape:
        """Place a shape (random size class when ``r`` is None); ``where(shape)`` may veto spots."""
        height, width = self.size
        if r is None:
            r = self.rng.randint(*self.rng.choice(SIZE_CLASSES))
        for _ in range(60):
            shape = Shape(kind, colour, self.rng.randint(r + _MARGIN, width - r - _MARGIN),
                          self.rng.randint(r + _MARGIN, height - r - _MARGIN), r)
            if self._free(shape.box) and (where is None or where(shape)):
                self.shapes.append(shape)
                return shape
        raise _NoRoom

    def add_word(self, text: str) -> Word:
        height, width = self.size
        scale = self.rng.choice(WORD_SCALES)
        w, h = word_width(text, scale), 7 * scale
        ink = tuple(self.rng.randint(10, 70) for _ in range(3))
        for _ in range(60):
            word = Word(text.upper(), self.rng.randint(_MARGIN, width - w - _MARGIN),
                        self.rng.randint(_MARGIN, height - h - _MARGIN), scale, ink)
            if self._free(word.box):
                self.word = word
                return word
        raise _NoRoom

    def scene(self) -> Scene:
        # shapes are painted in random order: the required ones are not always first
        shapes = list(self.shapes)
        self.rng.shuffle(shapes)
        return Scene(self.rng.choice(BACKGROUNDS), tuple(shapes), self.word)


def _fill(canvas: _Canvas, n_shapes: int, kinds=SHAPES, avoid=()) -> None:
    """Add random shapes until the canvas has ``n_shapes``; kinds from ``kinds``, never a
    ``(kind, colour)`` pair in ``avoid``."""
    while len(canvas.shapes) < n_shapes:
        kind, colour = canvas.rng.choice(kinds), canvas.rng.choice(tuple(COLOURS))
        if (kind, colour) not in avoid:
            canvas.add_shape(kind, colour)


def _maybe_word(canvas: _Canvas, dist: Distribution, exclude: str | None = None) -> None:
    if canvas.rng.random() < dist.word_prob:
        canvas.add_word(canvas.rng.choice([w for w in WORDS if w != exclude]))


def _distractors(rng, dist, n_images, size, target, make) -> list[Scene]:
    """Scenes for every image: ``make(canvas)`` lays out the target, random scenes the others."""
    scenes = []
    for i in range(n_images):
        canvas = _Canvas(rng, size)
        if i == target:
            make(canvas)
        else:
            _fill(canvas, rng.randint(1, dist.max_shapes))
            _maybe_word(canvas, dist)
        scenes.append(canvas.scene())
    return scenes


def _make_colour(rng, dist, n_images, size):
    target, kind, colour = rng.randrange(n_images), rng.choice(SHAPES), rng.choice(tuple(COLOURS))

    def make(canvas):
        canvas.add_shape(kind, colour)
        _fill(canvas, rng.randint(1, dist.max_shapes), kinds=[k for k in SHAPES if k != kind])
        _maybe_word(canvas, dist)

    scenes = _distractors(rng, dist, n_images, size, target, make)
    return f"What colour is the {kind} in Image {target + 1}? Answer with one word.", colour, scenes, target


def _make_which_image(rng, dist, n_images, size):
    target, kind, colour = rng.randrange(n_images), rng.choice(SHAPES), rng.choice(tuple(COLOURS))
    scenes = []
    for i in range(n_images):
        canvas = _Canvas(rng, size)
        if i == target:
            canvas.add_shape(kind, colour)
        else:
            # confusers: the same kind in another colour, the same colour on another kind
            if rng.random() < 0.7:
                canvas.add_shape(kind, rng.choice([c for c in COLOURS if c != colour]))
            if rng.random() < 0.5:
                canvas.add_shape(rng.choice([k for k in SHAPES if k != kind]), colour)
        _fill(canvas, max(len(canvas.shapes), rng.randint(1, dist.max_shapes)), avoid={(kind, colour)})
        _maybe_word(canvas, dist)
        scenes.append(canvas.scene())
    return f"Which image has a {colour} {kind}? Answer with the image number.", str(target + 1), scenes, target


def _make_count(rng, dist, n_images, size):
    target, count = rng.randrange(n_images), rng.randint(1, dist.max_count)

    def make(canvas):
        _fill(canvas, count)
        _maybe_word(canvas, dist)

    scenes = _distractors(rng, dist, n_images, size, target, make)
    return f"How many shapes are in Image {target + 1}? Answer with a number.", str(count), scenes, target


def _make_word(rng, dist, n_images, size):
    target, word = rng.randrange(n_images), rng.choice(WORDS)
    scenes = []
    for i in range(n_images):
        canvas = _Canvas(rng, size)
        if i == target:
            canvas.add_word(word)
        elif rng.random() < max(dist.word_prob, 0.5):
            canvas.add_word(rng.choice([w for w in WORDS if w != word]))
        _fill(canvas, rng.randint(0 if canvas.word else 1, max(1, dist.max_shapes - 1)))
        scenes.append(canvas.scene())
    return f"What word is written in Image {target + 1}? Answer with the word in lowercase.", word, scenes, target


def _make_position(rng, dist, n_images, size):
    target = rng.randrange(n_images)
    first, second = rng.sample(SHAPES, 2)
    colour = rng.choice(tuple(COLOURS))
    answer = []

    def make(canvas):
        a = canvas.add_shape(first, colour)
        # the second shape's horizontal extent is at least min_gap pixels clear of the first's
        gap = dist.min_gap
        b = canvas.add_shape(second, rng.choice(tuple(COLOURS)),
                             where=lambda s: s.box[2] + gap <= a.box[0] or a.box[2] + gap <= s.box[0])
        answer.append("left" if a.cx < b.cx else "right")
        others = [k for k in SHAPES if k not in (first, second)]
        _fill(canvas, rng.randint(2, max(2, dist.max_shapes)), kinds=others)
        _maybe_word(canvas, dist)

    scenes = _distractors(rng, dist, n_images, size, target, make)
    question = (f"Is the {colour} {first} left or right of the {second} in Image {target + 1}? "
                "Answer left or right.")
    return question, answer[0], scenes, target


def _make_shape(rng, dist, n_images, size):
    target, kind, colour = rng.randrange(n_images), rng.choice(SHAPES), rng.choice(tuple(COLOURS))

    def make(canvas):
        canvas.add_shape(kind, colour)
        others = [c for c in COLOURS if c != colour]
        for _ in range(rng.randint(1, dist.max_shapes) - 1):
            canvas.add_shape(rng.choice(SHAPES), rng.choice(others))
        _maybe_word(canvas, dist)

    scenes = _distractors(rng, dist, n_images, size, target, make)
    return f"Which shape in Image {target + 1} is {colour}? Answer with one word.", kind, scenes, target


def _make_count_colour(rng, dist, n_images, size):
    target, colour, count = rng.randrange(n_images), rng.choice(tuple(COLOURS)), rng.randint(1, 3)

    def make(canvas):
        for _ in range(count):
            canvas.add_shape(rng.choice(SHAPES), colour)
        others = [c for c in COLOURS if c != colour]
        # at least one shape of another colour, so counting every shape never gives the answer
        for _ in range(rng.randint(1, max(1, dist.max_shapes - count))):
            canvas.add_shape(rng.choice(SHAPES), rng.choice(others))
        _maybe_word(canvas, dist)

    scenes = _distractors(rng, dist, n_images, size, target, make)
    return (f"How many {colour} shapes are in Image {target + 1}? Answer with a number.", str(count), scenes,
            target)


_MAKERS = {
    "colour": _make_colour,
    "which_image": _make_which_image,
    "count": _make_count,
    "word": _make_word,
    "position": _make_position,
    "shape": _make_shape,
    "count_colour": _make_count_colour,
}
