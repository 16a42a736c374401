"""Compaction on pressure (issue 19, ``compaction_mode="on_pressure"``): dense while it fits,
compacted before anything is evicted.

Two levels. :class:`~engine.cache.prefix_cache.PrefixCache` on a small real pool (one layer,
float32 pages whose K holds each slot's own logical position, so a move is checked value by
value): the reclaim order (idle extensions, then compaction, then eviction), what a compaction
moves, frees and records, that an entry a request reads never moves, that the key stays. Engines
on the tiny "test" checkpoint (float32 pages, ``debug_checks``: the pool's page accounting, cache
entries included, is checked after every step): under a large pool nothing is compacted and greedy
outputs equal ``compaction=None``; under a small one entries are compacted, their next hit computes
only the question, the pages freed are the dense minus the compact pages, and every compact hit
equals the masked dense oracle (:mod:`engine.cache.reference_masked`) on the tokens the entry kept,
also with sessions hitting concurrently while others compact.
"""

from __future__ import annotations

import threading

import pytest
import torch
from PIL import Image

from engine import InvalidRequestError, SamplingParams
from engine.cache.compaction import CompactionConfig
from engine.cache.kv_pool import PagePool
from engine.cache.prefix_cache import KeptTokens, PrefixCache
from engine.cache.reference_masked import masked_greedy
from engine.engine import EngineOptions
from engine.inputs.prompts import media_first_messages
from engine.model.rope import VisualSpan

N_TOKENS = 8
SP = SamplingParams(max_tokens=N_TOKENS, ignore_eos=True)
EXACT = {"max_pixels": 256 * 256, "kv_cache_dtype": "auto", "debug_checks": True}
QUESTIONS = ("What is in this picture?", "Describe the colours you can see.", "Is there any text?")


def pool_bytes(pages: int) -> int:
    """KV bytes of ``pages`` float32 pages of the "test" preset (3 layers, 2 KV heads, 16 dims)."""
    return pages * 16 * 3 * 2 * 2 * 16 * 4


# ------------------------------------------------------------------------------------------------
# the cache on a small pool
# ------------------------------------------------------------------------------------------------

PAGE = 4
SPAN = VisualSpan(start=2, grid_h=4, grid_w=5, kind="image", item=0, frame=0)  # 20 visual tokens
PREFIX_LEN = 24  # 2 text + 20 visual + 2 text: 6 dense pages of 4


def small_cache(num_pages: int = 16, ratios=(0.6,)) -> PrefixCache:
    pool = PagePool(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=num_pages, page_size=PAGE,
                    kv_cache_dtype="auto")
    steps = tuple(CompactionConfig("uniform", r, min_keep=1) for r in ratios)
    return PrefixCache(pool, steps)


