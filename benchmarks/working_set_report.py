"""The working-set benchmark's report: a markdown table and a plot beside the JSON.

    python benchmarks/working_set_report.py ws.json      # writes ws.md and ws.png again

The plot (matplotlib, ``pip install -e ".[bench]"``) has one row per workset: the TTFT CDF of
every variant, then its recomputed prompt tokens, its resident prefixes and its answers by where
their prefix came from (a hit in the KV pool, a hit restored from the host tier, recomputed) as
bars. Below the tables, the host tier's goals (issue 33) checked against the JSON
(:func:`goal_checks`), pass or fail printed, nothing asserted.
"""

from __future__ import annotations

import json
import pathlib
import sys


def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return f"{v:,}"


def _change(v, ref) -> str:
    """``v`` against ``ref`` in percent (``-59.6 %``), or empty."""
    if v is None or not ref:
        return ""
    return f" ({100 * (v - ref) / ref:+.1f} %)"


COLUMNS = (
    ("TTFT p50 ms", "ttft_ms_p50"), ("TTFT p99 ms", "ttft_ms_p99"), ("E2E p50 ms", "e2e_ms_p50"),
    ("E2E p99 ms", "e2e_ms_p99"), ("recomputed prompt tokens", "recomputed_prompt_tokens"),
    ("hit / miss / stale", None), ("resident prefixes", "resident_prefixes"),
    ("prefix evictions", "prefix_evictions"), ("extension evictions", "extension_evictions"),
    ("on-pressure compactions (pages freed)", None), ("hits dense / compact", None),
    ("prefix pages (dense equiv.)", None), ("KV MiB", None), ("peak GPU GiB", None),
    ("output tok/s", "output_tokens_per_s"),
)
#: Columns shown with their change against the dense FP8 variant.
RELATIVE = {"ttft_ms_p50", "ttft_ms_p99", "recomputed_prompt_tokens", "resident_prefixes", "prefix_evictions"}


TIER_COLUMNS = ("host tier", "hits GPU / host", "dense prefix: of hits / of answers", "restore ms p50 / p99",
                "host pages used peak / end (of)", "offloads / restores / host evictions", "restore GB/s",
                "copy floor GB/s (restore / floor)")


def _share(v) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


def _gb(v) -> str:
    return "-" if v is None else f"{v / 1e9:,.2f}"


def host_label(result: dict, variant: str, m: dict) -> str:
    """The variant's host tier as the table shows it: ``off``, or its size as asked (``4 x B``)
    and in MiB as resolved (the engine's ``host_cache_bytes`` where it reports it)."""
    asked = result["protocol"]["variants"].get(variant, {}).get("host_cache_bytes", 0)
    if asked == 0:
        return "off"
    size = m.get("host_cache_bytes") or m.get("options", {}).get("host_cache_bytes")
    text = "default" if asked is None else str(asked)
    return text if not size else f"{text} ({size / 2**20:,.0f} MiB)"


def dense_hit_share(m: dict) -> float | None:
    """Dense hits over hits: the JSON's ``dense_hit_share``, or for a JSON from before it, its
    ``dense_hits`` / ``hits`` (None without hits)."""
    if "dense_hit_share" in m:
        return m["dense_hit_share"]
    return m["dense_hits"] / m["hits"] if m.get("hits") and "dense_hits" in m else None


def pool_hits(m: dict) -> int:
    """Hits served from the KV pool: those reported ``"gpu"`` plus those of an engine (or a JSON)
    from before the host tier, which reports no tier (all its hits are in the pool)."""
    if "hits_gpu" not in m:
        return m["hits"]
    return m["hits_gpu"] + m.get("hits_tier_unreported", 0)


