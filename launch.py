"""Start Prism: ``python launch.py`` opens a web chat about your images on http://127.0.0.1:7860.

See ``python launch.py --help`` for the options (each has a ``PRISM_*`` environment variable).
The server starts at once and prints its URL; the model loads in the background (progress in
this terminal, ``GET /healthz`` answers 503 until it is ready). Ctrl-C stops it cleanly: answers
in progress are cancelled and the database is closed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time


def _prepare_environment(data_dir) -> None:
    """Keep everything the app writes inside the data dir, and Gradio off the network."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    os.environ.setdefault("GRADIO_TEMP_DIR", str(data_dir / "tmp"))
    os.environ.setdefault("PRISM_CACHE_DIR", str(data_dir / "cache"))
    os.environ.setdefault("MPLCONFIGDIR", str(data_dir / "cache" / "matplotlib"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _private_data_dir(path):
    """The data dir as an absolute path, created ``0700`` (an existing one is tightened), with
    ``tmp/`` (Gradio's upload folder) the same; from here on every file and folder this process
    creates is private to its user (umask ``077``)."""
    from pathlib import Path

    from sessions import private_dir

    os.umask(0o077)
    path = Path(os.path.abspath(path))
    for folder in (path, path / "tmp"):
        private_dir(folder)
    return path


def _drop_shutdown_cancellations(record: logging.LogRecord) -> bool:
    """Logging filter: False for records about a task cancelled by the shutdown."""
    return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


class _Terminated(Exception):
    """SIGTERM arrived (after uvicorn's own shutdown, or before it started)."""


def _exit_on_sigterm(signum, frame) -> None:
    raise _Terminated


def _host_tier_refusal(settings) -> str | None:
    """Why the host tier asked for (``--host-cache-bytes`` or ``PRISM_HOST_CACHE_BYTES``) cannot be
    had on this host (its message says how much there is), or None."""
    from engine import EngineOptions
    from engine.errors import InvalidRequestError

    try:
        EngineOptions(host_cache_bytes=settings.host_cache_bytes).host_budget(settings.tensor_parallel_size)
    except InvalidRequestError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    from app.settings import parse_settings

    started = time.monotonic()
    settings = parse_settings(argv)
    refusal = _host_tier_refusal(settings)
    if refusal is not None:  # refused at start, not after the server is up and the model loaded
        print(f"prism: {refusal}", file=sys.stderr)
        return 2
    data_dir = _private_data_dir(settings.data_path)
    _prepare_environment(data_dir)

    import uvicorn

    from app.chat import ChatService
    from app.gradio_guard import STALE_UPLOAD_S, UploadFolder
    from app.model_loader import ModelLoader, say
    from app.server import create_app
    from sessions import SessionStore

    say(f"data dir: {data_dir}")
    store = SessionStore(data_dir, image_options=settings.image_options(), max_images_per_session=settings.max_images)
    store.collect_garbage()
    UploadFolder(data_dir / "tmp", 0).sweep(STALE_UPLOAD_S)
    loader = ModelLoader(settings)
    loader.start()
    chat = ChatService(store, loader, max_upload_bytes=settings.max_upload_bytes)
    app = create_app(settings, store, loader, chat)
    host = settings.host
    if host in ("127.0.0.1", "::1", "0.0.0.0", "::"):
        host = "localhost"  # 0.0.0.0 listens on every interface; localhost is one of them
    url = f"http://{host}:{settings.port}/"
    if settings.ui == "off":  # no page to open: name the API's routes (a bare /v1 is no route)
        url += "v1/chat/completions (and /v1/models, /metrics, /healthz)"

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                say(f"Prism is running at {url}  (started in {time.monotonic() - started:.1f} s; Ctrl-C to stop)")

        def handle_exit(self, sig, frame):
            if not self.should_exit:
                cancelled = chat.cancel_all() + app.state.openai.cancel_all()
                say(f"stopping: cancelled {cancelled} answer(s) in progress ...")
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                            timeout_graceful_shutdown=3, access_log=False)
    # Open browser tabs keep Gradio's event streams alive; at Ctrl-C uvicorn cancels them after the
    # grace period and would log each cancellation as an "Exception in ASGI application".
    logging.getLogger("uvicorn.error").addFilter(_drop_shutdown_cancellations)
    server = Server(config)
    # uvicorn handles SIGTERM (a supervisor's stop) like Ctrl-C and then raises it again once it
    # has shut down; with the default handler that kills the process before the cleanup below.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        server.run()
    except (KeyboardInterrupt, _Terminated):  # uvicorn re-raises the signal it handled, once it has shut down
        pass
    finally:
        chat.cancel_all()
        loader.close()
        store.close()
        say("stopped; database closed")
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
