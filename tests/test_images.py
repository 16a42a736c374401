"""Tests for engine.inputs.images: safe opening of user images (real photos from tests/media)."""

from __future__ import annotations

import hashlib
import io
import os
import struct
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import media_file
from PIL import Image, ImageFile, ImageOps

from engine.errors import InvalidImageError
from engine.inputs.images import ImageOptions, bytes_sha256, image_sha256, open_image

# name -> (width, height, mode Pillow opens it in)
MEDIA_FILES = {
    "astronaut.png": (512, 512, "RGB"),
    "chelsea.png": (451, 300, "RGB"),
    "china.jpg": (640, 427, "RGB"),
    "coffee.png": (600, 400, "RGB"),
    "coins.png": (384, 303, "L"),
    "grace_hopper.jpg": (512, 600, "RGB"),
    "hubble_deep_field.jpg": (1000, 872, "RGB"),
    "logo.png": (500, 500, "RGBA"),
    "no_time_for_that_tiny.gif": (14, 25, "P"),
    "page.png": (384, 191, "L"),
    "rocket.jpg": (640, 427, "RGB"),
    "text.png": (448, 172, "L"),
}

pytestmark = pytest.mark.usefixtures("media_dir")  # a missing media folder fails, it does not skip


# ---------------------------------------------------------------------------------------------
# helpers


def media(name: str) -> Path:
    return media_file(name)


def media_bytes(name: str) -> bytes:
    return media(name).read_bytes()


def plain_decode(name: str) -> Image.Image:
    """Pillow's own decode of a media file, fully loaded, without open_image."""
    with Image.open(media(name)) as im:
        im.load()
        return im.copy()


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image).astype(np.int32)


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    crc = zlib.crc32(kind + payload) & 0xFFFFFFFF
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


