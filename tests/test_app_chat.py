"""The app's chat flow on the tiny checkpoint: settings, telemetry lines, sessions, images, questions
(streaming, prefix hit/miss, stop, regenerate, history), bad input, and the page's handlers called
directly."""

from __future__ import annotations

import io
import pathlib
import struct
import types
import zlib

import pytest
from PIL import Image

from app.chat import ChatError, ChatOptions, ChatService, build_messages, telemetry_line
from app.model_loader import ModelChoice, ModelLoader, choose_model, looks_tiny
from app.settings import Settings, parse_bytes, parse_settings
from sessions import SessionStore

FAST = ChatOptions(temperature=0.0, max_tokens=6)


# ---------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(kv_cache_bytes=64 << 20)


@pytest.fixture
def store(tmp_path):
    with SessionStore(tmp_path / "data", max_images_per_session=3) as s:
        yield s


@pytest.fixture
def chat(store, engine):
    """The chat without prefix warming: these tests pin the cold path (a session's first question
    is a miss); tests/test_app_warm.py has the warmed one."""
    engine.clear_prefix_cache()
    loader = ModelLoader.ready(engine, ModelChoice("tiny", "tiny", True, "test"))
    return ChatService(store, loader, max_upload_bytes=2 << 20, warming=False)


@pytest.fixture(scope="module")
def pictures(media_path):
    return [media_path("astronaut.png"), media_path("coffee.png")]


OWNER = "o" * 43
STRANGER = "s" * 43


def run(active):
    """Drain an ActiveTurn; return (all views, final view)."""
    views = list(active)
    return views, views[-1]


