"""Rooms that stay small: no module of the package over 430 lines (20 under the 450 that a module must never near),
no function over 60 (shell templates live in clustertrain/launch/templates/, not in Python), and a trainer that only
conducts: at most 300 lines. A module that grows past its limit splits by concern."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "clustertrain"
MODULE_LINES, FUNCTION_LINES = 430, 60
TRAINER_LINES = 300  # the trainer conducts: its parts (checkpoints, metrics, observers) live in their own modules


def test_no_module_over_430_lines_and_no_function_over_60():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(PACKAGE.parent).as_posix()
        if len(text.splitlines()) > MODULE_LINES:
            too_long.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
    assert too_long == []


def test_the_trainer_is_at_most_300_lines():
    lines = len((PACKAGE / "train" / "trainer.py").read_text().splitlines())
    assert lines <= TRAINER_LINES, f"clustertrain/train/trainer.py: {lines} lines; move a part out, it only conducts"
