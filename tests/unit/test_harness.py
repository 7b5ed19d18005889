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
    ("broken.yaml", "--tasks broken.yaml: {tmp}/broken.yaml: not valid YAML: while scanning a simple key in "
                    "\"{tmp}/broken.yaml\", line 2, column 1"),
    ("unknown_function.yaml", "--tasks unknown_function.yaml: AttributeError: Module '{tmp}/utils.py' has no "
                              "function 'missing'"),
])
def test_a_task_that_cannot_run_is_one_line(tokenizer, tmp_path, monkeypatch, spec, message):
    monkeypatch.chdir(tmp_path)
    message = message.format(tmp=tmp_path)
    (tmp_path / "nameless.yaml").write_text("dataset_path: json\n")
    (tmp_path / "broken.yaml").write_text("task: broken\ndataset_path json\nx: 1\n")
    (tmp_path / "unknown_function.yaml").write_text("task: t\nprocess_docs: !function utils.missing\n")
    (tmp_path / "utils.py").write_text("def first_two(dataset):\n    return dataset\n")
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


FUNCTION_CODE = """import pathlib
pathlib.Path(__file__).with_suffix(".imported").touch()  # the proof that it was imported


def first_two(dataset):
    return dataset.select(range(2))
"""


def write_function_task(folder):
    """A task YAML whose `!function` names utils.first_two, and utils.py beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "utils.py").write_text(FUNCTION_CODE)
    (folder / "two_docs.yaml").write_text("task: two_docs\nprocess_docs: !function utils.first_two\n")
    return folder / "two_docs.yaml"


@pytest.mark.parametrize("marker", ["status.json", "checkpoints/step-0000004/", "train_state.json"])
def test_a_task_in_a_run_directory_or_checkpoint_names_no_code(tokenizer, tmp_path, marker):
    """A run directory or checkpoint is data (written by runs, downloaded, shared): a `!function` in a task YAML
    there, named directly, included from the user's own YAML, or found in an --include-path, imports nothing."""
    run = tmp_path / "run"
    task = write_function_task(run / "tasks")
    if marker.endswith("/"):
        (run / marker).mkdir(parents=True)
    else:
        (run / marker).write_text("{}")
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"include: {task}\ntask: mine\n")
    for specs, include in (([str(task)], []), ([str(mine)], []), (["two_docs"], [str(run / "tasks")])):
        with pytest.raises(UserError) as error:
            check_tasks(specs, tokenizer, include)
        assert str(error.value) == (
            f"--tasks {specs[0]}: {task} names code to import (`!function utils.first_two`) and its task lies in "
            f"{run}, a run directory or checkpoint, whose files may name no code; copy the task and its .py out of "
            "it (if you trust them) and pass that copy")
    assert not (run / "tasks" / "utils.imported").exists()
    (tmp_path / "checkpoints").mkdir()  # a project's own folder of that name: no run
    outside = write_function_task(tmp_path / "tasks")  # the same files outside: the user's code, by their choice
    check_tasks([str(outside)], tokenizer)
    assert (tmp_path / "tasks" / "utils.imported").is_file()


def test_greedy_tokens_of_left_padded_prompts_are_each_prompt_s_own_on_learned_positions():
    """Sharded evaluation's greedy decoding (every rank in the same forwards) batches prompts of different lengths,
    padded on the left. GPT-2 learns absolute positions, so each row must count them from its first real token
    (Llama's rotary positions would hide a shift): a batched row's tokens are HF's greedy `generate` of its prompt
    alone."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=64)).eval()
    prompts = [[5, 9, 3, 17, 22, 8, 41, 11], [12, 30], [7, 7, 50, 2, 19]]
    width, new, pad = max(map(len, prompts)), 6, 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    got = harness._greedy_together(model, ids, mask, width + new, eos=-1, pad=pad, dtype=None,
                                   broadcast=lambda chosen: chosen)  # one rank: its own choice
    for row, prompt in zip(got.tolist(), prompts):
        alone = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=new, do_sample=False, pad_token_id=pad)
        assert row[width - len(prompt):] == alone[0].tolist(), f"prompt {prompt}"