def add_dense(cache: PrefixCache, key: str, hits: int = 0):
    """A dense prefix whose slot ``i`` holds logical position ``i`` in its K (and ``-i`` in its V)."""
    pages = cache.pool.allocate(-(-PREFIX_LEN // PAGE))
    layer = cache.pool.layers[0]
    for i in range(PREFIX_LEN):
        p, o = pages[i // PAGE], i % PAGE
        layer.k_cache[p, 0, o] = float(i)
        layer.v_cache[p, 0, o] = -float(i)
    entry = cache.add_prefix(key, "s", list(range(100, 100 + PREFIX_LEN)), pages, PREFIX_LEN, len(pages), 20,
                             spans=(SPAN,))
    cache.pool.release(pages)  # the computing request finished
    entry.record_kept(KeptTokens(torch.arange(PREFIX_LEN), None, 1.0))
    entry.hits = hits
    return entry


def stored_positions(cache: PrefixCache, entry) -> list[int]:
    """The logical positions the entry's slots hold, read back from the pool's K, once the slot
    moves the cache ordered are applied (what the runner does first in the next step)."""
    for order in cache.pool.take_orders():
        cache.pool.apply(order)
    k = cache.pool.layers[0].k_cache
    return [int(k[entry.pages[i // PAGE], 0, i % PAGE, 0]) for i in range(entry.kv_len)]


def check(cache: PrefixCache, *readers: list[int]) -> None:
    cache.pool.check([*cache.holders(), *readers])


def test_compaction_moves_the_kept_slots_frees_the_tail_and_keeps_the_key():
    cache = small_cache()
    entry = add_dense(cache, "a")
    free = cache.pool.num_free
    assert cache.make_room(free + 1)
    expected = CompactionConfig("uniform", 0.6, min_keep=1).kept_positions(PREFIX_LEN, [SPAN])
    assert len(expected) == 4 + 12  # text kept, 12 of 20 visual tokens
    assert cache.prefixes["a"] is entry and entry.alive  # same key, compacted in place, not evicted
    assert entry.kept.positions.tolist() == expected.tolist() == stored_positions(cache, entry)
    assert (entry.kept.selector, entry.kept.keep_ratio, entry.visual_kept) == ("uniform", 0.6, 12)
    assert entry.kv_len == 16 and len(entry.pages) == 4 and entry.kv_offset == PREFIX_LEN - 16 and entry.compact
    v = cache.pool.layers[0].v_cache
    assert [int(v[entry.pages[i // PAGE], 0, i % PAGE, 0]) for i in range(16)] == [-p for p in expected.tolist()]
    stats = cache.counters()
    assert (stats["cache_pressure_compactions"], stats["cache_pressure_pages_freed"]) == (1, 2)
    assert stats["cache_prefix_evictions"] == 0 and cache.pool.num_free == free + 2
    check(cache)


def test_a_later_step_chooses_within_what_the_earlier_kept():
    cache = small_cache(ratios=(0.6, 0.3))
    entry = add_dense(cache, "a")
    cache.make_room(cache.pool.num_free + 1)
    first = entry.kept.positions.clone()
    cache.make_room(cache.pool.num_free + 1)
    second = CompactionConfig("uniform", 0.3, min_keep=1).kept_positions(PREFIX_LEN, [SPAN], within=first)
    assert entry.kept.positions.tolist() == second.tolist() == stored_positions(cache, entry)
    assert set(second.tolist()) < set(first.tolist()) and entry.kept.keep_ratio == 0.3 and entry.visual_kept == 6
    assert len(entry.pages) == 3 and cache.counters()["cache_pressure_compactions"] == 2
    assert cache.next_step(entry) is None  # every step done: the next pressure evicts it
    assert cache.make_room(cache.pool.num_pages) and not entry.alive
    assert cache.counters()["cache_prefix_evictions"] == 1
    check(cache)


def test_reclaim_order_extensions_then_every_first_step_then_eviction():
    cache = small_cache(num_pages=24, ratios=(0.6, 0.3))
    cold, hot = add_dense(cache, "cold"), add_dense(cache, "hot", hits=5)
    ext_pages = [*hot.pages[:5], *cache.pool.allocate(2)]  # a finished turn after hot's prefix
    ext = cache.add_extension(hot, list(range(100, 130)), ext_pages, 30)
    cache.pool.release(ext_pages[5:])
    used = cache.pool.num_free
    cache.make_room(used + 1)
    assert not ext.alive and cold.kept.selector is None and hot.kept.selector is None  # the extension went first
    cache.make_room(cache.pool.num_free + 1)
    assert cold.kept.keep_ratio == 0.6 and hot.kept.keep_ratio == 1.0  # lowest value first
    cache.make_room(cache.pool.num_free + 1)
    assert cold.kept.keep_ratio == hot.kept.keep_ratio == 0.6  # every entry's first step before a second
    cache.make_room(cache.pool.num_free + 1)
    assert cold.kept.keep_ratio == 0.3 and hot.kept.keep_ratio == 0.6
    cache.make_room(cache.pool.num_free + 1)
    cache.make_room(cache.pool.num_free + 1)
    assert not cold.alive and hot.alive and cache.stats.prefix_evictions == 1  # then eviction, by value
    check(cache)


def test_an_entry_a_request_reads_never_moves():
    cache = small_cache(num_pages=12)
    entry = add_dense(cache, "a")
    reader = cache.acquire(cache.lookup("a", [*entry.tokens, 1], PREFIX_LEN))  # a running request's table
    before = (list(entry.pages), stored_positions(cache, entry))
    assert not cache.compactable()
    assert not cache.make_room(cache.pool.num_free + 1)  # nothing may go: the request reads it
    assert (entry.pages, stored_positions(cache, entry)) == before and entry.kept.selector is None
    with pytest.raises(RuntimeError):
        cache.compact(entry, 0, entry.kept.positions[:8])
    check(cache, reader)
    cache.release_user(entry)
    cache.pool.release(reader)
    assert cache.make_room(cache.pool.num_free + 1) and entry.compact


def test_compact_drops_the_entrys_extensions():
    cache = small_cache()
    entry = add_dense(cache, "a")
    pages = [*entry.pages[:5], *cache.pool.allocate(2)]
    ext = cache.add_extension(entry, list(range(100, 128)), pages, 28)
    cache.pool.release(pages[5:])
    plan = CompactionConfig("uniform", 0.6, min_keep=1).kept_positions(PREFIX_LEN, [SPAN])
    freed = cache.compact(entry, 0, plan)
    assert not ext.alive and not entry.children and freed == 2
    assert cache.stats.extension_evictions == 1
    check(cache)


def test_key_ignores_the_entry_state_but_names_the_policy(tiny_engine_factory):
    always = tiny_engine_factory(**EXACT)
    stepped = tiny_engine_factory(**EXACT, compaction_mode="on_pressure", pressure_keep_ratios=(0.6, 0.4))
    one = tiny_engine_factory(**EXACT, compaction_mode="on_pressure")
    names = {e.prefix_reuse.key_namespace() for e in (always, stepped, one)}
    assert len(names) == 3


@pytest.mark.parametrize("options", [
    {"compaction_mode": "later"},
    {"compaction_mode": "on_pressure", "pressure_keep_ratios": (0.4, 0.6)},
    {"compaction_mode": "on_pressure", "pressure_keep_ratios": (0.6, 1.0)},  # 1.0 only first
    {"compaction_mode": "on_pressure", "pressure_keep_ratios": (1.0, 1.0)},
    {"compaction_mode": "on_pressure", "pressure_keep_ratios": (0.6, 0.0)},
    {"compaction_mode": "on_pressure", "pressure_keep_ratios": (1.5,)},
    {"compaction_mode": "always", "pressure_keep_ratios": (0.4, 0.6)},  # refused in every mode
    {"compaction_mode": "on_pressure", "keep_ratio": 0.0},
])
def test_bad_options_are_refused(options):
    with pytest.raises(InvalidRequestError):
        EngineOptions(**options).pressure_steps()


@pytest.mark.parametrize("options", [{"keep_ratio": 1.0}, {"pressure_keep_ratios": (1.0,)},
                                     {"keep_ratio": 0.4, "pressure_keep_ratios": (1.0,)}])
def test_keep_ratio_one_under_on_pressure_is_no_step(options):
    """Keeping every token frees nothing: 1.0 is valid and means "never compact on pressure"."""
    assert EngineOptions(compaction_mode="on_pressure", **options).pressure_steps() == ()


def test_a_leading_one_is_dropped_and_the_rest_are_steps():
    steps = EngineOptions(compaction_mode="on_pressure", pressure_keep_ratios=(1.0, 0.6, 0.3)).pressure_steps()
    assert [s.keep_ratio for s in steps] == [0.6, 0.3]


def test_a_cache_with_a_keep_one_step_evicts_instead_of_compacting():
    """PrefixCache takes the same ratios as the options: a 1.0 step is no step (the entry stays
    dense and goes whole), a 1.0 after another step or a step without a selector is refused."""
    cache = small_cache(ratios=(1.0,))
    assert cache.pressure_steps == ()
    entry = add_dense(cache, "a")
    assert cache.make_room(cache.pool.num_free + 1)
    assert not entry.alive and cache.stats.prefix_evictions == 1 and cache.stats.pressure_compactions == 0
    assert [s.keep_ratio for s in small_cache(ratios=(1.0, 0.6)).pressure_steps] == [0.6]
    for ratios in ((0.6, 1.0), (1.0, 1.0), (0.6, 0.6), (0.0,)):
        with pytest.raises(ValueError):
            small_cache(ratios=ratios)
    with pytest.raises(ValueError):
        PrefixCache(cache.pool, (CompactionConfig(None, 0.6),))


def test_no_steps_without_on_pressure_or_a_selector():
    assert EngineOptions(compaction_mode="always").pressure_steps() == ()
    assert [s.keep_ratio for s in EngineOptions().pressure_steps()] == [0.6]  # the default: on pressure, one step
    assert EngineOptions(compaction=None, compaction_mode="on_pressure").pressure_steps() == ()
    steps = EngineOptions(compaction_mode="on_pressure", pressure_keep_ratios=(0.6, 0.4)).pressure_steps()
    assert [s.keep_ratio for s in steps] == [0.6, 0.4]


# ------------------------------------------------------------------------------------------------
# engines
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def photos(media_path):
    def load(name):
        with Image.open(media_path(name)) as im:
            return im.convert("RGB")

    return [load(n + ".png") for n in ("astronaut", "chelsea", "coffee")]


@pytest.fixture(scope="module")
def oracles(tiny_engine_factory):
    """(dense reference: compaction off; compact reference: keep 0.6 always), exact pages."""
    return (tiny_engine_factory(**EXACT, compaction=None, conversation_reuse=False),
            tiny_engine_factory(**EXACT, conversation_reuse=False))


def guard_moves(engine) -> list[tuple[int, int]]:
    """Wrap the pool's ``keep_slots`` (the one place a compaction orders its slot moves) so that a
    move touching a page in a running request's block table, when it is decided, fails the step
    (and so the test); returns the list of (slots moved, pages they span). The move runs at the
    start of the next step, before any forward: a page freed by it and handed to a request of that
    step is written by that step only after the move read it."""
    pool, scheduler, moves = engine.pool, engine.loop.scheduler, []
    original = pool.keep_slots

    def checked(table, kept):
        touched = {table[i // pool.page_size] for i in (*kept, *range(len(kept)))}
        for req in scheduler.running:
            assert not touched & set(req.block_table), "a running request's prefix pages moved"
        moves.append((len(kept), len(touched)))
        return original(table, kept)

    pool.keep_slots = checked
    return moves


def entry_of(engine, messages, salt):
    prompt = engine.prompts.build(messages, salt)
    return engine.prefix_cache.prefixes.get(engine.prefix_reuse.key(prompt, salt))


def expected(oracles, engine, messages, tel, kept=None) -> list[int]:
    """What a request's tokens must be: dense prefix -> the compaction-off engine; compact -> the
    masked dense oracle on the positions the entry kept."""
    if tel.prefix_form != "compact":
        return oracles[0].generate(messages, SP, cache_salt="ref").token_ids
    return masked_greedy(engine, messages, N_TOKENS, kept)


def test_large_pool_never_compacts_and_equals_compaction_off(tiny_engine_factory, photos, oracles):
    engine = tiny_engine_factory(**EXACT, compaction_mode="on_pressure")
    for question in QUESTIONS[:2]:
        for i, img in enumerate(photos):
            messages = media_first_messages([img], question)
            got = engine.generate(messages, SP, cache_salt=f"s{i}")
            assert got.telemetry.prefix_form == "dense"
            assert got.telemetry.visual_tokens_kept == got.telemetry.visual_tokens > 0
            assert got.telemetry.prefix_pages == got.telemetry.prefix_pages_dense
            assert got.token_ids == oracles[0].generate(messages, SP, cache_salt=f"r{i}").token_ids
    stats = engine.stats()
    assert stats["cache_hits"] == 3 and stats["cache_pressure_compactions"] == stats["cache_evictions"] == 0
    assert stats["cache_prefix_pages"] == stats["cache_prefix_pages_dense"]
    assert all(not e.compact for e in engine.prefix_cache.prefixes.values())


def test_compacted_entrys_next_hit_computes_only_the_question(tiny_engine_factory, photos, oracles):
    """Pool of 9 pages, no conversation reuse: A's dense prefix (5 pages) is cached, B's request
    needs more than the 4 left, so A is compacted (to 3 pages), not evicted; A's next question hits
    the compact entry, prefills only its own tokens and equals the masked oracle."""
    engine = tiny_engine_factory(**{**EXACT, "kv_cache_bytes": pool_bytes(9)}, compaction_mode="on_pressure",
                                 conversation_reuse=False)
    moves = guard_moves(engine)
    a, b = photos[0], photos[1]
    first = engine.generate(media_first_messages([a], QUESTIONS[0]), SP, cache_salt="a")
    assert (first.telemetry.prefix_cache, first.telemetry.prefix_form) == ("miss", "dense")
    dense_pages = first.telemetry.prefix_pages_dense
    assert first.telemetry.prefix_pages == dense_pages == 5 and engine.stats()["pages_free"] == 4
    (shown,) = engine.prefix_info("a")  # what the image viewer shows: dense while it fits
    assert (shown["selector"], shown["keep_ratio"], shown["kept_count"]) == (None, 1.0, first.telemetry.visual_tokens)
    engine.generate(media_first_messages([b], QUESTIONS[0]), SP, cache_salt="b")
    (shown,) = engine.prefix_info("a")  # ... and what the compaction kept once it ran
    assert (shown["selector"], shown["keep_ratio"]) == ("uniform", 0.6)
    assert shown["kept_count"] < first.telemetry.visual_tokens
    stats = engine.stats()
    assert stats["cache_pressure_compactions"] == 1 and stats["cache_evictions"] == 0 and moves
    messages = media_first_messages([a], QUESTIONS[1])
    entry = entry_of(engine, messages, "a")
    assert entry is not None and entry.compact and not entry.children
    kept = entry.kept.positions.clone()
    hit = engine.generate(messages, SP, cache_salt="a")
    tel = hit.telemetry
    assert (tel.prefix_cache, tel.prefix_form) == ("hit", "compact")
    prefix_len = engine.prompts.build(messages).prefix_len
    assert tel.cached_tokens == prefix_len and tel.computed_tokens == tel.prompt_tokens - prefix_len
    assert tel.visual_tokens_kept == int(kept.lt(prefix_len).sum()) - (prefix_len - tel.visual_tokens)
    assert tel.visual_tokens_kept < tel.visual_tokens
    assert dense_pages - tel.prefix_pages == 2  # A's compaction freed its dense minus its compact pages
    assert hit.token_ids == masked_greedy(engine, messages, N_TOKENS, kept)
    assert hit.token_ids == oracles[1].generate(messages, SP, cache_salt="ref").token_ids  # the same 0.6 tokens


def test_pages_freed_equal_dense_minus_compact(tiny_engine_factory, photos):
    engine = tiny_engine_factory(**{**EXACT, "kv_cache_bytes": pool_bytes(9)}, compaction_mode="on_pressure",
                                 conversation_reuse=False)
    engine.generate(media_first_messages([photos[0]], QUESTIONS[0]), SP, cache_salt="a")
    engine.generate(media_first_messages([photos[1]], QUESTIONS[0]), SP, cache_salt="b")
    stats = engine.stats()
    compacted = [e for e in engine.prefix_cache.prefixes.values() if e.compact]
    assert len(compacted) == stats["cache_pressure_compactions"] == 1
    assert stats["cache_pressure_pages_freed"] == sum(e.dense_pages - len(e.pages) for e in compacted) == 2


@pytest.mark.parametrize("ratios,pages", [(None, 12), ((0.6, 0.4), 11)], ids=["one-step", "two-steps"])
def test_sessions_under_a_small_pool_equal_the_masked_oracle(tiny_engine_factory, photos, oracles, ratios, pages):
    """Three sessions asked in turn with conversation reuse on, a pool for about two dense
    prefixes and a request (11-12 pages; dense prefixes take 4-5): extensions go, entries are
    compacted (with two steps, to 0.4 as well), and every answer equals its oracle: dense hits
    the compaction-off engine, compact hits the masked dense oracle on exactly the positions the
    entry held when the request ran."""
    engine = tiny_engine_factory(**{**EXACT, "kv_cache_bytes": pool_bytes(pages)}, compaction_mode="on_pressure",
                                 pressure_keep_ratios=ratios)
    moves = guard_moves(engine)
    forms = []
    for question in QUESTIONS:
        for i, img in enumerate(photos):
            messages = media_first_messages([img], question)
            entry = entry_of(engine, messages, f"s{i}")
            got = engine.generate(messages, SP, cache_salt=f"s{i}")
            tel = got.telemetry
            forms.append((tel.prefix_cache, tel.prefix_form))
            if tel.prefix_form == "compact":
                # the entry found is the one used (nothing else ran meanwhile); its kept tokens now
                kept = entry.kept.positions if entry is not None and entry.alive else None
                assert kept is not None
                assert got.token_ids == masked_greedy(engine, messages, N_TOKENS, kept), (question, i)
            else:
                assert got.token_ids == expected(oracles, engine, messages, tel), (question, i)
    stats = engine.stats()
    assert stats["cache_pressure_compactions"] >= 2 and moves and ("hit", "compact") in forms
    if ratios:  # some entry had the second step, and was hit after it
        assert any(e.kept.keep_ratio == 0.4 for e in engine.prefix_cache.prefixes.values())
    for e in engine.prefix_cache.prefixes.values():
        assert all(c.kv_offset == e.kv_offset for c in e.children)  # extensions only of the current form


def test_concurrent_sessions_hitting_while_another_compacts_stay_exact(tiny_engine_factory, photos, oracles):
    """Three sessions' questions sent at once from threads, twice over, into a pool that makes the
    loop compact while other requests hit: every answer equals its oracle (the form it reports
    says which), and no running request's pages ever move."""
    engine = tiny_engine_factory(**{**EXACT, "kv_cache_bytes": pool_bytes(14)}, compaction_mode="on_pressure")
    moves = guard_moves(engine)
    for i, img in enumerate(photos[:2]):
        engine.generate(media_first_messages([img], QUESTIONS[0]), SP, cache_salt=f"s{i}")
    results: dict = {}

    def ask(i, question):
        messages = media_first_messages([photos[i]], question)
        results[(i, question)] = (messages, engine.generate(messages, SP, cache_salt=f"s{i}"))

    for question in QUESTIONS[1:]:
        threads = [threading.Thread(target=ask, args=(i, question)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert len(results) == 6
    compact_ref = oracles[1]
    for (i, question), (messages, got) in results.items():
        tel = got.telemetry
        if tel.prefix_form == "compact":  # one step: the uniform 0.6 tokens, as an always-compacting engine
            assert got.token_ids == compact_ref.generate(messages, SP, cache_salt="ref").token_ids, (i, question)
        else:
            assert got.token_ids == oracles[0].generate(messages, SP, cache_salt="ref").token_ids, (i, question)
    assert engine.stats()["cache_pressure_compactions"] >= 1 and moves
