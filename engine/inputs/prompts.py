"""From chat messages to model inputs.

Messages use the transformers chat format::

    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": [{"type": "image", "image": <PIL.Image | path | bytes>},
                                  {"type": "text", "text": "What is this?"}]}]

plus video parts, either a file or a list of frames:

* ``{"type": "video", "video": <path | bytes>}``: an MP4, WebM or animated GIF file, decoded by
  :mod:`engine.inputs.video` (PyAV, our limits) and sampled exactly as transformers' Qwen3-VL video
  processor samples it with its PyAV backend (the checkpoint's ``fps``, ``min_frames``,
  ``max_frames``); each temporal patch's timestamp is the mean of its frames' ``index / rate``.
* ``{"type": "video", "video": [frame, frame, ...], "fps": 2.0}``: frames already sampled, taken
  one for one (no sampling): frame ``i`` is at ``i / fps`` seconds (``fps`` defaults to 2), so a
  temporal patch of frames ``2k, 2k+1`` is labelled ``(2k + 0.5) / fps`` seconds.

An image part whose
source is a file or bytes may carry ``"sha256"``, the hex SHA-256 of those bytes, when the caller
already knows it (the app's store is content-addressed): a question about images processed before
then neither reads nor hashes them. The digest is checked against the bytes whenever the image is
processed, so a wrong one is refused and never enters the processed-image cache; but for an image
the same session (cache salt) processed before it is taken on trust, so pass digests from your own
records only, never from a client (whoever knows a digest could otherwise ask about that image
without having it). Images are opened by :mod:`engine.inputs.images` (our safety rules) and
processed and cached by :mod:`engine.inputs.processed_images`; the chat template, tokenizer and
pixel processing are the checkpoint's own transformers processor.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InvalidRequestError, RequestTooLargeError
from ..model.rope import VisualSpan, find_visual_spans, mrope_positions
from .images import _FORMATS as _IMAGE_FORMATS
from .images import ImageOptions, image_sha256, open_image
from .processed_images import BYTE_SOURCES, DeferredPixels, ProcessedImage, ProcessedImages, Source
from .video import DecodedVideo, DecodedVideos, VideoOptions, VideoSampling, sample_indices, video_demuxer

ROLES = ("system", "user", "assistant")
_HEX64 = re.compile("[0-9a-fA-F]{64}")
DEFAULT_VIDEO_FPS = 2.0


@dataclass
class Prompt:
    """A tokenised prompt with its pixels and logical positions.

    Attributes:
        input_ids: prompt token ids, visual placeholders expanded.
        positions: int64 ``[3, len(input_ids)]`` M-RoPE positions.
        rope_delta: generated token at sequence index ``j`` gets position ``j + rope_delta``.
        spans: visual token runs (images, video frames) in prompt order.
        image_pixels / image_grids: each image's processor patches ``[t*h*w, C*T*P*P]`` and its
            ``(t, h, w)`` grid (patches), in order.
        pixel_values_videos / video_grids: the same for videos.
        image_hashes: SHA-256 of each image's decoded pixels, in order.
        video_hashes: per video, in order: SHA-256 over its frames' hashes and fps (a frame list), or
            over the sampling settings and the file's SHA-256 (a file).
        image_keys: each image as its caller names it, in order: the SHA-256 (hex) of a file's or
            bytes' content (the part's ``sha256`` when given), ``"pil:"`` and the pixels' SHA-256
            for a PIL image, None for a source without one. A caller asks about its cached
            prefix by these (``Engine.prefix_info``).
    """

    input_ids: list[int]
    positions: torch.Tensor
    rope_delta: int
    spans: list[VisualSpan]
    image_pixels: list[torch.Tensor] = field(default_factory=list)
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)
    pixel_values_videos: torch.Tensor | None = None
    video_grids: list[tuple[int, int, int]] = field(default_factory=list)
    image_hashes: list[str] = field(default_factory=list)
    video_hashes: list[str] = field(default_factory=list)
    image_keys: list[str | None] = field(default_factory=list)
    deferred: DeferredPixels | None = field(default=None, compare=False, repr=False)

    @property
    def pixel_values(self) -> torch.Tensor | None:
        """All images' patches concatenated (the processor's ``pixel_values``), or None.

        Raises:
            ValueError: some images' patches are deferred and not processed yet."""
        if any(p is None for p in self.image_pixels):
            raise ValueError("the prompt's deferred images are not processed yet (Prompt.deferred)")
        return torch.cat(self.image_pixels) if self.image_pixels else None

    @property
    def prefix_len(self) -> int:
        """Length of the public prefix: every token up to and including the last image's or
        video's ``<|vision_end|>`` (0 without images or videos)."""
        return self.spans[-1].end + 1 if self.spans else 0

    @property
    def num_visual_tokens(self) -> int:
        return sum(s.length for s in self.spans)

    def visual_rows(self) -> torch.Tensor:
        """int64 indices of all visual tokens in prompt order (images and video frames)."""
        if not self.spans:
            return torch.empty(0, dtype=torch.long)
        return torch.cat([torch.arange(s.start, s.end) for s in self.spans])


