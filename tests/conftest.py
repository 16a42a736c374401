"""Shared pytest fixtures: tiny Qwen3-VL checkpoints and the sample media folder."""

from __future__ import annotations

import os
import pathlib
import re
from typing import NoReturn

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter (tests/test_triton_kernels.py); it must be
# chosen before the kernels are defined, i.e. before ops.triton_kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# No host-memory tier unless a test asks for one (``host_cache_bytes=...``, or
# ``monkeypatch.setenv``): its default is a quarter of the host's RAM per engine process, pinned on
# CUDA, and the suite builds dozens of engines (15 at a time on the GPU), launch.py servers and
# engine cores in child processes, which inherit this. ``setdefault``: a run may still ask for
# one everywhere (``PRISM_HOST_CACHE_BYTES=64M python -m pytest``).
os.environ.setdefault("PRISM_HOST_CACHE_BYTES", "0")

#: Where tests put the engines they build: ``PRISM_TEST_DEVICE=cuda python -m pytest`` runs the
#: engine tests on the GPU (their oracles, transformers and the reference ops, stay on the CPU).
TEST_DEVICE = os.environ.get("PRISM_TEST_DEVICE", "cpu")

if TEST_DEVICE != "cpu":
    import dataclasses

    import engine.engine as _engine_module

    # On CUDA an engine's KV pool defaults to most of the free GPU memory; the tests build many
    # engines in one process, so each gets the CPU default (512 MiB) unless a test asks otherwise.
    @dataclasses.dataclass(frozen=True)
    class _TestEngineOptions(_engine_module.EngineOptions):
        kv_cache_bytes: int | None = 512 << 20

    _engine_module.EngineOptions = _TestEngineOptions

#: The sample photos and clips, committed under ``tests/media/`` (origins and licences in its
#: ``SOURCES.md``); ``$PRISM_MEDIA_DIR`` may point elsewhere. A test that needs a missing one fails.
MEDIA_DIR = pathlib.Path(os.environ.get("PRISM_MEDIA_DIR", pathlib.Path(__file__).resolve().parent / "media"))

#: ``.ci/run`` sets ``PRISM_CI=1``: then an optional tool a test needs (Chromium, Playwright) must be
#: there, and the only skips allowed are those of tests that need a GPU (:data:`GPU_ONLY_SKIPS`).
#: Without it (a developer's machine) a missing optional tool skips with its reason.
CI = os.environ.get("PRISM_CI") == "1"

#: Skip reasons allowed under ``PRISM_CI=1``: tests (or cases) that can only run on a GPU.
GPU_ONLY_SKIPS = re.compile(r"GPU|CUDA|compute capability|inline assembly|the interpreter's bfloat16 tl\.dot")


def missing_fixture(message: str) -> NoReturn:
    """Report a missing optional test tool: fail under ``PRISM_CI=1``, skip otherwise."""
    if CI:
        pytest.fail(f"{message} (PRISM_CI=1: CI must provide it)", pytrace=False)
    pytest.skip(message)


def media_file(name: str) -> pathlib.Path:
    """The path of sample photo ``name`` in :data:`MEDIA_DIR`; fails the test if it is absent."""
    path = MEDIA_DIR / name
    if not path.is_file():
        pytest.fail(f"sample media {path} is missing: the photos are committed in tests/media "
                    "(is PRISM_MEDIA_DIR pointing elsewhere?)", pytrace=False)
    return path


@pytest.fixture(scope="session")
def media_path():
    """Return :func:`media_file` (a name in :data:`MEDIA_DIR` -> its path; fails if absent)."""
    return media_file


@pytest.fixture(scope="session")
def media_dir() -> pathlib.Path:
    """:data:`MEDIA_DIR`; fails the test if the folder is missing (``usefixtures`` it in modules
    that read the photos directly)."""
    if not MEDIA_DIR.is_dir():
        pytest.fail(f"sample media folder {MEDIA_DIR} is missing: the photos are committed in "
                    "tests/media (is PRISM_MEDIA_DIR pointing elsewhere?)", pytrace=False)
    return MEDIA_DIR


_skips: list[tuple[str, str]] = []  # (test id, reason) of every skipped test, for the CI check


