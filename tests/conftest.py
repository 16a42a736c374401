"""Shared pytest fixtures: tiny Qwen3-VL checkpoints and the sample media folder."""

from __future__ import annotations

import pathlib

import pytest

#: Sample photos and clips shared by the project (``/work/shared/media`` beside the repository).
MEDIA_DIR = pathlib.Path(__file__).resolve().parents[2] / "shared" / "media"


@pytest.fixture(scope="session")
def media_path():
    """Return a function mapping a file name in :data:`MEDIA_DIR` to its path (skips if absent)."""

    def find(name: str) -> pathlib.Path:
        path = MEDIA_DIR / name
        if not path.is_file():
            pytest.skip(f"sample media {path} is not available")
        return path

    return find


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> pathlib.Path:
    """A "test" preset tiny Qwen3-VL checkpoint (seed 0), built once per session."""
    from engine.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-test"), "test", seed=0)


@pytest.fixture(scope="session")
def demo_ckpt(tmp_path_factory) -> pathlib.Path:
    """A "demo" preset tiny Qwen3-VL checkpoint (seed 0, untied lm_head, bfloat16), built once per session."""
    from engine.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-demo"), "demo", seed=0)
