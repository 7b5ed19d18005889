"""`clustertrain export CHECKPOINT OUTDIR` and `clustertrain import SOURCE OUTDIR`: checkpoints <-> other formats.

    clustertrain export runs/tiny-llama/checkpoints/step-0000300 exports/tiny-llama
    clustertrain export runs/tiny-llama exports/tiny-llama --max-shard-size 500MB   # newest checkpoint
    clustertrain export runs/lora-sft exports/adapter              # a LoRA run: peft adapter files
    clustertrain export runs/lora-sft exports/merged --merge       # ... or the full model, adapter merged
    clustertrain export runs/tiny-llama exports/tiny-bf16 --dtype bf16   # default: the run's parallel.param_dtype
    clustertrain export --format meta runs/llama-cpt exports/llama-cpt-pth   # consolidated.00.pth, params.json
    clustertrain export runs/tiny-llama exports/tiny-llama --push-to-hub me/tiny-llama     # and upload it
    clustertrain import exports/tiny-llama runs/imported/checkpoints/step-0000000   # HF snapshot -> checkpoint
    clustertrain import /scratch/Llama-3.1-8B/original models/llama-3.1-8b          # Meta's -> HF snapshot
    clustertrain import outputs/checkpoint/step-1000 models/titan --params /scratch/Llama-3.1-8B/original
    clustertrain import experiments/chkpts/dummy-0.1.2024-06-01 models/stub --config run.yaml   # model_state_dict.pt
"""

from __future__ import annotations

import argparse
from pathlib import Path

from clustertrain.inference import DTYPES


