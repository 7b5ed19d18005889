"""`clustertrain generate SOURCE --prompt TEXT`: a completion from a checkpoint or an exported model.

    clustertrain generate runs/tiny-llama --prompt "def "                       # newest checkpoint, sampled
    clustertrain generate runs/tiny-llama/checkpoints/step-0000300 --prompt "def " --temperature 0   # greedy
    clustertrain generate exports/tiny-llama --prompt "import " --max-tokens 100 --top-p 0.9 --seed 3
    clustertrain generate exports/llama3-8b --prompt "Hello" --device cuda --dtype bf16   # the default on a GPU
"""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "generate", help="complete a prompt with a checkpoint, a run's newest checkpoint or an exported model",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", help="a step-NNNNNNN checkpoint, a run directory, or a Hugging Face model directory")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0: greedy (default 0.8)")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling threshold in (0, 1] (default 0.95)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling: the same seed, the same text")
    add_model_options(parser)
    parser.set_defaults(run=run_generate)


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """--device and --dtype, shared by generate and eval."""
    from clustertrain.inference import DTYPES

    parser.add_argument("--device", default="auto",
                        help="auto (a GPU when torch sees one, else the CPU), cpu, cuda or cuda:N (default auto)")
    parser.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                        help="weights and compute: auto is bf16 on a GPU, fp32 on the CPU (default auto)")


def load_model(args: argparse.Namespace, source):
    """The model and tokenizer of `source` on --device in --dtype."""
    from clustertrain.inference import inference_device, inference_dtype, load_for_inference

    device = inference_device(args.device)
    return load_for_inference(source, device, inference_dtype(args.dtype, device))


def run_generate(args: argparse.Namespace) -> int:
    from clustertrain.errors import UserError

    if args.max_tokens < 1:
        raise UserError(f"--max-tokens {args.max_tokens}: must be at least 1")
    if args.temperature < 0:
        raise UserError(f"--temperature {args.temperature}: must be 0 (greedy) or more")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p {args.top_p}: must be in (0, 1]")
    quiet_transformers()

    from clustertrain.inference import complete

    model, tokenizer = load_model(args, args.source)
    [text] = complete(model, tokenizer, [args.prompt], max_new_tokens=args.max_tokens,
                      temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    print(text)
    return 0


def quiet_transformers() -> None:
    """No progress bars, generation advice or deprecation notes on the terminal: the output is the model's text."""
    import warnings

    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # e.g. peft calling a renamed transformers method
