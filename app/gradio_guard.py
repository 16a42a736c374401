"""The check Gradio skips when it is mounted: file paths inside an event's payload.

Gradio's browser client first uploads a file (``POST /gradio_api/upload`` writes it to the upload
folder as ``<folder>/<sha256 hex>/<name>``), then names that path in the event's JSON, as
``{"path": ..., "meta": {"_type": "gradio.FileData"}}``. While it preprocesses the event, before
any handler runs, Gradio hashes and copies whatever file the payload names. A launched Gradio app
first checks that the path lies in its upload folder; a mounted one (``gr.mount_gradio_app``)
skips the check, so one request naming ``/dev/zero`` froze the server and others copied
``/etc/passwd`` or the session database into the upload folder.

:class:`GradioPayloadGuard` reads each JSON body posted to Gradio's API before Gradio does and
refuses (400) any payload with a ``"path"`` that is not one of this process's uploads, judged by
:meth:`UploadFolder.problem` from ``lstat`` alone: nothing the client names is ever opened here.
Uploads named by a refused payload are deleted (they will never be used).

The upload reply names uploads relative to the folder (:class:`RelativeUploadPaths`); the guard
puts the folder back in front of such a name. Beside it: :class:`GradioSessionGuard` (a Gradio
session id is bound to the owner cookie that opened it: nobody else reads its event stream),
:class:`ClosedGradioRoutes` (deep links and Gradio's monitoring answer 404),
:class:`UploadsNotServed` (uploads are not read back by path), :class:`MalformedUploadGuard` (a
400, not Gradio's 500, for a malformed upload), :class:`NoRemoteFetch` (Gradio's routes that fetch
a URL for the client answer 404) and :meth:`UploadFolder.sweep` with :func:`sweep_periodically`
(uploads no event ever used, deep-link snapshots).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import shutil
import stat
import time
from collections import OrderedDict
from collections.abc import Callable
from urllib.parse import parse_qsl

from .guards import TEXT_BODY_BYTES, UPLOAD_PATH, refuse

#: Uploads untouched this long are leftovers (never named by an event, or cut off mid-upload) and
#: are deleted (seconds; the age Gradio's own ``delete_cache`` uses for the files it tracks).
STALE_UPLOAD_S = 3600
#: How often a running server looks for such leftovers (seconds).
SWEEP_EVERY_S = 600
#: Deepest JSON nesting accepted in an event payload (Gradio's own walk over it is recursive).
MAX_PAYLOAD_DEPTH = 32
#: Most Gradio sessions whose owner is remembered (least recently used forgotten beyond it; a live
#: page polls and beats every few seconds, so it stays recent). ~100 bytes each.
MAX_GRADIO_SESSIONS = 100_000
#: Where Gradio writes deep-link snapshots (a page's component values) in its upload folder.
DEEP_LINKS_DIRNAME = "deep_links"
_UPLOAD_DIR_RE = re.compile(r"[0-9a-f]{64}")


class UploadFolder:
    """This process's Gradio upload folder (``GRADIO_TEMP_DIR``) and the files in it a client may name.

    Args:
        root: the folder (made absolute, links not resolved: Gradio names uploads under it as given).
        max_file_bytes: largest file Gradio's upload route accepts (bytes).
    """

    def __init__(self, root: str | os.PathLike, max_file_bytes: int):
        self.root = os.path.abspath(os.fspath(root))
        self.max_file_bytes = int(max_file_bytes)

    @classmethod
    def of_gradio(cls, max_file_bytes: int = 0) -> UploadFolder:
        """Gradio's upload folder for this process (``GRADIO_TEMP_DIR``, else ``<tmp>/gradio``)."""
        from gradio.utils import get_upload_folder

        return cls(get_upload_folder(), max_file_bytes)

    def problem(self, path: object) -> str | None:
        """Why ``path`` may not be named in a payload, or None when it is an upload of this folder:
        an absolute, normalised ``<root>/<64 hex digits>/<name>`` whose folder is a real folder
        and whose file a regular file (no link, FIFO or device; one hard link) of at most
        ``max_file_bytes``. Decided by ``lstat`` only; nothing is opened or followed."""
        if not isinstance(path, str):
            return "a file path must be a string"
        if "\x00" in path or not os.path.isabs(path) or os.path.normpath(path) != path:
            return "it is not one of your uploads"
        inside = path[len(self.root) + 1:].split(os.sep) if path.startswith(self.root + os.sep) else []
        if len(inside) != 2 or not _UPLOAD_DIR_RE.fullmatch(inside[0]) or inside[1] in ("", ".", ".."):
            return "it is not one of your uploads"
        try:
            folder = os.lstat(os.path.join(self.root, inside[0]))
            file = os.lstat(path)
        except (OSError, ValueError):
            return "the upload is gone (it was used or removed); upload the file again"
        if not stat.S_ISDIR(folder.st_mode) or not stat.S_ISREG(file.st_mode) or file.st_nlink != 1:
            return "it is not one of your uploads"
        if file.st_size > self.max_file_bytes:
            return f"the file is larger than the upload limit of {self.max_file_bytes:,} bytes"
        return None

    def absolute(self, name: object) -> object:
        """An upload as the upload reply names it (``<64 hex digits>/<name>``, relative to this
        folder: the reply does not show where the data dir is) as the absolute path Gradio
        takes; anything else unchanged (an absolute path is judged by :meth:`problem` as it is)."""
        if not isinstance(name, str) or os.path.isabs(name) or "\x00" in name:
            return name
        parts = name.split("/")
        if len(parts) != 2 or not _UPLOAD_DIR_RE.fullmatch(parts[0]) or parts[1] in ("", ".", ".."):
            return name
        return os.path.join(self.root, parts[0], parts[1])

    def relative(self, path: object) -> object:
        """The inverse of :meth:`absolute` for a path inside this folder; anything else unchanged."""
        if isinstance(path, str) and path.startswith(self.root + os.sep):
            return path[len(self.root) + 1:].replace(os.sep, "/")
        return path

    def discard(self, path: str | os.PathLike) -> None:
        """Delete an upload (a regular file inside this folder, never through a link) and its
        per-upload folder once empty. Anything else is left alone; errors are ignored."""
        path = os.path.abspath(os.fspath(path))
        if not path.startswith(self.root + os.sep) or os.path.normpath(path) != path:
            return
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode) or _has_link_between(self.root, path):
                return
            os.unlink(path)
            parent = os.path.dirname(path)
            if parent != self.root:
                os.rmdir(parent)  # only succeeds when empty
        except OSError:
            pass

    def sweep(self, older_than_s: float, now: float | None = None) -> int:
        """Delete what Gradio left in the folder and nobody touched for ``older_than_s`` seconds:
        per-upload folders (``<64 hex digits>/``) and its temporary files (``tmp*``), such as
        uploads never named by an event or files of an interrupted upload. Returns how many went.
        Anything else stays, and so do recent entries: another process may share the folder.
        Deep-link snapshots (:meth:`sweep_deep_links`) go whatever their age."""
        now = time.time() if now is None else now
        removed = self.sweep_deep_links()
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return 0
        for entry in entries:
            try:
                folder = entry.is_dir(follow_symlinks=False)
                ours = _UPLOAD_DIR_RE.fullmatch(entry.name) if folder else entry.name.startswith("tmp")
                if not ours or now - entry.stat(follow_symlinks=False).st_mtime < older_than_s:
                    continue
                if folder:
                    for child in os.scandir(entry.path):
                        if not child.is_dir(follow_symlinks=False):
                            os.unlink(child.path)
                    os.rmdir(entry.path)
                else:
                    os.unlink(entry.path)
                removed += 1
            except OSError:
                continue
        return removed


    def sweep_deep_links(self) -> int:
        """Delete Gradio's deep-link snapshots (``<folder>/deep_links/<id>/state.json``: a copy of
        a page's chat, which Gradio's file route served to anyone and never deleted). Deep links
        are off (:class:`ClosedGradioRoutes`), so these are left from before. Links are not
        followed. Returns how many snapshot folders went."""
        path = os.path.join(self.root, DEEP_LINKS_DIRNAME)
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                return 0
            count = sum(1 for _ in os.scandir(path))
        except OSError:
            return 0
        shutil.rmtree(path, ignore_errors=True)
        return count


