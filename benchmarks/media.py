"""The sample photos the benchmarks ask about: the ones committed in ``tests/media/`` (origins and
licences in its ``SOURCES.md``), or ``$PRISM_MEDIA_DIR`` when set."""

from __future__ import annotations

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MEDIA_DIR = pathlib.Path(os.environ.get("PRISM_MEDIA_DIR", ROOT / "tests" / "media"))
PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "china.jpg", "grace_hopper.jpg",
          "hubble_deep_field.jpg", "coins.png")
IMAGE_SIDE = 448


def load_photos(n: int, side: int = IMAGE_SIDE) -> list:
    """``n`` RGB photos (cycling through :data:`PHOTOS`) resized to ``side`` x ``side``.

    Raises:
        SystemExit: the photo folder is missing.
    """
    from PIL import Image

    if n and not MEDIA_DIR.is_dir():
        raise SystemExit(f"error: sample photos not found in {MEDIA_DIR} (set PRISM_MEDIA_DIR)")
    images = []
    for i in range(n):
        with Image.open(MEDIA_DIR / PHOTOS[i % len(PHOTOS)]) as im:
            images.append(im.convert("RGB").resize((side, side), Image.Resampling.BICUBIC))
    return images
