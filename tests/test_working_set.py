"""The working-set benchmark (benchmarks/bench_working_set.py, issue 18): what holds by construction.

The benchmark's numbers are timings, checked by hand; what a test can hold is the protocol. One
quick run on the tiny "test" checkpoint (pressure workset only, 24 measured requests, sent closed
loop with ``--time-scale 0`` so the cache behaviour does not depend on this machine's speed, and a
deliberately broken variant between the real ones) feeds the tests of this module:

* every variant sent the same requests (equal trace hashes, equal to the planned trace's),
* every variant got the same KV bytes (within one page) and the same vision-feature cache,
* the vision-only variant never hits the prefix cache,
* the compact prefix recomputes fewer prompt tokens than the dense FP8 prefix under pressure (the
  workset's dense pages >= 1.5 B, and dense FP8 really evicted prefixes),
* every metric the issue names is in the JSON, the markdown table and the plot are written, and
  a variant that fails is recorded while the JSON on disk keeps the variants before it and the
  variants after it still run.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
from conftest import missing_fixture

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench_working_set  # noqa: E402
import working_set as ws  # noqa: E402

pytestmark = pytest.mark.usefixtures("media_dir")

VARIANTS = ["compact_fp8", "broken", "on_pressure", "dense_fp8", "dense_bf16", "vision_only"]
REAL = [v for v in VARIANTS if v != "broken"]
#: The metrics issue 18 lists, per variant and workset.
FIELDS = ("ttft_ms_p50", "ttft_ms_p99", "e2e_ms_p50", "e2e_ms_p99", "recomputed_prompt_tokens", "hits", "misses",
          "stale", "resident_prefixes", "prefix_evictions", "extension_evictions", "prefix_pages",
          "prefix_pages_dense_equivalent", "peak_gpu_memory_bytes", "output_tokens_per_s", "kv_cache_bytes",
          "trace_hash", "requests", "ttft_ms", "pressure_compactions", "pressure_pages_freed", "dense_hits",
          "compact_hits", "outputs_sha256")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """Run the benchmark once (about 20 s on two cores): ``(exit code, result JSON, out path,
    the variants found in the JSON on disk after each write)``."""
    out = tmp_path_factory.mktemp("working-set") / "ws.json"
    on_disk: list[list[str]] = []
    write = bench_working_set.report.write

    def write_and_read_back(result, path, **kw):
        written = write(result, path, **kw)
        on_disk.append(list(json.loads(pathlib.Path(path).read_text())["results"]["pressure"]))
        return written

    mp = pytest.MonkeyPatch()
    # a variant whose engine cannot be built: its failure must cost only itself
    mp.setitem(ws.VARIANTS, "broken", {"kv_cache_dtype": "int3"})
    mp.setattr(bench_working_set.report, "write", write_and_read_back)
    try:
        rc = bench_working_set.main(["--model", "test", "--quick", "--worksets", "pressure", "--requests", "24",
                                     "--time-scale", "0", "--variants", ",".join(VARIANTS), "--out", str(out)])
    finally:
        mp.undo()
    return rc, json.loads(out.read_text()), out, on_disk


def test_the_pressure_workset_is_under_pressure(quick_run):
    """The run measures what it claims: the workset's dense prefix pages are at least 1.5 B, and
    the dense FP8 variant had to evict image prefixes while serving it."""
    _, result, _, _ = quick_run
    w = result["worksets"]["pressure"]
    assert w["dense_pages"] == sum(w["group_dense_pages"]) >= 1.5 * result["protocol"]["budget_pages"]
    assert w["dense_pages"] - w["group_dense_pages"][-1] < 1.5 * result["protocol"]["budget_pages"]  # the first run
    assert result["results"]["pressure"]["dense_fp8"]["prefix_evictions"] > 0
    assert all(2 <= g["photos"] <= 9 for g in result["groups"])


def test_every_variant_sent_the_same_trace(quick_run):
    """Each variant's hash is taken over the requests it actually sent (group content, question,
    planned arrival): all equal, and equal to the planned trace's."""
    _, result, _, _ = quick_run
    runs = result["results"]["pressure"]
    hashes = {runs[v]["trace_hash"] for v in REAL}
    assert hashes == {result["worksets"]["pressure"]["trace_hash"]}
    assert all(runs[v]["requests"] == 24 and runs[v]["errors"] == 0 for v in REAL)


