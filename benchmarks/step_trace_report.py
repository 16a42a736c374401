"""Where the engine's time went: a summary of a step trace (``PRISM_STEP_TRACE``, engine/serving/trace.py).

Steps are grouped by what they carried (a warm's chunk, another prefill, a host-tier restore, or
decode rows only) and by the forward that ran (decode graph, prefill graph, eager). For each group:
how many steps, their mean execution time, and the time the loop spent outside the runner
(planning, applying, and the gaps between steps). A window (``--from`` / ``--to``, perf_counter
seconds on the traced host, as benchmarks record them) restricts the summary to a stretch of the
run, e.g. one measured stream.

    python benchmarks/step_trace_report.py steps.jsonl
    python benchmarks/step_trace_report.py steps.jsonl --from 1234.5 --to 1236.0
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.serving.trace import read  # noqa: E402


def kind(record: dict, previous: dict | None = None) -> str:
    """The step's class: ``"restore"`` (it orders or waits for a restore, or follows a step during
    which restores started: it carries their questions' first chunks), ``"warm"``, ``"prefill"``,
    ``"decode"`` or ``"idle"`` (no run)."""
    if not record["runs"]:
        return "idle"
    if record["restores"] or record["awaited"] or (previous or {}).get("early_restores"):
        return "restore"
    if record["warm_tokens"]:
        return "warm"
    if record["prefill_tokens"]:
        return "prefill"
    return "decode"


def summary(records: list[dict], start: float | None = None, end: float | None = None) -> dict:
    """Per step class and forward path: ``steps``, ``exec_ms_mean``, ``exec_ms_p50``, ``vision_ms``
    (total); and over the window: its length, the time in steps' execution, planning, applying and
    gaps (all ms). ``start`` / ``end``: perf_counter seconds (a step counts when it began inside)."""
    chosen = [r for r in records if (start is None or r["t"] >= start) and (end is None or r["t"] <= end)]
    groups: dict[str, list[dict]] = {}
    before = {id(r): p for p, r in zip([None, *records[:-1]], records, strict=True)}
    for r in chosen:
        groups.setdefault(f"{kind(r, before[id(r)])}/{r['path']}", []).append(r)
    out = {"steps": len(chosen), "groups": {}}
    for name, rs in sorted(groups.items()):
        ex = [r["exec_ms"] for r in rs]
        out["groups"][name] = {"steps": len(rs), "exec_ms_mean": round(statistics.fmean(ex), 3),
                               "exec_ms_p50": round(statistics.median(ex), 3),
                               "vision_ms": round(sum(r["vision_ms"] for r in rs), 3),
                               "warm_tokens": sum(r["warm_tokens"] for r in rs),
                               "prefill_tokens": sum(r["prefill_tokens"] for r in rs)}
    for field in ("exec_ms", "plan_ms", "apply_ms"):
        out[field] = round(sum(r[field] for r in chosen), 3)
    out["gap_ms"] = round(sum(r["gap_ms"] or 0.0 for r in chosen), 3)
    if chosen:
        last = chosen[-1]
        out["window_ms"] = round((last["t"] - chosen[0]["t"]) * 1e3 + last["plan_ms"] + last["exec_ms"]
                                 + last["apply_ms"], 3)
    return out


def text(s: dict) -> str:
    """A few lines of :func:`summary`'s result."""
    lines = [f"{s['steps']} steps over {s.get('window_ms', 0):.1f} ms: exec {s['exec_ms']:.1f}, plan "
             f"{s['plan_ms']:.1f}, apply {s['apply_ms']:.1f}, gaps {s['gap_ms']:.1f} ms"]
    for name, g in s["groups"].items():
        lines.append(f"  {name:>22}: {g['steps']:5d} steps, exec mean {g['exec_ms_mean']:.2f} ms (p50 "
                     f"{g['exec_ms_p50']:.2f}), vision {g['vision_ms']:.1f} ms, prefill {g['prefill_tokens']} tokens")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("trace", type=pathlib.Path)
    p.add_argument("--from", dest="start", type=float)
    p.add_argument("--to", dest="end", type=float)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    s = summary(read(str(args.trace)), args.start, args.end)
    print(json.dumps(s, indent=1) if args.json else text(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
