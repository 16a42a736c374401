"""HTML fragments of the page and the share view. Every user-supplied string is escaped here.

Images are always referenced by hash through our own routes, never by a file path:
``/images/<sha256>`` on the owner's page (the owner cookie authorises it), and
``/s/<token>/images/<sha256>`` on a share page (the share token does).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from html import escape
from urllib.parse import quote

from .chat import TurnView

STATIC_VERSION = "10"  # bump to make browsers refetch static/prism.css and prism.js

#: A text-only chat's thumbnail: a speech bubble drawn inline (an emoji needs an emoji font, which
#: many machines lack, and then shows as an empty box).
_CHAT_ICON = ('<svg viewBox="0 0 24 24" width="22" height="22" aria-hidden="true" fill="none" '
              'stroke="currentColor" stroke-width="1.8" stroke-linejoin="round">'
              '<path d="M4 5h16v11H9l-5 4z"/></svg>')
#: A chat of video clips only: a play triangle in a frame, drawn inline like the speech bubble.
_CLIP_ICON = ('<svg viewBox="0 0 24 24" width="22" height="22" aria-hidden="true" fill="none" '
              'stroke="currentColor" stroke-width="1.8" stroke-linejoin="round">'
              '<rect x="3" y="5" width="18" height="14" rx="2"/><path d="M10 9v6l5-3z"/></svg>')
#: The image cards' "open" button: four arrows out to the corners (the whole image, uncropped).
_OPEN_ICON = ('<svg viewBox="0 0 24 24" width="14" height="14" aria-hidden="true" fill="none" '
              'stroke="currentColor" stroke-width="2.2" stroke-linecap="round" stroke-linejoin="round">'
              '<path d="M14 4h6v6M10 20H4v-6M20 4l-7 7M4 20l7-7"/></svg>')


def _e(text) -> str:
    return escape(str(text if text is not None else ""), quote=True)


def image_url(sha: str) -> str:
    """An image's URL on its owner's page."""
    return f"/images/{sha}"


def shared_image_url(token: str, sha: str) -> str:
    """An image's URL on the share page of ``token``: served while that share is live."""
    return f"/s/{quote(token, safe='')}/images/{sha}"


def prefix_url(session_id: str) -> str:
    """Where the owner's image viewer asks what the session's compact prefix kept."""
    return f"/sessions/{quote(session_id, safe='')}/prefix"


def shared_prefix_url(token: str) -> str:
    """The same on the share page of ``token``."""
    return f"/s/{quote(token, safe='')}/prefix"


def created_label(timestamp: float) -> str:
    """A creation time (seconds since the epoch) as ``"2026-12-01 23:31:05 UTC"``."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(timestamp))


def ago(timestamp: float | None, now: float | None = None) -> str:
    """``"just now"``, ``"5 min ago"``, ``"3 h ago"``, ``"2 days ago"``."""
    if not timestamp:
        return ""
    seconds = max(0.0, (now or time.time()) - timestamp)
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h ago"
    days = int(seconds // 86400)
    return f"{days} day{'s' if days != 1 else ''} ago"


# ---------------------------------------------------------------------------------- telemetry
def chip_kind(view: TurnView) -> str:
    """CSS flavour of a telemetry chip: hit, miss, stale, off, error, streaming."""
    if view.status in ("error", "streaming"):
        return view.status
    return view.prefix or "off"


def telemetry_chip(view: TurnView) -> str:
    """The telemetry line beside an answer, as a styled chip (``<div class="prism-tel ...">``);
    its ``prism-turn-<id>`` class names its turn for the page's Regenerate button (a class, not a
    ``data-`` attribute: the chat's HTML sanitizer drops those)."""
    kind = chip_kind(view)
    icon = {"error": "⚠ ", "streaming": ""}.get(kind, "")
    text = view.line or ("error" if kind == "error" else "")
    return (f'<div class="prism-tel prism-tel-{_e(kind)} prism-turn-{int(view.turn_id)}" data-prefix="{_e(kind)}">'
            f"{icon}{_e(text)}</div>")


