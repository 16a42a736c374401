"""The app over ``--engine process``: the core process killed (``kill -9``) mid-stream.

Every waiting client hears of it (a ``/v1`` stream ends with an ``aborted`` error event, a
non-streaming ``/v1`` call gets 503 ``aborted``, the chat shows a notice and records the turn as an
error), ``/healthz`` says ``restarting`` (503) while the app loads a new core with the same options,
then ``ok`` again; a new question works, and the session store has lost nothing. A core killed
again while it restarts is tried again; ``/healthz`` never says ``ok`` over a dead core; a SIGTERM
stops the server as Ctrl-C does.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import threading

import httpx
import pytest
from conftest import noise_png

from app.chat import ChatOptions, ChatService
from app.model_loader import ModelLoader
from app.server import create_app
from app.settings import parse_settings
from sessions import SessionStore

LONG = 1000  # tokens: far more than are generated before the kill (the tiny model runs to length)


@pytest.fixture()
def app_env(tmp_path, tiny_ckpt, live_server):
    settings = parse_settings(["--model", str(tiny_ckpt), "--device", "cpu", "--engine", "process",
                               "--kv-cache-bytes", "32M", "--data-dir", str(tmp_path)], environ={})
    loader = ModelLoader(settings)
    loader.start()
    store = SessionStore(tmp_path)
    chat = ChatService(store, loader)
    server = live_server(create_app(settings, store, loader, chat, mount_ui=False))
    try:
        assert loader.wait(180), loader.error
        yield loader, store, chat, server.url
    finally:
        loader.close()
        store.close()


def question(text: str, max_tokens: int, stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}


def events(lines) -> list:
    """The SSE ``data:`` payloads of ``lines`` (JSON decoded, ``[DONE]`` as is)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_a_killed_core_is_reported_to_every_client_restarted_and_the_store_keeps_everything(app_env):
    loader, store, chat, url = app_env
    assert loader.settings.engine == "process" and loader.status()["status"] == "ok"
    old = loader.engine
    owner = SessionStore.new_owner_key()
    first = chat.ask(None, owner, "First question?", ChatOptions(max_tokens=4))
    done = list(first)[-1]
    assert done.status == "done" and done.answer
    session = first.session

    http = httpx.Client(base_url=url, timeout=120)
    picture = "data:image/png;base64," + base64.b64encode(noise_png(5)).decode()
    asked = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture}},
                                                       {"type": "text", "text": "What is it?"}]}],
             "max_tokens": 3, "prompt_cache_key": "picture"}
    states = [http.post("/v1/chat/completions", json=asked).json()["prism"]["telemetry"]["prefix_cache"]
              for _ in range(2)]
    assert states == ["miss", "hit"]  # an image over /v1 reaches the core (once), and its prefix is reused
    blocking: dict = {}
    caller = threading.Thread(target=lambda: blocking.update(
        response=http.post("/v1/chat/completions", json=question("Tell me everything.", LONG, False))))
    with http.stream("POST", "/v1/chat/completions", json=question("Count to a thousand.", LONG, True)) as sse:
        lines = sse.iter_lines()
        seen = []
        while not any(isinstance(e, dict) and e["choices"] and e["choices"][0]["delta"].get("content")
                      for e in seen):
            seen += events([next(lines)])
        turn = chat.ask(session.id, owner, "Second question?", ChatOptions(max_tokens=LONG))
        views = iter(turn)
        assert next(views).status == "streaming"
        assert next(views).answer  # a delta arrived: the turn is mid-stream
        caller.start()
        ready = threading.Event()
        while old.stats()["running"] < 3:  # the non-streaming call has reached the engine too
            assert caller.is_alive() and not ready.wait(0.05)
        os.kill(old.pid, signal.SIGKILL)

        rest = events(list(lines))
    # the stream: no finish_reason, an error event with code aborted, then [DONE]
    assert rest[-1] == "[DONE]" and rest[-2]["error"]["code"] == "aborted"
    assert all(e["choices"][0]["finish_reason"] is None for e in seen + rest[:-2] if isinstance(e, dict))
    # the chat: the turn ends as an error with a notice
    final = list(views)[-1]
    assert final.status == "error" and "stopped unexpectedly" in final.line
    caller.join(120)
    assert blocking["response"].status_code == 503
    assert blocking["response"].json()["error"]["code"] == "aborted"
    # restarting while the new core loads
    health = http.get("/healthz")
    assert health.status_code == 503 and health.json()["status"] == "restarting"
    assert loader.engine is None and old.crashed
    refused = http.post("/v1/chat/completions", json=question("Anyone there?", 4, False))
    assert refused.status_code == 503 and "restarting" in refused.json()["error"]["message"]

    assert loader.wait(180), loader.error
    health = http.get("/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["engine_restarts"] == 1
    assert loader.engine.pid != old.pid
    answer = http.post("/v1/chat/completions", json=question("And now?", 4, False))
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length"
    third = list(chat.ask(session.id, owner, "Third question?", ChatOptions(max_tokens=4)))[-1]
    assert third.status == "done" and third.answer

    turns = store.list_turns(session.id)
    assert [t.question for t in turns] == ["First question?", "Second question?", "Third question?"]
    assert turns[0].answer == done.answer and not turns[0].error
    assert turns[1].error and "stopped unexpectedly" in turns[1].error
    assert turns[2].answer == third.answer and not turns[2].error

    new_pid = loader.engine.pid
    loader.close()
    with pytest.raises(ProcessLookupError):  # closing stops the restarted core too
        os.kill(new_pid, 0)
    http.close()


def test_the_engine_option_and_its_variable():
    assert parse_settings([], environ={}).engine == "process"  # the default, measured (docs/PERFORMANCE.md)
    assert parse_settings(["--engine", "in_process"], environ={}).engine == "in_process"
    assert parse_settings([], environ={"PRISM_ENGINE": "in_process"}).engine == "in_process"
    assert parse_settings(["--engine", "process"], environ={"PRISM_ENGINE": "in_process"}).engine == "process"
    for argv, environ in ((["--engine", "thread"], {}), ([], {"PRISM_ENGINE": "elsewhere"})):
        with pytest.raises(SystemExit):
            parse_settings(argv, environ=environ)


class _FakeCore:
    """An engine client whose core is alive or not, for the loader's bookkeeping alone."""

    def __init__(self, alive: bool = True):
        self.alive, self.pid, self.closed = alive, 4242, False
        self.device, self.dtype, self.options = "cpu", "float32", type("O", (), {"kv_cache_dtype": "auto"})()

    def stats(self) -> dict:
        return {"running": 0}

    def close(self) -> None:
        self.closed = True


def _loader_around(core):
    """A ready loader holding ``core`` as its engine client (as after loading one)."""
    from app.model_loader import ModelChoice

    loader = ModelLoader(parse_settings([], environ={}))
    loader.choice, loader.engine = ModelChoice("x", "x", True, "test"), core
    loader.state = loader.stage = "ready"
    return loader


def _restarting_loader(monkeypatch, outcomes):
    """A loader whose core just died, restarting with ``_build`` answering ``outcomes`` in turn
    (an exception is raised, anything else is the new client); no pauses between tries."""
    import app.model_loader as model_loader

    monkeypatch.setattr(model_loader, "RESTART_BACKOFF_S", (0.0, 0.0))
    dead = _FakeCore()
    loader = _loader_around(dead)
    tries = []

    def build(choice):
        tries.append(choice)
        outcome = outcomes[len(tries) - 1]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(loader, "_build", build)
    loader._crashed(dead)
    assert loader._thread is not None
    loader._thread.join(10)
    return loader, tries, dead


def test_a_core_that_dies_again_while_restarting_is_tried_again(monkeypatch):
    from engine.errors import EngineAbortedError

    fresh = _FakeCore()
    loader, tries, dead = _restarting_loader(
        monkeypatch, [EngineAbortedError("killed while loading"), EngineAbortedError("again"), fresh])
    assert dead.closed and len(tries) == 3
    assert (loader.state, loader.engine, loader.restarts) == ("ready", fresh, 1)
    assert loader.status()["status"] == "ok"


def test_a_restart_gives_up_after_its_last_try_or_at_another_error(monkeypatch):
    from engine.errors import CheckpointError, EngineAbortedError

    loader, tries, _ = _restarting_loader(monkeypatch, [EngineAbortedError("x")] * 3)
    assert len(tries) == 3 and loader.state == "failed" and loader.status()["status"] == "error"
    loader, tries, _ = _restarting_loader(monkeypatch, [CheckpointError("the checkpoint is gone"), _FakeCore()])
    assert len(tries) == 1 and loader.state == "failed" and "checkpoint is gone" in loader.error


def test_healthz_says_restarting_as_soon_as_the_core_is_dead():
    """Before the client's reader thread has told the loader (state still ``ready``), a dead core
    already reads as ``restarting``, never ``ok``."""
    core = _FakeCore()
    loader = _loader_around(core)
    assert loader.status()["status"] == "ok"
    core.alive = False
    assert loader.state == "ready" and loader.status()["status"] == "restarting"


def test_sigterm_stops_the_server_cleanly_and_leaves_no_core_behind(tmp_path, tiny_ckpt):
    """What a supervisor's stop (docker, systemd) sends: the database is closed and the core
    process stopped, as after Ctrl-C; the exit status is 0."""
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, str(root / "launch.py"), "--ui", "off", "--engine", "process", "--model", str(tiny_ckpt),
         "--device", "cpu", "--kv-cache-bytes", "32M", "--port", str(port), "--data-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("the server never became ready")
        core = json.loads(httpx.get(f"http://127.0.0.1:{port}/healthz").text)
        assert core["status"] == "ok"
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert children, "no core process"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-2000:]
    assert "stopped; database closed" in out
    def running(pid: str) -> bool:
        try:
            return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
        except OSError:
            return False

    # the core and multiprocessing's resource tracker go with the server (the tracker a moment later)
    deadline = time.monotonic() + 15
    while any(running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(running(pid) for pid in children), children
