"""The mutation check: plant each bug of ``mutants.py`` in a temporary copy of the repository, run
the tests that must catch it, and report which were killed (a test failed) and which survived.

Run it by hand from the repository root, on the CPU, before changing the areas it covers (the prefix
cache key and salts, compaction counts, the FP8 store, the prefix hit's work, share links, the app's
sessions, images, vision graphs), and after adding an entry::

    python tests/mutation/run.py                  # every mutant (about 5 minutes on 2 cores)
    python tests/mutation/run.py --only NAME ...  # some of them
    python tests/mutation/run.py --list           # names and bugs
    python tests/mutation/run.py --check          # only check that every entry still applies

The working tree is never modified: its files (tracked and untracked, not ignored, as they are now,
uncommitted edits included) are copied to a temporary folder, the unmutated copy must pass every
listed test (the baseline), then each bug is planted there in turn, its tests run with ``-x`` and the
file restored. Bytecode is not written (``PYTHONDONTWRITEBYTECODE=1``), so no run sees a stale
``.pyc`` of another. The photos are the copy's own (``tests/media``), as the tests find them.

Exit status 0 when the baseline passes and every mutant is killed; 1 otherwise (a survivor, an entry
whose text no longer occurs exactly once, a run that collected no test).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mutants import MUTANTS, Mutant

ROOT = Path(__file__).resolve().parents[2]
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]


@dataclass
class Outcome:
    """What happened to one mutant: ``result`` is killed / survived / not applied / error."""

    mutant: Mutant
    result: str
    caught_by: str = ""
    seconds: float = 0.0


def copy_repository(dest: Path) -> None:
    """Copy the working tree's tracked and untracked-but-not-ignored files into ``dest``."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():  # a tracked file deleted in the working tree is left out
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def base_env() -> dict[str, str]:
    """The environment of every run: no bytecode, no CI strictness unless asked."""
    env = {k: v for k, v in os.environ.items() if k != "PRISM_CI"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_imports(repo: Path, env: dict[str, str]) -> None:
    """Refuse to go on unless the copy's packages are the ones its tests import."""
    code = "import app, engine, ops, sessions; print('\\n'.join(m.__file__ for m in (app, engine, ops, sessions)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, check=True, capture_output=True, text=True)
    stray = [f for f in out.stdout.split() if not Path(f).resolve().is_relative_to(repo.resolve())]
    if stray:
        sys.exit(f"the copy imports packages from elsewhere: {stray}")


def first_failure(output: str) -> str:
    """The first ``FAILED`` / ``ERROR`` test of a pytest summary (or the line saying why the run failed)."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ", 1)[0]
        if line.startswith("STRAY SKIP "):  # conftest's PRISM_CI=1 check
            return line[:100]
    return next((line.strip()[:100] for line in output.splitlines() if "error" in line.lower()), "")


def run_tests(repo: Path, tests: tuple[str, ...], env: dict[str, str], timeout: float,
              stop_first: bool = True) -> tuple[int | None, str]:
    """Run ``tests`` in ``repo``; returns (exit status or None on timeout, output)."""
    cmd = PYTEST + (["-x"] if stop_first else []) + list(tests)
    try:
        done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, out
    return done.returncode, done.stdout + done.stderr


def apply(repo: Path, mutant: Mutant) -> tuple[Path, str] | str:
    """Plant ``mutant`` in ``repo``; returns (file, its original text) to restore, or why it cannot."""
    if mutant.path is None:
        return repo, ""
    path = repo / mutant.path
    if not path.is_file():
        return f"{mutant.path} does not exist"
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        return f"its text occurs {count} times in {mutant.path}"
    path.write_text(text.replace(mutant.old, mutant.new))
    return path, text


def try_mutant(repo: Path, mutant: Mutant, env: dict[str, str], timeout: float) -> Outcome:
    start = time.monotonic()
    planted = apply(repo, mutant)
    if isinstance(planted, str):
        return Outcome(mutant, "not applied", planted)
    path, original = planted
    try:
        status, output = run_tests(repo, mutant.tests, {**env, **mutant.env}, timeout)
    finally:
        if mutant.path is not None:
            path.write_text(original)
    seconds = time.monotonic() - start
    if status is None:
        return Outcome(mutant, "killed (timeout)", f"no result in {timeout:.0f} s", seconds)
    if status == 0:
        return Outcome(mutant, "survived", "", seconds)
    if status in (1, 2):  # tests failed; or collection failed (the suite fails too)
        return Outcome(mutant, "killed", first_failure(output), seconds)
    return Outcome(mutant, "error", f"pytest exit status {status}: {first_failure(output)}", seconds)


def table(outcomes: list[Outcome]) -> str:
    rows = ["| mutant | planted bug | result | first failing test | s |", "|---|---|---|---|---|"]
    for o in outcomes:
        rows.append(f"| `{o.mutant.name}` | {o.mutant.bug} | {o.result} | `{o.caught_by}` | {o.seconds:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--check", action="store_true", help="only check that every mutant applies")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run (default 600)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = parser.parse_args(argv)
    names = [m.name for m in MUTANTS]
    if len(set(names)) != len(names):
        sys.exit("mutants.py: duplicate names")
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - set(names)
    if unknown:
        sys.exit(f"unknown mutants: {sorted(unknown)}")
    if args.list:
        for m in chosen:
            print(f"{m.name:40s} {m.bug}")
        return 0

    tmp = Path(tempfile.mkdtemp(prefix="prism-mutation-"))
    repo = tmp / "repo"
    try:
        copy_repository(repo)
        env = base_env()
        if args.check:
            bad = 0
            for m in chosen:
                planted = apply(repo, m)
                if isinstance(planted, str):
                    bad += 1
                    print(f"NOT APPLIED {m.name}: {planted}")
                elif m.path is not None:
                    planted[0].write_text(planted[1])
            print(f"{len(chosen) - bad} of {len(chosen)} mutants apply")
            return 1 if bad else 0
        check_imports(repo, env)
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        print(f"baseline: {len(tests)} test selections on the unmutated copy in {repo} ...", flush=True)
        status, output = run_tests(repo, tests, env, args.timeout, stop_first=False)
        if status != 0:
            print(output[-4000:])
            print("baseline FAILED: fix the suite first (a mutant 'killed' by a failing test proves nothing)")
            return 1
        print("baseline passed", flush=True)
        outcomes = []
        for m in chosen:
            outcome = try_mutant(repo, m, env, args.timeout)
            outcomes.append(outcome)
            print(f"  {outcome.result:17s} {m.name} ({outcome.seconds:.0f} s) {outcome.caught_by}", flush=True)
        print()
        print(table(outcomes))
        killed = sum(o.result.startswith("killed") for o in outcomes)
        print(f"\n{killed} of {len(outcomes)} mutants killed")
        return 0 if killed == len(outcomes) else 1
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
