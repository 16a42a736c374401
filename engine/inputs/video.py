"""Decode user video files (MP4, WebM, animated GIF) with PyAV and sample their frames the way
transformers' Qwen3-VL video processor samples them with its PyAV backend.

A video part's file (a path or bytes) is untrusted. :func:`decode_video` bounds every cost before
the work is spent, and raises :class:`~engine.errors.InvalidVideoError` with a message the uploader
can act on:

* the file's size (``max_bytes``), checked before reading a path;
* the container and codec: only MP4/MOV, Matroska/WebM and GIF containers holding H.264, HEVC,
  VP8, VP9, AV1, MPEG-4 part 2 or GIF video are opened, each with its demuxer named from the
  file's first bytes (:func:`video_demuxer`), so FFmpeg never probes the demuxers that open other
  files (concat lists, HLS playlists, image sequences);
* the stream's claimed frame size (``max_frame_pixels``), frame count (``max_frames``) and
  duration (``max_duration_s``), from the header, before any frame is decoded; then the decode
  work (frames up to the last sampled one x their pixels, ``max_decode_pixels``) and the sampled
  frames' RGB bytes (``max_sampled_bytes``);
* while decoding: a frame of another size than the header claims, a decoder error, a wall-clock
  deadline (``max_decode_s``), and a file that ends before the last sampled frame (truncated);
  a file whose frames are counted (WebM, GIF) and end well before the duration its header declares
  is refused as truncated before decoding.

Sampling (the source: ``Qwen3VLVideoProcessor.sample_frames`` and ``read_video_pyav`` in
transformers 5.24, ``transformers/models/qwen3_vl/video_processing_qwen3_vl.py`` and
``transformers/video_utils.py``): the stream's frame count ``N`` is the container's (``frames``)
and its rate ``r`` the stream's ``average_rate``; ``n = int(N / r * fps)`` frames are kept
(``fps`` the checkpoint's, 2 for Qwen3-VL), clamped to ``[min_frames, max_frames]`` and at most
``N``; their indices are ``N - 1`` split evenly, ``round(linspace(0, N - 1, n))``, and the frames
are decoded in order as ``rgb24``. The processor then averages each temporal patch's timestamps,
``index / r``. A container that does not record its frame count (WebM, some GIFs) is where we go
beyond transformers' PyAV loader (which cannot sample it): ``N`` is then the number of the stream's
packets, counted without decoding.
"""

from __future__ import annotations

import hashlib
import io
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InvalidVideoError
from .uploads import UPLOADS

__all__ = ["DecodedVideo", "DecodedVideos", "InvalidVideoError", "VideoOptions", "VideoSampling", "check_decoded",
           "decode_video", "poster_jpeg", "read_video_bytes", "sample_indices", "sniff_video", "video_demuxer"]

#: FFmpeg's demuxer names for the containers we open (MP4/MOV and Matroska/WebM share a demuxer;
#: opened by name, the container reports the name it was opened with).
_CONTAINERS = frozenset({"mov", "matroska", "gif", "mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm"})
#: FFmpeg's decoder names for the video codecs we decode.
_CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "libdav1d", "mpeg4", "gif", "libvpx", "libvpx-vp9"})
_NOT_A_VIDEO = ("The file is not a video Prism can read, or it is damaged or truncated (supported: MP4, "
                "WebM and animated GIF with H.264, HEVC, VP8, VP9, AV1 or GIF frames). Convert it to MP4 "
                "(H.264) and upload again.")

_NO_FRAMES = "The video has no frames. Upload a clip with at least two frames."


