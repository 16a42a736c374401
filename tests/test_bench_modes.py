"""The benchmarks measure what their rows and columns are called (issue 29).

Each benchmark is run through its own entry point on the CPU at its smallest size, and what a
configuration is named is checked against what its engine did, with expectations worked out by
hand (not with ``keep_count``):

* ``bench_quality.py``: a ``<selector>@0.6`` row keeps 38 of every probe image's 64 visual tokens
  (round(0.6 x 64) = round(38.4) = 38), for every selector; compaction off and keep 1.0 keep all
  64, and keep 1.0 answers as compaction off does (nothing dropped). Under the engine's default
  ``compaction_mode="on_pressure"`` these pools never run short and every row would keep 100%.
* ``bench_prefix.py``: the "compact" pages column is the compact prefix's: a 448 x 448 photo is
  (448 / 32)^2 = 196 visual tokens, 0.6 of them is 118 (round(117.6)), so the compact prefix drops
  78 tokens, 4.875 pages of 16: 4 or 5 pages fewer than the dense prefix; with ``--compaction-mode
  on_pressure`` it says so and both columns are equal.
* ``bench_gpu.py`` (CUDA only): the options it builds engines with, and its TTFT measurement run
  on the CPU with an engine built from them: the hits attach the compact prefix (as above).

The full default runs stay by hand (docs/QUALITY.md, docs/PERFORMANCE.md).
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench_gpu  # noqa: E402
import bench_prefix  # noqa: E402
import bench_quality  # noqa: E402

from benchmarks.quality import MODEL_DIR, heldout  # noqa: E402

SELECTORS = ("uniform", "attention", "diversity", "random")
PROBE_IMAGE_TOKENS = 64  # a 256 x 256 probe image: (256 / 32)^2 merged tokens
PROBE_KEPT_AT_06 = 38  # round(0.6 * 64) = round(38.4)
PHOTO_TOKENS = 196  # a 448 x 448 benchmark photo: (448 / 32)^2
PHOTO_KEPT_AT_06 = 118  # round(0.6 * 196) = round(117.6); min_keep 16 does not bind
FEWER_PAGES = {4, 5}  # 196 - 118 = 78 tokens dropped = 4.875 pages of 16, however the prefix is aligned


def test_quality_rows_keep_what_their_ratio_says(tmp_path):
    """Five held-out samples, every selector at 0.6 and keep 1.0: the kept share of each row is
    its ratio's, worked out per image (about 10 s on two cores)."""
    samples = 5
    out = tmp_path / "q.json"
    assert bench_quality.main(["--model", str(MODEL_DIR), "--device", "cpu", "--samples", str(samples),
                               "--selectors", ",".join(SELECTORS), "--ratios", "1.0,0.6", "--threads", "8",
                               "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["off", "uniform@1.0", *(f"{s}@0.6" for s in SELECTORS)]
    images = sum(len(s.scenes) for s in heldout(samples))
    for name, run in runs.items():
        rep = run["report"]
        assert rep["visual_tokens"] * samples == pytest.approx(PROBE_IMAGE_TOKENS * images), name
        kept = PROBE_IMAGE_TOKENS if run["keep_ratio"] == 1.0 else PROBE_KEPT_AT_06
        assert rep["kept_tokens"] * samples == pytest.approx(kept * images), name
        assert rep["kept_share"] == pytest.approx(kept / PROBE_IMAGE_TOKENS), name
    assert runs["uniform@1.0"]["answers"] == runs["off"]["answers"]  # nothing dropped: the dense answers


def test_quality_merging_rows_are_selectable_and_keep_the_same_tokens(tmp_path):
    """``--selectors staggered,staggered+merge``: the merging row runs ``merge_values=True`` under
    its own name and keeps exactly what its selector keeps; no default list holds it."""
    out = tmp_path / "q.json"
    assert bench_quality.main(["--model", str(MODEL_DIR), "--device", "cpu", "--samples", "2", "--no-dense",
                               "--selectors", "staggered,staggered+merge", "--ratios", "0.6", "--threads", "4",
                               "--out", str(out)]) == 0
    runs = {r["name"]: r for r in json.loads(out.read_text())["runs"]}
    assert list(runs) == ["staggered@0.6", "staggered+merge@0.6"]
    assert [(r["selector"], r["merge_values"]) for r in runs.values()] == [("staggered", False),
                                                                          ("staggered+merge", True)]
    assert runs["staggered+merge@0.6"]["report"]["kept_share"] == runs["staggered@0.6"]["report"]["kept_share"]
    assert bench_quality.parse_selector("uniform") == ("uniform", False) and not any(
        s.endswith("+merge") for s in SELECTORS)
    with pytest.raises(SystemExit):
        bench_quality.main(["--model", str(MODEL_DIR), "--selectors", "nope+merge", "--out", str(out)])


@pytest.mark.usefixtures("media_dir")
@pytest.mark.parametrize("mode", ["always", "on_pressure"])
def test_prefix_bench_compact_column_is_the_mode_it_prints(tmp_path, capsys, mode):
    """One photo, one session on the tiny "test" checkpoint (about 6 s): by default the hits
    attach a compact prefix 4-5 pages smaller than the dense one; under on_pressure the output
    names that mode and the prefix stays dense (the pool never runs short)."""
    out = tmp_path / "prefix.json"
    args = ["--preset", "test", "--sessions", "1", "--repeats", "1", "--max-tokens", "1", "--skip-transformers",
            "--out", str(out)]
    assert bench_prefix.main(args if mode == "always" else [*args, "--compaction-mode", mode]) == 0
    result = json.loads(out.read_text())
    assert result["compaction_mode"] == mode and f"compaction_mode {mode}" in capsys.readouterr().out
    ours = result["rows"][0]["ours"]
    assert ours["prefix_cache"] == [["miss"], ["hit"], ["hit"], ["hit"]]
    assert ours["visual_tokens"] == PHOTO_TOKENS
    hits = ours["sessions"][0][1:]
    if mode == "always":
        assert ours["visual_tokens_kept"] == PHOTO_KEPT_AT_06
        assert ours["prefix_pages_dense"] - ours["prefix_pages"] in FEWER_PAGES
        assert {h["prefix_form"] for h in hits} == {"compact"}
    else:
        assert ours["visual_tokens_kept"] == PHOTO_TOKENS
        assert ours["prefix_pages"] == ours["prefix_pages_dense"]
        assert {h["prefix_form"] for h in hits} == {"dense"}


@pytest.mark.usefixtures("media_dir")
@pytest.mark.parametrize("mode", ["always", "on_pressure"])
def test_gpu_bench_options_measure_the_mode_they_name(tiny_ckpt, mode):
    """bench_gpu.py's engine options on the CPU, on the tiny "test" checkpoint (about 1 s): its
    TTFT measurement (one photo) reports hits on a compact prefix 4-5 pages smaller than the dense
    one by default, on the dense prefix with ``--compaction-mode on_pressure``, and the shape's
    JSON names the mode."""
    from engine import Engine

    options = bench_gpu.engine_options(bench_gpu.parse_args([] if mode == "always" else ["--compaction-mode", mode]))
    with Engine.from_pretrained(tiny_ckpt, device="cpu", **options) as engine:
        res = bench_gpu.bench_ttft(engine, None, 1, tflops=1.0)
        assert engine.options.compaction_mode == mode
    assert res["hit_prefix"] == ["hit"] * 3
    if mode == "always":
        assert res["prefix_pages_dense"] - res["prefix_pages"] in FEWER_PAGES
    else:
        assert res["prefix_pages"] == res["prefix_pages_dense"]
