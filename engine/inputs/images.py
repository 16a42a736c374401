"""Open user images safely before they reach the Qwen3-VL image processor.

Everything a user uploads goes through :func:`open_image`, which turns a path, bytes, a file
object or a PIL image into a fully decoded, independent ``RGB`` image, or raises
:class:`~engine.errors.InvalidImageError` with a message the uploader can act on.

What it guards against, in order:

* files over ``max_bytes`` (checked before reading a path or while reading a stream);
* anything that is not PNG, JPEG, WebP, GIF, BMP or TIFF (other Pillow plugins, some of which
  shell out to external programs, are never tried);
* decompression bombs: the size the header claims is checked before any pixel is decoded,
  independently of Pillow's global ``Image.MAX_IMAGE_PIXELS`` (which is neither relied upon nor
  changed); Pillow's own ``DecompressionBombError`` (and its warning, when warnings are errors)
  are reported the same way;
* aspect ratios the processor refuses: Qwen2/3-VL's ``smart_resize`` raises ``ValueError`` when
  ``max(h, w) / min(h, w) > 200``;
* truncated or damaged files: pixels are decoded eagerly with Pillow's default strict setting
  (``ImageFile.LOAD_TRUNCATED_IMAGES`` is read, never set).

Then it applies the EXIF orientation, takes the first frame of an animation, composites
transparency onto a background colour and maps every other mode (grayscale, 1-bit, palette,
CMYK, YCbCr, LAB, 16-bit and 32-bit integer, float) to 8-bit RGB.

Tiny images are passed through unchanged. ``smart_resize`` upscales anything below
``min_pixels`` itself; with patch 16 / merge 2 (factor 32) a 1×1, 3×40 or 1×200 image goes
through both the torchvision and the PIL Qwen2-VL processors without error in transformers 5.17,
so no padding is needed here.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
from PIL import Image, ImageFile, ImageOps

from ..errors import InvalidImageError

__all__ = [
    "ImageOptions",
    "ImageSource",
    "InvalidImageError",
    "bytes_sha256",
    "check_image_size",
    "image_sha256",
    "open_image",
]

logger = logging.getLogger(__name__)

ImageSource = Image.Image | bytes | bytearray | memoryview | str | os.PathLike | IO[bytes]

# Bump when the decoding pipeline changes pixels (cached features keyed on the namespace then
# stop matching).
_PIPELINE_VERSION = 1

# Pillow format names tried by Image.open; no other plugin ever sees user data. "JPEG" also
# covers MPO (multi-picture JPEGs from cameras and phones): Pillow's JPEG opener returns those
# itself, and "MPO" is not an opener name.
_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")

_NOT_AN_IMAGE = (
    "The file is not an image Prism can read (supported: PNG, JPEG, WebP, GIF, BMP, TIFF). "
    "Convert it to PNG or JPEG and upload again."
)
_HEIF_BRANDS = frozenset({b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1", b"avif", b"avis"})

_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa"})
# Modes whose ``info["transparency"]`` Pillow's convert("RGBA") turns into an alpha channel.
_KEYED_TRANSPARENCY_MODES = frozenset({"P", "1", "L", "RGB"})

_warned_truncated_flag = False


@dataclass(frozen=True)
class ImageOptions:
    """Limits and colour settings for :func:`open_image`.

    ``max_image_pixels``: largest ``width * height`` the file's header may claim (decompression
    bomb guard). ``max_bytes``: largest encoded file size. ``max_aspect_ratio``: largest
    ``long side / short side``; keep it at or below 200, the limit of Qwen2/3-VL's
    ``smart_resize``. ``background``: RGB colour transparent pixels are composited onto.
    Pillow's own global guard still applies on top of ``max_image_pixels``: with its default
    ``Image.MAX_IMAGE_PIXELS`` it refuses headers above about 179 megapixels.

    Raises ``ValueError`` when a value is out of range.
    """

    max_image_pixels: int = 50_000_000
    max_bytes: int = 50 * 2**20
    max_aspect_ratio: float = 200.0
    background: tuple[int, int, int] = (255, 255, 255)

    def __post_init__(self) -> None:
        if int(self.max_image_pixels) < 1:
            raise ValueError(f"max_image_pixels must be positive, got {self.max_image_pixels}")
        if int(self.max_bytes) < 1:
            raise ValueError(f"max_bytes must be positive, got {self.max_bytes}")
        if not self.max_aspect_ratio >= 1:
            raise ValueError(f"max_aspect_ratio must be at least 1, got {self.max_aspect_ratio}")
        background = tuple(int(c) for c in self.background)
        if len(background) != 3 or not all(0 <= c <= 255 for c in background):
            raise ValueError(f"background must be three integers in 0..255, got {self.background!r}")
        object.__setattr__(self, "background", background)

    def namespace(self) -> str:
        """A stable string naming every setting that changes the pixels of an accepted image.

        The limits only decide whether an image is accepted, so they are not part of it; the
        background colour and the pipeline version are. Use it as part of a cache key.
        """
        r, g, b = self.background
        return f"prism-images-v{_PIPELINE_VERSION};bg={r},{g},{b}"


def open_image(source: ImageSource, options: ImageOptions | None = None) -> Image.Image:
    """Open, check and decode a user image into a new 8-bit RGB image.

    ``source`` is a ``PIL.Image.Image``; ``bytes``/``bytearray``/``memoryview`` holding an
    encoded file; a ``str`` or ``os.PathLike`` path; or a binary file object (read from its
    current position, not closed). ``options`` defaults to ``ImageOptions()``.

    Returns a fully loaded image of mode ``"RGB"``, with the EXIF orientation applied (so a
    portrait photo stored sideways comes back ``height × width``), otherwise at the source's
    size: nothing is resized, not even tiny images (the processor's ``smart_resize`` upscales
    those). The result shares nothing with the source (empty ``info``, no file behind it) and
    every file this function opens is closed. An animated GIF, APNG or WebP yields its first
    frame; a PIL image source yields its current frame. Transparency (alpha channels, palette or
    colour-key ``transparency``) is composited onto ``options.background``. 16-bit grayscale is
    scaled 0..65535 -> 0..255 (divided by 257); 32-bit integer images whose values fit 0..255 or
    0..65535 are treated as 8-bit or 16-bit, anything wider is stretched from its minimum to its
    maximum; float images in 0..1 are multiplied by 255, in 0..255 kept, otherwise stretched.
    Embedded ICC profiles are not applied.

    Raises :class:`InvalidImageError` (a ``ValueError``) for an empty file, a file over
    ``max_bytes``, a file that is not a supported image, a header claiming more than
    ``max_image_pixels`` pixels, a zero-size image, an aspect ratio over ``max_aspect_ratio``, a
    truncated or damaged file, or an unreadable path or stream; the original exception is
    chained. Raises ``TypeError`` for a source of another type or a text-mode stream.

    Truncated files are detected only while ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES`` is False,
    its default; this module never sets it (if other code does, a warning is logged once).
    """
    options = ImageOptions() if options is None else options
    _warn_if_truncated_images_allowed()
    if isinstance(source, Image.Image):
        return _decode(source, options)
    data = read_image_bytes(source, options)
    if not data:
        raise InvalidImageError("The image file is empty. Check the file and upload it again.")
    try:
        with Image.open(io.BytesIO(data), formats=_FORMATS) as image:
            return _decode(image, options)
    except InvalidImageError:
        raise
    except Image.UnidentifiedImageError as e:
        raise InvalidImageError(_unidentified_message(data)) from e
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise InvalidImageError(_bomb_message(e, options)) from e
    except Exception as e:  # any Pillow plugin failure on a malformed header
        raise InvalidImageError(_damaged_header_message(data)) from e


def image_sha256(image: Image.Image) -> str:
    """Hex SHA-256 of an RGB image's size and decoded pixels.

    Two files that decode to the same pixels (say, a PNG and a lossless WebP) get the same
    digest; pass the output of :func:`open_image`. Raises ``ValueError`` if ``image.mode`` is
    not ``"RGB"``.
    """
    if image.mode != "RGB":
        raise ValueError(f"image_sha256 expects an RGB image (see open_image), got mode {image.mode}")
    width, height = image.size
    digest = hashlib.sha256(f"RGB {width}x{height}\n".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def bytes_sha256(data: bytes | bytearray | memoryview) -> str:
    """Hex SHA-256 of raw bytes (for example an uploaded file as sent)."""
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------------------------
# Reading the source


def read_image_bytes(source: object, options: ImageOptions | None = None) -> bytes:
    """The encoded bytes of a non-PIL image source (bytes-like, path or binary file object), read
    once and at most ``options.max_bytes`` of them.

    Raises:
        InvalidImageError: the file is over ``max_bytes`` or cannot be read.
        TypeError: a source of another type.
    """
    options = ImageOptions() if options is None else options
    limit = options.max_bytes
    if isinstance(source, (bytes, bytearray, memoryview)):
        size = source.nbytes if isinstance(source, memoryview) else len(source)
        _check_bytes(size, limit)
        return source.tobytes() if isinstance(source, memoryview) else bytes(source)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            _check_bytes(path.stat().st_size, limit)
            with open(path, "rb") as f:
                data = f.read(limit + 1)
        except OSError as e:
            reason = e.strerror or type(e).__name__
            raise InvalidImageError(f"Prism could not read the image file '{path.name}': {reason}.") from e
        _check_bytes(len(data), limit)
        return data
    if hasattr(source, "read"):
        data = _read_stream(source, limit + 1)
        _check_bytes(len(data), limit)
        return data
    raise TypeError(
        f"open_image accepts a PIL image, bytes, a path or a binary file object, not {type(source).__name__}"
    )


def _read_stream(stream: IO[bytes], most: int) -> bytes:
    """Read up to ``most`` bytes, looping over short reads (raw streams, sockets)."""
    parts: list[bytes] = []
    total = 0
    while total < most:
        try:
            part = stream.read(most - total)
        except OSError as e:
            raise InvalidImageError("Prism could not read the uploaded image. Upload it again.") from e
        if isinstance(part, str):
            raise TypeError("open_image needs a binary file object (opened with 'rb'), not a text one")
        if part is None:  # non-blocking stream with nothing ready
            raise InvalidImageError("The upload ended before the image was complete. Try again.")
        if not isinstance(part, (bytes, bytearray, memoryview)):
            raise TypeError(f"the file object's read() returned {type(part).__name__}, not bytes")
        if not part:
            break
        parts.append(bytes(part))
        total += len(parts[-1])
    return b"".join(parts)


def _check_bytes(size: int, limit: int) -> None:
    if size > limit:
        raise InvalidImageError(
            f"The image file is {_megabytes(size)}; the limit is {_megabytes(limit)}. "
            "Compress or resize it and upload again."
        )


# --------------------------------------------------------------------------------------------
# Decoding


def _decode(image: Image.Image, options: ImageOptions) -> Image.Image:
    """Check the claimed size, load the pixels and convert to a new RGB image."""
    _check_geometry(image.size, options)
    try:
        image.load()
        oriented = _apply_orientation(image)
        result = _to_rgb(oriented, options.background)
    except InvalidImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise InvalidImageError(_bomb_message(e, options)) from e
    except Exception as e:  # OSError "truncated", SyntaxError, struct.error, ValueError, ...
        raise InvalidImageError(
            "The image file is incomplete or damaged, so its pixels cannot be decoded. "
            "Check the file (it may have been cut off while copying or downloading) and upload "
            "it again."
        ) from e
    if result is image:
        result = result.copy()
    result.info = {}
    return result


def check_image_size(size: tuple[int, int], options: ImageOptions | None = None) -> None:
    """Check an image's ``(width, height)`` in pixels against ``options``' pixel count and aspect
    ratio, as :func:`open_image` checks a header before decoding (the same messages; a 90°
    orientation changes neither, so a decoded image's size may be checked as well).

    Raises:
        InvalidImageError: a zero side, more than ``max_image_pixels`` pixels, or an aspect ratio
            over ``max_aspect_ratio``.
    """
    _check_geometry(size, ImageOptions() if options is None else options)


def _check_geometry(size: tuple[int, int], options: ImageOptions) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise InvalidImageError(
            f"The image is {width} × {height} pixels, so it has no pixels to show. Upload a different image."
        )
    pixels = width * height
    if pixels > options.max_image_pixels:
        raise InvalidImageError(
            f"The image is {width} × {height} pixels ({_megapixels(pixels)}); the limit is "
            f"{_megapixels(options.max_image_pixels)}. Resize it and upload again."
        )
    ratio = max(width, height) / min(width, height)
    if ratio > options.max_aspect_ratio:
        raise InvalidImageError(
            f"The image is {width} × {height} pixels, an aspect ratio of {ratio:.0f}:1; the "
            f"limit is {options.max_aspect_ratio:g}:1. Crop it into less elongated pieces and "
            "upload again."
        )


def _apply_orientation(image: Image.Image) -> Image.Image:
    """Apply the EXIF orientation; a broken EXIF block leaves the image as stored."""
    try:
        return ImageOps.exif_transpose(image)
    except Exception:  # malformed EXIF must not make an otherwise good photo unusable
        logger.debug("ignoring unreadable EXIF orientation", exc_info=True)
        return image


def _to_rgb(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """Convert any Pillow mode to RGB, compositing transparency onto ``background``."""
    mode = image.mode
    if mode.startswith("I;16") or mode in ("I", "F"):
        image = _high_depth_to_l(image)
        mode = image.mode
    if mode == "La":  # premultiplied; Pillow converts it only to LA
        image = image.convert("LA")
        mode = "LA"
    has_alpha = mode in _ALPHA_MODES or (
        mode in _KEYED_TRANSPARENCY_MODES and image.info.get("transparency") is not None
    )
    if has_alpha:
        rgba = image.convert("RGBA")
        base = Image.new("RGBA", rgba.size, (*background, 255))
        return Image.alpha_composite(base, rgba).convert("RGB")
    if mode == "RGB":
        return image
    return image.convert("RGB")


def _high_depth_to_l(image: Image.Image) -> Image.Image:
    """Map a 16-bit, 32-bit integer or float image to 8-bit ``L`` (``LA`` with a colour key)."""
    values = np.asarray(image)
    if image.mode.startswith("I;16"):
        gray = _scale_16bit(values)
    elif image.mode == "I":
        low, high = int(values.min()), int(values.max())
        if low >= 0 and high <= 255:
            gray = values.astype(np.uint8)
        elif low >= 0 and high <= 65535:
            gray = _scale_16bit(values)
        else:
            gray = _stretch(values.astype(np.float64), low, high)
    else:  # "F"
        finite = np.isfinite(values)
        clean = np.where(finite, values, 0.0).astype(np.float64)
        low = float(clean[finite].min()) if finite.any() else 0.0
        high = float(clean[finite].max()) if finite.any() else 0.0
        if low >= 0.0 and high <= 1.0:
            gray = np.rint(clean * 255.0).astype(np.uint8)
        elif low >= 0.0 and high <= 255.0:
            gray = np.rint(clean).astype(np.uint8)
        else:
            gray = _stretch(clean, low, high)
    result = Image.fromarray(np.ascontiguousarray(gray))
    key = image.info.get("transparency")
    if isinstance(key, int) and image.mode != "F":
        alpha = np.where(values == key, 0, 255).astype(np.uint8)
        result = Image.merge("LA", (result, Image.fromarray(alpha)))
    return result


def _scale_16bit(values: np.ndarray) -> np.ndarray:
    """0..65535 -> 0..255, rounding; exact for 8-bit data stored as ``v * 257``."""
    return ((values.astype(np.uint32) + 128) // 257).astype(np.uint8)


def _stretch(values: np.ndarray, low: float, high: float) -> np.ndarray:
    if high <= low:
        return np.zeros(values.shape, dtype=np.uint8)
    return np.rint((values - low) * (255.0 / (high - low))).clip(0, 255).astype(np.uint8)


# --------------------------------------------------------------------------------------------
# Messages


def _megapixels(pixels: int) -> str:
    mp = pixels / 1e6
    text = f"{mp:.0f}" if mp >= 10 else f"{mp:.1f}".rstrip("0").rstrip(".")
    return f"{text} megapixels"


def _megabytes(size: int) -> str:
    mb = size / 2**20
    text = f"{mb:.0f}" if mb >= 10 or mb == int(mb) else f"{mb:.1f}"
    return f"{text} MB"


def _bomb_message(error: Exception, options: ImageOptions) -> str:
    limit = _megapixels(options.max_image_pixels)
    match = re.search(r"\((\d+) pixels\)", str(error))
    if match:
        claimed = _megapixels(int(match.group(1)))
        return f"The image is {claimed}, too large to open safely; the limit is {limit}. Resize it and upload again."
    return f"The image is too large to open safely; the limit is {limit}. Resize it and upload again."


def _unidentified_message(data: bytes) -> str:
    if data[4:8] == b"ftyp" and data[8:12] in _HEIF_BRANDS:
        return (
            "The file is a HEIC/HEIF or AVIF photo, which Prism cannot read (supported: PNG, "
            "JPEG, WebP, GIF, BMP, TIFF). Export it as JPEG and upload again."
        )
    if sniff_format(data) is not None:
        return _damaged_header_message(data)
    return _NOT_AN_IMAGE


def _damaged_header_message(data: bytes) -> str:
    kind = sniff_format(data)
    start = f"The file starts like a {kind} image but its" if kind else "The image file's"
    return f"{start} header is damaged or cut off, so Prism cannot read it. Check the file and upload it again."


def sniff_format(data: bytes) -> str | None:
    """Name a supported format (``"PNG"``, ``"JPEG"``, ``"GIF"``, ``"WebP"``, ``"TIFF"``, ``"BMP"``)
    from the file's magic bytes, or None. For messages and MIME types only: it does not validate."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return "WebP"
    if data.startswith((b"II*\x00", b"MM\x00*")):
        return "TIFF"
    if data.startswith(b"BM") and len(data) >= 14:
        return "BMP"
    return None


def _warn_if_truncated_images_allowed() -> None:
    global _warned_truncated_flag
    if ImageFile.LOAD_TRUNCATED_IMAGES and not _warned_truncated_flag:
        _warned_truncated_flag = True
        logger.warning(
            "PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True (set elsewhere in this process); "
            "truncated images will be accepted with missing pixels"
        )