def claimed_size_png(width: int, height: int) -> bytes:
    """A well-formed RGB PNG whose header claims width x height but whose data is one row."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    one_row = zlib.compress(b"\x00" * (1 + 3 * min(width, 64)))
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", one_row) + png_chunk(b"IEND", b"")


def open_fd_count() -> int | None:
    fd_dir = "/proc/self/fd"
    return len(os.listdir(fd_dir)) if os.path.isdir(fd_dir) else None


def with_alpha(rgb: Image.Image, alpha: np.ndarray) -> Image.Image:
    rgba = rgb.convert("RGBA")
    rgba.putalpha(Image.fromarray(alpha.astype(np.uint8)))
    return rgba


def alpha_pattern(width: int, height: int) -> np.ndarray:
    """Left quarter fully transparent, right quarter opaque, a ramp in between."""
    alpha = np.zeros((height, width), dtype=np.uint8)
    q = width // 4
    alpha[:, 3 * q :] = 255
    alpha[:, q : 3 * q] = np.linspace(1, 254, 2 * q).astype(np.uint8)
    return alpha


# ---------------------------------------------------------------------------------------------
# every media file


@pytest.mark.parametrize("name", sorted(MEDIA_FILES))
def test_media_file_opens_to_rgb_with_its_size(name):
    width, height, source_mode = MEDIA_FILES[name]
    assert plain_decode(name).mode == source_mode  # the fixture is what we think it is
    image = open_image(media(name))
    assert image.mode == "RGB"
    assert image.size == (width, height)
    assert image.info == {}
    if source_mode in ("RGB", "L"):
        expected = plain_decode(name).convert("RGB")
        assert np.array_equal(pixels(image), pixels(expected))


def test_logo_rgba_is_opaque_and_keeps_its_colours():
    source = plain_decode("logo.png")
    assert np.asarray(source)[..., 3].min() == 255
    assert np.array_equal(pixels(open_image(source)), pixels(source.convert("RGB")))


@pytest.mark.parametrize("name", ["coins.png", "page.png", "text.png"])
def test_grayscale_photo_becomes_equal_rgb_channels(name):
    gray = pixels(plain_decode(name))
    image = pixels(open_image(media(name)))
    for channel in range(3):
        assert np.array_equal(image[..., channel], gray)


# ---------------------------------------------------------------------------------------------
# sources


def test_every_source_kind_gives_the_same_pixels(tmp_path):
    data = media_bytes("chelsea.png")
    reference = image_sha256(open_image(media("chelsea.png")))
    copy = tmp_path / "cat.png"
    copy.write_bytes(data)
    sources = [
        str(copy),
        copy,
        data,
        bytearray(data),
        memoryview(data),
        io.BytesIO(data),
        plain_decode("chelsea.png"),
    ]
    for source in sources:
        assert image_sha256(open_image(source)) == reference, type(source)
    with open(copy, "rb") as f:
        assert image_sha256(open_image(f)) == reference
        assert not f.closed  # the caller's file is the caller's to close


class TrickleStream(io.RawIOBase):
    """A raw stream that hands out at most 1000 bytes per read, like a socket."""

    def __init__(self, data: bytes):
        self._data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        return self._data.read(1000 if size < 0 else min(size, 1000))


def test_short_reads_are_joined():
    data = media_bytes("coins.png")
    reference = image_sha256(open_image(data))
    assert image_sha256(open_image(TrickleStream(data))) == reference
    with pytest.raises(InvalidImageError, match="limit is"):
        open_image(TrickleStream(data), ImageOptions(max_bytes=len(data) - 1))


def test_lazy_pil_image_from_caller_is_loaded():
    with Image.open(media("rocket.jpg")) as lazy:
        image = open_image(lazy)
        assert image is not lazy
        expected = plain_decode("rocket.jpg")
        assert np.array_equal(pixels(image), pixels(expected))


def test_result_is_independent_of_pil_source():
    source = plain_decode("coffee.png")
    before = image_sha256(source)
    image = open_image(source)
    assert image is not source
    image.paste((0, 0, 0), (0, 0, 50, 50))
    assert image_sha256(source) == before


def test_no_file_handles_left_open(tmp_path):
    path = tmp_path / "photo.jpg"
    path.write_bytes(media_bytes("china.jpg"))
    before = open_fd_count()
    if before is None:
        pytest.skip("needs /proc/self/fd")
    for _ in range(5):
        open_image(path)
        open_image(str(path))
        with pytest.raises(InvalidImageError):
            open_image(path, ImageOptions(max_image_pixels=1000))
    truncated = tmp_path / "cut.jpg"
    truncated.write_bytes(media_bytes("china.jpg")[:50_000])
    with pytest.raises(InvalidImageError):
        open_image(truncated)
    assert open_fd_count() == before


def test_unsupported_source_type_is_a_type_error(tmp_path):
    with pytest.raises(TypeError):
        open_image(12345)
    path = tmp_path / "a.png"
    path.write_bytes(media_bytes("coins.png"))
    with open(path, encoding="latin-1") as text_file, pytest.raises(TypeError, match="binary"):
        open_image(text_file)


def test_missing_path_is_invalid_image(tmp_path):
    with pytest.raises(InvalidImageError, match="could not read") as info:
        open_image(tmp_path / "nope.png")
    assert isinstance(info.value.__cause__, FileNotFoundError)
    with pytest.raises(InvalidImageError, match="could not read"):
        open_image(tmp_path)  # a directory


# ---------------------------------------------------------------------------------------------
# orientation


def test_exif_orientation_6_is_applied():
    photo = plain_decode("rocket.jpg")  # 640 x 427
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated; display after turning 90 degrees clockwise
    data = encode(photo, "JPEG", quality=95, exif=exif.tobytes())

    image = open_image(data)
    assert image.size == (427, 640)

    with Image.open(io.BytesIO(data)) as stored:
        assert stored.size == (640, 427)
        expected = stored.convert("RGB").transpose(Image.Transpose.ROTATE_270)
    assert np.array_equal(pixels(image), pixels(expected))

    # and it is the clockwise turn of the real photo, not the counter-clockwise one
    clockwise = pixels(photo.transpose(Image.Transpose.ROTATE_270))
    counter = pixels(photo.transpose(Image.Transpose.ROTATE_90))
    assert np.abs(pixels(image) - clockwise).mean() < 4
    assert np.abs(pixels(image) - counter).mean() > 20


@pytest.mark.filterwarnings("ignore:Corrupt EXIF data")
def test_broken_exif_does_not_reject_the_photo(monkeypatch):
    photo = plain_decode("china.jpg")
    broken = b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\xff\xff"
    data = encode(photo, "JPEG", quality=90, exif=broken)
    assert open_image(data).size == photo.size

    def unreadable(image, **kwargs):
        raise SyntaxError("bad EXIF")

    monkeypatch.setattr(ImageOps, "exif_transpose", unreadable)
    assert open_image(data).size == photo.size


# ---------------------------------------------------------------------------------------------
# transparency


def test_rgba_composited_onto_background():
    photo = plain_decode("astronaut.png")
    width, height = photo.size
    alpha = alpha_pattern(width, height)
    data = encode(with_alpha(photo, alpha), "PNG")

    white = pixels(open_image(data))
    green = pixels(open_image(data, ImageOptions(background=(0, 128, 0))))
    rgb = pixels(photo)

    transparent = alpha == 0
    opaque = alpha == 255
    assert (white[transparent] == 255).all()
    assert (green[transparent] == [0, 128, 0]).all()
    assert np.array_equal(white[opaque], rgb[opaque])
    assert np.array_equal(green[opaque], rgb[opaque])

    # a half-transparent pixel is the alpha-weighted mix
    y, x = height // 2, width // 2
    a = alpha[y, x] / 255.0
    expected = rgb[y, x] * a + 255 * (1 - a)
    assert np.abs(white[y, x] - expected).max() <= 1


def test_namespace_tracks_the_background_only():
    white, green = ImageOptions(), ImageOptions(background=(0, 128, 0))
    assert white.namespace() != green.namespace()
    assert white.namespace() == ImageOptions().namespace()
    assert white.namespace() == ImageOptions(max_image_pixels=10, max_bytes=10).namespace()
    assert ImageOptions(background=[0, 128, 0]).namespace() == green.namespace()


def test_la_composited_onto_background():
    gray = plain_decode("coins.png")
    width, height = gray.size
    alpha = alpha_pattern(width, height)
    la = Image.merge("LA", (gray, Image.fromarray(alpha)))
    data = encode(la, "PNG")
    assert Image.open(io.BytesIO(data)).mode == "LA"

    image = pixels(open_image(data, ImageOptions(background=(10, 20, 30))))
    assert (image[alpha == 0] == [10, 20, 30]).all()
    opaque = alpha == 255
    for channel in range(3):
        assert np.array_equal(image[..., channel][opaque], pixels(gray)[opaque])


def test_palette_with_transparent_index():
    palette_image = plain_decode("chelsea.png").quantize(64)
    index = np.asarray(palette_image)
    key = int(index[0, 0])
    data = encode(palette_image, "PNG", transparency=key)
    with Image.open(io.BytesIO(data)) as reopened:
        assert reopened.mode == "P" and reopened.info.get("transparency") is not None

    image = pixels(open_image(data, ImageOptions(background=(255, 0, 255))))
    keyed = index == key
    assert keyed.any() and not keyed.all()
    assert (image[keyed] == [255, 0, 255]).all()
    expected = pixels(palette_image.convert("RGB"))
    assert np.array_equal(image[~keyed], expected[~keyed])


def test_palette_with_per_entry_alpha_and_pa():
    palette_image = plain_decode("coffee.png").quantize(16)
    alphas = bytes([0] + [255] * 15)  # entry 0 transparent, the rest opaque
    data = encode(palette_image, "PNG", transparency=alphas)
    image = pixels(open_image(data))
    index = np.asarray(palette_image)
    assert (image[index == 0] == 255).all()
    assert np.array_equal(image[index != 0], pixels(palette_image.convert("RGB"))[index != 0])

    pa = palette_image.convert("PA")
    pa.putalpha(0)
    assert (pixels(open_image(pa, ImageOptions(background=(1, 2, 3)))) == [1, 2, 3]).all()


def test_grayscale_and_rgb_colour_key_transparency():
    gray = plain_decode("page.png")
    key = int(np.asarray(gray)[0, 0])
    blue = ImageOptions(background=(0, 0, 255))
    image = pixels(open_image(encode(gray, "PNG", transparency=key), blue))
    assert (image[np.asarray(gray) == key] == [0, 0, 255]).all()

    rgb = plain_decode("coffee.png")
    colour = tuple(int(c) for c in np.asarray(rgb)[0, 0])
    image = pixels(open_image(encode(rgb, "PNG", transparency=colour), blue))
    matches = (np.asarray(rgb) == colour).all(axis=-1)
    assert (image[matches] == [0, 0, 255]).all()
    assert np.array_equal(image[~matches], pixels(rgb)[~matches])


def test_premultiplied_modes():
    photo = plain_decode("astronaut.png")
    rgba = with_alpha(photo, np.full(photo.size[::-1], 255, dtype=np.uint8))
    assert np.array_equal(pixels(open_image(rgba.convert("RGBa"))), pixels(photo))
    la = Image.merge("LA", (photo.convert("L"), Image.new("L", photo.size, 255)))
    assert np.array_equal(pixels(open_image(la.convert("La")))[..., 0], pixels(photo.convert("L")))


# ---------------------------------------------------------------------------------------------
# other modes


def test_16bit_grayscale_png_keeps_its_brightness():
    gray8 = np.asarray(plain_decode("grace_hopper.jpg").convert("L"))
    gray16 = gray8.astype(np.uint16) * 257  # the same picture at 16 bits, full range
    data = encode(Image.fromarray(gray16), "PNG")
    with Image.open(io.BytesIO(data)) as reopened:
        assert reopened.mode == "I;16"
        assert np.asarray(reopened.convert("L")).mean() > 250  # Pillow alone clips to white

    image = pixels(open_image(data))
    assert image.shape == (*gray8.shape, 3)
    assert abs(image.mean() - gray8.mean()) < 1
    assert 30 < image.mean() < 220
    assert np.array_equal(image[..., 0], gray8)  # v * 257 / 257 is exact


def test_16bit_big_endian_and_32bit_integer_tiff():
    gray8 = np.asarray(plain_decode("coins.png"))
    gray16 = gray8.astype(np.uint16) * 257
    height, width = gray8.shape
    raw = gray16.astype(">u2").tobytes()
    big_endian = Image.frombuffer("I;16B", (width, height), raw, "raw", "I;16B", 0, 1)
    assert big_endian.mode == "I;16B"
    assert np.array_equal(pixels(open_image(big_endian))[..., 1], gray8)
    data = encode(big_endian, "TIFF")
    assert np.array_equal(pixels(open_image(data))[..., 2], gray8)

    int32 = Image.fromarray(gray16.astype(np.int32))
    assert int32.mode == "I"
    assert np.array_equal(pixels(open_image(encode(int32, "TIFF")))[..., 0], gray8)
    # 8-bit values stored as 32-bit stay as they are
    eight_bit = open_image(Image.fromarray(gray8.astype(np.int32)))
    assert np.array_equal(pixels(eight_bit)[..., 0], gray8)
    # a range wider than 16 bits is stretched to 0..255
    wide = pixels(open_image(Image.fromarray(gray8.astype(np.int32) * 100_000 - 3_000_000)))
    assert wide.min() == 0 and wide.max() == 255


def test_float_images():
    gray8 = np.asarray(plain_decode("text.png"))
    unit = Image.fromarray(gray8.astype(np.float32) / 255.0)
    assert unit.mode == "F"
    assert np.abs(pixels(open_image(encode(unit, "TIFF")))[..., 0] - gray8).max() <= 1
    byte_range = Image.fromarray(gray8.astype(np.float32))
    assert np.array_equal(pixels(open_image(byte_range))[..., 0], gray8)
    odd = gray8.astype(np.float32) * 10.0 - 500.0
    odd[0, 0] = np.nan
    stretched = pixels(open_image(Image.fromarray(odd)))
    assert stretched.min() == 0 and stretched.max() == 255


def test_cmyk_jpeg():
    photo = plain_decode("china.jpg")
    data = encode(photo.convert("CMYK"), "JPEG", quality=95)
    with Image.open(io.BytesIO(data)) as reopened:
        assert reopened.mode == "CMYK"
    image = pixels(open_image(data))
    assert image.shape == (427, 640, 3)
    assert np.abs(image - pixels(photo)).mean() < 4


@pytest.mark.parametrize("mode", ["LAB", "CMYK"])
def test_tiff_colour_spaces(mode):
    photo = plain_decode("coffee.png")
    data = encode(photo.convert(mode), "TIFF")
    with Image.open(io.BytesIO(data)) as reopened:
        assert reopened.mode == mode
    assert np.abs(pixels(open_image(data)) - pixels(photo)).mean() < 4


def test_bilevel_image():
    bilevel = plain_decode("text.png").convert("1")
    image = pixels(open_image(encode(bilevel, "PNG")))
    assert set(np.unique(image)) <= {0, 255}
    assert np.array_equal(image[..., 0], pixels(bilevel.convert("L")))


def test_ycbcr_image():
    # (Pillow 12 cannot read back the YCbCr TIFFs it writes, so the YCbCr case goes in as an image)
    photo = plain_decode("coffee.png")
    assert np.abs(pixels(open_image(photo.convert("YCbCr"))) - pixels(photo)).mean() < 4


def test_hsv_image():
    photo = plain_decode("chelsea.png")
    assert np.abs(pixels(open_image(photo.convert("HSV"))) - pixels(photo)).mean() < 4


# ---------------------------------------------------------------------------------------------
# animation


def gif_frames() -> list[Image.Image]:
    frames = []
    with Image.open(media("no_time_for_that_tiny.gif")) as gif:
        for index in range(gif.n_frames):
            gif.seek(index)
            frames.append(gif.convert("RGB"))
    return frames


def test_animated_gif_uses_first_frame():
    frames = gif_frames()
    assert len(frames) > 1
    assert not np.array_equal(pixels(frames[0]), pixels(frames[1]))
    image = open_image(media("no_time_for_that_tiny.gif"))
    assert np.array_equal(pixels(image), pixels(frames[0]))


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_animated_png_and_webp_use_first_frame(fmt):
    frames = [frame.resize((56, 100), Image.Resampling.NEAREST) for frame in gif_frames()[:6]]
    options = {"lossless": True} if fmt == "WEBP" else {}
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=70, loop=0, **options)
    with Image.open(io.BytesIO(data)) as animated:
        assert animated.is_animated
    assert np.array_equal(pixels(open_image(data)), pixels(frames[0]))


# ---------------------------------------------------------------------------------------------
# rejected input


def test_not_an_image():
    for data in (b"hello, this is text", b"%PDF-1.4\n" + b"0" * 200, bytes(range(256)) * 4):
        with pytest.raises(InvalidImageError, match="not an image Prism can read") as info:
            open_image(data)
        assert "PNG, JPEG, WebP, GIF, BMP, TIFF" in str(info.value)
        assert info.value.__cause__ is not None


def test_not_an_image_file_on_disk(tmp_path):
    path = tmp_path / "notes.png"
    path.write_text("not really a png")
    with pytest.raises(InvalidImageError, match="not an image"):
        open_image(path)


def test_other_pillow_formats_are_not_tried():
    photo = plain_decode("chelsea.png")
    for fmt in ("PPM", "ICO", "TGA", "PCX"):
        with pytest.raises(InvalidImageError, match="not an image Prism can read"):
            open_image(encode(photo, fmt))


def test_heic_gets_its_own_message():
    data = b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + b"\x00" * 64
    with pytest.raises(InvalidImageError, match="HEIC"):
        open_image(data)


def test_empty_input(tmp_path):
    with pytest.raises(InvalidImageError, match="empty"):
        open_image(b"")
    with pytest.raises(InvalidImageError, match="empty"):
        open_image(io.BytesIO())
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    with pytest.raises(InvalidImageError, match="empty"):
        open_image(empty)


@pytest.mark.parametrize("name", ["coffee.png", "china.jpg", "logo.png", "hubble_deep_field.jpg"])
def test_truncated_file(name):
    data = media_bytes(name)
    for cut in (len(data) // 2, len(data) * 9 // 10):
        with pytest.raises(InvalidImageError, match="incomplete or damaged") as info:
            open_image(data[:cut])
        assert isinstance(info.value.__cause__, OSError)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


@pytest.mark.parametrize("fmt", ["TIFF", "WEBP", "BMP", "GIF"])
def test_truncated_other_formats(fmt):
    photo = plain_decode("chelsea.png")
    data = encode(photo.quantize(256) if fmt == "GIF" else photo, fmt)
    with pytest.raises(InvalidImageError):
        open_image(data[: len(data) // 2])


def test_damaged_header_is_invalid_image():
    data = bytearray(media_bytes("coffee.png"))
    data[16:24] = b"\xff" * 8  # IHDR width/height, CRC now wrong
    with pytest.raises(InvalidImageError, match="starts like a PNG image but its header"):
        open_image(bytes(data))
    for name, kind in (("china.jpg", "JPEG"), ("no_time_for_that_tiny.gif", "GIF")):
        with pytest.raises(InvalidImageError, match=f"starts like a {kind} image"):
            open_image(media_bytes(name)[:40])


@pytest.fixture
def pixel_loads(monkeypatch) -> list[tuple[int, int]]:
    """Records the size of every image whose pixels Pillow decodes (``ImageFile.load``) while the
    test runs: a guard that refuses before decoding leaves it empty."""
    loads: list[tuple[int, int]] = []
    real_load = ImageFile.ImageFile.load

    def load(self):
        loads.append(self.size)
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return loads


# Run in a fresh interpreter: ru_maxrss is the process's high-water mark, so in the test process an
# earlier, larger test would hide any growth. Prints the growth of the peak in KiB (Linux units). The
# direct proof that nothing is decoded is the ``pixel_loads`` spy; this bounds the memory too.
_PEAK_RSS_OF_OPENING = """
import resource, sys
from engine.errors import InvalidImageError
from engine.inputs.images import open_image
data = sys.stdin.buffer.read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    open_image(data)
except InvalidImageError as e:
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, str(e))
else:
    sys.exit("the image was accepted")
