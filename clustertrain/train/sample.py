"""The end-of-run sample: a prompt from the run's own data, continued through the training forward.

    ids = data_prompt(plan, tokenizer)        # or tokenizer(train.sample_prompt).input_ids
    text = tokenizer.decode(sample_ids(model, ids, 40, eos_id, device, autocast_dtype, together))
    text = sample_or_warn(lambda: sample_text(runner, ...), log, run_dir)   # what a run ends with
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from clustertrain.data.plan import DataPlan
from clustertrain.data.sft import render_example
from clustertrain.data.sources import text_of
from clustertrain.distributed.collectives import broadcast
from clustertrain.model.loss import full_logits
from clustertrain.parallel.apply import unwrap
from clustertrain.parallel.runner import Runner, autocast

PROMPT_TOKENS = 16  # of a document, when the prompt comes from the data


def data_prompt(plan: DataPlan, tokenizer) -> list[int]:
    """The first document of the held-out data (else of the training data) as prompt ids: an SFT example up to
    its response, or a document's first PROMPT_TOKENS tokens after the end-of-text token that precedes every
    document in training. The same on every rank."""
    plan, split = plan.for_split("eval" if plan.has_eval() else "train")
    eos = tokenizer.eos_token_id
    doc = next(plan.splits[0][split].read(0, len(plan.splits[0][split])), None) if plan.sources else None
    if doc is None:  # data.mode random: no documents
        return [eos]
    field = "text" if plan.sources[0].format in ("text", "stdlib") else plan.data.sources[0].field
    if plan.data.mode == "sft":
        example = render_example(doc.record, tokenizer, field=field, location=doc.location)
        mask = example.loss_mask
        return example.input_ids[:mask.index(True)] if any(mask) else example.input_ids[:PROMPT_TOKENS]
    if "ids" in doc.record:  # a token source
        return [eos, *map(int, doc.record["ids"][:PROMPT_TOKENS])]
    text = text_of(doc, field)[:40 * PROMPT_TOKENS]  # enough characters for the tokens
    return [eos, *tokenizer(text, add_special_tokens=False).input_ids[:PROMPT_TOKENS]]


@torch.no_grad()
def sample_ids(model: nn.Module, prompt: list[int], max_new_tokens: int, eos_id: int | None, device: torch.device,
               autocast_dtype: torch.dtype | None, together: bool) -> torch.Tensor:
    """`prompt` and up to `max_new_tokens` drawn after it (top-k 40, temperature 0.8, seed 0), as ids [1, n].

    `together`: every rank runs the same forwards (sharded or split weights), with rank 0's draw broadcast.
    """
    ids = torch.tensor([prompt], device=device)
    generator = torch.Generator(device).manual_seed(0)
    with autocast(device, autocast_dtype):
        for _ in range(max_new_tokens):
            logits = full_logits(model(input_ids=ids, use_cache=False).logits[:, -1]).float() / 0.8
            top = logits.topk(min(40, logits.shape[-1]))
            choice = top.indices.gather(-1, torch.multinomial(top.values.softmax(-1), 1, generator=generator))
            if together:
                choice = broadcast(choice).to(device)
            ids = torch.cat([ids, choice], dim=1)
            if choice.item() == eos_id:
                break
    return ids


@torch.no_grad()
def sample_text(runner: Runner, together: bool, rank0: bool, tokenizer, plan: DataPlan, prompt: str | None,
                max_new_tokens: int, device: torch.device) -> str:
    """A short sampled continuation of `prompt` (top-k 40, temperature 0.8), through the training forward;
    None: of the start of the run's own data (data_prompt).

    The model's own forward runs as in training, so every layout's hooks apply (FSDP's unsharding of the
    root's weights included, which HF's and peft's `generate` bypass). `together` (the weights are sharded or
    split): every rank takes part, and rank 0's draw is broadcast, so all ranks run the same forwards; else
    rank 0 samples alone from its full replica and the others return "".
    """
    if not (together or rank0):
        return ""
    model = runner.model if together else unwrap(runner.model)
    model.eval()
    start = tokenizer(prompt).input_ids if prompt is not None else data_prompt(plan, tokenizer)
    ids = sample_ids(model, start, max_new_tokens, tokenizer.eos_token_id, device, runner.autocast_dtype, together)
    model.train()
    return tokenizer.decode(ids[0], skip_special_tokens=True)


def sample_or_warn(sample: Callable[[], str], log: Callable[[str], None], run_dir: Path) -> str | None:
    """`sample()`, or None and one warning line if it fails: never a failed run (its checkpoint is saved)."""
    try:
        return sample()
    except Exception as e:  # noqa: BLE001 - the run's result is its checkpoint, already complete
        log(f"warning: the end-of-run sample failed ({type(e).__name__}: {str(e)[:200]}); the checkpoint is "
            f"complete, and `clustertrain generate {run_dir}` samples from it")
        return None


def end_of_run_sample(runner: Runner, together: bool, rank0: bool, tokenizer, plan: DataPlan, prompt: str | None,
                      max_new_tokens: int, finished: bool, device: torch.device, log: Callable[[str], None],
                      run_dir: Path) -> str | None:
    """What a run ends with when `train.sample_tokens` (`max_new_tokens`) asks for a sample: one, if it
    `finished` its budget and has a tokenizer; under pipelines a line saying where to sample instead."""
    if not max_new_tokens:
        return None
    if runner.model is None:
        log(f"train.sample_tokens: no end-of-run sample under parallel.pp > 1; `clustertrain generate {run_dir}` "
            "samples from the checkpoint")
        return None
    if not finished or tokenizer is None:
        return None
    return sample_or_warn(lambda: sample_text(runner, together, rank0, tokenizer, plan, prompt, max_new_tokens,
                                              device), log, run_dir)