class GradioPayloadGuard:
    """Refuse (400) a JSON body posted to Gradio's API that names a file other than one of this
    process's uploads (see :meth:`UploadFolder.problem`), names an event the page does not have
    (``fn_index``: Gradio answered 500), is not JSON, or nests deeper than
    :data:`MAX_PAYLOAD_DEPTH`; refuse (415) other bodies there, except the upload route's
    multipart. Everything else reaches Gradio unchanged (the body is read here and handed on).

    Args:
        app: the ASGI app behind. uploads: the upload folder. events: the page's event numbers
            (the keys of ``Blocks.fns``).
        prefix: where Gradio's API lives. max_body: most bytes read here (a request above it is
            refused 413; :class:`app.guards.BodySizeLimit` in front refuses it before reading).
    """

    def __init__(self, app, uploads: UploadFolder, events: frozenset[int], prefix: str = "/gradio_api/",
                 max_body: int = TEXT_BODY_BYTES):
        self.app, self.uploads, self.events = app, uploads, frozenset(events)
        self.prefix, self.max_body = prefix, max_body

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if (scope["type"] != "http" or scope.get("method") != "POST" or not path.startswith(self.prefix)
                or path.rstrip("/") == UPLOAD_PATH):
            return await self.app(scope, receive, send)
        body = await _read_body(receive, self.max_body)
        if body is None:
            return await refuse(scope, send, 413, f"the request body is larger than {self.max_body:,} bytes")
        if body.strip():
            content_type = dict(scope.get("headers", [])).get(b"content-type", b"").split(b";")[0].strip().lower()
            if content_type not in (b"", b"application/json") and not content_type.endswith(b"+json"):
                return await refuse(scope, send, 415, "Gradio's API takes JSON bodies here")
            problem, named, rewritten = self.check(body)
            if problem is not None:
                for upload in named:
                    self.uploads.discard(upload)
                return await refuse(scope, send, 400, problem)
            if rewritten is not None:
                body = rewritten
                headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-length"]
                scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        return await self.app(scope, _replay(body, receive), send)

    def check(self, body: bytes) -> tuple[str | None, list[str], bytes | None]:
        """``(why the payload is refused or None, the valid uploads it names, the body to hand on
        when an upload was named as the upload reply names it, relative to the folder (its
        absolute path put in), else None)``."""
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):
            return "the request body must be JSON", [], None
        named, problem, changed = [], None, False
        event = payload.get("fn_index") if isinstance(payload, dict) else None
        if event is not None and (type(event) is not int or event not in self.events):
            problem = f"there is no event number {str(event)[:40]} on this page"
        stack = [(payload, 0)]
        while stack:
            value, depth = stack.pop()
            if depth > MAX_PAYLOAD_DEPTH:
                return f"the payload nests deeper than {MAX_PAYLOAD_DEPTH} levels", named, None
            if isinstance(value, dict):
                if "path" in value:
                    full = self.uploads.absolute(value["path"])
                    if full is not value["path"]:
                        value["path"], changed = full, True
                    why = self.uploads.problem(value["path"])
                    if why is None:
                        named.append(value["path"])
                    elif problem is None:
                        problem = f"refused the file {str(value['path'])[:200]!r}: {why}"
                stack.extend((v, depth + 1) for v in value.values())
            elif isinstance(value, list):
                stack.extend((v, depth + 1) for v in value)
        return problem, named, json.dumps(payload).encode() if changed else None