def _video_sha256(frames, fps: float) -> str:
    h = hashlib.sha256(f"fps={fps!r}".encode())
    for frame in frames:
        h.update(image_sha256(frame).encode())
    return h.hexdigest()


def _video_file_sha256(video: DecodedVideo, sampling: VideoSampling) -> str:
    return hashlib.sha256(f"file;{sampling.namespace()};{video.sha256}".encode()).hexdigest()


def _frame_list_array(frames) -> np.ndarray:
    """uint8 ``[n, H, W, 3]`` of a frame list's RGB images.

    Raises:
        InvalidRequestError: frames of different sizes.
    """
    if len({f.size for f in frames}) != 1:
        raise InvalidRequestError("the frames of a video part must all have one size")
    return np.stack([np.asarray(f, dtype=np.uint8) for f in frames])


#: Qwen3-VL's vision markers: typed into a text part they would be read as image slots.
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_MARKERS = (IMAGE_PAD, VIDEO_PAD, "<|vision_start|>", "<|vision_end|>")
#: Written into message text after each "<|", so that typed special-token names (``<|image_pad|>``,
#: ``<|im_end|>``, ...) stay plain text: read as tokens they would open image slots or end turns.
#: Neutralised rather than refused, so that a question about them, or an earlier answer quoting
#: them, does not block the conversation.
MARKER_BREAK = "\u200b"  # zero-width space


def _neutralise_markers(text: str) -> str:
    return text.replace("<|", "<" + MARKER_BREAK + "|")


def _check_marker_counts(text: str, num_images: int, num_videos: int) -> None:
    """The rendered prompt holds exactly the chat template's vision markers, one set per image and
    video part (text split between parts as ``"<"`` + ``"|image_pad|>"`` could still join into one).

    Raises:
        InvalidRequestError: any other count.
    """
    expected = {IMAGE_PAD: num_images, VIDEO_PAD: num_videos, VISION_MARKERS[2]: num_images + num_videos,
                VISION_MARKERS[3]: num_images + num_videos}
    for marker, count in expected.items():
        if text.count(marker) != count:
            raise InvalidRequestError(f"the message text forms the vision marker {marker}; remove it from the text")


def _image_claim(part: dict, n: int) -> str | None:
    """The part's ``sha256`` (lowercase hex), None without one.

    Raises:
        InvalidRequestError: not 64 hex digits, or the source is not a file or bytes.
    """
    claim = part.get("sha256")
    if claim is None:
        return None
    if not (isinstance(claim, str) and _HEX64.fullmatch(claim)):
        raise InvalidRequestError(f"message {n}: an image part's sha256 must be 64 hexadecimal digits")
    if not isinstance(part["image"], BYTE_SOURCES):
        raise InvalidRequestError(f"message {n}: sha256 is for images given as a file path or bytes")
    return claim.lower()


def _unicode_text(text: str, n: int) -> str:
    """``text``, or InvalidRequestError when it holds a lone surrogate (the tokenizer cannot encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"message {n}: the text is not valid Unicode (an unpaired surrogate "
                                  f"{text[exc.start]!r} at character {exc.start})") from None
    return text


#: A video part's file: its path or its bytes.
VIDEO_FILE_SOURCES = (str, bytes, bytearray, memoryview, os.PathLike)


def _frame_rate(part: dict, n: int) -> float:
    """A frame list's ``fps`` (default 2): a finite positive number, or InvalidRequestError."""
    fps = part.get("fps", DEFAULT_VIDEO_FPS)
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < 1000:
        raise InvalidRequestError(f"message {n}: a video part's fps must be a number between 0 and 1000")
    return float(fps)


