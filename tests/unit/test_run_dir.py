"""RunDir's names are the ones README.md's "The run directory" documents, and its writes are whole."""

from __future__ import annotations

import re
from pathlib import Path

from clustertrain.run_dir import RunDir

README = Path(__file__).resolve().parents[2] / "README.md"
ROOT = Path("runs/x")


def documented_tree() -> list[str]:
    """The lines of README.md's run directory tree, after its `runs/<name>/` line."""
    section = README.read_text().split("## The run directory", 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.DOTALL)[1]
    return block.splitlines()[1:]


def run_dir_paths() -> list[Path]:
    """Every path RunDir names, the per-job and per-count ones with the README's placeholders."""
    run = RunDir(ROOT)
    named = [getattr(run, name) for name, value in vars(RunDir).items() if isinstance(value, property)]
    return [p for p in named if isinstance(p, Path)] + [run.job_log("<job>"), run.scaling_run("<nodes>"),
                                                        run.replaced("<time>")]


def test_every_name_is_documented():
    entries = {part for line in documented_tree() for part in line.split(maxsplit=1)[0].split("/") if part}
    missing = [str(p) for p in run_dir_paths() if not set(p.relative_to(ROOT).parts) <= entries]
    assert not missing, f"README.md's run directory tree lacks {missing}"


def test_every_documented_entry_is_a_run_dir_name():
    top = {line.split()[0].split("/")[0] for line in documented_tree() if re.match(r"  \S", line)}
    names = {p.relative_to(ROOT).parts[0] for p in run_dir_paths()}
    assert top <= names, f"README.md documents {sorted(top - names)}, which RunDir does not name"


def test_moved_aside_lies_in_the_run():
    run = RunDir(ROOT)
    assert all(p.parent == ROOT for p in run.moved_aside) and run.checkpoints in run.moved_aside


def test_write_makes_the_folder_and_replaces_whole(tmp_path):
    run = RunDir(tmp_path / "run")
    run.write(run.job_chain, "old\n")
    assert run.write(run.job_chain, "new\n") == run.job_chain
    assert run.job_chain.read_text() == "new\n"
    assert sorted(p.name for p in run.slurm.iterdir()) == ["jobs.jsonl"]  # no temporary left beside it


def test_scaling_runs_are_the_counts_of_scaling_folders(tmp_path):
    run = RunDir(tmp_path)
    for nodes in (4, 1, 16):
        run.scaling_run(nodes).mkdir()
    (tmp_path / "scaling-Nx").mkdir()
    assert run.scaling_runs() == [1, 4, 16]