class SessionOwners:
    """Which owner opened each Gradio session: ``session_hash`` -> SHA-256 of the owner key, the
    first owner to name it keeps it. At most ``max_sessions`` are remembered, least recently used
    forgotten first (a forgotten session is claimed again by the next owner naming it).

    Args:
        max_sessions: the bound (see :data:`MAX_GRADIO_SESSIONS`).
    """

    def __init__(self, max_sessions: int = MAX_GRADIO_SESSIONS):
        self.max_sessions = int(max_sessions)
        self._owners: OrderedDict[str, bytes] = OrderedDict()

    def claim(self, session_hash: str, owner: str) -> bool:
        """Whether ``owner`` (a plain owner key, not empty) may use ``session_hash``: it opened it,
        or nobody had; in that case it is now the session's owner."""
        digest = hashlib.sha256(owner.encode()).digest()
        bound = self._owners.get(session_hash)
        if bound is None:
            self._owners[session_hash] = digest
            while len(self._owners) > self.max_sessions:
                self._owners.popitem(last=False)
            return True
        self._owners.move_to_end(session_hash)
        return hmac.compare_digest(bound, digest)

    def __len__(self) -> int:
        return len(self._owners)


class GradioSessionGuard:
    """Refuse (403) a request to Gradio's API that names a Gradio session (``session_hash``)
    opened by another owner, or that names one without an owner cookie.

    Gradio's page draws its session id with ``Math.random()`` and sends it in URLs; whoever had it
    could read that page's event stream (``GET /gradio_api/queue/data?session_hash=H``: questions,
    answers, a share link just created) with no cookie at all. Here each session id belongs to the
    owner key (:mod:`app.server`'s HttpOnly cookie) that first named it. Where it is named: the
    ``session_hash`` query parameter (``queue/data``, ``deep_link``), the path of
    ``heartbeat/<hash>`` and ``stream/<hash>/...``, and the ``session_hash`` of a JSON body
    (``queue/join``, ``cancel``, ``component_server``, ``call``, ``run``). The upload route's
    ``session_hash`` header only labels a progress trace, and is not checked.

    Args:
        app: the ASGI app behind. owner_of: the request's owner key from its cookie ("" when it
            sent no valid one). sessions: the bindings (:class:`SessionOwners`).
        prefix: where Gradio's API lives. max_body: most body bytes read (the guards in front
            refuse longer bodies before this one runs).
    """

    def __init__(self, app, owner_of: Callable[[dict], str], sessions: SessionOwners | None = None,
                 prefix: str = "/gradio_api/", max_body: int = TEXT_BODY_BYTES):
        self.app, self.owner_of = app, owner_of
        self.sessions = sessions if sessions is not None else SessionOwners()
        self.prefix, self.max_body = prefix, max_body

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(self.prefix) or path.rstrip("/") == UPLOAD_PATH:
            return await self.app(scope, receive, send)
        named = self._in_url(path, scope.get("query_string", b""))
        if scope.get("method") == "POST":
            body = await _read_body(receive, self.max_body)
            if body is None:
                return await refuse(scope, send, 413, f"the request body is larger than {self.max_body:,} bytes")
            named += _body_session(body)
            receive = _replay(body, receive)
        if named:
            owner = self.owner_of(scope)
            if not owner:
                return await refuse(scope, send, 403, "this page's session needs the Prism cookie: enable cookies "
                                                      "for this site and reload the page")
            if not all(self.sessions.claim(h, owner) for h in named):
                return await refuse(scope, send, 403, "this Gradio session was opened by another browser; "
                                                      "reload the page to get your own")
        return await self.app(scope, receive, send)

    def _in_url(self, path: str, query: bytes) -> list[str]:
        """The session ids a request names in its path and query string."""
        named = [v for k, v in parse_qsl(query.decode("latin-1"), keep_blank_values=True) if k == "session_hash"]
        parts = path[len(self.prefix):].split("/")
        # stream/<event_id> and stream/<event_id>/close name an event; stream/<hash>/<run>/<id>/... a session
        if parts[0] == "heartbeat" and len(parts) >= 2 or parts[0] == "stream" and len(parts) >= 4:
            named.append(parts[1])
        return named