def tier_row(result: dict, variant: str, m: dict) -> str:
    """One variant's row of the host-tier table."""
    three = (m.get("cache_offloads"), m.get("cache_restores"), m.get("cache_host_evictions"))
    cells = [host_label(result, variant, m),
             f"{pool_hits(m)} / {m.get('hits_host', 0)}",
             f"{_share(dense_hit_share(m))} / {_share(m.get('dense_answer_share'))}",
             f"{_fmt(m.get('restore_ms_p50'), 2)} / {_fmt(m.get('restore_ms_p99'), 2)}",
             f"{_fmt(m.get('host_pages_used_peak'))} / {_fmt(m.get('host_pages_used_end'))} "
             f"({_fmt(m.get('host_pages_total'))})",
             " / ".join(_fmt(v) for v in three),
             _gb(m.get("restore_bytes_per_s")),
             f"{_gb(m.get('copy_floor_bytes_per_s'))} ({_share(m.get('restore_bandwidth_ratio'))})"]
    return f"| {variant} | " + " | ".join(cells) + " |"


def _run(result: dict, workset: str, variant: str) -> dict | None:
    m = result.get("results", {}).get(workset, {}).get(variant)
    return None if m is None or "error" in m else m


def goal_checks(result: dict) -> list[dict]:
    """The host tier's goals (issue 33, H200 at the 8B shape) computed from a result JSON: one
    dict per check, ``goal`` (text), ``value`` (text), ``passed`` (True / False, or None when
    what it needs did not run). The goals:

    * ``deep`` with host = 4 x B (``on_pressure_host4x``): >= 99 % of questions hit; >= 95 % of
      the hits on a dense prefix; TTFT p99 <= 1.5 x ``knee``'s ``on_pressure`` (no tier) TTFT p99;
      restores at >= 75 % of the copy floor measured in the same variant.
    * ``pressure``: each of ``on_pressure_host1x`` / ``on_pressure_host4x`` (the default policy
      with the tier) has a larger dense-hit share than ``on_pressure`` without it, at an equal or
      lower TTFT p99.
    """
    checks = []

    def add(goal: str, value: str, passed: bool | None) -> None:
        checks.append({"goal": goal, "value": value, "passed": passed})

    deep, knee = _run(result, "deep", "on_pressure_host4x"), _run(result, "knee", "on_pressure")
    name = "deep, on_pressure_host4x"
    if deep is None:
        for goal in ("hits >= 99 % of questions", "dense prefix >= 95 % of hits",
                     "TTFT p99 <= 1.5 x knee on_pressure (no tier)", "restore bandwidth >= 75 % of the copy floor"):
            add(f"{name}: {goal}", "not run", None)
    else:
        answered = deep["requests"] - deep["errors"]
        hit_share = deep["hits"] / deep["requests"] if deep["requests"] else None
        add(f"{name}: hits >= 99 % of questions", f"{deep['hits']} of {deep['requests']} ({_share(hit_share)}; "
            f"{answered} answered)", None if hit_share is None else hit_share >= 0.99)
        dense = dense_hit_share(deep)
        add(f"{name}: dense prefix >= 95 % of hits", _share(dense), None if dense is None else dense >= 0.95)
        if knee is None or knee["ttft_ms_p99"] is None or deep["ttft_ms_p99"] is None:
            add(f"{name}: TTFT p99 <= 1.5 x knee on_pressure (no tier)",
                f"{_fmt(deep['ttft_ms_p99'])} ms; knee on_pressure not run", None)
        else:
            ratio = deep["ttft_ms_p99"] / knee["ttft_ms_p99"]
            add(f"{name}: TTFT p99 <= 1.5 x knee on_pressure (no tier)",
                f"{_fmt(deep['ttft_ms_p99'])} vs {_fmt(knee['ttft_ms_p99'])} ms ({ratio:.2f} x)", ratio <= 1.5)
        bw = deep.get("restore_bandwidth_ratio")
        add(f"{name}: restore bandwidth >= 75 % of the copy floor",
            f"{_gb(deep.get('restore_bytes_per_s'))} of {_gb(deep.get('copy_floor_bytes_per_s'))} GB/s "
            f"({_share(bw)}, {deep.get('copy_floor_kind') or 'no floor'})", None if bw is None else bw >= 0.75)
    base = _run(result, "pressure", "on_pressure")
    for variant in ("on_pressure_host1x", "on_pressure_host4x"):
        goal = f"pressure, {variant}: dense-hit share > on_pressure's (no tier) at TTFT p99 <= its"
        tier = _run(result, "pressure", variant)
        if tier is None or base is None:
            add(goal, f"{'on_pressure' if base is None else variant} not run", None)
            continue
        a, b = dense_hit_share(tier), dense_hit_share(base)
        value = (f"dense {_share(a)} vs {_share(b)}, TTFT p99 {_fmt(tier['ttft_ms_p99'])} vs "
                 f"{_fmt(base['ttft_ms_p99'])} ms")
        known = None not in (a, b, tier["ttft_ms_p99"], base["ttft_ms_p99"])
        add(goal, value, (a > b and tier["ttft_ms_p99"] <= base["ttft_ms_p99"]) if known else None)
    return checks


