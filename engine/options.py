"""The engine's settings (:class:`EngineOptions`) and the values they settle into for a device."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .cache import host_memory
from .cache.compaction import COMPACTION_MODES, CompactionConfig, pressure_ratios
from .cache.kv_pool import KV_DTYPES
from .errors import InvalidRequestError
from .inputs.images import ImageOptions

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CACHE_SCOPES = ("session", "global")


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
        host_cache_bytes: size in bytes of the host-memory tier under the prefix cache (idle KV
            offloaded to host RAM, pinned on CUDA, and copied back on a hit), for the whole engine:
            under tensor parallelism the ranks split it (each holds ``1 / N`` of every page), unlike
            ``kv_cache_bytes``, which each rank has. 0: no host tier. None: the environment
            variable ``PRISM_HOST_CACHE_BYTES`` if set (bytes, or with a unit: ``512M``, ``4G``),
            else the default share of this host's memory, :data:`~engine.cache.host_memory.
            DEFAULT_SHARE` (25 %) of what other engines of this process left, capped by the memory
            available less a headroom (:mod:`engine.cache.host_memory` says why). More than the
            host can give is refused when the engine is built (see :meth:`host_budget`).
        page_size: tokens per KV page.
        max_num_seqs, max_num_batched_tokens, max_waiting: scheduler limits
            (see :class:`~engine.serving.scheduler.SchedulerConfig`). ``max_num_batched_tokens`` None
            means 8,192 on CUDA and 1,024 on the CPU. On CUDA an 8-photo prompt (~1.7k tokens) is
            then prefilled in one step, and a running stream waits at most one 8k-token step (about
            five times the 51 ms of a 1,662-token prefill of an 8B model on the H200).
        debug_checks: check the pool's page accounting after every step (slow; for tests).
        prefix_cache: keep the KV of each prompt's public prefix for later questions.
        compaction: a selector of :data:`~engine.cache.compaction.SELECTORS` (``"uniform"``,
            ``"attention"``, ``"diversity"``, ``"random"``) or None: how a cached prefix drops
            visual tokens. ``"attention"`` runs the vision encoder eagerly (its score pass is not
            in the encoder's CUDA graphs).
        keep_ratio, min_keep, compact_video: compaction settings (see
            :class:`~engine.cache.compaction.CompactionConfig`).
        merge_values: the merging variant of compaction (off by default; issue 35.3): each dropped
            visual token's V is folded into its nearest kept neighbour's, keys untouched (see
            :func:`~engine.cache.compaction.value_merge_plan` for what it computes and costs).
            Needs ``compaction`` set.
        compaction_mode: when a cached prefix is compacted (with ``compaction`` set): ``"always"``
            (when it is computed, so every answer uses the compact prefix) or ``"on_pressure"``
            (cached dense; compacted only when the KV pool must free pages, after idle
            conversation extensions and before evicting whole prefixes: see
            :mod:`engine.cache.prefix_cache`). Default ``"on_pressure"``: on the H200 working-set
            benchmark it kept the hits and TTFT p99 of ``"always"`` at knee and pressure while
            92% of the knee's answers used every visual token (docs/PERFORMANCE.md, "Working set").
        pressure_keep_ratios: under ``"on_pressure"``, the keep ratio of each compaction step in
            order, decreasing within (0, 1], each step choosing among the tokens the one before kept
            (None: one step to ``keep_ratio``). E.g. ``(0.6, 0.4)``. A ratio of 1.0 keeps every
            token and is no step: it may come only first, and ``keep_ratio=1.0`` (or ``(1.0,)``)
            under ``"on_pressure"`` caches every prefix dense and never compacts it.
        cache_scope: ``"session"`` (prefixes are shared only under the same ``cache_salt``) or
            ``"global"`` (salts ignored; for single-user setups).
        conversation_reuse: also keep a finished turn's KV so the next turn of the same chat
            prefills only its new question.
        reclaim_order: with a host tier, the order pages are reclaimed in when the KV pool runs
            short: ``"offload_first"`` (idle prefixes move to host memory, lossless, before any is
            compacted) or ``"compact_first"`` (compaction steps first, then compacted copies move);
            see :func:`engine.cache.reclaim.reclaim_once`.
        vision_cache_bytes: bound of the per-session vision-feature cache.
        cuda_graphs: on CUDA, replay captured graphs for decode steps (see
            :mod:`engine.graphs.decode`) and for the vision encoder on image sizes seen before (see
            :mod:`engine.graphs.vision`).
        graph_max_tokens: text-only steps of up to this many new tokens (and at least
            ``max_num_seqs``) replay the graphs too, so the question after a cached prefix is
            prefilled without the host in the way.
        prefill_graphs: with ``cuda_graphs`` on CUDA, a step holding only one cold prompt (or its
            first chunk) of fewer than 512 tokens replays a graph captured for its token-count
            bucket (see :mod:`engine.graphs.prefill`).
        tensor_parallel_size: ranks the decoder is split across, one process per GPU of this host
            (gloo processes on the CPU; see :mod:`engine.parallel`). 1: this process alone. Each
            rank holds ``1 / N`` of the KV heads in a pool of ``kv_cache_bytes`` (or its default,
            measured on rank 0's GPU), so the pool holds ``N`` times the tokens of one GPU's.
        tensor_parallel_timeout_s: under tensor parallelism, how long (seconds) a collective or a
            worker's answer may take before the group is declared failed.
        max_media_per_prompt: most images and videos (together) one prompt may hold; more is an
            InvalidRequestError naming this limit, raised before any of them is decoded.
        max_concurrent_decodes: most prompts whose images and videos are decoded at once (the
            others wait their turn), so that many large requests at once cannot add up in memory.
        warm_time_share: share of the wall-clock time, in (0, 1], that warms (``Engine.warm``) may
            take while questions run or wait; 1: no time budget (see
            :class:`~engine.serving.scheduler.SchedulerConfig`). Not the app's ``--warm-share`` (a
            share of the KV pool warmed at a start).
        max_warm_tokens, max_warm_images: the per-step bounds of warms while questions run or wait
            (see :class:`~engine.serving.scheduler.SchedulerConfig`).
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
    host_cache_bytes: int | None = None
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
    merge_values: bool = False
    compaction_mode: str = "on_pressure"
    pressure_keep_ratios: tuple[float, ...] | None = None
    cache_scope: str = "session"
    conversation_reuse: bool = True
    reclaim_order: str = "offload_first"
    vision_cache_bytes: int = 256 << 20
    cuda_graphs: bool = True
    graph_max_tokens: int = 64
    prefill_graphs: bool = True
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 60.0
    max_media_per_prompt: int = 16
    max_concurrent_decodes: int = 2
    warm_time_share: float = 0.03
    max_warm_tokens: int = 512
    max_warm_images: int = 2

    def image_options(self) -> ImageOptions:
        return ImageOptions(
            max_image_pixels=self.max_image_pixels, max_bytes=self.max_image_bytes, background=self.image_background
        )

    def check_kv_cache_dtype(self) -> None:
        """Raises: InvalidRequestError: ``kv_cache_dtype`` is not one of :data:`~engine.cache.kv_pool.KV_DTYPES`."""
        if self.kv_cache_dtype not in KV_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {KV_DTYPES}, got {self.kv_cache_dtype!r}")

    def check_cache_scope(self) -> None:
        """Raises: InvalidRequestError: ``cache_scope`` is neither ``"session"`` nor ``"global"``."""
        if self.cache_scope not in CACHE_SCOPES:
            raise InvalidRequestError(f"cache_scope must be 'session' or 'global', got {self.cache_scope!r}")

    def check_tensor_parallel(self, device: torch.device) -> None:
        """Raises: InvalidRequestError: ``tensor_parallel_size`` below 1, more CUDA ranks than
        GPUs, or a timeout that is not positive."""
        world = self.tensor_parallel_size
        if not isinstance(world, int) or world < 1:
            raise InvalidRequestError(f"tensor_parallel_size must be an integer >= 1, got {world!r}")
        if not self.tensor_parallel_timeout_s > 0:
            raise InvalidRequestError("tensor_parallel_timeout_s must be positive")
        if world > 1 and device.type == "cuda":
            first = device.index or 0
            if first + world > torch.cuda.device_count():
                raise InvalidRequestError(f"tensor_parallel_size={world} from {device} needs GPUs {first}.."
                                          f"{first + world - 1}; {torch.cuda.device_count()} visible")

    def compaction_config(self) -> CompactionConfig:
        """The compaction settings.

        Raises:
            InvalidRequestError: an unknown method, ``keep_ratio`` outside (0, 1], ``min_keep`` < 1.
        """
        if self.compaction_mode not in COMPACTION_MODES:
            raise InvalidRequestError(
                f"compaction_mode must be 'always' or 'on_pressure', got {self.compaction_mode!r}")
        try:
            return CompactionConfig(self.compaction, self.keep_ratio, self.min_keep, self.compact_video,
                                    self.merge_values)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None

    def pressure_steps(self) -> tuple[CompactionConfig, ...]:
        """The compaction steps applied on pressure: one per ``pressure_keep_ratios`` (default
        ``(keep_ratio,)``) below 1.0 under ``compaction_mode="on_pressure"`` with a selector; else
        none. A ratio of 1.0 keeps every token, so it is no step (``keep_ratio=1.0``: prefixes stay
        dense; see :func:`~engine.cache.compaction.pressure_ratios`).

        Raises:
            InvalidRequestError: as :meth:`compaction_config`, or ratios outside (0, 1] or not
                decreasing (checked in every mode, so a bad setting is refused wherever it is given).
        """
        base = self.compaction_config()
        try:
            ratios = pressure_ratios(self.pressure_keep_ratios or (self.keep_ratio,))
        except ValueError as exc:
            raise InvalidRequestError(f"pressure_keep_ratios: {exc}") from None
        if self.compaction_mode != "on_pressure" or base.method is None:
            return ()
        return tuple(CompactionConfig(base.method, r, base.min_keep, base.compact_video, base.merge_values)
                     for r in ratios)

    def salt(self, cache_salt: str | None) -> str:
        """The salt every cache of a request is keyed by: the caller's (None is the one anonymous
        session, ""), or "" for all under ``cache_scope="global"``."""
        return "" if self.cache_scope == "global" else (cache_salt or "")

    def step_budget(self, device: torch.device) -> int:
        """Most tokens one step computes: the option, or its device default."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 8192 if device.type == "cuda" else 1024

    def kv_budget(self, device: torch.device) -> int:
        """Bytes of the KV pool: the option, or on CUDA ``gpu_memory_utilization`` of the free
        memory (after loading the model), on the CPU 512 MiB."""
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * self.gpu_memory_utilization)
        return 512 << 20

    def host_budget(self, tensor_parallel: int = 1) -> int:
        """Bytes of the host-memory tier for the whole engine (all ``tensor_parallel`` ranks
        together, so each holds ``host_budget // tensor_parallel``; the result is a multiple of
        ``tensor_parallel``): ``host_cache_bytes``, else ``PRISM_HOST_CACHE_BYTES``, else the
        default share (:meth:`~engine.cache.host_memory.HostLedger.default_bytes`). 0: no tier.

        Reads this process's ledger, reserves nothing: the caller reserves the result
        (:func:`engine.cache.host_memory.reserve`) and releases it when the engine closes.

        Raises:
            InvalidRequestError (a ValueError): a negative or non-integer size, an unreadable
                ``PRISM_HOST_CACHE_BYTES``, ``tensor_parallel`` below 1, or more than the host can
                give (the message says how much it has, how much is asked, how much other engines
                of this process reserved, and how to lower it).
        """
        if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
            raise InvalidRequestError(f"tensor_parallel must be an integer >= 1, got {tensor_parallel!r}")
        asked = self.host_cache_bytes
        if asked is None:
            asked = host_cache_bytes_from_env(os.environ)
        try:
            if asked is None:
                budget = host_memory.default_bytes()
            else:
                host_memory.LEDGER.check(asked)
                budget = asked
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        return budget - budget % tensor_parallel


#: The environment variable read when ``EngineOptions.host_cache_bytes`` is None (launch.py's
#: ``--host-cache-bytes`` reads the same one).
HOST_CACHE_ENV = "PRISM_HOST_CACHE_BYTES"


def host_cache_bytes_from_env(environ) -> int | None:
    """``PRISM_HOST_CACHE_BYTES`` of ``environ`` in bytes, None when unset or empty.

    Raises:
        InvalidRequestError: the value is not a size (:func:`~engine.cache.host_memory.parse_size`).
    """
    text = environ.get(HOST_CACHE_ENV, "").strip()
    if not text:
        return None
    try:
        return host_memory.parse_size(text)
    except ValueError as exc:
        raise InvalidRequestError(f"{HOST_CACHE_ENV}={text[:40]!r}: {exc}") from None


def pick_device(device) -> torch.device:
    """``device`` as a :class:`torch.device`; None or ``"auto"``: CUDA when available, else the CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype, device: torch.device) -> torch.dtype:
    """The model dtype: ``dtype`` (a torch dtype or its name); None / ``"auto"``: bfloat16 on CUDA,
    float32 on the CPU.

    Raises:
        InvalidRequestError: not float32, bfloat16 or float16.
    """
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
