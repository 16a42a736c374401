"""The step trace (``PRISM_STEP_TRACE``, engine/serving/trace.py): one line per step, saying how
the engine spent its time and never whose work it was."""

from __future__ import annotations

from PIL import Image

from engine import SamplingParams, media_first_messages
from engine.serving import trace

SP = SamplingParams(max_tokens=4, ignore_eos=True)
SMALL = {"min_pixels": 32 * 32, "max_pixels": 96 * 96, "max_num_batched_tokens": 8}


def test_no_trace_without_the_variable(tiny_engine_factory, monkeypatch):
    monkeypatch.delenv(trace.ENV, raising=False)
    engine = tiny_engine_factory(**SMALL)
    assert engine.loop.trace is None


def test_each_step_is_one_line_with_its_phases_and_counts(tiny_engine_factory, tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(trace.ENV, str(path))
    engine = tiny_engine_factory(**SMALL)
    salt = "secret-session-salt"
    photo = Image.new("RGB", (96, 64), "red")
    warm = engine.warm([photo], cache_salt=salt)
    warm.result(timeout=60)
    out = engine.generate(media_first_messages([photo], "What colour?"), SP, cache_salt=salt)
    steps_run = engine.loop.steps
    engine.loop.close()  # flushes the trace
    records = trace.read(str(path))

    # a plan with nothing to compute (only finished requests to drop) is traced too, as path "none"
    assert len([r for r in records if r["runs"]]) == steps_run
    assert all((r["path"] == "none") == (r["runs"] == 0) for r in records)
    assert records[0]["gap_ms"] is None and all(r["gap_ms"] >= 0 for r in records[1:])
    assert all(r["plan_ms"] >= 0 and r["exec_ms"] >= 0 and r["apply_ms"] >= 0 for r in records)
    assert [r["t"] for r in records] == sorted(r["t"] for r in records)
    assert {r["path"] for r in records if r["runs"]} == {"eager"}  # the CPU has no CUDA graphs
    # the warm's prefix goes in chunks of at most 8 tokens; the question then decodes 3 tokens
    warm_steps = [r for r in records if r["warm_tokens"]]
    assert len(warm_steps) >= 2 and all(r["warm_tokens"] <= 8 for r in warm_steps)
    assert sum(r["warm_tokens"] for r in records) == out.telemetry.cached_tokens
    assert sum(r["decode_rows"] for r in records) == SP.max_tokens - 1
    assert sum(r["prefill_tokens"] for r in records) - sum(r["warm_tokens"] for r in records) \
        == out.telemetry.computed_tokens
    assert any(r["vision_ms"] > 0 for r in warm_steps)
    assert all(r["restores"] == r["offloads"] == r["awaited"] == 0 for r in records)
    # what an operator reading it learns: timings and counts, no salt, no token ids, no text
    text = path.read_text()
    assert salt not in text and "colour" not in text and "req" not in text
