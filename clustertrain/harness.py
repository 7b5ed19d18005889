"""lm-evaluation-harness tasks on a clustertrain model: standard tasks from the local cache, task YAMLs of your
own, and prompt/completion JSONL files (the `clustertrain eval --data` kind, scored the same way), with the
documents shared across the ranks of the launch.

    results = run_tasks(model, tokenizer, ["arc_easy", "data/reverse/test.jsonl"], limit=100)
    print(table(results))                                    # rank 0; other ranks get None

Needs the `eval` extra (`pip install 'clustertrain[eval]'`, lm-eval 0.4). Compute nodes run offline: a task's
dataset must be in the local HF datasets cache (`clustertrain download --dataset`) or a staged folder.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

from clustertrain.errors import UserError

# The exact match of `clustertrain eval --data`: greedy, up to EOS, both sides stripped of surrounding whitespace.
STRIP = ["^\\s+", "\\s+$"]


def jsonl_task(path: Path, name: str, max_gen_toks: int) -> dict[str, Any]:
    """The lm-eval task config that scores a prompt/completion JSONL as `clustertrain eval --data` does."""
    return {
        "task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(path.resolve())}},
        "test_split": "test", "output_type": "generate_until", "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{completion}}", "target_delimiter": "",
        "generation_kwargs": {"until": [], "do_sample": False, "max_gen_toks": max_gen_toks},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "regexes_to_ignore": STRIP}],
        "metadata": {"version": 1.0},
    }


def resolve_tasks(specs: list[str], tokenizer, workdir: Path) -> tuple[list[str], list[str]]:
    """Task names and the folders that define them: a name as is (lm-eval's own, or from an --include-path), a
    task .yaml (its `task:` name, its folder included), a prompt/completion .jsonl (a task written to `workdir`,
    named after the file, answers up to the longest completion's tokens plus one, as `clustertrain eval`)."""
    from clustertrain.data.synthetic import read_task

    names, folders = [], []
    for spec in specs:
        path = Path(spec)
        if path.suffix in (".yaml", ".yml"):
            if not path.is_file():
                raise UserError(f"--tasks {spec}: no such task file")
            name = (yaml.safe_load(path.read_text()) or {}).get("task") if path.is_file() else None
            if not isinstance(name, str):
                raise UserError(f"--tasks {spec}: a task YAML needs a `task: NAME` line")
            names.append(name)
            folders.append(str(path.resolve().parent))
        elif path.suffix == ".jsonl":
            records = read_task(path)  # a missing file or a bad line: one line naming it
            longest = max(len(tokenizer.encode(r["completion"], add_special_tokens=False)) for r in records)
            name = f"jsonl_{path.stem}"
            workdir.mkdir(parents=True, exist_ok=True)
            (workdir / f"{name}.yaml").write_text(yaml.safe_dump(jsonl_task(path, name, longest + 1)))
            names.append(name)
            folders.append(str(workdir))
        else:
            names.append(spec)
    return names, list(dict.fromkeys(folders))


def run_tasks(model, tokenizer, specs: list[str], *, limit: int | None = None, include: list[str] = (),
              batch_size: int = 16, seed: int = 0, together: bool = False,
              autocast_dtype=None) -> dict[str, Any] | None:
    """Evaluate `model` on the tasks `specs` (see resolve_tasks) with lm-eval; the results on rank 0, None on the
    others.

    Each rank of the process group (if one is up) holds the whole model and scores its share of the documents;
    `together` (a training model whose weights are sharded or split): every rank scores every document in the
    same forwards, rank 0's greedy tokens broadcast, and every rank gets the results. `autocast_dtype`: the
    forward's mixed precision, as in training.
    """
    from clustertrain.data.sft import adds_bos

    names, manager = _tasks(specs, tokenizer, include)  # lm-eval is installed from here on
    from lm_eval import simple_evaluate

    _quiet()
    lm = _lm(model, tokenizer, batch_size, adds_bos(tokenizer), together, autocast_dtype)
    try:
        return simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit, log_samples=True,
                               random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                               fewshot_random_seed=seed, bootstrap_iters=0)
    except (FileNotFoundError, ConnectionError) as e:  # the datasets cache lacks a task's data, offline
        raise UserError(f"a task's data is not in the local cache ({type(e).__name__}: {str(e)[:200]}); fetch it "
                        "on a login node (`clustertrain download --dataset NAME`) or point its task at a staged "
                        "folder") from None


def check_tasks(specs: list[str], tokenizer, include: list[str] = ()) -> None:
    """Refuse, before a run trains, tasks that its evaluations could not run (a missing file, an unknown name);
    the index it builds serves this process's evaluations."""
    _tasks(specs, tokenizer, include)


def _tasks(specs: list[str], tokenizer, include: list[str]):
    """The task names of `specs` and an lm-eval TaskManager that knows them (lm-eval's own tasks indexed only
    when one is asked for: that takes seconds). JSONL tasks' YAMLs go to this process's one folder."""
    try:
        import lm_eval.tasks  # noqa: F401
    except ImportError:
        raise UserError("lm-eval tasks need lm-evaluation-harness: pip install 'clustertrain[eval]'") from None
    names, folders = resolve_tasks(specs, tokenizer, _task_folder())
    folders = tuple(folders + [str(Path(p).resolve()) for p in include])
    own = _task_manager(folders, tuple(names), defaults=False) if folders else None
    defaults = any(own is None or name not in own.all_tasks for name in names)
    manager = _task_manager(folders, tuple(names), defaults=True) if defaults else own
    if unknown := [n for n in names if n not in manager.all_tasks]:
        raise UserError(f"unknown lm-eval task(s) {', '.join(unknown)}; `lm-eval ls tasks` lists lm-eval's own, "
                        "--include-path adds a folder of task YAMLs, and a .jsonl of prompt/completion records is a "
                        "task too")
    return names, manager


@functools.cache
def _task_manager(folders: tuple[str, ...], names: tuple[str, ...], defaults: bool):
    """lm-eval's index of the task YAMLs in `folders` (and of its own, which reads thousands of files: on a shared
    filesystem, once per process, not once per evaluation on every rank). `names` are part of the key, so a
    task added to a folder later is indexed anew."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(folders) or None, include_defaults=defaults)


@functools.cache
def _task_folder() -> Path:
    """This process's folder of JSONL task YAMLs: the same at every evaluation, so lm-eval indexes it once."""
    folder = Path(tempfile.mkdtemp(prefix="clustertrain-tasks-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _quiet() -> None:
    """lm-eval's notes on a model passed as an object, and git's "not a git repository" for the hash of the
    working directory (which is not lm-eval's code), off the terminal; its progress bars stay."""
    import logging

    import lm_eval.evaluator

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    lm_eval.evaluator.get_git_commit_hash = lambda: None


def _lm(model, tokenizer, batch_size: int, add_bos: bool, together: bool, autocast_dtype):
    """lm-eval's HF model over `model`: told this process's rank and how to gather across ranks, or (`together`)
    one process's view on every rank, with generation in lockstep."""
    import torch
    import torch.distributed as dist
    from lm_eval.models.huggingface import HFLM

    from clustertrain.distributed.collectives import all_gather, broadcast

    class ClustertrainLM(HFLM):
        """HFLM assumes a single process unless accelerate launched it: here the process group decides."""

        def __init__(self) -> None:
            super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, add_bos_token=add_bos,
                             mixed_precision_dtype=autocast_dtype)
            if dist.is_initialized() and not together:
                self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

        def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
            return all_gather(tensor) if self.world_size > 1 else tensor

        def barrier(self) -> None:
            if self.world_size > 1:
                dist.barrier()

        def _model_generate(self, context, max_length, stop, **options):
            if not together:
                return super()._model_generate(context, max_length, stop, **options)
            if options.get("do_sample"):
                raise UserError("train.eval_tasks: a task that samples (do_sample) cannot run on sharded weights; "
                                "evaluate the checkpoint with `clustertrain eval --tasks`")
            return _greedy_together(self.model, context, options.get("attention_mask"), max_length,
                                    self.eot_token_id, self.tokenizer.pad_token_id or 0, self.mixed_precision_dtype,
                                    broadcast)

    return ClustertrainLM()


def _greedy_together(model, ids, mask, max_length: int, eos: int, pad: int, dtype, broadcast):
    """Greedy tokens after the left-padded `ids` up to `max_length` (or EOS in every row), through the model's
    forward, rank 0's choice on every rank: ranks whose logits differ in the last bit (GPU kernels) still pick
    the same tokens and stop together, so their sharded forwards stay paired (HF's `generate` would not)."""
    import torch

    mask = torch.ones_like(ids) if mask is None else mask.to(ids.device)
    done = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
    with torch.no_grad(), torch.autocast(ids.device.type, dtype=dtype, enabled=dtype is not None):
        while ids.shape[1] < max_length and not done.all():
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
            choice = broadcast(logits[:, -1].argmax(-1)).to(ids.device)
            choice = torch.where(done, torch.full_like(choice, pad), choice)
            ids = torch.cat([ids, choice[:, None]], dim=1)
            mask = torch.cat([mask, (~done).to(mask.dtype)[:, None]], dim=1)
            done |= choice == eos
    return ids


def summary(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per task and metric: {"task", "metric", "value", "n"}, from lm-eval's results."""
    rows = []
    for task, metrics in results["results"].items():
        n = results.get("n-samples", {}).get(task, {}).get("effective")
        scored = results.get("higher_is_better", {}).get(task, {})
        for key, value in metrics.items():
            metric, _, _filter = key.partition(",")
            if metric in scored and isinstance(value, (int, float)):
                rows.append({"task": task, "metric": metric, "value": float(value), "n": n})
    return rows


def answers(results: dict[str, Any], task: str) -> list[str]:
    """The filtered answers of `task`'s documents, in document order (for comparing with `clustertrain eval`)."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [s["filtered_resps"][0] if isinstance(s["filtered_resps"], list) else s["filtered_resps"] for s in samples]


def to_json(results: dict[str, Any]) -> str:
    """The results without the per-document samples, as JSON."""
    return json.dumps({k: v for k, v in results.items() if k != "samples"}, indent=1, default=str)