def png_bytes(size=(8, 8), colour=(200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, "PNG")
    return out.getvalue()


def bomb_png(width=60000, height=60000) -> bytes:
    """A tiny PNG whose header claims a huge image (a decompression bomb)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


# ---------------------------------------------------------------------------------- settings
def test_settings_from_cli_and_environment(tmp_path):
    env = {"PRISM_PORT": "8123", "PRISM_KV_CACHE_BYTES": "256M", "PRISM_COMPACTION": "off",
           "PRISM_DATA_DIR": str(tmp_path)}
    s = parse_settings(["--keep-ratio", "0.5", "--cache-scope", "global"], env)
    assert (s.port, s.kv_cache_bytes, s.compaction, s.keep_ratio, s.cache_scope) == (8123, 256 << 20, "off", 0.5,
                                                                                       "global")
    assert s.data_path == tmp_path
    assert parse_settings(["--port", "9000"], env).port == 9000  # the command line wins
    opts = s.engine_options()
    assert opts["compaction"] is None and opts["kv_cache_bytes"] == 256 << 20 and opts["cache_scope"] == "global"
    assert parse_bytes("2G") == 2 << 30 and parse_bytes("1048576") == 1 << 20
    assert parse_bytes("0") == 0  # --host-cache-bytes 0 turns the host tier off (--kv-cache-bytes refuses it)
    assert "host_cache_bytes" not in opts  # the engine's default share
    assert parse_settings(["--host-cache-bytes", "0"], env).engine_options()["host_cache_bytes"] == 0
    # a 12-megapixel phone photo is resized to about 1 megapixel (~980 visual tokens), not 16.7
    assert opts["max_pixels"] == 1_003_520
    assert parse_settings(["--resize-pixels", "262144"], env).engine_options()["max_pixels"] == 262144
    assert opts["compaction_mode"] == "on_pressure"  # the default (docs/PERFORMANCE.md, "Working set")
    always = parse_settings(["--compaction-mode", "always"], env).engine_options()
    assert always["compaction_mode"] == "always"
    assert parse_settings([], {**env, "PRISM_COMPACTION_MODE": "always"}).compaction_mode == "always"
    assert "tensor_parallel_size" not in opts  # one GPU unless asked
    assert parse_settings(["--tensor-parallel-size", "2"], env).engine_options()["tensor_parallel_size"] == 2
    assert parse_settings([], {"PRISM_TENSOR_PARALLEL_SIZE": "4"}).engine_options()["tensor_parallel_size"] == 4


@pytest.mark.parametrize("argv,env", [(["--compaction", "sometimes"], {}), ([], {"PRISM_CACHE_SCOPE": "world"}),
                                      (["--compaction-mode", "later"], {}),
                                      (["--keep-ratio", "2"], {}), ([], {"PRISM_PORT": "http"}),
                                      (["--tensor-parallel-size", "0"], {}),
                                      (["--host-cache-bytes", "half"], {}), ([], {"PRISM_HOST_CACHE_BYTES": "-1"})])
def test_bad_settings_exit_with_a_message(argv, env, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_settings(argv, env)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        parse_settings(["--help"], {})
    text = capsys.readouterr().out
    for flag in ("--model", "--device", "--host", "--port", "--data-dir", "--kv-cache-bytes", "--host-cache-bytes",
                 "--kv-cache-dtype",
                 "--compaction", "--compaction-mode", "--keep-ratio", "--cache-scope", "--max-image-pixels",
                 "--max-upload-mb", "--resize-pixels"):
        assert flag in text
    assert "PRISM_MAX_UPLOAD_MB" in text


def test_default_model_falls_back_to_the_demo_offline(tmp_path, monkeypatch, tiny_ckpt):
    import app.model_loader as ml

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(ml, "cached_snapshot", lambda model_id: None)
    built = []

    def fake_demo(data_dir):
        built.append(data_dir)
        return tiny_ckpt

    monkeypatch.setattr(ml, "demo_checkpoint", fake_demo)
    choice = choose_model(None, tmp_path)
    assert choice.demo and choice.model_id == ml.DEMO_MODEL_ID and built == [tmp_path]
    assert looks_tiny(tiny_ckpt)
    given = choose_model(str(tiny_ckpt), tmp_path)
    assert given.source == str(tiny_ckpt) and given.demo  # a tiny checkpoint is flagged as random


def test_model_probe_serves_the_committed_probe_checkpoint(tmp_path, monkeypatch):
    """``--model probe`` picks the committed probe model (no network, no demo build), which is
    not flagged as random weights; the engine loads it and it reads a word off a picture."""
    import app.model_loader as ml
    from benchmarks.quality import MODEL_DIR, heldout

    monkeypatch.setattr(ml, "hub_reachable", lambda *a, **k: pytest.fail("no network for --model probe"))
    monkeypatch.setattr(ml, "demo_checkpoint", lambda d: pytest.fail("no demo build for --model probe"))
    choice = choose_model("probe", tmp_path)
    assert pathlib.Path(choice.source) == MODEL_DIR and choice.model_id == ml.PROBE_MODEL_ID and not choice.demo
    from engine import Engine, SamplingParams

    sample = next(s for s in heldout(10) if s.qtype == "word")
    with Engine.from_pretrained(choice.source, device="cpu", compaction=None, progress=False) as engine:
        done = engine.generate(sample.messages(), SamplingParams(max_tokens=4, temperature=0.0))
    assert done.text.strip().lower() == sample.answer


def test_compaction_choices_are_the_engines_selectors():
    """``--compaction`` offers every selector of the engine (and off), and passes it through."""
    from app.settings import _OPTIONS
    from engine.cache.compaction import SELECTORS

    choices = next(o[3] for o in _OPTIONS if o[0] == "--compaction")
    assert set(choices) == {*SELECTORS, "off"}
    assert parse_settings(["--compaction", "attention"], {}).engine_options()["compaction"] == "attention"
    from engine.cache.compaction import COMPACTION_MODES

    assert next(o[3] for o in _OPTIONS if o[0] == "--compaction-mode") == COMPACTION_MODES


def test_hub_probe_is_skipped_offline(monkeypatch):
    import app.model_loader as ml

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert ml.hub_reachable("Qwen/Qwen3-VL-2B-Instruct", timeout=0.1) is False


# ---------------------------------------------------------------------------------- telemetry line
def test_telemetry_line_hit():
    tel = {"prefix_cache": "hit", "ttft_ms": 41.2, "cached_tokens": 1568, "visual_tokens": 1500,
           "visual_tokens_kept": 873, "computed_tokens": 19, "decode_tokens_per_s": 23.4}
    assert telemetry_line(tel) == ("prefix HIT · TTFT 41 ms · reused 1,568 tok (compact 941) · computed 19 tok · "
                                   "23 tok/s")
    assert "reused 1,568 tok (compact 941) ·" in telemetry_line({**tel, "prefix_form": "compact"})


def test_telemetry_line_says_a_hit_came_from_the_host_tier():
    """A hit restored from the host-memory tier names the tier and the copy back (pages, ms); the
    rest of the chip reads as a GPU hit's, which is unchanged (issue 33)."""
    from engine import Telemetry

    hit = Telemetry(prefix_cache="hit", ttft_ms=48.7, cached_tokens=1568, visual_tokens=1500,
                    visual_tokens_kept=1500, prefix_form="dense", computed_tokens=19, decode_tokens_per_s=23.4)
    gpu = telemetry_line(Telemetry(**{**hit.to_dict(), "prefix_tier": "gpu"}).to_dict())
    assert gpu == "prefix HIT · TTFT 49 ms · reused 1,568 tok (dense) · computed 19 tok · 23 tok/s"
    host = Telemetry(**{**hit.to_dict(), "prefix_tier": "host", "restore_ms": 2.64, "restored_pages": 103})
    assert telemetry_line(host.to_dict()) == ("prefix HIT (host · restored 103 pages in 2.6 ms) · TTFT 49 ms · "
                                              "reused 1,568 tok (dense) · computed 19 tok · 23 tok/s")
    one = Telemetry(prefix_cache="hit", prefix_tier="host", restore_ms=0.4, restored_pages=1, ttft_ms=3)
    assert telemetry_line(one.to_dict()).startswith("prefix HIT (host · restored 1 page in 0.4 ms) · TTFT 3 ms")
    # telemetry stored before the tier existed has no prefix_tier: a plain hit
    assert telemetry_line({"prefix_cache": "hit", "ttft_ms": 5}).startswith("prefix HIT · TTFT 5 ms")


def test_telemetry_line_says_dense_or_compact():
    """Under on-pressure compaction the same session's hits are dense first, compact later: the
    chip names the form the prefix had when the question used it."""
    dense = {"prefix_cache": "hit", "ttft_ms": 9, "cached_tokens": 1568, "visual_tokens": 1500,
             "visual_tokens_kept": 1500, "prefix_form": "dense", "computed_tokens": 19}
    assert "· reused 1,568 tok (dense) · computed 19 tok" in telemetry_line(dense)
    compact = {**dense, "visual_tokens_kept": 873, "prefix_form": "compact"}
    assert "· reused 1,568 tok (compact 941) · computed 19 tok" in telemetry_line(compact)


def test_telemetry_line_miss_stale_off():
    miss = telemetry_line({"prefix_cache": "miss", "vision_encoder_ran": True, "ttft_ms": 812, "computed_tokens": 1587,
                           "visual_tokens": 1500, "decode_tokens_per_s": 21})
    assert miss.startswith("prefix MISS (now cached) · vision encoder ran · TTFT 812 ms") and "reused" not in miss
    stale = telemetry_line({"prefix_cache": "stale", "vision_encoder_ran": True, "ttft_ms": 700, "visual_tokens": 9})
    assert stale.startswith("prefix STALE (evicted, recomputed) · vision encoder ran")
    assert telemetry_line({"prefix_cache": "off", "ttft_ms": 30}).startswith("prefix OFF (no images) · TTFT 30 ms")
    assert telemetry_line({"prefix_cache": "hit", "ttft_ms": 5}, "cancelled").endswith("stopped")


def test_messages_are_media_first():
    msgs = build_messages(["a.png", "b.png"], "What?")
    parts = msgs[0]["content"]
    assert [p["type"] for p in parts][:3] == ["text", "image", "text"] and parts[-1]["text"] == "Question: What?"
    assert build_messages([], "Hi", [("Q", "A")]) == [
        {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}, {"role": "user", "content": "Hi"}]


# ---------------------------------------------------------------------------------- chat flow
def test_questions_about_images_miss_then_hit(chat, pictures):
    session, problems = chat.add_images(None, OWNER, [(p.name, p) for p in pictures])
    assert problems == [] and len(session.image_shas) == 2
    views, first = run(chat.ask(session.id, OWNER, "What is in image 1?", FAST))
    assert views[0].status == "streaming" and first.status == "done"
    assert first.prefix == "miss" and first.telemetry["vision_encoder_ran"]
    assert first.line.startswith("prefix MISS (now cached) · vision encoder ran · TTFT")
    # the streamed text (every delta, in order) is the stored answer
    streamed = [v.answer for v in views[:-1]]
    assert len(streamed) > 2 and all(b.startswith(a) for a, b in zip(streamed, streamed[1:], strict=False))
    assert first.answer and streamed[-1] == first.answer
    _, second = run(chat.ask(session.id, OWNER, "And image 2?", FAST))
    assert second.prefix == "hit" and not second.telemetry["vision_encoder_ran"]
    assert second.telemetry["cached_tokens"] > 0 and "reused" in second.line
    # stored with the turn, shown again when the session is reopened; titled by the first question
    turns = chat.turns(session.id)
    assert [t.line for t in turns] == [first.line, second.line]
    assert chat.session(session.id, OWNER).title == "What is in image 1?"
    stats = chat.session_stats(session.id)
    assert [r["prefix"] for r in stats["turns"]] == ["miss", "hit"]
    assert 0 < stats["pages"]["compact"] <= stats["pages"]["dense"]


def test_each_session_asks_under_its_own_cache_salt(chat, engine, pictures, monkeypatch):
    """The engine shares cached prefixes (and vision features) only between requests with the same
    salt, so the chat must send each session's questions under that session's own server-side salt:
    with one salt for everyone, a user asking about the same photo as another would hit the other's
    cached prefix (and could time it). Three sessions (two of one owner, one of a stranger) about the
    same photo: three different salts, each the same for all questions of its session, and every
    session's first question is a MISS."""
    salts = []
    submit = engine.submit

    def recording_submit(messages, sampling=None, *, cache_salt=None):
        salts.append(cache_salt)
        return submit(messages, sampling, cache_salt=cache_salt)

    monkeypatch.setattr(engine, "submit", recording_submit)
    photo = [(pictures[0].name, pictures[0])]
    a, _ = chat.add_images(None, OWNER, photo)
    b, _ = chat.add_images(None, OWNER, photo)
    c, _ = chat.add_images(None, STRANGER, photo)
    prefixes = []
    for session, owner in ((a, OWNER), (b, OWNER), (c, STRANGER), (a, OWNER), (c, STRANGER), (b, OWNER)):
        _, view = run(chat.ask(session.id, owner, "What is in the picture?", FAST))
        assert view.status == "done"
        prefixes.append(view.prefix)
    assert salts == [a.cache_salt, b.cache_salt, c.cache_salt, a.cache_salt, c.cache_salt, b.cache_salt]
    assert len({a.cache_salt, b.cache_salt, c.cache_salt}) == 3 and all(salts)
    assert prefixes == ["miss", "miss", "miss", "hit", "hit", "hit"]


def test_later_questions_do_not_read_the_stored_images_again(chat, store, pictures):
    """The app passes each stored file's digest (the store is content-addressed), so the engine
    takes the processed images by digest instead of reading and hashing every file per question:
    shown by overwriting the stored file after the first question."""
    session, _ = chat.add_images(None, OWNER, [(pictures[1].name, pictures[1])])
    _, first = run(chat.ask(session.id, OWNER, "What is this?", FAST))
    assert first.status == "done"
    path = store.image_path(session.image_shas[0])
    original = path.read_bytes()
    path.chmod(0o600)
    path.write_bytes(b"not an image, and not read")
    try:
        _, second = run(chat.ask(session.id, OWNER, "And now?", FAST))
    finally:
        path.write_bytes(original)
    assert second.status == "done" and second.prefix == "hit"


def test_a_stored_image_damaged_before_its_first_question_is_reported(chat, store):
    """The engine checks the store's digest when it first reads a file: a file that no longer holds
    its bytes is reported as damaged, and the chat goes on once it is whole again."""
    session, _ = chat.add_images(None, OWNER, [("new.png", png_bytes((40, 30), (17, 99, 201)))])
    path = store.image_path(session.image_shas[0])
    original = path.read_bytes()
    path.chmod(0o600)
    path.write_bytes(original[:-1] + b"x")
    try:
        _, view = run(chat.ask(session.id, OWNER, "What is this?", FAST))
    finally:
        path.write_bytes(original)
    assert view.status == "error" and view.line == "An image of this chat is damaged on the server."
    _, again = run(chat.ask(session.id, OWNER, "What is this?", FAST))  # the file is whole again
    assert again.status == "done"


def test_streaming_yields_growing_text(chat):
    views, final = run(chat.ask(None, OWNER, "Say something long", ChatOptions(max_tokens=12)))
    texts = [v.answer for v in views]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    assert final.answer == texts[-1] and final.status == "done"


def test_question_without_images_is_a_text_chat(chat):
    views, final = run(chat.ask(None, OWNER, "Hello there", FAST))
    assert final.status == "done" and final.prefix == "off" and final.line.startswith("prefix OFF (no images)")


def test_empty_question_is_refused_politely(chat):
    with pytest.raises(ChatError, match="type a question"):
        chat.ask(None, OWNER, "   \n ", FAST)
    assert chat.sessions(OWNER) == []  # nothing created


def test_stop_cancels_and_keeps_the_partial_answer(chat, engine):
    active = chat.ask(None, OWNER, "Talk forever", ChatOptions(max_tokens=2000))
    it = iter(active)
    next(it)  # "generating ..."
    next(it)  # the first delta
    assert chat.stop(active.session.id, OWNER)
    final = list(it)[-1]
    assert final.status == "cancelled" and final.finish_reason == "cancelled" and final.line.endswith("stopped")
    assert 0 < final.telemetry["generated_tokens"] < 2000
    assert engine.stats()["running"] == 0
    assert chat.turns(active.session.id)[-1].status == "cancelled"


def test_closing_the_stream_cancels_the_request(chat, engine):
    active = chat.ask(None, OWNER, "Talk forever", ChatOptions(max_tokens=2000))
    it = iter(active)
    next(it)
    next(it)
    it.close()  # the browser went away
    assert engine.stats()["running"] == 0
    assert chat.turns(active.session.id)[-1].finish_reason == "cancelled"


def test_regenerate_reasks_the_last_question(chat, pictures):
    session, _ = chat.add_images(None, OWNER, [(pictures[0].name, pictures[0])])
    run(chat.ask(session.id, OWNER, "First?", FAST))
    run(chat.ask(session.id, OWNER, "Second?", FAST))
    _, again = run(chat.regenerate(session.id, OWNER, ChatOptions(temperature=1.0, max_tokens=6)))
    assert [t.question for t in chat.turns(session.id)] == ["First?", "Second?"]
    assert again.status == "done" and again.prefix == "hit"


def test_history_mode_sends_the_conversation(chat, pictures, engine):
    session, _ = chat.add_images(None, OWNER, [(pictures[1].name, pictures[1])])
    run(chat.ask(session.id, OWNER, "One?", FAST))
    with_history = ChatOptions(max_tokens=6, history=True)
    _, second = run(chat.ask(session.id, OWNER, "Two?", with_history))
    assert second.prefix == "hit"
    _, third = run(chat.ask(session.id, OWNER, "Three?", with_history))
    assert third.telemetry["prompt_tokens"] > second.telemetry["prompt_tokens"]  # earlier turns included
    assert third.telemetry["conversation_reuse_tokens"] > 0  # reusing the previous turn's KV


def test_engine_error_shows_beside_that_answer_only(chat):
    session, _ = chat.add_images(None, OWNER, [])
    _, bad = run(chat.ask(session.id, OWNER, "Too long", ChatOptions(max_tokens=10_000_000)))
    assert bad.status == "error" and "max_tokens" in bad.line
    _, good = run(chat.ask(session.id, OWNER, "Fine", FAST))
    assert good.status == "done"
    assert [t.status for t in chat.turns(session.id)] == ["error", "done"]


def test_model_still_loading(store):
    loading = ModelLoader(Settings())
    with pytest.raises(ChatError, match="still loading"):
        ChatService(store, loading).ask(None, OWNER, "Hi?", FAST)


# ---------------------------------------------------------------------------------- bad uploads
def test_bad_uploads_are_explained_and_not_stored(chat, store, tmp_path, pictures):
    big = tmp_path / "big.png"
    big.write_bytes(png_bytes() + b"\0" * (3 << 20))
    truncated = pictures[0].read_bytes()[:5000]
    session, problems = chat.add_images(None, OWNER, [
        ("notes.txt", b"hello, not an image"),
        ("cut.png", truncated),
        ("bomb.png", bomb_png()),
        ("big.png", big),
        ("ok.png", png_bytes()),
    ])
    assert len(session.image_shas) == 1  # only the good one
    assert len(problems) == 4
    assert problems[0].startswith("notes.txt: ") and "not an image" in problems[0]
    assert problems[1].startswith("cut.png: ")
    assert problems[2].startswith("bomb.png: ") and "pixel" in problems[2].lower()
    assert problems[3].startswith("big.png: ") and "MiB" in problems[3]
    # the session stays usable
    _, final = run(chat.ask(session.id, OWNER, "What colour?", FAST))
    assert final.status == "done"


def test_a_first_upload_of_only_bad_files_leaves_no_empty_session(chat):
    before = [s.id for s in chat.sessions(OWNER)]
    session, problems = chat.add_images(None, OWNER, [("notes.txt", b"not an image"), ("bomb.png", bomb_png())])
    assert session is None and len(problems) == 2
    assert [s.id for s in chat.sessions(OWNER)] == before


def test_image_count_limit(chat):
    colours = [(i * 40, 0, 0) for i in range(5)]
    session, problems = chat.add_images(None, OWNER, [(f"{i}.png", png_bytes(colour=c)) for i, c in enumerate(colours)])
    assert len(session.image_shas) == 3 and len(problems) == 2
    session = chat.remove_image(session.id, OWNER, session.image_shas[0])
    assert len(session.image_shas) == 2


def test_other_owners_cannot_use_a_session(chat):
    session, _ = chat.add_images(None, OWNER, [("a.png", png_bytes())])
    assert chat.session(session.id, STRANGER) is None
    with pytest.raises(ChatError):
        chat.rename(session.id, STRANGER, "mine now")
    other = chat.ask(session.id, STRANGER, "Hi?", FAST)  # a new session of their own, not this one
    assert other.session.id != session.id
    run(other)
    assert chat.stop(session.id, STRANGER) is False
    assert [s.id for s in chat.sessions(STRANGER)] == [other.session.id]


# ---------------------------------------------------------------------------------- page handlers
def request(owner=OWNER, **query):
    return types.SimpleNamespace(cookies={"prism_owner": owner}, query_params=query)


@pytest.fixture
def ui(chat):
    from app.ui import PrismUI

    return PrismUI(chat, chat.engine_source)


def test_handlers_upload_ask_and_reopen(ui, pictures):
    out = ui.add_images(None, [str(p) for p in pictures], request())
    sid, sessions_html, _, images_html, chat_msgs, *_rest, notice, upload_value = out
    assert sid and images_html.count("/images/") == 2 and notice == "" and upload_value is None
    assert "../" not in images_html and str(pictures[0].parent) not in images_html  # hashes only, no paths
    steps = list(ui.answer(sid, "What is this?", 0.0, 6, False, request()))
    assert steps[0][3] == ""  # the question box is cleared at once
    final_chat = steps[-1][1]
    assert final_chat[-2] == {"role": "user", "content": "What is this?"}
    assert "prism-tel-miss" in final_chat[-1]["content"] and "prefix MISS" in final_chat[-1]["content"]
    steps = list(ui.answer(sid, "And now?", 0.0, 6, False, request()))
    assert "prefix HIT" in steps[-1][1][-1]["content"]
    # reopening (page load with ?session=) shows the stored telemetry again
    loaded = ui.on_load(request(session=sid))
    assert loaded[0] == sid and "prefix MISS" in loaded[4][1]["content"] and "prefix HIT" in loaded[4][3]["content"]
    assert "Q1" in loaded[5] and "prism-pages" in loaded[6]
    # a stranger's page load never opens it
    assert ui.on_load(request(STRANGER, session=sid))[0] is None


def test_demo_model_answers_default_to_few_tokens(ui, store, engine):
    """With the demo model (random text) the page's max-tokens slider starts at DEMO_MAX_TOKENS;
    with a real model the page keeps its default."""
    from app.ui import DEFAULT_MAX_TOKENS, DEMO_MAX_TOKENS, PrismUI

    assert DEMO_MAX_TOKENS < DEFAULT_MAX_TOKENS
    assert ui.on_load(request())[-1] == {"__type__": "update", "value": DEMO_MAX_TOKENS}
    real = ModelLoader.ready(engine, ModelChoice("real", "real", False, "test"))
    assert PrismUI(ChatService(store, real), real).on_load(request())[-1] == {"__type__": "update"}  # unchanged


def test_handlers_refuse_empty_question_and_show_bad_upload(ui, tmp_path):
    step = list(ui.answer(None, "  ", 0.0, 6, False, request()))
    assert len(step) == 1 and "type a question" in step[0][2]
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"definitely not a png")
    out = ui.add_images(None, [str(junk)], request())
    assert "Not added" in out[-2] and "junk.png" in out[-2]
    assert "/images/" not in out[3]


