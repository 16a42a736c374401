"""Refusals at the door: ASGI middlewares that turn hostile requests away before any route (ours
or Gradio's) reads them. Each does one job:

* :class:`BodySizeLimit`: a request body larger than its route accepts is answered 413 from its
  ``Content-Length`` alone, before one byte of it is read; a body of undeclared length is 411.
* :class:`BodyDeadline`: a request body that has not fully arrived within a deadline of its
  headers is answered 408 (uvicorn has no read timeout of its own).
* :class:`SameOriginGuard`: a page of another origin (another site, or another port of
  ``localhost``) may neither change anything here nor read the UI's API with the user's cookie.
* :class:`SecurityHeaders`: our HTML pages may not be framed and load only from this server.

The Gradio event payload check (file paths inside the JSON) is :mod:`app.gradio_guard`.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

#: Most bytes of a request without images: a Gradio event (a question, a title, a click), a share
#: fork. 1 MiB of question text is some 250,000 tokens, more than the model's context.
TEXT_BODY_BYTES = 1 << 20
#: Room for the multipart framing (boundaries, part headers) around the files of an upload.
MULTIPART_SLACK_BYTES = 1 << 20
#: Routes (by path prefix) whose own refusals the guards leave to them: the OpenAI API answers
#: cross-origin clients itself (API keys, its own CORS setting).
API_PREFIX = "/v1/"
UPLOAD_PATH = "/gradio_api/upload"

#: Content-Security-Policy of every HTML page. Gradio's page needs inline scripts and styles and
#: ``eval`` (``js_on_load`` handlers are compiled with ``new Function``); everything it loads comes
#: from this server (``'self'``), so a script injected into the page could still not send data
#: elsewhere (``connect-src``/``img-src``), and no other site may frame it (clickjacking).
PAGE_CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline' 'unsafe-eval'; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data: blob:; media-src 'self' data: blob:; font-src 'self' data:; connect-src 'self'; "
            "worker-src 'self' blob:; object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'")


@dataclass(frozen=True)
class BodyCaps:
    """Largest request body each kind of route accepts (bytes).

    Attributes:
        upload: ``POST /gradio_api/upload``: every image a chat may hold, each at the upload limit.
        api: ``/v1/...``: as many images (or video clips) as base64 ``data:`` URLs (4 bytes per 3),
            plus text.
        text: every other route (Gradio events, share forks): :data:`TEXT_BODY_BYTES`.
    """

    upload: int
    api: int
    text: int = TEXT_BODY_BYTES

    @classmethod
    def from_limits(cls, max_upload_bytes: int, max_images: int) -> BodyCaps:
        """Caps from the configured upload limit (bytes per image) and images per chat."""
        base64_image = -(-max_upload_bytes // 3) * 4
        return cls(upload=max_images * max_upload_bytes + MULTIPART_SLACK_BYTES,
                   api=max_images * base64_image + TEXT_BODY_BYTES)

    def for_path(self, path: str) -> tuple[int, str]:
        """The cap of a request to ``path`` (bytes), and what sets it (for the refusal's message)."""
        if path == UPLOAD_PATH or path == UPLOAD_PATH + "/":
            return self.upload, "--max-images images of --max-upload-mb each"
        if path.startswith(API_PREFIX):
            return self.api, "--max-images base64 images of --max-upload-mb each, and text"
        return self.text, "text only: images are uploaded on their own, up to --max-upload-mb each"


class BodySizeLimit:
    """Answer 413 to a body larger than its route's cap, judged by ``Content-Length`` before any of
    it is read (a client sending ``Expect: 100-continue`` never even sends it); 411 to a body
    without a declared length (chunked), 400 to a malformed ``Content-Length``.

    Args:
        app: the ASGI app behind. caps: the limits, see :class:`BodyCaps`.
    """

    def __init__(self, app, caps: BodyCaps):
        self.app, self.caps = app, caps

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        lengths = [v for k, v in scope.get("headers", []) if k == b"content-length"]
        chunked = any(k == b"transfer-encoding" for k, _ in scope.get("headers", []))
        cap, reason = self.caps.for_path(path)
        if chunked:
            return await refuse(scope, send, 411, "send the request body with a Content-Length header "
                                                  "(bodies of unknown length are not accepted)")
        if not lengths:
            return await self.app(scope, receive, send)
        if len(set(lengths)) != 1 or not lengths[0].isdigit() or len(lengths[0]) > 19:
            return await refuse(scope, send, 400, "malformed Content-Length header")
        size = int(lengths[0])
        if size > cap:
            return await refuse(scope, send, 413, f"the request body is {size:,} bytes; this route accepts at most "
                                                  f"{cap:,} ({reason})")
        return await self.app(scope, receive, send)


class SameOriginGuard:
    """Refuse requests that a page of another origin makes with the user's cookie.

    * A state-changing request (any method but GET, HEAD, OPTIONS) whose ``Origin`` (or, without
      one, ``Referer``) is another origin, or ``null`` (sandboxed frames, ``file:`` pages): 403.
      Requests with neither header (curl, scripts) pass: they carry no browser's cookie unasked.
    * A CORS preflight from another origin: 403, without any ``Access-Control-Allow-*`` grant.
    * Any other response to another origin loses its ``Access-Control-Allow-*`` headers, so the
      browser does not let that page read it (Gradio's own CORS layer grants every
      ``http://localhost:*`` origin, with credentials).

    "Same origin" compares the ``Origin``'s host and port with the request's ``Host`` header
    (default ports dropped; the scheme is not compared, since a TLS proxy in front may forward
    plain HTTP).

    Args:
        app: the ASGI app behind. exempt: path prefixes left alone (the OpenAI API, which answers
            cross-origin clients by its own rules).
    """

    SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

    def __init__(self, app, exempt: tuple[str, ...] = (API_PREFIX,)):
        self.app, self.exempt = app, exempt

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path", "").startswith(self.exempt):
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        host = headers.get("host", "")
        origin = headers.get("origin")
        method = scope.get("method", "GET")
        if method == "OPTIONS" and origin is not None and "access-control-request-method" in headers:
            if not same_origin(origin, host):
                return await refuse(scope, send, 403, "cross-origin requests are not accepted here")
        if method not in self.SAFE_METHODS:
            claimed = origin if origin is not None else headers.get("referer")
            if claimed is not None and not same_origin(claimed, host):
                return await refuse(scope, send, 403, "this request came from another site's page; "
                                                      "open Prism itself to do this")
        if origin is None or same_origin(origin, host):
            return await self.app(scope, receive, send)

        async def send_without_cors(message):
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", []) if not k.lower().startswith(b"access-control-")]
                message = {**message, "headers": kept}
            await send(message)

        return await self.app(scope, receive, send_without_cors)


class SecurityHeaders:
    """Add ``Content-Security-Policy`` (:data:`PAGE_CSP`), ``X-Frame-Options: DENY``,
    ``X-Content-Type-Options: nosniff`` and ``Referrer-Policy: same-origin`` to every HTML
    response that does not set them itself."""

    def __init__(self, app, csp: str = PAGE_CSP):
        self.app = app
        self.extra = [(b"content-security-policy", csp.encode()), (b"x-frame-options", b"DENY"),
                      (b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"same-origin")]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {k.lower() for k, _ in headers}
                content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                if content_type.lower().startswith(b"text/html"):
                    headers += [(k, v) for k, v in self.extra if k not in names]
                    message = {**message, "headers": headers}
            await send(message)

        return await self.app(scope, receive, send_with_headers)


# ---------------------------------------------------------------------------------- helpers
def same_origin(url: str, host: str) -> bool:
    """Whether ``url`` (an ``Origin`` or ``Referer`` value) names the server at ``host`` (the
    request's ``Host`` header). ``"null"``, garbage and an empty host are never the same origin."""
    try:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False
        claimed = _netloc(parts.hostname, parts.port)
        served = urlsplit("//" + host)
        return bool(host) and served.hostname is not None and claimed == _netloc(served.hostname, served.port)
    except ValueError:  # a port that is not a number, a malformed IPv6 literal
        return False


def _netloc(hostname: str, port: int | None) -> str:
    return hostname.lower() if port in (None, 80, 443) else f"{hostname.lower()}:{port}"


def _headers(scope) -> dict[str, str]:
    """The request's headers, names lower case, values decoded as Latin-1 (last one wins)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


class BodyDeadline:
    """Answer 408 to a request whose body has not fully arrived ``seconds`` after its headers, so
    a client trickling a body (or declaring a length it never sends) holds a connection and the
    route reading it for a bounded time. The route behind then sees the client gone
    (``http.disconnect``) and whatever it sends afterwards is dropped. Once the body is complete
    the deadline no longer applies (a streamed answer may wait on the client for as long as it
    runs). Slow *headers* are not seen here: uvicorn hands a request over only once they are
    complete, so bounding them needs a proxy in front.

    Args:
        app: the ASGI app behind. seconds: the deadline (positive).
    """

    def __init__(self, app, seconds: float):
        if not seconds > 0:
            raise ValueError(f"BodyDeadline needs a positive deadline, got {seconds!r}")
        self.app, self.seconds = app, float(seconds)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.seconds
        state = {"body_done": False, "started": False, "timed_out": False}

        async def timed_receive():
            if state["body_done"] or state["timed_out"]:
                return await receive() if not state["timed_out"] else {"type": "http.disconnect"}
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except TimeoutError:
                state["timed_out"] = True
                if not state["started"]:
                    state["started"] = True
                    await refuse(scope, send, 408, f"the request body did not arrive within {self.seconds:g} s "
                                                   "of its headers")
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                state["body_done"] = True
            return message

        async def guarded_send(message):
            if state["timed_out"]:
                return  # the 408 is the answer: the route's own reply to the "disconnect" goes nowhere
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        return await self.app(scope, timed_receive, guarded_send)


async def refuse(scope, send, status: int, message: str) -> None:
    """Answer ``status`` with ``message`` without reading the request: JSON in OpenAI's error shape
    under ``/v1/``, ``{"detail": message}`` elsewhere (as FastAPI's own errors)."""
    if scope.get("path", "").startswith(API_PREFIX):
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    else:
        body = {"detail": message}
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"cache-control", b"no-store"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})