def assistant_markdown(view: TurnView) -> str:
    """An answer for the chat: its markdown, then the telemetry chip."""
    answer = view.answer
    if not answer and view.status == "streaming":
        answer = "…"
    return f"{answer}\n\n{telemetry_chip(view)}"


# ---------------------------------------------------------------------------------- banner
def banner(status: dict) -> str:
    """Notice at the top of the page: loading, failed, or demo model; empty when all is well."""
    state = status.get("status")
    if state == "loading":
        return _banner("info", "Loading the model…", f"{_e(status.get('stage', ''))}. Progress is shown in the "
                       "terminal; you can already upload images.")
    if state == "error":
        return _banner("error", "Model not available", _e(status.get("error", "")), open_=True)
    if status.get("demo_model"):
        return _banner("warn", "Demo model: random answers", "<b>Demo mode:</b> this is a tiny model with "
                       "random weights, so its answers are random text. Everything else (sessions, the prefix "
                       "cache, telemetry, sharing) is real. For real answers start Prism with the real weights: "
                       "<code>python launch.py --model Qwen/Qwen3-VL-2B-Instruct</code> on a machine with network "
                       "access (downloads about 4 GB once), or <code>--model /path/to/checkpoint</code>.")
    return ""


def _banner(kind: str, label: str, details_html: str, open_: bool = False) -> str:
    """A one-line chip for the title bar (its height never changes the page's layout); the
    details (already escaped HTML) open below it, over the page."""
    return (f'<details class="prism-banner prism-banner-{kind}"{" open" if open_ else ""}><summary>{_e(label)}'
            f'</summary><div class="prism-banner-more" role="note">{details_html}</div></details>')


# ---------------------------------------------------------------------------------- sessions
def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def sessions_list(sessions, active_id: str | None) -> str:
    """The sidebar list: thumbnail, title and age of each session, newest first."""
    if not sessions:
        return '<div class="prism-empty">No chats yet. Add images or ask a question to start one.</div>'
    items = []
    for s in sessions:
        clips = getattr(s, "video_shas", frozenset())
        photos = [sha for sha in s.image_shas if sha not in clips]
        thumb = (f'<img src="{_e(image_url(photos[0]))}" alt="" loading="lazy">' if photos
                 else f'<span class="prism-thumb-empty">{_CLIP_ICON if clips else _CHAT_ICON}</span>')
        meta = f"{_count(len(photos), 'image')} · {ago(s.updated_at)}"
        if clips:
            meta = (f"{_count(len(photos), 'image')}, " if photos else "") + f"{_count(len(clips), 'clip')} · " \
                + ago(s.updated_at)
        active = " prism-session-active" if s.id == active_id else ""
        items.append(
            f'<button type="button" class="prism-session{active}" data-session="{_e(s.id)}" title="{_e(s.title)}">'
            f'<span class="prism-session-thumb">{thumb}</span>'
            f'<span class="prism-session-text"><span class="prism-session-title">{_e(s.title)}</span>'
            f'<span class="prism-session-meta">{_e(meta)}</span></span></button>'
        )
    return '<nav class="prism-sessions">' + "".join(items) + "</nav>"


def _remove_button(r, label: str, editable: bool) -> str:
    return (f'<button type="button" class="prism-remove" data-remove="{_e(r.sha256)}" '
            f'title="Remove {label}" aria-label="Remove {label}">×</button>') if editable else ""


def image_card(r, n: int, editable: bool, url: Callable[[str], str]) -> str:
    """One image's card: the photo (cropped), its number and size, an "open" button and, when
    editable, a remove button."""
    remove = _remove_button(r, f"image {n}", editable)
    name = r.filename or f"image {n}"
    size = f"{int(r.width)}×{int(r.height)}"
    # the open and remove buttons sit in the caption, beside the name: over the photo they hid part of it
    return (
        f'<figure class="prism-image" data-number="{n}" data-sha="{_e(r.sha256)}">'
        f'<img src="{_e(url(r.sha256))}" alt="{_e(name)}" loading="lazy">'
        f'<figcaption><span class="prism-image-label" title="Image {n} · {size}"><b>Image {n}</b> · {size}</span>'
        f'<span class="prism-image-row"><span class="prism-image-name" title="{_e(name)}">{_e(name)}</span>'
        f'<button type="button" class="prism-open" data-open-image="{n}" title="Open image {n}: the whole '
        f'image and what the model keeps of it" aria-label="Open image {n}">{_OPEN_ICON}</button>{remove}'
        f"</span></figcaption></figure>"
    )


