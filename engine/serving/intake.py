"""From a built prompt to a request the loop can take: its token limit settled, its sampler,
detokenizer and telemetry made, its prefix key computed (in the caller's thread)."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from ..cache.prefix_reuse import PrefixReuse
from ..errors import InvalidRequestError, RequestTooLargeError
from ..inputs.prompts import Prompt
from .detokenize import TextStream
from .request import Request
from .sampling import Sampler, SamplingParams


class Intake:
    """Makes :class:`Request` objects for one engine.

    Args:
        tokenizer: the checkpoint's tokenizer (for streaming text).
        device: where samplers draw.
        max_model_len: longest prompt + output in tokens.
        reuse: the prefix cache's bookkeeping (computes prefix keys), or None when it is off.

    Attributes:
        make_sampler: ``(SamplingParams, device) -> sampler`` for each request (:class:`Sampler`;
            tests may replace it with a scripted one).
    """

    def __init__(self, tokenizer, device: torch.device, max_model_len: int, reuse: PrefixReuse | None):
        self.tokenizer, self.device, self.max_model_len, self.reuse = tokenizer, device, max_model_len, reuse
        self.make_sampler = Sampler

    def request(self, prompt: Prompt, sampling: SamplingParams, salt: str, submitted: float) -> Request:
        """A new request for ``prompt`` under cache salt ``salt``; ``submitted`` is its
        ``time.perf_counter()`` submission time (``preprocess_ms`` runs from it to now).

        Raises:
            RequestTooLargeError: see :meth:`fitted`.
        """
        preprocess_ms = (time.perf_counter() - submitted) * 1e3
        sampling = self.fitted(prompt, sampling)
        req = Request(
            prompt=prompt,
            sampling=sampling,
            sampler=self.make_sampler(sampling, self.device),
            stream=TextStream(self.tokenizer, sampling.stop),
            submitted=submitted,
        )
        req.telemetry.preprocess_ms = preprocess_ms
        req.telemetry.prompt_tokens = len(prompt.input_ids)
        req.telemetry.visual_tokens = prompt.num_visual_tokens
        req.salt = salt
        if self.reuse is not None:
            req.prefix_key = self.reuse.key(prompt, salt)
        return req

    def warm_request(self, prompt: Prompt, salt: str, submitted: float) -> Request:
        """A warm for ``prompt``'s public prefix (a media-first prompt whose question is a
        placeholder): it computes the prefix only, samples nothing, and ends once the prefix is
        cached (:class:`~engine.serving.scheduler.Scheduler`).

        Raises:
            InvalidRequestError: prefix caching is off, or the prompt has no image or video.
            RequestTooLargeError: a question after this prefix would leave no room to generate.
        """
        if self.reuse is None:
            raise InvalidRequestError("the prefix cache is off in this engine: there is nothing to warm")
        if prompt.prefix_len == 0:
            raise InvalidRequestError("nothing to warm: the images are missing (a warm needs at least one image "
                                      "or video)")
        req = self.request(prompt, SamplingParams(max_tokens=1), salt, submitted)
        req.warm = True
        return req

    def fitted(self, prompt: Prompt, sampling: SamplingParams) -> SamplingParams:
        """``sampling`` with its token limit settled: an unset ``max_tokens`` becomes
        ``default_max_tokens``, or the room the prompt leaves when that is less.

        Raises:
            RequestTooLargeError: the prompt leaves no room at all, or less than an explicit
                ``max_tokens``.
        """
        n, limit = len(prompt.input_ids), self.max_model_len
        room = limit - n
        if room < 1:  # whatever max_tokens says: "ask for at most 0 tokens" would be no advice
            raise RequestTooLargeError(
                f"the prompt ({n} tokens) leaves no room to generate within the engine's limit of {limit} "
                "tokens (model context and KV pool); shorten it or send fewer images"
            )
        if sampling.max_tokens is None:
            return replace(sampling, max_tokens=min(sampling.default_max_tokens, room))
        if sampling.max_tokens > room:
            raise RequestTooLargeError(
                f"prompt ({n} tokens) + max_tokens ({sampling.max_tokens}) = {n + sampling.max_tokens} tokens "
                f"exceeds the engine's limit of {limit} tokens (model context and KV pool); ask for at most "
                f"{room} tokens, or leave max_tokens unset to generate up to the room left"
            )
        return sampling
