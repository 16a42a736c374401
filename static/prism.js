/* Prism's small browser helpers: paste images into the upload box, copy buttons, share dialog keys,
   the image viewer (the whole image and what the model keeps of it).
   No external resources; works with the Gradio page and the share view. */
(function () {
  "use strict";

  function absolute(path) {
    return window.location.origin + path;
  }

  function copyText(text, button) {
    var done = function () {
      if (!button) return;
      var label = button.textContent;
      button.textContent = "Copied!";
      button.classList.add("prism-copied");
      setTimeout(function () { button.textContent = label; button.classList.remove("prism-copied"); }, 1400);
    };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, function () { fallbackCopy(text); done(); });
    } else {
      fallbackCopy(text);
      done();
    }
  }

  function fallbackCopy(text) {
    var area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    try { document.execCommand("copy"); } catch (e) { /* nothing more to try */ }
    document.body.removeChild(area);
  }

  // Copy buttons: share links (data-copy-path) and code blocks on the share view (data-copy-code).
  document.addEventListener("click", function (event) {
    var link = event.target.closest("[data-copy-path]");
    if (link) {
      event.preventDefault();
      copyText(absolute(link.getAttribute("data-copy-path")), link);
      return;
    }
    var code = event.target.closest("[data-copy-code]");
    if (code) {
      var pre = code.parentElement.querySelector("pre");
      if (pre) copyText(pre.innerText, code);
    }
  });

  // Paste images anywhere on the page: they go to the upload box like dropped files.
  document.addEventListener("paste", function (event) {
    var data = event.clipboardData;
    if (!data || !data.files || !data.files.length) return;
    var images = Array.prototype.filter.call(data.files, function (f) { return f.type.indexOf("image/") === 0; });
    if (!images.length || answering()) return;  // no image changes while an answer streams
    var input = document.querySelector("#prism-upload input[type=file]");
    if (!input) return;
    event.preventDefault();
    var transfer = new DataTransfer();
    images.forEach(function (file, i) {
      var name = file.name && file.name !== "image.png" ? file.name : "pasted-" + Date.now() + "-" + (i + 1) + ".png";
      transfer.items.add(new File([file], name, { type: file.type }));
    });
    input.files = transfer.files;
    input.dispatchEvent(new Event("change", { bubbles: true }));
  });

  // Copy buttons on answers: the answer's text without its telemetry chip (Gradio's own copy button
  // would copy the chip's HTML too).
  function answerText(message) {
    var content = message.querySelector(".message-content") || message;
    var text = content.innerText;
    var chip = content.querySelector(".prism-tel");
    if (chip) {
      var tail = chip.innerText;
      var at = text.lastIndexOf(tail);
      if (at >= 0) text = text.slice(0, at);
    }
    return text.trim();
  }

  // "Regenerate" on every answer, not only the last: asks that answer's question again (the page's
  // bridge, app/ui.py's _ACTIONS_JS, sends the turn id named by the chip's prism-turn-<id> class).
  function regenerate(message) {
    var chip = message.querySelector(".prism-tel");
    var turn = chip && /(?:^|\s)prism-turn-(\d+)(?:\s|$)/.exec(chip.className);
    if (turn && window.prismActions) window.prismActions.regenerate(turn[1]);
  }

  function actionButton(label, className, title, onClick) {
    var button = document.createElement("button");
    button.type = "button";
    button.className = "prism-copy " + className;
    button.textContent = label;
    button.title = title;
    button.addEventListener("click", function (event) {
      event.stopPropagation();
      onClick(button);
    });
    return button;
  }

  function decorateAnswers() {
    document.querySelectorAll("#prism-chat .message.bot").forEach(function (message) {
      if (message.querySelector(".prism-answer-actions")) return;
      if (!message.querySelector(".prism-tel") || message.querySelector(".prism-tel-streaming")) return;
      var bar = document.createElement("div");
      bar.className = "prism-answer-actions";
      bar.appendChild(actionButton("↻ Regenerate", "prism-regenerate-answer",
        "Ask this question again (the questions after it are removed)", function () { regenerate(message); }));
      bar.appendChild(actionButton("Copy", "prism-copy-answer", "Copy this answer",
        function (button) { copyText(answerText(message), button); }));
      message.appendChild(bar);
    });
  }

  var pending = false;
  new MutationObserver(function () {
    if (pending) return;
    pending = true;
    requestAnimationFrame(function () { pending = false; decorateAnswers(); });
  }).observe(document.documentElement, { childList: true, subtree: true });

  // ---------------------------------------------------------------- the image viewer
  // An image card's "open" button (or the photo) shows the whole image: cards crop it to fill.
  // "What the model keeps" lays the merged-token grid the engine reports over it: dropped tokens
  // dimmed, kept ones clear. The grid is fetched afresh each time (the cached prefix may be
  // compacted again, evicted, or built with another selector) and drawn as reported: nothing is
  // computed here.
  var viewer = null;

  function element(tag, className, parent) {
    var el = document.createElement(tag);
    if (className) el.className = className;
    if (parent) parent.appendChild(el);
    return el;
  }

  function buildViewer() {
    var root = element("div", "prism-viewer", document.body);
    root.setAttribute("role", "dialog");
    root.setAttribute("aria-modal", "true");
    root.hidden = true;
    var panel = element("div", "prism-viewer-panel", root);
    var head = element("div", "prism-viewer-head", panel);
    var title = element("div", "prism-viewer-title", head);
    var label = element("label", "prism-viewer-toggle", head);
    var toggle = element("input", "", label);
    toggle.type = "checkbox";
    label.appendChild(document.createTextNode(" what the model keeps"));
    var close = element("button", "prism-copy prism-viewer-close", head);
    close.type = "button";
    close.textContent = "Close";
    var stage = element("div", "prism-viewer-stage", panel);
    var frame = element("div", "prism-viewer-frame", stage);
    var img = element("img", "prism-viewer-img", frame);
    var video = element("video", "prism-viewer-video", stage);
    video.controls = true;
    video.playsInline = true;
    video.hidden = true;
    var grid = element("div", "prism-kept-grid", frame);
    grid.hidden = true;
    var badge = element("div", "prism-preview-badge", frame);
    badge.textContent = "Preview: if memory runs short";
    badge.hidden = true;
    var status = element("div", "prism-viewer-status", panel);
    status.setAttribute("role", "status");
    viewer = { root: root, title: title, toggle: toggle, close: close, img: img, video: video, grid: grid,
               badge: badge, status: status,
               url: null, number: null, sha: null, asked: 0, opener: null };
    img.addEventListener("load", fitImage);
    window.addEventListener("resize", fitImage);
    close.addEventListener("click", closeViewer);
    root.addEventListener("click", function (event) { if (event.target === root) closeViewer(); });
    toggle.addEventListener("change", showKept);
    return viewer;
  }

  function openViewer(card) {
    var v = viewer || buildViewer();
    var strip = card.closest("[data-prefix-url]");
    var thumb = card.querySelector("img");
    var label = card.querySelector(".prism-image-label");
    v.url = strip ? strip.getAttribute("data-prefix-url") : null;
    v.number = Number(card.getAttribute("data-number"));
    v.sha = card.getAttribute("data-sha");
    v.opener = document.activeElement;
    v.title.textContent = (label ? label.innerText : "Image") + (thumb && thumb.alt ? " · " + thumb.alt : "");
    v.root.setAttribute("aria-label", v.title.textContent);
    v.toggle.parentElement.hidden = !v.url;
    v.img.style.width = v.img.style.height = "";
    v.img.alt = thumb ? thumb.alt : "";
    v.img.src = thumb ? thumb.currentSrc || thumb.src : "";
    v.root.hidden = false;
    v.close.focus();
    showKept();
  }

  // As large as the window allows (small photos scaled up, up to 3x), its aspect kept: the
  // element's box is then exactly the image's, the box the grid is laid over.
  function fitImage() {
    var v = viewer, img = v && v.img;
    if (!img || v.root.hidden || !img.naturalWidth) return;
    var panel = v.root.querySelector(".prism-viewer-panel");
    var spare = panel.offsetHeight - img.offsetHeight;  // the head, the status line and padding
    // (the panel has no max-height, so this holds however tall the image was before it was fitted)
    var roomW = window.innerWidth * 0.96 - 28, roomH = window.innerHeight * 0.96 - spare;
    var scale = Math.min(roomW / img.naturalWidth, roomH / img.naturalHeight, 3);
    img.style.width = Math.max(1, Math.floor(img.naturalWidth * scale)) + "px";
    img.style.height = Math.max(1, Math.floor(img.naturalHeight * scale)) + "px";
  }

  // A clip's card: the clip plays large in the viewer, with the browser's controls.
  function openClip(card) {
    var v = viewer || buildViewer();
    var clip = card.querySelector("video");
    var label = card.querySelector(".prism-image-label");
    v.opener = document.activeElement;
    v.title.textContent = (label ? label.innerText : "Video") + (clip ? " · " + clip.getAttribute("aria-label") : "");
    v.root.setAttribute("aria-label", v.title.textContent);
    v.toggle.parentElement.hidden = true;
    v.img.parentElement.hidden = true;
    v.grid.hidden = v.badge.hidden = true;
    v.status.textContent = "";
    v.video.hidden = false;
    v.video.poster = clip ? clip.poster : "";
    v.video.src = clip ? clip.currentSrc || clip.src : "";
    v.root.hidden = false;
    v.close.focus();
    var playing = v.video.play();
    if (playing && playing.catch) playing.catch(function () { /* the controls are there to start it */ });
  }

  function closeViewer() {
    if (!viewer || viewer.root.hidden) return;
    viewer.asked += 1;  // a reply still on its way is dropped
    viewer.root.hidden = true;
    viewer.img.removeAttribute("src");
    viewer.video.pause();
    viewer.video.removeAttribute("src");
    viewer.video.hidden = true;
    viewer.img.parentElement.hidden = false;
    if (viewer.opener && viewer.opener.focus) viewer.opener.focus();
  }

  function showKept() {
    var v = viewer;
    v.grid.hidden = v.badge.hidden = true;
    v.status.textContent = "";
    if (!v.toggle.checked || !v.url) return;
    var asked = ++v.asked;
    v.status.textContent = "Asking the engine what it keeps…";
    fetch(v.url, { cache: "no-store", credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
      .then(function (body) {
        if (asked !== v.asked) return;
        var item = (body.images || []).filter(function (i) { return i.number === v.number; })[0];
        if (!item || item.sha256 !== v.sha) {
          v.status.textContent = "This chat's images have changed: reload the page.";
        } else {
          drawKept(item);
        }
      })
      .catch(function () {
        if (asked === v.asked) v.status.textContent = "Could not ask the server what the model keeps.";
      });
  }

  // A dense prefix (compaction on pressure, while memory lasts) keeps everything: the engine then
  // reports what the first compaction step would keep, marked as a preview (item.preview).
  function drawKept(item) {
    var v = viewer;
    v.status.textContent = item.summary;
    v.grid.textContent = "";
    v.grid.classList.toggle("prism-kept-preview", !!(item.cached && item.preview));
    if (!item.cached) return;
    v.badge.hidden = !item.preview;
    v.grid.style.gridTemplateColumns = "repeat(" + item.cols + ", 1fr)";
    v.grid.style.gridTemplateRows = "repeat(" + item.rows + ", 1fr)";
    var cells = document.createDocumentFragment();
    for (var r = 0; r < item.rows; r++) {
      for (var c = 0; c < item.cols; c++) {
        element("div", item.kept[r][c] ? "prism-kept-cell" : "prism-kept-cell prism-dropped-cell", cells);
      }
    }
    v.grid.appendChild(cells);
    v.grid.hidden = false;
  }

  document.addEventListener("click", function (event) {
    var play = event.target.closest(".prism-play, .prism-video > video");
    var clip = play && play.closest(".prism-video[data-video-number]");
    if (clip) {
      event.preventDefault();
      openClip(clip);
      return;
    }
    var open = event.target.closest(".prism-open, .prism-image > img");
    var card = open && open.closest(".prism-image[data-number]");
    if (!card) return;
    event.preventDefault();
    openViewer(card);
  });

  // Escape closes the image viewer, else the share dialog.
  document.addEventListener("keydown", function (event) {
    if (event.key !== "Escape") return;
    if (viewer && !viewer.root.hidden) {
      closeViewer();
      return;
    }
    var dialog = document.getElementById("prism-share-dialog");
    if (dialog && dialog.offsetParent !== null) {
      var close = document.querySelector("#prism-close-share");
      if (close) close.click();
    }
  });

  // Share view: a copy button on each code block.
  function decorateCode() {
    document.querySelectorAll(".prism-share .prism-a pre").forEach(function (pre) {
      if (pre.parentElement.classList.contains("prism-code")) return;
      var wrap = document.createElement("div");
      wrap.className = "prism-code";
      pre.parentNode.insertBefore(wrap, pre);
      wrap.appendChild(pre);
      var button = document.createElement("button");
      button.type = "button";
      button.className = "prism-copy prism-copy-code";
      button.setAttribute("data-copy-code", "");
      button.textContent = "Copy";
      wrap.appendChild(button);
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", decorateCode);
  else decorateCode();

  // While an answer streams (Stop is showing), the controls that would change the chat do nothing:
  // Regenerate (both kinds), the edit pencils, adding or removing an image, Delete, switching chats,
  // and Enter in the question box. The server refuses the same changes (app.chat.BUSY) for any tab;
  // this only keeps one tab from asking. Capture phase: it runs before Gradio's own handlers.
  var BUSY_GUARDED = "#prism-regenerate, .prism-regenerate-answer, #prism-delete, #prism-upload, " +
    ".prism-remove, #prism-sessions [data-session], #prism-chat button[aria-label*='dit' i], " +
    "#prism-chat button[title*='dit' i]";
  function answering() {
    var stop = document.getElementById("prism-stop");
    var busy = !!(stop && stop.offsetParent !== null);
    document.body.classList.toggle("prism-busy", busy);
    return busy;
  }
  function refuseWhileAnswering(event) {
    if (!event.target.closest || !answering()) return;
    var enter = event.type === "keydown" && event.key === "Enter" && !event.shiftKey &&
      event.target.closest("#prism-question");
    if (enter || (event.type !== "keydown" && event.target.closest(BUSY_GUARDED))) {
      event.preventDefault();
      event.stopImmediatePropagation();
    }
  }
  ["click", "keydown", "drop"].forEach(function (kind) {
    document.addEventListener(kind, refuseWhileAnswering, true);
  });
  // Gradio shows and hides Stop without an event to hook, so the dimmed look follows it on a timer
  // too: after Stop (or an answer's end) the controls must not look disabled until the next click.
  setInterval(answering, 250);

  // Narrow screens (phones): the sidebar starts closed, or it covers the chat. Gradio renders it
  // after this script runs, so look for it for a few seconds, once per page load.
  var NARROW_PX = 768;
  function closeSidebarWhenNarrow(triesLeft) {
    if (window.innerWidth >= NARROW_PX) return;
    var sidebar = document.getElementById("prism-sidebar");
    if (!sidebar) {
      if (triesLeft > 0) setTimeout(function () { closeSidebarWhenNarrow(triesLeft - 1); }, 100);
      return;
    }
    var toggle = sidebar.querySelector(".toggle-button");
    if (sidebar.classList.contains("open") && toggle) toggle.click();
  }
  closeSidebarWhenNarrow(100);
})();