def test_handlers_share_and_revoke(ui, chat):
    session, _ = chat.add_images(None, OWNER, [("a.png", png_bytes())])
    html, notice, name_box = ui.create_share(session.id, "continue", None, request())
    assert 'data-path="/s/' in html and "can continue" in html and notice == "" and name_box == ""
    share = chat.store.list_shares(session.id, OWNER)[0]
    evt = types.SimpleNamespace(_data={"revoke": share.id})
    assert "No active links" in ui.revoke_share(session.id, evt, request())
    assert chat.store.list_shares(session.id, OWNER) == []


def test_share_dialog_rows_name_each_link_by_its_name_creation_time_and_id(ui, chat):
    """Issue 31.6: two links of one mode are told apart by the owner's name, the creation time
    (UTC, to the second) and the share id; a bad name is refused with a notice and stores nothing."""
    import time

    session, _ = chat.add_images(None, OWNER, [("a.png", png_bytes())])
    ui.create_share(session.id, "read", "for <Alice>", request())
    html, _, _ = ui.create_share(session.id, "read", "", request())
    first, second = chat.store.list_shares(session.id, OWNER)
    rows = html.split("<li>")[1:]
    assert len(rows) == 2
    assert "for &lt;Alice&gt;" in rows[0] and "<Alice>" not in html and "prism-share-name" not in rows[1]
    for row, share in zip(rows, (first, second), strict=True):
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(share.created_at))
        assert f"created {stamp}" in row and f"id {share.id}" in row and f'data-revoke="{share.id}"' in row
    html, notice, name_box = ui.create_share(session.id, "read", "x" * 81, request())
    assert "Not created" in notice and "80 characters" in notice and name_box == {"__type__": "update"}
    assert len(chat.store.list_shares(session.id, OWNER)) == 2 and html.count("<li>") == 2