def goals_markdown(result: dict) -> list[str]:
    """The goal checks as a markdown table (empty when none of what they need ran)."""
    checks = goal_checks(result)
    if all(c["passed"] is None and c["value"].endswith("not run") for c in checks):
        return []
    verdict = {True: "pass", False: "FAIL", None: "-"}
    return ["## Host-tier goals (issue 33; the H200 at the 8B shape is the reference)", "",
            "| goal | measured | verdict |", "|---|---|---|",
            *(f"| {c['goal']} | {c['value']} | {verdict[c['passed']]} |" for c in checks), ""]


def markdown(result: dict) -> str:
    """The results as markdown: two tables per workset (the cache, then the host tier), a row per
    variant (changes in brackets against ``dense_fp8`` where it ran), then the goal checks."""
    p = result["protocol"]
    lines = [f"# Working set: {result['setup']['checkpoint']} on {result['setup']['device']}", "",
             f"B = {p['budget_pages']} FP8 pages of {p['page_size']} tokens ({p['budget_bytes']:,} KV bytes per "
             f"variant), {p['requests']} measured requests per variant at {p['rate']} req/s (time scale "
             f"{p['time_scale']}), Zipf alpha {p['zipf_alpha']}, {p['max_tokens']} output tokens, vision-feature "
             f"cache {p['vision_cache_bytes'] / 2**20:.0f} MiB, keep ratio {p['keep_ratio']}.", ""]
    for name, runs in result["results"].items():
        ws = result["worksets"][name]
        lines += [f"## {name}: {ws['groups']} groups, {ws['dense_pages']} dense pages = {ws['ratio']:.2f} B", "",
                  "| variant | " + " | ".join(c for c, _ in COLUMNS) + " |",
                  "|---|" + "---|" * len(COLUMNS)]
        ref = runs.get("dense_fp8") if "error" not in runs.get("dense_fp8", {"error": 1}) else None
        for variant, m in runs.items():
            if "error" in m:
                lines.append(f"| {variant} | failed: {m['error']} |" + " |" * (len(COLUMNS) - 1))
                continue
            cells = []
            for _, key in COLUMNS[:5]:
                cells.append(_fmt(m[key]) + (_change(m[key], ref[key]) if ref and key in RELATIVE else ""))
            cells.append(f"{m['hits']} / {m['misses']} / {m['stale']}")
            for key in ("resident_prefixes", "prefix_evictions", "extension_evictions"):
                cells.append(_fmt(m[key]) + (_change(m[key], ref[key]) if ref and key in RELATIVE else ""))
            cells.append(f"{m.get('pressure_compactions', 0)} ({m.get('pressure_pages_freed', 0)})")
            cells.append(f"{m.get('dense_hits', '-')} / {m.get('compact_hits', '-')}")
            cells.append(f"{m['prefix_pages']} ({m['prefix_pages_dense_equivalent']})")
            cells.append(f"{m['kv_cache_bytes'] / 2**20:,.2f}")
            peak = m["peak_gpu_memory_bytes"]
            cells.append("-" if peak is None else f"{peak / 2**30:.1f}")
            cells.append(_fmt(m["output_tokens_per_s"]))
            lines.append(f"| {variant} | " + " | ".join(cells) + " |")
        lines += ["", f"*{name}: host tier* (hits GPU counts hits of an engine that reports no tier; dense "
                      "prefix of answers counts misses that cached a dense prefix too)", "",
                  "| variant | " + " | ".join(TIER_COLUMNS) + " |", "|---|" + "---|" * len(TIER_COLUMNS)]
        lines += [tier_row(result, v, m) for v, m in runs.items() if "error" not in m]
        lines.append("")
    lines += goals_markdown(result)
    return "\n".join(lines)


