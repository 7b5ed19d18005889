"""Tasks for lm-eval (clustertrain/harness.py): what a task spec becomes, and the specs refused before any work."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers import write_tiny_repo
from transformers import AutoTokenizer

from clustertrain import harness
from clustertrain.errors import UserError
from clustertrain.harness import check_tasks, resolve_tasks


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(write_tiny_repo(tmp_path_factory.mktemp("tiny")))


def test_a_jsonl_becomes_a_task_scored_as_eval_data(tokenizer, tmp_path):
    data = tmp_path / "test.jsonl"
    records = [{"prompt": "the", "completion": " quick brown fox"}, {"prompt": "a", "completion": " dog"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    names, folders = resolve_tasks([str(data), "arc_easy"], tokenizer, tmp_path / "work")
    assert names == ["jsonl_test", "arc_easy"] and folders == [str(tmp_path / "work")]
    task = yaml.safe_load((tmp_path / "work" / "jsonl_test.yaml").read_text())
    longest = len(tokenizer.encode(" quick brown fox", add_special_tokens=False))
    assert longest > 1 and task["generation_kwargs"]["max_gen_toks"] == longest + 1
    assert task["dataset_kwargs"]["data_files"]["test"] == str(data.resolve())
    assert task["doc_to_text"] == "{{prompt}}" and task["target_delimiter"] == ""


@pytest.mark.parametrize("spec, message", [
    ("missing.jsonl", "missing.jsonl: no such file"),
    ("missing.yaml", "--tasks missing.yaml: no such task file"),
    ("nameless.yaml", "--tasks nameless.yaml: a task YAML needs a `task: NAME` line"),
    ("no_such_task_anywhere", "unknown lm-eval task(s) no_such_task_anywhere; `lm-eval ls tasks` lists"),
])
def test_a_task_that_cannot_run_is_one_line(tokenizer, tmp_path, monkeypatch, spec, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nameless.yaml").write_text("dataset_path: json\n")
    with pytest.raises(UserError) as error:
        check_tasks([spec], tokenizer)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_each_evaluation_of_a_run_reuses_lm_eval_s_index_of_its_tasks(tokenizer, tmp_path, monkeypatch):
    """lm-eval's index reads every task YAML it knows (thousands for its own tasks): a training run's evaluations,
    on every rank, build it once per process, and anew only when the tasks change."""
    import lm_eval.tasks

    built = []
    real = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kwargs: built.append(kwargs) or real(**kwargs))
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    for path in (first, second):
        path.write_text(json.dumps({"prompt": "the", "completion": " fox"}) + "\n")
    for _ in range(3):
        names, manager = harness._tasks([str(first)], tokenizer, [])
        assert names == ["jsonl_first"] and "jsonl_first" in manager.all_tasks
    assert len(built) == 1, built
    assert (harness._task_folder() / "jsonl_first.yaml").is_file()  # the same folder at every evaluation
    names, manager = harness._tasks([str(first), str(second)], tokenizer, [])
    assert len(built) == 2 and {"jsonl_first", "jsonl_second"} <= set(manager.all_tasks)
