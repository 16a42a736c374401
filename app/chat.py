"""The chat flow: sessions and images in the store, questions to the engine, answers back.

Nothing here knows about Gradio or HTTP: :class:`ChatService` takes an owner key, a session id and
plain values, and returns records and :class:`TurnView` snapshots that the page and the share view
render. Every prompt is built with :func:`engine.media_first_messages` (images first, then the
question), so the prefix up to the last image is the same for every question of a session and the
engine's compact prefix cache can serve it.

That prefix is warmed (:mod:`app.warming`) whenever a session's images change (an upload, a
removal, a continued copy of a share) and, after a start, for the most recently used sessions
(:meth:`ChatService.warm_recent`), with exactly the images, order and salt its questions use
(:meth:`ChatService.prompt_images`): the first question is a hit too.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from engine import (
    Completion,
    ImageDigestMismatchError,
    InvalidVideoError,
    PrismError,
    SamplingParams,
    media_first_messages,
)
from engine.media import sniff_video
from sessions import (
    MAX_TITLE_LENGTH,
    InvalidImageError,
    LimitExceeded,
    NotFound,
    PermissionDenied,
    Session,
    SessionStore,
    StoreError,
)

from .warming import PrefixWarmer

log = logging.getLogger(__name__)

DEFAULT_TITLE = "New chat"
#: A chat is titled by its first question, up to the store's title limit: the sidebar shortens it
#: on screen and shows all of it on hover.
TITLE_FROM_QUESTION_CHARS = MAX_TITLE_LENGTH
#: How the title of a continued copy of a shared chat starts (in front, so that the sidebar, which
#: shortens long titles, still shows it).
COPY_PREFIX = "Copy of "
_TURN_ID_RE = re.compile(r"[1-9][0-9]{0,17}")


class ChatError(Exception):
    """A request the app refuses, with a message for the user (empty question, model loading...)."""


@dataclass(frozen=True)
class ChatOptions:
    """Per-question settings from the settings panel.

    ``history``: each question sees the earlier questions and answers (multi-turn chat, reusing
    the previous turn's KV); off, every question is asked against the images alone.
    """

    temperature: float = 0.0
    max_tokens: int = 256
    history: bool = False
    top_p: float = 1.0

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_tokens=int(self.max_tokens), temperature=float(self.temperature),
                              top_p=float(self.top_p))


@dataclass
class TurnView:
    """One question and its answer as the page shows it.

    ``status``: ``"streaming"``, ``"done"``, ``"cancelled"`` or ``"error"``. ``line`` is the
    telemetry line (or the error message).
    """

    turn_id: int
    question: str
    answer: str
    status: str
    telemetry: dict = field(default_factory=dict)
    line: str = ""
    finish_reason: str | None = None

    @property
    def prefix(self) -> str:
        return str(self.telemetry.get("prefix_cache", "off")) if self.telemetry else ""


def _tok(n) -> str:
    return f"{int(n):,} tok"


def _restored(tel: dict) -> str:
    """``host · restored 103 pages in 2.6 ms``: a host-tier hit's copy back to the GPU."""
    pages = int(tel.get("restored_pages", 0) or 0)
    ms = float(tel.get("restore_ms", 0.0) or 0.0)
    return f"host · restored {pages:,} page{'s' if pages != 1 else ''} in {ms:,.1f} ms"


def telemetry_line(tel: dict, finish_reason: str | None = None) -> str:
    """The compact line shown beside an answer, e.g.
    ``prefix HIT · TTFT 41 ms · reused 1,568 tok (compact 941) · computed 19 tok · 23 tok/s``, or
    ``reused 1,568 tok (dense)`` when the prefix it used kept every visual token (telemetry
    ``prefix_form``; older telemetry without it says nothing when nothing was dropped).

    A hit served from the host-memory tier says so and what bringing it back cost (telemetry
    ``prefix_tier``, ``restored_pages``, ``restore_ms``):
    ``prefix HIT (host · restored 103 pages in 2.6 ms) · TTFT ...``; a hit in the KV pool reads
    as it always did.

    The first question that attaches a prefix a warm built (telemetry ``warmed``) says so:
    ``prefix HIT (warmed at upload) · TTFT 12 ms`` (``warmed at start`` after a start's warming,
    telemetry ``warmed_by``); with the host tier too, ``prefix HIT (warmed at upload; host ·
    restored ...)``.

    A ``miss`` says that the prefix is now cached: it is the expected first question about a
    set of images, not a failure.

    ``stale`` (the cached prefix was evicted before the request ran) and ``off`` (no images, or
    prefix caching disabled) are shown as they are.
    """
    if not tel:
        return ""
    prefix = str(tel.get("prefix_cache", "off"))
    head = f"prefix {prefix.upper()}"
    if prefix == "hit":
        notes = ([_warmed(tel)] if tel.get("warmed") else []) + ([_restored(tel)] if tel.get("prefix_tier") == "host"
                                                                  else [])
        if notes:
            head += f" ({'; '.join(notes)})"
    elif prefix == "miss":
        head += " (now cached)"
    elif prefix == "stale":
        head += " (evicted, recomputed)"
    elif prefix == "off" and not tel.get("visual_tokens"):
        head += " (no images)"
    parts = [head]
    if tel.get("vision_encoder_ran"):
        parts.append("vision encoder ran")
    parts.append(f"TTFT {float(tel.get('ttft_ms', 0.0)):,.0f} ms")
    cached = int(tel.get("cached_tokens", 0) or 0)
    if cached:
        dropped = int(tel.get("visual_tokens", 0) or 0) - int(tel.get("visual_tokens_kept", 0) or 0)
        kept = cached - dropped if tel.get("visual_tokens_kept") and 0 < dropped < cached else cached
        form = tel.get("prefix_form")
        if form == "dense" or (form is None and kept == cached):
            note = " (dense)" if form == "dense" else ""
        else:
            note = f" (compact {kept:,})"
        parts.append(f"reused {_tok(cached)}{note}")
    parts.append(f"computed {_tok(tel.get('computed_tokens', 0) or 0)}")
    tps = float(tel.get("decode_tokens_per_s", 0.0) or 0.0)
    if tps:
        parts.append(f"{tps:,.0f} tok/s")
    if finish_reason == "cancelled":
        parts.append("stopped")
    elif finish_reason == "length":
        parts.append("hit max tokens")
    return " · ".join(parts)


#: How the chip names the event whose warm built the prefix a first question attached (telemetry
#: ``warmed``; the app adds ``warmed_by``, the :data:`app.warming.SOURCES` value of the session's warm).
WARMED_AT = {"upload": "warmed at upload", "restart": "warmed at start"}


def _warmed(tel: dict) -> str:
    """``warmed at upload``: the first question after a warm (any source but a start reads as
    the upload: a removal or a continued copy changed the images the same way)."""
    return WARMED_AT.get(str(tel.get("warmed_by") or "upload"), WARMED_AT["upload"])


#: File names of clips: such a file that is no image is refused with the video reader's reason.
_CLIP_SUFFIXES = (".mp4", ".m4v", ".mov", ".webm", ".mkv")

#: What the image viewer says of an image whose compact prefix is not cached: the engine keeps it
#: in memory only, so we cannot tell which of these it is, and do not guess a picture.
NOT_CACHED = ("Not cached: the model holds no prefix of this chat's images right now (not warmed or asked about "
              "them yet, evicted to make room, or the server restarted); the next question computes it again")
NOT_LOADED = "Not cached: the model is not loaded yet"


def kept_summary(item: dict) -> str:
    """The image viewer's line for a cached image of :meth:`ChatService.prefix_view`, e.g.
    ``kept 118 of 196 visual tokens · selector: uniform (keep ratio 0.6)`` or ``all kept: 196 of
    196 visual tokens · dense prefix (no compaction)``; for a preview (``item["preview"]``)
    it says so, with the compaction step (1-based) it shows (the first: later ones are not
    previewed, see :meth:`ChatService.prefix_view`)."""
    kept, total, selector = int(item["kept_count"]), int(item["rows"]) * int(item["cols"]), item.get("selector")
    how = (f"selector: {selector} (keep ratio {float(item['keep_ratio']):g})" if selector
           else "dense prefix (no compaction)")
    if item.get("preview"):
        step, steps = int(item["step"]) + 1, int(item["steps"])
        return (f"Preview (all {total:,} are kept now, the prefix is dense): when KV memory runs short, compaction "
                f"step {step} of {steps} would keep {kept:,} of {total:,} visual tokens · {how}")
    if kept == total:
        return f"all kept: {kept:,} of {total:,} visual tokens · {how}"
    return f"kept {kept:,} of {total:,} visual tokens · {how}"


def view_of(turn) -> TurnView:
    """The :class:`TurnView` of a stored turn."""
    if turn.error:
        status, line = "error", turn.error
    elif turn.finished_at is None:
        status, line = "streaming", "generating ..."
    else:
        status = "cancelled" if turn.finish_reason == "cancelled" else "done"
        line = telemetry_line(turn.telemetry, turn.finish_reason)
    return TurnView(turn.id, turn.question, turn.answer, status, dict(turn.telemetry or {}), line, turn.finish_reason)


def is_unicode_text(text: str) -> bool:
    """Whether ``text`` is valid Unicode (no lone surrogate, which UTF-8 cannot encode; JSON's
    ``"\\ud800"`` escapes produce them)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def build_messages(images: list, question: str, history: list[tuple[str, str]] | None = None) -> list[dict]:
    """Chat messages for the engine: media-first with images, a plain text chat without."""
    if images:
        return media_first_messages(images, question, history)
    messages: list[dict] = []
    for q, a in history or []:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": question})
    return messages


#: The refusal of a change to a chat while one of its answers is being written (any tab).
BUSY = "An answer of this chat is being written: wait for it or press Stop, then try again."
NOTHING_TO_REGENERATE = "There is nothing to regenerate yet: ask a question first."
_GONE = "That question is no longer part of this chat (it was edited or deleted, maybe in another tab)."


def _checked_question(question) -> str:
    """The question, stripped.

    Raises:
        ChatError: empty, not text, or not valid Unicode.
    """
    question = (question if isinstance(question, str) else "").strip()
    if not question:
        raise ChatError("Please type a question first.")
    if not is_unicode_text(question):
        raise ChatError("The question contains a broken character (an unpaired UTF-16 surrogate, as left by "
                        "a bad copy and paste); remove it and send the question again.")
    return question


def title_from(question: str) -> str:
    """A new chat's title: its first question, whitespace collapsed, shortened to
    :data:`TITLE_FROM_QUESTION_CHARS` characters (an ellipsis marks a cut)."""
    title = " ".join(question.split())
    return title if len(title) <= TITLE_FROM_QUESTION_CHARS else title[: TITLE_FROM_QUESTION_CHARS - 1] + "…"


def copy_title(title: str) -> str:
    """The title of a continued copy of a chat titled ``title``: ``"Copy of <title>"``, shortened
    to fit the store's title limit; a copy of a copy is not marked twice."""
    if title.startswith(COPY_PREFIX):
        return title
    room = MAX_TITLE_LENGTH - len(COPY_PREFIX)
    return COPY_PREFIX + (title if len(title) <= room else title[: room - 1].rstrip() + "…")


class ActiveTurn:
    """A question being answered. Iterate it for :class:`TurnView` snapshots (one per text delta,
    then the final one); :meth:`ChatService.stop` ends it early with the text so far.
    ``replaced``: how many earlier turns it replaced (an edited or regenerated turn and the ones
    after it; 0 for a new question). ``handle``: the engine's
    :class:`~engine.serving.handle.RequestHandle` of the answer (None with ``error``)."""

    def __init__(self, service: ChatService, session: Session, turn, handle=None, error: str | None = None):
        self.service, self.session, self.turn = service, session, turn
        self.handle, self.error = handle, error
        self.replaced = 0
        self.text = ""
        self.final: TurnView | None = None

    def __iter__(self) -> Iterator[TurnView]:
        if self.error is not None:
            self.final = self._record(error=self.error)
            self.service._forget(self.session.id, None, self.turn.id)
            yield self.final
            return
        handle = self.handle
        try:
            yield TurnView(self.turn.id, self.turn.question, "", "streaming", line="generating ...")
            for item in handle:  # raises the error the request failed with
                if isinstance(item, Completion):
                    self.service.observe(item)
                    self.final = self._record(completion=item)
                    yield self.final
                    return
                self.text += item
                yield TurnView(self.turn.id, self.turn.question, self.text, "streaming", line="generating ...")
        except PrismError as exc:
            self.service.observe(None, "error")
            self.final = self._record(error=str(exc) or type(exc).__name__)
            yield self.final
        except Exception as exc:  # a bug must not leave the turn unfinished
            log.exception("answer failed")
            self.service.observe(None, "error")
            self.final = self._record(error=f"internal error: {exc}")
            yield self.final
        finally:
            self.service._forget(self.session.id, handle, self.turn.id)
            if self.final is None:  # the reader went away (browser closed): free the engine at once
                self.service.observe(None, "abort")
                handle.cancel()  # returns once its KV pages are free
                self._record(cancelled=True)

    def _record(self, *, completion: Completion | None = None, error: str | None = None,
                cancelled: bool = False) -> TurnView:
        """Store the finished turn and return its view."""
        if completion is not None:
            text, tel, reason = completion.text, completion.telemetry.to_dict(), completion.finish_reason
            if tel.get("warmed"):  # which warm built it, for the chip (at upload, at start)
                tel["warmed_by"] = self.service.warmer.source(self.session.id) or "upload"
        else:
            text, tel, reason = self.text, {}, "cancelled" if cancelled else "error"
        try:
            turn = self.service.store.finish_turn(self.turn.id, text, tel, reason, error=error)
        except StoreError as exc:  # store closed during shutdown
            log.warning("could not store turn %s: %s", self.turn.id, exc)
            return TurnView(self.turn.id, self.turn.question, text, "error" if error else "done", tel,
                            error or telemetry_line(tel, reason), reason)
        return view_of(turn)


class ChatService:
    """Sessions, images and questions for one owner key at a time.

    Args:
        store: the session store.
        engine_source: an object with an ``engine`` attribute, an :class:`~engine.client.EngineClient` (the
            :class:`~app.model_loader.ModelLoader`),
            None while the model is loading.
        max_upload_bytes: uploads larger than this are refused before being read.

    ``metrics`` (an :class:`~app.metrics.Metrics`, set by :func:`app.server.create_app`; None:
    not counted) counts every answer that reached the engine, and the warms.

    ``warmer`` (:class:`~app.warming.PrefixWarmer`) holds each session's prefix warm; ``warming``
    (``--warm``; default True) says whether image changes and :meth:`warm_recent` start any.
    """

    def __init__(self, store: SessionStore, engine_source, *, max_upload_bytes: int = 50 * 2**20,
                 warming: bool = True):
        self.store = store
        self.engine_source = engine_source
        self.max_upload_bytes = max_upload_bytes
        self.warmer = PrefixWarmer(engine_source)
        self.warming = warming
        self._metrics = None
        self._active: dict[str, list] = {}
        self._active_turns: set[int] = set()
        # sessions whose answer is being started (claimed before its turn is stored): with _active,
        # what makes a chat busy, so two tabs cannot start or change answers of one chat at once
        self._starting: set[str] = set()
        self._lock = threading.Lock()

    @property
    def metrics(self):
        return self._metrics

    @metrics.setter
    def metrics(self, value) -> None:
        self._metrics = self.warmer.metrics = value

    # ------------------------------------------------------------------ engine
    def engine_or_none(self):
        return getattr(self.engine_source, "engine", None)

    def _engine(self):
        engine = self.engine_or_none()
        if engine is None:
            state = getattr(self.engine_source, "state", "loading")
            if state == "failed":
                raise ChatError(f"The model could not be loaded: {getattr(self.engine_source, 'error', '')}")
            if state == "restarting":
                raise ChatError("The engine stopped unexpectedly and is being restarted; try again in a moment.")
            raise ChatError("The model is still loading; try again in a moment (progress is shown in the terminal).")
        return engine

    def observe(self, completion: Completion | None, failure: str = "error") -> None:
        """Count a finished answer in :attr:`metrics` (``failure``, ``"error"`` or ``"abort"``,
        when it ended without a completion)."""
        if self.metrics is None:
            return
        if completion is not None:
            self.metrics.observe(completion)
        else:
            self.metrics.observe_failure(failure)

    # ------------------------------------------------------------------ sessions
    def sessions(self, owner: str) -> list[Session]:
        """The owner's sessions, newest first."""
        return self.store.list_sessions(owner) if owner else []

    def session(self, session_id: str | None, owner: str) -> Session | None:
        """The session if it exists and ``owner`` owns it, else None."""
        if not session_id or not owner:
            return None
        return self.store.get_session(session_id, owner=owner)

    def _owned(self, session_id: str | None, owner: str) -> Session:
        session = self.session(session_id, owner)
        if session is None:
            raise ChatError("This chat no longer exists; start a new one.")
        return session

    def ensure_session(self, session_id: str | None, owner: str) -> Session:
        """The owner's session ``session_id``, or a new one when there is none (or it is gone)."""
        if not owner:
            raise ChatError("Your browser did not send its Prism cookie; enable cookies for this site and reload.")
        return self.session(session_id, owner) or self.store.create_session(owner, DEFAULT_TITLE)

    def rename(self, session_id: str, owner: str, title: str) -> Session:
        return self.store.rename_session(self._owned(session_id, owner).id, owner, title)

    def fork(self, share, owner: str) -> Session:
        """The visitor's own copy of a "continue" share, titled as a copy (``"Copy of <title>"``),
        so the original and the copy can be told apart in the sidebar.

        Raises:
            NotFound, PermissionDenied, ValueError: as :meth:`SessionStore.fork_session`.
        """
        session = self.store.fork_session(share, owner)
        session = self.store.rename_session(session.id, owner, copy_title(session.title))
        self.warm_session(session)  # usually cached already: the original's salt and images
        return session

    def delete(self, session_id: str, owner: str) -> None:
        """Delete the owner's session: refused while an answer of it is being written, the store
        drops it (its images' files go with their last session), and the engine forgets its salt
        (:meth:`forget`). Copies of a "can continue" share keep the salt: they compute their
        prefix again.

        Raises:
            ChatError: the session is not the owner's, or busy (:data:`BUSY`).
        """
        session = self._owned(session_id, owner)
        self._refuse_if_busy(session.id)
        self.warmer.cancel(session.id)
        self.store.delete_session(session.id, owner)
        self.forget(session.cache_salt)

    def revoke_share(self, session_id: str | None, owner: str, share_id: str) -> threading.Thread | None:
        """Revoke one of the session's share links, then have the engine forget the session's
        salt (what the visitors' copies of a "can continue" share warmed with the owner), in a
        thread of its own: the owner's answers in progress finish first, and the click need not
        wait for them. Every prefix warm under that salt (the session's, its copies') is
        cancelled first. Returns that thread (None when nothing was revoked).

        Raises:
            ChatError: the session is not the owner's. NotFound, PermissionDenied: the share is
                not one of the owner's.
        """
        session = self._owned(session_id, owner)
        self.store.revoke_share(share_id, owner)
        self.warmer.cancel_salt(session.cache_salt)  # the session's and its continued copies'
        worker = threading.Thread(target=self.forget, args=(session.cache_salt,), name="prism-forget", daemon=True)
        worker.start()
        return worker

    def forget(self, cache_salt: str) -> None:
        """Have the engine drop what it keeps of a salt (``Engine.forget``: prefix entries, vision
        features, processed images, after the salt's running answers); nothing while the model
        loads (a new engine holds nothing of it) or once it is closed."""
        engine = self.engine_or_none()
        if engine is None:
            return
        try:
            engine.forget(cache_salt)
        except PrismError as exc:  # closed during shutdown
            log.info("forget skipped: %s", exc)

    def turns(self, session_id: str | None) -> list[TurnView]:
        """The session's turns as views, oldest first (no ownership check: callers check).

        A turn left unfinished by an earlier server process (it stopped mid-answer) is shown as
        interrupted, not as still generating.
        """
        views = [view_of(t) for t in self.store.list_turns(session_id)] if session_id else []
        with self._lock:
            active = set(self._active_turns)
        for view in views:
            if view.status == "streaming" and view.turn_id not in active:
                view.status, view.line = "error", "interrupted: the server stopped before this answer was finished"
        return views

    # ------------------------------------------------------------------ images
    def add_images(self, session_id: str | None, owner: str, uploads: list[tuple[str, str | Path | bytes]]
                   ) -> tuple[Session | None, list[str]]:
        """Add uploaded images and video clips (``(file name, path or bytes)`` pairs; MP4 and WebM
        files are clips, everything else, animated GIFs too, an image) to the session, creating it
        if needed. Returns the session and one message per refused file; a refused file is not
        stored and the others are. When every file of a first upload is refused, no session is
        left behind and the session returned is None."""
        existing = self.session(session_id, owner)
        if existing is not None:
            self._refuse_if_busy(existing.id)
        session = existing or self.ensure_session(None, owner)
        problems, stored = [], 0
        for name, source in uploads:
            label = os.path.basename(str(name or "")) or "image"
            try:
                data = self._read_upload(source)
                self._add_media(session.id, owner, data, label)
                stored += 1
            except (InvalidImageError, InvalidVideoError, LimitExceeded, ChatError) as exc:
                problems.append(f"{label}: {exc}")
            except (NotFound, PermissionDenied) as exc:
                raise ChatError(str(exc)) from None
        if existing is None and uploads and not stored:
            self.store.delete_session(session.id, owner)
            return None, problems
        session = self.store.get_session(session.id, owner=owner) or session
        if stored:
            self.warm_session(session)
        return session, problems

    def _add_media(self, session_id: str, owner: str, data: bytes, label: str) -> None:
        """Store one upload as a clip when its first bytes say so, else as an image. A file named
        like a clip that is no image either is tried as a clip, so its refusal speaks of videos
        (a damaged ``.mp4`` was told "not an image", and a QuickTime file without an ``ftyp``
        box was never opened as a video).

        Raises:
            InvalidImageError, InvalidVideoError, LimitExceeded: the file is refused.
        """
        if sniff_video(data):
            self.store.add_video(session_id, owner, data, filename=label)
            return
        try:
            self.store.add_image(session_id, owner, data, filename=label)
        except InvalidImageError:
            if not label.lower().endswith(_CLIP_SUFFIXES):
                raise
            self.store.add_video(session_id, owner, data, filename=label)

    def upscale_notice(self, name: str, width: int, height: int) -> str | None:
        """A note for an image smaller than the model's minimum (its processor then upscales it,
        so the model sees little detail), or None; None too while the model is loading."""
        engine = self.engine_or_none()
        if engine is None:
            return None
        minimum = int(engine.min_image_pixels)
        if int(width) * int(height) >= minimum:
            return None
        return (f"{name} is only {int(width)}×{int(height)} pixels, under the model's minimum of {minimum:,} pixels: "
                "it was upscaled, so the model sees little detail in it.")

    def _read_upload(self, source) -> bytes:
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
        else:
            path = Path(source)
            if path.stat().st_size > self.max_upload_bytes:
                data = None
            else:
                data = path.read_bytes()
        if data is None or len(data) > self.max_upload_bytes:
            raise ChatError(f"the file is larger than the upload limit of {self.max_upload_bytes / 2**20:g} MiB; "
                            "nothing was stored")
        return data

    def remove_image(self, session_id: str, owner: str, sha: str) -> Session:
        """Remove image ``sha`` from the session. Raises ChatError: not theirs, or busy."""
        session = self._owned(session_id, owner)
        self._refuse_if_busy(session.id)
        try:
            self.store.remove_image(session.id, owner, sha)
        except NotFound:
            return self.store.get_session(session.id, owner=owner) or session  # already gone (another tab)
        session = self.store.get_session(session.id, owner=owner) or session
        self.warm_session(session)  # the smaller set (or, with none left, the warm cancelled)
        return session

    # ------------------------------------------------------------------ warming
    def prompt_images(self, session: Session) -> list[dict]:
        """The image list every question of ``session`` passes to :func:`media_first_messages`,
        in the session's order: ``{"image": path, "sha256": digest}`` per image (the store is
        content-addressed: the digest spares the engine hashing the file again, and it checks it
        when it processes), ``{"video": path}`` per clip; a path is None when the file is missing
        on the server. Warms use exactly this list and the session's salt, or their prefix would
        not be the one the questions look up."""
        kinds = {r.sha256: r.kind for r in self.store.list_images(session.id)}
        return [{"video": self.store.image_path(sha)} if kinds.get(sha) == "video"
                else {"image": self.store.image_path(sha), "sha256": sha} for sha in session.image_shas]

    def warm_session(self, session: Session, source: str = "upload"):
        """Warm ``session``'s prefix (its images as they are now, :meth:`prompt_images`, under its
        salt), superseding its previous warm; a session without images (or with a file missing)
        has its warm cancelled instead. Nothing with ``warming`` off. Best-effort: returns the
        :meth:`~app.warming.PrefixWarmer.warm` future, or None when nothing was started."""
        images = self.prompt_images(session) if session.image_shas else []
        if not self.warming or not images or any(p.get("image", p.get("video")) is None for p in images):
            self.warmer.cancel(session.id)
            return None
        return self.warmer.warm(session.id, images, session.cache_salt, source)

    def warm_recent(self, share: float, *, candidates: int = 64, timeout_s: float = 600.0) -> list[str]:
        """After a start (the server's, or a restarted engine core's: both begin with an empty
        cache), warm the most recently used sessions' prefixes, newest first, one at a time,
        while their pages fit in ``share`` of the KV pool (``stats()["pages_total"]``).

        A session's pages are estimated before it is warmed from its prompt's length
        (:meth:`~engine.client.EngineClient.count_prompt_tokens` of its media-first prompt with an
        empty question, a few tokens more than the prefix, in pages of ``stats()["page_size"]``):
        the dense size, so with compaction the warmed prefix holds no more than counted. A
        session that does not fit is skipped (an older, smaller one may); once warmed, its real
        prefix length is what is counted. Sessions with a warm of their own on this engine already
        (changed since the start) are left to it. At most ``candidates`` sessions are looked at; one warm
        is waited for up to ``timeout_s`` (warms run below every question: a busy engine delays
        them), then counted as estimated and left running. Best-effort: errors are logged.

        Returns the ids of the sessions warmed (or left warming).
        """
        engine = self.engine_or_none()
        if engine is None or share <= 0 or not self.warming:
            return []
        try:
            stats = engine.stats()
            budget, page = int(stats["pages_total"] * share), max(1, int(stats["page_size"]))
            sessions = self.store.recent_sessions(candidates)
        except (PrismError, StoreError, KeyError) as exc:
            log.info("warming recent chats skipped: %s", exc)
            return []
        used, warmed = 0, []
        for session in sessions:
            images = self.prompt_images(session)
            if any(p.get("image", p.get("video")) is None for p in images) or self.warmer.active(session.id):
                continue
            try:
                tokens = engine.count_prompt_tokens(media_first_messages(images, ""), cache_salt=session.cache_salt)
            except PrismError as exc:
                log.info("not warming chat %s: %s", session.id, exc)
                continue
            pages = -(-tokens // page)
            if used + pages > budget:
                continue
            future = self.warmer.warm(session.id, images, session.cache_salt, "restart")
            try:
                handle = future.result(timeout_s)
                if handle is None:
                    continue
                pages = -(-int(handle.result(timeout=timeout_s)) // page)
            except TimeoutError:
                pass  # still warming: counted as estimated
            except PrismError as exc:  # cancelled by a newer change, refused by the engine
                log.info("warming chat %s after the start ended: %s", session.id, exc)
                continue
            used += pages
            warmed.append(session.id)
        if warmed:
            log.info("warmed %d recent chat(s) after the start: %d of %d pages", len(warmed), used, budget)
        return warmed

    # ------------------------------------------------------------------ questions
    def ask(self, session_id: str | None, owner: str, question: str, options: ChatOptions | None = None
            ) -> ActiveTurn:
        """Start answering ``question`` in the session (created when None). Iterate the result.

        Raises:
            ChatError: empty question, model not loaded yet, no usable owner key, or an answer
                of the chat is being started or written (:data:`BUSY`, any tab). Engine
                errors (a request too long, a bad image) do not raise: the turn records them and
                the returned :class:`ActiveTurn` shows them beside that answer.
        """
        question = _checked_question(question)
        options = options or ChatOptions()
        engine = self._engine()
        session = self.ensure_session(session_id, owner)
        with self._lock:
            if session.id in self._starting or self._active.get(session.id):
                raise ChatError(BUSY)
            self._starting.add(session.id)
        try:
            return self._start(engine, session, owner, question, options)
        finally:
            with self._lock:
                self._starting.discard(session.id)

    def _start(self, engine, session: Session, owner: str, question: str, options: ChatOptions) -> ActiveTurn:
        """:meth:`ask`'s work once the session is claimed."""
        history = None
        if options.history:
            history = [(t.question, t.answer) for t in self.store.list_turns(session.id)
                       if t.finished_at is not None and not t.error and t.answer]
        images = self.prompt_images(session)  # the very list the session's warms use
        if session.title == DEFAULT_TITLE and not self.store.list_turns(session.id):
            session = self.store.rename_session(session.id, owner, title_from(question))
        turn = self.store.add_turn(session.id, question)
        with self._lock:
            self._active_turns.add(turn.id)
        if any(p.get("image", p.get("video")) is None for p in images):
            return ActiveTurn(self, session, turn, error="An image of this chat is missing on the server.")
        try:
            sampling = options.sampling()
            handle = engine.submit(build_messages(images, question, history), sampling,
                                   cache_salt=session.cache_salt)
        except ImageDigestMismatchError:  # the stored file no longer holds the bytes it is named by
            return ActiveTurn(self, session, turn, error="An image of this chat is damaged on the server.")
        except PrismError as exc:
            return ActiveTurn(self, session, turn, error=str(exc))
        with self._lock:
            self._active.setdefault(session.id, []).append(handle)
        return ActiveTurn(self, session, turn, handle=handle)

    def edit(self, session_id: str | None, owner: str, turn_id, question: str,
             options: ChatOptions | None = None) -> ActiveTurn:
        """Ask ``question`` in place of turn ``turn_id``'s question: that turn and every later one
        are deleted, and the chat goes on from there. The cache reuses what still matches: the
        image prefix and, with history on, the KV of the turns before it (conversation reuse).

        ``turn_id`` comes from the browser: an int or a string of digits naming one of this
        session's turns.

        Raises:
            ChatError: the chat is not the owner's, ``turn_id`` is not one of its turns (another
                chat's, gone, negative, huge, not a number), the question is empty or broken, or
                the model is not loaded, or an answer of the chat is being written (:data:`BUSY`:
                edits never race a stream, whichever tab sent them). Nothing is deleted then.
        """
        session = self._owned(session_id, owner)
        question = _checked_question(question)
        self._engine()  # a loading model refuses before anything is deleted
        turn = self._turn_of(session, turn_id)
        self._refuse_if_busy(session.id)
        try:
            replaced = self.store.delete_turns_from(session.id, owner, turn.id)
        except NotFound:  # another tab got there first
            raise ChatError(_GONE) from None
        first = not self.store.list_turns(session.id)  # nothing before the edited turn
        if first and session.title == title_from(turn.question) and question != turn.question:
            # the title was the first question's (not one the owner chose): it follows the edit
            self.store.rename_session(session.id, owner, title_from(question))
        active = self.ask(session.id, owner, question, options)
        active.replaced = len(replaced)
        return active

    def regenerate(self, session_id: str | None, owner: str, options: ChatOptions | None = None, *,
                   turn_id=None) -> ActiveTurn:
        """Ask turn ``turn_id``'s question again (default: the last turn's); its old answer and
        every later turn are deleted. Refusals as :meth:`edit`; a chat with no question (a new,
        empty one, ``session_id`` None) has :data:`NOTHING_TO_REGENERATE`."""
        if self.session(session_id, owner) is None and not session_id:
            raise ChatError(NOTHING_TO_REGENERATE)
        session = self._owned(session_id, owner)
        if turn_id is None:
            turns = self.store.list_turns(session.id)
            if not turns:
                raise ChatError(NOTHING_TO_REGENERATE)
            turn = turns[-1]
        else:
            turn = self._turn_of(session, turn_id)
        return self.edit(session.id, owner, turn.id, turn.question, options)

    def _turn_of(self, session: Session, turn_id):
        """The session's turn ``turn_id`` (an int, or a string of digits, from the browser).

        Raises:
            ChatError: anything else, or a turn of another session: the same message whether or
                not that id exists elsewhere.
        """
        if isinstance(turn_id, str) and _TURN_ID_RE.fullmatch(turn_id):
            turn_id = int(turn_id)
        if isinstance(turn_id, int) and not isinstance(turn_id, bool):
            for turn in self.store.list_turns(session.id):
                if turn.id == turn_id:
                    return turn
        raise ChatError(_GONE)

    def stop(self, session_id: str | None, owner: str) -> bool:
        """Cancel the session's answers in progress (the engine frees them at once)."""
        if self.session(session_id, owner) is None:
            return False
        with self._lock:
            handles = list(self._active.get(session_id, []))
        for handle in handles:
            handle.cancel(wait=False)
        return bool(handles)

    def _refuse_if_busy(self, session_id: str) -> None:
        """Raise ChatError(:data:`BUSY`) while an answer of the session is started or streaming."""
        with self._lock:
            if session_id in self._starting or self._active.get(session_id):
                raise ChatError(BUSY)

    def answering(self, session_id: str | None) -> bool:
        """Whether an answer of the session is in progress (no ownership check)."""
        with self._lock:
            return bool(session_id and self._active.get(session_id))

    def cancel_all(self) -> int:
        """Cancel every answer in progress, and every prefix warm (shutdown). Returns how many
        answers."""
        self.warmer.cancel_all()
        with self._lock:
            handles = [h for active in self._active.values() for h in active]
        for handle in handles:
            handle.cancel(wait=False)
        return len(handles)

    def _forget(self, session_id: str, handle, turn_id: int) -> None:
        with self._lock:
            self._active_turns.discard(turn_id)
            handles = self._active.get(session_id, [])
            if handle in handles:
                handles.remove(handle)
            if not handles:
                self._active.pop(session_id, None)

    # ------------------------------------------------------------------ the image viewer
    def prefix_view(self, session: Session) -> dict:
        """What the compact prefix the session's next question would attach kept of each of its
        images, for the image viewer (no ownership check: callers check). Never holds the salt.

        Returns ``{"images": [...]}``, one item per image in prompt order: ``number`` (1-based),
        ``sha256``, ``cached`` (bool) and ``summary`` (the viewer's line, :func:`kept_summary`);
        when cached also ``rows``, ``cols``, ``kept`` (``rows`` lists of ``cols`` bools),
        ``kept_count``, ``selector``, ``keep_ratio``, ``preview``, ``step`` and ``steps`` as
        :meth:`engine.Engine.prefix_info` reports them with ``preview=True`` (the browser draws
        them, it computes nothing). Under ``compaction_mode="on_pressure"`` a cached prefix is
        dense until KV memory runs short, so "all kept" showed nothing: for a dense prefix the
        viewer shows, marked as a preview, what the first compaction step on pressure would keep;
        a prefix compacted already shows what it keeps.
        """
        videos = {r.sha256 for r in self.store.list_images(session.id) if r.is_video}
        shas = [sha for sha in session.image_shas if sha not in videos]  # clips have no viewer
        engine, info, reason = self.engine_or_none(), None, NOT_CACHED
        if engine is None:
            reason = NOT_LOADED
        elif shas:
            try:  # only a prefix of exactly these images: the one the next question would attach
                info = engine.prefix_info(session.cache_salt, shas, preview=True)
                if info and info[0].get("preview") and info[0].get("step"):
                    # compacted already: what it keeps now is real, and that is what is shown
                    info = engine.prefix_info(session.cache_salt, shas)
            except PrismError:  # closed during shutdown
                info = None
        reported = {item["image"]: item for item in info or []}
        images = []
        for n, sha in enumerate(shas):
            item = {"number": n + 1, "sha256": sha, "cached": n in reported, "summary": reason}
            if item["cached"]:
                got = reported[n]
                item.update({k: got[k] for k in ("rows", "cols", "kept", "kept_count", "selector", "keep_ratio")})
                item.update(preview=bool(got.get("preview")), step=got.get("step"), steps=int(got.get("steps") or 0))
                item["summary"] = kept_summary(item)
            images.append(item)
        return {"images": images}

    # ------------------------------------------------------------------ panels
    def session_stats(self, session_id: str | None) -> dict:
        """For the session panel: per-turn TTFT, prefix state and whether a warm built that
        prefix (``warmed``), and the prefix's page use."""
        rows, pages = [], None
        for n, view in enumerate(self.turns(session_id), 1):
            tel = view.telemetry
            if view.status == "error" or not tel:
                continue
            rows.append({"turn": n, "ttft_ms": float(tel.get("ttft_ms", 0.0)),  # rounded once, when shown
                         "prefix": str(tel.get("prefix_cache", "off")), "warmed": bool(tel.get("warmed"))})
            if tel.get("prefix_pages"):
                pages = {"compact": int(tel["prefix_pages"]), "dense": int(tel.get("prefix_pages_dense") or 0),
                         "visual_tokens": int(tel.get("visual_tokens", 0)),
                         "visual_tokens_kept": int(tel.get("visual_tokens_kept", 0))}
        return {"turns": rows, "pages": pages}