def test_handlers_open_rename_new_and_delete(ui, chat):
    a, _ = chat.add_images(None, OWNER, [("a.png", png_bytes(colour=(1, 2, 3)))])
    b, _ = chat.add_images(None, OWNER, [("b.png", png_bytes(colour=(4, 5, 6)))])
    opened = ui.open_session(types.SimpleNamespace(_data={"session": a.id}), request())
    assert opened[0] == a.id and "prism-session-active" in opened[1]
    assert ui.open_session(types.SimpleNamespace(_data={"session": a.id}), request(STRANGER))[0] is None
    sessions_html, title = ui.rename(a.id, "  Renamed   chat ", request())
    assert title == "Renamed chat" and "Renamed chat" in sessions_html
    assert chat.session(a.id, OWNER).title == "Renamed chat"
    fresh = ui.new_session(request())
    assert fresh[0] is None and fresh[4] == [] and fresh[2] == ""
    for cancelled in (False, None, "true", 1):  # the browser's confirm() said no (or a forged value)
        skipped = ui.delete(b.id, cancelled, request())
        assert len(skipped) == 8 and chat.session(b.id, OWNER) is not None
    after = ui.delete(b.id, True, request())
    assert chat.session(b.id, OWNER) is None and after[0] == a.id


def test_handlers_stop(ui, chat, engine):
    active = chat.ask(None, OWNER, "Long", ChatOptions(max_tokens=2000))
    it = iter(active)
    next(it), next(it)
    ui.stop(active.session.id, request())
    assert list(it)[-1].status == "cancelled"
    assert engine.stats()["running"] == 0


