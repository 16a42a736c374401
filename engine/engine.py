"""The public engine: load a Qwen3-VL checkpoint, then answer chat messages.

>>> from engine import Engine, SamplingParams
>>> with Engine.from_pretrained("path/to/checkpoint") as engine:
...     done = engine.generate([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=8))
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .attention import DenseKVCache
from .detokenize import TextStream
from .errors import InvalidRequestError, PrismError
from .hub import resolve_checkpoint
from .images import ImageOptions
from .inputs import Prompt, PromptBuilder
from .model import Qwen3VL, load_model
from .outputs import Completion, Telemetry
from .rope import decode_positions
from .sampling import Sampler, SamplingParams
from .text import VisualInjection
from .vision import VisionFeatures

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
            ``max_position_embeddings``).
        progress: show progress bars while loading.
    """

    min_pixels: int | None = None
    max_pixels: int | None = None
    max_image_pixels: int = ImageOptions.max_image_pixels
    max_image_bytes: int = ImageOptions.max_bytes
    image_background: tuple[int, int, int] = ImageOptions.background
    max_model_len: int | None = None
    progress: bool = True

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
    """A loaded Qwen3-VL model with its processor, answering chat requests.

    Build it with :meth:`from_pretrained`. :meth:`generate` and :meth:`stream` may be called from
    several threads; requests run one at a time.
    """

    def __init__(self, model: Qwen3VL, processor, *, model_id: str, folder: Path, options: EngineOptions):
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.model_id = model_id
        self.options = options
        cfg = model.config
        self.config = cfg
        self.eos_token_ids = _eos_ids(folder, self.tokenizer)
        self.max_model_len = options.max_model_len or cfg.text.max_position_embeddings
        self.prompts = PromptBuilder(
            processor,
            image_token_id=cfg.image_token_id,
            video_token_id=cfg.video_token_id,
            merge_size=cfg.vision.spatial_merge_size,
            image_options=options.image_options(),
            min_pixels=options.min_pixels,
            max_pixels=options.max_pixels,
        )
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, model: str | Path, *, device=None, dtype=None, **options) -> Engine:
        """Load a checkpoint folder or Hugging Face model id.

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

    def generate(self, messages, sampling: SamplingParams | None = None) -> Completion:
        """Answer ``messages`` and return the whole :class:`Completion`.

        Raises:
            InvalidRequestError: malformed messages, or prompt + ``max_tokens`` beyond the model length.
            InvalidImageError: an image cannot be used.
        """
        for item in self.stream(messages, sampling):
            if isinstance(item, Completion):
                return item
        raise RuntimeError("stream ended without a completion")  # pragma: no cover

    def stream(self, messages, sampling: SamplingParams | None = None) -> Iterator[str | Completion]:
        """Yield text deltas as they are generated, then the :class:`Completion`.

        Deltas never split a UTF-8 character or an emoji sequence and never contain any part of a
        stop string; joined they equal ``Completion.text``. Errors are those of :meth:`generate`.
        """
        if self._closed:
            raise PrismError("engine is closed")
        sampling = sampling or SamplingParams()
        submitted = time.perf_counter()
        with self._lock:
            yield from self._run(messages, sampling, submitted)

    def count_prompt_tokens(self, messages) -> int:
        """Prompt length in tokens of ``messages`` (images processed, nothing run)."""
        return len(self.prompts.build(messages).input_ids)

    def close(self) -> None:
        """Release the model's memory; later calls raise :class:`PrismError`."""
        with self._lock:
            self._closed = True
            self.model = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ one request
    def _run(self, messages, sampling: SamplingParams, submitted: float):
        tel = Telemetry()
        started = time.perf_counter()
        tel.queue_ms = (started - submitted) * 1e3
        prompt = self.prompts.build(messages)
        n = len(prompt.input_ids)
        if n + sampling.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model length "
                f"({self.max_model_len} tokens)"
            )
        tel.prompt_tokens = tel.computed_tokens = n
        tel.visual_tokens = prompt.num_visual_tokens
        visual = None
        if prompt.spans:
            t = time.perf_counter()
            features = self.vision_features(prompt)
            self._sync()
            tel.vision_ms = (time.perf_counter() - t) * 1e3
            tel.vision_encoder_ran = True
            visual = VisualInjection(prompt.visual_rows().to(self.device), features.embeds, features.deepstack)
        text_cfg = self.config.text
        cache = DenseKVCache(
            text_cfg.num_hidden_layers, n + sampling.max_tokens, text_cfg.num_key_value_heads,
            text_cfg.head_dim, self.dtype, self.device,
        )
        sampler = Sampler(sampling, self.device)
        stream = TextStream(self.tokenizer, sampling.stop)
        seen = torch.tensor(prompt.input_ids, device=self.device)
        t = time.perf_counter()
        ids = torch.tensor(prompt.input_ids, device=self.device)
        last = torch.tensor([n - 1], device=self.device)
        logits = self.model(ids, prompt.positions.to(self.device), cache.step(n), visual, last)[0]
        generated: list[int] = []
        finish = "length"
        first_token_at = None
        while True:
            token = sampler(logits, seen if sampling.repetition_penalty != 1.0 else None)
            generated.append(token)
            if first_token_at is None:
                first_token_at = time.perf_counter()
                tel.prefill_ms = (first_token_at - t) * 1e3
                tel.ttft_ms = (first_token_at - submitted) * 1e3
            if token in self.eos_token_ids and not sampling.ignore_eos:
                finish = "stop"
                break
            delta = stream.push(token)
            if delta:
                yield delta
            if stream.stopped:
                finish = "stop"
                break
            if len(generated) >= sampling.max_tokens:
                break
            if sampling.repetition_penalty != 1.0:
                seen = torch.cat([seen, torch.tensor([token], device=self.device)])
            index = torch.tensor([n + len(generated) - 1], device=self.device)
            pos = decode_positions(index, prompt.rope_delta)
            logits = self.model(torch.tensor([token], device=self.device), pos, cache.step(1))[0]
        tail = stream.finish()
        if tail:
            yield tail
        done = time.perf_counter()
        tel.generated_tokens = len(generated)
        tel.e2e_ms = (done - submitted) * 1e3
        if len(generated) > 1:
            decode_s = done - first_token_at
            tel.decode_tokens_per_s = (len(generated) - 1) / decode_s if decode_s > 0 else 0.0
            tel.tpot_ms = decode_s * 1e3 / (len(generated) - 1)
        yield Completion(stream.text, generated, prompt.input_ids, finish, tel)

    def vision_features(self, prompt: Prompt) -> VisionFeatures:
        """Run the vision encoder on a prompt's images and videos.

        Returns features of all visual tokens in prompt order (``prompt.visual_rows()``).
        """
        parts = {}
        if prompt.image_grids:
            parts["image"] = self.model.encode_vision(prompt.pixel_values, prompt.image_grids)
        if prompt.video_grids:
            parts["video"] = self.model.encode_vision(prompt.pixel_values_videos, prompt.video_grids)
        if len(parts) == 1:
            return next(iter(parts.values()))
        # images and videos interleaved: gather each span's rows from its own feature tensor
        offsets = {"image": 0, "video": 0}
        pieces = []
        for span in prompt.spans:
            start = offsets[span.kind]
            rows = torch.arange(start, start + span.length, device=self.device)
            pieces.append(parts[span.kind].select(rows))
            offsets[span.kind] += span.length
        return VisionFeatures.concat(pieces)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
