"""`clustertrain eval SOURCE --data TEST.jsonl`: exact-match accuracy of greedy completions;
`clustertrain eval SOURCE --tasks a,b`: lm-evaluation-harness tasks (the `eval` extra), shared across the ranks.

    clustertrain eval --make-task data/reverse                          # a synthetic task: train.jsonl, test.jsonl
    clustertrain train --set data.mode=sft --set 'data.sources=[{path: data/reverse/train.jsonl}]'
    clustertrain eval runs/default --data data/reverse/test.jsonl       # newest checkpoint
    clustertrain eval exports/tiny-llama --data data/reverse/test.jsonl --limit 50 --json

Each record is {"prompt": ..., "completion": ...}; an answer counts when it equals the completion after
stripping whitespace. Tasks (--kind): reverse (a b c = -> c b a), upper (a b = -> A B), add (1 2 + 3 4 = -> 4 6).

    clustertrain eval runs/default --tasks arc_easy,hellaswag --limit 200    # lm-eval's tasks, data cached offline
    clustertrain eval exports/adapter --tasks data/reverse/test.jsonl       # the --data task, scored by lm-eval
    clustertrain eval runs/default --tasks my_task --include-path tasks/ --nproc 2 --output results.json
    torchrun --nproc_per_node 8 -m clustertrain eval runs/default --tasks arc_easy   # or srun, mpirun

A task is a name (lm-eval's own, or one in an --include-path folder), a task .yaml, or a prompt/completion
.jsonl (scored as --data does). See docs/generate-eval.md.
"""

from __future__ import annotations

import argparse
import json


def add_parser(commands: argparse._SubParsersAction) -> None:
    from clustertrain.cli.generate_cmd import add_model_options
    from clustertrain.data.synthetic import KINDS

    parser = commands.add_parser(
        "eval", help="exact-match accuracy on prompt/completion JSONL; --make-task writes a synthetic task",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", nargs="?",
                        help="a step-NNNNNNN checkpoint, a run directory, or a Hugging Face model directory")
    parser.add_argument("--data", help="JSONL of {prompt, completion} records to score")
    parser.add_argument("--tasks", help="lm-eval tasks, comma-separated: names, task .yaml files or .jsonl files")
    parser.add_argument("--include-path", action="append", default=[], metavar="DIR",
                        help="a folder of lm-eval task YAMLs (repeatable)")
    parser.add_argument("--output", metavar="JSON", help="with --tasks: also write the results here")
    parser.add_argument("--nproc", type=int, help="with --tasks: start this many local ranks (like torchrun)")
    parser.add_argument("--max-tokens", type=int, help="most tokens per answer (default: longest completion + 1)")
    parser.add_argument("--limit", type=int, help="score only the first N records (of each task)")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per forward pass (default 64)")
    parser.add_argument("--show", type=int, default=5, help="examples to print (default 5; --json prints all)")
    parser.add_argument("--json", action="store_true", help="print the result and every example as JSON")
    add_model_options(parser)
    task = parser.add_argument_group("synthetic task (instead of scoring)")
    task.add_argument("--make-task", metavar="OUT_DIR", help="write OUT_DIR/train.jsonl and OUT_DIR/test.jsonl")
    task.add_argument("--kind", choices=sorted(KINDS), default="reverse", help="the task (default reverse)")
    task.add_argument("--train", type=int, default=5000, help="training records (default 5000)")
    task.add_argument("--test", type=int, default=200, help="test records, none seen in training (default 200)")
    task.add_argument("--seed", type=int, default=0, help="the same seed writes the same files (default 0)")
    parser.set_defaults(run=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    from clustertrain.errors import UserError

    if args.make_task:
        if args.source or args.data:
            raise UserError("--make-task writes a task; give it without SOURCE and --data")
        return make_task(args)
    if not args.source or bool(args.data) == bool(args.tasks):
        raise UserError("give SOURCE and either --data TEST.jsonl or --tasks TASKS (or --make-task OUT_DIR to write "
                        "a task)")
    for flag in ("max_tokens", "limit", "batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} {value}: must be at least 1")
    if args.show < 0:
        raise UserError(f"--show {args.show}: must be 0 or more")

    if args.tasks:
        return run_tasks(args)
    if args.nproc is not None or args.output or args.include_path:
        raise UserError("--nproc, --output and --include-path go with --tasks; --data scores on one process")
    from clustertrain.cli.generate_cmd import load_model, quiet_transformers
    from clustertrain.data.synthetic import read_task
    from clustertrain.inference import exact_match, resolve_source

    source = resolve_source(args.source)
    records = read_task(args.data)[: args.limit]
    quiet_transformers()
    model, tokenizer = load_model(args, source)
    result = exact_match(model, tokenizer, records, max_new_tokens=args.max_tokens, batch_size=args.batch_size)
    result = {"source": str(source), "data": args.data, **result}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"exact match {result['accuracy']:.1%} ({result['correct']}/{result['n']}) on {args.data} by {source}")
    for e in result["examples"][: args.show]:
        mark = "ok  " if e["correct"] else "miss"
        expected = "" if e["correct"] else f"  (expected {e['expected']!r})"
        print(f"  {mark} {e['prompt']!r} -> {e['answer']!r}{expected}")
    return 0


