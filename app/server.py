"""The FastAPI app: health, images by hash, share links, static files, the OpenAI API, and the
Gradio page mounted at ``/``; headless (``--ui off``): health, metrics and the OpenAI API only,
without importing Gradio.

Routes (ours are registered before Gradio's mount, so they take precedence):

* ``GET /healthz``: JSON with the model id, device, KV dtype, engine state and counters, and the
  host-memory tier (``host_cache``, :func:`app.model_loader.host_cache_status`; null when off);
  503 until loaded.
* ``GET /metrics``: Prometheus metrics (:mod:`app.metrics`); with API keys configured it needs
  one (``Authorization: Bearer KEY``), like ``/v1``; without, it is open like ``/healthz``.
* ``POST /admin/replicas``, ``DELETE /admin/replicas/<id>``: add an engine replica, or remove one
  (``--replicas``; :meth:`engine.replicas.ReplicaClient.add_replica` / ``remove_replica``); only
  with API keys configured, and with one (403 without keys: a replica holds a GPU).
* ``GET /images/<sha256>``: an uploaded image by its hash (64 lowercase hex digits), only to an
  owner of a session that holds it (the owner cookie; same-origin ``<img>`` requests send it).
* ``GET /s/<token>``: a shared session, read-only; ``POST /s/<token>/fork`` copies a
  "continue" share into the visitor's own sessions; ``GET /s/<token>/images/<sha256>``: an image
  of the shared session, while the share is live. Unknown or revoked tokens, images a session
  does not hold, other owners' images: 404, the same whether or not the image exists.
* ``GET /sessions/<id>/prefix``: what the session's cached compact prefix kept of each image
  (JSON for the image viewer, :meth:`app.chat.ChatService.prefix_view`), only to its owner;
  ``GET /s/<token>/prefix``: the same for a shared session while the share is live. Another
  owner's session, an unknown id or token: the same 404. Never the cache salt.
* ``/prism-static/...``: our CSS and JS from ``static/`` (Gradio keeps ``/static`` for its own files).
* ``/v1/models``, ``/v1/chat/completions``, ``/v1/prefix_cache/warm``: see :mod:`app.openai_api`
  (a sub-application with its own API keys and CORS, mounted at ``/v1``).

Every browser gets an owner key in an HttpOnly cookie (:class:`OwnerCookieMiddleware`); it is
the only credential for its sessions and is never put in a page.

In front of every route sit the refusals of :mod:`app.guards` (body sizes, other origins, page
headers) and of :mod:`app.gradio_guard` (file paths in Gradio's event payloads, Gradio sessions
bound to the owner cookie that opened them, deep links and Gradio's monitoring off).
"""

from __future__ import annotations

import re
from contextlib import asynccontextmanager
from http.cookies import SimpleCookie
from pathlib import Path

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.requests import cookie_parser

from sessions import NotFound, PermissionDenied, SessionStore

from . import render
from .chat import ChatService
from .gradio_guard import (
    STALE_UPLOAD_S,
    SWEEP_EVERY_S,
    ClosedGradioRoutes,
    GradioPayloadGuard,
    GradioSessionGuard,
    MalformedUploadGuard,
    NoRemoteFetch,
    RelativeUploadPaths,
    UploadFolder,
    UploadsNotServed,
    sweep_periodically,
)
from .guards import BodyCaps, BodyDeadline, BodySizeLimit, SameOriginGuard, SecurityHeaders
from .metrics import Metrics
from .model_loader import ModelLoader
from .openai_api import APIError, OpenAIAPI
from .settings import Settings

#: The cookie that carries a browser's owner key.
OWNER_COOKIE = "prism_owner"
STATIC_DIR = Path(__file__).resolve().parents[1] / "static"
STATIC_URL = "/prism-static"
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_OWNER_RE = re.compile(r"[A-Za-z0-9_-]{32,128}")
_SESSION_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_COOKIE_MAX_AGE = 10 * 365 * 24 * 3600
#: Worker threads for blocking handlers (each streaming answer holds one while it streams).
WORKER_THREADS = 160
# "same-origin", not "no-referrer": the share link in the URL never leaves for another site either
# way, and with "no-referrer" a browser sends "Origin: null" on the fork form's POST, which
# SameOriginGuard must refuse (a sandboxed frame on any site sends the same).
_PRIVATE = {"Cache-Control": "no-store", "Referrer-Policy": "same-origin", "X-Robots-Tag": "noindex",
            "X-Content-Type-Options": "nosniff"}


