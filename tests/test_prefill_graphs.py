"""Short cold prompts prefilled on padded buffers (engine.graphs.prefill): the padded forward equals
the eager prefill, stores only the prompt's K/V, and the engine takes that path for a prompt alone
in its step. On CUDA the buffers are replayed as captured graphs; on the CPU they run eagerly."""

from __future__ import annotations

import pytest
import torch
from conftest import TEST_DEVICE

from engine import SamplingParams
from engine.cache.kv_pool import PagePool
from engine.graphs.prefill import PrefillGraphs
from engine.model.attention import PagedStep
from engine.model.decoder import VisualInjection
from ops import AttentionMetadata


def photo_question(media_path, name="astronaut.png"):
    return [{"role": "user", "content": [{"type": "image", "image": media_path(name)},
                                         {"type": "text", "text": "What is in the picture?"}]}]


#: Longer than the decode graphs' 64 rows, which take shorter text-only steps on CUDA.
TEXT = [{"role": "user", "content": "Write one line about rain, with a cloud in it. " * 8}]


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    """Eager prefills everywhere (on CUDA too): the reference the padded buffers are checked against."""
    return tiny_engine_factory(prefix_cache=False, kv_cache_dtype="auto", prefill_graphs=False)


def nan_pool(engine, pages: int) -> PagePool:
    t = engine.config.text
    pool = PagePool(num_layers=t.num_hidden_layers, num_kv_heads=t.num_key_value_heads, head_dim=t.head_dim,
                    num_pages=pages, page_size=16, kv_cache_dtype="auto", model_dtype=engine.dtype,
                    device=engine.device)
    for layer in pool.layers:
        layer.k_cache.fill_(float("nan"))
        layer.v_cache.fill_(float("nan"))
    return pool


@pytest.mark.parametrize("which", ["photo", "text"])
def test_padded_forward_equals_the_eager_prefill_and_stores_only_the_prompt(engine, media_path, which):
    prompt = engine.prompts.build(photo_question(media_path) if which == "photo" else TEXT)
    n, dev = len(prompt.input_ids), engine.device
    graphs_pool, eager_pool = nan_pool(engine, 40), nan_pool(engine, 40)
    table = list(range(3, 3 + -(-n // 16)))  # not from page 0: padding must not land anywhere
    slots = [table[i // 16] * 16 + i % 16 for i in range(n)]
    rows = prompt.visual_rows()
    feats = engine.vision_features(prompt) if rows.numel() else None

    graphs = PrefillGraphs(engine.model, graphs_pool)
    assert graphs.fits(n) and graphs._bucket(n) > n
    padded = graphs.run(prompt.input_ids, prompt.positions, slots, rows, feats)

    meta = AttentionMetadata.build([n], [n], [table], slots, dev)
    visual = VisualInjection(rows.to(dev), feats.embeds, feats.deepstack) if feats is not None else None
    eager = engine.model(torch.tensor(prompt.input_ids, device=dev), prompt.positions.to(dev),
                         PagedStep(eager_pool, None, meta), visual, torch.tensor([n - 1], device=dev))
    torch.testing.assert_close(padded, eager, rtol=0, atol=1e-4)
    assert graphs.runs == 1
    stored = torch.tensor(slots)
    for mine, ref in zip(graphs_pool.layers, eager_pool.layers, strict=True):
        k = mine.k_cache.transpose(1, 2).reshape(-1, *mine.k_cache.shape[1::2])  # [slot, Hkv, D]
        k_ref = ref.k_cache.transpose(1, 2).reshape(-1, *ref.k_cache.shape[1::2])
        torch.testing.assert_close(k[stored], k_ref[stored], rtol=0, atol=1e-4)
        others = torch.ones(k.shape[0], dtype=torch.bool)
        others[stored] = False
        assert k[others].isnan().all(), "a padding row stored its K/V"


def test_an_earlier_prompts_features_never_reach_a_later_one(engine, media_path):
    """The buffers keep the last prompt's visual features; the padded rows of the next prompt all add
    into one padding row, which must stay finite (a real row gives it weight 0, and 0 * inf is NaN).
    Stand-in for a 16-bit overflow: the buffers hold inf before a text-only prompt."""
    pool = nan_pool(engine, 40)
    graphs = PrefillGraphs(engine.model, pool)
    photo = engine.prompts.build(photo_question(media_path))
    n = len(photo.input_ids)
    graphs.run(photo.input_ids, photo.positions, list(range(n)), photo.visual_rows(), engine.vision_features(photo))
    graphs.embeds.fill_(float("inf"))
    for tap in graphs.deepstack:
        tap.fill_(float("inf"))
    text = engine.prompts.build(TEXT)
    m = len(text.input_ids)
    logits = graphs.run(text.input_ids, text.positions, list(range(m)), torch.empty(0, dtype=torch.long), None)
    assert torch.isfinite(logits).all()
    dev = engine.device
    meta = AttentionMetadata.build([m], [m], [list(range(-(-m // 16)))], list(range(m)), dev)
    eager = engine.model(torch.tensor(text.input_ids, device=dev), text.positions.to(dev),
                         PagedStep(nan_pool(engine, 40), None, meta), None, torch.tensor([m - 1], device=dev))
    torch.testing.assert_close(logits, eager, rtol=0, atol=1e-4)


def test_refuses_a_prompt_without_a_bucket_or_with_mismatched_features(engine, media_path):
    graphs = PrefillGraphs(engine.model, nan_pool(engine, 4), buckets=(8, 16))
    assert graphs.max_tokens == 15 and not graphs.fits(16) and not graphs.fits(0)
    with pytest.raises(ValueError, match="no prefill bucket"):
        graphs.run(list(range(16)), torch.zeros(3, 16, dtype=torch.long), list(range(16)),
                   torch.empty(0, dtype=torch.long), None)
    with pytest.raises(ValueError, match="disagree"):
        graphs.run(list(range(4)), torch.zeros(3, 4, dtype=torch.long), list(range(4)), torch.tensor([1, 2]), None)
    with pytest.raises(ValueError, match="increasing"):
        PrefillGraphs(engine.model, nan_pool(engine, 1), buckets=(16, 8))


def test_the_engine_prefills_a_lone_cold_prompt_on_the_padded_buffers(tiny_engine_factory, engine, media_path):
    """Greedy answers equal the eager engine's; the prompt alone in its step took the padded path,
    and a prompt longer than every bucket (~700 tokens in one step) did not."""
    padded = tiny_engine_factory(prefix_cache=False, kv_cache_dtype="auto", max_num_batched_tokens=2048)
    if padded.loop.runner.prefill_graphs is None:  # the CPU: the same buffers, run eagerly
        padded.loop.runner.prefill_graphs = PrefillGraphs(padded.model, padded.pool)
    graphs = padded.loop.runner.prefill_graphs
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    for messages in (photo_question(media_path), photo_question(media_path, "coffee.png"), TEXT):
        before = graphs.runs
        assert padded.generate(messages, greedy).token_ids == engine.generate(messages, greedy).token_ids
        assert graphs.runs == before + 1
    long_text = [{"role": "user", "content": "rain " * 700}]
    before = graphs.runs
    assert padded.generate(long_text, SamplingParams(max_tokens=1)).token_ids
    assert graphs.runs == before


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA graphs need the engines on a GPU")
def test_on_cuda_the_prompt_replays_a_captured_graph(tiny_engine_factory, media_path):
    eng = tiny_engine_factory(prefix_cache=False)
    graphs = eng.loop.runner.prefill_graphs
    assert graphs is not None and set(graphs._graphs) == set(graphs.buckets)
    eager = tiny_engine_factory(prefix_cache=False, prefill_graphs=False)
    assert eager.loop.runner.prefill_graphs is None
    first = SamplingParams(max_tokens=1)
    done = eng.generate(photo_question(media_path), first)
    assert graphs.replays == 1
    assert done.token_ids == eager.generate(photo_question(media_path), first).token_ids


def test_no_step_graphs_when_the_references_are_forced(monkeypatch):
    """``PRISM_OPS=reference`` (the GPU smoke's oracle) runs the references, which read values back to
    the host: a capture of them fails (cudaErrorStreamCaptureInvalidated), so no graphs are offered."""
    from engine.graphs.capture import graphs_supported
    from ops import dispatch

    monkeypatch.setattr(dispatch, "triton_kernels", object())  # as if Triton were there
    cuda = torch.device("cuda")
    monkeypatch.setenv("PRISM_OPS", "reference")
    assert not graphs_supported(cuda)
    monkeypatch.setenv("PRISM_OPS", "auto")
    assert graphs_supported(cuda) and not graphs_supported(torch.device("cpu"))
