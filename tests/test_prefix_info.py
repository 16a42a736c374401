"""Issue 23, the engine's part: ``Engine.prefix_info(cache_salt)`` reports which visual tokens
the compact prefix a session's next question would attach kept, per image, from the one record
on the cache entry (``PrefixEntry.kept``, written by ``PrefixEntry.record_kept``).

Each test says what it proves; all of them fail on the code before issue 23 (there was no
``prefix_info``, no ``KeptTokens``).
"""

from __future__ import annotations

import hashlib
import io
import threading

import pytest
import torch
from PIL import Image

from engine import PrismError, SamplingParams, media_first_messages
from engine.cache.compaction import SELECTOR_SCORES, SELECTORS
from engine.cache.prefix_cache import KeptTokens

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)
KEEP_RATIO, MIN_KEEP = 0.45, 4
#: What each 96-token image (A, B) keeps at KEEP_RATIO: 0.45 * 96 = 43.2, by hand.
KEPT_PER_IMAGE = 43


def png(seed: int, size: tuple[int, int]) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(size[1], size[0], 3, generator=gen) * 255).to(torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


#: Two images of different shapes (grids 8 × 12 and 12 × 8 at the tiny model's 32 px per token).
A, B = png(1, (384, 256)), png(2, (256, 384))


def key(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def messages(*images: bytes, question: str = "What is this?") -> list[dict]:
    return media_first_messages([{"image": data} for data in images], question)


def ask(engine, *images: bytes, salt: str = "s", question: str = "What is this?"):
    return engine.generate(messages(*images, question=question), ONE_TOKEN, cache_salt=salt)


def expected_grid(span, selector: str, scores) -> list[list[bool]]:
    """The selector's own output for a span (given the prefix's stored token scores, None for
    uniform), as a rows × cols grid of booleans."""
    own = None if scores is None else {name: t[span.start : span.end] for name, t in scores.items()}
    keep = torch.zeros(span.length, dtype=torch.bool)
    assert span.length == 96
    keep[SELECTORS[selector](span, KEPT_PER_IMAGE, own, None)] = True
    return keep.view(span.grid_h, span.grid_w).tolist()


@pytest.mark.parametrize("selector", sorted(SELECTORS))
def test_reported_bitmap_is_the_selectors_output(tiny_engine_factory, selector):
    """For every selector: each image's reported grid is its merged-token grid, and its kept cells
    are exactly the tokens the selector picks for that image's span of the prefix, from the
    scores stored with the entry (some dropped, so an "all kept" report would fail); the counts
    add up to the telemetry's kept tokens. Score-based selectors store exactly their own scores."""
    engine = tiny_engine_factory(kv_cache_bytes=32 << 20, compaction=selector, keep_ratio=KEEP_RATIO,
                                 min_keep=MIN_KEEP)
    done = ask(engine, A, B)
    info = engine.prefix_info("s")
    spans = [s for s in engine.prompts.build(messages(A, B), "s").spans if s.kind == "image"]
    assert [(s.grid_h, s.grid_w) for s in spans] == [(8, 12), (12, 8)]
    assert info is not None and len(info) == 2
    scores = engine.prefix_cache.latest_prefix("s").scores
    assert (scores is None) == (SELECTOR_SCORES[selector] == ())
    assert scores is None or set(scores) == set(SELECTOR_SCORES[selector])
    for n, (item, span) in enumerate(zip(info, spans, strict=True)):
        assert item["image"] == n and (item["rows"], item["cols"]) == (span.grid_h, span.grid_w)
        assert item["kept"] == expected_grid(span, selector, scores)
        assert item["kept_count"] == sum(map(sum, item["kept"])) == KEPT_PER_IMAGE
        assert item["selector"] == selector and item["keep_ratio"] == KEEP_RATIO
    assert sum(item["kept_count"] for item in info) == done.telemetry.visual_tokens_kept


def test_a_dense_prefix_reports_every_token_kept(tiny_engine_factory):
    """Without compaction every cell is kept and no selector is named (the viewer's "all kept")."""
    engine = tiny_engine_factory(kv_cache_bytes=32 << 20, compaction=None)
    ask(engine, A)
    [item] = engine.prefix_info("s")
    assert (item["rows"], item["cols"], item["kept_count"]) == (8, 12, 96)
    assert all(all(row) for row in item["kept"]) and item["selector"] is None and item["keep_ratio"] == 1.0


def test_nothing_cached_is_none_and_other_salts_see_nothing(tiny_engine_factory):
    """None before the first question, for another session's salt (what a stranger's call would
    see: nothing, not the owner's grid), for other images than the prefix was built from, after
    eviction, with prefix caching off; the salt never shows in ``stats()``; a closed engine
    raises."""
    engine = tiny_engine_factory(kv_cache_bytes=32 << 20)
    assert engine.prefix_info("secret-salt-1") is None
    ask(engine, A, B, salt="secret-salt-1")
    assert engine.prefix_info("secret-salt-1") is not None
    assert engine.prefix_info("secret-salt-2") is None and engine.prefix_info(None) is None
    assert engine.prefix_info("secret-salt-1", [key(A), key(B)]) == engine.prefix_info("secret-salt-1")
    assert engine.prefix_info("secret-salt-1", [key(A)]) is None
    assert engine.prefix_info("secret-salt-1", [key(B), key(A)]) is None  # order matters: another prefix
    assert "secret-salt" not in repr(engine.stats())
    engine.clear_prefix_cache()
    assert engine.prefix_info("secret-salt-1") is None
    engine.close()
    with pytest.raises(PrismError, match="closed"):
        engine.prefix_info("secret-salt-1")
    off = tiny_engine_factory(kv_cache_bytes=32 << 20, prefix_cache=False)
    ask(off, A)
    assert off.prefix_info("s") is None


def test_the_prefix_used_last_is_reported(tiny_engine_factory):
    """The latest prefix is the one the salt's last question computed or hit: after {A, B}, then
    {A}, then {A, B} again (a hit, no new entry), it is {A, B}'s; naming the images picks each."""
    engine = tiny_engine_factory(kv_cache_bytes=32 << 20)
    ask(engine, A, B)
    ask(engine, A)
    assert len(engine.prefix_info("s")) == 1
    assert ask(engine, A, B, question="And now?").telemetry.prefix_cache == "hit"
    assert [i["rows"] for i in engine.prefix_info("s")] == [8, 12]
    assert [i["rows"] for i in engine.prefix_info("s", [key(A)])] == [8]


def test_a_restart_reports_not_cached(tiny_engine_factory):
    """The cache lives in the engine's memory: a new engine (a restart) reports None for the
    salt its predecessor had cached, never a remembered grid."""
    first = tiny_engine_factory(kv_cache_bytes=32 << 20)
    ask(first, A, salt="kept-across?")
    assert first.prefix_info("kept-across?") is not None
    first.close()
    again = tiny_engine_factory(kv_cache_bytes=32 << 20)
    assert again.prefix_info("kept-across?") is None


def test_the_report_is_a_copy(tiny_engine_factory):
    """What the caller gets is its own: changing it changes nothing in the cache, and it stays as
    it was after the entry is evicted."""
    engine = tiny_engine_factory(kv_cache_bytes=32 << 20)
    ask(engine, A)
    first = engine.prefix_info("s")
    snapshot = [dict(item, kept=[list(r) for r in item["kept"]]) for item in first]
    first[0]["kept"][0][0] = not first[0]["kept"][0][0]
    assert engine.prefix_info("s") == snapshot
    engine.clear_prefix_cache()
    assert first[0]["kept"][0][1] == snapshot[0]["kept"][0][1] and engine.prefix_info("s") is None


def test_prefix_info_holds_the_loop_lock(tiny_engine_factory):
    """Read under the engine loop's lock: while the cache is being read, another thread cannot
    pause the loop (so the loop cannot step and mutate the cache under the reader)."""
    engine = tiny_engine_factory(kv_cache_bytes=32 << 20)
    ask(engine, A)
    reuse, seen = engine.prefix_reuse, []
    real = reuse.prefix_info

    def reading(*args, **kwargs):
        entered = threading.Event()

        def try_pause():
            with engine.loop.paused():
                entered.set()

        other = threading.Thread(target=try_pause, daemon=True)
        other.start()
        seen.append(entered.wait(0.5))  # False: the lock is held by this reader
        return real(*args, **kwargs)

    reuse.prefix_info = reading
    assert engine.prefix_info("s") is not None
    assert seen == [False]


def test_a_later_recompaction_updates_the_report(tiny_engine_factory):
    """The hook a re-compaction under memory pressure (issue 19) calls: ``record_kept`` with what
    it left replaces the record, and ``prefix_info`` (which reads only that record) and the
    entry's kept count follow."""
    engine = tiny_engine_factory(kv_cache_bytes=32 << 20)
    ask(engine, A)
    entry = engine.prefix_cache.latest_prefix("s")
    [span] = entry.spans
    visual = torch.arange(span.start, span.end)[:: 4]  # every fourth visual token of the image
    others = torch.tensor([i for i in range(entry.prefix_len) if not span.start <= i < span.end])
    with engine.loop.paused():
        entry.record_kept(KeptTokens(torch.cat([others, visual]).sort().values, "uniform", 0.25))
    [item] = engine.prefix_info("s")
    assert item["kept_count"] == entry.visual_kept == 24 and item["keep_ratio"] == 0.25
    assert [c for row in item["kept"] for c in row] == [i % 4 == 0 for i in range(span.length)]


def _compact_on_pressure(engine) -> None:
    """Memory runs short once: the cache's own pressure path (idle turns evicted first, then one
    compaction step of an idle prefix) frees pages until one compaction step was made."""
    cache = engine.prefix_cache
    before = cache.stats.pressure_compactions
    with engine.loop.paused():
        for _ in range(8):  # each call frees at least a page; the turns kept for reuse go first
            if cache.stats.pressure_compactions > before:
                break
            assert cache.make_room(engine.pool.num_free + 1)
    assert cache.stats.pressure_compactions == before + 1


@pytest.mark.parametrize("selector", ["uniform", "attention"])
def test_the_preview_is_what_the_next_pressure_step_then_keeps(tiny_engine_factory, selector):
    """Under ``on_pressure`` a cached prefix is dense, so "what the model keeps" was all kept.
    ``prefix_info(preview=True)`` reports what the next compaction step on pressure would keep:
    for the first step, exactly the selector's own choice at that step's keep ratio; asking
    compacts nothing; and when memory then runs short, the compaction keeps exactly the previewed
    tokens (for the second step too). With every step done there is nothing to preview."""
    engine = tiny_engine_factory(kv_cache_bytes=32 << 20, compaction=selector, keep_ratio=KEEP_RATIO,
                                 min_keep=MIN_KEEP, compaction_mode="on_pressure",
                                 pressure_keep_ratios=(KEEP_RATIO, 0.2))
    ask(engine, A, B)
    entry = engine.prefix_cache.latest_prefix("s")
    dense = engine.prefix_info("s")
    assert all(all(map(all, item["kept"])) and not item["preview"] and item["step"] is None for item in dense)
    preview = engine.prefix_info("s", preview=True)
    spans = [s for s in entry.spans if s.kind == "image"]
    for item, span in zip(preview, spans, strict=True):
        assert item["preview"] and item["step"] == 0 and item["steps"] == 2
        assert item["selector"] == selector and item["keep_ratio"] == KEEP_RATIO
        assert item["kept"] == expected_grid(span, selector, entry.scores)
        assert item["kept_count"] == sum(map(sum, item["kept"])) < span.length
    assert engine.prefix_info("s") == dense and entry.kv_len == entry.prefix_len  # asking changed nothing

    for step in (0, 1):
        preview = engine.prefix_info("s", preview=True)
        assert all(item["preview"] and item["step"] == step for item in preview)
        _compact_on_pressure(engine)
        kept = engine.prefix_info("s")
        assert [(i["kept"], i["kept_count"], i["keep_ratio"]) for i in kept] == [
            (i["kept"], i["kept_count"], i["keep_ratio"]) for i in preview]
        assert sum(i["kept_count"] for i in kept) == entry.visual_kept
    assert engine.prefix_info("s", preview=True) == engine.prefix_info("s")  # every step done: no preview
    assert not engine.prefix_info("s", preview=True)[0]["preview"]


def test_no_preview_when_prefixes_are_compacted_as_cached(tiny_engine_factory):
    """``compaction_mode="always"`` has no pressure steps: the preview is what is kept now."""
    engine = tiny_engine_factory(kv_cache_bytes=32 << 20, compaction="uniform", keep_ratio=KEEP_RATIO,
                                 min_keep=MIN_KEEP)
    ask(engine, A)
    [item] = engine.prefix_info("s", preview=True)
    assert not item["preview"] and item["steps"] == 0 and item["kept_count"] < 96
    assert [item] == engine.prefix_info("s")
