"""An OpenAI-compatible API: ``POST /v1/chat/completions`` and ``GET /v1/models``, and Prism's
``POST /v1/prefix_cache/warm`` (below).

Messages may mix text parts, ``image_url`` parts and ``video_url`` parts (an MP4, WebM or animated
GIF clip, as vLLM accepts them) whose URL is a base64 ``data:`` URL (remote URLs are refused: the
server never fetches anything). A video counts as one file against the same body cap and per-file
limit as an image; a file the engine cannot use (not a video, truncated, no frames, too long or
too large to decode) is a 400 with the engine's message. ``stream: true`` answers with server-sent
events. A client that disconnects mid-answer cancels its request in the engine.

``model`` may be left out (the served model answers); a model this server does not serve is a
404 with code ``model_not_found``, as OpenAI and vLLM answer. ``GET /v1/models`` lists the one
served model.

An answer cut short never looks finished. Stopped before its end (the server shutting down, a
cancel in the engine), a stream's last chunk has ``finish_reason: "abort"`` (vLLM's reason for
an aborted request) and is followed by an error event, ``data: {"error": {..., "code":
"aborted"}}``, before ``data: [DONE]``; a failure inside the engine sends the error event alone
(as vLLM does), never a ``finish_reason``. The same without streaming: 503 (code ``aborted``) or
500, in OpenAI's error shape.

Who may call, and what is shared (see README, "What stays with its owner"):

* With API keys configured (``--api-key``, ``PRISM_API_KEYS``, ``--api-key-file``), every ``/v1``
  request needs ``Authorization: Bearer <key>``; none or a wrong one is 401 in OpenAI's error
  shape. Keys are compared in constant time (digests of equal length, every key compared).
* The prefix-cache salt is chosen by the server, never by the client: without keys, each request
  gets a salt of its own (nothing it leaves in any cache is found by another request) unless it
  sends OpenAI's ``prompt_cache_key``: requests with the same ``prompt_cache_key`` share a salt,
  an HMAC of that key under a per-process server secret (so a long random ``prompt_cache_key`` is
  a capability: only who knows it reaches that cache). With keys, the salt is per API key, and
  per ``prompt_cache_key`` within a key.
* ``POST /v1/prefix_cache/warm`` (issue 34) builds a prefix before its first question, for a
  client that knows its images before its questions. Its body is a chat request's ``messages``
  (parsed as ``/v1/chat/completions`` parses them: the same ``data:`` URL parts, media and size
  limits) laid out media-first, the layout :func:`engine.media_first_messages` writes: an optional
  system message, then a user message whose content starts with ``"Image 1: "``, the first image,
  then ``"\\nImage 2: "``, the second, ... (clips as ``Video N: `` parts, numbered apart), and
  anything after the last one (the question, or nothing). Images elsewhere, or other text between
  them, are a 400 naming the text expected: only that layout's prefix can be warmed, and a later
  chat request hits it when its messages start the same way. ``prompt_cache_key`` is required
  (400 without: an anonymous request is its own cache session, nothing could ever find what it
  warmed); the salt is derived from it exactly as for a chat request. ``wait`` (default true):
  answer once the prefix is cached, ``200 {"object": "prefix_cache.warm", "status": "cached",
  "prefix_tokens": N}``; false: at once, ``202`` with ``"status": "warming"`` and the same
  ``prefix_tokens`` (a chat request sent meanwhile joins the warm in the engine). A client
  that goes away does not cancel the warm. Refusals as for a chat request (401, 404 for another
  ``model``, 415, 429, 503, 400 for bad input or a prefix longer than the context). Counted in
  ``/metrics`` as ``prism:prefix_cache_warms_total{source="api"}``.
* A browser on another origin cannot drive the API: request bodies must be
  ``Content-Type: application/json`` (anything else is 415, so a cross-origin form or
  ``text/plain`` post is refused), and a cross-origin preflight is answered only for the origins
  given with ``--cors-origin`` (the CORS middleware lives in this API's own sub-application,
  mounted at ``/v1``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from engine import (
    Completion,
    EngineAbortedError,
    EngineOverloadedError,
    InvalidImageError,
    InvalidRequestError,
    PrismError,
    SamplingParams,
)

from .metrics import Metrics

log = logging.getLogger(__name__)

#: Most tokens an answer gets when the request sets neither ``max_tokens`` nor
#: ``max_completion_tokens`` (fewer when the prompt leaves less room in the context).
DEFAULT_MAX_TOKENS = 512
#: Longest ``prompt_cache_key`` accepted (characters).
MAX_PROMPT_CACHE_KEY = 1024
#: Most text one request may carry (characters over every text part and string content): the
#: README's "plus 1 MiB of text" of the /v1 body cap, enforced on its own.
MAX_TEXT_CHARS = 1 << 20
#: Most content parts (text, image and video) of one request.
MAX_PARTS = 1024
#: Most JSON objects one body may hold (counted while parsing, which stops at the limit: a body of
#: a million tiny parts is refused before it is all built in memory).
MAX_JSON_OBJECTS = 4096
_DATA_URL_RE = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[^,;]*)*?),(?P<data>.*)$", re.DOTALL)


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        # a message may echo client text: a lone surrogate in it must not make the 4xx a 500
        message = self.message.encode("utf-8", "backslashreplace").decode("utf-8")
        body = {"error": {"message": message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


@contextlib.contextmanager
def _refusals_as_api_errors():
    """The engine's refusals of a request or a warm, raised when it is handed over, as API errors:
    bad input 400, overloaded 429, the core gone 503 (:func:`_failure`), anything else 500."""
    try:
        yield
    except (InvalidImageError, InvalidRequestError) as exc:
        raise _bad(str(exc), "messages") from None
    except EngineOverloadedError as exc:
        raise APIError(429, str(exc), "server_error") from None
    except EngineAbortedError as exc:
        raise _failure(exc) from None
    except PrismError as exc:
        raise APIError(500, str(exc), "server_error") from None


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def decode_data_url(url: object, max_bytes: int, what: str = "image") -> bytes:
    """The bytes of a base64 ``data:`` URL (``what``: ``"image"`` or ``"video"``, for the
    messages), at most ``max_bytes`` of them, or :class:`APIError` 400."""
    example = "data:video/mp4;base64,..." if what == "video" else "data:image/png;base64,..."
    if not isinstance(url, str):
        raise _bad(f"{what}_url.url must be a string", "messages")
    if not url.startswith("data:"):
        raise _bad(f"only base64 data: URLs are accepted for {what}s ({example}); "
                   "this server does not fetch remote URLs", "messages")
    match = _DATA_URL_RE.match(url)
    if not match or ";base64" not in match.group("params").lower():
        raise _bad(f"{what} data: URLs must be base64 encoded ({example})", "messages")
    payload = match.group("data").strip()
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise _bad(f"a{'n' if what == 'image' else ''} {what} is larger than the limit of "
                   f"{max_bytes / 2**20:g} MiB", "messages")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(f"a{'n' if what == 'image' else ''} {what} data: URL is not valid base64", "messages") from None


def _check_request_size(raw: list, max_media: int) -> None:
    """Refuse (400, naming the limit) a ``messages`` array over :data:`MAX_PARTS` parts,
    :data:`MAX_TEXT_CHARS` characters of text, or ``max_media`` images and videos, before any part
    is decoded."""
    parts = media = chars = 0
    for msg in raw:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            parts += len(content)
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("image_url", "video_url"):
                    media += 1
                elif kind == "text" and isinstance(part.get("text"), str):
                    chars += len(part["text"])
    if parts > MAX_PARTS:
        raise _bad(f"the request has {parts:,} content parts; at most {MAX_PARTS:,} are accepted", "messages")
    if chars > MAX_TEXT_CHARS:
        raise _bad(f"the request has {chars:,} characters of text; at most {MAX_TEXT_CHARS:,} are accepted",
                   "messages")
    if media > max_media:
        raise _bad(f"the request has {media} images and videos; this server takes at most {max_media} per "
                   "request (--max-media-per-request)", "messages")


def convert_messages(raw: object, max_image_bytes: int, max_media: int = 16) -> list[dict]:
    """OpenAI chat messages -> engine messages (image and video parts as bytes; a video file is
    held to the same per-file limit as an image, ``max_image_bytes``). A request over
    ``max_media`` images and videos, :data:`MAX_PARTS` parts or :data:`MAX_TEXT_CHARS` characters
    of text is refused (400) before any base64 is decoded."""
    if not isinstance(raw, list) or not raw:
        raise _bad("messages must be a non-empty array", "messages")
    _check_request_size(raw, max_media)
    out = []
    for n, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise _bad(f"messages[{n}] must be an object", "messages")
        role = msg.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise _bad(f"messages[{n}].role must be system, user or assistant, got {role!r}", "messages")
        content = msg.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"messages[{n}].content must be a string or an array of parts", "messages")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                spec = part.get("image_url")
                url = spec.get("url") if isinstance(spec, dict) else spec
                parts.append({"type": "image", "image": decode_data_url(url, max_image_bytes)})
            elif kind == "video_url":  # as vLLM accepts it: {"video_url": {"url": "data:video/mp4;base64,..."}}
                spec = part.get("video_url")
                url = spec.get("url") if isinstance(spec, dict) else spec
                parts.append({"type": "video", "video": decode_data_url(url, max_image_bytes, "video")})
            else:
                raise _bad(f"messages[{n}]: unsupported content part type {kind!r} (use text, image_url or "
                           "video_url)", "messages")
        out.append({"role": role, "content": parts})
    return out


def _number(body: dict, name: str, default, kind=float):
    value = body.get(name, default)
    if value is None:
        return default
    wrong_type = isinstance(value, bool) or not isinstance(value, (int, float))
    if wrong_type or (kind is int and not float(value).is_integer()):
        raise _bad(f"{name} must be {'an integer' if kind is int else 'a number'}", name)
    return kind(value)


def sampling_from(body: dict) -> SamplingParams:
    """SamplingParams from ``max_tokens``/``max_completion_tokens``, ``temperature``, ``top_p``,
    ``seed`` and ``stop``. Without a token limit (absent or null) the answer gets up to
    :data:`DEFAULT_MAX_TOKENS`, fewer when the prompt leaves less room; a limit that does not fit
    is refused."""
    if body.get("n", 1) not in (1, None):
        raise _bad("only n = 1 is supported", "n")
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise _bad("stop must be a non-empty string or an array of at most 16 of them", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("seed must be an integer", "seed")
    try:
        return SamplingParams(
            max_tokens=_number(body, limit_name, None, int),
            default_max_tokens=DEFAULT_MAX_TOKENS,
            temperature=_number(body, "temperature", 1.0),
            top_p=_number(body, "top_p", 1.0),
            seed=seed,
            stop=tuple(stop),
        )
    except InvalidRequestError as exc:  # the engine's messages start with the field's name
        field = str(exc).split(" ", 1)[0]
        param = {"max_tokens": limit_name, "temperature": "temperature", "top_p": "top_p", "seed": "seed"}.get(field)
        raise _bad(str(exc), param) from None


def _usage(completion: Completion) -> dict:
    tel = completion.telemetry
    prompt = len(completion.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": tel.generated_tokens,
            "total_tokens": prompt + tel.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": tel.cached_tokens}}


def _finish_reason(completion: Completion) -> str:
    """OpenAI's ``finish_reason`` (``stop``, ``length``), or vLLM's ``abort`` for an answer
    cancelled before its end."""
    return {"stop": "stop", "length": "length"}.get(completion.finish_reason, "abort")


def _sse_error(error: APIError) -> str:
    """An error as a server-sent event, in OpenAI's error shape."""
    body = {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _failure(exc: BaseException) -> APIError:
    """The 500 for a request that failed inside the engine (a bug is logged, and named only by
    its type); the 503 ``aborted`` of one whose engine process died under it (retry: the app
    restarts the engine)."""
    if isinstance(exc, EngineAbortedError):
        return APIError(503, f"the answer was stopped before it was finished: {exc}", "server_error", code="aborted")
    if isinstance(exc, PrismError):
        return APIError(500, f"the request failed: {exc}", "server_error")
    log.error("API request failed", exc_info=exc)
    return APIError(500, f"the request failed: internal error ({type(exc).__name__})", "server_error")


def prompt_cache_key_of(body: dict) -> str | None:
    """The request's ``prompt_cache_key`` (a non-empty string of at most
    :data:`MAX_PROMPT_CACHE_KEY` characters), None without one; else :class:`APIError` 400."""
    key = body.get("prompt_cache_key")
    if key is None:
        return None
    if not isinstance(key, str) or not key or len(key) > MAX_PROMPT_CACHE_KEY:
        raise _bad(f"prompt_cache_key must be a non-empty string of at most {MAX_PROMPT_CACHE_KEY} characters",
                   "prompt_cache_key")
    return key


def _is_json(request: Request) -> bool:
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    return media_type == "application/json"


class _TooManyObjects(Exception):
    pass


class _ObjectBudget:
    """A ``json.loads`` object hook that stops the parse at the ``limit``-th object + 1."""

    def __init__(self, limit: int):
        self.left = limit

    def __call__(self, obj: dict) -> dict:
        self.left -= 1
        if self.left < 0:
            raise _TooManyObjects
        return obj


def warm_prefix_of(messages: list[dict]) -> tuple[list, str | None]:
    """The images (and clips, ``{"video": bytes}``) and the system prompt of engine messages
    (:func:`convert_messages`' output) laid out media-first (see the module docstring), for
    :meth:`~engine.client.EngineClient.warm`: ``warm(images, system=system)`` builds the prefix
    that these messages, with any question after the last image, attach.

    Raises:
        APIError: 400 naming what differs from that layout: a system message that is not text
            or empty, no user message after it, no image, text other than the layout's between (or before)
            the images, or an image or clip outside the first user message.
    """
    rest, system = list(messages), None
    if rest and rest[0]["role"] == "system":
        content = rest.pop(0)["content"]
        if isinstance(content, list):
            if any(p["type"] != "text" for p in content):
                raise _bad("messages[0]: a system message holds text only", "messages")
            content = "".join(p["text"] for p in content)
        if not content:  # media_first_messages leaves an empty one out: a request with it has another prefix
            raise _bad("messages[0]: an empty system message cannot be warmed (leave it out, here and in the chat "
                       "requests)", "messages")
        system = content
    first = len(messages) - len(rest)
    if not rest or rest[0]["role"] != "user":
        raise _bad(f"messages[{first}] must be the user message holding the images (after an optional system "
                   "message)", "messages")
    content = rest[0]["content"]
    media, counts, text = [], {"image": 0, "video": 0}, ""
    for part in content if isinstance(content, list) else [{"type": "text", "text": content}]:
        if part["type"] == "text":
            text += part["text"]
            continue
        kind = part["type"]
        counts[kind] += 1
        expected = ("\n" if media else "") + f"{kind.capitalize()} {counts[kind]}: "
        if text != expected:
            shown = text if len(text) <= 80 else text[:79] + "…"
            raise _bad(f"messages[{first}]: the text before {kind} {counts[kind]} must be exactly {expected!r}, "
                       f"got {shown!r}: only the media-first layout's prefix can be warmed (Image 1: <image>, then "
                       "\\nImage 2: <image>, ...; the question after the last one)", "messages")
        media.append(part["image"] if kind == "image" else {"video": part["video"]})
        text = ""
    if not media:
        raise _bad(f"messages[{first}] holds no image or video: there is no prefix to warm", "messages")
    for n, msg in enumerate(rest[1:], first + 1):
        if isinstance(msg["content"], list) and any(p["type"] != "text" for p in msg["content"]):
            raise _bad(f"messages[{n}]: every image and video of a warm must be in the first user message",
                       "messages")
    return media, system


def _is_unicode(text: str) -> bool:
    """Whether ``text`` has no lone UTF-16 surrogate (UTF-8 cannot encode one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def _until_disconnected(request: Request) -> None:
    """Return once the client of ``request`` has gone away: its ASGI ``receive`` (which, once the
    body has been read, answers only at a disconnect) says ``http.disconnect``. Awaited, never
    polled; cancel the task awaiting it when the answer is done."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class OpenAIAPI:
    """The ``/v1`` routes over a model loader (``loader.engine``, ``loader.model_id``), as the
    sub-application :attr:`app`, to mount at ``/v1``.

    Args:
        loader: where the engine comes from (None while loading).
        max_image_bytes: largest decoded image accepted.
        max_media: most images and videos one request may hold (``--max-media-per-request``).
        api_keys: keys a client must present as ``Authorization: Bearer <key>``; none: the API
            is open, and each request is its own cache session unless it sends ``prompt_cache_key``.
        cors_origins: origins (``https://example.org``, or ``*``) a browser may call the API from;
            none: cross-origin preflights are not answered, so browsers on other origins cannot
            send JSON here.
        secret: the server secret salts are derived from (random per process by default).
        metrics: where finished and refused requests are counted (a private one by default).
    """

    def __init__(self, loader, *, max_image_bytes: int, api_keys=(), cors_origins=(), secret: bytes | None = None,
                 metrics: Metrics | None = None, max_media: int = 16):
        self.loader = loader
        self.max_image_bytes, self.max_media = max_image_bytes, max_media
        self.metrics = metrics or Metrics(loader)
        self._keys = [_digest(k) for k in api_keys]
        self._secret = secret or secrets.token_bytes(32)
        self._active: set = set()
        self._stopping = False
        self.app = FastAPI(title="Prism API", docs_url=None, redoc_url=None, openapi_url=None)
        self.app.add_api_route("/models", self.models, methods=["GET"])
        self.app.add_api_route("/chat/completions", self.chat_completions, methods=["POST"])
        self.app.add_api_route("/prefix_cache/warm", self.warm_prefix, methods=["POST"])
        self._warms: set = set()  # warms not waited for, held until they finish (or shutdown cancels them)
        if cors_origins:
            self.app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                                    allow_headers=["Authorization", "Content-Type"], max_age=600)

    def cancel_all(self) -> int:
        """Cancel every API request in progress (shutdown): their streams end at once, as aborted
        (see the module docstring), and later requests get 503."""
        self._stopping = True
        handles = list(self._active)
        for handle in handles:
            handle.cancel(wait=False)
        for warm in list(self._warms):  # prefix warms too (not counted: no answer is cut short)
            warm.cancel(wait=False)
        return len(handles)

    def authorize(self, request: Request) -> bytes | None:
        """The digest of the client's API key, or None when no keys are configured.

        Raises:
            APIError: 401 when keys are configured and the request has none, or a wrong one.
        """
        if not self._keys:
            return None
        auth = request.headers.get("authorization", "")
        presented = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not presented:
            raise APIError(401, "You didn't provide an API key. Send it in an Authorization header: "
                                "Authorization: Bearer YOUR_KEY.", headers={"WWW-Authenticate": "Bearer"})
        digest, match = _digest(presented), None
        for key in self._keys:  # every key compared, each in constant time: the timing tells nothing
            if hmac.compare_digest(digest, key):
                match = key
        if match is None:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return match

    def salt_for(self, api_key: bytes | None, prompt_cache_key: str | None) -> str:
        """The cache salt of a request: per API key and ``prompt_cache_key`` (an HMAC of both under
        the server secret); without either, a fresh random salt that no other request gets."""
        if api_key is None and prompt_cache_key is None:
            return "api:once:" + secrets.token_hex(16)
        message = json.dumps(["prism-api-salt", api_key.hex() if api_key else None, prompt_cache_key])
        return "api:" + hmac.new(self._secret, message.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()

    def _model_id(self) -> str:
        return self.loader.model_id or "prism"

    def check_model(self, body: dict) -> None:
        """The request's ``model`` must be the served one; absent or null means the served one.

        Raises:
            APIError: 400 when ``model`` is not a string; 404 (code ``model_not_found``) when it
                names a model this server does not serve. While the model is still being chosen
                any name passes (the request then gets the 503 of a loading server).
        """
        model = body.get("model")
        if model is None:
            return
        if not isinstance(model, str):
            raise _bad("model must be a string (the id GET /v1/models lists), or left out", "model")
        if not _is_unicode(model):
            raise _bad("model is not valid Unicode (an unpaired UTF-16 surrogate)", "model")
        served = self.loader.model_id
        if served is not None and model != served:
            shown = model if len(model) <= 200 else model[:199] + "…"
            raise APIError(404, f"The model `{shown}` does not exist on this server; it serves `{served}` "
                                "(GET /v1/models lists it; leave model out to use it).", param="model",
                           code="model_not_found")

    async def models(self, request: Request):
        try:
            self.authorize(request)
        except APIError as exc:
            self.metrics.observe_rejected(exc.status)
            return exc.response()
        engine_ready = getattr(self.loader, "engine", None) is not None
        data = [{"id": self._model_id(), "object": "model", "created": int(time.time()), "owned_by": "prism"}]
        return {"object": "list", "data": data if engine_ready or self.loader.model_id else []}

    async def _authorized_json(self, request: Request) -> tuple[bytes | None, dict]:
        """The caller's API key and the JSON body of a ``/v1`` POST, its model checked.

        Raises:
            APIError: 401 (:meth:`authorize`), 415 (not JSON), 400 (:meth:`_body`, :meth:`check_model`).
        """
        api_key = self.authorize(request)
        if not _is_json(request):
            raise APIError(415, "the request body must be JSON, sent with Content-Type: application/json",
                           code="unsupported_media_type")
        body = await self._body(request)
        self.check_model(body)
        return api_key, body

    async def chat_completions(self, request: Request):
        try:
            api_key, body = await self._authorized_json(request)
            messages = convert_messages(body.get("messages"), self.max_image_bytes, self.max_media)
            sampling = sampling_from(body)
            salt = self.salt_for(api_key, prompt_cache_key_of(body))
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise _bad("stream must be true or false", "stream")
            options = body.get("stream_options") or {}
            include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
            engine = self._engine()
            handle = await run_in_threadpool(self._submit, engine, messages, sampling, salt)
        except APIError as exc:
            self.metrics.observe_rejected(exc.status)
            return exc.response()
        rid = "chatcmpl-" + secrets.token_hex(12)
        if stream:
            return StreamingResponse(self._sse(request, handle, rid, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(request, handle, rid)

    def _engine(self):
        """The engine client, or the 503 of a server shutting down, loading, restarting or failed."""
        if self._stopping:
            raise APIError(503, "the server is shutting down", "server_error")
        engine = self.loader.engine
        if engine is None:
            state = getattr(self.loader, "state", None)
            if state == "failed":
                raise APIError(503, "the engine is not available (see /healthz); the server must be restarted",
                               "server_error", code="engine_unavailable")
            why = ("the engine is restarting (its process stopped)" if state == "restarting"
                   else "the model is still loading")
            raise APIError(503, f"{why}; retry shortly", "server_error", code="loading",
                           headers={"Retry-After": "5"})
        return engine

    async def warm_prefix(self, request: Request):
        """``POST /v1/prefix_cache/warm``: build the prefix of a media-first request's images
        before its question (see the module docstring)."""
        try:
            api_key, body = await self._authorized_json(request)
            key = prompt_cache_key_of(body)
            if key is None:
                raise _bad("prompt_cache_key is required: a request without one is its own cache session, so "
                           "nothing could ever use the prefix it warmed; send the same prompt_cache_key here and "
                           "with the chat requests that should find it", "prompt_cache_key")
            images, system = warm_prefix_of(convert_messages(body.get("messages"), self.max_image_bytes,
                                                             self.max_media))
            wait = body.get("wait", True)
            if not isinstance(wait, bool):
                raise _bad("wait must be true or false", "wait")
            salt = self.salt_for(api_key, key)
            engine = self._engine()
            handle = await run_in_threadpool(self._warm, engine, images, system, salt)
        except APIError as exc:
            self.metrics.observe_rejected(exc.status)
            return exc.response()
        self.metrics.observe_warm("api")
        self._warms = {h for h in self._warms if not h.done} | {handle}  # the finished ones let go
        if not wait and not handle.done:
            return JSONResponse({"object": "prefix_cache.warm", "status": "warming",
                                 "prefix_tokens": getattr(handle, "prefix_tokens", None)}, status_code=202)
        try:
            tokens = await run_in_threadpool(self._warm_result, handle)
        except APIError as exc:
            self.metrics.observe_rejected(exc.status)
            return exc.response()
        finally:
            self._warms.discard(handle)
        return {"object": "prefix_cache.warm", "status": "cached", "prefix_tokens": tokens}

    @staticmethod
    def _warm(engine, images, system, salt):
        """``engine.warm``, its refusals as API errors (as :meth:`_submit` maps a chat request's)."""
        warm = getattr(engine, "warm", None)
        if warm is None:
            raise APIError(501, "this engine cannot warm prefixes", "server_error", code="not_implemented")
        with _refusals_as_api_errors():
            return warm(images, system=system, cache_salt=salt)

    def _warm_result(self, handle) -> int:
        """The warmed prefix's length in tokens, once cached; the engine's errors as API errors
        (a warm cancelled under it, by a shutdown or the engine: 503 ``aborted``)."""
        try:
            return int(handle.result())
        except (InvalidImageError, InvalidRequestError) as exc:
            raise _bad(str(exc), "messages") from None
        except EngineOverloadedError as exc:  # dropped: no room for it now
            raise APIError(429, str(exc), "server_error") from None
        except EngineAbortedError as exc:
            raise _failure(exc) from None
        except PrismError as exc:
            if "cancel" in str(exc).lower():
                why = "the server is shutting down" if self._stopping else "it was cancelled in the engine"
                raise APIError(503, f"the warm was stopped before the prefix was cached: {why}", "server_error",
                               code="aborted") from None
            raise APIError(500, f"the warm failed: {exc}", "server_error") from None

    def _aborted(self) -> APIError:
        """The error of an answer cancelled before its end (503: retry, elsewhere or later)."""
        why = "the server is shutting down" if self._stopping else "it was cancelled in the engine"
        return APIError(503, f"the answer was stopped before it was finished: {why}", "server_error", code="aborted")

    async def _complete(self, request: Request, handle, rid: str):
        """The non-streaming answer: the whole completion, or the error that ended it."""
        try:
            async for item in self._items(request, handle):
                if isinstance(item, Completion):
                    if _finish_reason(item) == "abort":
                        return self._aborted().response()
                    return self._completion_body(rid, item)
        except Exception as exc:
            return _failure(exc).response()
        return APIError(499, "client closed the request", "server_error").response()

    @staticmethod
    async def _body(request: Request) -> dict:
        try:
            raw = await request.body()
        except ClientDisconnect:  # gone before its declared body came: nobody to answer, nothing to log
            raise APIError(499, "client closed the request", "server_error") from None
        try:
            body = json.loads(raw, object_hook=_ObjectBudget(MAX_JSON_OBJECTS))
        except _TooManyObjects:
            raise _bad(f"the request body holds more than {MAX_JSON_OBJECTS:,} JSON objects") from None
        except (ValueError, UnicodeDecodeError):
            raise _bad("the request body must be JSON") from None
        except RecursionError:  # json's decoder recurses per level: ~1,000 brackets (2 KB) reach the limit
            raise _bad("the request body nests JSON too deeply") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        return body

    @staticmethod
    def _submit(engine, messages, sampling, salt):
        with _refusals_as_api_errors():
            return engine.submit(messages, sampling, cache_salt=salt)

    async def _items(self, request: Request, handle) -> AsyncIterator:
        """The deltas and completion of ``handle`` (a :class:`~engine.RequestHandle`; an error
        from the engine is raised), read without polling. Cancels the request if the client goes
        away (seen by :func:`_until_disconnected`) or we stop reading early; nothing more is
        yielded to a client that is gone. Counts the outcome in :attr:`metrics`."""
        finished = gone = False

        async def watch() -> None:
            nonlocal gone
            await _until_disconnected(request)
            gone = True
            handle.cancel(wait=False)  # the engine ends it at once: the loop below sees its completion

        self._active.add(handle)
        watcher = asyncio.ensure_future(watch())
        try:
            async for item in handle:
                if gone:
                    return
                if isinstance(item, Completion):
                    finished = True
                    self.metrics.observe(item)
                yield item
        except Exception:
            if handle.done:  # the error the engine failed the request with (not a reader gone)
                finished = True
                self.metrics.observe_failure("abort" if isinstance(handle.error, EngineAbortedError) else "error")
            raise
        finally:
            watcher.cancel()
            self._active.discard(handle)
            if not finished:
                self.metrics.observe_failure("abort")
                handle.cancel(wait=False)

    def _completion_body(self, rid: str, completion: Completion) -> dict:
        return {
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": self._model_id(),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": completion.text},
                         "finish_reason": _finish_reason(completion), "logprobs": None}],
            "usage": _usage(completion),
            "prism": {"telemetry": completion.telemetry.to_dict()},
        }

    async def _sse(self, request: Request, handle, rid: str, include_usage: bool):
        created, model = int(time.time()), self._model_id()

        def chunk(delta: dict, finish: str | None = None, **extra) -> str:
            body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        yield chunk({"role": "assistant", "content": ""})
        try:
            async for item in self._items(request, handle):
                if isinstance(item, str):
                    yield chunk({"content": item})
                    continue
                reason = _finish_reason(item)
                yield chunk({}, reason, prism={"telemetry": item.telemetry.to_dict()})
                if include_usage:
                    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": _usage(item)}
                    yield f"data: {json.dumps(body)}\n\n"
                if reason == "abort":  # a client reading only finish_reason "stop"/"length" still sees it
                    yield _sse_error(self._aborted())
        except Exception as exc:  # the engine failed the request (or a bug): an error event, no finish_reason
            yield _sse_error(_failure(exc))
        yield "data: [DONE]\n\n"
