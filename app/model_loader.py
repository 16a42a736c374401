"""Choosing the model and loading it in the background.

The web server starts at once; the model loads in a thread of its own, reporting its progress in
the terminal. :class:`ModelLoader` tells the rest of the app (``/healthz``, the page's banner, the
chat handlers) whether the engine is ready yet.

Which model: ``--model`` when given; otherwise ``Qwen/Qwen3-VL-2B-Instruct`` when it is in the
local Hugging Face cache or the Hub answers within a few seconds (then it is downloaded); otherwise
the built-in tiny demo checkpoint (random weights), built once under the data dir.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from sessions import private_dir

from .settings import REAL_MODEL, Settings

log = logging.getLogger(__name__)

#: How long the Hub may take to answer before Prism decides it is offline.
HUB_PROBE_TIMEOUT_S = 4.0
DEMO_MODEL_ID = "prism-tiny-demo"
PROBE_MODEL_ID = "prism-probe"
#: The committed probe checkpoint (benchmarks/quality/probe, docs/QUALITY.md): a 22 M-parameter
#: Qwen3-VL trained on synthetic pictures of shapes and words; ``--model probe`` serves it.
PROBE_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "quality" / "probe"
#: Text hidden sizes at or below this are the random tiny checkpoints of ``engine.tiny``.
_TINY_HIDDEN_SIZE = 256


@dataclass(frozen=True)
class ModelChoice:
    """The checkpoint to load.

    Attributes:
        source: what to pass to ``Engine.from_pretrained`` (a folder or a Hub id).
        model_id: the name shown to users and API clients.
        demo: True for a random-weight tiny checkpoint (its answers are random text).
        reason: why this model was chosen, for the terminal.
    """

    source: str
    model_id: str
    demo: bool
    reason: str


def say(message: str) -> None:
    """Progress for the person who started the app (stderr, flushed)."""
    print(f"[prism] {message}", file=sys.stderr, flush=True)


def hub_offline() -> bool:
    """Whether the user told Hugging Face libraries not to use the network."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def cached_snapshot(model_id: str) -> str | None:
    """The local folder of ``model_id`` in the Hugging Face cache, or None (never uses the network)."""
    from huggingface_hub import snapshot_download

    from engine.hub import CHECKPOINT_PATTERNS

    try:
        return snapshot_download(model_id, allow_patterns=CHECKPOINT_PATTERNS, local_files_only=True)
    except Exception:
        return None


def hub_reachable(model_id: str, timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the Hub describes ``model_id`` within ``timeout`` seconds (False offline).

    The request runs in a daemon thread so that even a resolver that ignores timeouts cannot
    hold up start-up.
    """
    if hub_offline():
        return False
    answer: list[bool] = []

    def probe() -> None:
        from huggingface_hub import HfApi

        try:
            HfApi().model_info(model_id, timeout=timeout)
            answer.append(True)
        except Exception as exc:
            log.debug("hub probe failed: %s", exc)
            answer.append(False)

    thread = threading.Thread(target=probe, name="prism-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout + 1.0)
    return bool(answer and answer[0])


def demo_checkpoint(data_dir: Path) -> Path:
    """The tiny demo checkpoint under ``data_dir/models``, built on first use; private like the
    rest of the data dir (folders ``0700``, files ``0600``; an existing one is tightened: the
    builder leaves its weights ``0644`` for checkpoints shared outside an app)."""
    from engine.tiny import build_tiny_checkpoint

    folder = data_dir / "models" / "tiny-demo"
    private_dir(folder)
    if not (folder / "model.safetensors").is_file() or not (folder / "tokenizer.json").is_file():
        say(f"building the tiny demo checkpoint in {folder} (once) ...")
        build_tiny_checkpoint(folder, "demo", seed=0)
    for path in folder.rglob("*"):
        with suppress(OSError):
            if not path.is_symlink() and path.stat().st_mode & 0o077:
                path.chmod(0o700 if path.is_dir() else 0o600)
    return folder


def looks_tiny(folder: str | Path) -> bool:
    """Whether a local checkpoint folder is one of the tiny random-weight checkpoints."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
        return int(config.get("text_config", {}).get("hidden_size", 1 << 20)) <= _TINY_HIDDEN_SIZE
    except (OSError, ValueError, TypeError, AttributeError):
        return False


def choose_model(requested: str | None, data_dir: Path, *, probe_timeout: float = HUB_PROBE_TIMEOUT_S) -> ModelChoice:
    """Pick the checkpoint to load (see the module docstring). Never waits long on the network.
    ``"probe"`` is the committed probe model: it answers one-word questions about synthetic
    pictures (the colour, count, word or position of shapes), not general chat."""
    if requested == "probe":
        return ModelChoice(str(PROBE_DIR), PROBE_MODEL_ID, False, "asked for with --model probe")
    if requested and requested != "demo":
        folder = Path(requested).expanduser()
        return ModelChoice(requested, folder.name if folder.is_dir() else requested,
                           folder.is_dir() and looks_tiny(folder), "given with --model")
    if requested != "demo":
        say(f"looking for {REAL_MODEL} in the local Hugging Face cache ...")
        folder = cached_snapshot(REAL_MODEL)
        if folder:
            return ModelChoice(folder, REAL_MODEL, False, "found in the Hugging Face cache")
        if hub_offline():
            say("not cached, and HF_HUB_OFFLINE is set: not trying to download it")
        else:
            say(f"not cached; asking the Hugging Face Hub (at most {probe_timeout:.0f} s) ...")
            if hub_reachable(REAL_MODEL, probe_timeout):
                return ModelChoice(REAL_MODEL, REAL_MODEL, False, "downloading it from the Hugging Face Hub")
            say("the Hub cannot be reached (offline?)")
    folder = demo_checkpoint(data_dir)
    reason = "asked for with --model demo" if requested == "demo" else f"{REAL_MODEL} is not available offline"
    return ModelChoice(str(folder), DEMO_MODEL_ID, True, reason)


#: Pauses (seconds) before each new try when a restarted core process dies again while it loads;
#: after the last, the loader gives up (``failed``: the server must be restarted).
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0)