def duration_text(seconds: float | None) -> str:
    """A clip's length as ``m:ss`` (``0:08``), or ``h:mm:ss`` from an hour; ``?`` when unknown."""
    if seconds is None:
        return "?"
    total = int(round(float(seconds)))
    h, rest = divmod(total, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def video_card(r, n: int, editable: bool, url: Callable[[str], str]) -> str:
    """One video clip's card: its poster frame (a JPEG the store made at upload, inline), a play
    button with its duration (the clip, loaded only then, plays large in the page's viewer: the
    browser's own controls did not fit the card), and when editable a remove button."""
    import base64

    remove = _remove_button(r, f"video {n}", editable)
    name = r.filename or f"video {n}"
    length = duration_text(r.duration_s)
    poster = f"data:image/jpeg;base64,{base64.b64encode(r.poster).decode()}" if r.poster else ""
    return (
        f'<figure class="prism-image prism-video" data-video-number="{n}" data-sha="{_e(r.sha256)}">'
        f'<video src="{_e(url(r.sha256))}" poster="{_e(poster)}" preload="none" muted playsinline '
        f'aria-label="{_e(name)}"></video>'
        f'<button type="button" class="prism-duration prism-play" data-play-video="{n}" '
        f'title="Play video {n} ({length})" aria-label="Play video {n}, {length}">▶ {length}</button>'
        f'<figcaption><span class="prism-image-label" title="Video {n} · {length} · {int(r.width)}×{int(r.height)}">'
        f"<b>Video {n}</b> · {length}</span>"
        f'<span class="prism-image-row"><span class="prism-image-name" title="{_e(name)}">{_e(name)}</span>{remove}'
        f"</span></figcaption></figure>"
    )


def images_strip(records, *, editable: bool = True, url: Callable[[str], str] = image_url,
                 prefix: str | None = None) -> str:
    """The session's images and video clips in prompt order: each image with its number, an "open"
    button (prism.js shows the whole image, and with ``prefix``, the URL of :func:`prefix_url` or
    :func:`shared_prefix_url`, what the model keeps of it), each clip as :func:`video_card`; when
    editable, a remove button; ``url`` maps a file's hash to its URL."""
    if not records:
        return ('<div class="prism-images prism-images-empty">No images yet: drop, paste or choose some '
                "below (short MP4 or WebM clips too). Without images, questions are a plain text chat.</div>")
    figures, counts = [], {"image": 0, "video": 0}
    for r in records:
        kind = "video" if getattr(r, "kind", "image") == "video" else "image"
        counts[kind] += 1
        figures.append((video_card if kind == "video" else image_card)(r, counts[kind], editable, url))
    viewer = f' data-prefix-url="{_e(prefix)}"' if prefix else ""
    return f'<div class="prism-images"{viewer}>' + "".join(figures) + "</div>"


# ---------------------------------------------------------------------------------- panels
def _bar(parts: list[tuple[str, float, str]]) -> str:
    total = sum(v for _, v, _ in parts) or 1
    segs = "".join(f'<span class="prism-bar-{cls}" style="width:{100 * v / total:.2f}%" title="{_e(label)}"></span>'
                   for label, v, cls in parts if v > 0)
    return f'<div class="prism-bar">{segs}</div>'


PREFIX_COLOURS = {"hit": "#16a34a", "miss": "#2563eb", "stale": "#d97706", "off": "#64748b"}
#: The mark above a bar whose question attached a prefix a warm built (telemetry ``warmed``).
WARMED_MARK = "#f59e0b"


def ttft_chart(rows: list[dict], *, width: int = 300, height: int = 170) -> str:
    """An inline SVG bar chart of TTFT per question, each bar coloured by its prefix state; a
    question whose prefix a warm built (the first after an upload or a start) has a diamond above
    its bar, and "warmed" in its tooltip and the legend.

    ``rows``: ``{"turn": n, "ttft_ms": float, "prefix": "hit"|"miss"|"stale"|"off", "warmed":
    bool}`` (``warmed`` may be absent: False; the session panel shows the last 24).
    """
    title = '<div class="prism-kv-title">Time to first token per question</div>'
    if not rows:
        return title + '<div class="prism-panel-note">Bars appear here as questions are answered.</div>'
    rows = rows[-24:]
    labelled = len(rows) <= 12
    # a warmed bar's diamond sits above its value label: the top margin leaves room for it at the peak
    left, bottom, top = 6, 18, 16 + (10 if any(r.get("warmed") for r in rows) else 0)
    plot_h = height - bottom - top
    peak = max(r["ttft_ms"] for r in rows) or 1.0
    step = (width - left) / len(rows)
    bar_w = max(4.0, min(36.0, step * 0.7))
    parts = [f'<line x1="{left}" y1="{top + plot_h}" x2="{width}" y2="{top + plot_h}" class="prism-axis"/>']
    for i, r in enumerate(rows):
        h = max(1.5, plot_h * r["ttft_ms"] / peak)
        x, y = left + i * step + (step - bar_w) / 2, top + plot_h - h
        mid = x + bar_w / 2
        colour = PREFIX_COLOURS.get(r["prefix"], PREFIX_COLOURS["off"])
        warmed = bool(r.get("warmed"))
        label = (f"Q{int(r['turn'])}: {r['prefix'].upper()}{' (warmed)' if warmed else ''} · "
                 f"TTFT {r['ttft_ms']:,.0f} ms")
        parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w:.1f}" height="{h:.1f}" rx="2" fill="{colour}">'
                     f"<title>{_e(label)}</title></rect>")
        if warmed:  # above the value label (when shown)
            cy, d = y - (14 if labelled else 6), 3.5
            parts.append(f'<path class="prism-chart-warmed" d="M{mid:.1f} {cy - d:.1f} L{mid + d:.1f} {cy:.1f} '
                         f'L{mid:.1f} {cy + d:.1f} L{mid - d:.1f} {cy:.1f} Z" fill="{WARMED_MARK}">'
                         f"<title>{_e(label)}</title></path>")
        if labelled:
            value, name = f"{r['ttft_ms']:,.0f}", f"Q{int(r['turn'])}"
            parts.append(f'<text x="{mid:.1f}" y="{y - 3:.1f}" class="prism-chart-value">{value}</text>')
            parts.append(f'<text x="{mid:.1f}" y="{height - 4}" class="prism-chart-label">{name}</text>')
    present = [k for k in PREFIX_COLOURS if any(r["prefix"] == k for r in rows)]
    legend = "".join(f'<span class="prism-dot" style="background:{PREFIX_COLOURS[k]}"></span>{k}' for k in present)
    if any(r.get("warmed") for r in rows):
        legend += f' <span class="prism-warmed-mark" style="color:{WARMED_MARK}">◆</span>warmed'
    svg = (f'<svg class="prism-chart" viewBox="0 0 {width} {height}" width="100%" role="img" '
           f'aria-label="TTFT per question in milliseconds">{"".join(parts)}</svg>')
    return f'{title}{svg}<div class="prism-legend">{legend} <span class="prism-unit">(TTFT in ms)</span></div>'


