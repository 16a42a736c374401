"""The page: a Gradio 6 Blocks app over :class:`~app.chat.ChatService`.

Layout: a left sidebar with the browser's sessions; in the middle the session's title, images and
chat; on the right the session, engine and settings panels; a share dialog. Handlers are small
functions of :class:`PrismUI` so tests can call them directly; lists rendered as HTML (sessions,
images, share links) send their clicks back through ``gr.HTML``'s ``trigger``.

The owner key comes from the HttpOnly cookie that :mod:`app.server` gives every browser.

Asking again: a question can be edited in place (Gradio's own editor on user messages, whose
event names the message by its index in the chat) and any answer regenerated (prism.js puts a
"↻ Regenerate" button on each answer, naming its turn id through a hidden ``gr.HTML`` bridge).
Both come from the browser, so they are checked against the session's own turns
(:meth:`app.chat.ChatService.edit`); the turn and every later one are replaced.
"""

from __future__ import annotations

import logging
import os
import types

import gradio as gr

from sessions import MAX_SHARE_NAME_LENGTH

from . import render
from .chat import ChatError, ChatOptions, ChatService, TurnView
from .gradio_guard import UploadFolder
from .model_loader import ModelLoader
from .server import OWNER_COOKIE

log = logging.getLogger(__name__)

#: Most answers streamed at once through the page (each holds a worker thread while it streams).
CHAT_CONCURRENCY = 48
#: Max tokens per answer, the settings slider's default (tokens).
DEFAULT_MAX_TOKENS = 256
#: The default with the demo model: its answers are random text, and 256 tokens of it took ~14 s on a
#: 2-core CPU and filled the chat.
DEMO_MAX_TOKENS = 48

_CLICK_JS = """
element.addEventListener('click', (event) => {
  const el = event.target.closest('[data-%(attr)s]');
  if (el) { event.preventDefault(); trigger('click', {%(key)s: el.dataset.%(key)s}); }
});
"""
# The bridge from prism.js's per-answer Regenerate buttons to the server (see the module
# docstring). The latest mount's trigger wins: Gradio may mount the component again.
_ACTIONS_JS = """
window.prismActions = { regenerate: (turn) => trigger('click', {regenerate: String(turn)}) };
"""
_SHARES_JS = """
const absolute = () => element.querySelectorAll('input.prism-link').forEach(
  (input) => { input.value = window.location.origin + input.dataset.path; });
element.addEventListener('click', (event) => {
  const el = event.target.closest('[data-revoke]');
  if (el) { event.preventDefault(); trigger('click', {revoke: el.dataset.revoke}); }
});
watch('value', absolute);
absolute();
"""


def owner_of(request: gr.Request | None) -> str:
    """The browser's owner key (from its cookie); empty when it sent none."""
    if request is None:
        return ""
    try:
        return (request.cookies or {}).get(OWNER_COOKIE, "") or ""
    except Exception:
        return ""


def event_value(evt: gr.EventData | None, key: str) -> str | None:
    """A value sent with ``trigger('click', {key: ...})`` from an HTML list."""
    data = getattr(evt, "_data", None) or {}
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


#: The Send and Stop buttons (one shows at a time) while an answer streams, and after it.
_BUSY = ({"__type__": "update", "visible": False}, {"__type__": "update", "visible": True})
_IDLE = ({"__type__": "update", "visible": True}, {"__type__": "update", "visible": False})


