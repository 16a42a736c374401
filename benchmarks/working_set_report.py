"""The working-set benchmark's report: a markdown table and a plot beside the JSON.

    python benchmarks/working_set_report.py ws.json      # writes ws.md and ws.png again

The plot (matplotlib, ``pip install -e ".[bench]"``) has one row per workset: the TTFT CDF of
every variant, then its recomputed prompt tokens and its resident prefixes as bars.
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


def markdown(result: dict) -> str:
    """The results as markdown: one table per workset, a row per variant (changes in brackets
    against ``dense_fp8`` where it ran)."""
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
        lines.append("")
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
    fig, axes = plt.subplots(len(worksets), 3, figsize=(15, 3.8 * len(worksets)), squeeze=False)
    for row, name in zip(axes, worksets, strict=True):
        runs = {v: m for v, m in result["results"][name].items() if "error" not in m}
        cdf, recomputed, resident = row
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
        for ax in (recomputed, resident):
            ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


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