class OwnerCookieMiddleware:
    """Give every browser a random owner key in an HttpOnly cookie.

    A request without a valid key gets a fresh one, both in the response (``Set-Cookie``) and in
    the request itself, so the handlers of that very request already see it.
    """

    def __init__(self, app, cookie: str = OWNER_COOKIE):
        self.app, self.cookie = app, cookie

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = list(scope.get("headers", []))
        raw = b"; ".join(v for k, v in headers if k == b"cookie").decode("latin-1")
        if _OWNER_RE.fullmatch(cookie_parser(raw).get(self.cookie, "")):
            return await self.app(scope, receive, send)
        key = SessionStore.new_owner_key()
        cookies = cookie_parser(raw)
        cookies[self.cookie] = key
        merged = "; ".join(f"{k}={v}" for k, v in cookies.items())
        headers = [(k, v) for k, v in headers if k != b"cookie"] + [(b"cookie", merged.encode("latin-1"))]
        scope = {**scope, "headers": headers}
        morsel = SimpleCookie()
        morsel[self.cookie] = key
        attrs = morsel[self.cookie]
        attrs.update({"path": "/", "max-age": str(_COOKIE_MAX_AGE), "httponly": True, "samesite": "Lax"})
        if scope.get("scheme") == "https":
            attrs["secure"] = True
        set_cookie = attrs.OutputString().encode("latin-1")

        async def send_with_cookie(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", set_cookie)]}
            await send(message)

        return await self.app(scope, receive, send_with_cookie)


def owner_from(request: Request) -> str:
    return request.cookies.get(OWNER_COOKIE, "")


def owner_in(scope) -> str:
    """The owner key a request's cookie carries, "" when it carries no valid one (before
    :class:`OwnerCookieMiddleware` gives it a fresh one)."""
    raw = b"; ".join(v for k, v in scope.get("headers", []) if k == b"cookie").decode("latin-1")
    key = cookie_parser(raw).get(OWNER_COOKIE, "")
    return key if _OWNER_RE.fullmatch(key) else ""


def _not_found() -> Response:
    return Response("Not found", status_code=404, media_type="text/plain", headers={"Cache-Control": "no-store"})


def _private_json(body: dict) -> JSONResponse:
    """JSON for this origin's pages only, never stored (the cached prefix changes under it)."""
    return JSONResponse(body, headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
                                       "Cross-Origin-Resource-Policy": "same-origin"})


