""".venv/bin/python bench/suite_startup.py [--repeats 3]

What the test suite's fork server (tests/forkserver.py) saves: the tiny run the tests train (`helpers.TINY`, 6
steps), on one rank and on two (`--nproc 2`), started as fresh interpreters and forked from the server, in turns
within one process so that both ways meet the same machine. Prints the median wall time of each and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

from helpers import TINY, _run_once  # noqa: E402
from forkserver import SERVER  # noqa: E402


def run(folder: Path, nproc: int | None, fresh: bool) -> float:
    """Seconds for one tiny run of 6 steps, to its exit."""
    args = ["train", *(["--nproc", str(nproc)] if nproc else []),
            *[f"--set={o}" for o in (*TINY, f"train.run_dir={folder}", "train.steps=6")]]
    if fresh:
        os.environ["CLUSTERTRAIN_TEST_NO_FORK"] = "1"
    start = time.perf_counter()
    try:
        result = _run_once(["-m", "clustertrain", *args], None, 300, None)
    finally:
        os.environ.pop("CLUSTERTRAIN_TEST_NO_FORK", None)
    assert result.returncode == 0, result.stderr[-2000:]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    os.environ["CLUSTERTRAIN_CACHE"] = str(root / "cache")
    started = time.perf_counter()
    SERVER.start()
    print(f"fork server ready in {time.perf_counter() - started:.1f} s (once per pytest worker)")
    run(root / "warm", None, fresh=False)  # the tokenizer, trained once into the cache
    print(f"{'run':<10} {'fresh (s)':>10} {'forked (s)':>11} {'ratio':>6}")
    for nproc in (None, 2):
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(args.repeats):
            for fresh in (True, False):
                times[fresh].append(run(root / f"{nproc}-{fresh}-{i}", nproc, fresh))
        fresh, forked = statistics.median(times[True]), statistics.median(times[False])
        print(f"{f'{nproc or 1} rank(s)':<10} {fresh:>10.2f} {forked:>11.2f} {fresh / forked:>5.1f}x")
    SERVER.stop()


if __name__ == "__main__":
    main()
