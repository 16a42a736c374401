"""The committed test media are complete and accounted for: every file in ``tests/media`` has its
origin and licence in ``SOURCES.md``, and every file listed there is committed."""

from __future__ import annotations

import pathlib
import re

MEDIA = pathlib.Path(__file__).resolve().parent / "media"


def listed_files() -> set[str]:
    """The first cell of each row of SOURCES.md's table (the header and separator left out)."""
    rows = re.findall(r"^\| ([^|]+?) \|", (MEDIA / "SOURCES.md").read_text(), flags=re.MULTILINE)
    return {name for name in rows if name not in ("file", "---")} - {""}


def test_every_media_file_is_listed_with_its_origin_and_licence():
    present = {p.name for p in MEDIA.iterdir() if p.is_file() and p.name != "SOURCES.md"}
    assert present - listed_files() == set(), "files in tests/media without a row in SOURCES.md"
    assert listed_files() - present == set(), "rows in SOURCES.md for files that are not committed"


def test_the_photos_the_tests_name_are_committed():
    for name in ("astronaut.png", "chelsea.png", "rocket.jpg", "page.png", "pan.mp4", "pan.gif"):
        assert (MEDIA / name).stat().st_size > 1000, name