def pages_panel(pages: dict | None) -> str:
    """The session's image prefix at its last answer: KV pages compact vs dense. (Under
    ``compaction_mode="on_pressure"`` the cached prefix may be compacted after that answer; the
    title says when the numbers are from, and the next answer or the viewer shows the change.)"""
    if not pages:
        return ('<div class="prism-panel-note">The prefix page use appears after the first answer about '
                "images.</div>")
    compact, dense = pages["compact"], max(pages["dense"], 1)
    kept, total = pages["visual_tokens_kept"], pages["visual_tokens"]
    # a prefix kept dense (the default until KV memory runs short) was labelled "compact" beside
    # an equal "dense" bar and "0% fewer pages", which reads as a compaction that did nothing
    label = "compact" if kept < total else "cached"
    if kept < total:
        note = (f"{100 * (1 - compact / dense):.0f}% fewer pages: keeps {kept:,} of {total:,} visual tokens "
                "(the prefix's text tokens are all kept).")
    else:
        note = f"Not compacted: the prefix is dense, all {total:,} visual tokens kept."
    compact_bar = _bar([("compact", compact, "compact"), ("", dense - compact, "none")])
    return (
        '<div class="prism-pages"><div class="prism-kv-title">Image prefix KV pages (at the last answer)</div>'
        f'<div class="prism-pages-row"><span>{label}</span>{compact_bar}<b>{compact}</b></div>'
        f'<div class="prism-pages-row"><span>dense</span>{_bar([("dense", dense, "dense")])}<b>{dense}</b></div>'
        f'<div class="prism-panel-note">{note}</div></div>'
    )


