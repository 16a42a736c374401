"""Selectors beyond uniform (issue 20, section 4): the attention (VisionZip-like), diversity
(DivPrune-like) and random selectors and the token scores they read
(:mod:`engine.cache.token_scores`).

What each test proves is in its docstring. The engine tests run every selector of ``SELECTORS``
on the tiny test checkpoint; their oracle equality (hit == cold == masked dense reference) is in
tests/test_prefix_cache.py (``compact_pair`` is parametrized over ``SELECTORS``).
"""

from __future__ import annotations

import inspect
import io
import types

import pytest
import torch
from PIL import Image

from engine import SamplingParams, media_first_messages
from engine.cache.compaction import SELECTOR_SCORES, SELECTORS, CompactionConfig
from engine.cache.token_scores import SCORE_NAMES, content_random, max_min_order, prefix_scores
from engine.model.rope import VisualSpan
from engine.model.vision import VisionAttention, VisionFeatures

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)
GRIDS = [(1, 1), (2, 3), (4, 4), (8, 8), (9, 23), (16, 16)]
RATIOS = [0.05, 0.25, 0.4, 0.6, 0.8, 1.0]
#: Visual tokens each GRIDS span (1, 6, 16, 64, 207, 256 tokens) keeps at a ratio (min_keep 1),
#: worked out by hand: round(ratio * n) with ties to even, at least 1, at most n. The ratios are
#: RATIOS and their halves (the candidates' step). Ties: 6 * 0.25 = 1.5 -> 2, 207 * 0.5 = 103.5 -> 104.
KEPT = {
    0.05: [1, 1, 1, 3, 10, 13],  # 0.05 0.3 0.8 3.2 10.35 12.8
    0.025: [1, 1, 1, 2, 5, 6],  # 0.025 0.15 0.4 1.6 5.175 6.4
    0.25: [1, 2, 4, 16, 52, 64],  # 0.25 1.5 4 16 51.75 64
    0.125: [1, 1, 2, 8, 26, 32],  # 0.125 0.75 2 8 25.875 32
    0.4: [1, 2, 6, 26, 83, 102],  # 0.4 2.4 6.4 25.6 82.8 102.4
    0.2: [1, 1, 3, 13, 41, 51],  # 0.2 1.2 3.2 12.8 41.4 51.2
    0.6: [1, 4, 10, 38, 124, 154],  # 0.6 3.6 9.6 38.4 124.2 153.6
    0.3: [1, 2, 5, 19, 62, 77],  # 0.3 1.8 4.8 19.2 62.1 76.8
    0.8: [1, 5, 13, 51, 166, 205],  # 0.8 4.8 12.8 51.2 165.6 204.8
    1.0: [1, 6, 16, 64, 207, 256],
    0.5: [1, 3, 8, 32, 104, 128],  # 0.5 3 8 32 103.5 128
}


def spans_and_features(grids, start: int = 5, seed: int = 0):
    """Image spans for ``grids`` separated by 3 text tokens, random features (with attention), a
    content hash per image, and the prefix length (2 text tokens after the last span)."""
    gen = torch.Generator().manual_seed(seed)
    spans, pos = [], start
    for i, (h, w) in enumerate(grids):
        spans.append(VisualSpan(start=pos, grid_h=h, grid_w=w, kind="image", item=i))
        pos += h * w + 3
    v = sum(s.length for s in spans)
    feats = VisionFeatures(torch.randn(v, 16, generator=gen), [], torch.rand(v, generator=gen))
    hashes = {("image", i): f"hash{seed}-{i}" for i in range(len(grids))}
    return spans, feats, hashes, pos


def all_scores(spans, feats, hashes, prefix_len):
    return prefix_scores(SCORE_NAMES, prefix_len, spans, hashes, feats)