def test_two_users_are_answered_together(chat, engine, pictures):
    import threading

    sessions = [chat.add_images(None, owner, [(pictures[0].name, pictures[0])])[0] for owner in (OWNER, STRANGER)]
    actives = [chat.ask(s.id, o, "Describe it", ChatOptions(max_tokens=24))
               for s, o in zip(sessions, (OWNER, STRANGER), strict=True)]
    peak = []
    finals = [None, None]

    def read(i):
        for view in actives[i]:
            peak.append(engine.stats()["running"])
            finals[i] = view

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [f.status for f in finals] == ["done", "done"]
    assert max(peak) == 2  # both in the same running batch
    # each session has its own cache salt: no sharing of the prefix between the two users
    assert {f.prefix for f in finals} == {"miss"}


def test_settings_defaults_match_the_engines_image_limits():
    from engine.inputs.images import ImageOptions

    s = Settings()
    assert s.max_image_pixels == ImageOptions.max_image_pixels
    assert s.max_upload_bytes == ImageOptions.max_bytes


def test_chat_events_are_not_serialised(tmp_path, engine):
    from app.server import create_app
    from app.ui import CHAT_CONCURRENCY

    store = SessionStore(tmp_path)
    loader = ModelLoader.ready(engine, ModelChoice("tiny", "tiny", True, "test"))
    app = create_app(Settings(data_dir=tmp_path), store, loader)
    blocks = app.state.blocks
    limits = {fn.name: fn.concurrency_limit for fn in blocks.fns.values()}
    assert limits["answer"] == limits["regenerate"] == CHAT_CONCURRENCY > 1
    assert blocks._queue.default_concurrency_limit > 1  # quick clicks are not serialised either
    store.close()


def test_sessions_survive_a_restart_with_a_cold_cache(tmp_path, tiny_engine_factory, pictures):
    data = tmp_path / "data"
    with SessionStore(data) as store:
        chat = ChatService(store, ModelLoader.ready(tiny_engine_factory(kv_cache_bytes=32 << 20),
                                                    ModelChoice("tiny", "tiny", True, "test")))
        session, _ = chat.add_images(None, OWNER, [(p.name, p) for p in pictures])
        run(chat.ask(session.id, OWNER, "Before the restart?", FAST))
        _, warm = run(chat.ask(session.id, OWNER, "Still warm?", FAST))
        assert warm.prefix == "hit"
    with SessionStore(data) as store:  # a new process: new store, new engine, empty caches
        chat = ChatService(store, ModelLoader.ready(tiny_engine_factory(kv_cache_bytes=32 << 20),
                                                    ModelChoice("tiny", "tiny", True, "test")))
        again = chat.session(session.id, OWNER)
        assert again.image_shas == session.image_shas
        assert [t.line for t in chat.turns(session.id)][1].startswith("prefix HIT")
        _, cold = run(chat.ask(session.id, OWNER, "After the restart?", FAST))
        assert cold.prefix == "miss" and cold.line.startswith("prefix MISS (now cached) · vision encoder ran")


def test_gradio_temp_copies_are_deleted_after_upload(ui, tmp_path, monkeypatch, pictures):
    temp = tmp_path / "gradio-tmp"
    upload_dir = temp / "abc123"
    upload_dir.mkdir(parents=True)
    copy = upload_dir / "astronaut.png"
    copy.write_bytes(pictures[0].read_bytes())
    junk = temp / "def456" / "junk.png"
    junk.parent.mkdir()
    junk.write_bytes(b"nope")
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(temp))
    out = ui.add_images(None, [str(copy), str(junk)], request())
    assert out[3].count("/images/") == 1 and "junk.png" in out[-2]
    assert not copy.exists() and not junk.exists() and not upload_dir.exists()
    assert pictures[0].exists()


def test_a_turn_left_unfinished_by_a_crash_shows_as_interrupted(chat, store):
    session = store.create_session(OWNER)
    store.add_turn(session.id, "Asked just before the crash")  # never finished
    [view] = chat.turns(session.id)
    assert view.status == "error" and view.line.startswith("interrupted")
    active = chat.ask(session.id, OWNER, "Now?", FAST)
    assert chat.turns(session.id)[-1].status == "streaming"  # a live one is not
    run(active)
    assert chat.turns(session.id)[-1].status == "done"


def test_text_only_chat_thumbnail_needs_no_emoji_font(chat):
    """A chat without images shows a drawn speech bubble in the sidebar, not an emoji (which shows
    as an empty box where no emoji font is installed)."""
    from app import render

    run(chat.ask(None, OWNER, "Hello?", ChatOptions(max_tokens=2)))
    html = render.sessions_list(chat.sessions(OWNER), None)
    assert '<span class="prism-thumb-empty"><svg' in html and "💬" not in html


def test_engine_panel_says_what_the_prefix_cache_holds(chat, engine, pictures):
    """The Engine tab counts image prefixes and the finished turns kept for conversation reuse
    apart (one count of "entries" read as more image sets than the user added)."""
    from app import render

    engine.clear_prefix_cache()
    active = chat.ask(None, OWNER, "What is this?", ChatOptions(max_tokens=2))
    run(active)
    sid = active.session.id
    chat.add_images(sid, OWNER, [(pictures[0].name, pictures[0])])
    run(chat.ask(sid, OWNER, "And this?", ChatOptions(max_tokens=2)))
    run(chat.ask(sid, OWNER, "Anything else?", ChatOptions(max_tokens=2)))
    stats = engine.stats()
    assert stats["cache_prefixes"] == 1 and stats["cache_entries"] > 1, stats
    turns = stats["cache_entries"] - 1
    html = render.engine_panel({"status": "ok", "model": "m", "device": "cpu", "dtype": "float32", "engine": stats})
    assert f"1 image prefix + {turns} turn{'s' if turns != 1 else ''} kept for reuse" in html


