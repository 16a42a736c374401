"""Write the committed test clips: ``pan.mp4`` (H.264, 29.97 fps, 8 s, 96 x 64) and ``pan.gif``.

Both pan across ``chelsea.png`` (committed beside them, see ``SOURCES.md``), so the
frames differ from one another. Run from the repository root: ``python tests/media/make_media.py``.
PyAV writes them; the bytes depend on its libx264, so they are committed rather than rebuilt in
tests.
"""

from __future__ import annotations

import pathlib
from fractions import Fraction

import av
import numpy as np
from PIL import Image

HERE = pathlib.Path(__file__).resolve().parent
SOURCE = HERE / "chelsea.png"
WIDTH, HEIGHT = 96, 64
MP4_RATE = Fraction(30000, 1001)  # 29.97 fps
MP4_FRAMES = 240  # 8.008 s
GIF_FRAMES, GIF_DELAY_MS = 20, 100  # 2 s at 10 fps


def pan_frames(n: int) -> list[Image.Image]:
    """``n`` crops of the photo, moving right then down, scaled to WIDTH x HEIGHT."""
    with Image.open(SOURCE) as im:
        photo = im.convert("RGB")
    frames = []
    for i in range(n):
        x, y = round(i * (photo.width - 240) / max(n - 1, 1)), round(i * 60 / max(n - 1, 1))
        frames.append(photo.crop((x, y, x + 240, y + 160)).resize((WIDTH, HEIGHT), Image.BICUBIC))
    return frames


def write_mp4(path: pathlib.Path) -> None:
    with av.open(str(path), "w", options={"movflags": "faststart"}) as out:
        stream = out.add_stream("libx264", rate=MP4_RATE)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.options = {"crf": "30", "preset": "veryslow"}
        for frame in pan_frames(MP4_FRAMES):
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.asarray(frame), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def write_gif(path: pathlib.Path) -> None:
    frames = [f.quantize(64) for f in pan_frames(GIF_FRAMES)]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=GIF_DELAY_MS, loop=0)


if __name__ == "__main__":
    write_mp4(HERE / "pan.mp4")
    write_gif(HERE / "pan.gif")
    for name in ("pan.mp4", "pan.gif"):
        print(name, (HERE / name).stat().st_size, "bytes")