def _cache_entries(stats: dict) -> str:
    """``2 image prefixes + 3 turns``: what the prefix cache holds (turns are finished answers
    kept for conversation reuse)."""
    entries = int(stats.get("cache_entries", 0))
    if "cache_prefixes" not in stats:
        return f"{entries} entries"
    prefixes = int(stats["cache_prefixes"])
    text = f"{prefixes} image prefix{'es' if prefixes != 1 else ''}"
    turns = entries - prefixes
    return text + (f" + {turns} turn{'s' if turns != 1 else ''} kept for reuse" if turns else "")


def _evictions(stats: dict) -> str:
    """``3 image prefixes · 12 turns kept for reuse``: entries evicted, by kind (an evicted
    image prefix costs the vision encoder and the prefix prefill again, an evicted turn only its
    conversation's recompute)."""
    prefixes, turns = int(stats.get("cache_prefix_evictions", 0)), int(stats.get("cache_extension_evictions", 0))
    return (f"{prefixes:,} image prefix{'es' if prefixes != 1 else ''} · "
            f"{turns:,} turn{'s' if turns != 1 else ''} kept for reuse")


def _pressure(stats: dict) -> str:
    """``2 prefixes · 37 pages freed``: compaction steps made to free KV pages under
    ``compaction_mode="on_pressure"`` (each drops visual tokens of one idle cached prefix instead
    of evicting it)."""
    steps, pages = int(stats.get("cache_pressure_compactions", 0)), int(stats.get("cache_pressure_pages_freed", 0))
    return f"{steps:,} prefix{'es' if steps != 1 else ''} · {pages:,} page{'s' if pages != 1 else ''} freed"