# ---------------------------------------------------------------------------------- issue 22: asking again
HISTORY = ChatOptions(max_tokens=6, history=True)


def three_turns(chat, pictures, options=FAST):
    session, _ = chat.add_images(None, OWNER, [(pictures[0].name, pictures[0])])
    for q in ("One?", "Two?", "Three?"):
        assert run(chat.ask(session.id, OWNER, q, options))[1].status == "done"
    return session, chat.turns(session.id)


def test_editing_a_past_question_asks_again_from_there_and_reuses_what_matches(chat, pictures):
    """Editing question 2 of 3 (history on): turns 2 and 3 are replaced by the edited question's
    turn, whose prompt is the images, turn 1 and the new question. The cache reuses what still
    matches: the image prefix (a hit, no vision encoder) and turn 1's KV (conversation reuse).
    Before, only the last question could be asked again, and never changed."""
    session, turns = three_turns(chat, pictures, HISTORY)
    active = chat.edit(session.id, OWNER, turns[1].turn_id, "Two, edited?", HISTORY)
    assert active.replaced == 2
    _, final = run(active)
    assert final.status == "done" and final.prefix == "hit" and not final.telemetry["vision_encoder_ran"]
    assert final.telemetry["conversation_reuse_tokens"] > 0  # turn 1's question and answer
    after = chat.turns(session.id)
    assert [t.question for t in after] == ["One?", "Two, edited?"]
    assert after[0].turn_id == turns[0].turn_id and after[0].answer == turns[0].answer  # turn 1 untouched


def test_editing_the_first_question_retitles_the_chat_unless_the_owner_named_it(chat, pictures, store):
    """A chat is titled by its first question; editing that question changes the title with it
    (it kept the old question before). Editing a later question, regenerating, or editing the
    first question of a chat the owner renamed leaves the title alone."""
    session, turns = three_turns(chat, pictures)
    assert store.get_session(session.id).title == "One?"
    run(chat.edit(session.id, OWNER, turns[1].turn_id, "Two, edited?", FAST))  # not the first: kept
    assert store.get_session(session.id).title == "One?"
    run(chat.edit(session.id, OWNER, chat.turns(session.id)[0].turn_id, "  One,\n  edited? ", FAST))
    assert store.get_session(session.id).title == "One, edited?"
    run(chat.regenerate(session.id, OWNER, FAST, turn_id=chat.turns(session.id)[0].turn_id))
    assert store.get_session(session.id).title == "One, edited?"
    chat.rename(session.id, OWNER, "My coffee chat")
    run(chat.edit(session.id, OWNER, chat.turns(session.id)[0].turn_id, "One again?", FAST))
    assert store.get_session(session.id).title == "My coffee chat"


def test_regenerating_an_older_answer_drops_the_later_turns(chat, pictures):
    """Regenerate works on any answer, not only the last: asking question 1 of 3 again replaces
    its answer and drops turns 2 and 3; without history the image prefix is still a hit."""
    session, turns = three_turns(chat, pictures)
    active = chat.regenerate(session.id, OWNER, ChatOptions(temperature=1.0, max_tokens=6), turn_id=turns[0].turn_id)
    _, final = run(active)
    assert final.status == "done" and final.prefix == "hit" and final.question == "One?"
    assert [t.question for t in chat.turns(session.id)] == ["One?"]
    assert chat.turns(session.id)[0].turn_id != turns[0].turn_id  # a new turn in its place
    # the last turn, as before, by default
    run(chat.ask(session.id, OWNER, "Two?", FAST))
    _, last = run(chat.regenerate(session.id, OWNER, FAST))
    assert [t.question for t in chat.turns(session.id)] == ["One?", "Two?"] and last.status == "done"


@pytest.mark.parametrize("bad", ["other-session", "stranger", -1, 0, 2**63, 10**40, "abc", "1.5", "-3", "", None,
                                 True, 2.0, [1], {"id": 1}, "00001", "9" * 30])
def test_turn_ids_from_the_browser_are_checked(chat, pictures, store, bad):
    """Edit and regenerate take a turn id from the browser. A turn of another chat (the same
    owner's or a stranger's), an id that is negative, zero, huge, not a number or malformed is
    refused with a clear message, and nothing is deleted or asked; the attacker learns nothing
    about the other chat (the same message as for an id that does not exist)."""
    session, turns = three_turns(chat, pictures)
    mine_elsewhere, _ = chat.add_images(None, OWNER, [("x.png", png_bytes(colour=(9, 9, 9)))])
    foreign = store.create_session(STRANGER)
    if bad == "other-session":
        run(chat.ask(mine_elsewhere.id, OWNER, "Elsewhere?", FAST))
        bad = chat.turns(mine_elsewhere.id)[0].turn_id
    elif bad == "stranger":
        bad = store.add_turn(foreign.id, "Stranger's question").id
    before = [(t.turn_id, t.question, t.answer) for t in chat.turns(session.id)]
    elsewhere = [(t.id, t.answer) for s in (mine_elsewhere, foreign) for t in store.list_turns(s.id)]
    attempts = [lambda: chat.edit(session.id, OWNER, bad, "Hijack?", FAST)]
    if bad is not None:  # regenerate's turn_id=None is "the last turn"
        attempts.append(lambda: chat.regenerate(session.id, OWNER, FAST, turn_id=bad))
    for attempt in attempts:
        with pytest.raises(ChatError, match="no longer part of this chat"):
            attempt()
    assert [(t.turn_id, t.question, t.answer) for t in chat.turns(session.id)] == before
    assert [(t.id, t.answer) for s in (mine_elsewhere, foreign) for t in store.list_turns(s.id)] == elsewhere


def test_edit_refuses_other_owners_and_bad_questions_and_keeps_everything(chat, pictures):
    """A stranger cannot edit or regenerate someone's chat (even with valid turn ids), and an
    empty or broken edited question is refused before anything is dropped."""
    session, turns = three_turns(chat, pictures)
    before = [(t.turn_id, t.answer) for t in chat.turns(session.id)]
    with pytest.raises(ChatError, match="no longer exists"):
        chat.edit(session.id, STRANGER, turns[0].turn_id, "Mine now?", FAST)
    with pytest.raises(ChatError, match="no longer exists"):
        chat.regenerate(session.id, STRANGER, FAST, turn_id=turns[0].turn_id)
    for question in ("   ", "\ud800 broken"):
        with pytest.raises(ChatError):
            chat.edit(session.id, OWNER, turns[0].turn_id, question, FAST)
    assert [(t.turn_id, t.answer) for t in chat.turns(session.id)] == before


