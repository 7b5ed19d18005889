"""The exit codes are one table, errors.ExitCode, and README.md's "Exit codes" lists the same ones."""

from __future__ import annotations

import re
from pathlib import Path

from clustertrain.errors import ExitCode, UserError

README = Path(__file__).parents[2] / "README.md"


def test_readme_lists_every_exit_code_of_the_table_and_no_other():
    section = README.read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    listed = {int(code) for code in re.findall(r"^\| (\d+) \|", section, re.MULTILINE)}
    assert listed == {int(code) for code in ExitCode}


def test_a_user_error_exits_2():
    assert UserError.exit_code == ExitCode.USER_ERROR == 2