def _record_skip(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skips.append((report.nodeid, reason))


def pytest_runtest_logreport(report):
    _record_skip(report)


def pytest_collectreport(report):
    """A module that skips as a whole (``pytest.importorskip`` or ``pytest.skip(allow_module_level=
    True)`` at import) is a collection report, not a test's: without this, a missing Triton would
    skip test_triton_kernels.py and test_linear.py under ``PRISM_CI=1`` without a word."""
    _record_skip(report)


def _stray_skips() -> list[tuple[str, str]]:
    return [(test, reason) for test, reason in _skips if not GPU_ONLY_SKIPS.search(reason)]


def pytest_sessionfinish(session, exitstatus):
    """Under ``PRISM_CI=1`` a skip that is not a GPU-only test's fails the run."""
    if CI and _stray_skips():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if CI and _stray_skips():
        terminalreporter.section("PRISM_CI=1: only GPU-only tests may skip", red=True)
        for test, reason in _stray_skips():
            terminalreporter.write_line(f"STRAY SKIP {test}: {reason}")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> pathlib.Path:
    """A "test" preset tiny Qwen3-VL checkpoint (seed 0), built once per session."""
    from engine.model.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-test"), "test", seed=0)


@pytest.fixture(scope="session")
def demo_ckpt(tmp_path_factory) -> pathlib.Path:
    """A "demo" preset tiny Qwen3-VL checkpoint (seed 0, untied lm_head, bfloat16), built once per session."""
    from engine.model.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-demo"), "demo", seed=0)


@pytest.fixture(scope="session")
def tiny_engine_factory(tiny_ckpt):
    """Return ``make(dtype=torch.float32, **options) -> Engine`` building engines on the "test"
    checkpoint that share one loaded model (per dtype) and one processor, so tests can afford many
    engine configurations (pool sizes, chunk sizes, queue limits). Options are
    :class:`engine.engine.EngineOptions` fields (``progress`` defaults to False). Engines left open
    are closed at the end of the session. ``compaction_mode`` defaults to ``"always"`` here (the
    engine's default is ``"on_pressure"``)."""
    import torch
    from transformers import AutoProcessor

    from engine.engine import Engine, EngineOptions
    from engine.model.qwen3_vl import load_model

    processor = AutoProcessor.from_pretrained(str(tiny_ckpt))
    models: dict = {}
    made: list = []

    def make(dtype=torch.float32, **options) -> Engine:
        if dtype not in models:
            models[dtype] = load_model(tiny_ckpt, device=TEST_DEVICE, dtype=dtype, progress=False)
        options.setdefault("progress", False)
        # Compaction tests compare a prefix compacted when it is cached with the masked oracle; the
        # default mode (on_pressure) compacts only under pressure, and its own tests ask for it.
        options.setdefault("compaction_mode", "always")
        engine = Engine(models[dtype], processor, model_id=str(tiny_ckpt), folder=tiny_ckpt,
                        options=EngineOptions(**options))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


class LiveServer:
    """An ASGI app served by uvicorn on a free local port from a thread of this process, as
    ``launch.py`` serves it (so requests cross a real socket, and one request that blocks the
    event loop blocks the others). ``url`` is ``http://127.0.0.1:<port>``."""

    def __init__(self, app):
        import socket
        import threading

        import uvicorn

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)
        self.thread.start()
        for _ in range(600):  # up to a minute on a busy 2-core machine
            if self.server.started or not self.thread.is_alive():
                break
            self.thread.join(0.1)
        if not self.server.started:
            raise RuntimeError(f"uvicorn did not start on port {self.port}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def live_server():
    """Return ``serve(app) -> LiveServer``; every server started is stopped after the module."""
    started: list[LiveServer] = []

    def serve(app) -> LiveServer:
        started.append(LiveServer(app))
        return started[-1]

    yield serve
    for server in started:
        server.stop()


def noise_png(seed: int, size=(80, 60)) -> bytes:
    """A PNG of seeded uniform noise, ``size`` = (width, height) pixels: distinct images per seed
    whose vision features share nothing (cache-isolation tests)."""
    import io

    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(size[1], size[0], 3, generator=gen) * 255).to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()