def test_page_edit_maps_the_chat_position_to_the_turn_and_checks_it(ui, chat, pictures):
    """Gradio's edit event names the edited message by its position in the chat (client data):
    only a user message's position within this chat, whose text is the one the tab showed, is
    accepted; anything else shows a notice and the chat as stored (the browser had already put
    the edit on screen), and nothing is lost."""
    from app.ui import turn_at

    session, turns = three_turns(chat, pictures)
    assert turn_at(turns, 2, "Two?") == turns[1].turn_id
    for index, previous in ((1, None), (3, None), (-2, None), (6, None), (10**9, None), ("2", None), (True, None),
                            (2.0, None), ((0, 0), None), (None, None), (2, "Three?")):
        evt = types.SimpleNamespace(index=index, value="Hijack?", previous_value=previous)
        steps = list(ui.edit(session.id, 0.0, 6, False, evt, request()))
        assert len(steps) == 1, index
        sid, shown, notice, _, send, stop = steps[0]
        assert "changed" in notice and [m["content"] for m in shown[::2]] == ["One?", "Two?", "Three?"]
        assert send["visible"] is True and stop["visible"] is False
    assert [t.turn_id for t in chat.turns(session.id)] == [t.turn_id for t in turns]
    # a stranger's page gets an empty chat, not this one
    evt = types.SimpleNamespace(index=0, value="Hijack?", previous_value="One?")
    assert list(ui.edit(session.id, 0.0, 6, False, evt, request(STRANGER)))[0][1] == []
    # a real edit: Send turns into Stop while it streams, and back; a notice says what was replaced
    evt = types.SimpleNamespace(index=2, value="Two, edited?", previous_value="Two?")
    steps = list(ui.edit(session.id, 0.0, 6, False, evt, request()))
    assert steps[0][4]["visible"] is False and steps[0][5]["visible"] is True
    assert steps[-1][4]["visible"] is True and steps[-1][5]["visible"] is False
    assert "the question after it and its answer were removed" in steps[0][2]
    assert [m["content"] for m in steps[-1][1][::2]] == ["One?", "Two, edited?"]


def test_page_regenerate_any_answer_through_the_bridge(ui, chat, pictures):
    """The page's per-answer Regenerate button sends the answer's turn id (a string) through the
    hidden bridge; the handler asks that turn again, and refuses a turn of another chat."""
    session, turns = three_turns(chat, pictures)
    other, _ = chat.add_images(None, OWNER, [("y.png", png_bytes(colour=(3, 3, 3)))])
    run(chat.ask(other.id, OWNER, "Other?", FAST))
    foreign = chat.turns(other.id)[0].turn_id
    refused = list(ui.regenerate_turn(session.id, 0.0, 6, False, types.SimpleNamespace(_data={"regenerate":
                                                                                           str(foreign)}), request()))
    assert len(refused) == 1 and "no longer part of this chat" in refused[0][2]
    assert len(chat.turns(session.id)) == 3 and len(chat.turns(other.id)) == 1
    evt = types.SimpleNamespace(_data={"regenerate": str(turns[1].turn_id)})
    steps = list(ui.regenerate_turn(session.id, 0.0, 6, False, evt, request()))
    assert [m["content"] for m in steps[-1][1][::2]] == ["One?", "Two?"]
    assert "prefix HIT" in steps[-1][1][-1]["content"]
    assert [t.question for t in chat.turns(session.id)] == ["One?", "Two?"]


def test_each_answer_names_its_turn_for_the_page(chat, pictures):
    """The telemetry chip carries its turn id as a ``prism-turn-<id>`` class (the chat's HTML
    sanitizer drops ``data-`` attributes), which prism.js reads for the answer's Regenerate."""
    from app import render

    session, turns = three_turns(chat, pictures)
    html = render.assistant_markdown(turns[1])
    assert f"prism-turn-{turns[1].turn_id}" in html


def test_send_turns_into_stop_while_an_answer_streams(ui, chat):
    """While an answer streams only Stop shows in Send's place, then Send again; a refused
    question leaves Send."""
    steps = list(ui.answer(None, "Say something", 0.0, 6, False, request()))
    assert (steps[0][4]["visible"], steps[0][5]["visible"]) == (False, True)
    assert all(s[4] == s[5] == {"__type__": "update"} for s in steps[1:-1])  # unchanged meanwhile
    assert (steps[-1][4]["visible"], steps[-1][5]["visible"]) == (True, False)
    refused = list(ui.answer(None, "  ", 0.0, 6, False, request()))
    assert (refused[0][4]["visible"], refused[0][5]["visible"]) == (True, False)
    after = ui.after_answer(steps[-1][0], request())
    assert (after[-2]["visible"], after[-1]["visible"]) == (True, False)


def test_a_long_title_is_kept_whole_for_the_hover(chat):
    """A chat is titled by its first question; it used to be cut to 60 characters with "…", so the
    sidebar's hover (the button's title) could not show it in full. Now it keeps up to the store's
    limit; the sidebar shortens it on screen only."""
    from app import render

    question = "What is in the first picture, and how does it compare with everything else in the second one?"
    active = chat.ask(None, OWNER, question, ChatOptions(max_tokens=2))
    run(active)
    assert chat.session(active.session.id, OWNER).title == question
    html = render.sessions_list(chat.sessions(OWNER), None)
    assert f'title="{question}"' in html.replace("&#x27;", "'")


def test_a_tiny_image_gets_a_notice_that_it_was_upscaled(ui, engine):
    """A 1×1 image is upscaled by the processor to the model's minimum size: the upload says so
    (the model sees almost nothing of it); a normal image gets no such notice."""
    minimum = engine.prompts.size["shortest_edge"]
    out = ui.add_images(None, [_write(png_bytes((1, 1)), "dot.png")], request())
    notice = out[-2]
    assert "dot.png" in notice and "1×1" in notice and "upscaled" in notice and f"{minimum:,}" in notice
    assert "prism-notice-info" in notice
    side = int(minimum ** 0.5) + 1
    normal = ui.add_images(out[0], [_write(png_bytes((side, side)), "big-enough.png")], request())
    assert normal[-2] == ""


def _write(data: bytes, name: str) -> str:
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / name
    path.write_bytes(data)
    return str(path)


def test_the_engine_tab_shows_prefix_and_extension_evictions_apart():
    from app import render

    stats = {"pages_total": 10, "pages_used": 2, "pages_free": 8, "page_size": 16, "kv_cache_dtype": "fp8_e4m3",
             "running": 0, "waiting": 0, "cache_evictions": 3, "cache_prefix_evictions": 1,
             "cache_extension_evictions": 2, "cache_pressure_compactions": 3, "cache_pressure_pages_freed": 41}
    html = render.engine_panel({"status": "ok", "model": "m", "device": "cpu", "dtype": "float32", "engine": stats})
    assert "1 image prefix · 2 turns kept for reuse" in html
    assert "<th>Compacted on pressure</th><td>3 prefixes · 41 pages freed</td>" in html


