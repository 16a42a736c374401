"""The README's numbers that a reader relies on agree with the code's defaults.

A stale limit in the README misleads a user about what is refused (the clip limits were
tightened in the code while the README still promised 300 s and 18,000 frames).
"""
from __future__ import annotations

import pathlib
import re

from engine.inputs.video import VideoOptions

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _clip_limits_sentence() -> str:
    text = " ".join(README.read_text(encoding="utf-8").split())
    match = re.search(r"`InvalidVideoError` before work is spent \(([^)]*)\)", text)
    assert match, "the README no longer states the clip limits where the engine section did"
    return match.group(1)


def test_readme_clip_limits_are_the_video_options_defaults():
    """Each number in the README's list of clip limits is ``VideoOptions()``'s."""
    limits = _clip_limits_sentence()
    options = VideoOptions()
    assert f"over {options.max_bytes >> 20} MiB" in limits
    assert f"{options.max_duration_s:g} s," in limits
    assert f"{options.max_frames:,} frames" in limits
    width, height = 1920, 1080
    assert options.max_frame_pixels == width * height and f"{width}×{height} pixels a frame" in limits
    assert f"a {options.max_decode_s:g} s decode deadline" in limits
