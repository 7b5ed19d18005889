"""`clustertrain export CHECKPOINT OUTDIR` and `clustertrain import HF_DIR OUTDIR`: checkpoints <-> Hugging Face.

    clustertrain export runs/tiny-llama/checkpoints/step-0000300 exports/tiny-llama
    clustertrain export runs/tiny-llama exports/tiny-llama --max-shard-size 500MB   # newest checkpoint
    clustertrain export runs/lora-sft exports/adapter              # a LoRA run: peft adapter files
    clustertrain export runs/lora-sft exports/merged --merge       # ... or the full model, adapter merged
    clustertrain export runs/tiny-llama exports/tiny-bf16 --dtype bf16   # default: the run's parallel.param_dtype
    clustertrain import exports/tiny-llama runs/imported/checkpoints/step-0000000
"""

from __future__ import annotations

import argparse
from pathlib import Path

from clustertrain.inference import DTYPES


def add_parser(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export", help="write a checkpoint as a Hugging Face model directory (safetensors)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument("checkpoint", help="a step-NNNNNNN checkpoint folder, or a run directory (its newest one)")
    export.add_argument("outdir", help="new or empty directory for config.json, safetensors and tokenizer")
    export.add_argument("--max-shard-size", default="2GB", help="largest safetensors file, e.g. 500MB (default 2GB)")
    export.add_argument("--merge", action="store_true",
                        help="LoRA runs: write the full model with the adapter merged in (default: the adapter only)")
    export.add_argument("--dtype", choices=sorted(DTYPES),
                        help="dtype of the written weights (default: the run's parallel.param_dtype)")
    export.set_defaults(run=run_export)

    imp = commands.add_parser(
        "import", help="write a local Hugging Face model directory as a clustertrain checkpoint",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    imp.add_argument("hf_dir", help="local Hugging Face model directory (config.json and weights)")
    imp.add_argument("outdir", help="new or empty directory for the checkpoint")
    imp.set_defaults(run=run_import)


def run_export(args: argparse.Namespace) -> int:
    import torch
    from transformers.utils import logging

    from clustertrain.checkpoint.export import export_hf

    logging.disable_progress_bar()
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    out = export_hf(args.checkpoint, args.outdir, max_shard_size=shard_size(args.max_shard_size), merge=args.merge,
                    dtype=dtype)
    files = len(list(out.glob("*.safetensors")))
    tokenizer = "tokenizer" if (out / "tokenizer_config.json").exists() else "no tokenizer"
    if (out / "adapter_config.json").exists():
        print(f"wrote the LoRA adapter to {out} ({tokenizer}); load it with "
              f'peft.PeftModel.from_pretrained(base_model, "{out}"), or export with --merge for a full model')
    else:
        print(f"wrote {out} ({files} safetensors file{'s' * (files != 1)}, {tokenizer}); "
              f'load it with AutoModelForCausalLM.from_pretrained("{out}")')
    return 0


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

    logging.disable_progress_bar()
    out = import_hf(args.hf_dir, args.outdir)
    tokenizer = "tokenizer" if (out / "tokenizer").is_dir() else "no tokenizer"
    print(f"wrote checkpoint {out} (weights and config.yaml at step 0, {tokenizer}) from {Path(args.hf_dir)}")
    return 0