"""


def test_decompression_bomb_rejected_before_decoding(pixel_loads):
    """A 200-byte PNG claiming 20000 x 20000 pixels (1.2 GB decoded) is refused from its header:
    no pixel is decoded, and opening it in a fresh process does not raise its peak memory."""
    bomb = claimed_size_png(20_000, 20_000)
    assert len(bomb) < 200
    with pytest.raises(InvalidImageError) as info:
        open_image(bomb)
    assert pixel_loads == []  # refused from the header alone
    message = str(info.value)
    assert "400 megapixels" in message and "limit is 50 megapixels" in message
    assert "Resize" in message
    assert isinstance(info.value.__cause__, Image.DecompressionBombError)
    out = subprocess.run([sys.executable, "-c", _PEAK_RSS_OF_OPENING], input=bomb, capture_output=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=120, check=True).stdout.decode()
    growth_kib, refusal = out.split(" ", 1)
    assert "400 megapixels" in refusal
    assert int(growth_kib) < 100 * 1024  # 100 MiB; decoding would touch 1.2 GB


def test_bomb_check_does_not_rely_on_pillow_global(monkeypatch, pixel_loads):
    """With Pillow's own guard off, our header check still refuses the bomb before any decoding."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    with pytest.raises(InvalidImageError) as info:
        open_image(claimed_size_png(20_000, 20_000))
    assert pixel_loads == []
    assert "20000 × 20000 pixels (400 megapixels); the limit is 50 megapixels" in str(info.value)
    open_image(media("coffee.png"))  # the spy sees a real decode
    assert pixel_loads and set(pixel_loads) == {(600, 400)}