def run_tasks(args: argparse.Namespace) -> int:
    """lm-eval's tasks on SOURCE, each rank of the launch (or of --nproc) scoring its share of the documents."""
    from pathlib import Path

    from clustertrain.errors import UserError
    from clustertrain.inference import resolve_source

    if args.nproc is not None:
        if args.nproc < 1:
            raise UserError(f"--nproc {args.nproc}: must be at least 1")
        resolve_source(args.source)  # refused here, before any rank starts
        from clustertrain.distributed.spawn import spawn_local

        options = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                   if k in ("tasks", "output", "limit", "batch_size", "device", "dtype") and v is not None]
        return spawn_local(args.nproc, ["eval", args.source, *options, *(["--json"] if args.json else []),
                                        *(f"--include-path={p}" for p in args.include_path)])

    from clustertrain.cli.generate_cmd import load_model, quiet_transformers
    from clustertrain.config.schema import ParallelConfig
    from clustertrain.distributed.env import detect_launcher
    from clustertrain.distributed.init import close_distributed, init_distributed
    from clustertrain.harness import run_tasks as evaluate_tasks
    from clustertrain.harness import summary, to_json

    specs = [t.strip() for t in args.tasks.split(",") if t.strip()]
    source = resolve_source(args.source)
    info = detect_launcher()
    if info.world_size > 1:  # one whole model per rank, on its own device; the documents are shared out
        args.device = str(init_distributed(ParallelConfig(), info))
    quiet_transformers()
    try:
        model, tokenizer = load_model(args, source)
        results = evaluate_tasks(model, tokenizer, specs, limit=args.limit, include=args.include_path,
                                 batch_size=args.batch_size)
    finally:
        close_distributed()
    if results is None:  # not rank 0
        return 0
    results["source"] = str(source)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(to_json(results))
    if args.json:
        print(to_json(results))
        return 0
    print(f"lm-eval on {source} ({info.world_size} rank(s))")
    for row in summary(results):
        print(f"  {row['task']:<28} {row['metric']:<16} {row['value']:.4f}  (n={row['n']})")
    return 0


def make_task(args: argparse.Namespace) -> int:
    from clustertrain.data.synthetic import write_task
    from clustertrain.errors import UserError

    if args.train < 1 or args.test < 1:
        raise UserError("--train and --test must be at least 1")
    train, test = write_task(args.make_task, n_train=args.train, n_test=args.test, seed=args.seed, kind=args.kind)
    print(f"wrote {train} ({args.train} records) and {test} ({args.test}); train with\n"
          f"  clustertrain train --set data.mode=sft --set 'data.sources=[{{path: {train}}}]'")
    return 0