def create_app(settings: Settings, store: SessionStore, loader: ModelLoader, chat: ChatService | None = None,
               *, mount_ui: bool = True) -> FastAPI:
    """Build the whole web app. ``mount_ui=False`` leaves out the Gradio page (API tests).

    With ``settings.ui == "off"`` (``--ui off``) the app is headless: ``/v1``, ``/metrics`` and
    ``/healthz`` only. Every page route (the chat, share links, images, the prefix viewer, static
    files) is a 404, no owner cookie is set, and Gradio is never imported.

    The app's :class:`~app.metrics.Metrics` (its own registry) counts the chat's and the API's
    requests and warms: it is attached to ``chat`` here, and so is ``--warm``.

    While the app runs (its lifespan), each time an engine becomes ready (the first load, a
    restarted core) the most recently used chats' prefixes are warmed within ``--warm-share`` of
    the KV pool (:meth:`~app.chat.ChatService.warm_recent`; not headless: no chat asks there)."""
    chat = chat or ChatService(store, loader, max_upload_bytes=settings.max_upload_bytes)
    metrics = Metrics(loader)
    chat.metrics = metrics
    chat.warming = chat.warming and settings.warm == "on"

    @asynccontextmanager
    async def lifespan(_app):
        anyio.to_thread.current_default_thread_limiter().total_tokens = WORKER_THREADS
        if not headless and chat.warming and settings.warm_share > 0 and hasattr(loader, "on_ready"):
            loader.on_ready(lambda _engine: chat.warm_recent(settings.warm_share))
        async with anyio.create_task_group() as tasks:
            uploads = getattr(app.state, "uploads", None)
            if uploads is not None:  # leftovers of failed or abandoned uploads, while the server runs
                tasks.start_soon(sweep_periodically, uploads, SWEEP_EVERY_S, STALE_UPLOAD_S)
            yield
            tasks.cancel_scope.cancel()

    app = FastAPI(title="Prism", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.chat, app.state.loader, app.state.store, app.state.metrics = chat, loader, store, metrics
    api = OpenAIAPI(loader, max_image_bytes=settings.max_upload_bytes, api_keys=settings.api_keys,
                    cors_origins=settings.cors_origins, metrics=metrics, max_media=settings.media_per_request)

    headless = settings.ui == "off"
    pages = APIRouter()  # the web UI's own routes, left out when headless

    @app.api_route("/healthz", methods=["GET", "HEAD"])  # HEAD for load balancers' health checks
    def healthz(request: Request):
        """Model id, device, KV dtype and engine state; 503 while the model is loading (or failed).
        Over replicas, each one's counters only with an API key when keys are configured (its id
        and state without)."""
        status = loader.status()
        if status.get("replicas"):
            try:
                api.authorize(request)
            except APIError:
                status["replicas"] = [{"id": r["id"], "state": r["state"]} for r in status["replicas"]]
        return JSONResponse(status, status_code=200 if status["status"] == "ok" else 503,
                            headers={"Cache-Control": "no-store"})

    @app.get("/metrics")
    def prometheus_metrics(request: Request):
        """Prometheus' text format; behind the API key when keys are configured (401 otherwise)."""
        try:
            api.authorize(request)
        except APIError as exc:
            return exc.response()
        body, content_type = metrics.exposition(request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type, "Cache-Control": "no-store"})

    def replicas_admin(request: Request):
        """The replica client to change, or the refusal to answer: 404 without ``--replicas`` (or
        while it loads), 403 without API keys configured, 401 without the key."""
        engine = loader.engine
        if engine is None or not hasattr(engine, "add_replica"):
            return None, APIError(404, "this server runs no engine replicas (--replicas)", code="not_found")
        if not settings.api_keys:
            return None, APIError(403, "adding or removing replicas needs API keys (--api-key)", code="forbidden")
        try:
            api.authorize(request)
        except APIError as exc:
            return None, exc
        return engine, None

    def replica_change(change) -> Response:
        from engine.errors import InvalidRequestError, PrismError

        try:
            body = change()
        except InvalidRequestError as exc:
            return APIError(400, str(exc)).response()
        except PrismError as exc:
            return APIError(503, str(exc), "server_error", code="unavailable").response()
        except Exception as exc:  # a replica that could not start: its error
            return APIError(500, f"{type(exc).__name__}: {exc}", "server_error").response()
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    @app.post("/admin/replicas")
    def add_replica(request: Request):
        """Deploy one more engine replica and put it on the ring (blocks while it loads its model):
        ``{"id": ..., "replicas": [...]}`` (the ``/healthz`` entries)."""
        engine, refused = replicas_admin(request)
        if refused is not None:
            return refused.response()

        def add():
            from .model_loader import replica_entry

            name = engine.add_replica()
            return {"id": name, "replicas": [replica_entry(r) for r in engine.replica_status()]}

        return replica_change(add)

    @app.delete("/admin/replicas/{name}")
    def remove_replica(name: str, request: Request):
        """Take a replica off the ring and delete it: its requests in flight end as ``aborted``
        (retryable), its sessions move to the others; ``{"id": ..., "sessions_moved": n}``."""
        engine, refused = replicas_admin(request)
        if refused is not None:
            return refused.response()
        return replica_change(lambda: {"id": name, "sessions_moved": engine.remove_replica(name)})

    def image_response(sha: str, cache_control: str) -> Response:
        path = store.image_path(sha)
        if path is None:
            return _not_found()
        info = store.image_info(sha)
        return FileResponse(path, media_type=info.mime if info else "application/octet-stream", headers={
            "Cache-Control": cache_control, "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": "default-src 'none'; sandbox",
            # other origins' pages cannot even load it (an <img> there would tell whether we own it)
            "Cross-Origin-Resource-Policy": "same-origin"})

    @pages.get("/images/{sha:path}")
    def image(sha: str, request: Request):
        """An uploaded image by its SHA-256, for an owner of a session holding it; anything else
        (another owner's image, no cookie, not 64 lowercase hex digits) is the same 404."""
        if not (_SHA_RE.fullmatch(sha) and store.owner_has_image(owner_from(request), sha)):
            return _not_found()
        return image_response(sha, "private, max-age=31536000, immutable")

    @pages.get("/s/{token}/images/{sha}")
    def shared_image(token: str, sha: str):
        """An image of a shared session while its share is live (not cached by the browser, so a
        revoked link stops showing it)."""
        share = store.resolve_share(token) if _SHA_RE.fullmatch(sha) else None
        if share is None or not store.has_image(share.session_id, sha):
            return _not_found()
        return image_response(sha, "no-store")

    @pages.get("/sessions/{session_id}/prefix")
    def session_prefix(session_id: str, request: Request):
        """What the session's cached compact prefix kept of each image, for its owner; anything
        else (another owner's session, no cookie, an id that is not one) is the same 404."""
        session = chat.session(session_id, owner_from(request)) if _SESSION_ID_RE.fullmatch(session_id) else None
        if session is None:
            return _not_found()
        return _private_json(chat.prefix_view(session))

    @pages.get("/s/{token}/prefix")
    def shared_prefix(token: str):
        """The same for a shared session while its share is live (read-only: it only reads)."""
        share = store.resolve_share(token)
        session = store.get_session(share.session_id) if share else None
        if session is None:
            return _not_found()
        return _private_json(chat.prefix_view(session))

    @pages.get("/s/{token}", response_class=HTMLResponse)
    def shared(token: str):
        """The read-only view of a shared session (404 for an unknown or revoked token)."""
        share = store.resolve_share(token)
        session = store.get_session(share.session_id) if share else None
        if session is None:
            return HTMLResponse(render.not_found_page(), status_code=404, headers=_PRIVATE)
        records = store.list_images(session.id)
        page = render.share_page(session, records, chat.turns(session.id), mode=share.mode, token=token,
                                 demo=loader.demo)
        return HTMLResponse(page, headers=_PRIVATE)

    @pages.post("/s/{token}/fork")
    def fork(token: str, request: Request):
        """Copy a "continue" share into the visitor's sessions (titled as a copy) and open it."""
        share = store.resolve_share(token)
        if share is None or share.mode != "continue":
            return HTMLResponse(render.not_found_page(), status_code=404, headers=_PRIVATE)
        try:
            session = chat.fork(share, owner_from(request))
        except (NotFound, PermissionDenied, ValueError):
            return HTMLResponse(render.not_found_page(), status_code=404, headers=_PRIVATE)
        return RedirectResponse(f"/?session={session.id}", status_code=303, headers=_PRIVATE)

    if not headless:
        app.include_router(pages)
        app.mount(STATIC_URL, StaticFiles(directory=STATIC_DIR), name="prism-static")
    app.mount("/v1", api.app)
    app.state.openai = api
    if not headless:
        app.add_middleware(OwnerCookieMiddleware)
    if mount_ui and not headless:
        _mount_ui(app, settings, chat, loader)
    # added last = runs first: headers on every page, then origin, then body size
    app.add_middleware(BodySizeLimit, caps=BodyCaps.from_limits(settings.max_upload_bytes, settings.max_images))
    app.add_middleware(BodyDeadline, seconds=settings.body_timeout_s)
    app.add_middleware(SameOriginGuard)
    app.add_middleware(SecurityHeaders)
    return app


