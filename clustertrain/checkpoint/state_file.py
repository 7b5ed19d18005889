"""A model saved as one `torch.save` state dict (the training stub's `model_state_dict.pt`) as a Hugging Face snapshot.

    clustertrain config convert test_config_training.yaml -o run.yaml
    clustertrain import experiments/chkpts/dummy-0.1.2024-06-01 models/stub --config run.yaml

The file is read with `torch.load(weights_only=True)` only (`model.weights.read_pth`): tensors, never code. It holds no
model config, so the run config that trained it (or its conversion) gives the model; every tensor is checked
against that model by name and shape before anything is written. The prefixes that DDP (`module.`), FSDP
(`_fsdp_wrapped_module.`) and torch.compile (`_orig_mod.`) put before the model's own names are taken off.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from clustertrain.model.weights import read_pth
from clustertrain.errors import CheckpointError

STATE_FILE = "model_state_dict.pt"
_WRAPPERS = re.compile(r"(module\.|_fsdp_wrapped_module\.|_orig_mod\.|_checkpoint_wrapped_module\.)")


def import_state_file(source: str | Path, out_dir: str | Path, config_file: str | Path) -> Path:
    """Write `source` (a `model_state_dict.pt`, or the checkpoint folder holding one) as a Hugging Face snapshot of
    the model `config_file` (a clustertrain config) describes, with the config's tokenizer when it names one."""
    from huggingface_hub import save_torch_state_dict

    from clustertrain.checkpoint.compat import write_legacy_config, write_portable_tokenizer_class
    from clustertrain.checkpoint.export import publish_folder, refuse_non_empty
    from clustertrain.config.load import load_config
    from clustertrain.model.build import build_hf_config
    from clustertrain.model.spec import model_config_problems

    source, out_dir = Path(source), Path(out_dir)
    file = source / STATE_FILE if source.is_dir() else source
    if not file.is_file():
        raise CheckpointError(f"{source} has no {STATE_FILE}")
    config = load_config(Path(config_file), checks=(model_config_problems,))
    refuse_non_empty(out_dir)
    tokenizer = None
    if config.data.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(config.data.tokenizer, local_files_only=True,
                                                  trust_remote_code=False)
    hf_config = build_hf_config(config.model, tokenizer, config.model.config.get("vocab_size", config.data.vocab_size))
    state = {_WRAPPERS.sub("", name): tensor for name, tensor in read_pth(file).items()}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    check_fits(file, state, model)

    def write(folder: Path) -> None:
        save_torch_state_dict(state, folder)
        hf_config.architectures = [type(model).__name__]
        hf_config.save_pretrained(folder)
        write_legacy_config(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
            write_portable_tokenizer_class(folder)

    publish_folder(out_dir, write)
    return out_dir


def check_fits(file: Path, state: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """One line naming the first tensor the model lacks, that `file` lacks, or that differs in shape."""
    expected = model.state_dict()
    tied = {name for name, p in model.named_parameters(remove_duplicate=False)
            if model.config.tie_word_embeddings and p is model.get_output_embeddings().weight}
    for name, tensor in state.items():
        if name not in expected:
            raise CheckpointError(f"{file} holds {name}, which the config's {model.config.model_type} model does "
                                  "not have: is --config the run that saved it?")
        if tensor.shape != expected[name].shape:
            raise CheckpointError(f"{file}: {name} is {tuple(tensor.shape)} but {tuple(expected[name].shape)} in the "
                                  "config's model: is --config the run that saved it?")
    if missing := sorted(expected.keys() - state.keys() - tied):
        raise CheckpointError(f"{file} has no {missing[0]}, which the config's model has")