def test_our_limit_is_below_pillows():
    before = Image.MAX_IMAGE_PIXELS
    with pytest.raises(InvalidImageError, match=r"9000 × 9000 pixels \(81 megapixels\)"):
        open_image(claimed_size_png(9000, 9000))
    with pytest.raises(InvalidImageError, match="limit is 0.1 megapixels"):
        open_image(media("coffee.png"), ImageOptions(max_image_pixels=100_000))
    assert Image.MAX_IMAGE_PIXELS == before


def test_pillow_bomb_warning_as_error_is_wrapped():
    # 100 MP: above Pillow's warning threshold (~89 MP), below its error threshold.
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with pytest.raises(InvalidImageError, match="100 megapixels") as info:
            open_image(claimed_size_png(10_000, 10_000), ImageOptions(max_image_pixels=150_000_000))
    assert isinstance(info.value.__cause__, Image.DecompressionBombWarning)


def test_extreme_aspect_ratio():
    strip = plain_decode("rocket.jpg").resize((10_000, 20))
    with pytest.raises(InvalidImageError, match=r"aspect ratio of 500:1; the limit is 200:1"):
        open_image(encode(strip, "PNG"))
    with pytest.raises(InvalidImageError, match="aspect ratio"):
        open_image(strip.transpose(Image.Transpose.ROTATE_90))
    with pytest.raises(InvalidImageError, match="limit is 3:1"):
        open_image(plain_decode("rocket.jpg").resize((400, 100)), ImageOptions(max_aspect_ratio=3))
    # exactly 200:1 is what smart_resize still accepts
    assert open_image(plain_decode("rocket.jpg").resize((2000, 10))).size == (2000, 10)


