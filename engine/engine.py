"""The public engine: load a Qwen3-VL checkpoint, then answer chat messages.

>>> from engine import Engine, SamplingParams
>>> with Engine.from_pretrained("path/to/checkpoint") as engine:
...     done = engine.generate([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=8))

:class:`Engine` wires the wings together (docs/ARCHITECTURE.md) and delegates: prompts are built by
:mod:`engine.inputs`, requests run in the loop of :mod:`engine.serving.loop`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ops.dispatch import warm_up as warm_up_kernels

from .cache import host_memory
from .cache.host_pool import HostPool
from .cache.kv_pool import PagePool
from .cache.kv_transfer import KVTransfers
from .cache.prefix_cache import PrefixCache
from .cache.prefix_reuse import PrefixReuse
from .cache.vision_cache import VisionCache
from .errors import InvalidRequestError, PrismError
from .graphs.capture import capture_step_graphs, graphs_supported
from .graphs.vision import VisionGraphs
from .inputs.prompts import Prompt, PromptBuilder, prefix_messages
from .inputs.uploads import UPLOADS
from .inputs.vision_features import VisionLookup
from .model.config import ModelConfig
from .model.hub import resolve_checkpoint
from .model.qwen3_vl import Qwen3VL, eos_token_ids, load_model
from .model.vision import EncodeCounter, VisionFeatures
from .options import EngineOptions, pick_device, pick_dtype
from .serving.handle import RequestHandle, WarmHandle
from .serving.intake import Intake
from .serving.loop import EngineLoop
from .serving.outputs import Completion
from .serving.request import Request
from .serving.runner import ModelRunner
from .serving.sampling import SamplingParams
from .serving.scheduler import Scheduler, SchedulerConfig

__all__ = ["Engine", "EngineOptions", "Forgotten"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Forgotten:
    """What :meth:`Engine.forget` dropped (counts; an engine's running totals in ``stats()`` as
    ``forgotten_*``).

    Attributes:
        sessions: salts forgotten (1 for one call; 0 under ``cache_scope="global"``).
        cache_entries: prefix-cache entries (public prefixes and conversation extensions).
        vision_features: per-image vision features.
        processed_images: processed images (decoded, resized pixels).
        decoded_videos: decoded and sampled clips.
        vision_graphs: the vision encoder's CUDA graphs.
    """

    sessions: int = 0
    cache_entries: int = 0
    vision_features: int = 0
    processed_images: int = 0
    decoded_videos: int = 0
    vision_graphs: int = 0

    def __add__(self, other: Forgotten) -> Forgotten:
        return Forgotten(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)))


class Engine:
    """A loaded Qwen3-VL model serving chat requests with continuous batching.

    Build it with :meth:`from_pretrained`. :meth:`generate` and :meth:`stream` may be called from
    many threads at once: every request joins one background loop that batches them over a
    paged KV pool. :meth:`close` (or leaving a ``with`` block) stops the loop.

    Attributes (read them; tests and benchmarks may also replace what the parts say they allow):
        model, config, processor, tokenizer, model_id, options: the network, its config, the
            checkpoint's processor and tokenizer, its name, the settings.
        eos_token_ids: tokens that end generation.
        namespace: what besides the images changes a prompt's tokens or pixels (cache keys).
        max_model_len: longest prompt + output in tokens (model context, capped by the pool).
        prompts: the :class:`~engine.inputs.prompts.PromptBuilder` (messages -> ``Prompt``).
        vision: the :class:`~engine.inputs.vision_features.VisionLookup` (its ``encoder``).
        pool: the :class:`~engine.cache.kv_pool.PagePool`.
        prefix_cache: the :class:`~engine.cache.prefix_cache.PrefixCache`, None when off.
        prefix_reuse: the :class:`~engine.cache.prefix_reuse.PrefixReuse` driving it, None when off.
        compaction: the :class:`~engine.cache.compaction.CompactionConfig`.
        intake: the :class:`~engine.serving.intake.Intake` (prompt -> request; its ``make_sampler``).
        loop: the :class:`~engine.serving.loop.EngineLoop` (its ``scheduler``, ``runner`` and
            ``paused()``).
        parallel: the :class:`~engine.parallel.group.TensorParallelGroup` of rank 0 (its
            ``pids``, ``error``), None with ``tensor_parallel_size=1``.
    """

    def __init__(self, model: Qwen3VL, processor, *, model_id: str, folder: Path, options: EngineOptions,
                 parallel=None):
        """``parallel``: the :class:`~engine.parallel.group.TensorParallelGroup` this process is
        rank 0 of (``model`` already sharded, see :meth:`from_pretrained`), or None."""
        options.check_kv_cache_dtype()
        self.parallel = parallel
        if model.device.type == "cuda":
            model.language_model.fuse_projections()  # fewer, larger matrix products per decode step
        self.model, self.processor, self.tokenizer = model, processor, processor.tokenizer
        self.model_id, self.options, self.config = model_id, options, model.config
        cfg = model.config
        self.eos_token_ids = eos_token_ids(folder, self.tokenizer)
        self.prompts = PromptBuilder(
            processor, image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
            merge_size=cfg.vision.spatial_merge_size, image_options=options.image_options(),
            min_pixels=options.min_pixels, max_pixels=options.max_pixels, pixel_dtype=model.dtype,
            max_media=options.max_media_per_prompt, max_concurrent_decodes=options.max_concurrent_decodes,
        )
        options.check_cache_scope()
        self.compaction = options.compaction_config()
        try:  # checked before anything is reserved (the host tier below)
            step = SchedulerConfig(options.max_num_seqs, options.step_budget(model.device), options.max_waiting,
                                   max_warm_tokens=options.max_warm_tokens,
                                   max_warm_images=options.max_warm_images,
                                   warm_time_share=options.warm_time_share)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        config_sha = hashlib.sha256((Path(folder) / "config.json").read_bytes()).hexdigest()
        self.namespace = "|".join([f"model={model_id}", f"config={config_sha}", self.prompts.namespace(),
                                   f"dtype={model.dtype}", f"kv={options.kv_cache_dtype}"])
        t = cfg.text
        world = parallel.world if parallel is not None else 1
        pool_shape = dict(num_layers=t.num_hidden_layers, num_kv_heads=t.num_key_value_heads // world,
                          head_dim=t.head_dim, page_size=options.page_size, kv_cache_dtype=options.kv_cache_dtype,
                          model_dtype=model.dtype)
        self.pool = PagePool.sized(options.kv_budget(model.device), **pool_shape, device=model.device)
        self.max_model_len = min(options.max_model_len or t.max_position_embeddings, self.pool.capacity_tokens)
        self.prompts.max_prompt_tokens = self.max_model_len - 1  # one token at least left to generate
        steps = options.pressure_steps()
        self.host_cache_bytes, self.host, transfers, self._host_reservation = self._host_tier(options, world)
        self.prefix_cache = PrefixCache(self.pool, steps, host=self.host, reclaim_order=options.reclaim_order) \
            if options.prefix_cache else None
        reuse = None
        if self.prefix_cache is not None:
            reuse = PrefixReuse(self.prefix_cache, self.compaction, self.namespace,
                                conversation_reuse=options.conversation_reuse,
                                mode=options.compaction_mode if self.compaction.method else "always")
        self.prefix_reuse = reuse
        scheduler = Scheduler(self.pool, step, reuse)
        decode_graphs = prefill_graphs = None
        graph_spec = None
        if options.cuda_graphs and graphs_supported(model.device):
            graph_spec = dict(decode_rows=max(options.max_num_seqs, options.graph_max_tokens),
                              max_model_len=self.max_model_len, prefill=options.prefill_graphs)
        if parallel is not None:  # workers build their pools and capture beside rank 0 (paired collectives)
            host_pages = self.host.num_pages if self.host is not None else 0
            parallel.start_workers({**pool_shape, "num_pages": self.pool.num_pages, "host_pages": host_pages},
                                   graph_spec)
        if graph_spec is not None:
            decode_graphs, prefill_graphs = capture_step_graphs(
                model, self.pool, **graph_spec, gates=transfers.gates if transfers is not None else None)
        if "attention" in self.compaction.score_names:  # its scores pass is eager only (issue 20)
            encoder = functools.partial(model.encode_vision, attention=True)
        else:
            encoder = model.encode_vision if decode_graphs is None else VisionGraphs(model)
        self._vision_counter = EncodeCounter(model.visual)
        self.vision = VisionLookup(encoder, VisionCache(options.vision_cache_bytes), self.namespace,
                                   cfg.vision.spatial_merge_size, model.device)
        scorer = reuse.token_scores if reuse is not None else None
        if parallel is None:
            runner = ModelRunner(model, self.pool, self.vision.encode_items, decode_graphs, prefill_graphs,
                                 scorer=scorer, transfers=transfers)
        else:
            from .parallel.runner import ParallelRunner

            parallel.wait_ready()
            runner = ParallelRunner(model, self.pool, self.vision.encode_items, decode_graphs, prefill_graphs,
                                    scorer=scorer, transfers=transfers, group=parallel)
        warm_up_kernels(self.pool.layers[0], model.language_model.layers[0].self_attn.heads, self.dtype)
        self.intake = Intake(self.tokenizer, model.device, self.max_model_len, reuse)
        self.loop = EngineLoop(scheduler, runner, reuse, eos_token_ids=self.eos_token_ids,
                               debug_checks=options.debug_checks)
        self._transfers = transfers
        self.forgotten = Forgotten()
        UPLOADS.attach()  # uploads validated in this process are handed to this engine (engine.media)
        self._takes_uploads = True

    def _host_tier(self, options: EngineOptions, world: int):
        """The host tier under the prefix cache: its budget in bytes (all ranks together: each
        rank holds ``1 / world`` of every page), its :class:`~engine.cache.host_pool.HostPool` of
        this rank, the copies' executor and the bytes reserved in this process's ledger
        (:mod:`engine.cache.host_memory`, released by :meth:`close`); ``(0, None, None, None)``
        when it is off (budget 0, or no prefix cache).

        Raises:
            InvalidRequestError: a budget the host cannot give (:meth:`EngineOptions.host_budget`).
        """
        if not options.prefix_cache:
            return 0, None, None, None
        budget = options.host_budget(world)
        full_page = self.pool.page_bytes * world
        pages = budget // full_page
        if pages <= 0:
            if budget > 0:  # asked for, but smaller than one page: say so rather than run without
                log.warning("host_cache_bytes=%d holds no KV page (one page is %d bytes): no host tier",
                            budget, full_page)
            return budget, None, None, None
        reservation = host_memory.reserve(pages * full_page)
        host = HostPool(self.pool, pages)
        return budget, host, KVTransfers(self.pool, host), reservation

    @classmethod
    def from_pretrained(cls, model: str | Path, *, device=None, dtype=None, **options) -> Engine:
        """Load a checkpoint folder or Hugging Face model id and start the engine loop.

        Args:
            model: local folder or model id (see :func:`engine.model.hub.resolve_checkpoint`).
            device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or None / ``"auto"`` (CUDA when available).
            dtype: ``torch.float32`` / ``bfloat16`` / ``float16`` or their names; None picks
                bfloat16 on CUDA and float32 on CPU.
            **options: fields of :class:`EngineOptions`.

        With ``tensor_parallel_size=N > 1`` this process becomes rank 0 of ``N`` (see
        :mod:`engine.parallel`): ranks ``1 .. N-1`` are started as processes that load the
        checkpoint themselves; a script that calls this must guard its top level with
        ``if __name__ == "__main__":`` (they are spawned).

        Raises:
            CheckpointError: the checkpoint cannot be found or does not match Qwen3-VL.
            InvalidRequestError: unknown options, a bad dtype, or a tensor-parallel size that does
                not divide the model's heads or exceeds the GPUs.
            TensorParallelError: a tensor-parallel rank failed to start.
        """
        from transformers import AutoProcessor

        try:
            opts = EngineOptions(**options)
        except TypeError as exc:
            raise InvalidRequestError(f"unknown engine option: {exc}") from None
        folder = resolve_checkpoint(model)
        dev = pick_device(device)
        opts.check_tensor_parallel(dev)
        model_dtype = pick_dtype(dtype, dev)
        parallel = None
        if opts.tensor_parallel_size > 1:
            from .parallel.group import TensorParallelGroup
            from .parallel.sharding import check_divisible

            check_divisible(ModelConfig.from_folder(folder).text, opts.tensor_parallel_size)
            parallel = TensorParallelGroup.launch(opts.tensor_parallel_size, folder, dev, model_dtype,
                                                  opts.tensor_parallel_timeout_s)
        try:
            net = load_model(folder, device=dev, dtype=model_dtype, progress=opts.progress)
            if parallel is not None:
                parallel.shard(net)
            processor = AutoProcessor.from_pretrained(str(folder))
            if not hasattr(processor, "image_processor"):
                raise PrismError(f"{folder} has no usable Qwen3-VL processor (got {type(processor).__name__})")
            return cls(net, processor, model_id=str(model), folder=folder, options=opts, parallel=parallel)
        except BaseException:
            if parallel is not None:
                parallel.close()
            raise

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
            TensorParallelError: a tensor-parallel rank failed (now, or before).
        """
        handle = self.submit(messages, sampling, cache_salt=cache_salt)
        try:
            return handle.result()
        finally:
            if not handle.done:  # interrupted while waiting (KeyboardInterrupt): free its pages
                handle.cancel(wait=False)

    def stream(
        self, messages, sampling: SamplingParams | None = None, *, cache_salt: str | None = None
    ) -> Iterator[str | Completion]:
        """Yield text deltas as they are generated, then the :class:`Completion`.

        Deltas never split a UTF-8 character or an emoji sequence and never contain any part of a
        stop string; joined they equal ``Completion.text``. Closing the iterator early (or
        dropping it) cancels the request and frees its KV pages. ``cache_salt`` and errors are
        those of :meth:`generate`; input errors are raised here, before iteration starts.
        """
        return iter(self.submit(messages, sampling, cache_salt=cache_salt))

    def submit(self, messages, sampling: SamplingParams | None = None, *,
               cache_salt: str | None = None) -> RequestHandle:
        """Validate and queue a request; read its outputs through the returned handle.

        Iterate the :class:`~engine.serving.handle.RequestHandle` (``for`` in a thread, ``async
        for`` in an event loop) for the deltas and the :class:`Completion`, or call its
        ``result()``; its ``prompt_tokens`` is the prompt's length, known now; its ``cancel()``
        (or :meth:`cancel`) stops the request. The handle's ``outbox`` (formerly
        ``Request.outbox``, what this method returned before) still works for one release, with a
        DeprecationWarning.

        Raises: as :meth:`generate`, except failures inside the engine loop (the handle raises those).
        """
        # close() drops self.model and self.intake; a submit racing it (prompt building is slow)
        # reads intake once, so it says "engine is closed" instead of failing on a dropped part.
        intake = self.intake
        if self.loop.closed or intake is None:
            raise PrismError("engine is closed")
        if self.parallel is not None:
            self.parallel.check()  # a failed rank: refuse at once (TensorParallelError)
        salt = self.options.salt(cache_salt)
        submitted = time.perf_counter()
        prompt = self.prompts.build(messages, salt, defer=True)
        req = intake.request(prompt, sampling or SamplingParams(), salt, submitted)
        self.loop.submit(req)
        return RequestHandle(req.id, req.outbox, functools.partial(self.loop.cancel, req),
                             prompt_tokens=req.num_prompt, request=req)

    def warm(self, images, *, system: str | None = None, cache_salt: str | None = None) -> WarmHandle:
        """Build and cache the public prefix that every question about ``images`` attaches, before
        the first question comes (the app calls it when a chat's images change).

        The prefix is that of :func:`~engine.inputs.prompts.media_first_messages` ``(images,
        question, system=system)`` for any question: the images preprocessed, encoded (vision
        tower and DeepStack) and prefilled up to the last image's ``<|vision_end|>``; nothing is
        sampled. A warm runs below every question (docs/ARCHITECTURE.md, "Warms"): it takes only
        free pages or those of entries nobody hit, is the first to give its pages up, and is
        dropped when there is no room (its ``result()`` raises EngineOverloadedError). A question
        sent while the warm computes waits for it and hits its prefix (``Telemetry.warmed`` on the
        first that attaches it). Warming a cached prefix (on the GPU or in the host tier) ends at
        once.

        Args:
            images: as :func:`~engine.inputs.prompts.media_first_messages` takes them (image
                sources, image parts with a ``sha256``, ``{"video": ...}`` parts), in order.
            system: the system message the questions will carry, if any.
            cache_salt: the chat session (as :meth:`generate`).

        Returns:
            a :class:`~engine.serving.handle.WarmHandle`: ``result(timeout)`` gives the prefix
            length in tokens once it is cached, ``cancel()`` stops it and frees its pages.

        Raises:
            InvalidRequestError: no images, malformed parts, or prefix caching off.
            InvalidImageError, InvalidVideoError: an image or clip cannot be used.
            RequestTooLargeError: a question after this prefix would not fit the engine's limit.
            EngineOverloadedError: the waiting queue is full.
            PrismError: the engine is closed.
        """
        return self.warm_prefix(prefix_messages(images, system=system), cache_salt=cache_salt)

    def warm_prefix(self, messages, *, cache_salt: str | None = None) -> WarmHandle:
        """:meth:`warm` for the public prefix of ``messages`` (everything up to the last image's
        or video's ``<|vision_end|>``; what follows is not computed): the form the engine core in
        another process receives. Raises: as :meth:`warm`."""
        intake = self.intake
        if self.loop.closed or intake is None:
            raise PrismError("engine is closed")
        if self.parallel is not None:
            self.parallel.check()
        salt = self.options.salt(cache_salt)
        submitted = time.perf_counter()
        prompt = self.prompts.build(messages, salt, defer=True)
        req = intake.warm_request(prompt, salt, submitted)
        self.loop.submit(req)
        handle = RequestHandle(req.id, req.outbox, functools.partial(self.loop.cancel, req),
                               prompt_tokens=req.num_prompt, request=req)
        return WarmHandle(handle, prompt.prefix_len)

    def cancel(self, handle: RequestHandle, wait: bool = True) -> None:
        """Stop the request of ``handle`` (what :meth:`submit` returned); its KV pages are freed
        before the engine's next step. The same as ``handle.cancel(wait)``.

        With ``wait`` the call returns once the pages are free. A
        :class:`~engine.serving.request.Request` (what :meth:`submit` returned before) is still
        accepted for one release, with a DeprecationWarning.
        """
        if isinstance(handle, Request):
            warnings.warn("Engine.cancel(Request) is deprecated and goes in the next release: pass the "
                          "RequestHandle that Engine.submit returns", DeprecationWarning, stacklevel=2)
            self.loop.cancel(handle, wait)
            return
        handle.cancel(wait)

    def stats(self) -> dict:
        """Engine counters: KV pool pages (total, used, free, page size, capacity in tokens),
        running and waiting requests, steps run, tokens generated, and the prefix cache's
        entries (``cache_entries``: the public prefixes, counted in ``cache_prefixes``, plus the
        finished turns kept for conversation reuse), pages held (``cache_pages``; of them the
        public prefixes' ``cache_prefix_pages``, against ``cache_prefix_pages_dense`` without
        compaction), hits, misses, stale fallbacks, evictions (``cache_evictions``, the sum of
        ``cache_prefix_evictions``, image prefixes, and ``cache_extension_evictions``, finished
        turns kept for reuse), prompt tokens saved, compactions made to free pages under
        ``compaction_mode="on_pressure"`` and the pages they freed (``cache_pressure_compactions``,
        ``cache_pressure_pages_freed``; one per step of one entry);
        the processed-image cache's hits, entries and refused entries (``image_cache_hits``,
        ``image_cache_entries``, ``image_cache_mismatches``) and the vision-feature cache's hits
        and entries; with the vision encoder's CUDA graphs, their eager runs, captures and
        replays (``vision_graph_*``); what :meth:`forget` dropped so far (``forgotten_sessions``,
        ``forgotten_cache_entries``, ``forgotten_vision_features``, ``forgotten_processed_images``,
        ``forgotten_decoded_videos``, ``forgotten_vision_graphs``); the host tier
        (``host_cache_bytes``: its budget, 0 when off; ``host_pages_total``, ``host_pages_used``,
        ``host_bytes_allocated``; ``cache_host_entries``: prefixes on it now; ``cache_offloads``,
        ``cache_restores``: families moved down and back; ``cache_host_evictions``: entries dropped
        from it, not counted in ``cache_evictions``; ``cache_hits_host``: hits on an entry found
        there, counted in ``cache_hits`` too; ``cache_transfer_failures``: copies that failed).
        Every cache is keyed by the cache salt, so each hit is one within a session (or under
        ``cache_scope="global"``).

        Raises:
            PrismError: the engine is closed.
        """
        with self.loop.paused():
            if self.loop.closed:
                raise PrismError("engine is closed")
            cache = self.prefix_cache.counters() if self.prefix_cache is not None else {"prefix_cache": False}
            cache["host_cache_bytes"] = self.host_cache_bytes
            forgotten = {f"forgotten_{k}": v for k, v in dataclasses.asdict(self.forgotten).items()}
            return {**self.pool.counters(), **self.loop.counters(), **cache, **self.prompts.counters(),
                    **self.vision.counters(), **forgotten}

    def prefix_info(self, cache_salt: str | None, images: list[str | None] | None = None, *,
                    preview: bool = False) -> list[dict] | None:
        """What the compact prefix the session's next question would attach kept of each image:
        the latest prefix cached under ``cache_salt`` (created or hit last), restricted to one
        built from exactly ``images`` when given (each image's content key as its message part
        named it, in prompt order: the hex SHA-256 of a file's bytes, see
        :attr:`~engine.inputs.prompts.Prompt.image_keys`), so that a session whose images changed
        since its last question is told nothing is cached rather than shown another prefix.

        Only token indices leave the engine, never KV; read under the loop's lock and copied out,
        so it may be called from any thread while requests run. Salts stay out of :meth:`stats`.

        Returns:
            None when no such prefix is cached (none yet, evicted, prefix caching off, or a new
            engine since); else one dict per image of the prefix, in prompt order:
            ``image`` (int, its index), ``rows``, ``cols`` (int: the image's merged-token grid as
            the vision encoder sees it, patch grid / spatial merge size, EXIF orientation
            applied), ``kept`` (``rows`` lists of ``cols`` bools, row-major: whether that visual
            token's KV is kept), ``kept_count`` (int, tokens), ``selector`` (str, a key of
            :data:`engine.cache.compaction.SELECTORS`, or None for a dense prefix) and
            ``keep_ratio`` (float, 1.0 when dense); and ``preview`` (bool), ``step`` (int or
            None) and ``steps`` (int, how many compaction steps on pressure the engine has); and
            ``tier`` (``"gpu"`` or ``"host"``: where the prefix's KV lives now, the host tier
            including a restore in flight).

            With ``preview`` (the viewer's "what a compaction would keep"): when the prefix has a
            compaction step on pressure still ahead (``compaction_mode="on_pressure"``, see
            :meth:`~engine.cache.prefix_cache.PrefixCache.next_step`), ``kept``, ``kept_count``,
            ``selector`` and ``keep_ratio`` describe what that step would keep, ``preview`` is
            True and ``step`` is its index in the steps (0: the first); nothing is compacted by
            asking, and a compaction at that step keeps exactly these tokens. Without a step
            ahead (compacted when cached, or every step done) it reports what is kept now, with
            ``preview`` False, as without ``preview``.

        Raises:
            PrismError: the engine is closed.
        """
        with self.loop.paused():
            reuse = self.prefix_reuse  # read once: close() drops it
            if self.loop.closed:
                raise PrismError("engine is closed")
            return None if reuse is None else reuse.prefix_info(self.options.salt(cache_salt), images, preview=preview)

    def forget(self, cache_salt: str) -> Forgotten:
        """Drop everything the engine keeps of one session (cache salt), at once: its prefix-cache
        entries (public prefixes and conversation extensions; their pages go back to the pool),
        its vision features, its processed images and decoded clips, its uploads decoded by their
        validation and not yet asked about (:mod:`engine.media`; not counted), and its vision
        encoder CUDA graphs with their sightings. Its next question is a miss that runs the vision encoder
        again; other salts' entries are untouched.

        A request of that salt queued or running when ``forget`` is called finishes first
        (``forget`` does not cancel it: cancel it first to end it sooner), so nothing it computed
        is left behind; the salt's warms are cancelled (their ``result()`` raises); ``forget``
        returns once it has and everything is dropped. A request of the salt submitted meanwhile
        or later is a new one: it runs, and caches, as usual. Under
        ``cache_scope="global"`` nothing is any one session's: nothing is dropped.

        Returns:
            The counts dropped (:class:`Forgotten`), also added to ``stats()``'s ``forgotten_*``.

        Raises:
            InvalidRequestError: ``cache_salt`` is not a non-empty string (the empty salt is the
                anonymous session every request without a salt shares).
            PrismError: the engine is closed.
        """
        if not isinstance(cache_salt, str) or not cache_salt:
            raise InvalidRequestError("forget needs a session's cache salt (a non-empty string)")
        with self.loop.paused():
            if self.loop.closed:
                raise PrismError("engine is closed")
            if self.options.salt(cache_salt) != cache_salt:  # cache_scope="global": no session has its own
                return Forgotten()
            self.loop.wait_for_salt(cache_salt)
            if self.loop.closed:  # it stopped while the salt's requests ran
                raise PrismError("engine is closed")
            cache = self.prefix_cache
            entries = cache.forget(cache_salt) if cache is not None else 0
            features, graphs = self.vision.forget(cache_salt)
            images, videos = self.prompts.forget(cache_salt)
            UPLOADS.forget(cache_salt)  # decoded uploads never asked about: nothing was used, not counted
            done = Forgotten(1, entries, features, images, videos, graphs)
            self.forgotten += done
            return done

    def count_prompt_tokens(self, messages, *, cache_salt: str | None = None) -> int:
        """Prompt length in tokens of ``messages`` (images processed and cached under
        ``cache_salt``, as :meth:`generate` would; nothing run)."""
        return len(self.prompts.build(messages, self.options.salt(cache_salt), defer=True).input_ids)

    def clear_prefix_cache(self) -> None:
        """Evict every cached prefix that no running request uses."""
        with self.loop.paused():
            cache = self.prefix_cache  # read once: close() drops it
            if cache is not None:
                cache.clear()

    def vision_features(self, prompt: Prompt, salt: str = "") -> VisionFeatures:
        """Vision features of a prompt's images and videos, in prompt order (``prompt.visual_rows()``)."""
        return self.vision.encode_prompt(prompt, salt)[0]

    def encode_prompt_vision(self, prompt: Prompt, salt: str = "") -> tuple[VisionFeatures, bool]:
        """Deprecated (removed in the next release): use :meth:`vision_features`, or
        ``engine.vision.encode_prompt`` for whether the encoder ran.

        Vision features of all of a prompt's visual tokens, in prompt order
        (``prompt.visual_rows()``), and whether the encoder had to run. Warns ``DeprecationWarning``.
        """
        warnings.warn("Engine.encode_prompt_vision is deprecated and will be removed; use "
                      "Engine.vision_features", DeprecationWarning, stacklevel=2)
        return self.vision.encode_prompt(prompt, salt)

    def encode_items(self, prompt: Prompt, salt: str, items: list[tuple[str, int]]) -> tuple[dict, bool]:
        """Deprecated (removed in the next release): the serving core encodes a step's items
        itself (:meth:`engine.inputs.vision_features.VisionLookup.encode_items`, ``engine.vision``).

        Vision features of some of a prompt's images and videos. Warns ``DeprecationWarning``.
        """
        warnings.warn("Engine.encode_items is deprecated and will be removed; the engine encodes a step's "
                      "images itself (engine.vision.encode_items)", DeprecationWarning, stacklevel=2)
        return self.vision.encode_items(prompt, salt, items)

    def close(self) -> None:
        """Stop the loop (running requests fail with PrismError) and release memory."""
        if self._takes_uploads:  # also for a loop that stopped itself
            self._takes_uploads = False
            UPLOADS.detach()
        if not self.loop.close():
            return
        self._vision_counter.remove()
        if self.parallel is not None:
            self.parallel.close()
        if self._transfers is not None:  # copies in flight land first; then the pinned memory goes
            self._transfers.close()
            self.host.close()
            self._host_reservation.release()
        # drop every reference to the model, the KV pool and the captured graphs so their memory goes
        self.pool = self.model = self.prefix_cache = self.prefix_reuse = self.vision = self.intake = None
        self.host = self._transfers = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def tensor_parallel_counters(self) -> list[dict]:
        """Per-rank counters, rank 0 first: ``vision_images_encoded`` (images that rank's vision
        tower encoded; under tensor parallelism only rank 0 encodes, so they sum to the images
        encoded, not to that times the ranks) and ``steps`` (forwards run; rank 0's is the loop's);
        a worker's also ``page_copies`` and ``slot_moves`` (the copy-on-write copies and compaction
        moves rank 0 sent it and it applied), ``offloads`` and ``restores`` (the host-tier copies of
        its shard it ran) and ``transfers_held`` (its copies not yet let go: 0 between steps on
        the CPU). One entry with tensor parallelism off.

        Raises:
            PrismError: the engine is closed. TensorParallelError: a rank failed.
        """
        with self.loop.paused():
            if self.loop.closed:
                raise PrismError("engine is closed")
            ranks = self.parallel.counters() if self.parallel is not None else [{}]
            ranks[0] = {"vision_images_encoded": self._vision_counter.images, "steps": self.loop.steps}
            return ranks

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
