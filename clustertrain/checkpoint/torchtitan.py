"""torchtitan's Llama checkpoints (DCP folders such as `outputs/checkpoint/step-1000`) in clustertrain.

    clustertrain import outputs/checkpoint/step-1000 models/titan-1000 --params /scratch/Llama-3.1-8B/original
    clustertrain export --format meta models/titan-1000 exports/titan-1000-pth        # back to consolidated.00.pth

torchtitan names its Llama weights as Meta does (`tok_embeddings.weight`, `layers.N.attention.wq.weight`, ...,
`output.weight`), at the top of the DCP state dict (its model-only and full saves) or under `model.` (its older
releases and the scripts that convert Meta's checkpoints to DCP); optimizer, data loader and scheduler state
beside them are left alone. A DCP folder does not record the model's shape, so its params.json comes from the
Meta checkpoint it started from. Reading goes through clustertrain's safe DCP reader: no code runs from the files.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from clustertrain.checkpoint.meta import PARAMS, find_tokenizer, read_params, write_snapshot
from clustertrain.checkpoint.reader import DamagedCheckpoint, load_state, read_metadata
from clustertrain.errors import CheckpointError

_WEIGHT = re.compile(r"(tok_embeddings|norm|output|layers\.\d+\.(attention\.w[qkvo]|feed_forward\.w[123]|"
                     r"attention_norm|ffn_norm))\.weight")


def read_torchtitan(folder: Path) -> dict[str, torch.Tensor]:
    """The Llama weights of a torchtitan DCP folder by Meta's names, as stored (usually fp32)."""
    try:
        metadata = read_metadata(folder)
    except DamagedCheckpoint as e:
        raise CheckpointError(str(e)) from None
    keys = {}
    for key, item in metadata.state_dict_metadata.items():
        name = key.removeprefix("model.")
        if isinstance(item, TensorStorageMetadata) and _WEIGHT.fullmatch(name):
            keys[name] = key
    if not keys:
        raise CheckpointError(f"{folder} holds no torchtitan Llama weights (tok_embeddings.weight, "
                              "layers.N.attention.wq.weight, ...)")
    saved = metadata.state_dict_metadata
    state = {key: torch.empty(tuple(saved[key].size), dtype=saved[key].properties.dtype) for key in keys.values()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        load_state(state, folder, metadata)
    return {name: state[key] for name, key in keys.items()}


def params_file(given: Path | None, folder: Path) -> Path:
    """--params (params.json, or the folder that holds it), else one beside the checkpoint; one line if none."""
    if given is None and (folder / PARAMS).is_file():
        return folder / PARAMS
    if given is None:
        raise CheckpointError(f"{folder} is a torchtitan checkpoint, which does not record the model's shape: pass "
                              "--params with the params.json of the Llama it was trained from (Meta's original/)")
    return given / PARAMS if given.is_dir() else given


def import_torchtitan(folder: str | Path, out_dir: str | Path, params: str | Path | None = None,
                      tokenizer: str | Path | None = None) -> Path:
    """Write a torchtitan Llama checkpoint as a Hugging Face snapshot (as `import_meta` does a Meta one).

    Args:
        params: Meta's params.json of the model (or its folder; its tokenizer.model is taken too).
        tokenizer: a tiktoken file or Hugging Face tokenizer folder, instead of the one beside params.json.
    """
    from clustertrain.checkpoint.export import publish_folder, refuse_non_empty

    folder, out_dir = Path(folder), Path(out_dir)
    file = params_file(Path(params) if params else None, folder)
    shape = read_params(file)
    refuse_non_empty(out_dir)
    state = read_torchtitan(folder)
    found = find_tokenizer(Path(tokenizer) if tokenizer else None, file.parent, shape.use_scaled_rope)
    publish_folder(out_dir, lambda out: write_snapshot(state, shape, found, out, folder))
    return out_dir