def test_file_over_max_bytes(tmp_path):
    data = media_bytes("hubble_deep_field.jpg")  # about 0.5 MB
    options = ImageOptions(max_bytes=100_000)
    path = tmp_path / "big.jpg"
    path.write_bytes(data)
    for source in (data, io.BytesIO(data), path, memoryview(data)):
        with pytest.raises(InvalidImageError, match=r"limit is 0.1 MB\. Compress or resize"):
            open_image(source, options)
    assert open_image(data, ImageOptions(max_bytes=len(data))).size == (1000, 872)


def test_zero_size_image():
    with pytest.raises(InvalidImageError, match="no pixels"):
        open_image(Image.new("RGB", (0, 5)))
    with pytest.raises(InvalidImageError):
        open_image(claimed_size_png(0, 10))


def test_global_pillow_state_untouched():
    before = (Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES)
    open_image(media("coffee.png"))
    for bad in (b"", b"junk", claimed_size_png(20_000, 20_000), media_bytes("coffee.png")[:1000]):
        with pytest.raises(InvalidImageError):
            open_image(bad)
    assert (Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES) == before


def test_invalid_image_error_is_a_value_error():
    with pytest.raises(ValueError):
        open_image(b"junk")


def test_options_validation():
    with pytest.raises(ValueError):
        ImageOptions(background=(0, 0, 256))
    with pytest.raises(ValueError):
        ImageOptions(background=(0, 0))
    with pytest.raises(ValueError):
        ImageOptions(max_image_pixels=0)
    with pytest.raises(ValueError):
        ImageOptions(max_aspect_ratio=0.5)


