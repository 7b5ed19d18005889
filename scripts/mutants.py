"""Plant classic training faults one at a time in a copy of the repo, and report which the fast tests catch.

    make mutants                                          # every mutant of tests/mutants.yaml, one at a time
    .venv/bin/python scripts/mutants.py --only grad-accum-not-averaged --only warmup-off-by-one -j 2
    .venv/bin/python scripts/mutants.py --list            # what the list holds (and any entry that no longer applies)
    .venv/bin/python scripts/mutants.py --markdown        # the table of docs/testing.md

Each mutant replaces one exact line fragment (`old`, found exactly once in its file) with `new` in a copy of the
tracked and untracked-but-not-ignored files, then runs its `tests` there with pytest. The copy's package is the
one imported: pytest runs in the copy with the copy first on PYTHONPATH, which every rank it starts inherits
(the editable install's finder comes after PYTHONPATH on the import path). Each run gets its own tokenizer cache,
so a fault in tokenization is not hidden by a cache the real tree filled.

A mutant is caught (its tests fail), MISSED (they pass) or broken (its text does not apply, the tests could not
be collected or ran past --timeout). The exit code is 1 when any is missed or broken. `--baseline` (as `make mutants`
runs it) first runs every named test unmutated: a test that fails without a mutant would make "caught" meaningless.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "tests" / "mutants.yaml"
FIELDS = ("id", "fault", "file", "old", "new", "tests")


@dataclass
class Mutant:
    id: str
    fault: str  # the classic fault, in one line
    file: str
    old: str
    new: str
    tests: list[str]


@dataclass
class Outcome:
    status: str  # caught, MISSED or broken
    seconds: float
    detail: str = ""


def load_mutants(path: Path) -> list[Mutant]:
    """The mutants of a YAML list; a malformed entry is an error naming it."""
    entries = yaml.safe_load(path.read_text())
    mutants = []
    for i, entry in enumerate(entries or []):
        missing = [f for f in FIELDS if not isinstance(entry, dict) or entry.get(f) in (None, "", [])]
        if missing:
            raise SystemExit(f"{path}: entry {i + 1} lacks {', '.join(missing)}")
        tests = entry["tests"] if isinstance(entry["tests"], list) else [entry["tests"]]
        mutants.append(Mutant(*(str(entry[f]) for f in FIELDS[:-1]), [str(t) for t in tests]))
    ids = [m.id for m in mutants]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise SystemExit(f"{path}: ids used twice: {', '.join(repeated)}")
    return mutants


def problem(mutant: Mutant, root: Path) -> str | None:
    """Why `mutant` cannot be planted in `root` (its old text must be one line, found exactly once), or None."""
    path = root / mutant.file
    if not path.is_file():
        return f"{mutant.file} does not exist"
    if "\n" in mutant.old:
        return "old text spans several lines; give one line's fragment"
    if mutant.old == mutant.new:
        return "old and new text are the same"
    count = path.read_text().count(mutant.old)
    if count != 1:
        return f"old text found {count} times in {mutant.file}, not once: {mutant.old!r}"
    return None


def copy_tree(root: Path, dest: Path) -> None:
    """Copy git's tracked files and its untracked, not ignored ones (as the working tree has them) to `dest`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            check=True, capture_output=True, text=True).stdout
    for name in filter(None, listed.split("\0")):
        source = root / name
        if source.is_file():  # a tracked file deleted in the working tree is left out
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def run_mutant(mutant: Mutant | None, tests: list[str], timeout: float) -> Outcome:
    """Plant `mutant` (None: nothing) in a fresh copy of the repo and run `tests` there."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.id if mutant else 'baseline'}-") as tmp:
        copy = Path(tmp) / "repo"
        copy_tree(ROOT, copy)
        if mutant:
            why = problem(mutant, copy)
            if why:
                return Outcome("broken", 0.0, why)
            path = copy / mutant.file
            path.write_text(path.read_text().replace(mutant.old, mutant.new))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(copy), os.environ.get("PYTHONPATH")])),
               "CLUSTERTRAIN_TEST_CACHE": str(Path(tmp) / "cache"), "COLUMNS": "200"}  # wide FAILED lines
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                   f"--basetemp={Path(tmp) / 'pytest'}", *tests]
        proc = subprocess.Popen(command, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # pytest and every rank it started
            proc.communicate()
            return Outcome("broken", time.monotonic() - start, f"ran past {timeout:.0f} s")
        seconds = time.monotonic() - start
    last = (output.strip().splitlines() or [""])[-1]
    if proc.returncode == 0:
        return Outcome("MISSED", seconds, last)
    if proc.returncode == 1:  # tests failed
        failed = next((line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))), last)
        return Outcome("caught", seconds, failed[:200])
    return Outcome("broken", seconds, f"pytest exit {proc.returncode}: {last}")  # collection error, no tests, ...


def markdown(mutants: list[Mutant]) -> str:
    """The table of faults and the tests meant to catch them, for docs/testing.md."""
    rows = ["| fault | planted in | caught by |", "| --- | --- | --- |"]
    for m in mutants:
        tests = "<br>".join(f"`{t}`" for t in m.tests)
        rows.append(f"| {m.fault} (`{m.id}`) | `{m.file}` | {tests} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutants", type=Path, default=MUTANTS, help="the list (default: tests/mutants.yaml)")
    parser.add_argument("--only", action="append", metavar="ID", help="run only this mutant (repeatable)")
    parser.add_argument("--list", action="store_true", help="print the mutants and whether each still applies")
    parser.add_argument("--markdown", action="store_true", help="print the table for docs/testing.md")
    parser.add_argument("-j", type=int, default=1, metavar="N", help="mutants run at once (default 1)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutant (default 900)")
    parser.add_argument("--baseline", action="store_true",
                        help="first run the named tests without any mutant: they must pass")
    args = parser.parse_args(argv)

    mutants = load_mutants(args.mutants)
    if args.only:
        unknown = sorted(set(args.only) - {m.id for m in mutants})
        if unknown:
            parser.error(f"no mutant {', '.join(unknown)} in {args.mutants}")
        mutants = [m for m in mutants if m.id in args.only]
    if args.markdown:
        print(markdown(mutants))
        return 0
    if args.list:
        for m in mutants:
            why = problem(m, ROOT)
            print(f"{m.id}: {m.fault}\n    {m.file}: {m.old!r} -> {m.new!r}\n    tests: {' '.join(m.tests)}"
                  + (f"\n    BROKEN: {why}" if why else ""))
        return 1 if any(problem(m, ROOT) for m in mutants) else 0

    if args.baseline:  # a test that fails unmutated would count every mutant it names as caught
        tests = list(dict.fromkeys(t for m in mutants for t in m.tests))
        print(f"baseline: running {len(tests)} test selections on the unmutated tree", flush=True)
        outcome = run_mutant(None, tests, args.timeout * len(mutants))
        if outcome.status != "MISSED":
            print(f"baseline: the tests do not pass without a mutant ({outcome.detail}); fix them first")
            return 1
        print(f"baseline: passed in {outcome.seconds:.0f} s", flush=True)

    outcomes: dict[str, Outcome] = {}
    width = max(len(m.id) for m in mutants)

    def one(numbered: tuple[int, Mutant]) -> None:
        i, m = numbered
        why = problem(m, ROOT)  # refused before copying anything
        if why is None:
            print(f"[{i}/{len(mutants)}] {m.id}: running {' '.join(m.tests)}", flush=True)
        outcome = Outcome("broken", 0.0, why) if why else run_mutant(m, m.tests, args.timeout)
        outcomes[m.id] = outcome
        print(f"[{i}/{len(mutants)}] {m.id}: {outcome.status} in {outcome.seconds:.0f} s  {outcome.detail}", flush=True)

    with ThreadPoolExecutor(max(1, args.j)) as pool:
        list(pool.map(one, enumerate(mutants, 1)))

    print(f"\n{'mutant':<{width}}  {'result':<7} {'time':>6}  tests")
    for m in mutants:
        o = outcomes[m.id]
        print(f"{m.id:<{width}}  {o.status:<7} {o.seconds:>5.0f}s  {' '.join(m.tests)}"
              + (f"\n{'':<{width}}  {o.detail}" if o.status == "broken" else ""))
    counts = {s: sum(o.status == s for o in outcomes.values()) for s in ("caught", "MISSED", "broken")}
    print(f"\n{counts['caught']} caught, {counts['MISSED']} missed, {counts['broken']} broken of {len(mutants)} mutants")
    return 1 if counts["MISSED"] or counts["broken"] else 0


if __name__ == "__main__":
    sys.exit(main())
