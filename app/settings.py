"""Command-line and environment settings of the Prism app.

Every option of ``python launch.py`` has an environment variable ``PRISM_<OPTION>`` (upper case,
dashes as underscores) that sets its default; an option given on the command line wins. The
repeatable options (``--api-key``, ``--cors-origin``) read ``PRISM_API_KEYS`` and
``PRISM_CORS_ORIGINS``, lists separated by commas or whitespace; given on the command line they
replace the variable's list.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

REAL_MODEL = "Qwen/Qwen3-VL-2B-Instruct"

_SIZE_RE = re.compile(r"^\s*(\d{1,30}(?:\.\d{1,30})?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """``"0"``, ``"536870912"``, ``"512M"``, ``"512MiB"`` or ``"1.5G"`` -> a number of bytes
    (binary units, rounded down to a whole byte). The engine reads ``PRISM_HOST_CACHE_BYTES``
    with the same grammar (``engine.cache.host_memory.parse_size``; not imported here, so that
    ``--help`` stays fast; tests/test_host_memory.py holds the two equal).

    Raises:
        argparse.ArgumentTypeError: not such a size, or a size above 0 that rounds to 0 bytes.
    """
    match = _SIZE_RE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(
            f"not a size in bytes: {str(text)[:40]!r} (examples: 0, 536870912, 512M, 2G)")
    exact = Fraction(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    if 0 < exact < 1:
        raise argparse.ArgumentTypeError(f"a size must be 0 or at least 1 byte, got {text!r}")
    return int(exact)


def _positive_bytes(text: str) -> int:
    """:func:`parse_bytes`, refusing 0 (a KV pool needs pages)."""
    value = parse_bytes(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _bounded(convert, within, refusal: str):
    """An argparse type: ``convert`` (``int`` or ``float``) the text, then require ``within(value)``.

    ``refusal`` is the message for a value out of range, formatted with ``value`` (the converted
    number) and ``text`` (as given). Text that does not convert is refused as "not an integer" /
    "not a number"."""
    what = "an integer" if convert is int else "a number"

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not within(value):
            raise argparse.ArgumentTypeError(refusal.format(value=value, text=text))
        return value

    return parse


_positive_int = _bounded(int, lambda v: v >= 1, "must be at least 1, got {value}")


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {value}")
    return value


_seconds = _bounded(float, lambda v: 0 < v < float("inf"), "must be a positive number of seconds, got {text}")
_ratio = _bounded(float, lambda v: 0 < v <= 1, "must be in (0, 1], got {value}")
#: 0 (no replicas: one engine) or a number of replicas, at most 64.
_replica_count = _bounded(int, lambda v: 0 <= v <= 64, "must be in [0, 64], got {value}")
#: A positive number of CPUs, fractions allowed.
_cpus = _bounded(float, lambda v: 0 < v <= 1024, "must be a positive number of CPUs, got {text}")
#: A share in [0, 1] (0 turns the feature off).
_share = _bounded(float, lambda v: 0 <= v <= 1, "must be in [0, 1], got {value}")
_time_share = _bounded(float, lambda v: 0 < v <= 1, "must be in (0, 1], got {value}")


_RAY_ADDRESS_RE = re.compile(r"^(ray://)?[A-Za-z0-9.\-\[\]:]{1,253}:\d{1,5}$|^auto$")


def _ray_address(text: str) -> str:
    if not _RAY_ADDRESS_RE.match(text):
        raise argparse.ArgumentTypeError(f"not a Ray address (host:port, ray://host:port or auto): {text[:80]!r}")
    return text


def default_data_dir() -> Path:
    """The per-user data folder (``~/.local/share/prism`` on Linux)."""
    from platformdirs import user_data_dir

    return Path(user_data_dir("prism", appauthor=False))


@dataclass(frozen=True)
class Settings:
    """Everything ``launch.py`` can be told. See :func:`build_parser` for the meaning of each."""

    model: str | None = None
    device: str = "auto"
    host: str = "127.0.0.1"
    port: int = 7860
    ui: str = "on"
    data_dir: Path | None = None
    kv_cache_bytes: int | None = None
    host_cache_bytes: int | None = None
    kv_cache_dtype: str = "fp8_e4m3"
    compaction: str = "uniform"
    compaction_mode: str = "on_pressure"
    keep_ratio: float = 0.6
    cache_scope: str = "session"
    tensor_parallel_size: int = 1
    engine: str = "process"  # measured: docs/PERFORMANCE.md, "Streaming over HTTP"
    max_image_pixels: int = 50_000_000  # engine.media.ImageOptions' defaults (not imported: --help stays fast)
    max_upload_mb: int = 50
    max_images: int = 16
    resize_pixels: int = 1_003_520  # about 980 visual tokens per image (32 x 32 pixels per token)
    api_keys: tuple[str, ...] = dataclasses.field(default=(), repr=False)  # never printed
    api_key_file: Path | None = None
    cors_origins: tuple[str, ...] = ()
    body_timeout_s: float = 120.0
    max_media_per_request: int | None = None
    warm: str = "on"
    warm_share: float = 0.25
    warm_time_share: float = 0.03  # engine.serving.scheduler.SchedulerConfig's default
    replicas: int = 0  # 0: no Ray, one engine (--engine); N: N replicas on Ray Serve
    ray_address: str | None = None
    replica_cpus: float = 1.0

    @property
    def media_per_request(self) -> int:
        """Most images and videos one request may hold: ``max_media_per_request``, else ``max_images``."""
        return self.max_media_per_request or self.max_images

    @property
    def data_path(self) -> Path:
        """The data folder: ``data_dir`` or the per-user default."""
        return Path(self.data_dir).expanduser() if self.data_dir else default_data_dir()

    @property
    def max_upload_bytes(self) -> int:
        return self.max_upload_mb * 2**20

    def image_options(self):
        """The :class:`engine.media.ImageOptions` every uploaded image is checked against."""
        from engine.media import ImageOptions

        return ImageOptions(max_image_pixels=self.max_image_pixels, max_bytes=self.max_upload_bytes)

    def engine_options(self) -> dict:
        """Keyword options for :meth:`engine.Engine.from_pretrained`."""
        options = {
            "kv_cache_dtype": self.kv_cache_dtype,
            "compaction": None if self.compaction == "off" else self.compaction,
            "keep_ratio": self.keep_ratio,
            "compaction_mode": self.compaction_mode,
            "cache_scope": self.cache_scope,
            "max_image_pixels": self.max_image_pixels,
            "max_image_bytes": self.max_upload_bytes,
            "max_pixels": self.resize_pixels,
            "max_media_per_prompt": self.media_per_request,
        }
        if self.kv_cache_bytes is not None:
            options["kv_cache_bytes"] = self.kv_cache_bytes
        if self.host_cache_bytes is not None:  # 0 too: the tier turned off
            options["host_cache_bytes"] = self.host_cache_bytes
        if self.tensor_parallel_size != 1:
            options["tensor_parallel_size"] = self.tensor_parallel_size
        if self.warm_time_share != Settings.warm_time_share:
            options["warm_time_share"] = self.warm_time_share
        return options


# (flag, field, type, choices, help). The default comes from Settings, or from PRISM_<FIELD>.
_OPTIONS = [
    ("--model", "model", str, None,
     f"checkpoint folder or Hugging Face id (default: {REAL_MODEL} when it is cached or can be "
     "downloaded, otherwise the built-in tiny demo model with random weights; 'demo' forces the latter; "
     "'probe' serves the small model trained on synthetic pictures, benchmarks/quality/probe: one-word "
     "answers about shapes and words)"),
    ("--device", "device", str, ("auto", "cpu", "cuda"), "where the model runs (auto: CUDA when available)"),
    ("--host", "host", str, None, "address to listen on (0.0.0.0 exposes the app to your network)"),
    ("--port", "port", _port, None, "TCP port to listen on"),
    ("--ui", "ui", str, ("on", "off"),
     "on: the web chat at / beside the API; off: a headless server of /v1, /metrics and /healthz only "
     "(every page route is a 404, Gradio is not even imported)"),
    ("--data-dir", "data_dir", Path, None,
     "folder for the session database, uploaded images and the demo model (default: a per-user folder)"),
    ("--kv-cache-bytes", "kv_cache_bytes", _positive_bytes, None,
     "size of the KV cache pool, e.g. 512M or 4G (default: 512 MiB on CPU, most free GPU memory on CUDA)"),
    ("--host-cache-bytes", "host_cache_bytes", parse_bytes, None,
     "size of the host-memory tier under the prefix cache (idle KV kept in RAM and copied back on a "
     "hit), for the whole engine (tensor-parallel ranks split it), e.g. 8G; 0 turns it off (default: "
     "a quarter of this host's memory, less if less is available; more than the host can give is "
     "refused at start)"),
    ("--kv-cache-dtype", "kv_cache_dtype", str, ("fp8_e4m3", "auto"),
     "KV cache storage: Scaled-FP8 pages (fp8_e4m3) or the model's own dtype (auto)"),
    ("--compaction", "compaction", str, ("uniform", "staggered", "attention", "coverage", "diversity", "random", "off"),
     "how the cached image prefix drops visual tokens, keeping --keep-ratio of them: uniform (evenly "
     "spaced), staggered (evenly spaced per row, rows shifted), attention (the most attended in the "
     "vision encoder), coverage (attention with one token per region first), diversity (a max-min cover of "
     "the features), random (a control), or off (docs/QUALITY.md)"),
    ("--compaction-mode", "compaction_mode", str, ("always", "on_pressure"),
     "when the cached image prefix is compacted: always (as soon as it is computed) or on_pressure "
     "(kept dense, compacted only when KV memory runs short, before anything is evicted)"),
    ("--keep-ratio", "keep_ratio", _ratio, None,
     "share of visual tokens the compact prefix keeps, in (0, 1]; 1.0 keeps them all (the prefix is never compacted)"),
    ("--cache-scope", "cache_scope", str, ("session", "global"),
     "session: a cached prefix is reused only within its chat session (and its forks); "
     "global: across all sessions (single-user setups)"),
    ("--tensor-parallel-size", "tensor_parallel_size", _positive_int, None,
     "GPUs of this host the model is split across (tensor parallel, one process per GPU); 1: one GPU"),
    ("--engine", "engine", str, ("in_process", "process"),
     "where the engine core runs: in_process (a thread of the web server's process) or process (a child "
     "process the server talks to over a pipe, restarted if it dies; docs/ARCHITECTURE.md)"),
    ("--max-image-pixels", "max_image_pixels", _positive_int, None,
     "refuse images whose width x height is larger (decompression-bomb guard)"),
    ("--max-upload-mb", "max_upload_mb", _positive_int, None, "refuse image files larger than this many MiB"),
    ("--max-images", "max_images", _positive_int, None, "most images one chat session may hold"),
    ("--max-media-per-request", "max_media_per_request", _positive_int, None,
     "most images and videos one request (a question, a /v1 call) may hold (default: --max-images)"),
    ("--resize-pixels", "resize_pixels", _positive_int, None,
     "largest area an image is resized to before the vision encoder; more pixels mean more visual "
     "tokens and slower answers (Qwen3-VL allows up to 16777216, ~16k tokens for one photo)"),
    ("--body-timeout-s", "body_timeout_s", _seconds, None,
     "seconds a request's body may take to arrive after its headers (408 after that; slow headers "
     "need a proxy in front)"),
    ("--warm", "warm", str, ("on", "off"),
     "on: the chat builds a session's image prefix (vision encoder and prefill) as soon as its images "
     "change (upload, removal, a continued copy of a shared chat), so its first question is a prefix hit, "
     "and after a start the most recently used chats' prefixes (--warm-share); off: the first question "
     "computes it (POST /v1/prefix_cache/warm works either way)"),
    ("--warm-share", "warm_share", _share, None,
     "share of the KV pool, in [0, 1], that the most recently used chats' image prefixes may fill when the "
     "server (or a restarted engine core) starts, warmed before anyone asks; 0: none warmed at a start"),
    ("--warm-time-share", "warm_time_share", _time_share, None,
     "share of the engine's time, in (0, 1], that warms may take while questions run or wait (the rest of "
     "a warm waits: a running stream's TPOT stays within a few percent); 1: no time budget"),
    ("--replicas", "replicas", _replica_count, None,
     "engine replicas on Ray Serve behind this app, each chat session routed to one by its cache salt "
     "(consistent hashing with bounded loads; docs/SCALING.md); 0: one engine as --engine says, no Ray"),
    ("--ray-address", "ray_address", _ray_address, None,
     "with --replicas: an existing Ray cluster to run them on (salts, images and KV go to it: see the README's "
     "Security section); default: a local Ray instance on loopback, started and stopped with the app"),
    ("--replica-cpus", "replica_cpus", _cpus, None,
     "with --replicas: CPUs Ray reserves for each replica (fractions allowed); GPUs: --tensor-parallel-size each"),
    ("--api-key-file", "api_key_file", Path, None,
     "a file of API keys for /v1, one per line ('#' starts a comment line), besides any --api-key"),
]


#: Repeatable options: (flag, field, item type, metavar, help, secret); a secret's values are never shown.
_LIST_OPTIONS = [
    ("--api-key", "api_keys", "_api_key", "KEY",
     "an API key clients of /v1 must send (Authorization: Bearer KEY); repeat for several; with none "
     "the API is open and every request is its own cache session unless it sends prompt_cache_key "
     "(prefer PRISM_API_KEYS or --api-key-file: the command line is visible to other local users)", True),
    ("--cors-origin", "cors_origins", "_origin", "ORIGIN",
     "an origin (https://host[:port], or *) whose web pages may call /v1 from a browser; repeat for "
     "several; with none, browsers on other origins cannot send requests to the API", False),
]
_KEY_RE = re.compile(r"[\x21-\x7e]{1,512}")
_ORIGIN_RE = re.compile(r"^https?://[A-Za-z0-9.-]+(:\d{1,5})?$|^https?://\[[0-9A-Fa-f:.]+\](:\d{1,5})?$")


def _api_key(text: str) -> str:
    if not _KEY_RE.fullmatch(text):
        raise argparse.ArgumentTypeError("an API key must be 1 to 512 printable ASCII characters without spaces")
    return text


def _origin(text: str) -> str:
    if text != "*" and not _ORIGIN_RE.match(text):
        raise argparse.ArgumentTypeError(f"not an origin (scheme://host[:port], no path): {text!r}")
    return text


_LIST_TYPES = {"_api_key": _api_key, "_origin": _origin}


def read_key_file(path: Path) -> tuple[str, ...]:
    """API keys from a file: one per line; blank lines and lines starting with ``#`` are skipped.

    Raises:
        argparse.ArgumentTypeError: the file cannot be read, or a line is not a valid key.
    """
    try:
        lines = Path(path).expanduser().read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read the API key file {str(path)!r}: {exc}") from None
    keys = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if line and not line.startswith("#"):
            try:
                keys.append(_api_key(line))
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentTypeError(f"{path}, line {n}: {exc}") from None
    return tuple(keys)


def _env_name(field: str) -> str:
    return "PRISM_" + field.upper()


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The ``launch.py`` argument parser; defaults come from ``environ`` (``PRISM_*``) or Settings."""
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="python launch.py",
        description="Prism: a visual chat about your images on the embedded Qwen3-VL engine. "
        "Starts a web server and prints its URL.",
        epilog="Every option can also be set with an environment variable PRISM_<OPTION> "
        "(for example PRISM_PORT=8080 or PRISM_DATA_DIR=/srv/prism); the command line wins.",
    )
    defaults = Settings()
    for flag, field, kind, choices, text in _OPTIONS:
        env = _env_name(field)
        default = getattr(defaults, field)
        if environ.get(env):
            try:
                default = kind(environ[env])
            except (argparse.ArgumentTypeError, ValueError) as exc:
                parser.error(f"{env}={environ[env]!r}: {exc}")
        shown = "" if default is None else f"; default {default}"
        parser.add_argument(flag, dest=field, type=kind, choices=choices, default=default,
                            help=f"{text} [env {env}{shown}]")
    for flag, name, kind, metavar, text, secret in _LIST_OPTIONS:
        env = _env_name(name)
        values = _env_list(parser, env, environ.get(env, ""), _LIST_TYPES[kind])
        shown = f"{len(values)} set" if secret else ", ".join(values)
        parser.add_argument(flag, dest=name, type=_LIST_TYPES[kind], action="append", default=None,
                            metavar=metavar, help=f"{text} [env {env}{'; ' + shown if values else ''}]")
    return parser