def turn_at(views: list[TurnView], index, previous_value=None) -> int:
    """The turn id of the user message at chat position ``index`` (as Gradio's edit event names
    it: two messages per turn, the question first), checked: an int, even, within the chat, and,
    when the browser sends the text it showed, that text is the turn's question (a stale tab
    must not edit another question than the one it showed).

    Raises:
        ChatError: anything else.
    """
    stale = ChatError("This chat has changed (in another tab?); it is shown again as it is now. Edit the "
                      "question again.")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0 or index % 2 or index // 2 >= len(views):
        raise stale
    view = views[index // 2]
    if isinstance(previous_value, str) and previous_value != view.question:
        raise stale
    return view.turn_id


def chat_messages(views: list[TurnView]) -> list[dict]:
    """Chatbot messages: each question, then its answer with the telemetry chip beside it."""
    messages = []
    for view in views:
        messages.append({"role": "user", "content": view.question})
        messages.append({"role": "assistant", "content": render.assistant_markdown(view)})
    return messages


class PrismUI:
    """The Gradio page and its handlers."""

    def __init__(self, chat: ChatService, loader: ModelLoader):
        self.chat = chat
        self.loader = loader

    # ------------------------------------------------------------------ views of a session
    def session_outputs(self, session_id: str | None, owner: str) -> tuple:
        """Everything that shows one session: (id, sessions list, title, images, chat, plot, pages)."""
        session = self.chat.session(session_id, owner)
        sid = session.id if session else None
        sessions = self.chat.sessions(owner)
        records = self.chat.store.list_images(sid) if sid else []
        stats = self.chat.session_stats(sid)
        return (
            sid,
            render.sessions_list(sessions, sid),
            session.title if session else "",
            render.images_strip(records, prefix=render.prefix_url(sid) if sid else None),
            chat_messages(self.chat.turns(sid)),
            render.ttft_chart(stats["turns"]),
            render.pages_panel(stats["pages"]),
        )

    def on_load(self, request: gr.Request):
        """Page load: open ``?session=<id>`` when it is ours, else the newest session. With the demo
        model, answers default to :data:`DEMO_MAX_TOKENS` (its random text gains nothing from length)."""
        owner = owner_of(request)
        wanted = None
        try:
            wanted = dict(request.query_params or {}).get("session")
        except Exception:
            pass
        session = self.chat.session(wanted, owner) if wanted else None
        if session is None:
            sessions = self.chat.sessions(owner)
            session = sessions[0] if sessions else None
        status = self.loader.status()
        max_tokens = gr.update(value=DEMO_MAX_TOKENS) if self.loader.demo else gr.skip()
        return (*self.session_outputs(session.id if session else None, owner),
                render.banner(status), render.engine_panel(status), max_tokens)

    def open_session(self, evt: gr.EventData, request: gr.Request):
        return self.session_outputs(event_value(evt, "session"), owner_of(request))

    def new_session(self, request: gr.Request):
        """"New chat": an empty view; the session is created by its first image or question."""
        return (*self.session_outputs(None, owner_of(request)), "")

    def rename(self, session_id: str | None, title: str, request: gr.Request):
        owner = owner_of(request)
        session = self.chat.session(session_id, owner)
        if session is None or not (title or "").strip() or title == session.title:
            return gr.skip(), gr.skip()
        session = self.chat.rename(session.id, owner, title)
        return render.sessions_list(self.chat.sessions(owner), session.id), session.title

    def delete(self, session_id: str | None, confirmed, request: gr.Request):
        """Delete the open session when ``confirmed`` is True (the browser's confirm() answer, sent
        through a hidden checkbox: the session id is a ``gr.State`` kept on the server, so the
        confirm's answer cannot travel in its place). Returns (*view, notice)."""
        owner = owner_of(request)
        if confirmed is not True or self.chat.session(session_id, owner) is None:
            return (*(gr.skip() for _ in range(7)), gr.skip())
        try:
            self.chat.delete(session_id, owner)
        except ChatError as exc:
            return (*(gr.skip() for _ in range(7)), _notice(str(exc), "info"))
        UploadFolder.of_gradio().sweep_deep_links()  # a snapshot there could hold this chat
        sessions = self.chat.sessions(owner)
        return (*self.session_outputs(sessions[0].id if sessions else None, owner), "")

    # ------------------------------------------------------------------ images
    def add_images(self, session_id: str | None, files, request: gr.Request):
        """Upload (several at once, drop or paste): store the good ones, explain the bad ones."""
        owner = owner_of(request)
        uploads = [(_name_of(f), _path_of(f)) for f in (files or []) if _path_of(f)]
        notice = ""
        try:
            before = self.chat.session(session_id, owner)
            session, problems = self.chat.add_images(session_id, owner, uploads)
            session_id = session.id if session is not None else session_id
            if problems:
                notice = _notice("Not added: " + " ".join(problems), "error")
            notice += self._upscale_notes(session, set(before.image_shas) if before else set())
        except ChatError as exc:
            notice = _notice(str(exc), "error")
        finally:
            for _, path in uploads:
                _discard_upload(path)
        return (*self.session_outputs(session_id, owner), notice, None)

    def _upscale_notes(self, session, known: set[str]) -> str:
        """A notice naming the newly added images that are under the model's minimum size."""
        if session is None:
            return ""
        notes = [self.chat.upscale_notice(r.filename or "an image", r.width, r.height)
                 for r in self.chat.store.list_images(session.id) if r.sha256 not in known and not r.is_video]
        notes = [n for n in notes if n]
        return _notice(" ".join(notes), "info") if notes else ""

    def remove_image(self, session_id: str | None, evt: gr.EventData, request: gr.Request):
        owner = owner_of(request)
        sha = event_value(evt, "remove")
        if sha and self.chat.session(session_id, owner) is not None:
            self.chat.remove_image(session_id, owner, sha)
        return self.session_outputs(session_id, owner)

    # ------------------------------------------------------------------ questions
    def answer(self, session_id, question, temperature, max_tokens, history, request: gr.Request):
        """Stream the answer to ``question``: yields (session id, chat, notice, question box,
        Send, Stop); Send turns into Stop while the answer streams."""
        options = _options(temperature, max_tokens, history)
        try:
            active = self.chat.ask(session_id, owner_of(request), question, options)
        except ChatError as exc:
            yield session_id, gr.skip(), _notice(str(exc), "info"), gr.skip(), *_IDLE
            return
        yield from self._stream(active, clear_question=True)

    def regenerate(self, session_id, temperature, max_tokens, history, request: gr.Request):
        """Ask the last question again; yields like :meth:`answer`."""
        yield from self._again(session_id, None, None, _options(temperature, max_tokens, history), request)

    def regenerate_turn(self, session_id, temperature, max_tokens, history, evt: gr.EventData,
                        request: gr.Request):
        """Regenerate on any answer (its turn id comes from the page's bridge); that turn and the
        later ones are replaced. Yields like :meth:`answer`."""
        turn_id = event_value(evt, "regenerate") or ""  # "" is refused like any other unknown turn
        yield from self._again(session_id, turn_id, None, _options(temperature, max_tokens, history), request)

    def edit(self, session_id, temperature, max_tokens, history, evt: gr.EditData, request: gr.Request):
        """A question edited in the chat: asked again from there (later turns are replaced).
        Yields like :meth:`answer`."""
        options = _options(temperature, max_tokens, history)
        owner = owner_of(request)
        value = getattr(evt, "value", None)
        session = self.chat.session(session_id, owner)
        try:
            turn_id = turn_at(self.chat.turns(session.id) if session else [], getattr(evt, "index", None),
                              getattr(evt, "previous_value", None))
        except ChatError as exc:
            yield from self._refused(session_id, owner, exc)
            return
        yield from self._again(session_id, turn_id, value if isinstance(value, str) else "", options, request)

    def _again(self, session_id, turn_id, question: str | None, options: ChatOptions, request: gr.Request):
        """Regenerate (``question`` None) or edit turn ``turn_id`` (None: the last turn)."""
        owner = owner_of(request)
        try:
            if question is None:
                active = self.chat.regenerate(session_id, owner, options, turn_id=turn_id)
            else:
                active = self.chat.edit(session_id, owner, turn_id, question, options)
        except ChatError as exc:
            yield from self._refused(session_id, owner, exc)
            return
        later = active.replaced - 1
        removed = ("the question after it and its answer" if later == 1
                   else f"the {later} questions after it and their answers")
        notice = _notice(f"Asked again from there: {removed} were removed.", "info") if later > 0 else ""
        yield from self._stream(active, clear_question=False, notice=notice)

    def _refused(self, session_id, owner: str, exc: ChatError):
        """The chat as stored (the browser may show an edit that was refused) and why."""
        sid = session_id if self.chat.session(session_id, owner) else None
        yield session_id, chat_messages(self.chat.turns(sid)), _notice(str(exc), "info"), gr.skip(), *_IDLE

    def _stream(self, active, clear_question: bool, notice: str = ""):
        """The chat so far plus the answer being generated, once per text delta."""
        earlier = [v for v in self.chat.turns(active.session.id) if v.turn_id != active.turn.id]
        first = True
        for view in active:
            if view.status != "streaming" and self.chat.store.get_turn(active.turn.id) is None:
                # edited or regenerated while it streamed: the answer that replaced it owns the chat
                yield active.session.id, *(gr.skip() for _ in range(5))
                continue
            question = "" if (first and clear_question) else gr.skip()
            buttons = _IDLE if view.status != "streaming" else _BUSY if first else (gr.skip(), gr.skip())
            yield active.session.id, chat_messages([*earlier, view]), notice if first else gr.skip(), question, *buttons
            first = False

    def stop(self, session_id: str | None, request: gr.Request):
        self.chat.stop(session_id, owner_of(request))

    def after_answer(self, session_id: str | None, request: gr.Request):
        """Refresh the panels once an answer is finished: (sessions, title, plot, pages, engine,
        Send, Stop); Send is back whatever ended the answer, unless another answer of the chat
        is streaming."""
        owner = owner_of(request)
        out = self.session_outputs(session_id, owner)
        # another answer of this chat may have started meanwhile (an edit stops this one): Stop stays
        buttons = (gr.skip(), gr.skip()) if self.chat.answering(session_id) else _IDLE
        return out[1], out[2], out[5], out[6], render.engine_panel(self.loader.status()), *buttons

    def tick(self):
        """Periodic refresh: banner and engine panel."""
        status = self.loader.status()
        return render.banner(status), render.engine_panel(status)

    # ------------------------------------------------------------------ sharing
    def open_share(self, session_id: str | None, request: gr.Request):
        owner = owner_of(request)
        if self.chat.session(session_id, owner) is None:
            note = '<div class="prism-panel-note">Start a chat (add an image or ask a question) to share it.</div>'
            return gr.update(visible=True), note, ""
        return gr.update(visible=True), render.shares_list(self.chat.store.list_shares(session_id, owner)), ""

    def create_share(self, session_id: str | None, mode: str, name, request: gr.Request):
        """Create a link named ``name`` (optional; refused with a notice when not text, too long or
        holding control characters). Returns (share list, notice, name box)."""
        owner = owner_of(request)
        if self.chat.session(session_id, owner) is None:
            return render.shares_list([]), _notice("There is no chat to share yet.", "info"), gr.skip()
        mode = "continue" if mode == "continue" else "read"
        try:
            token, _ = self.chat.store.create_share(session_id, owner, mode, "" if name is None else name)
        except ValueError as exc:
            shares = self.chat.store.list_shares(session_id, owner)
            return render.shares_list(shares), _notice(f"Not created: {exc}.", "error"), gr.skip()
        shares = self.chat.store.list_shares(session_id, owner)
        return render.shares_list(shares, new_link=f"/s/{token}", new_mode=mode), "", ""

    def revoke_share(self, session_id: str | None, evt: gr.EventData, request: gr.Request):
        owner = owner_of(request)
        share_id = event_value(evt, "revoke")
        if share_id and self.chat.session(session_id, owner) is not None:
            try:
                self.chat.revoke_share(session_id, owner, share_id)
            except Exception as exc:  # not ours / gone
                log.info("revoke refused: %s", exc)
        shares = self.chat.store.list_shares(session_id, owner) if self.chat.session(session_id, owner) else []
        return render.shares_list(shares)

    # ------------------------------------------------------------------ the Blocks
    def build(self) -> gr.Blocks:
        """The page: components first (see the ``_*_components`` methods), then their events."""
        with gr.Blocks(title="Prism", fill_width=True, analytics_enabled=False, delete_cache=(3600, 3600)) as demo:
            c = types.SimpleNamespace(session=gr.State(None))
            self._sidebar_components(c)
            with gr.Row(equal_height=False, elem_id="prism-page"):
                with gr.Column(scale=3, min_width=480, elem_id="prism-main"):
                    self._chat_components(c)
                with gr.Column(scale=1, min_width=300, elem_id="prism-panels"):
                    self._panel_components(c)
            self._share_components(c)
            c.timer = gr.Timer(3.0)
            self._wire(demo, c)
        return demo

    @staticmethod
    def _sidebar_components(c) -> None:
        with gr.Sidebar(position="left", width=290, open=True, elem_id="prism-sidebar"):
            gr.HTML('<div class="prism-logo">Prism<span>visual chat</span></div>')
            c.new = gr.Button("+ New chat", variant="primary", elem_id="prism-new")
            c.sessions = gr.HTML(render.sessions_list([], None), elem_id="prism-sessions",
                                 js_on_load=_CLICK_JS % {"attr": "session", "key": "session"})

    @staticmethod
    def _chat_components(c) -> None:
        with gr.Row(elem_id="prism-titlebar"):
            c.title = gr.Textbox(label="Chat title", show_label=False, placeholder="New chat", scale=6,
                                 elem_id="prism-title", container=False, max_length=200)
            # in the title bar, whose height it never changes: shown after the page loads, it pushed
            # the whole page down (a one-line chip; its details open over the page)
            c.banner = gr.HTML("", elem_id="prism-banner")
            c.share = gr.Button("Share", scale=0, min_width=90, elem_id="prism-share-btn")
            c.delete = gr.Button("Delete", scale=0, min_width=90, variant="stop", elem_id="prism-delete")
            c.delete_ok = gr.Checkbox(False, visible=False, elem_id="prism-delete-ok")
        with gr.Row(elem_id="prism-media"):  # the images, then the drop zone as the strip's last tile
            c.images = gr.HTML(render.images_strip([]), elem_id="prism-images",
                               js_on_load=_CLICK_JS % {"attr": "remove", "key": "remove"})
            c.upload = gr.File(file_count="multiple", file_types=["image", ".mp4", ".webm"], type="filepath",
                               height=76, show_label=False, label="Add images or clips", elem_id="prism-upload")
        c.notice = gr.HTML("", elem_id="prism-notice")
        c.chat = gr.Chatbot(elem_id="prism-chat", height=440, show_label=False, buttons=[], editable="user",
                            placeholder="Ask anything about your images. Answers stream here, each with its "
                                        "cache and latency telemetry.",
                            feedback_options=None, layout="bubble", group_consecutive_messages=False)
        c.actions = gr.HTML("", elem_id="prism-chat-actions", js_on_load=_ACTIONS_JS)
        with gr.Row(elem_id="prism-inputrow"):
            c.question = gr.Textbox(label="Question", show_label=False,
                                    placeholder="Ask about the images… (Enter to send)", scale=8,
                                    lines=1, max_lines=6, elem_id="prism-question", container=False, autofocus=True)
            button = {"size": "md", "scale": 0}
            c.send = gr.Button("Send", variant="primary", min_width=70, elem_id="prism-send", **button)
            c.stop = gr.Button("Stop", variant="stop", min_width=70, elem_id="prism-stop", visible=False, **button)
            c.regen = gr.Button("↻ Regenerate", min_width=132, elem_id="prism-regenerate", **button)

    @staticmethod
    def _panel_components(c) -> None:
        with gr.Tabs():
            with gr.Tab("Session", elem_id="prism-tab-session"):
                c.plot = gr.HTML(render.ttft_chart([]), elem_id="prism-ttft-plot")
                c.pages = gr.HTML(render.pages_panel(None), elem_id="prism-pages")
            with gr.Tab("Engine", elem_id="prism-tab-engine"):
                c.engine = gr.HTML("", elem_id="prism-engine")
            with gr.Tab("Settings", elem_id="prism-tab-settings"):
                c.temperature = gr.Slider(0.0, 1.5, value=0.7, step=0.05, label="Temperature",
                                          info="0 = always the most likely token", elem_id="prism-temperature")
                c.max_tokens = gr.Slider(16, 2048, value=DEFAULT_MAX_TOKENS, step=16, label="Max tokens per answer",
                                         elem_id="prism-max-tokens")
                c.history = gr.Checkbox(
                    False, label="Each question sees the conversation", elem_id="prism-history",
                    info="Off: every question is asked against the images alone (the layout the compact prefix "
                         "is built for). On: multi-turn chat with history, reusing the previous turn's KV.")

    @staticmethod
    def _share_components(c) -> None:
        with gr.Group(visible=False, elem_id="prism-share-dialog", elem_classes=["prism-dialog"]) as c.dialog:
            gr.HTML('<div class="prism-dialog-title">Share this chat</div><div class="prism-panel-note">Anyone '
                    "with a link sees the images, questions, answers and telemetry, never your other chats. "
                    "“Can continue” gives them their own copy to ask more.</div>")
            c.share_mode = gr.Radio([("Read-only", "read"), ("Can continue", "continue")], value="read",
                                    show_label=False, elem_id="prism-share-mode")
            c.share_name = gr.Textbox(label="Link name (optional, only you see it)", max_lines=1,
                                      max_length=MAX_SHARE_NAME_LENGTH, elem_id="prism-share-name",
                                      placeholder="e.g. for Alice")
            with gr.Row():
                c.create_share = gr.Button("Create link", variant="primary", elem_id="prism-create-share")
                c.close_share = gr.Button("Close", elem_id="prism-close-share")
            c.shares = gr.HTML(render.shares_list([]), elem_id="prism-shares", js_on_load=_SHARES_JS)

    def _wire(self, demo: gr.Blocks, c) -> None:
        """Connect the events. Chat answers get their own, high concurrency limit; quick clicks and
        refreshes run beside them, so one long answer never blocks anyone else's clicks."""
        view = [c.session, c.sessions, c.title, c.images, c.chat, c.plot, c.pages]
        quiet = {"show_progress": "hidden"}
        demo.load(self.on_load, None, [*view, c.banner, c.engine, c.max_tokens], **quiet)
        c.timer.tick(self.tick, None, [c.banner, c.engine], **quiet)
        c.sessions.click(self.open_session, None, view, **quiet)
        c.new.click(self.new_session, None, [*view, c.notice], **quiet)
        for event in (c.title.submit, c.title.blur):
            event(self.rename, [c.session, c.title], [c.sessions, c.title], **quiet)
        c.delete.click(self.delete, [c.session, c.delete_ok], [*view, c.notice], **quiet,
                       js="(sid, ok) => [sid, confirm('Delete this chat, its images and its share links?')]")
        # preprocess=False: the handler gets the uploads' FileData as sent (after app.gradio_guard checked
        # them); gr.File's own preprocess left an empty temporary file behind per upload, and refused
        # a file by its name's extension before our handler could explain it and delete it.
        c.upload.upload(self.add_images, [c.session, c.upload], [*view, c.notice, c.upload], show_progress="minimal",
                        preprocess=False)
        c.images.click(self.remove_image, [c.session], view, **quiet)

        streaming = {"concurrency_limit": CHAT_CONCURRENCY, "concurrency_id": "chat", "show_progress": "hidden"}
        after = {"fn": self.after_answer, "inputs": [c.session],
                 "outputs": [c.sessions, c.title, c.plot, c.pages, c.engine, c.send, c.stop], **quiet}
        settings = [c.temperature, c.max_tokens, c.history]
        answer_out = [c.session, c.chat, c.notice, c.question, c.send, c.stop]
        for event in (c.send.click, c.question.submit):
            event(self.answer, [c.session, c.question, *settings], answer_out, **streaming).then(**after)
        c.regen.click(self.regenerate, [c.session, *settings], answer_out, **streaming).then(**after)
        c.actions.click(self.regenerate_turn, [c.session, *settings], answer_out, **streaming).then(**after)
        c.chat.edit(self.edit, [c.session, *settings], answer_out, **streaming).then(**after)
        c.stop.click(self.stop, [c.session], None, queue=False, **quiet)

        c.share.click(self.open_share, [c.session], [c.dialog, c.shares, c.notice], **quiet)
        c.close_share.click(lambda: gr.update(visible=False), None, c.dialog, queue=False, **quiet)
        c.create_share.click(self.create_share, [c.session, c.share_mode, c.share_name],
                             [c.shares, c.notice, c.share_name], **quiet)
        c.shares.click(self.revoke_share, [c.session], c.shares, **quiet)


def _discard_upload(path: str) -> None:
    """Delete Gradio's copy of an upload (only inside Gradio's upload folder): the store keeps its
    own copy of the good ones, and the bad ones must not linger."""
    UploadFolder.of_gradio().discard(path)


def _options(temperature, max_tokens, history) -> ChatOptions:
    """The settings panel's values as ChatOptions (top-p 0.8 when sampling, as Qwen suggests)."""
    temperature = float(temperature)
    return ChatOptions(temperature=temperature, max_tokens=int(max_tokens), history=bool(history),
                       top_p=0.8 if temperature > 0 else 1.0)


def _path_of(file) -> str:
    """A Gradio upload's path: a FileData dict (the event is not preprocessed), or a path string;
    empty when there is none."""
    value = file.get("path") if isinstance(file, dict) else getattr(file, "path", None) or file
    return value if isinstance(value, str) else ""


def _name_of(file) -> str:
    """The uploader's file name (FileData's ``orig_name``), else the upload's own file name."""
    name = file.get("orig_name") if isinstance(file, dict) else None
    return name if isinstance(name, str) and name else os.path.basename(_path_of(file))


def _notice(message: str, kind: str = "info") -> str:
    from html import escape

    return f'<div class="prism-notice prism-notice-{kind}" role="status">{escape(message)}</div>'


def theme() -> gr.themes.Base:
    """System fonts only: Gradio's default themes fetch web fonts from an external service.

    A primary button under the mouse turns darker: Soft's lighter hover shade made "+ New chat"
    and Send look disabled right after a click (the pointer is still on them)."""
    return gr.themes.Soft(
        primary_hue="indigo", neutral_hue="slate",
        font=["system-ui", "-apple-system", "Segoe UI", "Roboto", "Helvetica Neue", "Arial", "sans-serif"],
        font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "Liberation Mono", "monospace"],
    ).set(button_primary_background_fill_hover="*primary_600", button_primary_background_fill_hover_dark="*primary_700")