# ---------------------------------------------------------------------------------------------
# hashing


def test_image_sha256_is_about_pixels_not_encoding():
    photo = open_image(media("chelsea.png"))
    digest = image_sha256(photo)
    assert len(digest) == 64
    lossless = (("BMP", {}), ("WEBP", {"lossless": True}), ("TIFF", {"compression": "tiff_lzw"}))
    for fmt, kwargs in lossless:
        assert image_sha256(open_image(encode(photo, fmt, **kwargs))) == digest, fmt
    assert image_sha256(open_image(media("coffee.png"))) != digest


def test_image_sha256_includes_size():
    wide = Image.new("RGB", (4, 1), (9, 9, 9))
    tall = Image.new("RGB", (1, 4), (9, 9, 9))
    assert wide.tobytes() == tall.tobytes()
    assert image_sha256(wide) != image_sha256(tall)


def test_image_sha256_needs_rgb():
    with pytest.raises(ValueError, match="RGB"):
        image_sha256(plain_decode("coins.png"))


def test_bytes_sha256():
    data = media_bytes("page.png")
    assert bytes_sha256(data) == hashlib.sha256(data).hexdigest()
    assert bytes_sha256(memoryview(data)) == bytes_sha256(bytearray(data))


# ---------------------------------------------------------------------------------------------
# through the Qwen2/3-VL image processor

