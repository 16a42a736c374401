"""Curves and a table from ``benchmarks/bench_quality.py``'s JSON (issue 20).

    python benchmarks/quality_report.py q.json [more.json ...] --plot docs/quality/curves.png [--markdown q.md]

Several JSONs (one configuration list split over processes, the same samples) are merged: the
first file's header and runs, then every run of the others whose name is new.

One panel per question type (and all types): accuracy against keep ratio, one line per selector
(ratio 1.0 is the same run for every selector: it keeps every token), compaction off as a solid
grey line with its 95% interval shaded, and the blind control's answer-frequency prior (the
rate a model that does not look reaches; :func:`benchmarks.quality.harness.answer_prior`) dotted.
Also the paired comparison against compaction off: answers that changed, right -> wrong and
wrong -> right, overall and per type; and the transfer split's accuracy (``--transfer`` runs) in
a column of its own, outside ``all``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.quality import QUESTION_TYPES, heldout, is_correct  # noqa: E402
from benchmarks.quality.harness import answer_prior, blind, half_width  # noqa: E402

TYPES = (*QUESTION_TYPES, "all")


def merge(parts: list[dict]) -> dict:
    """One result from several ``bench_quality.py`` JSONs of the same samples: the first's header
    and runs, then each later run whose name is not there yet.

    Raises:
        ValueError: the parts differ in samples, start or transfer count.
    """
    out = {**parts[0], "runs": list(parts[0]["runs"])}
    names = {r["name"] for r in out["runs"]}
    for part in parts[1:]:
        for key in ("samples", "start", "transfer"):
            if part.get(key) != out.get(key):
                raise ValueError(f"cannot merge runs with different {key}: {part.get(key)} vs {out.get(key)}")
        for r in part["runs"]:
            if r["name"] not in names:
                out["runs"].append(r)
                names.add(r["name"])
    return out


def curves(data: dict) -> dict[str, dict[float, dict]]:
    """``{selector: {keep_ratio: report}}``; ratio 1.0 (run once) is every selector's."""
    runs = {r["name"]: r for r in data["runs"]}
    out: dict[str, dict[float, dict]] = {}
    full = runs.get("uniform@1.0")
    for r in data["runs"]:
        if r["selector"] is None:
            continue
        out.setdefault(r["selector"], {})[r["keep_ratio"]] = r["report"]
    for sel in out:
        if full is not None:
            out[sel].setdefault(1.0, full["report"])
    return out


def blind_prior(data: dict) -> dict[str, float] | None:
    """The answer-frequency prior of the blind run, recomputed from its stored answers."""
    run = next((r for r in data["runs"] if r["name"] == "blind"), None)
    if run is None:
        return None
    samples = blind(heldout(data["samples"], start=data["start"]))
    return answer_prior(samples, run["answers"])


def paired(data: dict, qtype: str = "all") -> list[tuple[str, int, int]]:
    """Per configuration: samples (of ``qtype``, or all) right when dense and wrong compacted, and
    the reverse."""
    samples = heldout(data["samples"], start=data["start"])
    dense = next(r for r in data["runs"] if r["name"] == "off")["answers"]
    out = []
    for r in data["runs"]:
        if r["selector"] is None:
            continue
        pairs = [(is_correct(d, s), is_correct(c, s)) for s, d, c in zip(samples, dense, r["answers"], strict=True)
                 if qtype in ("all", s.qtype)]
        lost = sum(d and not c for d, c in pairs)
        won = sum(c and not d for d, c in pairs)
        out.append((r["name"], lost, won))
    return out


def plot(data: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = curves(data)
    dense = next(r for r in data["runs"] if r["name"] == "off")["report"]
    prior = blind_prior(data)
    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5), sharex=True)
    for ax, qtype in zip(axes.flat, TYPES, strict=True):
        d = dense[qtype]
        hw = half_width(d["accuracy"], d["n"])
        ax.axhspan(100 * (d["accuracy"] - hw), 100 * (d["accuracy"] + hw), color="0.9")
        ax.axhline(100 * d["accuracy"], color="0.4", lw=1.5, label="compaction off (95% interval)")
        if prior is not None:
            ax.axhline(100 * prior[qtype], color="0.4", ls=":", lw=1.2, label="blind prior")
        for sel in sorted(lines):
            ratios = sorted(lines[sel])
            ax.plot(ratios, [100 * lines[sel][r][qtype]["accuracy"] for r in ratios], marker="o", ms=4, label=sel)
        ax.set_title(f"{qtype} (n = {d['n']})")
        ax.set_ylim(-2, 102)
        ax.set_xticks([0.25, 0.4, 0.6, 0.8, 1.0])
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("keep ratio (visual tokens kept per image)")
    for ax in axes[:, 0]:
        ax.set_ylabel("accuracy (%)")
    axes.flat[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Probe model, Prism engine ({data['device']}, kv {data['kv_cache_dtype']}), "
                 f"{data['samples']} held-out samples, min_keep {data['min_keep']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def markdown(data: dict) -> str:
    """The accuracy table (with the transfer column when the runs have one) and the per-type
    paired table (right -> wrong / wrong -> right against compaction off)."""
    has_transfer = bool(data.get("transfer"))
    extra = " transfer (count_colour) |" if has_transfer else ""
    head = "| configuration | " + " | ".join(TYPES) + f" |{extra} kept tokens | dense right -> wrong | wrong -> right |"
    rows = [head, "|" + "---|" * (len(TYPES) + 4 + has_transfer)]
    changes = {name: (lost, won) for name, lost, won in paired(data)}
    prior = blind_prior(data)
    for r in data["runs"]:
        rep = r["report"]
        cells = " | ".join(f"{100 * rep[t]['accuracy']:.1f}" for t in TYPES)
        if has_transfer:
            cells += f" | {100 * r['transfer']['report']['all']['accuracy']:.1f}" if "transfer" in r else " | "
        lost, won = changes.get(r["name"], ("", ""))
        rows.append(f"| {r['name']} | {cells} | {rep['kept_tokens']:.1f} ({100 * rep['kept_share']:.0f}%) "
                    f"| {lost} | {won} |")
        if r["name"] == "blind" and prior is not None:
            tp = r.get("transfer", {}).get("answer_prior")
            rows.append("| blind: answer-frequency prior | " + " | ".join(f"{100 * prior[t]:.1f}" for t in TYPES)
                        + (f" | {100 * tp['all']:.1f}" if tp else (" | " if has_transfer else "")) + " | | | |")
    per_type = {t: {name: (lost, won) for name, lost, won in paired(data, t)} for t in QUESTION_TYPES}
    rows += ["", "Right -> wrong / wrong -> right against compaction off, per type:", "",
             "| configuration | " + " | ".join(QUESTION_TYPES) + " |", "|" + "---|" * (len(QUESTION_TYPES) + 1)]
    for name in changes:
        rows.append(f"| {name} | " + " | ".join("{} / {}".format(*per_type[t][name]) for t in QUESTION_TYPES) + " |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=pathlib.Path, nargs="+")
    ap.add_argument("--plot", type=pathlib.Path)
    ap.add_argument("--markdown", type=pathlib.Path)
    args = ap.parse_args(argv)
    data = merge([json.loads(p.read_text()) for p in args.json])
    text = markdown(data)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.plot:
        plot(data, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
