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

from clustertrain.errors import UserError, first_line, one_line

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
    """Task specs for lm-eval and the folders that define them: a name as is (lm-eval's own, or from an
    --include-path), a task .yaml as its absolute path (lm-eval loads it, see `task_yaml`), a prompt/completion
    .jsonl (a task written to `workdir`, named after the file, answers up to the longest completion's tokens plus
    one, as `clustertrain eval`)."""
    from clustertrain.data.synthetic import read_task

    names, folders = [], []
    for spec in specs:
        path = Path(spec)
        if path.suffix in (".yaml", ".yml"):
            names.append(str(task_yaml(spec)))
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


def task_yaml(spec: str) -> Path:
    """The task YAML `spec` names, checked, for lm-eval to load by its path (not by indexing its folder, which
    may hold anything). Its `!function utils.f` tags import `f` from the utils.py beside it, as lm-eval documents:
    the user's own code, by their choice. A task YAML in a run directory or checkpoint names no code: such folders
    are written by runs and shared as data, so a `!function` there (or in a file it includes) is refused."""
    from lm_eval.tasks._yaml_loader import load_yaml  # what lm-eval's TaskManager loads a task YAML with

    path = Path(spec)
    if not path.is_file():
        raise UserError(f"--tasks {spec}: no such task file")
    files = _task_files(path, spec)
    name = files[0][1].get("task")
    if not isinstance(name, str):
        raise UserError(f"--tasks {spec}: a task YAML needs a `task: NAME` line")
    check_no_code_in_runs(spec, files)
    try:
        load_yaml(path, resolve_func=True)  # a missing module or function: one line now, not a traceback later
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything on import
        raise UserError(f"--tasks {spec}: {type(e).__name__}: {first_line(e)}") from None
    return path.resolve()


class _TaskLoader(yaml.SafeLoader):
    """A task YAML read as data: lm-eval's `!function NAME` tags are noted in `functions`, nothing imported."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self.functions: list[str] = []


def _note_function(loader: _TaskLoader, node: yaml.ScalarNode) -> str:
    name = loader.construct_scalar(node)
    loader.functions.append(name)
    return name


_TaskLoader.add_constructor("!function", _note_function)


def _task_files(path: Path, spec: str, seen: frozenset[Path] = frozenset()) -> list[tuple[Path, dict, list[str]]]:
    """(file, config, `!function` names) of task YAML `path` and of the files it includes (lm-eval's `include:`)."""
    path = path.resolve()
    if path in seen or not path.is_file():  # lm-eval itself reports a circle or a missing include
        return []
    loader = _TaskLoader(path.read_bytes())
    loader.name = str(path)  # what its error marks name, not "<byte string>"
    try:
        config = loader.get_single_data()
    except (yaml.YAMLError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else one_line(e)
        raise UserError(f"--tasks {spec}: {path}: not valid YAML: {reason}") from None
    finally:
        loader.dispose()
    config = config if isinstance(config, dict) else {}
    found = [(path, config, loader.functions)]
    includes = config.get("include") or []
    for include in [includes] if isinstance(includes, str) else includes:
        if isinstance(include, str):
            found += _task_files(path.parent / include, spec, seen | {path})
    return found


def check_no_code_in_runs(spec: str, files: list[tuple[Path, dict, list[str]]]) -> None:
    """A UserError when a task YAML that lies in a run directory or checkpoint, or includes one that does, names
    code with `!function`."""
    functions = [(file, name) for file, _, names in files for name in names]
    inside = [(file, run) for file, _, _ in files if (run := run_folder(file))]
    if functions and inside:
        (file, name), (_, run) = functions[0], inside[0]
        raise UserError(f"--tasks {spec}: {file} names code to import (`!function {name}`) and its task lies in "
                        f"{run}, a run directory or checkpoint, whose files may name no code; copy the task and its "
                        ".py out of it (if you trust them) and pass that copy")


def run_folder(path: Path) -> Path | None:
    """The run directory or checkpoint that `path` lies in, if any: a folder holding a checkpoint's train state, a
    run's status, lock or heartbeats, or checkpoints/step-N (a project's own empty checkpoints/ is no run)."""
    from clustertrain.checkpoint.train_state import TRAIN_STATE
    from clustertrain.run_dir import RunDir

    for folder in path.resolve().parents:
        run = RunDir(folder)
        if (folder / TRAIN_STATE).is_file() or any(p.exists() for p in (run.status, run.lock, run.heartbeats)) or \
                any(run.checkpoints.glob("step-*")):
            return folder
    return None


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
    """The task specs of `specs` and an lm-eval TaskManager that knows them (lm-eval's own tasks indexed only
    when one is asked for: that takes seconds). JSONL tasks' YAMLs go to this process's one folder; task YAMLs
    are loaded by path. A named task defined in a run directory or checkpoint may name no code either."""
    try:
        import lm_eval.tasks  # noqa: F401
    except ImportError:
        raise UserError("lm-eval tasks need lm-evaluation-harness: pip install 'clustertrain[eval]'") from None
    names, folders = resolve_tasks(specs, tokenizer, _task_folder())
    folders = tuple(folders + [str(Path(p).resolve()) for p in include])
    named = [n for n in names if not n.endswith((".yaml", ".yml"))]
    own = _task_manager(folders, tuple(names), defaults=False)
    defaults = any(name not in own.all_tasks for name in named)
    manager = _task_manager(folders, tuple(names), defaults=True) if defaults else own
    if unknown := [n for n in named if n not in manager.all_tasks]:
        raise UserError(f"unknown lm-eval task(s) {', '.join(unknown)}; `lm-eval ls tasks` lists lm-eval's own, "
                        "--include-path adds a folder of task YAMLs, and a .jsonl of prompt/completion records is a "
                        "task too")
    for name in named:
        if (source := manager.task_index[name].yaml_path) is not None and run_folder(Path(source)):
            check_no_code_in_runs(name, _task_files(Path(source), name))
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
    from clustertrain.model.loss import full_logits

    class ClustertrainLM(HFLM):
        """HFLM assumes a single process unless accelerate launched it: here the process group decides."""

        def __init__(self) -> None:
            super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, add_bos_token=add_bos,
                             mixed_precision_dtype=autocast_dtype)
            if dist.is_initialized() and not together:
                self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

        def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
            return all_gather(tensor) if self.world_size > 1 else tensor

        def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
            return full_logits(super()._model_call(inps, attn_mask, labels))  # a tp-split head's, gathered

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

    from clustertrain.model.loss import full_logits

    mask = torch.ones_like(ids) if mask is None else mask.to(ids.device)
    done = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
    with torch.no_grad(), torch.autocast(ids.device.type, dtype=dtype, enabled=dtype is not None):
        while ids.shape[1] < max_length and not done.all():
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
            choice = broadcast(full_logits(logits[:, -1]).argmax(-1)).to(ids.device)
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