class ClosedGradioRoutes:
    """Answer 404 to Gradio routes Prism does not use and that hand out what they should not:

    * deep links (``GET /gradio_api/deep_link?session_hash=H`` wrote a snapshot of that page's
      chat and returned its id; ``/config?deep_link=<id>`` or ``/?deep_link=<id>`` gave the chat
      back, to anyone, and the snapshot outlived the chat's deletion);
    * Gradio's monitoring (``/monitoring``, ``/monitoring/summary``: per-event counts and
      latencies, open to anyone; Prism's own metrics are ``/metrics``).
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path = scope.get("path", "").rstrip("/").lower()
            query = scope.get("query_string", b"").decode("latin-1")
            if path == "/gradio_api/deep_link" or any(k == "deep_link" for k, _ in parse_qsl(query,
                                                                                          keep_blank_values=True)):
                return await refuse(scope, send, 404, "deep links are off on this server")
            if path == "/monitoring" or path.startswith("/monitoring/"):
                return await refuse(scope, send, 404, "Gradio's monitoring is off on this server; see /metrics")
        return await self.app(scope, receive, send)


class NoRemoteFetch:
    """Answer 404 to Gradio's routes that make the server fetch a URL for the client:
    ``/gradio_api/file=<URL>`` and its older form ``/gradio_api/file/<URL>`` (Gradio fetches and
    streams any public URL) and ``/gradio_api/proxy=...`` (for apps loaded from elsewhere, which
    Prism has none of). This server never fetches anything a client names.

    A file route's argument is a URL here when, percent-decoded until it stops changing, it
    starts with a scheme (``http:``, ``HTTPS:``, ``ftp:``, any case) or with two slashes
    (``//host/x``, ``\\\\host``); the route itself is matched in any case and with repeated slashes."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and fetches_a_url(scope.get("path", "")):
            return await refuse(scope, send, 404, "this server does not fetch URLs")
        return await self.app(scope, receive, send)


class UploadsNotServed:
    """Answer 404 to Gradio's file route (``/gradio_api/file=<path>``, ``/gradio_api/file/<path>``)
    for anything inside the upload folder: an upload was readable by its path, by anyone, until
    its event ran (or for an hour when none did), and Gradio's deep-link snapshots lived there too.
    The page never reads its uploads back (the store's images are served by ``/images/<sha256>``
    to their owners)."""

    PREFIXES = ("/gradio_api/file=", "/gradio_api/file/")

    def __init__(self, app, uploads: UploadFolder):
        self.app, self.uploads = app, uploads

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and path.startswith(self.PREFIXES):
            named = path[len(self.PREFIXES[0]):]
            if self._inside(named):
                return await refuse(scope, send, 404, "uploads are not served back")
        return await self.app(scope, receive, send)

    def _inside(self, named: str) -> bool:
        """Whether ``named`` (as Gradio would take it: relative to the working folder, links
        resolved or not) lies in the upload folder."""
        roots = {self.uploads.root, os.path.realpath(self.uploads.root)}
        try:
            forms = {os.path.abspath(named), os.path.realpath(named)}
        except (OSError, ValueError):
            return True  # nothing Gradio could serve either: refuse without asking it
        return any(f == r or f.startswith(r + os.sep) for f in forms for r in roots)


class RelativeUploadPaths:
    """Name each upload in the upload reply relative to the upload folder (``<64 hex>/<name>``):
    the absolute path showed every client where the server's data dir is.
    :class:`GradioPayloadGuard` puts the folder back in front when an event names one.

    Args:
        app: the ASGI app behind. uploads: the upload folder.
    """

    def __init__(self, app, uploads: UploadFolder):
        self.app, self.uploads = app, uploads

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path", "").rstrip("/") != UPLOAD_PATH:
            return await self.app(scope, receive, send)
        start: dict | None = None
        chunks: list[bytes] = []

        async def holding(message):
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return
            if message["type"] != "http.response.body" or start is None:
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            if start.get("status") == 200:
                body = self._relative(body)
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, holding)

    def _relative(self, body: bytes) -> bytes:
        try:
            paths = json.loads(body)
        except ValueError:
            return body
        if not isinstance(paths, list):
            return body
        return json.dumps([self.uploads.relative(p) for p in paths]).encode()


