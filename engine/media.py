"""User media as the engine takes it: opening and validating an image upload, validating and
sniffing a video clip, their limits and the content key. Public API, for the engine's callers
(the session store checks uploads with it, the app routes files with it); the engine's own inputs
(:mod:`engine.inputs`) run the same code, so an upload the store accepted is read by the same rules
as the engine reads it.

* Images: :func:`open_image` (any source to a decoded, checked ``RGB`` image) and
  :func:`validate_image` (an upload's bytes to an :class:`ImageUpload`), under
  :class:`ImageOptions`; :func:`image_mime` names a file's format from its first bytes.
* Clips: :func:`validate_clip` (an upload's bytes to a :class:`ClipUpload`: decoded and sampled as
  a question would, so a truncated or over-long clip is refused at upload), under
  :class:`VideoOptions` and :class:`VideoSampling`; :func:`sniff_video` routes an upload.
* :func:`content_key`: the hex SHA-256 of a file's bytes, the key of the store's files, of an
  image part's ``"sha256"`` and of :meth:`Engine.prefix_info <engine.Engine.prefix_info>`.
* Errors: :class:`InvalidImageError`, :class:`InvalidVideoError` (messages for the uploader).

Decoded once: validating means decoding (a truncated file shows only then). Given the session's
cache ``salt``, :func:`validate_image` and :func:`validate_clip` keep what they decoded for the
first question of that salt about the same bytes, which an engine running in this process then
takes instead of decoding again (see :mod:`engine.inputs.uploads`: keyed by salt, digest and the
settings that change pixels; taken once; the engine's own limits checked; bounded; nothing kept
without an engine in this process). An engine in another process decodes again: pixels do not
cross the process boundary, only the bytes' content key does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .errors import InvalidImageError, InvalidVideoError
from .inputs.images import ImageOptions, ImageSource, check_image_size, open_image, sniff_format
from .inputs.uploads import UPLOADS
from .inputs.video import DecodedVideo, VideoOptions, VideoSampling, decode_video, poster_jpeg, sniff_video

__all__ = [
    "ClipUpload",
    "DecodedVideo",
    "ImageOptions",
    "ImageSource",
    "ImageUpload",
    "InvalidImageError",
    "InvalidVideoError",
    "VideoOptions",
    "VideoSampling",
    "check_image_size",
    "content_key",
    "image_mime",
    "open_image",
    "sniff_video",
    "validate_clip",
    "validate_image",
]

_MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WebP": "image/webp", "TIFF": "image/tiff",
         "BMP": "image/bmp"}


def content_key(data: bytes | bytearray | memoryview) -> str:
    """The content key of a file: the hex SHA-256 (64 lowercase characters) of its bytes."""
    return hashlib.sha256(data).hexdigest()


def image_mime(data: bytes) -> str | None:
    """The MIME type of a supported image format (``"image/png"``, ``"image/jpeg"``, ...) from a
    file's magic bytes, or None. For routing and headers only: it does not validate."""
    return _MIME.get(sniff_format(bytes(data[:16])))


@dataclass(frozen=True)
class ImageUpload:
    """A validated image upload.

    Attributes:
        key: :func:`content_key` of its bytes.
        width, height: the decoded image's size in pixels (EXIF orientation applied).
        mime: its format's MIME type (``"application/octet-stream"`` if the magic bytes name none).
        kept: whether the decoded image was kept for the engine's first question (see the module
            docstring).
    """

    key: str
    width: int
    height: int
    mime: str
    kept: bool = False


@dataclass(frozen=True)
class ClipUpload:
    """A validated video clip upload.

    Attributes:
        key: :func:`content_key` of its bytes.
        width, height: its frames' size in pixels.
        duration_s: its length in seconds (frames / rate).
        mime: ``"video/mp4"`` or ``"video/webm"`` (:func:`sniff_video`; an animated GIF, or a
            QuickTime file without an ``ftyp`` box, is ``"application/octet-stream"``).
        poster: a JPEG of its first sampled frame, at most 320 pixels a side.
        kept: whether the decoded clip was kept for the engine's first question.
    """

    key: str
    width: int
    height: int
    duration_s: float
    mime: str
    poster: bytes
    kept: bool = False


def validate_image(data: bytes | bytearray | memoryview, options: ImageOptions | None = None, *,
                   salt: str | None = None) -> ImageUpload:
    """Check an uploaded image by opening it (:func:`open_image`: limits before decoding, then every
    pixel decoded).

    Args:
        data: the file's bytes.
        options: the limits (default ``ImageOptions()``).
        salt: the session's cache salt: the decoded image is kept for that session's first question
            about these bytes (only while an engine runs in this process). None keeps nothing.

    Raises:
        InvalidImageError: not a usable image (the message is for the uploader).
        TypeError: ``data`` is not bytes-like.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"an upload is bytes, not {type(data).__name__}")
    options = ImageOptions() if options is None else options
    image = open_image(data, options)
    key = content_key(data)
    width, height = image.size
    kept = salt is not None and UPLOADS.keep(salt, key, options.namespace(), image, width * height * 3)
    if not kept:
        image.close()
    return ImageUpload(key, width, height, image_mime(data) or "application/octet-stream", kept)


def validate_clip(data: bytes | bytearray | memoryview, options: VideoOptions | None = None,
                  sampling: VideoSampling | None = None, *, salt: str | None = None) -> ClipUpload:
    """Check an uploaded video clip by decoding and sampling it as a question would (limits checked
    from the header first; see :func:`engine.inputs.video.decode_video`).

    Args:
        data: the file's bytes.
        options: the limits (default ``VideoOptions()``).
        sampling: the video processor's settings (default Qwen3-VL's: 2 fps, 4 to 768 frames).
        salt: as for :func:`validate_image`.

    Raises:
        InvalidVideoError: not a usable clip (the message is for the uploader).
        TypeError: ``data`` is not bytes-like.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"an upload is bytes, not {type(data).__name__}")
    sampling = sampling or VideoSampling()
    video = decode_video(data, sampling, options)
    key = content_key(data)
    height, width = video.frames.shape[1:3]
    poster = poster_jpeg(video)
    kept = salt is not None and UPLOADS.keep(salt, key, sampling.namespace(), video, video.frames.nbytes)
    mime = sniff_video(bytes(data[:16])) or "application/octet-stream"
    return ClipUpload(key, int(width), int(height), float(video.duration_s), mime, poster, kept)