@dataclass(frozen=True)
class VideoOptions:
    """Limits on a video file, all checked before the work they bound is done. The defaults fit
    short clips (two minutes, 7,200 frames: 30 fps for the whole two minutes; 2e9 decoded pixels:
    about 16 s of 1080p at 60 fps, a few seconds of CPU), and bound one clip's decoding to 30 s.

    Attributes:
        max_bytes: largest file (bytes).
        max_duration_s: longest clip (seconds, frame count / frame rate).
        max_frames: most frames in the stream (the header's count, or the packets counted).
        max_frame_pixels: largest frame (width x height, pixels).
        max_decode_pixels: most pixels decoded (frames up to the last sampled one x frame pixels):
            the decode time.
        max_sampled_bytes: most RGB bytes of the sampled frames held at once (memory).
        max_decode_s: wall-clock deadline for decoding (seconds).
    """

    max_bytes: int = 64 << 20
    max_duration_s: float = 120.0
    max_frames: int = 7_200
    max_frame_pixels: int = 1920 * 1080
    max_decode_pixels: int = 2_000_000_000
    max_sampled_bytes: int = 256 << 20
    max_decode_s: float = 30.0

    def __post_init__(self):
        for name in ("max_bytes", "max_duration_s", "max_frames", "max_frame_pixels", "max_decode_pixels",
                     "max_sampled_bytes", "max_decode_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"VideoOptions.{name} must be positive, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class VideoSampling:
    """The video processor's sampling settings (``fps``: frames kept per second of clip;
    ``min_frames`` / ``max_frames``: bounds on the frames kept)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768

    @classmethod
    def of(cls, video_processor) -> VideoSampling:
        """The settings of a transformers video processor (its defaults where it has none)."""
        return cls(fps=float(getattr(video_processor, "fps", None) or 2.0),
                   min_frames=int(getattr(video_processor, "min_frames", None) or 4),
                   max_frames=int(getattr(video_processor, "max_frames", None) or 768))

    def namespace(self) -> str:
        return f"fps={self.fps!r};min_frames={self.min_frames};max_frames={self.max_frames}"


@dataclass
class DecodedVideo:
    """The sampled frames of a video file.

    Attributes:
        frames: uint8 ``[n, height, width, 3]`` RGB, the sampled frames in order.
        fps: the stream's average frame rate (frames per second).
        total_frames: frames in the stream (``N`` above).
        indices: the sampled frames' indices in the stream (``n`` ints, ascending).
        sha256: hex SHA-256 of the file's bytes.
    """

    frames: np.ndarray
    fps: float
    total_frames: int
    indices: list[int] = field(default_factory=list)
    sha256: str = ""

    @property
    def duration_s(self) -> float:
        """The clip's length in seconds (frames / rate), as transformers' PyAV loader reports it."""
        return self.total_frames / self.fps

    @property
    def timestamps_s(self) -> list[float]:
        """Each sampled frame's time in seconds (``index / fps``)."""
        return [i / self.fps for i in self.indices]

    def metadata(self) -> dict:
        """The processor's ``video_metadata`` for these frames (with ``do_sample_frames=False``)."""
        return {"fps": self.fps, "total_num_frames": self.total_frames, "frames_indices": list(self.indices),
                "duration": self.duration_s, "width": int(self.frames.shape[2]),
                "height": int(self.frames.shape[1]), "video_backend": "pyav"}


def sample_indices(total_frames: int, video_fps: float, sampling: VideoSampling) -> list[int]:
    """Indices of the frames kept from a stream of ``total_frames`` at ``video_fps`` (see the module
    docstring for the rule and its source).

    Raises:
        InvalidVideoError: ``total_frames < 1`` or a non-positive rate.
    """
    if total_frames < 1 or not video_fps > 0:
        raise InvalidVideoError(_NO_FRAMES)
    wanted = int(total_frames / video_fps * sampling.fps)
    n = min(max(wanted, sampling.min_frames), sampling.max_frames, total_frames)
    return [int(i) for i in np.linspace(0, total_frames - 1, n).round().astype(int)]


def read_video_bytes(source, options: VideoOptions | None = None) -> bytes:
    """A video source's bytes (bytes-like or a path), at most ``options.max_bytes`` of them.

    Raises:
        InvalidVideoError: over ``max_bytes``, empty, or unreadable.
        TypeError: a source of another type.
    """
    options = options or VideoOptions()
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            _check_size(path.stat().st_size, options)
            with open(path, "rb") as f:
                data = f.read(options.max_bytes + 1)
        except OSError as e:
            raise InvalidVideoError(f"Prism could not read the video file '{path.name}': "
                                    f"{e.strerror or type(e).__name__}.") from e
    else:
        raise TypeError(f"a video file is given as bytes or a path, not {type(source).__name__}")
    _check_size(len(data), options)
    if not data:
        raise InvalidVideoError("The video file is empty. Upload it again.")
    return data


def _check_size(size: int, options: VideoOptions) -> None:
    if size > options.max_bytes:
        raise InvalidVideoError(f"The video is {size / 2**20:.1f} MiB; Prism takes clips of up to "
                                f"{options.max_bytes / 2**20:.0f} MiB. Trim or compress it.")


def decode_video(source, sampling: VideoSampling | None = None, options: VideoOptions | None = None) -> DecodedVideo:
    """Open a video file, check it against ``options`` and decode its sampled frames.

    Args:
        source: the file as bytes or a path.
        sampling: the video processor's settings (:meth:`VideoSampling.of`).
        options: the limits.

    Returns:
        The sampled frames, uint8 ``[n, H, W, 3]``, with their indices and the stream's rate.

    Raises:
        InvalidVideoError: see the module docstring; the message is for the uploader.
    """
    import av  # a project dependency; imported here so that image-only use never loads FFmpeg

    sampling, options = sampling or VideoSampling(), options or VideoOptions()
    data = read_video_bytes(source, options)
    demuxer = video_demuxer(data)
    try:
        container = av.open(io.BytesIO(data), mode="r", format=demuxer, metadata_errors="ignore")
    except (av.FFmpegError, ValueError, UnicodeDecodeError) as e:
        raise InvalidVideoError(_NOT_A_VIDEO) from e
    with container:
        stream = _video_stream(container)
        total, fps = _frame_count_and_rate(container, stream, options)
        indices = sample_indices(total, fps, sampling)
        if len(indices) < 2:
            raise InvalidVideoError("The video has a single frame; upload it as an image instead.")
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_work(indices, width * height, options)
        frames = _decode(container, stream, indices, (height, width), options)
    return DecodedVideo(np.stack(frames), fps, total, indices, hashlib.sha256(data).hexdigest())


def check_decoded(video: DecodedVideo, options: VideoOptions | None = None) -> None:
    """Check a clip decoded under other limits against ``options``, as :func:`decode_video` would
    have before decoding it (the same messages): its frame size, frames and duration, decode work
    and sampled bytes. The decoding deadline (``max_decode_s``) bounds work already done: it is
    not checked.

    Raises:
        InvalidVideoError: the clip passes one of ``options``' limits.
    """
    options = options or VideoOptions()
    height, width = int(video.frames.shape[1]), int(video.frames.shape[2])
    if width * height > options.max_frame_pixels:
        raise InvalidVideoError(f"The video's frames are {width}x{height}; Prism takes frames of up to "
                                f"{options.max_frame_pixels:,} pixels. Scale it down (e.g. to 1280x720).")
    total, fps = video.total_frames, video.fps
    if total > options.max_frames or total / fps > options.max_duration_s:
        raise InvalidVideoError(f"The video is {total / fps:.1f} s long ({total:,} frames); Prism takes clips "
                                f"of up to {options.max_duration_s:g} s and {options.max_frames:,} frames. Trim it.")
    _check_work(video.indices, width * height, options)


def _video_stream(container):
    if container.format.name not in _CONTAINERS:
        raise InvalidVideoError(_NOT_A_VIDEO)
    if not container.streams.video:
        raise InvalidVideoError("The file holds no video frames: it has no video stream, or is truncated or "
                                "damaged. Upload a clip with at least two frames.")
    stream = container.streams.video[0]
    if stream.codec_context is None or stream.codec_context.name not in _CODECS:
        raise InvalidVideoError(_NOT_A_VIDEO)
    return stream


def _frame_count_and_rate(container, stream, options: VideoOptions) -> tuple[int, float]:
    """The stream's frame count and rate, checked against the limits before any frame is decoded."""
    width, height = stream.codec_context.width, stream.codec_context.height
    if width < 1 or height < 1:
        raise InvalidVideoError("The video's frame size is missing or zero; the file is damaged. Upload it again.")
    if width * height > options.max_frame_pixels:
        raise InvalidVideoError(f"The video's frames are {width}x{height}; Prism takes frames of up to "
                                f"{options.max_frame_pixels:,} pixels. Scale it down (e.g. to 1280x720).")
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else 0.0
    if not fps > 0:
        raise InvalidVideoError("The video does not say its frame rate; the file is damaged. Re-encode it as MP4.")
    total = int(stream.frames or 0)
    if total == 0:
        total = _count_packets(container, stream, options)
        _check_not_cut_short(container, total, fps)
    if total > options.max_frames or total / fps > options.max_duration_s:
        raise InvalidVideoError(f"The video is {total / fps:.1f} s long ({total:,} frames); Prism takes clips "
                                f"of up to {options.max_duration_s:g} s and {options.max_frames:,} frames. Trim it.")
    return total, fps


def _count_packets(container, stream, options: VideoOptions) -> int:
    """Frames of a stream whose container does not record them: its packets, counted without
    decoding, stopping once past ``max_frames``."""
    import av

    count = 0
    try:
        for packet in container.demux(stream):
            if packet.size:
                count += 1
                if count > options.max_frames:
                    break
        container.seek(0)  # a damaged index can make the rewind itself fail (EPERM from FFmpeg)
    except av.FFmpegError as e:
        raise InvalidVideoError("The video file is damaged or truncated. Upload it again.") from e
    return count


def _check_not_cut_short(container, counted: int, fps: float) -> None:
    """Refuse a file whose counted frames end well before the duration its header declares
    (Matroska's segment duration, written before the frames): a WebM cut short still demuxes
    cleanly, so the packet count alone cannot tell. Slack of 10% and one frame, for rounding and
    variable frame rates."""
    import av

    declared = container.duration / av.time_base if container.duration else 0.0
    if declared > 0 and counted / fps < 0.9 * declared - 1 / fps:
        raise InvalidVideoError(f"The video file ends early: its header says {declared:.1f} s, the file holds "
                                f"{counted / fps:.1f} s. It is truncated or damaged; upload it again.")


def _check_work(indices: list[int], frame_pixels: int, options: VideoOptions) -> None:
    decoded = (indices[-1] + 1) * frame_pixels
    sampled = len(indices) * frame_pixels * 3
    if decoded > options.max_decode_pixels or sampled > options.max_sampled_bytes:
        raise InvalidVideoError("The video is too large to decode (frames x frame size); use a shorter "
                                "clip or smaller frames.")


def _decode(container, stream, indices: list[int], size: tuple[int, int], options: VideoOptions) -> list[np.ndarray]:
    """The frames at ``indices`` (ascending) as uint8 ``[H, W, 3]`` RGB, decoding in order up to the
    last one."""
    import av

    wanted, last = set(indices), indices[-1]
    deadline = time.monotonic() + options.max_decode_s
    frames: list[np.ndarray] = []
    try:
        for i, frame in enumerate(container.decode(stream)):
            if i > last:
                break
            if (frame.height, frame.width) != size:
                raise InvalidVideoError("The video changes its frame size mid-stream; Prism needs one frame "
                                        "size. Re-encode it as MP4.")
            if i in wanted:
                frames.append(frame.to_ndarray(format="rgb24"))
            if time.monotonic() > deadline:
                raise InvalidVideoError(f"Decoding the video took over {options.max_decode_s:g} s; use a "
                                        "shorter clip or smaller frames.")
    except av.FFmpegError as e:
        raise InvalidVideoError("The video file is damaged or truncated. Upload it again.") from e
    if len(frames) < len(indices):
        raise InvalidVideoError(f"The video file ends early: its header promises frames up to {last + 1}, "
                                f"the file holds fewer. It is truncated or damaged; upload it again.")
    return frames


#: The FFmpeg demuxer each container we open is read with, by :func:`sniff_video`'s answer (and
#: the GIF header). Named, never probed: FFmpeg's probe would also try the demuxers that open
#: other files (concat lists, HLS playlists, image2 sequences), relative to the working directory.
_DEMUXERS = {"video/mp4": "mov", "video/webm": "matroska", "image/gif": "gif"}
#: Top-level QuickTime boxes a MOV may open with instead of ``ftyp``.
_QUICKTIME_FIRST_BOXES = frozenset({b"free", b"wide", b"skip", b"moov", b"mdat", b"pnot"})


def video_demuxer(data: bytes) -> str:
    """The FFmpeg demuxer to read a video file with, from its first bytes: ``"mov"`` (MP4/MOV: an
    ``ftyp`` box, or a QuickTime ``free``/``wide``/``skip``/``moov``/``mdat``/``pnot`` box first),
    ``"matroska"`` (WebM/Matroska) or ``"gif"``.

    Raises:
        InvalidVideoError: any other file (a playlist, a concat list, an image, text...): it is
            never handed to FFmpeg.
    """
    kind = sniff_video(data) or ("image/gif" if data.startswith((b"GIF87a", b"GIF89a")) else None)
    if kind is None and len(data) >= 8 and data[4:8] in _QUICKTIME_FIRST_BOXES:
        kind = "video/mp4"  # older QuickTime writers put padding or the movie box before any ftyp
    if kind is None:
        raise InvalidVideoError(_NOT_A_VIDEO)
    return _DEMUXERS[kind]


def sniff_video(data: bytes) -> str | None:
    """``"video/mp4"`` (an ISO BMFF ``ftyp`` box: MP4, MOV) or ``"video/webm"`` (an EBML header:
    WebM, Matroska) from a file's first bytes, else None. For routing uploads and MIME types only:
    it does not validate (animated GIFs are images to this test)."""
    if len(data) >= 12 and data[4:8] == b"ftyp":
        return "video/mp4"
    if data.startswith(b"\x1a\x45\xdf\xa3"):
        return "video/webm"
    return None


def poster_jpeg(video: DecodedVideo, longest_edge: int = 320) -> bytes:
    """The clip's first sampled frame as a JPEG of at most ``longest_edge`` pixels a side (bytes):
    the poster a video card shows."""
    from PIL import Image

    im = Image.fromarray(video.frames[0])
    im.thumbnail((longest_edge, longest_edge))
    out = io.BytesIO()
    im.save(out, "JPEG", quality=85)
    return out.getvalue()


class DecodedVideos:
    """Decoded clips kept per cache salt, so that each later question about a clip in a session
    skips decoding it (the file is still read and hashed: the key is its SHA-256). LRU, bounded by
    the sampled frames' bytes; keyed by the salt as the processed-image cache is, so one session's
    decoding is never another's (a hit would tell it the other had the clip).

    Args:
        sampling: the video processor's settings. options: the limits. cache_bytes: bound of the
            kept frames (bytes); a clip larger than it is decoded and not kept.

    Counters: ``hits`` (clips taken from the cache), ``entries``. The frames handed out are
    shared with later prompts: callers must not write to them (the processor copies them).
    """

    def __init__(self, sampling: VideoSampling, options: VideoOptions, cache_bytes: int = 128 << 20):
        from collections import OrderedDict
        from threading import Lock

        self.sampling, self.options, self.cache_bytes = sampling, options, int(cache_bytes)
        self._entries: OrderedDict[tuple[str, str], DecodedVideo] = OrderedDict()
        self._bytes, self._lock, self.hits = 0, Lock(), 0

    @property
    def entries(self) -> int:
        return len(self._entries)

    def forget(self, salt: str) -> int:
        """Drop the salt's decoded clips; returns how many went."""
        with self._lock:
            gone = [k for k in self._entries if k[0] == salt]
            for key in gone:
                self._bytes -= self._entries.pop(key).frames.nbytes
            return len(gone)

    def get(self, source, salt: str) -> DecodedVideo:
        """The clip's sampled frames (see :func:`decode_video`), from the cache when this salt
        decoded the same bytes before.

        Raises:
            InvalidVideoError: as :func:`decode_video`.
        """
        data = read_video_bytes(source, self.options)
        key = (salt, hashlib.sha256(data).hexdigest())
        with self._lock:
            if (found := self._entries.get(key)) is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return found
        video = UPLOADS.take(salt, key[1], self.sampling.namespace())  # the upload's own decoding
        if video is not None:
            check_decoded(video, self.options)
        else:
            video = decode_video(data, self.sampling, self.options)
        size = video.frames.nbytes
        if size <= self.cache_bytes:
            with self._lock:
                if key not in self._entries:
                    self._entries[key] = video
                    self._bytes += size
                while self._bytes > self.cache_bytes:
                    _, old = self._entries.popitem(last=False)
                    self._bytes -= old.frames.nbytes
        return video
