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
import torch
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


#: The host tier's metrics (issue 33), per variant and workset.
TIER_FIELDS = ("hits_gpu", "hits_host", "hits_tier_unreported", "dense_hit_share", "dense_answer_share",
               "restore_ms_p50", "restore_ms_p99", "restored_pages", "host_pages_used_peak", "host_pages_used_end",
               "host_pages_total", "cache_offloads", "cache_restores", "cache_host_evictions", "restore_bytes_per_s",
               "copy_floor_bytes_per_s", "restore_bandwidth_ratio")


def test_variants_without_the_tier_say_so_and_report_none_of_it(quick_run):
    """Every real variant ran with ``host_cache_bytes=0`` (recorded in its options and the
    protocol): no hit came from the host, no restore, no offload, no host page; the dense-hit
    share is the dense hits over the hits; the markdown has the tier table."""
    _, result, out, _ = quick_run
    for v in REAL:
        m = result["results"]["pressure"][v]
        missing = [f for f in TIER_FIELDS if f not in m]
        assert not missing, (v, missing)
        assert m["options"]["host_cache_bytes"] == 0 and result["protocol"]["variants"][v]["host_cache_bytes"] == 0
        assert m["hits_host"] == 0 and m["hits_gpu"] + m["hits_tier_unreported"] == m["hits"], v
        assert m["restore_ms_p50"] is None and m["restored_pages"] == 0 and m["restore_bytes_per_s"] is None, v
        assert m["restore_bandwidth_ratio"] is None and m["copy_floor_bytes_per_s"] is None, v
        assert m["cache_offloads"] in (None, 0) and m["cache_restores"] in (None, 0), v
        assert m["host_pages_used_peak"] in (None, 0) and m["host_pages_used_end"] in (None, 0), v
        if m["hits"]:
            assert m["dense_hit_share"] == pytest.approx(m["dense_hits"] / m["hits"]), v
    md = out.with_suffix(".md").read_text()
    assert "*pressure: host tier*" in md and "| on_pressure | off | " in md


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
    >= 1.5 B, deep = the first run >= 3 B; a run the groups never reach is all of them."""
    pages = [30, 40, 30, 50, 10, 40]  # running sums 30, 70, 100, 150, 160, 200 against B = 100
    assert ws.choose_worksets(pages, 100) == {"fit": 2, "knee": 4, "pressure": 4, "deep": 6}  # 3 B = 300: all
    # 1.5 B = 165: 200 is the first
    assert ws.choose_worksets(pages, 110) == {"fit": 2, "knee": 4, "pressure": 6, "deep": 6}
    # 1.5 B = 210: never, so all
    assert ws.choose_worksets(pages, 140) == {"fit": 2, "knee": 4, "pressure": 6, "deep": 6}
    # none fits: one group
    assert ws.choose_worksets([80, 10], 100) == {"fit": 1, "knee": 2, "pressure": 2, "deep": 2}
    assert not ws.enough_groups([30, 40], 100, ["fit"]) and ws.enough_groups([30, 40, 30], 100, ["fit"])
    assert not ws.enough_groups([30, 40, 30], 100, ["knee"]) and ws.enough_groups([30, 40, 30, 50], 100, ["pressure"])


def test_the_deep_workset_is_the_first_run_of_three_b():
    """deep by hand: B = 60 makes 3 B = 180, first reached by the sixth group (200; 160 before it);
    B = 50 makes 3 B = 150, reached exactly by the fourth (a sum equal to 3 B counts); the groups
    generated must reach 3 B before deep is decided."""
    pages = [30, 40, 30, 50, 10, 40]  # running sums 30, 70, 100, 150, 160, 200
    # B = 60: fit <= 42 (30: one group), knee > 60 (70: two), pressure >= 90 (100: three)
    assert ws.choose_worksets(pages, 60) == {"fit": 1, "knee": 2, "pressure": 3, "deep": 6}
    # B = 50: fit <= 35 (one), knee > 50 (two), pressure >= 75 (three), deep >= 150 (four)
    assert ws.choose_worksets(pages, 50) == {"fit": 1, "knee": 2, "pressure": 3, "deep": 4}
    assert not ws.enough_groups(pages[:3], 50, ["deep"]) and ws.enough_groups(pages[:4], 50, ["deep"])
    assert not ws.enough_groups(pages[:5], 60, ["pressure", "deep"]) and ws.enough_groups(pages, 60, ["deep"])
    assert ws.WORKSETS[-1] == "deep" and ws.DEEP == 3.0


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


# ------------------------------------------------------------------------------------------------
# the host-memory tier (issue 33): variants, metrics, goals
# ------------------------------------------------------------------------------------------------


def test_host_variants_resolve_multiples_of_b_to_bytes():
    """``_hostKx`` is K times the run's KV bytes, resolved per run (two budgets, by hand); the
    rest of the options are the variant's and the base's; the JSON shows the multiple as text."""
    for budget in (1_000, 2_785_281):
        one = ws.variant_options("on_pressure_host1x", budget, 7, 16)
        four = ws.variant_options("on_pressure_host4x", budget, 7, 16)
        assert one["host_cache_bytes"] == budget and four["host_cache_bytes"] == 4 * budget
        assert ws.variant_options("dense_host4x", budget, 7, 16)["host_cache_bytes"] == 4 * budget
        first = ws.variant_options("compact_first_host1x", budget, 7, 16)
        assert first["host_cache_bytes"] == budget and first["reclaim_order"] == "compact_first"
        assert four["kv_cache_bytes"] == budget and four["vision_cache_bytes"] == 7 and four["page_size"] == 16
    assert ws.variant_options("on_pressure", 1_000, 7, 16)["host_cache_bytes"] == 0
    assert ws.TimesB(4).bytes(2_785_281) == 11_141_124 and str(ws.TimesB(4)) == "4 x B"
    described = ws.describe_variant(ws.VARIANTS["on_pressure_host4x"])
    assert described["host_cache_bytes"] == "4 x B" and json.loads(json.dumps(described)) == described
    assert ws.describe_variant(ws.VARIANTS["on_pressure_steps"])["pressure_keep_ratios"] == [0.6, 0.4]


def test_every_variant_names_its_host_tier_and_means_it():
    """Every variant without ``host`` in its name sets ``host_cache_bytes=0`` (the engine's
    default, None, would give it a tier); every ``_hostKx`` one gets K x B, the default reclaim
    order unless its name starts with ``compact_first``; ``dense`` names run without compaction,
    ``on_pressure`` ones compact on pressure."""
    hosted = [name for name in ws.VARIANTS if "host" in name]
    assert set(hosted) >= {"on_pressure_host1x", "on_pressure_host4x", "dense_host4x", "compact_first_host1x"}
    for name, overrides in ws.VARIANTS.items():
        assert "host_cache_bytes" in overrides, name  # explicit, never the engine's default
        if name not in hosted:
            assert overrides["host_cache_bytes"] == 0 and not ws.uses_host_tier(overrides), name
            assert "reclaim_order" not in overrides, name
            continue
        k = float(name.rsplit("_host", 1)[1].removesuffix("x"))
        assert overrides["host_cache_bytes"] == ws.TimesB(k) and ws.uses_host_tier(overrides), name
        order = "compact_first" if name.startswith("compact_first") else "offload_first"
        assert overrides.get("reclaim_order", "offload_first") == order, name
        if name.startswith("dense"):
            assert overrides["compaction"] is None, name
        else:
            assert overrides["compaction_mode"] == "on_pressure" and overrides["keep_ratio"] == 0.6, name
    ws.check_variants(list(ws.VARIANTS))  # the tier's fields are accepted even before the engine has them
    with pytest.raises(ValueError, match="unknown EngineOptions fields"):
        ws.check_variants(["odd"], {"odd": {"host_cache_byte": 0}})


def test_host_tier_fields_fit_an_engine_without_the_tier():
    """On an engine from before the tier, asking for no tier drops the fields; asking for one
    fails that variant with a message; an engine with the fields gets them as they are."""
    without = {"kv_cache_bytes", "compaction"}
    off = {"kv_cache_bytes": 5, "host_cache_bytes": 0, "reclaim_order": "offload_first"}
    assert ws.fit_to_engine(off, without) == {"kv_cache_bytes": 5}
    for asked in ({"host_cache_bytes": 40}, {"host_cache_bytes": None}, {"reclaim_order": "compact_first"}):
        with pytest.raises(ValueError, match="no host-memory tier"):
            ws.fit_to_engine({"kv_cache_bytes": 5, **asked}, without)
    full = without | set(ws.HOST_TIER_OFF)
    assert ws.fit_to_engine({**off, "host_cache_bytes": 40}, full) == {**off, "host_cache_bytes": 40}


class _FakeEngine:
    """Answers each ``generate`` with the next hand-built telemetry (or raises it)."""

    def __init__(self, telemetries):
        self.telemetries = list(telemetries)

    def generate(self, messages, sampling, cache_salt=None):
        from engine import Completion

        tel = self.telemetries.pop(0)
        if isinstance(tel, Exception):
            raise tel
        return Completion("", [1, 2], [], "length", tel)


def _tier_results(tmp_path, media_dir):
    """Six requests through :func:`ws.ask` on hand-built telemetries: a dense GPU hit, a dense and
    a compact host hit (2 ms / 10 pages and 6 ms / 30 pages), a miss that cached a dense prefix, a
    compact GPU hit, and a failure."""
    from media import PHOTOS

    from engine import Telemetry

    group = ws.make_group(0, 0, tmp_path, media_dir=media_dir, photos=PHOTOS, sides=(64, 64), count=(2, 2))
    group.dense_pages = 12
    tels = [Telemetry(prefix_cache="hit", prefix_form="dense", prefix_tier="gpu"),
            Telemetry(prefix_cache="hit", prefix_form="dense", prefix_tier="host", restore_ms=2.0, restored_pages=10),
            Telemetry(prefix_cache="hit", prefix_form="compact", prefix_tier="host", restore_ms=6.0,
                      restored_pages=30),
            Telemetry(prefix_cache="miss", prefix_form="dense", computed_tokens=100),
            Telemetry(prefix_cache="hit", prefix_form="compact", prefix_tier="gpu"),
            RuntimeError("refused")]
    engine = _FakeEngine(tels)
    from engine import SamplingParams

    sampling = SamplingParams(max_tokens=2)
    return group, [ws.ask(engine, group, ws.Arrival(0, i, 0.0), sampling, 0.0) for i in range(len(tels))]


def test_tier_metrics_on_hand_built_telemetries(tmp_path, media_dir):
    """By hand: 4 hits of 5 answers, 2 in the pool and 2 from the host; dense: 2 of the 4 hits,
    3 of the 5 answers (the miss cached a dense prefix); restore ms over the host hits [2, 6]:
    p50 4, p99 2 + 0.99 x 4 = 5.96; 40 pages of 1,000 bytes in 8 ms = 5e6 bytes/s; a typical
    restore is the median of 10,000 and 30,000 bytes."""
    group, results = _tier_results(tmp_path, media_dir)
    ok = [r for r in results if "error" not in r]
    m = ws.tier_metrics(ok)
    assert (m["hits_gpu"], m["hits_host"], m["hits_tier_unreported"]) == (2, 2, 0)
    assert m["dense_hit_share"] == pytest.approx(0.5) and m["dense_answer_share"] == pytest.approx(0.6)
    assert m["restore_ms_p50"] == pytest.approx(4.0) and m["restore_ms_p99"] == pytest.approx(5.96)
    assert m["restore_ms_total"] == pytest.approx(8.0) and m["restored_pages"] == 40
    assert ws.restore_bandwidth(results, 1_000) == pytest.approx(5e6)
    assert ws.restore_size(results, 1_000, [group]) == 20_000
    no_host = [r for r in results if r.get("prefix_tier") != "host"]
    assert ws.restore_bandwidth(no_host, 1_000) is None
    assert ws.restore_size(no_host, 1_000, [group]) == 12_000  # the group's dense prefix instead
    # an engine from before the tier reports no tier: its hits are counted apart, none on the host
    old = ws.tier_metrics([{**r, "prefix_tier": None, "restore_ms": 0.0} for r in ok])
    assert (old["hits_gpu"], old["hits_host"], old["hits_tier_unreported"]) == (0, 0, 4)
    assert old["restore_ms_p50"] is None
    assert ws.tier_metrics([])["dense_hit_share"] is None and ws.tier_metrics([])["dense_answer_share"] is None


def test_summarise_counts_the_host_tier_from_stats_differences(tmp_path, media_dir):
    """Host counters: levels read at the end, counts as differences over the phase; None on an
    engine that has no such counters."""
    _, results = _tier_results(tmp_path, media_dir)
    before = {"cache_offloads": 3, "cache_restores": 1, "cache_host_evictions": 0, "cache_hits_host": 1,
              "host_pages_used": 9}
    after = {"cache_offloads": 10, "cache_restores": 3, "cache_host_evictions": 2, "cache_hits_host": 3,
             "host_pages_total": 640, "host_pages_used": 120, "host_bytes_allocated": 640_000,
             "host_cache_bytes": 640_000, "cache_host_entries": 5}
    m = ws.summarise(results, before, after, start=0.0)
    assert (m["cache_offloads"], m["cache_restores"], m["cache_host_evictions"], m["cache_hits_host"]) == (7, 2, 2, 2)
    assert (m["host_pages_total"], m["host_pages_used_end"], m["cache_host_entries"]) == (640, 120, 5)
    assert m["hits"] == 4 and m["hits_host"] == 2 and m["errors"] == 1
    assert [r["prefix_tier"] for r in m["per_request"]] == ["gpu", "host", "host", None, "gpu", None]
    bare = ws.summarise(results, {}, {}, start=0.0)
    assert all(bare[k] is None for k in ("cache_offloads", "host_pages_total", "host_pages_used_end"))


def test_stats_poller_keeps_the_peak():
    """The poller folds every stats read into the peak of its key and stops on exit."""
    import threading

    reads = threading.Event()

    class Stats:
        values = iter([4, 17, 9] + [2] * 10_000)

        def stats(self):
            value = next(self.values)
            if value == 9:
                reads.set()
            return {"host_pages_used": value}

    with ws.StatsPoller(Stats(), "host_pages_used", interval_s=0.001) as poller:
        assert reads.wait(30)
    assert poller.peak == 17 and not poller._thread.is_alive()
    poller.sample({"host_pages_used": 30})
    poller.sample({"other": 99})
    assert poller.peak == 30


def test_copy_floor_on_the_cpu_is_a_memcpy():
    out = ws.copy_floor(1 << 20, torch.device("cpu"), repeats=3)
    assert out["copy_floor_kind"] == "host memcpy" and out["copy_floor_bytes"] == 1 << 20
    assert out["copy_floor_bytes_per_s"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned host -> GPU copy needs CUDA")
def test_copy_floor_on_cuda_is_a_pinned_copy():
    out = ws.copy_floor(8 << 20, torch.device("cuda"), repeats=3)
    assert out["copy_floor_kind"] == "pinned host -> cuda" and out["copy_floor_bytes_per_s"] > 0


def _goal_result(deep_hits=199, dense=0.96, deep_p99=60.0, knee_p99=50.0, ratio=0.8, host_dense=0.5,
                 host_p99=40.0, base_dense=0.06, base_p99=45.0):
    def run(**m):
        return {"requests": 200, "errors": 0, "hits": 200, **m}

    return {"protocol": {"variants": {}}, "results": {
        "deep": {"on_pressure_host4x": run(hits=deep_hits, dense_hit_share=dense, ttft_ms_p99=deep_p99,
                                           restore_bandwidth_ratio=ratio, restore_bytes_per_s=4e10,
                                           copy_floor_bytes_per_s=5e10, copy_floor_kind="pinned host -> cuda")},
        "knee": {"on_pressure": run(ttft_ms_p99=knee_p99, dense_hit_share=0.9)},
        "pressure": {"on_pressure": run(dense_hit_share=base_dense, ttft_ms_p99=base_p99),
                     "on_pressure_host1x": run(dense_hit_share=host_dense, ttft_ms_p99=host_p99),
                     "on_pressure_host4x": {"error": "RuntimeError: no"}}}}


def test_goal_checks_read_the_json():
    """Each goal from hand-built results, on both sides of its threshold: 199 of 200 hits
    (99.5 %) passes and 197 (98.5 %) fails; 60 against 50 ms is 1.2 x (pass), 80 is 1.6 x
    (fail); a variant that failed or did not run is neither."""
    from working_set_report import goal_checks, goals_markdown

    def verdicts(**kw):
        return [c["passed"] for c in goal_checks(_goal_result(**kw))]

    assert verdicts() == [True, True, True, True, True, None]
    assert verdicts(deep_hits=197, dense=0.94, deep_p99=80.0, ratio=0.7, host_p99=46.0) == [
        False, False, False, False, False, None]
    assert verdicts(host_dense=0.06)[4] is False  # equal dense share does not beat it
    assert verdicts(host_p99=45.0)[4] is True  # equal TTFT p99 is enough
    no_knee = _goal_result()
    del no_knee["results"]["knee"]
    assert [c["passed"] for c in goal_checks(no_knee)][2] is None
    md = "\n".join(goals_markdown(_goal_result(deep_p99=80.0)))
    assert "| FAIL |" in md and "| pass |" in md and "80.0 vs 50.0 ms (1.60 x)" in md
    assert goals_markdown({"protocol": {"variants": {}}, "results": {"pressure": {}}}) == []


def test_only_restricts_a_workset_to_some_variants():
    """``--only knee=on_pressure``: knee runs that variant alone, the other worksets every one of
    ``--variants``; mistakes are refused before anything runs."""
    args = bench_working_set.parse_args(["--model", "test", "--worksets", "deep,knee", "--variants",
                                         "on_pressure,on_pressure_host4x", "--only", "knee=on_pressure"])
    assert args.worksets == ["deep", "knee"] and args.only == {"knee": ["on_pressure"]}
    assert bench_working_set.parse_only(["deep=on_pressure_host4x,on_pressure"], ["deep"],
                                        ["on_pressure", "on_pressure_host4x"]) == {
        "deep": ["on_pressure", "on_pressure_host4x"]}  # in --variants' order
    for bad in (["knee"], ["knee="], ["fit=on_pressure"], ["knee=dense_fp8"], ["knee=on_pressure", "knee=on_pressure"]):
        with pytest.raises(ValueError):
            bench_working_set.parse_only(bad, ["deep", "knee"], ["on_pressure", "on_pressure_host4x"])
    with pytest.raises(SystemExit):
        bench_working_set.parse_args(["--model", "test", "--worksets", "knee", "--only", "deep=on_pressure"])
