"""Text from a run's files, made fit for a terminal: what a terminal would obey is escaped, a long value is cut.

    console.print(printable(f"state {cut(status['state'], CELL_CHARS)}: {cut(first_line)}"))

`status` and `slurm status` show what anyone who can write to a run directory wrote there; both go through these.
"""

from __future__ import annotations

import re
from typing import Any

LINE_CHARS = 300  # a value from a run's file is cut to this many characters on screen
CELL_CHARS = 40  # a table cell (a host, a state, a job's nodes): cut shorter
# What a terminal would act on: C0 and C1 controls (ESC starts its sequences), DEL, and Unicode's invisible
# direction and line controls; shown escaped, as Python writes them.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2066-\u2069\ufeff]")


def printable(text: str) -> str:
    """`text` with what a terminal would act on (CONTROL) written as Python escapes ("\\x1b[2J"): seen, not obeyed."""
    return CONTROL.sub(lambda m: ascii(m[0])[1:-1], text)


def cut(value: Any, limit: int = LINE_CHARS) -> str:
    """`value` as text of at most `limit` characters, an ellipsis ending one that was longer."""
    text = str(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"
