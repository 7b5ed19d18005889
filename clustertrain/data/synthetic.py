"""Small instruction tasks with checkable answers, as prompt/completion JSONL: a fine-tune you can score.

    clustertrain eval --make-task data/reverse                     # data/reverse/{train,test}.jsonl
    clustertrain train --set data.mode=sft --set 'data.sources=[{path: data/reverse/train.jsonl}]'
    clustertrain eval runs/default --data data/reverse/test.jsonl  # exact-match accuracy

Letters and digits are written with spaces between them so that a byte-level BPE gives one token per
symbol (" a", " 7"): the task is then about the symbols, not about how the tokenizer happened to merge them.
Test prompts never appear in the training file, so accuracy measures the rule learned, not recall.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from clustertrain.errors import DataError

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _letters(rng: random.Random) -> list[str]:
    return rng.choices(LETTERS, k=rng.randint(3, 5))


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = _letters(rng)
    return f"reverse: {' '.join(word)} =", " " + " ".join(reversed(word))


def _upper(rng: random.Random) -> tuple[str, str]:
    word = _letters(rng)
    return f"upper: {' '.join(word)} =", " " + " ".join(word).upper()


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"add: {' '.join(str(a))} + {' '.join(str(b))} =", " " + " ".join(str(a + b))


# kind -> a function drawing one (prompt, completion) pair from a random generator.
KINDS: dict[str, Callable[[random.Random], tuple[str, str]]] = {"reverse": _reverse, "upper": _upper, "add": _add}


def make_records(kind: str, n: int, seed: int, exclude: set[str] | frozenset[str] = frozenset()) -> list[dict]:
    """`n` records `{"prompt", "completion"}` of task `kind` with distinct prompts, none of them in `exclude`.

    Raises:
        DataError: `kind` is unknown, or the task has too few distinct prompts for `n`.
    """
    if kind not in KINDS:
        raise DataError(f"unknown task kind {kind!r}; choose one of {', '.join(KINDS)}")
    draw, rng = KINDS[kind], random.Random(f"{kind}-{seed}")
    records: list[dict] = []
    seen = set(exclude)
    for _ in range(20 * n + 1000):  # bounded: a small task runs out of distinct prompts
        if len(records) == n:
            break
        prompt, completion = draw(rng)
        if prompt not in seen:
            seen.add(prompt)
            records.append({"prompt": prompt, "completion": completion})
    if len(records) < n:
        raise DataError(f"task {kind!r} has too few distinct prompts for {n} records (found {len(records)})")
    return records


def write_task(out_dir: str | Path, n_train: int = 5000, n_test: int = 200, seed: int = 0,
               kind: str = "reverse") -> tuple[Path, Path]:
    """Write `train.jsonl` and `test.jsonl` of task `kind` into `out_dir`; the same seed writes the same files.

    Returns:
        (train path, test path). No test prompt appears in the training file.
    """
    test = make_records(kind, n_test, seed=seed)
    train = make_records(kind, n_train, seed=seed + 1, exclude={r["prompt"] for r in test})
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "train.jsonl", out_dir / "test.jsonl"
    for path, records in zip(paths, (train, test)):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return paths


def read_task(path: str | Path) -> list[dict]:
    """The prompt/completion records of a JSONL file.

    Raises:
        DataError: the file is missing, or a line is not a record with string prompt and completion.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: not JSON: {e.msg}") from None
        if not (isinstance(record, dict) and isinstance(record.get("prompt"), str)
                and isinstance(record.get("completion"), str)):
            raise DataError(f"{path}:{number}: needs string fields 'prompt' and 'completion'")
        records.append(record)
    if not records:
        raise DataError(f"{path}: no records")
    return records


def is_correct(answer: str, expected: str) -> bool:
    """Exact match after stripping surrounding whitespace."""
    return answer.strip() == expected.strip()
