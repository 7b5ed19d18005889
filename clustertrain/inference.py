"""Load a trained model for generation in one process, on a GPU or the CPU, and complete prompts in batches.

    model, tokenizer = load_for_inference("runs/tiny-llama")          # newest checkpoint of a run
    model, tokenizer = load_for_inference("exports/tiny-llama")        # `clustertrain export` output
    model, tokenizer = load_for_inference("exports/adapter")           # a LoRA adapter on its base model
    device = inference_device("auto")                                  # a GPU when torch sees one
    model, tokenizer = load_for_inference("exports/x", device, inference_dtype("auto", device))  # bf16 there
    complete(model, tokenizer, ["reverse: a b c ="], max_new_tokens=8) # greedy: [" c b a"]
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clustertrain.errors import CheckpointError, UserError, first_line

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# torch and transformers are imported where used, so that a wrong path fails in a blink, not after imports.


def resolve_source(source: str | Path) -> Path:
    """The folder a source loads from: an HF model or adapter directory as is, a checkpoint folder, or the
    newest complete checkpoint of a run directory.

    Raises:
        UserError: the source does not exist or holds no complete checkpoint.
    """
    source = Path(source)
    if not source.exists():
        raise UserError(f"{source} does not exist (give a checkpoint, a run directory or an exported model)")
    if _is_hf_dir(source):
        return source
    from clustertrain.checkpoint.export import resolve_checkpoint

    return resolve_checkpoint(source)


def inference_device(name: str) -> torch.device:
    """`--device`: auto (the first GPU when torch sees one; ROCm builds report as cuda), cpu, cuda or cuda:N.

    Raises:
        UserError: a GPU is asked for and torch sees none, or not that many.
    """
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name}: not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise UserError(f"--device {name}: use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise UserError(f"--device {name}: this torch build sees no GPU; use --device cpu (or auto)")
    if (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"--device {name}: torch sees {torch.cuda.device_count()} GPU(s), numbered from 0")
    return device


def inference_dtype(name: str, device: torch.device) -> torch.dtype:
    """`--dtype`: bf16, fp16 or fp32; auto is bf16 on a GPU (half the memory of fp32) and fp32 on the CPU."""
    import torch

    if name == "auto":
        name = "bf16" if device.type == "cuda" else "fp32"
    return getattr(torch, DTYPES[name])


def load_for_inference(source: str | Path, device: torch.device | str = "cpu",
                       dtype: torch.dtype | None = None) -> tuple[PreTrainedModel, Any]:
    """The model (in eval mode, on `device`, in `dtype`, fp32 by default) and tokenizer of a checkpoint folder, a
    run directory, an HF model directory, or a LoRA adapter directory (`adapter_config.json`, loaded on its
    `base_model_name_or_path`).

    An HF directory is read in `dtype`; a checkpoint is assembled in fp32 on the CPU, then cast and moved.

    Raises:
        UserError: the source does not exist, cannot be loaded, or has no tokenizer.
    """
    import torch

    dtype = dtype or torch.float32
    path = resolve_source(source)
    if _is_hf_dir(path):
        model, tokenizer = _load_hf_dir(path, dtype)
    else:
        from clustertrain.checkpoint.export import load_checkpoint_model

        model, tokenizer, _ = load_checkpoint_model(path)
    if tokenizer is None:
        raise CheckpointError(f"{path} has no tokenizer, so prompts cannot be encoded")
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() or (path / "adapter_config.json").is_file()


def _load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, Any]:
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clustertrain.config.remote_code import custom_code
    from clustertrain.model.weights import refusal

    adapter = not (path / "config.json").is_file()
    if adapter:
        from clustertrain.model.download import check_adapter_base

        check_adapter_base(path)
    if problem := custom_code(path):
        raise CheckpointError(problem)
    try:
        if adapter:
            from peft import AutoPeftModelForCausalLM

            model = AutoPeftModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                             trust_remote_code=False)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                         trust_remote_code=False)
    except pickle.UnpicklingError as e:  # transformers loads .bin weights with weights_only=True
        raise CheckpointError(f"{path} holds code or non-tensor objects ({refusal(e)}) and was not loaded") from None
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        raise CheckpointError(f"{path}: cannot load a causal LM: {first_line(e)}") from None
    tokenizer_dir = path
    if adapter and not _has_tokenizer(path):  # then its base model has it
        tokenizer_dir = model.peft_config["default"].base_model_name_or_path  # checked by check_adapter_base
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot load its tokenizer: {first_line(e)}") from None
    return model, tokenizer


def _has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """The prompt's ids as SFT training saw them (`clustertrain.data.sft`): BOS if the tokenizer adds one, then
    the prompt without special tokens, so that generation continues where a trained completion would start."""
    from clustertrain.data.sft import adds_bos

    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return [tokenizer.bos_token_id, *ids] if adds_bos(tokenizer) else ids


def complete(model: PreTrainedModel, tokenizer, prompts: list[str], *, max_new_tokens: int = 32,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             batch_size: int = 64) -> list[str]:
    """Each prompt's completion (text after the prompt, up to EOS), decoded without special tokens.

    Args:
        temperature: 0 decodes greedily (deterministic); above 0 samples at this temperature.
        top_p: with sampling, draw only from the smallest set of tokens whose probability reaches top_p.
        seed: seeds the sampling; the same seed gives the same text.
        batch_size: prompts per forward; shorter prompts are padded on the left.
    """
    import torch

    eos = tokenizer.eos_token_id
    pad = next((t for t in (tokenizer.pad_token_id, eos, 0) if t is not None))
    # An empty prompt starts after a document boundary, as every document does in pretraining.
    start_id = next((t for t in (tokenizer.bos_token_id, eos, pad) if t is not None))
    if temperature > 0:
        options = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    else:
        options = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    texts: list[str] = []
    gpus = [model.device.index or 0] if model.device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=gpus):  # the caller's random state is left as it was
        torch.manual_seed(seed)
        for start in range(0, len(prompts), batch_size):
            encoded = [encode_prompt(tokenizer, p) or [start_id] for p in prompts[start : start + batch_size]]
            width = max(len(ids) for ids in encoded)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded], device=model.device)
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded], device=model.device)
            out = model.generate(
                input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad,
                eos_token_id=eos, **options,
            )
            for row in out[:, width:].tolist():
                if eos in row:
                    row = row[: row.index(eos)]
                texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts


def exact_match(model: PreTrainedModel, tokenizer, records: list[dict], *, max_new_tokens: int | None = None,
                batch_size: int = 64) -> dict[str, Any]:
    """Greedy-decode each record's prompt and compare with its completion (exact match after strip).

    Args:
        records: `{"prompt", "completion"}` dicts, e.g. from `clustertrain.data.synthetic.read_task`.
        max_new_tokens: default: the longest expected completion in tokens, plus one for EOS.

    Returns:
        {"n", "correct", "accuracy", "max_new_tokens", "examples": [{"prompt", "expected", "answer", "correct"}]}.
    """
    from clustertrain.data.synthetic import is_correct

    if max_new_tokens is None:
        longest = max(len(tokenizer.encode(r["completion"], add_special_tokens=False)) for r in records)
        max_new_tokens = longest + 1
    answers = complete(model, tokenizer, [r["prompt"] for r in records], max_new_tokens=max_new_tokens,
                       batch_size=batch_size)
    examples = [
        {"prompt": r["prompt"], "expected": r["completion"], "answer": a, "correct": is_correct(a, r["completion"])}
        for r, a in zip(records, answers)
    ]
    correct = sum(e["correct"] for e in examples)
    return {"n": len(examples), "correct": correct, "accuracy": correct / len(examples),
            "max_new_tokens": max_new_tokens, "examples": examples}


