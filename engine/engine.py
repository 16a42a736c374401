"""The public engine: load a Qwen3-VL checkpoint, then answer chat messages.

>>> from engine import Engine, SamplingParams
>>> with Engine.from_pretrained("path/to/checkpoint") as engine:
...     done = engine.generate([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=8))
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ops.dispatch import warm_up as warm_up_kernels

from .compaction import CompactionConfig
from .detokenize import TextStream
from .errors import EngineOverloadedError, InvalidRequestError, PrismError, RequestTooLargeError
from .hub import resolve_checkpoint
from .images import ImageOptions
from .inputs import Prompt, PromptBuilder
from .kv_cache import KV_DTYPES, PagePool
from .model import Qwen3VL, load_model
from .outputs import Completion
from .prefix_cache import PrefixCache, prefix_key
from .request import Request, Status
from .runner import ModelRunner
from .sampling import Sampler, SamplingParams
from .scheduler import Scheduler, SchedulerConfig
from .vision import VisionFeatures, span_features
from .vision_cache import VisionCache
from .vision_graphs import VisionGraphs

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineOptions:
    """Engine settings (all optional keyword arguments of :meth:`Engine.from_pretrained`).

    Attributes:
        min_pixels / max_pixels: bounds on an image's resized area in pixels (None keeps the
            checkpoint's processor settings; Qwen3-VL's default max allows ~16 M pixels).
        max_image_pixels: refuse images whose header claims more pixels (decompression bombs).
        max_image_bytes: refuse image files larger than this many bytes.
        image_background: RGB colour transparent images are composited onto.
        max_model_len: longest prompt + output in tokens (default: the checkpoint's
            ``max_position_embeddings``, capped by the KV pool).
        progress: show progress bars while loading.
        kv_cache_dtype: ``"fp8_e4m3"`` (Scaled-FP8 pages) or ``"auto"`` (the model dtype).
        kv_cache_bytes: KV pool size in bytes, scales included. Default: on CUDA
            ``gpu_memory_utilization`` of the memory free after loading the model; on CPU 512 MiB.
        page_size: tokens per KV page.
        max_num_seqs, max_num_batched_tokens, max_waiting: scheduler limits
            (see :class:`~engine.scheduler.SchedulerConfig`). ``max_num_batched_tokens`` None means
            8,192 on CUDA and 1,024 on the CPU. On CUDA an 8-photo prompt (~1.7k tokens) is then
            prefilled in one step, and a running stream waits at most one 8k-token step (about five
            times the 51 ms of a 1,662-token prefill of an 8B model on the H200).
        debug_checks: check the pool's page accounting after every step (slow; for tests).
        prefix_cache: keep the KV of each prompt's public prefix for later questions.
        compaction: ``"uniform"`` or None: how a cached prefix drops visual tokens.
        keep_ratio, min_keep, compact_video: compaction settings (see
            :class:`~engine.compaction.CompactionConfig`).
        cache_scope: ``"session"`` (prefixes are shared only under the same ``cache_salt``) or
            ``"global"`` (salts ignored; for single-user setups).
        conversation_reuse: also keep a finished turn's KV so the next turn of the same chat
            prefills only its new question.
        vision_cache_bytes: bound of the per-session vision-feature cache.
        cuda_graphs: on CUDA, replay captured graphs for decode steps (see :mod:`engine.cuda_graphs`)
            and for the vision encoder on image sizes seen before (see :mod:`engine.vision_graphs`).
        graph_max_tokens: text-only steps of up to this many new tokens (and at least
            ``max_num_seqs``) replay the graphs too, so the question after a cached prefix is
            prefilled without the host in the way.
        prefill_graphs: with ``cuda_graphs`` on CUDA, a step holding only one cold prompt (or its
            first chunk) of fewer than 512 tokens replays a graph captured for its token-count
            bucket (see :mod:`engine.prefill_graphs`).
    """

    min_pixels: int | None = None
    max_pixels: int | None = None
    max_image_pixels: int = ImageOptions.max_image_pixels
    max_image_bytes: int = ImageOptions.max_bytes
    image_background: tuple[int, int, int] = ImageOptions.background
    max_model_len: int | None = None
    progress: bool = True
    kv_cache_dtype: str = "fp8_e4m3"
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.85
    page_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None
    max_waiting: int = 256
    debug_checks: bool = False
    prefix_cache: bool = True
    compaction: str | None = "uniform"
    keep_ratio: float = 0.6
    min_keep: int = 16
    compact_video: bool = False
    cache_scope: str = "session"
    conversation_reuse: bool = True
    vision_cache_bytes: int = 256 << 20
    cuda_graphs: bool = True
    graph_max_tokens: int = 64
    prefill_graphs: bool = True

    def image_options(self) -> ImageOptions:
        return ImageOptions(
            max_image_pixels=self.max_image_pixels, max_bytes=self.max_image_bytes, background=self.image_background
        )


def _pick_device(device) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _pick_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        try:
            return _DTYPES[dtype]
        except KeyError:
            raise InvalidRequestError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}") from None
    if dtype not in _DTYPES.values():
        raise InvalidRequestError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    return dtype


def _eos_ids(folder: Path, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen = folder / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class Engine:
    """A loaded Qwen3-VL model serving chat requests with continuous batching.

    Build it with :meth:`from_pretrained`. :meth:`generate` and :meth:`stream` may be called from
    many threads at once: every request joins one background loop that batches them over a
    paged KV pool. :meth:`close` (or leaving a ``with`` block) stops the loop.
    """

    def __init__(self, model: Qwen3VL, processor, *, model_id: str, folder: Path, options: EngineOptions):
        if options.kv_cache_dtype not in KV_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {KV_DTYPES}, got {options.kv_cache_dtype!r}")
        if model.device.type == "cuda":
            model.language_model.fuse_projections()  # fewer, larger matrix products per decode step
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.model_id = model_id
        self.options = options
        cfg = model.config
        self.config = cfg
        self.eos_token_ids = _eos_ids(folder, self.tokenizer)
        self.prompts = PromptBuilder(
            processor,
            image_token_id=cfg.image_token_id,
            video_token_id=cfg.video_token_id,
            merge_size=cfg.vision.spatial_merge_size,
            image_options=options.image_options(),
            min_pixels=options.min_pixels,
            max_pixels=options.max_pixels,
            pixel_dtype=model.dtype,
        )
        if options.cache_scope not in ("session", "global"):
            raise InvalidRequestError(f"cache_scope must be 'session' or 'global', got {options.cache_scope!r}")
        try:
            self.compaction = CompactionConfig(
                options.compaction, options.keep_ratio, options.min_keep, options.compact_video
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        self.namespace = self._namespace(folder)
        self.pool = self._make_pool()
        self.max_model_len = min(options.max_model_len or cfg.text.max_position_embeddings,
                                 self.pool.capacity_tokens)
        self.prefix_cache = PrefixCache(self.pool) if options.prefix_cache else None
        self.vision_cache = VisionCache(options.vision_cache_bytes)
        self.scheduler = Scheduler(
            self.pool,
            SchedulerConfig(options.max_num_seqs, self._step_budget(), options.max_waiting),
            self.prefix_cache,
        )
        self.runner = ModelRunner(model, self.pool, self._encode_request, self._capture_graphs(),
                                  self._capture_prefill_graphs())
        warm_up_kernels(self.pool.layers[0], cfg.text.num_attention_heads, self.dtype)
        self.vision_encoder = self._vision_encoder()
        self._cv = threading.Condition()
        self._inbox: list[Request] = []
        self._cancels: list[Request] = []
        self._stopping = False
        self._closed = False
        self.steps = 0
        self.tokens_generated = 0
        self._thread = threading.Thread(target=self._loop, name="prism-engine", daemon=True)
        self._thread.start()

    def _step_budget(self) -> int:
        """Most tokens one step computes: the option, or its device default."""
        if self.options.max_num_batched_tokens is not None:
            return self.options.max_num_batched_tokens
        return 8192 if self.model.device.type == "cuda" else 1024

    def _graphs_possible(self) -> bool:
        """CUDA graphs are on and can be captured: on CUDA, with the Triton kernels (the references
        read values back to the host, which a capture cannot hold)."""
        if not (self.options.cuda_graphs and self.model.device.type == "cuda"):
            return False
        from ops.dispatch import triton_kernels

        return triton_kernels is not None

    def _capture_graphs(self):
        if not self._graphs_possible():
            return None
        from .cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(
            self.model, self.pool, max(self.options.max_num_seqs, self.options.graph_max_tokens),
            max_pages_per_seq=-(-self.max_model_len // self.pool.page_size), max_seq_len=self.max_model_len,
        )
        graphs.capture()
        return graphs

    def _capture_prefill_graphs(self):
        if not (self.options.prefill_graphs and self._graphs_possible()):
            return None
        from .prefill_graphs import PrefillGraphs

        graphs = PrefillGraphs(self.model, self.pool)
        graphs.capture()
        return graphs

    def _vision_encoder(self):
        """``(pixels, grids) -> VisionFeatures``: the model's eager encoder, or a
        :class:`~engine.vision_graphs.VisionGraphs` (which also takes the request's salt) where
        decode uses CUDA graphs."""
        if self.runner.graphs is None:
            return self.model.encode_vision
        return VisionGraphs(self.model)

    def _encode_pixels(self, pixels: torch.Tensor, grids: list, salt: str) -> VisionFeatures:
        """The vision encoder on ``pixels``; its CUDA graphs are the salt's own (a graph another
        session earned would replay faster and tell which image sizes it sent)."""
        encoder = self.vision_encoder
        if isinstance(encoder, VisionGraphs):
            return encoder(pixels, grids, salt)
        return encoder(pixels, grids)

    def _namespace(self, folder: Path) -> str:
        """Everything besides the images that changes a prompt's tokens or pixels."""
        ip = self.processor.image_processor
        config_sha = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
        parts = [
            f"model={self.model_id}", f"config={config_sha}", f"size={sorted(self.prompts.size.items())}",
            f"patch={getattr(ip, 'patch_size', None)}", f"merge={getattr(ip, 'merge_size', None)}",
            f"temporal={getattr(ip, 'temporal_patch_size', None)}", self.prompts.image_options.namespace(),
            f"dtype={self.model.dtype}", f"kv={self.options.kv_cache_dtype}",
        ]
        return "|".join(parts)

    def _make_pool(self) -> PagePool:
        t, o = self.config.text, self.options
        shape = dict(num_layers=t.num_hidden_layers, num_kv_heads=t.num_key_value_heads, head_dim=t.head_dim)
        per_page = PagePool.bytes_per_page(
            **shape, page_size=o.page_size, kv_cache_dtype=o.kv_cache_dtype, model_dtype=self.model.dtype
        )
        budget = o.kv_cache_bytes
        if budget is None:
            if self.model.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.model.device)
                budget = int(free * o.gpu_memory_utilization)
            else:
                budget = 512 << 20
        return PagePool(
            **shape, num_pages=budget // per_page, page_size=o.page_size, kv_cache_dtype=o.kv_cache_dtype,
            model_dtype=self.model.dtype, device=self.model.device,
        )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, model: str | Path, *, device=None, dtype=None, **options) -> Engine:
        """Load a checkpoint folder or Hugging Face model id and start the engine loop.

        Args:
            model: local folder or model id (see :func:`engine.hub.resolve_checkpoint`).
            device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or None / ``"auto"`` (CUDA when available).
            dtype: ``torch.float32`` / ``bfloat16`` / ``float16`` or their names; None picks
                bfloat16 on CUDA and float32 on CPU.
            **options: fields of :class:`EngineOptions`.

        Raises:
            CheckpointError: the checkpoint cannot be found or does not match Qwen3-VL.
            InvalidRequestError: unknown options or a bad dtype.
        """
        from transformers import AutoProcessor

        try:
            opts = EngineOptions(**options)
        except TypeError as exc:
            raise InvalidRequestError(f"unknown engine option: {exc}") from None
        folder = resolve_checkpoint(model)
        dev = _pick_device(device)
        dt = _pick_dtype(dtype, dev)
        net = load_model(folder, device=dev, dtype=dt, progress=opts.progress)
        processor = AutoProcessor.from_pretrained(str(folder))
        if not hasattr(processor, "image_processor"):
            raise PrismError(f"{folder} has no usable Qwen3-VL processor (got {type(processor).__name__})")
        return cls(net, processor, model_id=str(model), folder=folder, options=opts)

    # ------------------------------------------------------------------ public API
    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def generate(
        self, messages, sampling: SamplingParams | None = None, *, cache_salt: str | None = None
    ) -> Completion:
        """Answer ``messages`` and return the whole :class:`Completion`.

        ``cache_salt`` names the chat session: cached prefixes are shared only between requests
        with the same salt (unless ``cache_scope="global"``). The server chooses it, never a
        client. None is one shared anonymous session.

        Raises:
            InvalidRequestError: malformed messages or sampling parameters.
            RequestTooLargeError: prompt + ``max_tokens`` beyond the model length or the KV pool.
            InvalidImageError: an image cannot be used.
            EngineOverloadedError: the waiting queue is full.
            PrismError: the engine is closed, or the request failed inside the engine.
        """
        for item in self.stream(messages, sampling, cache_salt=cache_salt):
            if isinstance(item, Completion):
                return item
        raise RuntimeError("stream ended without a completion")  # pragma: no cover

    def stream(
        self, messages, sampling: SamplingParams | None = None, *, cache_salt: str | None = None
    ) -> Iterator[str | Completion]:
        """Yield text deltas as they are generated, then the :class:`Completion`.

        Deltas never split a UTF-8 character or an emoji sequence and never contain any part of a
        stop string; joined they equal ``Completion.text``. Closing the iterator early (or
        dropping it) cancels the request and frees its KV pages. ``cache_salt`` and errors are
        those of :meth:`generate`; input errors are raised here, before iteration starts.
        """
        req = self.submit(messages, sampling, cache_salt=cache_salt)
        return self._drain(req)

    def submit(self, messages, sampling: SamplingParams | None = None, *, cache_salt: str | None = None) -> Request:
        """Validate and queue a request; its outputs arrive on ``request.outbox``.

        Raises: as :meth:`generate`, except failures inside the engine loop.
        """
        # Review fix: close() drops self.model; a submit racing it (prompt building is slow) then
        # failed with AttributeError on self.device instead of "engine is closed" below.
        model = self.model
        if self._closed or model is None:
            raise PrismError("engine is closed")
        sampling = sampling or SamplingParams()
        salt = self._salt(cache_salt)
        submitted = time.perf_counter()
        prompt = self.prompts.build(messages, salt)
        preprocess_ms = (time.perf_counter() - submitted) * 1e3
        sampling = self._fitted(prompt, sampling)
        req = Request(
            prompt=prompt,
            sampling=sampling,
            sampler=Sampler(sampling, model.device),
            stream=TextStream(self.tokenizer, sampling.stop),
            submitted=submitted,
        )
        req.telemetry.preprocess_ms = preprocess_ms
        req.telemetry.prompt_tokens = len(prompt.input_ids)
        req.telemetry.visual_tokens = prompt.num_visual_tokens
        req.salt = salt
        if self.prefix_cache is not None and 0 < prompt.prefix_len < len(prompt.input_ids):
            req.prefix_key = prefix_key(
                self.namespace, req.salt, prompt.image_hashes + prompt.video_hashes, self.compaction.namespace(),
                prompt.input_ids[: prompt.prefix_len],
            )
        with self._cv:
            if self._stopping:
                raise PrismError("engine is closed")
            if len(self._inbox) + len(self.scheduler.waiting) >= self.options.max_waiting:
                raise EngineOverloadedError(
                    f"Prism is busy: {self.options.max_waiting} requests are already waiting. Try again shortly."
                )
            self._inbox.append(req)
            self._cv.notify()
        return req

    def _salt(self, cache_salt: str | None) -> str:
        """The salt every cache of this request is keyed by: the caller's (None is the one
        anonymous session, ""), or "" for all under ``cache_scope="global"``."""
        return "" if self.options.cache_scope == "global" else (cache_salt or "")

    def cancel(self, req: Request, wait: bool = True) -> None:
        """Stop ``req``; its KV pages are freed before the engine's next step.

        With ``wait`` the call returns once the pages are free.
        """
        with self._cv:
            if req.status is Status.FINISHED or req.cancelled:
                return
            req.cancelled = True
            self._cancels.append(req)
            self._cv.notify()
            if wait:
                self._cv.wait_for(lambda: req.status is Status.FINISHED or not self._thread.is_alive(), timeout=60)

    def stats(self) -> dict:
        """Engine counters: KV pool pages (total, used, free, page size, capacity in tokens),
        running and waiting requests, steps run, tokens generated, and the prefix cache's
        entries (``cache_entries``: the public prefixes, counted in ``cache_prefixes``, plus the
        finished turns kept for conversation reuse), pages held, hits, misses, stale fallbacks,
        evictions (``cache_evictions``, the sum of ``cache_prefix_evictions``, image prefixes,
        and ``cache_extension_evictions``, finished turns kept for reuse), prompt tokens saved;
        the processed-image cache's hits, entries and refused entries (``image_cache_hits``,
        ``image_cache_entries``, ``image_cache_mismatches``) and the vision-feature cache's hits
        and entries; with the vision encoder's CUDA graphs, their eager runs, captures and
        replays (``vision_graph_*``). Every cache is keyed by the cache salt, so each hit is one
        within a session (or under ``cache_scope="global"``).

        Raises:
            PrismError: the engine is closed.
        """
        with self._cv:
            if self._closed:
                raise PrismError("engine is closed")
            return {
                "pages_total": self.pool.num_pages,
                "pages_used": self.pool.num_used,
                "pages_free": self.pool.num_free,
                "page_size": self.pool.page_size,
                "capacity_tokens": self.pool.capacity_tokens,
                "kv_cache_dtype": self.pool.kv_cache_dtype,
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting) + len(self._inbox),
                "steps": self.steps,
                "tokens_generated": self.tokens_generated,
                **self._cache_stats(),
                "image_cache_hits": self.prompts.cache_hits,
                "image_cache_entries": self.prompts.cache_entries,
                "image_cache_mismatches": self.prompts.cache_mismatches,
                "vision_cache_hits": self.vision_cache.hits,
                "vision_cache_entries": len(self.vision_cache),
                **self._graph_stats(),
            }

    def _graph_stats(self) -> dict:
        graphs = self.vision_encoder
        if not isinstance(graphs, VisionGraphs):
            return {}
        return {"vision_graph_eager_runs": graphs.eager_runs, "vision_graph_captures": graphs.captures,
                "vision_graph_replays": graphs.replays}

    def _cache_stats(self) -> dict:
        c = self.prefix_cache
        if c is None:
            return {"prefix_cache": False}
        return {
            "prefix_cache": True,
            "cache_entries": len(c.entries),
            "cache_prefixes": len(c.prefixes),
            "cache_pages": c.pages_held,
            "cache_hits": c.stats.hits,
            "cache_misses": c.stats.misses,
            "cache_stale": c.stats.stale,
            "cache_evictions": c.stats.evictions,
            "cache_prefix_evictions": c.stats.prefix_evictions,
            "cache_extension_evictions": c.stats.extension_evictions,
            "prompt_tokens_saved": c.stats.tokens_saved,
        }

    def count_prompt_tokens(self, messages, *, cache_salt: str | None = None) -> int:
        """Prompt length in tokens of ``messages`` (images processed and cached under
        ``cache_salt``, as :meth:`generate` would; nothing run)."""
        return len(self.prompts.build(messages, self._salt(cache_salt)).input_ids)

    def close(self) -> None:
        """Stop the loop (running requests fail with PrismError) and release memory."""
        with self._cv:
            if self._closed:
                return
            self._closed = self._stopping = True
            self._cv.notify_all()
        self._thread.join()
        # drop every reference to the model, the KV pool and the captured graphs so their memory goes
        self.pool = self.runner = self.model = self.scheduler = self.prefix_cache = None
        self.vision_cache = self.vision_encoder = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ request plumbing
    def _image_features(self, prompt: Prompt, salt: str, indices: list[int]) -> tuple[list[VisionFeatures], bool]:
        """Features of the prompt's images ``indices``: from the session's vision-feature cache,
        the others encoded together. Returns them in order and whether the encoder ran."""
        merge2 = self.config.vision.spatial_merge_size ** 2
        keys = [f"{salt}|{self.namespace}|{prompt.image_hashes[i]}|{prompt.image_grids[i]}" for i in indices]
        found = [self.vision_cache.get(k) for k in keys]
        missing = [j for j, f in enumerate(found) if f is None]
        if missing:
            pixels = torch.cat([prompt.image_pixels[indices[j]] for j in missing])
            fresh = self._encode_pixels(pixels, [prompt.image_grids[indices[j]] for j in missing], salt)
            offset = 0
            for j in missing:
                n = prompt.image_pixels[indices[j]].shape[0] // merge2
                found[j] = fresh.select(torch.arange(offset, offset + n, device=self.device))
                self.vision_cache.put(keys[j], found[j])
                offset += n
        return found, bool(missing)

    def _fitted(self, prompt: Prompt, sampling: SamplingParams) -> SamplingParams:
        """``sampling`` with its token limit settled: an unset ``max_tokens`` becomes
        ``default_max_tokens``, or the room the prompt leaves when that is less.

        Raises:
            RequestTooLargeError: the prompt leaves no room at all, or less than an explicit
                ``max_tokens``.
        """
        n, limit = len(prompt.input_ids), self.max_model_len
        room = limit - n
        if sampling.max_tokens is None:
            if room < 1:
                raise RequestTooLargeError(
                    f"the prompt ({n} tokens) leaves no room to generate within the engine's limit of {limit} "
                    "tokens (model context and KV pool); shorten it or send fewer images"
                )
            return replace(sampling, max_tokens=min(sampling.default_max_tokens, room))
        if sampling.max_tokens > room:
            raise RequestTooLargeError(
                f"prompt ({n} tokens) + max_tokens ({sampling.max_tokens}) = {n + sampling.max_tokens} tokens "
                f"exceeds the engine's limit of {limit} tokens (model context and KV pool); ask for at most "
                f"{max(room, 0)} tokens, or leave max_tokens unset to generate up to the room left"
            )
        return sampling

    def _drain(self, req: Request):
        try:
            while True:
                item = req.outbox.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Completion):
                    return
        finally:
            if req.status is not Status.FINISHED:
                self.cancel(req)

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        reason = "the engine was closed before the request finished"
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(
                        lambda: self._stopping or self._inbox or self._cancels or self.scheduler.has_work()
                    )
                    if self._stopping:
                        break
                    for req in self._inbox:
                        self._lookup(req)
                        self.scheduler.add(req)
                    self._inbox.clear()
                    for req in self._cancels:
                        self._finish(req, None)
                    self._cancels.clear()
                    self._cv.notify_all()
                if self.scheduler.has_work():
                    self._step()
        except Exception as exc:
            # A bug outside the model step (scheduling, bookkeeping, a failed debug check) used to
            # end this thread silently, leaving every caller blocked forever on its outbox. Stop
            # the engine instead and fail all its requests below.
            log.exception("engine loop crashed")
            reason = f"internal engine error, the engine stopped: {exc!r}"
            with self._cv:
                self._stopping = self._closed = True
        with self._cv:
            for req in [*self.scheduler.running, *self.scheduler.waiting, *self._inbox]:
                try:
                    self._finish(req, PrismError(reason))
                except Exception:  # state too broken to free pages: still answer the caller
                    req.status = Status.FINISHED
                    req.outbox.put(PrismError(reason))
            self._inbox.clear()
            self._cv.notify_all()

    def _step(self) -> None:
        with self._cv:  # scheduling evicts and attaches cache entries: never beside stats() or a clear
            batch = self.scheduler.schedule()
        if not batch.items:
            time.sleep(0.001)  # nothing fits right now: pages are held by requests about to finish
            return
        now = time.perf_counter()
        for req, _ in batch.items:
            if req.first_scheduled is None:
                req.first_scheduled = now
                req.telemetry.queue_ms = (now - req.submitted) * 1e3
        # Vision first, request by request: a failing encode fails its own request only, not
        # every request sharing the step (which the error handler below would fail).
        for req, exc in self.runner.encode_pending(batch):
            log.error("vision encoder failed for request %s: %r", req.id, exc)
            with self._cv:
                self._finish(req, PrismError(f"internal error while running the request: {exc}"))
                self._cv.notify_all()
            batch.items = [(r, n) for r, n in batch.items if r is not req]
        if not batch.items:
            return
        try:
            sampled = self.runner.execute(batch)
        except Exception as exc:  # one bad step fails its requests only; the loop goes on
            log.exception("engine step failed")
            with self._cv:
                for req, _ in batch.items:
                    self._finish(req, PrismError(f"internal error while running the request: {exc}"))
                self._cv.notify_all()
            return
        for req, n in batch.items:
            if n > 1 or req.num_computed - 1 < req.num_prompt:  # prefill (or recompute), not a decode step
                req.telemetry.computed_tokens += n
        with self._cv:
            self.steps += 1
            if self.prefix_cache is not None:
                self._after_step(batch)
            for req, token in sampled:
                self._accept(req, token)
            if self.options.debug_checks:
                self._check_pool()
            self._cv.notify_all()

    def _check_pool(self) -> None:
        holders = [r.block_table for r in self.scheduler.running]
        if self.prefix_cache is not None:
            holders += self.prefix_cache.holders()
        self.pool.check(holders)

    def _accept(self, req: Request, token: int) -> None:
        now = time.perf_counter()
        req.tokens.append(token)
        self.tokens_generated += 1
        if req.first_token_at is None:
            req.first_token_at = now
            req.telemetry.ttft_ms = (now - req.submitted) * 1e3
        if token in self.eos_token_ids and not req.sampling.ignore_eos:
            return self._finish(req, None, "stop")
        delta = req.stream.push(token)
        if delta:
            req.outbox.put(delta)
        if req.stream.stopped:
            return self._finish(req, None, "stop")
        if len(req.generated) >= req.sampling.max_tokens:
            return self._finish(req, None, "length")

    def _finish(self, req: Request, error: BaseException | None, reason: str | None = None) -> None:
        """Free the request's pages and deliver its completion (or error). Holds ``self._cv``."""
        if req.status is Status.FINISHED:
            return
        if req in self._inbox:
            self._inbox.remove(req)
            req.status = Status.FINISHED
        else:
            if reason in ("stop", "length") and self.prefix_cache is not None:
                self._cache_conversation(req)
            self.scheduler.finish(req)
        if error is not None:
            req.outbox.put(error)
            return
        if req.cancelled and reason is None:
            reason = "cancelled"  # a partial answer, for a reader other than the canceller
        tail = req.stream.finish()
        if tail:
            req.outbox.put(tail)
        tel = req.telemetry
        done = time.perf_counter()
        tel.generated_tokens = len(req.generated)
        tel.e2e_ms = (done - req.submitted) * 1e3
        tel.kv_pages = req.max_pages_held
        if tel.generated_tokens > 1 and req.first_token_at is not None:
            decode_s = done - req.first_token_at
            tel.decode_tokens_per_s = (tel.generated_tokens - 1) / decode_s if decode_s > 0 else 0.0
            tel.tpot_ms = decode_s * 1e3 / (tel.generated_tokens - 1)
        if req.first_scheduled is not None and req.first_token_at is not None:
            tel.prefill_ms = (req.first_token_at - req.first_scheduled) * 1e3 - tel.vision_ms
        req.outbox.put(Completion(req.stream.text, req.generated, list(req.prompt.input_ids), reason, tel))

    # ------------------------------------------------------------------ prefix cache
    def _lookup(self, req: Request) -> None:
        """Find the request's cached prefix (before admission). Holds ``self._cv``."""
        tel = req.telemetry
        if req.prefix_key is None:
            tel.prefix_cache = "off"
            return
        req.match = self.prefix_cache.lookup(req.prefix_key, req.prompt.input_ids, req.prompt.prefix_len)
        tel.prefix_cache = "hit" if req.match else "miss"
        if req.match:
            self.prefix_cache.stats.hits += 1
        else:
            self.prefix_cache.stats.misses += 1

    def _after_step(self, batch) -> None:
        """Compact and cache the public prefix of requests that just computed it."""
        for req, _ in batch.items:
            if req.cold_prefix and req.num_computed == req.prompt.prefix_len:
                self._compact_and_cache(req)

    def _compact_and_cache(self, req: Request) -> None:
        page = self.pool.page_size
        n = req.prompt.prefix_len
        kept = self.compaction.kept_positions(n, req.prompt.spans)
        k = len(kept)
        if k < n:
            table = req.block_table
            self.pool.move_slots([table[i // page] * page + i % page for i in kept.tolist()],
                                 [table[i // page] * page + i % page for i in range(k)])
            keep_pages = -(-k // page)
            self.pool.release(table[keep_pages:])
            del table[keep_pages:]
        req.kv_offset = n - k
        req.cold_prefix = False
        visual_kept = k - (n - req.prompt.num_visual_tokens)
        tel = req.telemetry
        tel.visual_tokens_kept = visual_kept
        tel.prefix_pages = len(req.block_table)
        tel.prefix_pages_dense = -(-n // page)
        entry = self.prefix_cache.add_prefix(
            req.prefix_key, req.salt, req.tokens[:n], req.block_table, k, tel.prefix_pages_dense, visual_kept
        )
        if entry is not None:
            entry.users += 1
            req.attached = entry

    def _cache_conversation(self, req: Request) -> None:
        """Keep a finished turn's KV as an extension of its prefix (conversation reuse)."""
        entry = req.attached
        if entry is None or not entry.alive or not self.options.conversation_reuse:
            return
        if req.num_computed <= len(entry.tokens) or req.kv_offset != entry.kv_offset:
            return
        pages = req.block_table[: -(-req.kv_len // self.pool.page_size)]
        self.prefix_cache.add_extension(entry, req.tokens[: req.num_computed], pages, req.kv_len)

    def clear_prefix_cache(self) -> None:
        """Evict every cached prefix that no running request uses."""
        with self._cv:
            cache = self.prefix_cache  # read once: close() drops it
            if cache is not None:
                cache.clear()

    def _encode_request(self, req: Request, items: list[tuple[str, int]]):
        return self.encode_items(req.prompt, req.salt, items)

    def vision_features(self, prompt: Prompt, salt: str = "") -> VisionFeatures:
        """Vision features of a prompt's images and videos, in prompt order (``prompt.visual_rows()``)."""
        return self.encode_prompt_vision(prompt, salt)[0]

    def encode_prompt_vision(self, prompt: Prompt, salt: str = "") -> tuple[VisionFeatures, bool]:
        """Vision features of all of a prompt's visual tokens, in prompt order
        (``prompt.visual_rows()``), and whether the encoder had to run."""
        items = [("image", i) for i in range(len(prompt.image_grids))]
        items += [("video", i) for i in range(len(prompt.video_grids))]
        features, ran = self.encode_items(prompt, salt, items)
        return span_features(prompt.spans, features, 0, len(prompt.input_ids), self.device)[1], ran

    def encode_items(self, prompt: Prompt, salt: str, items: list[tuple[str, int]]) -> tuple[dict, bool]:
        """Vision features of some of a prompt's images and videos.

        Args:
            items: ``("image", i)`` / ``("video", i)`` keys.

        Returns:
            ``(features by key, whether the encoder ran)``: an image's features come from the
            session's (``salt``'s) vision-feature cache when present; videos are always encoded.
        """
        images = [i for kind, i in items if kind == "image"]
        out, ran = {}, False
        if images:
            features, ran = self._image_features(prompt, salt, images)
            out.update({("image", i): f for i, f in zip(images, features, strict=True)})
        patches = [t * h * w for t, h, w in prompt.video_grids]
        for kind, i in items:
            if kind == "video":
                start = sum(patches[:i])
                pixels = prompt.pixel_values_videos[start : start + patches[i]]
                out[("video", i)] = self._encode_pixels(pixels, [prompt.video_grids[i]], salt)
                ran = True
        return out, ran