QWEN3_VL_SIZE = {"shortest_edge": 65536, "longest_edge": 16777216}  # Qwen3-VL preprocessor config


def qwen_processors():
    module = pytest.importorskip("transformers.models.qwen2_vl.image_processing_qwen2_vl")
    pil_module = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    kwargs = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2}
    return [
        module.Qwen2VLImageProcessor(**kwargs),
        module.Qwen2VLImageProcessor(size=dict(QWEN3_VL_SIZE), **kwargs),
        pil_module.Qwen2VLImageProcessorPil(size=dict(QWEN3_VL_SIZE), **kwargs),
    ]


@pytest.mark.parametrize("size", [(1, 1), (3, 40), (40, 3), (5, 300), (1, 200), (200, 1)])
def test_tiny_images_go_through_the_processor(size):
    crop = plain_decode("astronaut.png").resize(size, Image.Resampling.BOX)
    image = open_image(encode(crop, "PNG"))
    assert image.size == size  # not resized here
    for processor in qwen_processors():
        out = processor(images=[image], return_tensors="pt")
        ((t, grid_h, grid_w),) = out["image_grid_thw"].tolist()
        assert t == 1 and grid_h % 2 == 0 and grid_w % 2 == 0
        assert out["pixel_values"].shape == (grid_h * grid_w, 3 * 2 * 16 * 16)
        width, height = size
        if width != height:  # orientation survives
            assert (grid_w > grid_h) == (width > height)


