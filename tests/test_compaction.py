"""Query-independent visual-token selection (:mod:`engine.cache.compaction`): counts, spread, order,
determinism, what is never removed, video handling and configuration errors."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from engine.cache.compaction import SELECTORS, CompactionConfig, keep_count, uniform_selector
from engine.inputs.prompts import media_first_messages
from engine.model.rope import VisualSpan
from engine.model.tiny import IMAGE_PAD_ID, VIDEO_PAD_ID, VISION_END_ID, VISION_START_ID


def span(h: int, w: int, start: int = 0, kind: str = "image", frame: int = 0) -> VisualSpan:
    return VisualSpan(start=start, grid_h=h, grid_w=w, kind=kind, item=0, frame=frame)


def uniform(s: VisualSpan, ratio: float, min_keep: int) -> torch.Tensor:
    """The uniform selector at a keep ratio, as :meth:`CompactionConfig.kept_positions` calls it."""
    return uniform_selector(s, keep_count(s.length, ratio, min_keep))


GRIDS = [(1, 1), (1, 7), (3, 5), (4, 4), (8, 8), (14, 14), (16, 16), (9, 23), (32, 32)]
RATIOS = [0.05, 0.25, 0.5, 0.6, 0.75, 0.999, 1.0]


# ------------------------------------------------------------------------------------------------
# uniform_selector
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("h,w", GRIDS)
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("min_keep", [1, 4, 16])
def test_uniform_count_order_range_and_determinism(h, w, ratio, min_keep):
    s = span(h, w)
    n = h * w
    kept = uniform(s, ratio, min_keep)
    assert kept.dtype == torch.int64 and kept.dim() == 1
    assert min(n, min_keep) <= len(kept) <= n  # exact counts: test_uniform_kept_counts_written_out
    assert bool((kept[1:] > kept[:-1]).all())  # strictly increasing: no duplicates
    assert int(kept.min()) >= 0 and int(kept.max()) < n
    assert torch.equal(kept, uniform(s, ratio, min_keep))
    assert torch.equal(kept, uniform(span(h, w, start=1234, frame=3), ratio, min_keep))  # offsets


# (grid h, grid w, keep_ratio, min_keep, tokens kept), worked out by hand: k = min(n, max(min_keep,
# round(keep_ratio * n))) with round's ties to the even count (2.5 -> 2, 4.5 -> 4, 7.5 -> 8, 38.5 -> 38),
# so an implementation rounding half up (or down, or truncating) fails on some row.
KEPT_COUNTS = [
    (1, 5, 0.5, 1, 2),  # 2.5: tie, to even (half up would keep 3)
    (3, 3, 0.5, 1, 4),  # 4.5: tie, to even
    (5, 5, 0.5, 1, 12),  # 12.5: tie, to even
    (2, 5, 0.25, 1, 2),  # 2.5: tie, to even
    (1, 7, 0.5, 1, 4),  # 3.5: tie, to even (up)
    (3, 5, 0.5, 1, 8),  # 7.5: tie, to even (up)
    (2, 3, 0.25, 1, 2),  # 1.5: tie, to even (up)
    (1, 1, 0.5, 1, 1),  # 0.5 -> 0, then min_keep
    (4, 4, 0.6, 1, 10),  # 9.6
    (8, 8, 0.6, 16, 38),  # 38.4 (a 256 x 256 photo at the default settings)
    (7, 11, 0.5, 1, 38),  # 38.5: tie, to even
    (9, 23, 0.6, 16, 124),  # 124.2
    (14, 14, 0.6, 16, 118),  # 117.6
    (32, 32, 0.6, 16, 614),  # 614.4
    (32, 32, 0.999, 1, 1023),  # 1022.976
    (8, 8, 0.05, 16, 16),  # 3.2 -> min_keep
    (2, 3, 0.1, 16, 6),  # min_keep capped at the span's 6 tokens
    (16, 16, 1.0, 16, 256),
]


@pytest.mark.parametrize("h,w,ratio,min_keep,expected", KEPT_COUNTS)
def test_uniform_kept_counts_written_out(h, w, ratio, min_keep, expected):
    assert len(uniform(span(h, w), ratio, min_keep)) == expected


def test_uniform_small_spans_keep_everything_up_to_min_keep():
    assert uniform(span(2, 3), 0.1, 16).tolist() == list(range(6))  # capped at n
    assert len(uniform(span(4, 4), 0.1, 16)) == 16
    assert len(uniform(span(8, 8), 0.1, 16)) == 16
    assert uniform(span(8, 8), 1.0, 1).tolist() == list(range(64))


@pytest.mark.parametrize("side", [4, 8, 14, 16, 28, 32])
@pytest.mark.parametrize("ratio", [0.25, 0.4, 0.6, 0.8])
def test_uniform_is_evenly_spread_over_rows_and_columns(side, ratio):
    """Square grids: every row keeps its share k / side of the k kept tokens, within one token; the
    gaps between kept tokens differ by at most one."""
    kept = uniform(span(side, side), ratio, 1)
    k = len(kept)
    rows = torch.bincount(kept // side, minlength=side)
    assert bool((rows > 0).all())
    assert float((rows.float() - k / side).abs().max()) < 1
    gaps = kept[1:] - kept[:-1]
    assert int(gaps.max()) - int(gaps.min()) <= 1
    if ratio >= 0.4:  # no column is dropped entirely either (the stride is below 2 + 1/side)
        assert len(set((kept % side).tolist())) >= side // 2


def test_selectors_registry():
    assert set(SELECTORS) == {"uniform", "staggered", "attention", "coverage", "diversity", "random"}
    assert SELECTORS["uniform"] is uniform_selector


# ------------------------------------------------------------------------------------------------
# CompactionConfig.kept_positions
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def builder(tiny_ckpt):
    from transformers import AutoProcessor

    from engine.inputs.prompts import PromptBuilder

    return PromptBuilder(AutoProcessor.from_pretrained(str(tiny_ckpt)), image_token_id=IMAGE_PAD_ID,
                         video_token_id=VIDEO_PAD_ID, merge_size=2, max_pixels=256 * 256)


def _image_prompt(builder):
    images = [Image.new("RGB", (256, 256), "red"), Image.new("RGB", (320, 192), "blue"),
              Image.new("RGB", (96, 96), "green")]
    return builder.build(media_first_messages(images, "What differs?"))


def test_kept_positions_never_remove_text_or_vision_markers(builder):
    prompt = _image_prompt(builder)
    ids = torch.tensor(prompt.input_ids)
    n = prompt.prefix_len
    assert len(prompt.spans) == 3 and min(s.length for s in prompt.spans) == 64
    assert int(ids[n - 1]) == VISION_END_ID
    assert [s.length for s in prompt.spans] == [64, 77, 64] and n - 205 == 26  # 26 text / marker tokens
    # kept per image, by hand: 0.6 * (64, 77, 64) = 38.4, 46.2, 38.4; 0.2 * ... = 12.8, 15.4, 12.8;
    # 0.5 * 77 = 38.5, a tie, to even: 38; 0.3 * ... < 64 = min_keep
    configs = ((CompactionConfig(), 26 + 38 + 46 + 38),
               (CompactionConfig(keep_ratio=0.2, min_keep=1), 26 + 13 + 15 + 13),
               (CompactionConfig(keep_ratio=0.5, min_keep=1), 26 + 32 + 38 + 32),
               (CompactionConfig(keep_ratio=1.0), n),
               (CompactionConfig(keep_ratio=0.3, min_keep=64), 26 + 64 + 64 + 64))
    for cfg, expected in configs:
        kept = cfg.kept_positions(n, prompt.spans)
        assert kept.dtype == torch.int64 and bool((kept[1:] > kept[:-1]).all())
        assert int(kept.max()) < n
        keep = torch.zeros(n, dtype=torch.bool)
        keep[kept] = True
        visual = ids[:n] == IMAGE_PAD_ID
        assert bool(keep[~visual].all())  # text, <|vision_start|>, <|vision_end|>, chat markup
        assert bool(keep[ids[:n] == VISION_START_ID].all()) and bool(keep[ids[:n] == VISION_END_ID].all())
        for s in prompt.spans:  # each image keeps exactly the selector's tokens
            inside = kept[(kept >= s.start) & (kept < s.end)] - s.start
            assert torch.equal(inside, uniform(s, cfg.keep_ratio, cfg.min_keep))
        assert len(kept) == expected
    # (last config) spans of min_keep = 64 tokens or fewer are kept whole, larger ones keep 64
    for s in prompt.spans:
        assert int(keep[s.start : s.end].sum()) == 64


def test_no_compaction_keeps_everything(builder):
    prompt = _image_prompt(builder)
    n = prompt.prefix_len
    assert CompactionConfig(method=None).kept_positions(n, prompt.spans).tolist() == list(range(n))


def test_spans_beyond_the_prefix_are_left_alone():
    spans = [span(4, 4, start=2), span(4, 4, start=30)]
    kept = CompactionConfig(keep_ratio=0.5, min_keep=1).kept_positions(20, spans)
    assert len(kept) == 20 - 8  # only the first span lies inside the 20-token prefix


def test_video_frames_kept_unless_compact_video(builder):
    frames = [Image.new("RGB", (128, 128), c) for c in ("red", "green", "blue", "white")]
    messages = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (256, 256), "red")},
                                             {"type": "video", "video": frames, "fps": 2.0},
                                             {"type": "text", "text": "What happens?"}]}]
    prompt = builder.build(messages)
    kinds = [s.kind for s in prompt.spans]
    assert kinds == ["image", "video", "video"]
    ids = torch.tensor(prompt.input_ids)
    n = prompt.prefix_len
    video = torch.zeros(n, dtype=torch.bool)
    for s in prompt.spans[1:]:
        video[s.start : s.end] = True
    assert bool((ids[:n][video] == VIDEO_PAD_ID).all())

    def kept_mask(cfg):
        keep = torch.zeros(n, dtype=torch.bool)
        keep[cfg.kept_positions(n, prompt.spans)] = True
        return keep

    default = kept_mask(CompactionConfig(keep_ratio=0.5, min_keep=1))
    assert bool(default[video].all())  # video untouched
    assert int(default[prompt.spans[0].start : prompt.spans[0].end].sum()) == 32  # the image is compacted
    both = kept_mask(CompactionConfig(keep_ratio=0.5, min_keep=1, compact_video=True))
    for s in prompt.spans[1:]:  # every frame pair (4 x 4 tokens) compacted on its own grid: 0.5 * 16
        assert s.length == 16 and int(both[s.start : s.end].sum()) == 8
    assert bool(both[~video & (ids[:n] != IMAGE_PAD_ID)].all())


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"method": "topk"}, "compaction must be None or one of"),
        ({"method": ""}, "compaction must be None or one of"),
        ({"keep_ratio": 0.0}, "keep_ratio must be in"),
        ({"keep_ratio": -0.5}, "keep_ratio must be in"),
        ({"keep_ratio": 1.01}, "keep_ratio must be in"),
        ({"min_keep": 0}, "min_keep must be >= 1"),
        ({"min_keep": -3}, "min_keep must be >= 1"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CompactionConfig(**kwargs)


def test_engine_turns_bad_compaction_options_into_invalid_request(tiny_engine_factory):
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="keep_ratio"):
        tiny_engine_factory(kv_cache_bytes=1 << 20, keep_ratio=1.5)
    with pytest.raises(InvalidRequestError, match="compaction must be"):
        tiny_engine_factory(kv_cache_bytes=1 << 20, compaction="topk")


def test_namespace_names_every_setting():
    base = CompactionConfig()
    variants = [CompactionConfig(keep_ratio=0.5), CompactionConfig(min_keep=8),
                CompactionConfig(compact_video=True), CompactionConfig(method=None),
                *(CompactionConfig(method=m) for m in sorted(SELECTORS) if m != base.method)]
    names = {base.namespace(), *(v.namespace() for v in variants)}
    assert len(names) == 1 + len(variants)
    assert CompactionConfig(method=None, keep_ratio=0.3).namespace() == CompactionConfig(method=None).namespace()
    assert base.namespace() == CompactionConfig().namespace()


def test_uniform_within_earlier_kept_tokens_chooses_among_them():
    """A later compaction step (within=) keeps keep_count of the span's original length, chosen
    among what the earlier step kept, evenly over those candidates."""
    s = span(8, 8, start=3)
    prefix_len = 3 + 64 + 2
    first = CompactionConfig(keep_ratio=0.6, min_keep=1).kept_positions(prefix_len, [s])
    second = CompactionConfig(keep_ratio=0.4, min_keep=1).kept_positions(prefix_len, [s], within=first)
    assert set(second.tolist()) <= set(first.tolist())
    assert len(first) == 5 + 38 and len(second) == 5 + 26  # round(0.4 * 64) = 26, of the original 64
    visual_first = first[(first >= 3) & (first < 67)] - 3
    assert torch.equal(second[(second >= 3) & (second < 67)] - 3, uniform_selector(s, 26, None, visual_first))
    # a step asking for more than is left keeps what is left
    again = CompactionConfig(keep_ratio=0.8, min_keep=1).kept_positions(prefix_len, [s], within=second)
    assert torch.equal(again, second)
