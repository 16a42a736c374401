"""The committed probe model through Prism's engine (issue 20, section 5): it reaches its measured
dense accuracy, and it looks at the images (the blind control falls to the prior rate).

CPU, float32, KV in the model dtype, the harness of ``benchmarks/bench_quality.py``
(:mod:`benchmarks.quality.harness`): every question under its own cache salt.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.quality import MODEL_DIR, QUESTION_TYPES, accuracy_by_type, heldout
from benchmarks.quality.harness import answer_all, answer_prior, blind

#: Dense accuracy on heldout(100) measured on the CPU (float32, Prism engine, compaction off;
#: 2026-12-03, the probe that binds): colour 100, which_image 100, count 100, word 95, position 55
#: (its constant answer "right"), all 90.0. The margins (2 points overall: two answers of 100; 5
#: points per type: one answer of 20) allow for float32 sums in another order on another CPU
#: flipping a near tie; a model that stopped binding, reading or counting would lose 20+ points.
DENSE_MEASURED = {"colour": 1.00, "which_image": 1.00, "count": 1.00, "word": 0.95, "position": 0.55, "all": 0.90}
MARGIN = {"all": 0.02, **dict.fromkeys(QUESTION_TYPES, 0.05)}
#: Blind shuffles (images of the k-th next sample with the same image count, k = 1 .. SHUFFLES):
#: 600 blind answers, 120 per type. Measured (2026-12-03, CPU), blind / prior in %: colour
#: 14.2 / 18.2, which_image 42.5 / 47.9, count 17.5 / 22.4, word 1.7 / 2.3, position 55.0 / 55.0.
#: which_image stays 5-6 points under its prior from 3 to 10 shuffles (the blind model names the
#: images less evenly than the answers fall; the question-level noise of 20 fixed questions does
#: not shrink with more shuffles; docs/QUALITY.md, section 5), so the band is 7 points.
SHUFFLES = 6
PRIOR_BAND = 0.07


@pytest.fixture(scope="module")
def engine():
    from engine import Engine

    with Engine.from_pretrained(MODEL_DIR, device="cpu", dtype=torch.float32, kv_cache_dtype="auto",
                                compaction=None, progress=False, max_num_seqs=64) as eng:
        yield eng


@pytest.fixture(scope="module")
def samples():
    return heldout(100)


@pytest.fixture(scope="module")
def dense(engine, samples):
    return accuracy_by_type(samples, answer_all(engine, samples, "dense").texts)


def test_dense_accuracy_is_at_least_the_measured_value(dense):
    """Dense accuracy on the 100 fixed held-out samples >= measured - 2 points overall, and
    >= measured - 5 points (one answer) per type."""
    for qtype, want in DENSE_MEASURED.items():
        assert dense[qtype]["accuracy"] >= want - MARGIN[qtype] - 1e-9, (qtype, dense[qtype])


def test_blind_control_falls_to_the_prior_rate(engine, samples, dense):
    """The same questions with the images shuffled between samples: each type's accuracy is within
    5 points of its prior rate, the answer-frequency prior (``sum_a p_model(a) p_true(a)`` per image
    count, from the blind answers themselves: the accuracy a guesser that answers like the model
    but independently of the images reaches). Count and word, which the model reads off the
    images (100% dense), fall by more than 60 points, and colour and which_image, which the probe
    binds to the named image (100% dense), by more than 50: so the model is shown to look."""
    shuffled, answers = [], []
    for k in range(1, SHUFFLES + 1):
        part = blind(samples, k)
        assert all(b.scenes != s.scenes for b, s in zip(part, samples, strict=True))  # nobody keeps its images
        shuffled += part
        answers += answer_all(engine, part, f"blind{k}").texts
    got = accuracy_by_type(shuffled, answers)
    prior = answer_prior(shuffled, answers)
    for qtype in QUESTION_TYPES:
        assert abs(got[qtype]["accuracy"] - prior[qtype]) <= PRIOR_BAND, (qtype, got[qtype], prior[qtype])
    for qtype, drop in (("count", 0.6), ("word", 0.6), ("colour", 0.5), ("which_image", 0.5)):
        assert dense[qtype]["accuracy"] - got[qtype]["accuracy"] > drop, (qtype, got[qtype])
