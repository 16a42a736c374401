"""SamplingParams validation and the Sampler's logit processing.

transformers' logits processors (``RepetitionPenaltyLogitsProcessor``, ``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper``) are the oracle for the processing semantics. The
Sampler draws with ``torch.multinomial``; tests that need the exact distribution it draws from spy
on that call.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine import InvalidRequestError, SamplingParams
from engine.serving.sampling import Sampler

VOCAB = 1000


def random_logits(seed: int, n: int = VOCAB, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.fixture
def spy_multinomial(monkeypatch):
    """Record the probability vectors the Sampler hands to ``torch.multinomial``."""
    seen: list[torch.Tensor] = []
    real = torch.multinomial

    def spy(probs, *args, **kwargs):
        seen.append(probs.detach().clone())
        return real(probs, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", spy)
    return seen


def drawn_probs(params: SamplingParams, logits: torch.Tensor, spy: list, seen_tokens=None) -> torch.Tensor:
    spy.clear()
    Sampler(params)(logits, seen_tokens)
    assert len(spy) == 1, "the sampler should draw once with torch.multinomial"
    return spy[0].reshape(-1)


def hf_probs(logits: torch.Tensor, *, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """What transformers' generate samples from (temperature, then top-k, then top-p)."""
    scores = logits[None].clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores.softmax(-1)[0]


# --------------------------------------------------------------------------------------------
# SamplingParams validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"max_tokens": 2.5},
        {"max_tokens": "16"},
        {"max_tokens": True},
        {"default_max_tokens": 0},
        {"default_max_tokens": None},
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"temperature": "hot"},
        {"top_p": 0.0},
        {"top_p": -0.5},
        {"top_p": 1.01},
        {"top_p": float("nan")},
        {"top_p": None},
        {"top_k": -1},
        {"top_k": 2.5},
        {"top_k": "5"},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.2},
        {"repetition_penalty": float("nan")},
        {"repetition_penalty": float("inf")},
        {"seed": "seven"},
        {"seed": 1.5},
        {"stop": 5},
        {"stop": ["ok", 5]},
    ],
    ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()),
)
def test_bad_sampling_params_raise(kwargs):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert next(iter(kwargs)) in str(info.value), "the message should name the bad field"


def test_good_sampling_params():
    p = SamplingParams(max_tokens=1, temperature=0.7, top_p=0.5, top_k=3, seed=0, repetition_penalty=0.9)
    assert not p.greedy
    assert SamplingParams().greedy
    assert SamplingParams(top_p=1.0, top_k=0).top_p == 1.0
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "", "b"]).stop == ("a", "b"), "empty stop strings are dropped"
    assert SamplingParams(repetition_penalty=1).repetition_penalty == 1


# --------------------------------------------------------------------------------------------
# Greedy, top-k, top-p
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_greedy_is_argmax(seed):
    logits = random_logits(seed)
    assert Sampler(SamplingParams(temperature=0.0))(logits) == int(logits.argmax())


@pytest.mark.parametrize("temperature", [0.01, 0.5, 1.0, 3.0, 100.0])
def test_top_k_1_is_greedy_at_any_temperature(temperature):
    for seed in range(5):
        logits = random_logits(seed)
        sampler = Sampler(SamplingParams(temperature=temperature, top_k=1, seed=seed))
        assert all(sampler(logits) == int(logits.argmax()) for _ in range(5))


def test_tiny_top_p_keeps_only_the_top_token():
    for seed in range(5):
        logits = random_logits(seed, scale=0.1)  # flat: many tokens would be drawn otherwise
        sampler = Sampler(SamplingParams(temperature=1.5, top_p=1e-6, seed=seed))
        assert {sampler(logits) for _ in range(20)} == {int(logits.argmax())}


@pytest.mark.parametrize("top_k", [1, 2, 5, 50, 999, 1000, 5000])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_top_k_matches_transformers(spy_multinomial, top_k, temperature):
    logits = random_logits(top_k)
    ours = drawn_probs(SamplingParams(temperature=temperature, top_k=top_k, seed=0), logits, spy_multinomial)
    ref = hf_probs(logits, temperature=temperature, top_k=top_k)
    assert torch.equal(ours > 0, ref > 0), "kept sets differ"
    assert int((ours > 0).sum()) == min(top_k, VOCAB)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("top_p", [1e-6, 0.05, 0.3, 0.5, 0.9, 0.99, 0.999])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_top_p_matches_transformers(spy_multinomial, top_p, temperature):
    for seed in range(3):
        logits = random_logits(seed)
        ours = drawn_probs(SamplingParams(temperature=temperature, top_p=top_p, seed=0), logits, spy_multinomial)
        ref = hf_probs(logits, temperature=temperature, top_p=top_p)
        # tokens whose preceding mass lies within float32 rounding of top_p may go either way
        full = (logits.double() / temperature).softmax(-1)
        ordered, order = torch.sort(full, descending=True)
        before = torch.empty_like(full)
        before[order] = ordered.cumsum(-1) - ordered
        ambiguous = (before - top_p).abs() < 1e-5
        differ = (ours > 0) != (ref > 0)
        assert not (differ & ~ambiguous).any(), f"kept sets differ (seed {seed})"
        if not differ.any():
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)
        # the kept set is the smallest prefix of the sorted distribution reaching top_p
        kept = full[ours > 0]
        assert kept.sum() >= top_p - 1e-5 or kept.numel() == VOCAB
        assert kept.sum() - kept.min() < top_p + 1e-5


