"""From chat messages to model inputs.

Messages use the transformers chat format::

    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": [{"type": "image", "image": <PIL.Image | path | bytes>},
                                  {"type": "text", "text": "What is this?"}]}]

plus ``{"type": "video", "video": [frame, frame, ...], "fps": 2.0}`` parts. Images are opened by
:mod:`engine.images` (our safety rules); the chat template, tokenizer and pixel processing are
the checkpoint's own transformers processor.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from .errors import InvalidRequestError
from .images import ImageOptions, image_sha256, open_image
from .rope import VisualSpan, find_visual_spans, mrope_positions

ROLES = ("system", "user", "assistant")
DEFAULT_VIDEO_FPS = 2.0


@dataclass
class Prompt:
    """A tokenised prompt with its pixels and logical positions.

    Attributes:
        input_ids: prompt token ids, visual placeholders expanded.
        positions: int64 ``[3, len(input_ids)]`` M-RoPE positions.
        rope_delta: generated token at sequence index ``j`` gets position ``j + rope_delta``.
        spans: visual token runs (images, video frames) in prompt order.
        pixel_values / image_grids: the processor's image patches ``[patches, C*T*P*P]`` and
            ``(t, h, w)`` grids, or None / [] without images.
        pixel_values_videos / video_grids: the same for videos.
        image_hashes: SHA-256 of each image's decoded pixels, in order.
        video_hashes: SHA-256 over each video's frame hashes and fps, in order.
    """

    input_ids: list[int]
    positions: torch.Tensor
    rope_delta: int
    spans: list[VisualSpan]
    pixel_values: torch.Tensor | None = None
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)
    pixel_values_videos: torch.Tensor | None = None
    video_grids: list[tuple[int, int, int]] = field(default_factory=list)
    image_hashes: list[str] = field(default_factory=list)
    video_hashes: list[str] = field(default_factory=list)

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


def _normalise(messages) -> tuple[list[dict], list, list[tuple[list, float]]]:
    """Validate messages; return template messages, opened images and video frame lists."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} dicts")
    template, images, videos = [], [], []
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
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image" and "image" in part:
                images.append(part["image"])
                parts.append({"type": "image"})
            elif kind == "video" and isinstance(part.get("video"), (list, tuple)) and part["video"]:
                videos.append((list(part["video"]), float(part.get("fps", DEFAULT_VIDEO_FPS))))
                parts.append({"type": "video"})
            else:
                raise InvalidRequestError(
                    f"message {n}: unsupported content part {part!r:.80}; use text, image or video parts"
                )
        template.append({"role": msg["role"], "content": parts})
    return template, images, videos


class PromptBuilder:
    """Applies the checkpoint's processor to chat messages.

    Args:
        processor: a transformers ``Qwen3VLProcessor``.
        image_token_id, video_token_id, merge_size: from the model config.
        image_options: our image-opening rules.
        min_pixels, max_pixels: processor resize bounds in pixels (None keeps the checkpoint's).
    """

    def __init__(self, processor, *, image_token_id, video_token_id, merge_size, image_options=None,
                 min_pixels=None, max_pixels=None):
        self.processor = processor
        self.image_token_id, self.video_token_id, self.merge_size = image_token_id, video_token_id, merge_size
        self.image_options = image_options or ImageOptions()
        size = dict(getattr(processor.image_processor, "size", None) or {})
        if min_pixels is not None:
            size["shortest_edge"] = int(min_pixels)
        if max_pixels is not None:
            size["longest_edge"] = int(max_pixels)
        self.size = size

    def build(self, messages) -> Prompt:
        """Tokenise ``messages`` (with the generation prompt) and process their images / videos.

        Raises:
            InvalidRequestError: malformed messages.
            InvalidImageError: an image or video frame cannot be used.
        """
        template, raw_images, raw_videos = _normalise(messages)
        images = [open_image(src, self.image_options) for src in raw_images]
        videos = [([open_image(f, self.image_options) for f in frames], fps) for frames, fps in raw_videos]
        text = self.processor.apply_chat_template(template, tokenize=False, add_generation_prompt=True)
        kwargs = {"return_tensors": "pt"}
        if images:
            kwargs["images"] = images
            kwargs["images_kwargs"] = {"size": self.size}
        if videos:
            kwargs["videos"] = [frames for frames, _ in videos]
            kwargs["videos_kwargs"] = {
                "do_sample_frames": False,
                "video_metadata": [
                    {"fps": fps, "total_num_frames": len(frames), "frames_indices": list(range(len(frames)))}
                    for frames, fps in videos
                ],
            }
        out = self.processor(text=[text], **kwargs)
        input_ids = out["input_ids"][0].tolist()
        image_grids = [tuple(g) for g in out["image_grid_thw"].tolist()] if images else []
        video_grids = [tuple(g) for g in out["video_grid_thw"].tolist()] if videos else []
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
            pixel_values=out.get("pixel_values") if images else None,
            image_grids=image_grids,
            pixel_values_videos=out.get("pixel_values_videos") if videos else None,
            video_grids=video_grids,
            image_hashes=[image_sha256(im) for im in images],
            video_hashes=[_video_sha256(frames, fps) for frames, fps in videos],
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
        images: image sources (PIL images, paths or bytes), in order.
        question: the question to answer now.
        history: earlier ``(question, answer)`` pairs, oldest first.
        system: an optional system message (placed before the images).
    """
    history = list(history or [])
    questions = [q for q, _ in history] + [question]
    first = [part for i, img in enumerate(images, 1)
             for part in ({"type": "text", "text": f"Image {i}: "}, {"type": "image", "image": img},
                          {"type": "text", "text": "\n"})]
    first.append({"type": "text", "text": f"Question: {questions[0]}"})
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": first})
    for (_, answer), q in zip(history, questions[1:], strict=True):
        messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": f"Question: {q}"})
    return messages
