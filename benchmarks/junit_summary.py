"""What a pytest run did, from its JUnit XML (``pytest --junitxml FILE``): how many tests passed,
failed, errored and were skipped, every skip reason with its count and tests, and how many tests of
each file ran. ``benchmarks/gpu_all.sh`` writes it beside the GPU suite's output, so the record
shows that the GPU-only tests (those that skip on the CPU) ran there, and why anything skipped.

Usage: ``python benchmarks/junit_summary.py JUNIT_XML``
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict


def summarize(path: str) -> str:
    """The summary of the JUnit XML file at ``path`` as text (one fact per line)."""
    cases = ET.parse(path).getroot().iter("testcase")
    outcome: Counter[str] = Counter()
    ran_per_file: Counter[str] = Counter()
    skips: dict[str, list[str]] = defaultdict(list)
    for case in cases:
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        skipped = case.find("skipped")
        if skipped is not None:
            outcome["skipped"] += 1
            skips[skipped.get("message", "").strip()].append(test)
            continue
        kind = "failed" if case.find("failure") is not None else "error" if case.find("error") is not None else "passed"
        outcome[kind] += 1
        ran_per_file[case.get("classname", "")] += 1
    lines = [f"tests: {sum(outcome.values())}; " + ", ".join(f"{k} {outcome[k]}" for k in
                                                             ("passed", "failed", "error", "skipped"))]
    lines.append(f"skip reasons ({len(skips)}):")
    for reason, tests in sorted(skips.items(), key=lambda item: -len(item[1])):
        lines.append(f"  {len(tests):4d}  {reason}")
        lines += [f"          {t}" for t in tests]
    lines.append("tests run (passed, failed or errored) per module (or class):")
    lines += [f"  {n:4d}  {module}" for module, n in sorted(ran_per_file.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    try:
        print(summarize(sys.argv[1]))
    except (OSError, ET.ParseError) as exc:  # no XML: the run was killed (timeout) before it ended
        sys.exit(f"no readable JUnit XML at {sys.argv[1]} ({exc}): did the test run finish?")