def test_photo_goes_through_the_processor():
    image = open_image(media("hubble_deep_field.jpg"))
    for processor in qwen_processors():
        out = processor(images=[image], return_tensors="pt")
        ((t, grid_h, grid_w),) = out["image_grid_thw"].tolist()
        assert t == 1 and grid_h > 0 and grid_w > grid_h
        assert out["pixel_values"].shape[0] == grid_h * grid_w


def test_processor_refuses_what_open_image_refuses():
    module = pytest.importorskip("transformers.models.qwen2_vl.image_processing_qwen2_vl")
    with pytest.raises(ValueError, match="aspect ratio"):
        module.smart_resize(10, 2010, factor=32)
    assert module.smart_resize(10, 2000, factor=32)  # 200:1 passes both
    with pytest.raises(InvalidImageError):
        open_image(Image.new("RGB", (2010, 10)))


def test_exif_transpose_helper_matches_pillow():
    """Sanity: the orientation the module applies is Pillow's own exif_transpose."""
    photo = plain_decode("grace_hopper.jpg")
    exif = Image.Exif()
    exif[0x0112] = 8
    data = encode(photo, "PNG", exif=exif.tobytes())
    with Image.open(io.BytesIO(data)) as stored:
        expected = ImageOps.exif_transpose(stored).convert("RGB")
    image = open_image(data)
    assert image.size == (600, 512)
    assert np.array_equal(pixels(image), pixels(expected))
