"""Sampling parameters and the token sampler.

Order of logit processing follows common practice (the transformers ``generate`` processors):
repetition penalty (CTRL, Keskar et al. 2019, arXiv:1909.05858: positive logits divided by the
penalty, negative ones multiplied), then temperature, top-k, top-p (nucleus, Holtzman et al. 2019,
arXiv:1904.09751), then a draw from the per-request seeded generator. ``temperature == 0`` is greedy.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from ..errors import InvalidRequestError

#: Most tokens a request generates when it sets no ``max_tokens`` (fewer when its prompt leaves
#: less room in the model's context).
DEFAULT_MAX_TOKENS = 256


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


#: The seeds ``torch.Generator.manual_seed`` takes (a 64-bit integer, signed or not).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    Attributes:
        max_tokens: most tokens to generate (generated tokens only, not the prompt). None (the
            default): up to ``default_max_tokens``, or fewer when the prompt leaves less room in
            the engine's context; a number is taken as asked, and a request whose prompt leaves
            less room than that is refused (:class:`~engine.errors.RequestTooLargeError`).
        default_max_tokens: the cap when ``max_tokens`` is None (:data:`DEFAULT_MAX_TOKENS`; the
            OpenAI-compatible API passes its own).
        temperature: 0 for greedy decoding; otherwise logits are divided by it.
        top_p: keep the smallest set of tokens whose probability mass reaches ``top_p`` (1 = off).
        top_k: keep the ``top_k`` most likely tokens (0 = off).
        seed: seed of this request's own random generator; None draws a fresh one.
        repetition_penalty: > 1 discourages tokens already in the prompt or output (1 = off).
        stop: strings that end generation; the stop string itself is not part of the text.
        ignore_eos: keep generating past end-of-sequence tokens (benchmarks, tests).
    """

    max_tokens: int | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] | list[str] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise InvalidRequestError(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")
        if not _is_int(self.default_max_tokens) or self.default_max_tokens < 1:
            raise InvalidRequestError(
                f"default_max_tokens must be a positive integer, got {self.default_max_tokens!r}"
            )
        if not _is_real(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequestError(f"seed must be an integer from {SEED_MIN} to {SEED_MAX} or None, "
                                      f"got {self.seed!r:.40}")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequestError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}"
            )
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {self.stop!r:.80}")
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Picks the next token of one request from float32 logits ``[vocab]``."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor, seen_tokens: torch.Tensor | None = None) -> int:
        """Choose a token id.

        Args:
            logits: float32 ``[vocab]``.
            seen_tokens: int64 ids of prompt + generated tokens, for the repetition penalty.
        """
        p = self.params
        logits = logits.float()
        if p.repetition_penalty != 1.0 and seen_tokens is not None and seen_tokens.numel():
            logits = logits.clone()
            seen = seen_tokens.to(logits.device).unique()
            picked = logits[seen]
            logits[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token when the mass before it already reaches top_p (the top token always stays)
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            logits = logits.clone()
            logits[order[drop]] = float("-inf")
        probs = logits.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
