/* Prism's small browser helpers: paste images into the upload box, copy buttons, share dialog keys.
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
    if (!images.length) return;
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

  // Escape closes the share dialog.
  document.addEventListener("keydown", function (event) {
    if (event.key !== "Escape") return;
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
