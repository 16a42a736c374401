"""What a request returns: :class:`Completion` and its :class:`Telemetry`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Telemetry:
    """Timings and counts of one request. Times in milliseconds, counts in tokens.

    Attributes:
        prompt_tokens: tokens in the prompt (visual placeholders included).
        computed_tokens: tokens the engine prefilled: the prompt minus reused cached tokens, plus
            anything recomputed after a preemption (decode steps not counted).
        visual_tokens: image / video tokens in the prompt.
        generated_tokens: tokens generated.
        queue_ms: from submission until the engine started the request.
        preprocess_ms: of ``queue_ms``, building the prompt in the caller's thread (chat template,
            tokeniser, image decoding and processing, or their cache lookups), plus the processing
            of images that was deferred (their patches had left the processed-image cache) and
            done when the prompt had to compute its prefix after all.
        vision_ms: time spent in the vision encoder (0 when it did not run).
        vision_encoder_ran: whether the vision encoder ran for this request.
        prefill_ms: time of the prompt prefill (vision excluded).
        ttft_ms: from submission to the first generated token.
        e2e_ms: from submission to the last token.
        decode_tokens_per_s: generated tokens after the first, per second of decoding.
        tpot_ms: mean time per output token after the first.
        kv_pages: most KV pages the request held at once.
        preempted: how often the request was preempted (its KV freed and recomputed).
        prefix_cache: ``"hit"`` (the public prefix's KV was reused), ``"miss"`` (computed and
            cached now), ``"stale"`` (found, but evicted before the request started: computed
            again) or ``"off"`` (no images, or prefix caching disabled).
        cached_tokens: prompt tokens whose KV was reused (prefix and conversation).
        conversation_reuse_tokens: of those, tokens of earlier turns beyond the public prefix.
        visual_tokens_kept: visual tokens the prefix's KV keeps (all of them when dense).
        prefix_form: ``"dense"`` or ``"compact"``: whether the public prefix the request used (hit)
            or cached (miss) had dropped visual tokens; None without a cached prefix.
        prefix_pages / prefix_pages_dense: KV pages of the public prefix, compacted vs dense.
        prefix_tier: where the prefix-cache entry the request hit was: ``"gpu"`` (in the KV
            pool) or ``"host"`` (in the host-memory tier, or on its way back: the request waited
            for the host-to-GPU copy, its own or another request's, before its prefill); None
            without a hit.
        restore_ms: time the host-to-GPU copy of that entry took (0 unless ``prefix_tier`` is
            ``"host"``; not part of ``prefill_ms``).
        restored_pages: KV pages that copy brought back (0 unless restored).
        warmed: the request is the first to attach a prefix that a warm built (``Engine.warm``,
            e.g. the app's warm at upload); False for every later request on that prefix.
    """

    prompt_tokens: int = 0
    computed_tokens: int = 0
    visual_tokens: int = 0
    generated_tokens: int = 0
    queue_ms: float = 0.0
    preprocess_ms: float = 0.0
    vision_ms: float = 0.0
    vision_encoder_ran: bool = False
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    tpot_ms: float = 0.0
    kv_pages: int = 0
    preempted: int = 0
    prefix_cache: str = "off"
    cached_tokens: int = 0
    conversation_reuse_tokens: int = 0
    visual_tokens_kept: int = 0
    prefix_form: str | None = None
    prefix_pages: int = 0
    prefix_pages_dense: int = 0
    prefix_tier: str | None = None
    restore_ms: float = 0.0
    restored_pages: int = 0
    warmed: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Completion:
    """The result of one request.

    Attributes:
        text: generated text (special tokens and any stop string removed).
        token_ids: generated token ids (an end-of-sequence token that ended generation included).
        prompt_token_ids: the prompt's token ids as the model saw them.
        finish_reason: ``"stop"`` (EOS or a stop string), ``"length"`` (``max_tokens`` reached) or
            ``"cancelled"`` (stopped by :meth:`Engine.cancel`; the text so far); a warm's
            (``Engine.warm``, no text): ``"warmed"`` (it cached the prefix) or ``"cached"`` (the
            prefix was cached already).
        telemetry: timings and counts.
    """

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    telemetry: Telemetry = field(default_factory=Telemetry)