# ------------------------------------------------------------------------------------------------
# counts, order, candidates
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("selector", sorted(SELECTORS))
@pytest.mark.parametrize("ratio", RATIOS)
def test_every_selector_keeps_exactly_the_requested_count(selector, ratio):
    """Each selector returns exactly ``k`` distinct increasing offsets inside the span, for every
    grid and ratio, and with candidates (an earlier step's kept tokens) exactly ``k`` of them."""
    spans, feats, hashes, n = spans_and_features(GRIDS)
    scores = all_scores(spans, feats, hashes, n)
    select = SELECTORS[selector]
    gen = torch.Generator().manual_seed(1)
    assert [s.length for s in spans] == [1, 6, 16, 64, 207, 256]
    for span, k, half in zip(spans, KEPT[ratio], KEPT[ratio / 2], strict=True):
        own = {name: t[span.start : span.end] for name, t in scores.items()}
        kept = select(span, k, own, None)
        assert len(kept) == k and kept.dtype == torch.long
        assert torch.equal(kept, kept.unique()) and (kept >= 0).all() and (kept < span.length).all()
        candidates = torch.randperm(span.length, generator=gen)[: max(1, span.length * 2 // 3)].sort().values
        k2 = min(half, len(candidates))
        chosen = select(span, k2, own, candidates)
        assert len(chosen) == k2 and torch.equal(chosen, chosen.unique())
        assert set(chosen.tolist()) <= set(candidates.tolist())
        with pytest.raises(ValueError, match="cannot keep"):
            select(span, len(candidates) + 1, own, candidates)


@pytest.mark.parametrize("selector", sorted(SELECTORS))
def test_kept_positions_keep_the_count_per_span_and_drop_the_rest(selector):
    """Through :meth:`CompactionConfig.kept_positions`: text and markers all stay, each span keeps
    exactly ``keep_count`` tokens; so a ratio below 1 really drops tokens."""
    spans, feats, hashes, n = spans_and_features(GRIDS)
    cfg = CompactionConfig(selector, 0.4, 1)
    kept = cfg.kept_positions(n, spans, all_scores(spans, feats, hashes, n))
    keep = torch.zeros(n, dtype=torch.bool)
    keep[kept] = True
    visual = torch.zeros(n, dtype=torch.bool)
    for s, k in zip(spans, KEPT[0.4], strict=True):
        visual[s.start : s.end] = True
        assert int(keep[s.start : s.end].sum()) == k
    assert keep[~visual].all()
    assert len(kept) < n


@pytest.mark.parametrize("selector", ["attention", "diversity", "random"])
def test_score_selectors_are_nested_so_stepwise_equals_direct(selector):
    """A later compaction step (1.0 -> 0.6 -> 0.4, ``within`` the earlier kept tokens, from the
    stored scores) keeps exactly what a direct 0.4 keeps: the priority orders are nested."""
    spans, feats, hashes, n = spans_and_features(GRIDS)
    scores = all_scores(spans, feats, hashes, n)
    first = CompactionConfig(selector, 0.6, 1).kept_positions(n, spans, scores)
    second = CompactionConfig(selector, 0.4, 1).kept_positions(n, spans, scores, within=first)
    direct = CompactionConfig(selector, 0.4, 1).kept_positions(n, spans, scores)
    assert torch.equal(second, direct)
    assert len(direct) < len(first) < n


def test_score_selectors_keep_the_highest_priorities():
    """Each score selector keeps the ``k`` tokens of highest priority: the ``k`` most attended,
    the first ``k`` of the max-min order, the ``k`` largest content-seeded draws."""
    span = VisualSpan(start=0, grid_h=4, grid_w=4, kind="image", item=0)
    priority = torch.tensor([float((7 * i) % 16) for i in range(16)])
    for name in ("attention", "diversity", "random"):
        kept = SELECTORS[name](span, 5, {name: priority}, None)
        assert kept.tolist() == sorted(torch.topk(priority, 5).indices.tolist())


@pytest.mark.parametrize("selector", ["attention", "diversity", "random"])
def test_score_selectors_refuse_a_prefix_built_without_their_scores(selector):
    span = VisualSpan(start=0, grid_h=2, grid_w=2, kind="image", item=0)
    with pytest.raises(ValueError, match="needs the prefix"):
        SELECTORS[selector](span, 2, None, None)
    with pytest.raises(ValueError, match="needs the prefix"):
        SELECTORS[selector](span, 2, {"other": torch.zeros(4)}, None)


# ------------------------------------------------------------------------------------------------
# the scores
# ------------------------------------------------------------------------------------------------


def test_scores_are_priorities_over_prefix_positions_zero_outside_spans():
    """One float32 ``[prefix_len]`` per name (4 bytes a token), 0 on text; diversity is a
    permutation of ``n .. 1`` per span; attention is the features' attention at the span rows."""
    spans, feats, hashes, n = spans_and_features(GRIDS)
    scores = all_scores(spans, feats, hashes, n)
    visual = torch.zeros(n, dtype=torch.bool)
    row = 0
    for s in spans:
        visual[s.start : s.end] = True
        assert sorted(scores["diversity"][s.start : s.end].tolist()) == list(range(1, s.length + 1))
        assert torch.equal(scores["attention"][s.start : s.end], feats.attention[row : row + s.length])
        row += s.length
    for t in scores.values():
        assert t.shape == (n,) and t.dtype == torch.float32 and (t[~visual] == 0).all()


def test_max_min_order_covers_clusters_before_repeating_one():
    """Four tight clusters of 6 points: the first 4 picks of the greedy max-min order hit 4
    different clusters (a selector keeping 4 tokens keeps one of each)."""
    gen = torch.Generator().manual_seed(3)
    centres = torch.eye(8)[:4] * 10
    points = (centres.repeat_interleave(6, 0) + 0.05 * torch.randn(24, 8, generator=gen))
    perm = torch.randperm(24, generator=gen)
    order = max_min_order(points[perm])
    assert sorted(order.tolist()) == list(range(24))
    clusters = {int(perm[i]) // 6 for i in order[:4].tolist()}
    assert clusters == {0, 1, 2, 3}


def test_random_scores_depend_on_the_content_only():
    """The control's draws are a function of (content hash, frame): equal for equal content,
    different for different images or frames."""
    assert torch.equal(content_random("abc", 0, 64), content_random("abc", 0, 64))
    assert not torch.equal(content_random("abc", 0, 64), content_random("abd", 0, 64))
    assert not torch.equal(content_random("abc", 0, 64), content_random("abc", 1, 64))


def test_received_attention_equals_the_full_softmax_column_means():
    """The chunked score pass equals the plain computation (softmax over keys of each image,
    averaged over heads and queries) with chunks of a few queries, and each image's values sum
    to 1."""
    cfg = types.SimpleNamespace(num_heads=2, head_dim=8, hidden_size=16)
    torch.manual_seed(0)
    attn = VisionAttention(cfg)
    seg = [12, 20]
    x = torch.randn(sum(seg), 16)
    angle = torch.randn(sum(seg), 4)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    with torch.no_grad():
        got = attn.received_attention(x, cos, sin, seg, max_elements=2 * 3 * 20)  # 3-query chunks
        from ops.fused import rope_float32_reference
        qkv = attn.qkv(x).view(sum(seg), 6, 8)
        q, k = rope_float32_reference(qkv[:, :2], cos, sin), rope_float32_reference(qkv[:, 2:4], cos, sin)
        want, start = [], 0
        for n in seg:
            qs, ks = q[start : start + n].transpose(0, 1), k[start : start + n].transpose(0, 1)
            w = torch.softmax(qs @ ks.transpose(1, 2) / 8**0.5, -1)  # [heads, n, n]
            want.append(w.mean((0, 1)))
            start += n
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[:12].sum(), torch.tensor(1.0))
    torch.testing.assert_close(got[12:].sum(), torch.tensor(1.0))


# ------------------------------------------------------------------------------------------------
# through the engine (tiny checkpoint)
# ------------------------------------------------------------------------------------------------


def png(seed: int, size: tuple[int, int]) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(size[1], size[0], 3, generator=gen) * 255).to(torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


A, B = png(11, (256, 320)), png(12, (320, 256))


def ask(engine, salt: str, question: str):
    done = engine.generate(media_first_messages([{"image": A}, {"image": B}], question), ONE_TOKEN, cache_salt=salt)
    return done, engine.prefix_cache.latest_prefix(salt)


def test_selectors_take_no_question_input():
    """A selector's only inputs are the span, ``k``, the stored scores and the candidates; the
    scores are computed from spans, media hashes and vision features (no prompt, no question)."""
    for select in SELECTORS.values():
        assert list(inspect.signature(select).parameters) == ["span", "k", "scores", "candidates"]
    params = set(inspect.signature(prefix_scores).parameters)
    assert params == {"needs", "prefix_len", "spans", "hashes", "features", "offsets"}


@pytest.mark.parametrize("selector", sorted(SELECTORS))
def test_same_images_different_question_keep_the_same_tokens(tiny_engine_factory, selector):
    """Two sessions ask different questions about the same images: their compact prefixes keep
    the same tokens and store the same scores, so a selector that read the question would fail
    (the prefix ids are the same; the question tokens differ)."""
    engine = tiny_engine_factory(kv_cache_bytes=32 << 20, compaction=selector, keep_ratio=0.4, min_keep=1)
    first, a = ask(engine, "one", "What is in these pictures?")
    second, b = ask(engine, "two", "Which picture is brighter, and why? Answer in detail.")
    assert first.telemetry.prefix_cache == second.telemetry.prefix_cache == "miss"
    assert torch.equal(a.kept.positions, b.kept.positions)
    assert (a.scores is None) == (b.scores is None) == (SELECTOR_SCORES[selector] == ())
    if a.scores is not None:
        assert a.scores.keys() == b.scores.keys() == set(SELECTOR_SCORES[selector])
        for name in a.scores:
            assert torch.equal(a.scores[name], b.scores[name])


@pytest.mark.parametrize("selector", sorted(SELECTORS))
def test_compaction_really_drops_tokens_and_pages(tiny_engine_factory, selector):
    """With keep 0.4 every selector's cached prefix keeps exactly ``keep_count`` visual tokens per
    image (fewer than it has), and its KV holds fewer pages than the dense prefix; a hit reports
    the same. A compaction that silently kept everything fails here."""
    engine = tiny_engine_factory(kv_cache_bytes=32 << 20, compaction=selector, keep_ratio=0.4, min_keep=1)
    cold, entry = ask(engine, "s", "What is in these pictures?")
    hit, _ = ask(engine, "s", "Describe the second picture.")
    prompt = engine.prompts.build(media_first_messages([{"image": A}, {"image": B}], "x"), "s")
    assert [(s.grid_h, s.grid_w) for s in prompt.spans] == [(10, 8), (8, 10)]  # 256 x 320 and 320 x 256 px
    want = 32 + 32  # 0.4 * 80 tokens per image
    assert hit.telemetry.prefix_cache == "hit"
    for done in (cold, hit):
        assert done.telemetry.visual_tokens_kept == want < done.telemetry.visual_tokens == prompt.num_visual_tokens
        assert done.telemetry.prefix_pages < done.telemetry.prefix_pages_dense
    assert len(entry.kept.positions) == prompt.prefix_len - prompt.num_visual_tokens + want


def test_attention_engine_encodes_with_the_score_pass_only_when_needed(tiny_engine_factory):
    """The attention selector's engine gets attention with its vision features; the others'
    features carry none (the score pass is off their path)."""
    messages = media_first_messages([{"image": A}], "What is this?")
    with_pass = tiny_engine_factory(kv_cache_bytes=32 << 20, compaction="attention")
    without = tiny_engine_factory(kv_cache_bytes=32 << 20, compaction="diversity")
    feats = with_pass.vision_features(with_pass.prompts.build(messages))
    assert feats.attention is not None and feats.attention.shape == (feats.embeds.shape[0],)
    torch.testing.assert_close(feats.attention.sum().cpu(), torch.tensor(1.0))  # one image's share sums to 1
    assert without.vision_features(without.prompts.build(messages)).attention is None


def test_video_frames_get_scores_only_when_compacted():
    """Scores are computed for the spans the configuration compacts: video frames only with
    ``compact_video`` (their diversity order would otherwise be wasted work)."""
    image = VisualSpan(start=0, grid_h=2, grid_w=2, kind="image", item=0)
    frame = VisualSpan(start=6, grid_h=2, grid_w=2, kind="video", item=0, frame=1)
    assert CompactionConfig("diversity").compacted_spans([image, frame]) == [image]
    assert CompactionConfig("diversity", compact_video=True).compacted_spans([image, frame]) == [image, frame]


@pytest.mark.parametrize("method", sorted(m for m, names in SELECTOR_SCORES.items() if names and m != "coverage"))
def test_kept_positions_follow_each_spans_own_stored_scores(method):
    """Through :meth:`CompactionConfig.kept_positions` (the path compaction takes), a score-based
    selector keeps, in each span, the tokens of highest stored priority in *that span's* slice of
    the prefix scores: what it keeps moves when only the scores move."""
    spans = [VisualSpan(start=3, grid_h=4, grid_w=4, kind="image", item=0),
             VisualSpan(start=21, grid_h=2, grid_w=4, kind="image", item=1)]
    prefix_len = 31
    gen = torch.Generator().manual_seed(7)
    cfg = CompactionConfig(method, keep_ratio=0.5, min_keep=1)
    for _ in range(3):
        scores = {name: torch.rand(prefix_len, generator=gen) for name in cfg.score_names}
        kept = cfg.kept_positions(prefix_len, spans, scores=scores)
        expected = torch.ones(prefix_len, dtype=torch.bool)
        for s, k in zip(spans, (8, 4), strict=True):  # half of 16 and of 8 tokens
            expected[s.start : s.end] = False
            top = torch.topk(scores[cfg.score_names[0]][s.start : s.end], k).indices
            expected[s.start + top] = True
        assert kept.tolist() == expected.nonzero().flatten().tolist()


# ------------------------------------------------------------------------------------------------
# staggered uniform and the coverage hybrid (issue 35.3)
# ------------------------------------------------------------------------------------------------


def test_staggered_keeps_the_hand_computed_positions_where_uniform_drops_columns():
    """2 x 5 grid, keep 6. Uniform over the row-major order keeps floor((j + 1/2) * 10/6) =
    0, 2, 4, 5, 7, 9: columns 0, 2, 4 in both rows, columns 1 and 3 gone. Staggered gives each row
    3 (floor(5 * 6/10) - 0 = 3, then 6 - 3); row 0 (phase 0) keeps floor(j * 5/3) = 0, 1, 3, row 1
    (phase frac(PHI) = 0.618) floor((j + 0.618) * 5/3) = 1, 2, 4, i.e. offsets 6, 7, 9: every column
    keeps a token."""
    span = VisualSpan(start=0, grid_h=2, grid_w=5, kind="image", item=0)
    assert SELECTORS["uniform"](span, 6).tolist() == [0, 2, 4, 5, 7, 9]
    assert SELECTORS["staggered"](span, 6).tolist() == [0, 1, 3, 6, 7, 9]


def test_staggered_keeps_no_whole_column_out_where_uniform_does():
    """A 16 x 20 grid at keep 0.6 (192 of 320): uniform's stride 5/3 divides the 20-column rows, so
    every row keeps the same 12 columns and 8 columns vanish (vertical stripes); staggered keeps
    12 tokens in every row and at least one token in every column."""
    span = VisualSpan(start=0, grid_h=16, grid_w=20, kind="image", item=0)
    k = 192  # 0.6 x 320 tokens
    uniform = SELECTORS["uniform"](span, k)
    assert len(set((uniform % 20).tolist())) == 12
    kept = SELECTORS["staggered"](span, k)
    assert len(kept) == k
    assert len(set((kept % 20).tolist())) == 20
    assert torch.bincount(kept // 20, minlength=16).tolist() == [12] * 16


def test_staggered_spreads_candidates_by_row_in_proportion():
    """With candidates (an earlier step's kept tokens): a 2 x 4 grid whose row 0 has candidates
    0, 1, 2, 3 and row 1 only 5, 7; keep 3 of the 6: row 0 gets floor(4 * 3/6) = 2, row 1 the other 1.
    Row 0 (phase 0) takes its candidates floor(j * 4/2) = 0, 2 (offsets 0, 2); row 1 (phase 0.618)
    floor(0.618 * 2/1) = 1, i.e. its second candidate, offset 7."""
    span = VisualSpan(start=0, grid_h=2, grid_w=4, kind="image", item=0)
    assert SELECTORS["staggered"](span, 3, None, torch.tensor([0, 1, 2, 3, 5, 7])).tolist() == [0, 2, 7]


def test_coverage_keeps_each_regions_best_token_before_the_global_top():
    """4 x 4 grid, keep 4: the floor budget is q = 2, regions of side ceil(sqrt(16/2)) = 3 (four
    regions: rows 0-2 / 3 by columns 0-2 / 3). The scores put the 4 highest values in the top-left
    region (offsets 0, 1, 4, 5), which a plain top-4 keeps entirely; coverage first keeps each
    region's best (offsets 0 = 16, 3 = 3, 12 = 2, 15 = 1, in score order), which already uses the 4."""
    span = VisualSpan(start=0, grid_h=4, grid_w=4, kind="image", item=0)
    score = torch.zeros(16)
    score[[0, 1, 4, 5]] = torch.tensor([16.0, 15.0, 14.0, 13.0])
    score[3], score[12], score[15] = 3.0, 2.0, 1.0
    assert SELECTORS["attention"](span, 4, {"attention": score}).tolist() == [0, 1, 4, 5]
    assert SELECTORS["coverage"](span, 4, {"attention": score}).tolist() == [0, 3, 12, 15]


def test_coverage_fills_the_rest_by_score_and_caps_the_floor_at_k():
    """The same scores, keep 6: the four region picks (0, 3, 12, 15), then the two best of the rest
    (1 = 15, 4 = 14). With keep 2 (q = 1, one region of side 4: the whole grid) it is the top 2:
    0 and 1. And with candidates 3, 12, 15 and keep 2 (q = 1, side 4, one region): its best (3),
    then the next best candidate (12)."""
    span = VisualSpan(start=0, grid_h=4, grid_w=4, kind="image", item=0)
    score = torch.zeros(16)
    score[[0, 1, 4, 5]] = torch.tensor([16.0, 15.0, 14.0, 13.0])
    score[3], score[12], score[15] = 3.0, 2.0, 1.0
    own = {"attention": score}
    assert SELECTORS["coverage"](span, 6, own).tolist() == [0, 1, 3, 4, 12, 15]
    assert SELECTORS["coverage"](span, 2, own).tolist() == [0, 1]
    assert SELECTORS["coverage"](span, 2, own, torch.tensor([3, 12, 15])).tolist() == [3, 12]


def test_coverage_refuses_a_prefix_built_without_attention():
    span = VisualSpan(start=0, grid_h=2, grid_w=2, kind="image", item=0)
    with pytest.raises(ValueError, match="needs the prefix"):
        SELECTORS["coverage"](span, 2, None, None)
    with pytest.raises(ValueError, match="needs the prefix"):
        SELECTORS["coverage"](span, 2, {"random": torch.zeros(4)}, None)


def test_coverage_engine_computes_the_attention_scores(tiny_engine_factory):
    """The coverage selector reads the attention score, so its engine runs the score pass."""
    engine = tiny_engine_factory(kv_cache_bytes=32 << 20, compaction="coverage")
    messages = media_first_messages([{"image": A}], "What is this?")
    assert engine.vision_features(engine.prompts.build(messages)).attention is not None
