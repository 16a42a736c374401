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

Beside it: :class:`MalformedUploadGuard` (a 400, not Gradio's 500, for a malformed upload),
:class:`NoRemoteFetch` (Gradio's routes that fetch a URL for the client answer 404) and
:meth:`UploadFolder.sweep` with :func:`sweep_periodically` (uploads no event ever used).
"""

from __future__ import annotations

import json
import os
import re
import stat
import time

from .guards import TEXT_BODY_BYTES, UPLOAD_PATH, refuse

#: Uploads untouched this long are leftovers (never named by an event, or cut off mid-upload) and
#: are deleted (seconds; the age Gradio's own ``delete_cache`` uses for the files it tracks).
STALE_UPLOAD_S = 3600
#: How often a running server looks for such leftovers (seconds).
SWEEP_EVERY_S = 600
#: Deepest JSON nesting accepted in an event payload (Gradio's own walk over it is recursive).
MAX_PAYLOAD_DEPTH = 32
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
        Anything else stays, and so do recent entries: another process may share the folder."""
        now = time.time() if now is None else now
        removed = 0
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
            problem, named = self.check(body)
            if problem is not None:
                for upload in named:
                    self.uploads.discard(upload)
                return await refuse(scope, send, 400, problem)
        return await self.app(scope, _replay(body, receive), send)

    def check(self, body: bytes) -> tuple[str | None, list[str]]:
        """``(why the payload is refused or None, the valid uploads it names)``."""
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):
            return "the request body must be JSON", []
        named, problem = [], None
        event = payload.get("fn_index") if isinstance(payload, dict) else None
        if event is not None and (type(event) is not int or event not in self.events):
            problem = f"there is no event number {str(event)[:40]} on this page"
        stack = [(payload, 0)]
        while stack:
            value, depth = stack.pop()
            if depth > MAX_PAYLOAD_DEPTH:
                return f"the payload nests deeper than {MAX_PAYLOAD_DEPTH} levels", named
            if isinstance(value, dict):
                if "path" in value:
                    why = self.uploads.problem(value["path"])
                    if why is None:
                        named.append(value["path"])
                    elif problem is None:
                        problem = f"refused the file {str(value['path'])[:200]!r}: {why}"
                stack.extend((v, depth + 1) for v in value.values())
            elif isinstance(value, list):
                stack.extend((v, depth + 1) for v in value)
        return problem, named


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