def _bytes(n: int) -> str:
    """``25.0 MiB``: a byte count in binary units (as ``--kv-cache-bytes`` takes them)."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:,.1f} {unit}"


def _plural(n: int, word: str, plural: str | None = None) -> str:
    """``1 page``, ``3 pages``; ``plural`` for a word that is not made plural by an ``s``."""
    return f"{n:,} {word if n == 1 else plural or word + 's'}"


def _host_tier_rows(status: dict) -> list[tuple[str, str]]:
    """The Engine tab's rows of the host-memory tier (idle prefixes' KV offloaded to host RAM,
    restored on a hit): ``off``, or its pages, bytes and entries, then what moved through it
    (offloads GPU -> host, restores host -> GPU, entries dropped from it, hits it served)."""
    tier = status.get("host_cache")
    if not tier:
        return [("Host tier", "off")]
    s = status["engine"]
    held = (f"{tier['pages_used']:,} / {tier['pages_total']:,} pages used · {_bytes(tier['bytes_allocated'])} "
            f"allocated of {_bytes(tier['bytes'])} · {_plural(tier['entries'], 'entry', 'entries')}")
    moves = (f"{_plural(int(s.get('cache_offloads', 0)), 'offload')} · "
             f"{_plural(int(s.get('cache_restores', 0)), 'restore')} · "
             f"{int(s.get('cache_host_evictions', 0)):,} evicted · {_plural(int(s.get('cache_hits_host', 0)), 'hit')}")
    return [("Host tier", held), ("Host tier moves", moves)]


def _replicas_table(status: dict) -> str:
    """Over replicas (``status["replicas"]``, :func:`app.model_loader.replica_entry`): one row each,
    its state, sessions, requests, prefix-cache hits and misses and KV pool use; "" without."""
    replicas = status.get("replicas")
    if not replicas:
        return ""
    rows = []
    for r in replicas:
        if "pages_total" in r:
            used = 100 * r["pages_used"] / (r["pages_total"] or 1)
            detail = (f"{r['running']} running · {r['waiting']} waiting · {r['cache_hits']} hit / "
                      f"{r['cache_misses']} miss · KV {used:.1f}% used")
        else:
            detail = "–"
        state = r["state"] + (f" · {_plural(r.get('sessions', 0), 'session')}" if "sessions" in r else "")
        rows.append(f"<tr><th>{_e(r['id'])}</th><td>{_e(state)}</td><td>{_e(detail)}</td></tr>")
    ready = sum(r["state"] == "ready" for r in replicas)
    return (f'<div class="prism-kv-title">Replicas ({ready} of {len(replicas)} ready; the counters above are '
            f'their sum)</div><table class="prism-replicas">{"".join(rows)}</table>')


def engine_panel(status: dict) -> str:
    """The engine panel: model, device, KV pool use (running / cached / free), cache counters, the
    host-memory tier (``status["host_cache"]``, :func:`app.model_loader.host_cache_status`); over
    replicas, their sum, then a row per replica (:func:`_replicas_table`)."""
    if status.get("status") != "ok" or "engine" not in status:
        return f'<div class="prism-panel-note">Engine: {_e(status.get("stage") or status.get("status"))}</div>'
    s = status["engine"]
    total = s["pages_total"] or 1
    cached = s.get("cache_pages", 0)
    running = max(0, s["pages_used"] - cached)
    free = s["pages_free"]
    lookups = s.get("cache_hits", 0) + s.get("cache_misses", 0) + s.get("cache_stale", 0)
    hit_rate = f"{100 * s.get('cache_hits', 0) / lookups:.0f}%" if lookups else "–"
    rows = [
        ("Model", status.get("model")),
        ("Device", f"{status.get('device')} · {status.get('dtype')}"),
        ("KV cache", f"{s['kv_cache_dtype']} · {total:,} pages × {s['page_size']} tok"),
        ("Requests", f"{s['running']} running · {s['waiting']} waiting"),
        ("Prefix cache", f"{_cache_entries(s)} · hit rate {hit_rate} "
                         f"({s.get('cache_hits', 0)} hit / {s.get('cache_misses', 0)} miss / "
                         f"{s.get('cache_stale', 0)} stale)"),
        ("Evictions", _evictions(s)),
        ("Compacted on pressure", _pressure(s)),
        *_host_tier_rows(status),
        ("Tokens saved", f"{s.get('prompt_tokens_saved', 0):,} prompt tokens"),
    ]
    table = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    legend = (f'<div class="prism-legend"><span class="prism-dot prism-bar-running"></span>running {running:,} '
              f'<span class="prism-dot prism-bar-cached"></span>cached {cached:,} '
              f'<span class="prism-dot prism-bar-free"></span>free {free:,}</div>')
    bar = _bar([("running", running, "running"), ("cached", cached, "cached"), ("free", free, "free")])
    return (f'<div class="prism-engine"><div class="prism-kv-title">KV pool ({100 * (total - free) / total:.1f}% used)'
            f"</div>{bar}{legend}<table>{table}</table>{_replicas_table(status)}</div>")


def shares_list(shares, new_link: str | None = None, new_mode: str | None = None) -> str:
    """The share dialog's body: the link just created (shown once) and the active links."""
    parts = []
    if new_link:
        mode = "read-only" if new_mode == "read" else "can continue"
        parts.append(
            f'<div class="prism-newlink"><div>New {mode} link (shown once: copy it now):</div>'
            f'<div class="prism-copyrow"><input class="prism-link" readonly value="{_e(new_link)}" '
            f'data-path="{_e(new_link)}"><button type="button" class="prism-copy" data-copy-path="{_e(new_link)}">'
            "Copy</button></div></div>"
        )
    if shares:
        # the token is stored only as its SHA-256, so a row names its link by the owner's name,
        # its creation time and its share id (not a credential)
        rows = "".join(
            f'<li>{f"""<span class="prism-share-name">{_e(s.name)}</span>""" if s.name else ""}'
            f'<span class="prism-share-mode">{"read-only" if s.mode == "read" else "can continue"}</span>'
            f'<span class="prism-share-age" title="{_e(ago(s.created_at))}">'
            f'created {_e(created_label(s.created_at))}</span>'
            f'<span class="prism-share-id">id {_e(s.id)}</span>'
            f'<button type="button" class="prism-revoke" data-revoke="{_e(s.id)}" '
            f'aria-label="Revoke {_e(s.name or s.id)}">Revoke</button></li>'
            for s in shares
        )
        parts.append(f'<div class="prism-kv-title">Active links</div><ul class="prism-shares">{rows}</ul>')
    else:
        parts.append('<div class="prism-panel-note">No active links for this chat.</div>')
    return "".join(parts)