def test_every_variant_has_the_same_kv_bytes_and_vision_cache(quick_run):
    """Same KV bytes within one page (the bf16 pool holds fewer, larger pages), never more than
    the budget; the same vision-feature cache size, as reported in the protocol."""
    _, result, _, _ = quick_run
    p, runs = result["protocol"], result["results"]["pressure"]
    kv = [runs[v]["kv_cache_bytes"] for v in REAL]
    largest_page = max(runs[v]["kv_page_bytes"] for v in REAL)
    assert max(kv) - min(kv) <= largest_page and max(kv) <= p["budget_bytes"]
    assert runs["dense_bf16"]["kv_tokens"] < runs["dense_fp8"]["kv_tokens"]  # same bytes, fewer tokens
    assert runs["dense_bf16"]["kv_cache_dtype"] == "bfloat16" and runs["dense_fp8"]["kv_cache_dtype"] == "fp8_e4m3"
    assert {runs[v]["options"]["vision_cache_bytes"] for v in REAL} == {p["vision_cache_bytes"]}


def test_vision_only_never_hits(quick_run):
    _, result, _, _ = quick_run
    m = result["results"]["pressure"]["vision_only"]
    assert (m["hits"], m["misses"], m["stale"], m["off"]) == (0, 0, 0, 24)
    assert m["resident_prefixes"] == 0 and m["recomputed_prompt_tokens"] == m["prompt_tokens"]


def test_compact_recomputes_fewer_tokens_than_dense_fp8_at_pressure(quick_run):
    """The point of the compact prefix: under pressure it keeps more prefixes in the same bytes,
    so fewer questions recompute theirs."""
    _, result, _, _ = quick_run
    runs = result["results"]["pressure"]
    compact, dense = runs["compact_fp8"], runs["dense_fp8"]
    assert compact["recomputed_prompt_tokens"] < dense["recomputed_prompt_tokens"]
    assert compact["prefix_pages"] < compact["prefix_pages_dense_equivalent"]
    assert dense["prefix_pages"] == dense["prefix_pages_dense_equivalent"]


def test_on_pressure_compacts_under_pressure_and_always_never_does(quick_run):
    """Issue 19's variant under pressure: it compacted cached prefixes to make room (and freed
    pages doing it), some hits used a compact prefix; the always-compacting variant never
    compacts on pressure and never hits a dense prefix."""
    _, result, _, _ = quick_run
    runs = result["results"]["pressure"]
    on, always = runs["on_pressure"], runs["compact_fp8"]
    assert on["pressure_compactions"] > 0 and on["pressure_pages_freed"] >= on["pressure_compactions"]
    assert on["dense_hits"] + on["compact_hits"] == on["hits"] and on["compact_hits"] > 0
    assert always["pressure_compactions"] == 0 and always["dense_hits"] == 0


def test_every_field_is_present(quick_run):
    """Every metric the issue names, for every variant (peak GPU memory is None on the CPU)."""
    _, result, _, _ = quick_run
    for v in REAL:
        m = result["results"]["pressure"][v]
        missing = [f for f in FIELDS if f not in m]
        assert not missing, (v, missing)
        assert [f for f in FIELDS if m[f] is None] == ["peak_gpu_memory_bytes"], v
        assert len(m["ttft_ms"]) == 24 and m["ttft_ms_p50"] <= m["ttft_ms_p99"]
        assert m["hits"] + m["misses"] + m["stale"] + m["off"] == 24
    for key in ("groups", "dense_pages", "ratio", "group_dense_pages", "trace_hash"):
        assert key in result["worksets"]["pressure"]
    for key in ("budget_bytes", "budget_pages", "page_size", "vision_cache_bytes", "requests", "time_scale"):
        assert key in result["protocol"]


def test_a_failing_variant_costs_only_itself(quick_run):
    """The broken variant is recorded with its error; the variants after it still ran; the JSON
    was rewritten after every variant, so the one before it was on disk before it ran."""
    rc, result, _, on_disk = quick_run
    runs = result["results"]["pressure"]
    assert rc == 1  # a failed variant makes the command fail ...
    assert "InvalidRequestError" in runs["broken"]["error"] and "kv_cache_dtype" in runs["broken"]["error"]
    assert list(runs) == VARIANTS  # ... after running every other variant
    assert on_disk[:len(VARIANTS)] == [VARIANTS[: i + 1] for i in range(len(VARIANTS))]