def add_parser(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export", help="write a checkpoint as a Hugging Face model directory (safetensors), or in Meta's format",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument("checkpoint", help="a step-NNNNNNN checkpoint folder, or a run directory (its newest one)")
    export.add_argument("outdir", help="new or empty directory for config.json, safetensors and tokenizer")
    export.add_argument("--max-shard-size", default="2GB", help="largest safetensors file, e.g. 500MB (default 2GB)")
    export.add_argument("--merge", action="store_true",
                        help="LoRA runs: write the full model with the adapter merged in (default: the adapter only)")
    export.add_argument("--dtype", choices=sorted(DTYPES),
                        help="dtype of the written weights (default: the run's parallel.param_dtype)")
    export.add_argument("--format", choices=["hf", "meta"], default="hf",
                        help="hf: Hugging Face safetensors (default); meta: Meta's consolidated.00.pth, params.json "
                             "and tokenizer.model (Llama; CHECKPOINT may also be a Hugging Face Llama snapshot)")
    export.add_argument("--push-to-hub", metavar="REPO", help="then upload OUTDIR to this Hugging Face model repo")
    export.set_defaults(run=run_export)

    imp = commands.add_parser(
        "import", help="write a Hugging Face model directory as a clustertrain checkpoint, or a Meta or torchtitan "
                       "Llama checkpoint as a Hugging Face snapshot", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    imp.add_argument("source", help="a Hugging Face model directory (config.json), Meta's original checkpoint folder "
                                    "(params.json, consolidated.*.pth), a torchtitan DCP checkpoint folder, or a "
                                    "model_state_dict.pt (or its folder)")
    imp.add_argument("outdir", help="new or empty directory for the checkpoint (or the snapshot)")
    imp.add_argument("--params", help="torchtitan: Meta's params.json of the model, or its folder (default: one "
                                      "beside the checkpoint)")
    imp.add_argument("--tokenizer", help="Meta, torchtitan: a tiktoken tokenizer.model or a Hugging Face tokenizer "
                                         "folder (default: the tokenizer.model beside params.json)")
    imp.add_argument("--config", help="model_state_dict.pt: the clustertrain config of the model it holds (e.g. "
                                      "`clustertrain config convert` of the run's YAML)")
    imp.set_defaults(run=run_import)


def run_export(args: argparse.Namespace) -> int:
    import torch
    from transformers.utils import logging

    from clustertrain.checkpoint.export import check_can_push, export_hf, push_to_hub
    from clustertrain.checkpoint.meta import export_meta

    logging.disable_progress_bar()
    if args.push_to_hub:
        check_can_push(args.push_to_hub)
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    if args.format == "meta":
        out = export_meta(args.checkpoint, args.outdir, dtype=dtype, merge=args.merge)
        print(f"wrote {out} ({', '.join(sorted(p.name for p in out.iterdir()))}) in Meta's format")
    else:
        out = export_hf(args.checkpoint, args.outdir, max_shard_size=shard_size(args.max_shard_size),
                        merge=args.merge, dtype=dtype)
        describe_hf_export(out)
    if args.push_to_hub:
        print(f"uploaded {out} to {push_to_hub(out, args.push_to_hub)}")
    return 0


def describe_hf_export(out: Path) -> None:
    files = len(list(out.glob("*.safetensors")))
    tokenizer = "tokenizer" if (out / "tokenizer_config.json").exists() else "no tokenizer"
    if (out / "adapter_config.json").exists():
        print(f"wrote the LoRA adapter to {out} ({tokenizer}); load it with "
              f'peft.PeftModel.from_pretrained(base_model, "{out}"), or export with --merge for a full model')
    else:
        print(f"wrote {out} ({files} safetensors file{'s' * (files != 1)}, {tokenizer}); "
              f'load it with AutoModelForCausalLM.from_pretrained("{out}")')


def shard_size(value: str) -> int:
    """--max-shard-size in bytes (500MB, 2GB, 1GiB or a plain byte count); anything else is a one-line error."""
    from transformers.utils.hub import convert_file_size_to_int

    from clustertrain.errors import UserError

    try:
        size = int(value) if value.strip().isdigit() else convert_file_size_to_int(value.strip())
    except (ValueError, TypeError):
        size = None
    if not isinstance(size, int) or size <= 0:
        raise UserError(f"--max-shard-size {value!r}: not a size; give bytes or a whole number with a unit, e.g. 500MB, 2GB")
    return size


def run_import(args: argparse.Namespace) -> int:
    from transformers.utils import logging

    from clustertrain.checkpoint.export import import_hf
    from clustertrain.checkpoint.meta import PARAMS, SHARDS, import_meta
    from clustertrain.checkpoint.reader import METADATA
    from clustertrain.checkpoint.state_file import STATE_FILE, import_state_file
    from clustertrain.checkpoint.torchtitan import import_torchtitan
    from clustertrain.checkpoint.train_state import TRAIN_STATE
    from clustertrain.errors import UserError

    logging.disable_progress_bar()
    source = Path(args.source)
    if (source / STATE_FILE).is_file() or source.suffix in (".pt", ".pth"):
        if not args.config:
            raise UserError(f"{source}: a torch.save state dict holds no model config; pass --config with the run's "
                            "config (`clustertrain config convert` turns the stub's YAML into one)")
        out, kind = import_state_file(source, args.outdir, args.config), "state dict"
    elif (source / METADATA).is_file() and not (source / TRAIN_STATE).is_file():
        out, kind = import_torchtitan(source, args.outdir, args.params, args.tokenizer), "torchtitan"
    elif (source / PARAMS).is_file() or any(source.glob(SHARDS)):
        out, kind = import_meta(source, args.outdir, args.tokenizer), "Meta"
    else:
        if args.params or args.tokenizer or args.config:
            raise UserError(f"--params, --tokenizer and --config are for Meta, torchtitan and torch.save checkpoints; "
                            f"{source} is none of them")
        out = import_hf(source, args.outdir)
        tokenizer = "tokenizer" if (out / "tokenizer").is_dir() else "no tokenizer"
        print(f"wrote checkpoint {out} (weights and config.yaml at step 0, {tokenizer}) from {source}")
        return 0
    tokenizer = "tokenizer" if (out / "tokenizer_config.json").is_file() else "no tokenizer"
    print(f"wrote the Hugging Face snapshot {out} ({tokenizer}) from the {kind} checkpoint {source}; train from it "
          f"with --set model.path={out}, or `clustertrain import {out} CHECKPOINT` for a step-0 checkpoint")
    return 0