def test_the_engine_tab_shows_the_host_tier():
    """The host-memory tier (issue 33): pages used / total, bytes allocated of its budget, entries,
    and what moved through it; "off" when it has no pages (the tier is off, or an older engine
    without its keys)."""
    from app import render
    from app.model_loader import host_cache_status

    base = {"pages_total": 10, "pages_used": 2, "pages_free": 8, "page_size": 16, "kv_cache_dtype": "fp8_e4m3",
            "running": 0, "waiting": 0}
    on = {**base, "host_pages_total": 400, "host_pages_used": 103, "host_bytes_allocated": 103 << 16,
          "host_cache_bytes": 400 << 16, "cache_host_entries": 1, "cache_offloads": 7, "cache_restores": 2,
          "cache_host_evictions": 4, "cache_hits_host": 1}
    panel = lambda stats: render.engine_panel({"status": "ok", "model": "m", "device": "cpu",  # noqa: E731
                                               "dtype": "float32", "engine": stats,
                                               "host_cache": host_cache_status(stats)})
    html = panel(on)
    assert ("<th>Host tier</th><td>103 / 400 pages used · 6.4 MiB allocated of 25.0 MiB · 1 entry</td>") in html
    assert "<th>Host tier moves</th><td>7 offloads · 2 restores · 4 evicted · 1 hit</td>" in html
    for off in (base, {**on, "host_pages_total": 0, "host_pages_used": 0}):
        html = panel(off)
        assert "<th>Host tier</th><td>off</td>" in html and "Host tier moves" not in html


def test_primary_buttons_get_darker_under_the_mouse():
    """Soft's hover shade of a primary button is lighter than the button: with the pointer still on
    "+ New chat" (or Send) after a click, it looked disabled. Prism's theme darkens it instead."""
    from app.ui import theme

    t = theme()
    shade = lambda ref: int(ref.rsplit("_", 1)[1])  # noqa: E731  "*primary_600" -> 600
    assert shade(t.button_primary_background_fill_hover) > shade(t.button_primary_background_fill)
    assert shade(t.button_primary_background_fill_hover_dark) > shade(t.button_primary_background_fill_dark)


def test_image_cards_keep_the_remove_button_off_the_photo():
    """The remove × sat over the photo's corner; it is now in the caption, beside the file name,
    and "Image N · W×H" is one label (the browser test checks they do not overlap or wrap)."""
    from app import render
    from sessions import ImageRecord

    html = render.images_strip([ImageRecord("a" * 64, "astronaut.png", 512, 512, 1, "image/png")])
    caption = html[html.index("<figcaption>"):html.index("</figcaption>")]
    assert 'class="prism-remove"' in caption and '<span class="prism-image-label"' in caption
    assert "<b>Image 1</b> · 512×512</span>" in caption


def test_copy_title_marks_a_copy_once_and_fits():
    from app.chat import copy_title
    from sessions import MAX_TITLE_LENGTH

    assert copy_title("Cats") == "Copy of Cats"
    assert copy_title("Copy of Cats") == "Copy of Cats"
    long = copy_title("x" * MAX_TITLE_LENGTH)
    assert len(long) <= MAX_TITLE_LENGTH and long.startswith("Copy of x") and long.endswith("x…")


def test_a_chat_with_a_streaming_answer_refuses_every_change_from_any_tab(ui, chat, engine):
    """While an answer streams, a second tab (same owner, same chat) cannot regenerate, edit, ask,
    add or remove an image or delete: each is refused with the busy message, nothing is stored or
    deleted, and the streaming answer is the one the chat keeps (issue 31.2: a regenerate during a
    stream replaced it, and its turn could not be stored)."""
    from app.chat import BUSY

    session, _ = chat.add_images(None, OWNER, [("a.png", png_bytes(colour=(9, 9, 9)))])
    _, first = run(chat.ask(session.id, OWNER, "First?", ChatOptions(max_tokens=4)))
    old = ui.answer(session.id, "Talk for a long time", 0.0, 2000, False, request())
    sid = next(old)[0]
    next(old)
    turns_before = [(t.id, t.question) for t in chat.store.list_turns(sid)]
    sha = chat.session(sid, OWNER).image_shas[0]
    attempts = {
        "regenerate": lambda: chat.regenerate(sid, OWNER, ChatOptions(max_tokens=4)),
        "regenerate an earlier turn": lambda: chat.regenerate(sid, OWNER, turn_id=turns_before[0][0]),
        "edit": lambda: chat.edit(sid, OWNER, turns_before[0][0], "Other?", ChatOptions(max_tokens=4)),
        "ask": lambda: chat.ask(sid, OWNER, "Another?", ChatOptions(max_tokens=4)),
        "add an image": lambda: chat.add_images(sid, OWNER, [("b.png", png_bytes(colour=(1, 9, 1)))]),
        "remove an image": lambda: chat.remove_image(sid, OWNER, sha),
        "delete": lambda: chat.delete(sid, OWNER),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except ChatError as exc:
            assert str(exc) == BUSY, name
        else:
            pytest.fail(f"{name} was not refused while an answer streamed")
    # the page's handlers say so instead of racing
    refused = list(ui.regenerate(sid, 0.0, 4, False, request()))
    assert len(refused) == 1 and BUSY in refused[0][2]
    assert ui.delete(sid, True, request())[-1] and chat.session(sid, OWNER) is not None
    assert [(t.id, t.question) for t in chat.store.list_turns(sid)] == turns_before
    assert chat.session(sid, OWNER).image_shas == [sha]
    chat.stop(sid, OWNER)
    streamed = list(old)
    last = streamed[-1][1][-1]["content"]
    stored = chat.store.list_turns(sid)
    assert [t.question for t in stored] == ["First?", "Talk for a long time"]
    assert stored[0].answer == first.answer and stored[1].answer and stored[1].answer in last
    assert not chat.answering(sid) and engine.stats()["running"] == 0
    # once it is finished, the chat takes changes again
    assert run(chat.regenerate(sid, OWNER, ChatOptions(max_tokens=4)))[1].status == "done"


def test_regenerate_on_a_new_empty_chat_says_there_is_nothing_to_regenerate(ui, chat):
    from app.chat import NOTHING_TO_REGENERATE

    for sid in (None, ""):
        with pytest.raises(ChatError) as caught:
            chat.regenerate(sid, OWNER)
        assert str(caught.value) == NOTHING_TO_REGENERATE
        out = list(ui.regenerate(sid, 0.0, 4, False, request()))
        assert len(out) == 1 and NOTHING_TO_REGENERATE in out[0][2]
    session, _ = chat.add_images(None, OWNER, [("a.png", png_bytes(colour=(3, 9, 3)))])
    with pytest.raises(ChatError, match="nothing to regenerate"):
        chat.regenerate(session.id, OWNER)  # images but no question yet
    with pytest.raises(ChatError, match="no longer exists"):
        chat.regenerate("deleted-or-never-existed", OWNER)  # a named chat that is gone still says so
    assert chat.sessions(OWNER) == [chat.session(session.id, OWNER)]


def _idle_buttons():
    from app.ui import _IDLE

    return _IDLE