def test_the_table_and_the_plot_are_written(quick_run):
    _, result, out, _ = quick_run
    md = out.with_suffix(".md").read_text()
    assert all(f"| {v} |" in md for v in VARIANTS) and "## pressure" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        missing_fixture("matplotlib is not installed (pip install -e '.[test]')")
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# ------------------------------------------------------------------------------------------------
# the protocol's pure parts
# ------------------------------------------------------------------------------------------------


def test_worksets_follow_their_definitions():
    """fit = the longest leading run <= 0.7 B, knee = the first run > B, pressure = the first run
    >= 1.5 B; a run the groups never reach is all of them."""
    pages = [30, 40, 30, 50, 10, 40]  # running sums 30, 70, 100, 150, 160, 200 against B = 100
    assert ws.choose_worksets(pages, 100) == {"fit": 2, "knee": 4, "pressure": 4}
    assert ws.choose_worksets(pages, 110) == {"fit": 2, "knee": 4, "pressure": 6}  # 1.5 B = 165: 200 is the first
    assert ws.choose_worksets(pages, 140) == {"fit": 2, "knee": 4, "pressure": 6}  # 1.5 B = 210: never, so all
    assert ws.choose_worksets([80, 10], 100) == {"fit": 1, "knee": 2, "pressure": 2}  # none fits: one group
    assert not ws.enough_groups([30, 40], 100, ["fit"]) and ws.enough_groups([30, 40, 30], 100, ["fit"])
    assert not ws.enough_groups([30, 40, 30], 100, ["knee"]) and ws.enough_groups([30, 40, 30, 50], 100, ["pressure"])


def test_the_trace_is_seeded_zipf_poisson_with_rotating_questions():
    """Population first (each group once, question 0, closed loop), then Zipf(1) over the group
    order, Poisson arrivals at the rate asked, each group's questions round-robin from 1."""
    trace = ws.make_trace(5, 4000, seed=3, rate=4.0)
    assert trace == ws.make_trace(5, 4000, seed=3, rate=4.0) != ws.make_trace(5, 4000, seed=4, rate=4.0)
    assert trace[:5] == [ws.Arrival(g, 0, None) for g in range(5)]
    measured = trace[5:]
    times = [a.at_s for a in measured]
    assert times == sorted(times) and 4000 / times[-1] == pytest.approx(4.0, rel=0.05)
    counts = [sum(a.group == g for a in measured) for g in range(5)]
    assert counts == sorted(counts, reverse=True)
    assert counts[0] / counts[1] == pytest.approx(2.0, rel=0.15)  # 1/1 against 1/2
    for g in range(5):
        assert [a.question for a in measured if a.group == g] == list(range(1, counts[g] + 1))


def test_groups_are_seeded_and_differ(tmp_path, media_dir):
    from media import PHOTOS

    def group(i, folder):
        return ws.make_group(i, 0, tmp_path / folder, media_dir=media_dir, photos=PHOTOS, sides=(256, 320))

    a, again, b = group(0, "a"), group(0, "b"), group(1, "a")
    assert [i["sha256"] for i in a.images] == [i["sha256"] for i in again.images]
    assert a.digest != b.digest and a.salt != b.salt and a.questions != b.questions
    assert all(256 <= s <= 320 for size in a.sizes + b.sizes for s in size)
    assert 2 <= len(a.images) <= 9 and len(set(a.questions)) == len(ws.QUESTIONS)


def test_open_loop_traffic_sends_the_same_trace(tmp_path):
    """With a time scale above 0 the measured requests go out from client threads at their
    (scaled) planned arrival times, overlapping in the engine: every one is sent and measured,
    and the trace hash is still the planned one."""
    out = tmp_path / "ws.json"
    rc = bench_working_set.main(["--model", "test", "--quick", "--worksets", "fit", "--requests", "8",
                                 "--time-scale", "0.02", "--variants", "dense_fp8", "--no-plot", "--out", str(out)])
    result = json.loads(out.read_text())
    m = result["results"]["fit"]["dense_fp8"]
    assert rc == 0 and m["errors"] == 0 and len(m["ttft_ms"]) == 8
    assert m["trace_hash"] == result["worksets"]["fit"]["trace_hash"]
    assert m["hits"] + m["misses"] + m["stale"] == 8 and min(m["ttft_ms"]) > 0