_FETCH_ROUTE_RE = re.compile(r"/+gradio_api/+(?P<route>file=|file/|proxy=)(?P<rest>.*)", re.IGNORECASE | re.DOTALL)
_URL_START_RE = re.compile(r"[a-z][a-z0-9+.\-]*:|[/\\]{2}", re.IGNORECASE)


def fetches_a_url(path: str) -> bool:
    """Whether a request path (percent-decoded once, as the ASGI scope holds it) asks one of
    Gradio's fetching routes for a URL (see :class:`NoRemoteFetch`)."""
    from urllib.parse import unquote

    match = _FETCH_ROUTE_RE.match(path)
    if match is None:
        return False
    if match["route"].lower() == "proxy=":
        return True
    rest = match["rest"]
    for _ in range(8):  # each layer of percent-encoding peeled; a path stable after 8 is not an upload
        decoded = unquote(rest)
        if decoded == rest:
            break
        rest = decoded
    else:
        return True
    return _URL_START_RE.match(rest.lstrip(" \t\r\n\x00")) is not None


class MalformedUploadGuard:
    """Answer 400 where Gradio's upload route fails with a TypeError (a 500) on a multipart part
    named ``files`` that is not a file (no ``filename``). Gradio's own error layer has sent its 500
    by the time the exception comes out, so a 500 is held back until it is known whether that
    TypeError follows. Whatever the failed upload wrote is left to :meth:`UploadFolder.sweep`.

    Args:
        app: the ASGI app behind.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path", "").rstrip("/") != UPLOAD_PATH:
            return await self.app(scope, receive, send)
        held: list[dict] = []

        async def holding_500(message):
            if held or (message["type"] == "http.response.start" and message.get("status") == 500):
                held.append(message)
            else:
                await send(message)

        try:
            await self.app(scope, receive, holding_500)
        except TypeError:
            if held:
                await refuse(scope, send, 400, "malformed upload: every part named 'files' must be a file "
                                               "with a file name")
                return
            raise
        except BaseException:
            for message in held:
                await send(message)
            raise
        for message in held:
            await send(message)


async def sweep_periodically(folder: UploadFolder, every_s: float, older_than_s: float) -> None:
    """Run :meth:`UploadFolder.sweep` every ``every_s`` seconds (in a worker thread) until cancelled."""
    import anyio

    while True:
        await anyio.sleep(every_s)
        await anyio.to_thread.run_sync(folder.sweep, older_than_s)


# ---------------------------------------------------------------------------------- helpers
def _has_link_between(root: str, path: str) -> bool:
    """Whether a folder between ``root`` and ``path`` (both absolute, ``path`` inside) is a link."""
    current = os.path.dirname(path)
    while current != root and current.startswith(root + os.sep):
        if os.path.islink(current):
            return True
        current = os.path.dirname(current)
    return False


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole request body, or None once it exceeds ``limit`` bytes (the rest is not read)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _body_session(body: bytes) -> list[str]:
    """The ``session_hash`` a JSON body names at its top level (none when it is not JSON, not an
    object or the field is not a string: Gradio refuses those itself)."""
    try:
        payload = json.loads(body) if body.strip() else None
    except (ValueError, RecursionError):
        return []
    value = payload.get("session_hash") if isinstance(payload, dict) else None
    return [value] if isinstance(value, str) else []


def _replay(body: bytes, receive):
    """A ``receive`` that hands the app the body already read, then waits on the client as usual."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay

