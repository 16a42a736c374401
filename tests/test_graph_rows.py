"""Short text-only steps as rows of the decode graph (engine/serving/runner.py ``_run_graph``).

On CUDA the runner replays the captured decode graph for any text-only step of at most
``graphs.max_batch`` new tokens: every new token is one row that attends to its sequence's KV up to
itself. A prefix hit's question is prefilled that way. CUDA graphs need a GPU, so here the graph is
replaced by :class:`EagerRows`, which runs the same rows through the model with the reference
decode op: what is tested is the runner's row layout (slots, causal lengths, block tables, which
rows are sampled). The oracle is the same engine running every step eagerly; K/V in float32.
benchmarks/gpu_smoke.py checks the captured graphs themselves on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from engine import SamplingParams, media_first_messages
from engine.model.attention import PagedStep
from ops import AttentionMetadata

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
BASE = dict(kv_cache_dtype="auto", max_pixels=256 * 256)


class EagerRows:
    """The interface of :class:`engine.graphs.decode.DecodeGraphs` without capture: each row is a
    sequence of one new token (the decode op), run eagerly. Records the rows of every call."""

    def __init__(self, model, pool, max_batch: int):
        self.model, self.pool, self.max_batch = model, pool, max_batch
        self.calls: list[list[int]] = []

    def run(self, ids, positions, slots, seq_lens, tables, before_replay=None):
        self.calls.append(list(ids))
        meta = AttentionMetadata.build([1] * len(ids), seq_lens, tables, slots, self.model.device)
        assert meta.is_decode_only
        if before_replay is not None:
            before_replay()
        dev = self.model.device
        logits = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                            PagedStep(self.pool, meta))
        return logits, logits.argmax(dim=-1)


@pytest.fixture(scope="module")
def photos(media_path) -> list[Image.Image]:
    out = []
    for name in ("astronaut.png", "coffee.png"):
        with Image.open(media_path(name)) as im:
            out.append(im.convert("RGB"))
    return out


def with_rows(engine, max_batch: int = 32) -> EagerRows:
    rows = EagerRows(engine.model, engine.pool, max_batch)
    engine.loop.runner.graphs = rows
    return rows


def image_token_ids(engine) -> set[int]:
    return {engine.config.image_token_id, engine.config.video_token_id}


def test_text_prompts_prefill_and_decode_as_rows_like_eager_steps(tiny_engine_factory):
    eager = tiny_engine_factory(**BASE, prefix_cache=False)
    graphed = tiny_engine_factory(**BASE, prefix_cache=False)
    rows = with_rows(graphed)
    prompt = [{"role": "user", "content": "Write a short poem about the sea, please."}]
    n_prompt = len(graphed.prompts.build(prompt).input_ids)
    assert 1 < n_prompt <= rows.max_batch

    want = eager.generate(prompt, GREEDY)
    got = graphed.generate(prompt, GREEDY)

    assert got.token_ids == want.token_ids
    assert [len(c) for c in rows.calls] == [n_prompt] + [1] * (GREEDY.max_tokens - 1)


def test_a_prompt_longer_than_the_graph_is_prefilled_eagerly(tiny_engine_factory):
    eager = tiny_engine_factory(**BASE, prefix_cache=False)
    graphed = tiny_engine_factory(**BASE, prefix_cache=False)
    rows = with_rows(graphed, max_batch=8)
    prompt = [{"role": "user", "content": "Name the planets of the solar system in order, with one fact each."}]
    assert len(graphed.prompts.build(prompt).input_ids) > 8

    assert graphed.generate(prompt, GREEDY).token_ids == eager.generate(prompt, GREEDY).token_ids
    assert [len(c) for c in rows.calls] == [1] * (GREEDY.max_tokens - 1)  # decode steps only


def test_a_prefix_hit_prefills_its_question_as_rows(tiny_engine_factory, photos):
    eager = tiny_engine_factory(**BASE)
    graphed = tiny_engine_factory(**BASE)
    first = media_first_messages(photos, "What is in the first picture?")
    second = media_first_messages(photos, "Which picture has more colour in it?")
    want = [eager.generate(m, GREEDY, cache_salt="s") for m in (first, second)]
    rows = with_rows(graphed)

    got = [graphed.generate(m, GREEDY, cache_salt="s") for m in (first, second)]

    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.telemetry.prefix_cache for c in got] == ["miss", "hit"]
    hit_prefill = got[1].telemetry.computed_tokens
    assert 1 < hit_prefill <= rows.max_batch
    assert any(len(c) == hit_prefill for c in rows.calls), [len(c) for c in rows.calls]
    # steps with image tokens never ran as rows: the vision features are injected eagerly
    assert not any(set(c) & image_token_ids(graphed) for c in rows.calls)


def test_decode_rows_and_a_prefill_share_one_step(tiny_engine_factory, photos, monkeypatch):
    eager = tiny_engine_factory(**BASE, prefix_cache=False)
    graphed = tiny_engine_factory(**BASE, prefix_cache=False)
    rows = with_rows(graphed)
    long = [{"role": "user", "content": "Count slowly from one to twenty."}]
    short = [{"role": "user", "content": "Hi!"}]
    want = [eager.generate(m, GREEDY) for m in (long, short)]

    # Submit the second request once the first is decoding, so one step holds both.
    first = graphed.submit(long, GREEDY)
    real = graphed.loop.runner.execute
    state = {"sent": None}

    def execute(plan):
        if state["sent"] is None and first.request.generated:
            state["sent"] = graphed.submit(short, GREEDY)
        return real(plan)

    monkeypatch.setattr(graphed.loop.runner, "execute", execute)
    done, second = first.result(), state["sent"].result()

    assert [done.token_ids, second.token_ids] == [c.token_ids for c in want]
    n_short = len(graphed.prompts.build(short).input_ids)
    assert any(len(c) == n_short + 1 for c in rows.calls), [len(c) for c in rows.calls]


class _NoGraph:
    def replay(self):
        pass


def graph_inputs(max_batch: int = 8, width: int = 6):
    """A DecodeGraphs on the CPU with its graphs replaced: what ``run`` writes to the buffers."""
    from types import SimpleNamespace

    from engine.graphs.decode import DecodeGraphs

    model = SimpleNamespace(device=torch.device("cpu"))
    graphs = DecodeGraphs(model, None, max_batch, max_pages_per_seq=width, max_seq_len=width * 16)
    graphs._graphs = {b: (_NoGraph(), torch.zeros(b, 3), torch.zeros(b, dtype=torch.long)) for b in graphs.buckets}
    return graphs


def test_graph_inputs_are_packed_and_padded_to_the_bucket():
    graphs = graph_inputs()
    graphs.run([11, 12, 13], [[5, 6, 7], [5, 6, 8], [5, 6, 9]], [40, 41, 42], [6, 7, 8], [[2, 3], [2, 3], [4]])
    b = 4  # the bucket for three rows
    assert graphs.inputs[graphs.IDS, :b].tolist() == [11, 12, 13, 0]
    assert graphs.inputs[graphs.POS, :b].tolist() == [[5, 6, 7, 0], [5, 6, 8, 0], [5, 6, 9, 0]]
    assert graphs.inputs[graphs.SLOTS, :b].tolist() == [40, 41, 42, -1]  # padding stores nothing
    assert graphs.inputs[graphs.LENS, :b].tolist() == [6, 7, 8, 0]  # and attends to nothing
    assert graphs.tables[:3, :2].tolist() == [[2, 3], [2, 3], [4, 0]]


def test_graph_table_rows_follow_growth_copy_on_write_and_new_owners():
    graphs = graph_inputs()
    a, b = [1, 2], [7]
    graphs.run([0, 0], [[0, 0]] * 3, [0, 0], [1, 1], [a, b])
    a.append(3)  # a sequence grew by a page
    graphs.run([0, 0], [[0, 0]] * 3, [0, 0], [1, 1], [a, b])
    assert graphs.tables[:2, :3].tolist()[0] == [1, 2, 3] and graphs.tables[1, 0] == 7
    a[1] = 9  # copy-on-write replaced a page in place: same length, new content
    graphs.run([0, 0], [[0, 0]] * 3, [0, 0], [1, 1], [a, b])
    assert graphs.tables[0, :3].tolist() == [1, 9, 3]
    graphs.run([0, 0], [[0, 0]] * 3, [0, 0], [1, 1], [b, a])  # rows change owners
    assert graphs.tables[0, 0] == 7 and graphs.tables[1, :3].tolist() == [1, 9, 3]


def test_prefill_chunks_that_sample_nothing_run_as_rows(tiny_engine_factory):
    """A prompt split into chunks: the first chunks end before the prompt does, so their steps
    sample no token (regression: the empty row selection was a float tensor and failed on CUDA)."""
    eager = tiny_engine_factory(**BASE, prefix_cache=False)
    graphed = tiny_engine_factory(**BASE, prefix_cache=False, max_num_batched_tokens=8)
    rows = with_rows(graphed)
    prompt = [{"role": "user", "content": "Write a short poem about the sea, please."}]
    n_prompt = len(graphed.prompts.build(prompt).input_ids)
    assert n_prompt > 8

    assert graphed.generate(prompt, GREEDY).token_ids == eager.generate(prompt, GREEDY).token_ids
    chunks = [len(c) for c in rows.calls[: -(GREEDY.max_tokens - 1)]]
    assert sum(chunks) == n_prompt and max(chunks) == 8


def test_graph_rows_of_one_prefill_share_one_table_copy():
    graphs = graph_inputs()
    table, other = [5, 6], [8]
    graphs.run([0] * 4, [[0] * 4] * 3, [0] * 4, [1] * 4, [other, table, table, table])  # a decode + 3 rows
    assert graphs.tables[:4, :2].tolist() == [[8, 0], [5, 6], [5, 6], [5, 6]]
    table.append(7)  # the prefill's sequence grew
    graphs.run([0] * 4, [[0] * 4] * 3, [0] * 4, [1] * 4, [table, table, table, other])  # rows moved too
    assert graphs.tables[:3, :3].tolist() == [[5, 6, 7]] * 3
    assert graphs.tables[3, 0] == 8  # columns past a table's length are never read


def test_a_prefill_over_a_long_context_is_run_eagerly(tiny_engine_factory, monkeypatch):
    """Every row re-reads its sequence's KV: past GRAPH_PREFILL_READS (rows x KV length) the
    prefill runs eagerly, reading it once; decode steps still replay the graph."""
    import engine.serving.runner as runner_module

    eager = tiny_engine_factory(**BASE, prefix_cache=False)
    graphed = tiny_engine_factory(**BASE, prefix_cache=False)
    rows = with_rows(graphed)
    prompt = [{"role": "user", "content": "Write a short poem about the sea, please."}]
    n_prompt = len(graphed.prompts.build(prompt).input_ids)
    monkeypatch.setattr(runner_module, "GRAPH_PREFILL_READS", n_prompt * n_prompt - 1)

    assert graphed.generate(prompt, GREEDY).token_ids == eager.generate(prompt, GREEDY).token_ids
    assert [len(c) for c in rows.calls] == [1] * (GREEDY.max_tokens - 1)
