"""docs/parallel.md's table of tested combinations: every row names exactly one test, and that test exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_ID = re.compile(r"`(tests/[\w/]+\.py::\w+(?:\[[^\]`]+\])?)`")


def table_rows() -> list[str]:
    """The body rows of the table under '### Tested combinations'."""
    text = (ROOT / "docs" / "parallel.md").read_text()
    section = text.split("### Tested combinations", 1)[1]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return lines[2:]  # after the header and its rule


def test_every_row_names_one_test_and_every_named_test_is_collected():
    rows = table_rows()
    assert len(rows) >= 50
    named = []
    for row in rows:
        ids = TEST_ID.findall(row.rsplit("|", 2)[-2])
        assert len(ids) == 1, f"a row without exactly one test: {row}"
        named.append(ids[0])
    assert len(set(rows)) == len(rows), "a combination is listed twice"
    files = sorted({test_id.split("::")[0] for test_id in named})
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    found = set(collected.stdout.split())
    missing = [test_id for test_id in named if test_id not in found]
    assert not missing, f"named in docs/parallel.md but not collected: {missing}\n{collected.stdout[-2000:]}"