def _normalise(messages) -> tuple[list[dict], list, list[str | None], list[tuple[list, float]]]:
    """Validate messages; return template messages, image sources, their claimed digests (None
    where not given) and videos: ``(frames, fps)`` for a frame list, ``(source, None)`` for a file."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} dicts")
    template, images, claims, videos = [], [], [], []
    for n, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES or "content" not in msg:
            raise InvalidRequestError(f"message {n} must be a dict with role in {ROLES} and content")
        content = msg["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, (list, tuple)):
            raise InvalidRequestError(f"message {n}: content must be a string or a list of parts")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": _neutralise_markers(_unicode_text(part["text"], n))})
            elif kind == "image" and "image" in part:
                claims.append(_image_claim(part, n))
                images.append(part["image"])
                parts.append({"type": "image"})
            elif kind == "video" and isinstance(part.get("video"), (list, tuple)) and part["video"]:
                videos.append((list(part["video"]), _frame_rate(part, n)))
                parts.append({"type": "video"})
            elif kind == "video" and isinstance(part.get("video"), VIDEO_FILE_SOURCES):
                if "fps" in part:
                    raise InvalidRequestError(f"message {n}: a video file's frame rate is the file's own; "
                                              "'fps' is for frame lists")
                videos.append((part["video"], None))
                parts.append({"type": "video"})
            else:
                raise InvalidRequestError(
                    f"message {n}: unsupported content part {part!r:.80}; use text, image or video parts"
                )
        template.append({"role": msg["role"], "content": parts})
    return template, images, claims, videos



def _image_header_size(source) -> tuple[int, int] | None:
    """(width, height) from an image's header (Pillow opens lazily: no pixel is decoded), None
    when it cannot be read that way."""
    import io

    from PIL import Image

    if isinstance(source, Image.Image):
        return source.size
    if not isinstance(source, (bytes, bytearray, memoryview)):
        return None
    try:
        with Image.open(io.BytesIO(source), formats=_IMAGE_FORMATS) as im:
            return im.size
    except Exception:  # any unreadable header: the decode that follows explains it
        return None


def _video_header(source) -> tuple[int, float, int, int] | None:
    """(frames, fps, width, height) from a video file's container header (0 frames where the
    container does not record them), None when it cannot be read; no frame is decoded."""
    import io

    if not isinstance(source, (bytes, bytearray, memoryview)):
        return None
    try:
        import av

        with av.open(io.BytesIO(bytes(source)), format=video_demuxer(bytes(source[:64]))) as container:
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            width, height = stream.codec_context.width, stream.codec_context.height
            if not rate or width < 1 or height < 1:
                return None
            return int(stream.frames or 0), float(rate), width, height
    except Exception:  # damaged or not a video: decode_video refuses it with its own reason
        return None


class PromptBuilder:
    """Applies the checkpoint's processor to chat messages.

    Images go through :class:`~engine.inputs.processed_images.ProcessedImages` (``images``): asking
    again in the same session about the same images skips decoding and pixel processing, and only
    the chat template and the tokenizer run.

    Args:
        processor: a transformers ``Qwen3VLProcessor``.
        image_token_id, video_token_id, merge_size: from the model config.
        image_options: our image-opening rules.
        min_pixels, max_pixels: processor resize bounds in pixels (None keeps the checkpoint's).
        cache_bytes: bound of the processed-image cache (patch tensor bytes).
        pixel_dtype: dtype images' patches are kept in (the vision encoder's; None keeps the
            processor's float32). Rounding here gives the same values as rounding on the device,
            and half the bytes to cache and to copy there in bfloat16.
        video_options: our limits on video files (:class:`~engine.inputs.video.VideoOptions`);
            frames are sampled with the checkpoint's video processor settings.

    Counters (of ``images``): ``cache_hits`` (images taken from the cache), ``cache_mismatches``
    (cached PIL images refused because their size or grid did not match the image given),
    ``cache_entries``.
    """

    def __init__(self, processor, *, image_token_id, video_token_id, merge_size, image_options=None,
                 min_pixels=None, max_pixels=None, cache_bytes: int = 256 << 20,
                 pixel_dtype: torch.dtype | None = None, video_options: VideoOptions | None = None,
                 max_media: int = 16, max_concurrent_decodes: int = 2):
        if not (isinstance(max_media, int) and max_media >= 1):
            raise InvalidRequestError(f"max_media_per_prompt must be an integer >= 1, got {max_media!r}")
        if not (isinstance(max_concurrent_decodes, int) and max_concurrent_decodes >= 1):
            raise InvalidRequestError(f"max_concurrent_decodes must be an integer >= 1, got {max_concurrent_decodes!r}")
        self.max_media = max_media
        # the decode budget shared by every request of this engine: pixels held at once are bounded
        # by max_concurrent_decodes prompts' worth, however many requests arrive together
        self._decode_slots = threading.BoundedSemaphore(max_concurrent_decodes)
        self.decodes = 0  # prompts whose media went to decoding (a counter for tests)
        #: Longest prompt the engine can take (tokens; set by the engine): a prompt whose visual
        #: tokens, counted from the files' headers, already pass it is refused before decoding.
        self.max_prompt_tokens: int | None = None
        self.processor = processor
        self.video_options = video_options or VideoOptions()
        self.video_sampling = VideoSampling.of(getattr(processor, "video_processor", None))
        self.videos = DecodedVideos(self.video_sampling, self.video_options)
        self.image_token_id, self.video_token_id, self.merge_size = image_token_id, video_token_id, merge_size
        self.image_options = image_options or ImageOptions()
        size = dict(getattr(processor.image_processor, "size", None) or {})
        if min_pixels is not None:
            size["shortest_edge"] = int(min_pixels)
        if max_pixels is not None:
            size["longest_edge"] = int(max_pixels)
        self.size = size
        self.images = ProcessedImages(processor.image_processor, size=size, image_options=self.image_options,
                                      pixel_dtype=pixel_dtype, cache_bytes=cache_bytes)

    @property
    def cache_hits(self) -> int:
        return self.images.cache_hits

    @property
    def cache_mismatches(self) -> int:
        return self.images.cache_mismatches

    @property
    def cache_entries(self) -> int:
        """Images in the processed-image cache (one per salt and image)."""
        return self.images.cache_entries

    def forget(self, salt: str) -> tuple[int, int]:
        """Drop what this builder keeps of the salt: ``(processed images, decoded clips)`` dropped."""
        return self.images.forget(salt), self.videos.forget(salt)

    def counters(self) -> dict:
        """The processed-image cache's part of :meth:`Engine.stats() <engine.Engine.stats>`: hits,
        entries, cached PIL images refused for another size or grid, images taken without their
        patches (``image_cache_deferred``) and those of them processed later after all
        (``image_cache_deferred_processed``)."""
        return {"image_cache_hits": self.cache_hits, "image_cache_entries": self.cache_entries,
                "image_cache_mismatches": self.cache_mismatches, "image_cache_deferred": self.images.deferred,
                "image_cache_deferred_processed": self.images.deferred_processed}

    def namespace(self) -> str:
        """Every setting of this builder that changes a prompt's tokens or pixels (the processor's
        resize bounds, patch, merge and temporal patch sizes, the image-opening rules): part of the
        keys of the engine's caches."""
        ip = self.processor.image_processor
        return "|".join([
            f"size={sorted(self.size.items())}", f"patch={getattr(ip, 'patch_size', None)}",
            f"merge={getattr(ip, 'merge_size', None)}", f"temporal={getattr(ip, 'temporal_patch_size', None)}",
            self.image_options.namespace(), self.video_sampling.namespace(),
            f"video_size={sorted(dict(getattr(self.processor.video_processor, 'size', None) or {}).items())}",
        ])

    def build(self, messages, salt: str = "", *, defer: bool = False) -> Prompt:
        """Tokenise ``messages`` (with the generation prompt) and process their images / videos.

        Args:
            salt: the session's cache salt: processed images are reused only under the same salt.
            defer: take images the salt sent before from the index of known images when their
                patches have left the cache: the prompt (tokens, hashes, keys) is complete, its
                ``image_pixels`` hold None for them, and ``deferred`` processes them when asked
                (the engine asks only when the prompt computes its prefix).

        Raises:
            InvalidRequestError: malformed messages.
            InvalidImageError: an image or video frame cannot be used.
            InvalidVideoError: a video file cannot be used (see :func:`~engine.inputs.video.decode_video`).
        """
        template, raw_images, claims, raw_videos = _normalise(messages)
        media = len(raw_images) + len(raw_videos)
        if media > self.max_media:
            raise InvalidRequestError(f"the prompt holds {media} images and videos; this server takes at most "
                                      f"{self.max_media} per request (max_media_per_prompt)")
        if media and self.max_prompt_tokens is not None:
            floor = self.visual_tokens_floor(raw_images, raw_videos)
            if floor > self.max_prompt_tokens:
                raise RequestTooLargeError(
                    f"the prompt's images and videos alone come to at least {floor:,} visual tokens (from their "
                    f"headers); the engine takes prompts of up to {self.max_prompt_tokens:,} tokens (max_model_len)")
        text = self.processor.apply_chat_template(template, tokenize=False, add_generation_prompt=True)
        _check_marker_counts(text, len(raw_images), len(raw_videos))
        sources = self.images.sources(raw_images, claims)
        with self._decode_slots if media else contextlib.nullcontext():
            if media:
                self.decodes += 1
            if raw_videos:
                prompt = self._build_with_videos(text, sources, raw_videos, salt)
            else:
                items = self.images.get(sources, salt, defer=defer)
                prompt = self._build_from_cache(text, items)
                pending = [(i, s, item) for i, (s, item) in enumerate(zip(sources, items, strict=True))
                           if item.pixels is None]
                if pending:
                    process = functools.partial(self._process_deferred, salt=salt)
                    prompt.deferred = DeferredPixels(process, pending, prompt.image_pixels)
        prompt.image_keys = [source.key for source in sources]
        return prompt

    def _process_deferred(self, sources: list[Source], salt: str) -> list[ProcessedImage]:
        """Deferred images processed (:class:`DeferredPixels`), under the same decode bound as
        every prompt's."""
        with self._decode_slots:
            items = self.images.get(sources, salt)
        self.images.count_deferred_processed(len(items))
        return items








    def visual_tokens_floor(self, raw_images, raw_videos) -> int:
        """A lower bound of the visual tokens of these images and video files, read from their
        headers (image size by Pillow's lazy open, a clip's frame count and rate by its demuxer),
        decoding no pixel. A file whose header cannot be read counts 0 here (decoding refuses it).

        Each image's area is clamped to the resize bounds; rounding each side to the patch grid
        keeps at least a quarter of it (a side rounds to no less than half), hence the ``// 4``."""
        ip = self.processor.image_processor
        factor = int(getattr(ip, "patch_size", 16) or 16) * self.merge_size
        temporal = int(getattr(ip, "temporal_patch_size", 2) or 2)

        def tokens(width: int, height: int, size: dict) -> int:
            area = width * height
            low, high = size.get("shortest_edge"), size.get("longest_edge")
            area = max(area, int(low)) if low else area
            area = min(area, int(high)) if high else area
            return max(1, area // (factor * factor) // 4)

        total = 0
        for source in raw_images:
            wh = _image_header_size(source)
            if wh is not None:
                total += tokens(*wh, self.size)
        video_size = dict(getattr(getattr(self.processor, "video_processor", None), "size", None) or {})
        for source, fps in raw_videos:
            if fps is not None:  # frame lists are counted by their length alone
                total += -(-len(source) // temporal)
                continue
            header = _video_header(source)
            if header is None:
                continue
            frames, rate, width, height = header
            n = len(sample_indices(frames, rate, self.video_sampling)) if frames else self.video_sampling.min_frames
            total += -(-n // temporal) * tokens(width, height, video_size)
        return total

    def _build_from_cache(self, text: str, images: list[ProcessedImage]) -> Prompt:
        """The processor's token expansion (each image pad repeated once per merged patch), without
        touching pixels; tests check it equals the processor's own output.

        The text between image pads is tokenised piece by piece and the pad ids are spliced in: the
        tokenizer splits at special tokens before anything else, so this equals tokenising the
        expanded text, without running it over ~200 pads per photo."""
        pieces = text.split(IMAGE_PAD)  # one more than images: build() checked the markers
        encoded = self.processor.tokenizer(pieces, add_special_tokens=False)["input_ids"]
        merge2 = self.merge_size**2
        input_ids = list(encoded[0])
        for im, rest in zip(images, encoded[1:], strict=True):
            input_ids += [self.image_token_id] * (im.grid[0] * im.grid[1] * im.grid[2] // merge2)
            input_ids += rest
        return self._prompt(input_ids, images, [], None, [])

    def _build_with_videos(self, text: str, sources: list[Source], raw_videos, salt: str) -> Prompt:
        """With videos the processor takes the images and videos of the prompt in one call."""
        opened = [self.images.open(source, salt) for source in sources]
        images = [im for im, _, _ in opened]
        arrays, metadata, hashes = [], [], []
        for source, fps in raw_videos:
            if fps is None:  # a file: decoded and sampled here, as transformers' PyAV backend would
                video = self.videos.get(source, salt)
                arrays.append(video.frames)
                metadata.append(video.metadata())
                hashes.append(_video_file_sha256(video, self.video_sampling))
            else:  # frames already sampled: frame i is at i / fps seconds
                frames = [open_image(f, self.image_options) for f in source]
                arrays.append(_frame_list_array(frames))
                metadata.append({"fps": fps, "total_num_frames": len(frames),
                                 "frames_indices": list(range(len(frames)))})
                hashes.append(_video_sha256(frames, fps))
        kwargs = {"return_tensors": "pt"}
        if images:
            kwargs["images"] = images
            kwargs["images_kwargs"] = {"size": self.size}
        kwargs["videos"] = arrays
        kwargs["videos_kwargs"] = {"do_sample_frames": False, "video_metadata": metadata}
        out = self.processor(text=[text], **kwargs)
        processed = []
        if images:
            grids = [tuple(g) for g in out["image_grid_thw"].tolist()]
            pixels = out["pixel_values"].split([t * h * w for t, h, w in grids])
            for (im, key, sha), g, px in zip(opened, grids, pixels, strict=True):
                processed.append(ProcessedImage(sha, g, self.images.keep(px), im.size))
                self.images.remember(salt, key, processed[-1])
        video_grids = [tuple(g) for g in out["video_grid_thw"].tolist()]
        return self._prompt(
            out["input_ids"][0].tolist(), processed, video_grids, out.get("pixel_values_videos"), hashes,
        )




    def _prompt(self, input_ids, images: list[ProcessedImage], video_grids, video_pixels, video_hashes) -> Prompt:
        image_grids = [im.grid for im in images]
        spans = find_visual_spans(
            input_ids, image_grids, video_grids,
            image_token_id=self.image_token_id, video_token_id=self.video_token_id, merge_size=self.merge_size,
        )
        positions, delta = mrope_positions(len(input_ids), spans)
        return Prompt(
            input_ids=input_ids,
            positions=positions,
            rope_delta=delta,
            spans=spans,
            image_pixels=[im.pixels for im in images],
            image_grids=image_grids,
            pixel_values_videos=video_pixels,
            video_grids=video_grids,
            image_hashes=[im.sha256 for im in images],
            video_hashes=video_hashes,
        )


def media_first_messages(images, question: str, history=None, *, system: str | None = None) -> list[dict]:
    """Chat messages in Prism's media-first layout.

    The first user turn numbers the images before any text::

        Image 1: <image>
        Image 2: <image>
        Question: {first question}

    so the public prefix (up to the last image) is the same whatever is asked. ``history`` is a
    list of earlier ``(question, answer)`` pairs; with it, the first user turn carries the first
    earlier question, answers become assistant turns and later questions follow as user turns,
    so the conversation extends the same prefix.

    Args:
        images: image sources (PIL images, paths or bytes) in order, or image parts without their
            type (``{"image": path, "sha256": digest}``) to pass a known digest along; a video clip
            is a part ``{"video": path or bytes}``, laid out as ``Video N: <video>`` in its place
            (images and videos are numbered separately).
        question: the question to answer now.
        history: earlier ``(question, answer)`` pairs, oldest first.
        system: an optional system message (placed before the images).
    """
    history = list(history or [])
    questions = [q for q, _ in history] + [question]
    first, counts = [], {"image": 0, "video": 0}
    for item in images:
        kind = "video" if isinstance(item, dict) and "video" in item else "image"
        counts[kind] += 1
        part = {**item, "type": kind} if isinstance(item, dict) else {"type": "image", "image": item}
        first += [{"type": "text", "text": f"{kind.capitalize()} {counts[kind]}: "}, part,
                  {"type": "text", "text": "\n"}]
    first.append({"type": "text", "text": f"Question: {questions[0]}"})
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": first})
    for (_, answer), q in zip(history, questions[1:], strict=True):
        messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": f"Question: {q}"})
    return messages


#: The question :func:`prefix_messages` puts after the images: the prefix's tokens do not depend on
#: it (the prefix ends at the last image's ``<|vision_end|>``, a special token), and a warm never
#: computes it.
PLACEHOLDER_QUESTION = "?"


def prefix_messages(images, *, system: str | None = None) -> list[dict]:
    """Messages whose public prefix is the one :func:`media_first_messages` ``(images, question,
    system=system)`` has for every question: what a warm (``Engine.warm``) builds. ``images`` and
    ``system`` as there."""
    return media_first_messages(images, PLACEHOLDER_QUESTION, system=system)