@pytest.mark.parametrize(("top_k", "top_p"), [(10, 0.5), (3, 0.99), (100, 0.2), (1000, 0.7)])
def test_top_k_then_top_p_matches_transformers(spy_multinomial, top_k, top_p):
    logits = random_logits(top_k + 7)
    ours = drawn_probs(SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, seed=0), logits, spy_multinomial)
    ref = hf_probs(logits, temperature=0.8, top_k=top_k, top_p=top_p)
    assert torch.equal(ours > 0, ref > 0)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------------
# Seeds and the sampled distribution
# --------------------------------------------------------------------------------------------


def test_same_seed_same_tokens_different_seeds_differ():
    logits = random_logits(0, scale=0.05)  # flat-ish: nearly uniform over 1000 tokens

    def draw(seed):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [sampler(logits) for _ in range(32)]

    assert draw(1234) == draw(1234)
    assert draw(1234) != draw(4321)
    assert len(set(draw(7))) > 16, "a flat distribution should give varied tokens"


def test_unseeded_samplers_differ():
    logits = random_logits(0, scale=0.05)
    a, b = (Sampler(SamplingParams(temperature=1.0)) for _ in range(2))
    assert [a(logits) for _ in range(32)] != [b(logits) for _ in range(32)]


@pytest.mark.parametrize("temperature", [0.5, 2.5])
def test_temperature_frequencies_follow_softmax(temperature):
    logits = torch.tensor([1.0, 0.3, -0.4, -1.5])
    expected = (logits / temperature).softmax(-1)
    draws = 20_000
    sampler = Sampler(SamplingParams(temperature=temperature, seed=2024))
    counts = torch.bincount(torch.tensor([sampler(logits) for _ in range(draws)]), minlength=4).double()
    chi2 = float((((counts - draws * expected) ** 2) / (draws * expected)).sum())
    assert chi2 < 16.27, f"chi-square {chi2:.1f} (3 dof, p = 0.001) counts {counts.tolist()} expected {expected}"
    # and temperature matters: the wrong temperature would be rejected
    wrong = logits.softmax(-1) if temperature != 1.0 else (logits / 2).softmax(-1)
    chi2_wrong = float((((counts - draws * wrong) ** 2) / (draws * wrong)).sum())
    assert chi2_wrong > 100


# --------------------------------------------------------------------------------------------
# Repetition penalty
# --------------------------------------------------------------------------------------------


def hf_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    return RepetitionPenaltyLogitsProcessor(penalty)(seen[None], logits[None].clone())[0]


@pytest.mark.parametrize("penalty", [0.5, 0.9, 1.3, 2.0, 10.0])
def test_repetition_penalty_matches_transformers(spy_multinomial, penalty):
    for seed in range(3):
        logits = random_logits(seed)
        gen = torch.Generator().manual_seed(100 + seed)
        seen = torch.randint(0, VOCAB, (200,), generator=gen)  # with repeats
        seen[:3] = torch.topk(logits, 3).indices  # the best tokens were seen
        ours = drawn_probs(SamplingParams(temperature=1.0, repetition_penalty=penalty, seed=0), logits,
                           spy_multinomial, seen)
        ref = hf_repetition(logits, seen, penalty).softmax(-1)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-8)
        # greedy picks the argmax of the penalised logits
        greedy = Sampler(SamplingParams(repetition_penalty=penalty))(logits, seen)
        assert greedy == int(hf_repetition(logits, seen, penalty).argmax())


def test_repetition_penalty_semantics():
    logits = torch.tensor([4.0, -2.0, 3.0, 0.0, -1.0])
    seen = torch.tensor([0, 1, 1, 3])
    sampler = Sampler(SamplingParams(repetition_penalty=2.0))
    # token 0: 4 -> 2 (divided), token 1: -2 -> -4 (multiplied), token 3: 0 stays; 2 wins with 3.0
    assert sampler(logits, seen) == 2
    assert sampler(logits) == 0, "no seen tokens: no penalty"
    assert sampler(logits, torch.tensor([], dtype=torch.long)) == 0
    # a penalty below 1 rewards repetition
    assert Sampler(SamplingParams(repetition_penalty=0.5))(torch.tensor([3.0, 4.0]), torch.tensor([0])) == 0
    expected = hf_repetition(logits, seen, 2.0)
    assert expected.tolist() == [2.0, -4.0, 3.0, 0.0, -1.0]


def test_sampler_does_not_modify_logits():
    logits = random_logits(3)
    before = logits.clone()
    Sampler(SamplingParams(temperature=0.7, top_k=5, top_p=0.5, repetition_penalty=1.5, seed=1))(
        logits, torch.tensor([1, 2, 3])
    )
    assert torch.equal(logits, before)


def test_half_precision_logits():
    logits = random_logits(4).to(torch.bfloat16)
    assert Sampler(SamplingParams())(logits) == int(logits.float().argmax())
    top3 = torch.topk(logits.float(), 3).indices.tolist()
    for seed in range(8):  # sampled exactly as their float32 values are, a plain int among the top 3
        params = SamplingParams(temperature=1.0, top_k=3, seed=seed)
        token = Sampler(params)(logits)
        assert type(token) is int and token in top3
        assert token == Sampler(params)(logits.float())