# ---------------------------------------------------------------------------------- share view
def _markdown(text: str) -> str:
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"html": False, "breaks": True}).enable("table").render(text or "")


def share_page(session, records, turns: list[TurnView], *, mode: str, token: str, demo: bool = False) -> str:
    """The read-only view of a shared session (a whole HTML document).

    Shows the title, images, questions, answers and telemetry; nothing else (no owner key, no
    other sessions, no file paths). In ``continue`` mode it offers a button that forks the session.
    """
    convo = []
    for view in turns:
        convo.append(
            f'<div class="prism-turn"><div class="prism-q">{_e(view.question)}</div>'
            f'<div class="prism-a">{_markdown(view.answer)}{telemetry_chip(view)}</div></div>'
        )
    body = "".join(convo) or '<div class="prism-empty">No questions yet.</div>'
    action = (
        f'<form method="post" action="/s/{_e(token)}/fork" class="prism-fork"><button type="submit">'
        "Continue this chat</button> <span>You get your own copy with the same images; the original "
        "stays unchanged.</span></form>"
    ) if mode == "continue" else ""
    # at the top too: on a long chat the only button was below its end
    top_action = (f'<form method="post" action="/s/{_e(token)}/fork" class="prism-fork-top"><button type="submit">'
                  "Continue this chat</button></form>") if mode == "continue" else ""
    note = ('<div class="prism-banner prism-banner-warn">Answered by a tiny demo model with random weights: '
            "the answers are random text.</div>") if demo else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="robots" content="noindex">
<title>{_e(session.title)} · Prism (shared)</title>
<link rel="stylesheet" href="/prism-static/prism.css?v={STATIC_VERSION}">
<script src="/prism-static/prism.js?v={STATIC_VERSION}" defer></script>
</head><body class="prism-share-body">
<main class="prism-share">
<header><a class="prism-brand" href="/">Prism</a><span class="prism-share-badge">shared ·
{"read-only" if mode == "read" else "can continue"}</span>{top_action}</header>
<h1>{_e(session.title)}</h1>{note}
{images_strip(records, editable=False, url=lambda sha: shared_image_url(token, sha),
              prefix=shared_prefix_url(token))}
<section class="prism-conversation">{body}</section>
{action}
</main></body></html>"""


def not_found_page() -> str:
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Not found · Prism</title>
<link rel="stylesheet" href="/prism-static/prism.css?v={STATIC_VERSION}"></head>
<body class="prism-share-body"><main class="prism-share"><header><a class="prism-brand" href="/">Prism</a></header>
<h1>Link not found</h1><p>This link does not exist or is no longer shared.</p></main></body></html>"""
