"""The suite through Prism's engine (issue 20, section 3): answers, the blind control, prior rates
and the interval a sample count gives. ``benchmarks/bench_quality.py`` is its command line; the
quality tests use the same functions.

Every question gets a salt of its own (``cache_salt``), so its prefix is computed cold, compacted
at the prefix boundary (the scheduler ends a step there) and the question then attends to the
compact prefix only: exactly what a later cache hit on that prefix sees (the masked dense oracle,
``engine.cache.reference_masked``, computes the same function).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from .scenes import Sample, accuracy_by_type, normalise_answer

#: Enough for every answer of the suite (one word or digit, then ``<|im_end|>``).
ANSWER_TOKENS = 4


@dataclasses.dataclass
class Answers:
    """One configuration's answers: ``texts[i]`` for ``samples[i]``, the visual tokens its
    prefix kept (``kept``) and had (``visual``), per sample."""

    texts: list[str]
    kept: list[int]
    visual: list[int]


def answer_all(engine, samples: Sequence[Sample], tag: str, threads: int = 64) -> Answers:
    """Greedy answers (``ANSWER_TOKENS`` tokens) of ``engine`` to ``samples``, submitted from
    ``threads`` threads so the engine batches them (continuous batching). Salt of sample ``s``:
    ``f"{tag}|{s.uid}"`` (a fresh prefix per question and configuration)."""
    from engine import SamplingParams

    greedy = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0)

    def one(sample: Sample):
        done = engine.generate(sample.messages(), greedy, cache_salt=f"{tag}|{sample.uid}")
        tel = done.telemetry
        return done.text, tel.visual_tokens_kept, tel.visual_tokens

    with ThreadPoolExecutor(threads) as pool:
        rows = list(pool.map(one, samples))
    return Answers([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


def blind(samples: Sequence[Sample], shift: int = 1) -> list[Sample]:
    """The blind control: each sample's images replaced by those of the ``shift``-th next sample
    with the same number of images (cyclically, in order), question and answer unchanged, so no
    sample keeps its own images (while ``shift`` is below the group's size) and the images carry
    no information about the answer. Several shifts give several independent shuffles."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        groups[len(s.scenes)].append(i)
    out = list(samples)
    for members in groups.values():
        for j, i in enumerate(members):
            donor = samples[members[(j + shift) % len(members)]]
            out[i] = dataclasses.replace(samples[i], scenes=donor.scenes)
    return out


def answer_prior(samples: Sequence[Sample], predictions: Sequence[str]) -> dict[str, float]:
    """Per type, the accuracy of a guesser that ignores what the images show but answers with the
    model's own answer frequencies: ``sum_a p_model(a | c) * p_true(a | c)`` within each group
    ``c`` of one image count (the count is visible without looking: it is in the prompt, and
    :func:`blind` keeps it; which_image's answers range over it), weighted by the groups' sizes.
    Both frequencies come from these samples. With images unrelated to the answer (:func:`blind`)
    this is the expected accuracy. Also ``"all"``, the sample-weighted mean over types."""
    groups: dict[tuple[str, int], list[tuple[str, str]]] = defaultdict(list)
    for s, p in zip(samples, predictions, strict=True):
        groups[(s.qtype, len(s.scenes))].append((normalise_answer(p), normalise_answer(s.answer)))
    hits: dict[str, float] = defaultdict(float)
    sizes: Counter = Counter()
    for (qtype, _), pairs in groups.items():
        pred, true = Counter(p for p, _ in pairs), Counter(t for _, t in pairs)
        hits[qtype] += sum(pred[a] * true[a] for a in true) / len(pairs)  # expected correct answers
        sizes[qtype] += len(pairs)
    out = {t: hits[t] / sizes[t] for t in sizes}
    out["all"] = sum(hits.values()) / len(samples)
    return out


def majority_rate(samples: Sequence[Sample]) -> dict[str, float]:
    """Per type, the share of its most frequent true answer (the best image-blind constant guess)."""
    by_type: dict[str, Counter] = defaultdict(Counter)
    for s in samples:
        by_type[s.qtype][normalise_answer(s.answer)] += 1
    return {t: c.most_common(1)[0][1] / sum(c.values()) for t, c in by_type.items()}


def half_width(p: float, n: int, z: float = 1.96) -> float:
    """Half-width of the normal-approximation 95% interval of an accuracy ``p`` on ``n`` samples."""
    return z * math.sqrt(p * (1 - p) / n) if n else float("inf")


def samples_for(half: float, p: float = 0.5, z: float = 1.96) -> int:
    """Samples giving a 95% interval of ``±half`` for an accuracy near ``p`` (``z^2 p(1-p) / half^2``;
    ``p = 0.5`` is the worst case)."""
    return math.ceil(z * z * p * (1 - p) / half**2)


def report(samples: Sequence[Sample], answers: Answers) -> dict:
    """Accuracy per type (:func:`~benchmarks.quality.scenes.accuracy_by_type`) plus kept tokens:
    ``kept_tokens`` (mean per sample), ``visual_tokens`` (mean) and ``kept_share``."""
    out = accuracy_by_type(samples, answers.texts)
    out["kept_tokens"] = sum(answers.kept) / len(samples)
    out["visual_tokens"] = sum(answers.visual) / len(samples)
    out["kept_share"] = sum(answers.kept) / sum(answers.visual)
    return out