def _mount_ui(app: FastAPI, settings: Settings, chat: ChatService, loader: ModelLoader) -> None:
    """Mount the Gradio page at ``/``, with the payload check a mounted Gradio app lacks."""
    import gradio as gr

    from .ui import PrismUI, theme

    ui = PrismUI(chat, loader)
    blocks = ui.build()
    blocks.queue(default_concurrency_limit=16)
    app.state.ui, app.state.blocks = ui, blocks
    v = render.STATIC_VERSION
    max_file_bytes = settings.max_upload_bytes * 2  # above our limit: our handler explains the refusal
    gr.mount_gradio_app(
        app, blocks, path="/", theme=theme(), ssr_mode=False, footer_links=[],
        head=f'<link rel="stylesheet" href="/prism-static/prism.css?v={v}">'
             f'<script src="/prism-static/prism.js?v={v}" defer></script>',
        max_file_size=max_file_bytes, favicon_path=str(STATIC_DIR / "favicon.png"),
    )
    # Gradio checks that an event's file paths lie in its upload folder only once ``launch()`` has
    # set this flag, which mounting never does; set, its own check runs again behind ours.
    blocks.has_launched = True
    app.state.uploads = UploadFolder.of_gradio(max_file_bytes)
    app.state.uploads.sweep_deep_links()  # snapshots of chats left by a server before deep links were off
    # added first = runs last: the payload's JSON is checked before the session it names
    app.add_middleware(GradioSessionGuard, owner_of=owner_in)
    app.add_middleware(GradioPayloadGuard, uploads=app.state.uploads, events=frozenset(blocks.fns))
    app.add_middleware(MalformedUploadGuard)
    app.add_middleware(RelativeUploadPaths, uploads=app.state.uploads)
    app.add_middleware(NoRemoteFetch)
    app.add_middleware(UploadsNotServed, uploads=app.state.uploads)
    app.add_middleware(ClosedGradioRoutes)