def plot(result: dict, path: pathlib.Path) -> bool:
    """Write the plot to ``path``; False (nothing written) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    worksets = list(result["results"])
    fig, axes = plt.subplots(len(worksets), 4, figsize=(20, 3.8 * len(worksets)), squeeze=False)
    for row, name in zip(axes, worksets, strict=True):
        runs = {v: m for v, m in result["results"][name].items() if "error" not in m}
        cdf, recomputed, resident, tiers = row
        for variant, m in runs.items():
            ttft = m["ttft_ms"]
            if ttft:
                cdf.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=variant)
        cdf.set_xscale("log")
        cdf.xaxis.set_minor_formatter(NullFormatter())  # minor labels collide within a decade
        cdf.set_xlabel("TTFT from planned arrival (ms)")
        cdf.set_ylabel("share of requests")
        cdf.set_title(f"{name}: TTFT CDF")
        cdf.legend(fontsize=8)
        names = list(runs)
        recomputed.bar(names, [runs[v]["recomputed_prompt_tokens"] for v in names], color="tab:orange")
        recomputed.set_title(f"{name}: recomputed prompt tokens")
        resident.bar(names, [runs[v]["resident_prefixes"] for v in names], color="tab:green")
        resident.axhline(result["worksets"][name]["groups"], color="grey", linestyle="--", linewidth=1)
        resident.set_title(f"{name}: resident prefixes at the end (dashed: groups)")
        plot_tiers(tiers, name, runs)
        for ax in (recomputed, resident, tiers):
            ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_tiers(ax, name: str, runs: dict) -> None:
    """Stacked bars per variant: hits in the KV pool, hits restored from the host tier, the rest
    (misses, stale, errors); the dense-hit share written above each bar."""
    names = list(runs)
    gpu = [pool_hits(runs[v]) for v in names]
    host = [runs[v].get("hits_host", 0) for v in names]
    rest = [runs[v]["requests"] - g - h for v, g, h in zip(names, gpu, host, strict=True)]
    ax.bar(names, gpu, color="tab:blue", label="hit, KV pool")
    ax.bar(names, host, bottom=gpu, color="tab:purple", label="hit, host tier")
    ax.bar(names, rest, bottom=[g + h for g, h in zip(gpu, host, strict=True)], color="tab:grey",
           label="miss / stale / error")
    for i, v in enumerate(names):
        share = dense_hit_share(runs[v])
        if share is not None:
            ax.text(i, runs[v]["requests"], f"{100 * share:.0f}% dense", ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, 1.15 * max((runs[v]["requests"] for v in names), default=1))  # room for the shares
    ax.set_title(f"{name}: answers by prefix source (dense share of hits)")
    ax.legend(fontsize=7, loc="lower right")


def write(result: dict, out: pathlib.Path, *, with_plot: bool = True) -> dict:
    """Write ``out`` (JSON, replaced atomically), and beside it ``.md`` and, with ``with_plot``
    and matplotlib installed, ``.png``. Returns the paths written by kind."""
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)
    md = out.with_suffix(".md")
    md.write_text(markdown(result) + "\n")
    written = {"json": str(out), "markdown": str(md)}
    png = out.with_suffix(".png")
    if with_plot and plot(result, png):
        written["plot"] = str(png)
    return written


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = pathlib.Path(args[0])
    print(write(json.loads(out.read_text()), out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