def _env_list(parser: argparse.ArgumentParser, env: str, text: str, kind) -> tuple[str, ...]:
    values = []
    for item in text.replace(",", " ").split():
        try:
            values.append(kind(item))
        except argparse.ArgumentTypeError as exc:
            parser.error(f"{env}: {exc}")  # the value itself is not repeated: it may be a key
    return tuple(values)


def parse_settings(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from the command line ``argv`` and the ``PRISM_*`` variables of ``environ``."""
    parser = build_parser(environ)
    args = parser.parse_args(argv)
    for _, field, _, choices, _ in _OPTIONS:
        value = getattr(args, field)
        if choices and value not in choices:  # argparse does not check defaults taken from the environment
            parser.error(f"{_env_name(field)}={value!r}: choose from {', '.join(choices)}")
    environ = os.environ if environ is None else environ
    for _, name, kind, _, _, _ in _LIST_OPTIONS:
        given = getattr(args, name)
        env = _env_name(name)
        setattr(args, name, tuple(given) if given is not None else
                _env_list(parser, env, environ.get(env, ""), _LIST_TYPES[kind]))
    if args.api_key_file is not None:
        try:
            args.api_keys = tuple(dict.fromkeys(args.api_keys + read_key_file(args.api_key_file)))
        except argparse.ArgumentTypeError as exc:
            parser.error(str(exc))
        if not args.api_keys:
            parser.error(f"the API key file {str(args.api_key_file)!r} holds no key")
    return Settings(**vars(args))