class ModelLoader:
    """Loads the engine in a background thread and reports its state.

    ``state`` is ``"loading"``, ``"ready"``, ``"restarting"`` or ``"failed"``. ``engine`` is an
    :class:`~engine.client.EngineClient` (None unless ready): with ``--engine in_process`` an
    :class:`~engine.client.InProcessClient`, with ``--engine process`` a
    :class:`~engine.client.ProcessClient`, whose core process, should it die, is started again
    with the same options (``restarting`` meanwhile; ``restarts`` counts them). Tests can hand in
    a ready engine (an ``Engine`` is wrapped in an ``InProcessClient``) with :meth:`ready`.
    """

    def __init__(self, settings: Settings):
        self.settings = settings
        self.state = "loading"
        self.stage = "starting"
        self.error: str | None = None
        self.choice: ModelChoice | None = None
        self.engine = None
        self.started_at = time.monotonic()
        self.load_seconds: float | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ready_event = threading.Event()
        self.restarts = 0
        self._closed = False
        self._listeners: list = []

    @classmethod
    def ready(cls, engine, choice: ModelChoice, settings: Settings | None = None) -> ModelLoader:
        """A loader around an engine that is already loaded."""
        from engine.client import EngineClient, InProcessClient

        if not isinstance(engine, EngineClient):
            engine = InProcessClient(engine)
        loader = cls(settings or Settings())
        loader.choice, loader.engine, loader.state, loader.stage = choice, engine, "ready", "ready"
        loader.load_seconds = 0.0
        loader._ready_event.set()
        return loader

    def on_ready(self, callback) -> None:
        """Call ``callback(engine)`` each time an engine becomes ready: after the first load and
        after every restart of a core process that died (each new core starts with empty caches),
        and at once if one is ready now. Each call runs in a daemon thread of its own (a callback
        may block, e.g. warming prefixes); its exceptions are logged."""
        with self._lock:
            self._listeners.append(callback)
            engine = self.engine if self.state == "ready" else None
        if engine is not None:
            self._notify([callback], engine)

    @staticmethod
    def _notify(callbacks, engine) -> None:
        def run(callback):
            try:
                callback(engine)
            except Exception:
                log.exception("a model-ready callback failed")

        for callback in callbacks:
            threading.Thread(target=run, args=(callback,), name="prism-on-ready", daemon=True).start()

    def start(self) -> None:
        """Start loading in the background (returns at once)."""
        self._thread = threading.Thread(target=self._load, name="prism-model-loader", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the engine is ready or failed; True when ready."""
        self._ready_event.wait(timeout)
        return self.state == "ready"

    def _load(self) -> None:
        try:
            self.stage = "choosing the model"
            choice = choose_model(self.settings.model, self.settings.data_path)
            self.choice = choice
            say(f"model: {choice.model_id} ({choice.reason})")
            self.stage = f"loading {choice.model_id}"
            engine = self._build(choice)
        except BaseException as exc:  # shown in /healthz and on the page
            self._failed(exc)
            return
        self._ready(engine)

    def _build(self, choice: ModelChoice):
        """The engine client ``--engine`` names, loaded (blocks for the whole model load)."""
        options = dict(device=self.settings.device, progress=True, **self.settings.engine_options())
        if self.settings.replicas:
            from engine.replicas import ReplicaClient

            return ReplicaClient(choice.source, replicas=self.settings.replicas, ray_address=self.settings.ray_address,
                                 replica_cpus=self.settings.replica_cpus, **replica_options(options, self.settings))
        if self.settings.engine == "process":
            from engine.client import ProcessClient

            return ProcessClient(choice.source, on_crash=self._crashed, **options)
        from engine.client import InProcessClient

        return InProcessClient.from_pretrained(choice.source, **options)

    def _failed(self, exc: BaseException) -> None:
        log.exception("model loading failed", exc_info=exc)
        with self._lock:
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
        say(f"loading the model FAILED: {self.error}")
        self._ready_event.set()

    def _ready(self, engine) -> None:
        with self._lock:
            closed = self._closed
            if not closed:
                self.engine, self.state, self.stage, self.error = engine, "ready", "ready", None
                self.load_seconds = time.monotonic() - self.started_at
        if closed:  # the server stopped while this engine loaded
            engine.close()
            return
        say(f"model ready: {self.model_id} on {engine.device} ({engine.dtype}, KV {engine.options.kv_cache_dtype}) "
            f"after {self.load_seconds:.1f} s")
        self._ready_event.set()
        with self._lock:
            listeners = list(self._listeners)
        self._notify(listeners, engine)

    def _crashed(self, client) -> None:
        """The core process died (called from its client's reader thread, once every waiting
        request has been failed): ``restarting`` until a new one is loaded with the same options."""
        with self._lock:
            if self._closed or self.engine is not client:
                return
            self.engine, self.state = None, "restarting"
            self.stage = f"restarting the engine (its process {client.pid} stopped)"
            self.restarts += 1
            self.started_at = time.monotonic()
            self._ready_event.clear()
        say(f"the engine process {client.pid} stopped unexpectedly; restarting it ...")
        client.close()
        self._thread = threading.Thread(target=self._restart, name="prism-engine-restart", daemon=True)
        self._thread.start()

    def _restart(self) -> None:
        """Load the engine again; a core that dies while it loads (killed again, out of memory) is
        retried after a pause (:data:`RESTART_BACKOFF_S`, ``restarting`` meanwhile); any other
        failure, or the last retry's, is final (``failed``)."""
        from engine.errors import EngineAbortedError

        for attempt, pause in enumerate((*RESTART_BACKOFF_S, None), start=1):
            try:
                engine = self._build(self.choice)
            except EngineAbortedError as exc:
                if pause is None or self._closed:
                    self._failed(exc)
                    return
                with self._lock:
                    self.stage = f"restarting the engine (attempt {attempt + 1}; the last one stopped: {exc})"
                say(f"the engine process stopped while loading; trying again in {pause:.0f} s ...")
                time.sleep(pause)
                continue
            except BaseException as exc:
                self._failed(exc)
                return
            self._ready(engine)
            return

    @property
    def model_id(self) -> str | None:
        return self.choice.model_id if self.choice else None

    @property
    def demo(self) -> bool:
        return bool(self.choice and self.choice.demo)

    def status(self) -> dict:
        """What ``/healthz`` reports: ``status``, ``model``, ``demo_model``, ``stage``; once the
        engine runs, its device, dtypes, ``engine`` (:meth:`engine.Engine.stats`; over replicas,
        their sum) and ``host_cache`` (:func:`host_cache_status`: the host-memory tier, None when
        off); over replicas (``--replicas``) ``replicas``: each one's ``id``, ``state``,
        ``sessions``, ``restarts`` and its counters (:data:`REPLICA_COUNTERS`, under the
        ``stats()`` names; absent while it is not ready). ``ok`` while at least one replica is."""
        state = {"loading": "loading", "ready": "ok", "restarting": "restarting", "failed": "error"}
        engine = self.engine
        status = state[self.state]
        if status == "ok" and engine is not None and not getattr(engine, "alive", True):
            status = "restarting"  # its core just died: the reader thread has not told us yet
        out = {"status": status,
               "model": self.model_id, "demo_model": self.demo, "stage": self.stage}
        if self.error:
            out["error"] = self.error
        if self.restarts:
            out["engine_restarts"] = self.restarts
        if engine is not None and status == "ok":
            out.update(device=str(engine.device), dtype=str(engine.dtype).replace("torch.", ""),
                       kv_cache_dtype=engine.options.kv_cache_dtype, load_seconds=round(self.load_seconds or 0, 1))
            try:
                if hasattr(engine, "replica_status"):
                    from engine.replicas import aggregate_stats

                    replicas = engine.replica_status()
                    out["replicas"] = [replica_entry(r) for r in replicas]
                    out["engine"] = aggregate_stats(replicas)
                else:
                    out["engine"] = engine.stats()
                out["host_cache"] = host_cache_status(out["engine"])
                out["engine_status"] = "running"
            except Exception as exc:  # closed engine
                out["engine_status"] = f"unavailable: {exc}"
        return out

    def close(self) -> None:
        """Stop the engine (running requests end with an error); an engine still loading or
        restarting is closed once it is ready."""
        with self._lock:
            self._closed = True
            engine, self.engine = self.engine, None
        if engine is not None:
            self.state, self.stage = "failed", "stopped"
            self.error = "the server is shutting down"
            engine.close()


#: The counters of each ``/healthz`` ``replicas`` entry, under their ``stats()`` names.
REPLICA_COUNTERS = ("running", "waiting", "tokens_generated", "cache_hits", "cache_misses", "cache_stale",
                    "cache_entries", "cache_pages", "pages_total", "pages_used", "pages_free")


def replica_entry(replica: dict) -> dict:
    """One ``/healthz`` ``replicas`` entry from :meth:`~engine.replicas.ReplicaClient.replica_status`:
    ``id``, ``state``, ``sessions``, ``restarts``, then :data:`REPLICA_COUNTERS` when it answered."""
    entry = {k: replica[k] for k in ("id", "state", "sessions", "restarts")}
    stats = replica.get("stats") or {}
    entry.update({k: stats[k] for k in REPLICA_COUNTERS if k in stats})
    return entry


def replica_options(options: dict, settings: Settings) -> dict:
    """Engine options for each of ``settings.replicas`` replicas: the host-memory tier (the
    ``--host-cache-bytes`` asked for, else this host's default share) split evenly between them,
    since replicas on one host share its RAM (each replica's engine would otherwise take the whole
    default for itself)."""
    from engine import EngineOptions

    total = EngineOptions(host_cache_bytes=settings.host_cache_bytes).host_budget(settings.tensor_parallel_size)
    per = total // settings.replicas
    return {**options, "host_cache_bytes": per - per % settings.tensor_parallel_size}


def host_cache_status(stats: dict) -> dict | None:
    """The host-memory tier under the prefix cache, as ``/healthz`` and the Engine tab show it.

    Args:
        stats: :meth:`engine.Engine.stats`; an engine that predates the tier lacks its keys.

    Returns:
        None when the tier is off (no host pages: ``host_pages_total`` 0 or missing); else
        ``bytes`` (its budget, ``host_cache_bytes``), ``bytes_allocated`` (host memory it holds),
        ``pages_total``, ``pages_used`` (pages of the pool's page size) and ``entries`` (prefix
        entries on the host now), all ints.
    """
    total = int(stats.get("host_pages_total", 0) or 0)
    if total <= 0:
        return None
    return {"bytes": int(stats.get("host_cache_bytes", 0) or 0),
            "bytes_allocated": int(stats.get("host_bytes_allocated", 0) or 0),
            "pages_total": total, "pages_used": int(stats.get("host_pages_used", 0) or 0),
            "entries": int(stats.get("cache_host_entries", 0) or 0)}
